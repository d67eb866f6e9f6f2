"""AdamW with the warmup–stable–decay schedule of SPEC §4 (the step budget: `summary.budget`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P


def wsd(peak: float, final: float, warmup: int, total: int, decay_fraction: float):
    """Warmup–stable–decay: linear warmup reaching `peak` at step warmup-1, constant, then
    linear decay over the last `decay_fraction` of steps reaching `final` at step total-1."""
    decay_steps = max(1, round(decay_fraction * total))
    decay_start = total - decay_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
        frac = jnp.clip((step - decay_start) / max(decay_steps - 1, 1), 0.0, 1.0)
        decayed = peak + (final - peak) * frac
        return jnp.where(step < decay_start, warm, jnp.minimum(warm, decayed))

    return schedule


def decay_mask(logical_axes) -> dict:
    """True where weight decay applies: matrices. Vectors (norm weights, the gate) are exempt;
    a leading `layers` axis (scan) does not count as a dimension."""
    return jax.tree.map(
        lambda spec: len([a for a in spec if a != "layers"]) >= 2,
        logical_axes,
        is_leaf=lambda x: isinstance(x, P),
    )


def schedule(cfg, steps: int):
    """The run's learning-rate schedule over `steps` optimizer steps (0-based counts)."""
    t = cfg.train
    return wsd(t.lr, t.final_lr, t.warmup_steps, steps, t.decay_fraction)


def first_changed_step(a, b, steps: int) -> int | None:
    """The first optimizer step of 0..steps-1 whose learning rate differs between schedules
    `a` and `b` (evaluated, not derived from their formula), or None: a run that has taken
    `steps` steps under `a` may go on under `b` exactly when this is None."""
    counts = jnp.arange(steps)
    changed = np.flatnonzero(np.asarray(a(counts)) != np.asarray(b(counts)))
    return int(changed[0]) if changed.size else None


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the gradients by min(1, max_norm / ‖g‖), one multiply per entry (PyTorch's
    `clip_grad_norm_` form, without its +1e-6).

    optax.clip_by_global_norm computes `select(‖g‖ < max_norm, g, g / ‖g‖ · max_norm)`. XLA counts
    an elementwise divide as expensive, so it computes that quotient once into a buffer of
    its own for the two moment updates: an extra read and write of every gradient a step
    (`benchmarks/peer.py --what=parts`; figures in docs/performance.md). A scalar factor fuses
    into both. Unclipped gradients are unchanged (× 1.0); clipped ones differ from optax's in
    the last bit. Its state is optax's (EmptyState), so the optimizer state and checkpoints
    keep their structure."""

    def update(updates, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / optax.global_norm(updates))  # ‖g‖ = 0: max/0 = inf → 1
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg, steps: int, logical_axes) -> tuple[optax.GradientTransformation, callable]:
    t = cfg.train
    lr = schedule(cfg, steps)
    mask = decay_mask(logical_axes) if not t.decay_vectors else None
    # grad_clip 0 = no clipping (a max norm of 0 would zero every update). Both have an empty
    # state, so the optimizer state has one structure either way.
    clip = clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    tx = optax.chain(
        clip,
        optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=mask),
    )
    return tx, lr
