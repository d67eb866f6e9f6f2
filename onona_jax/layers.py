"""The layers every decoder family shares (SPEC §3): RMSNorm, RoPE, grouped-query attention
with QK-norm and a decoding cache, the SwiGLU MLP, and the remat policies.

Pure functions for the math, thin modules around them. Parameters are declared with logical
axis names (`params.param`); activations are pinned with `sharding.constrain`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from onona_jax.attention import OUTPUT as ATTENTION_OUT, QKV, causal_attention
from onona_jax.params import param
from onona_jax.sharding import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# The MoE's expert weights after their FSDP gather (models/moe.py names them).
EXPERT_WEIGHTS = "expert_weights"

# model.remat: what the backward pass keeps of each layer's forward (the rest is recomputed).
REMAT_POLICIES = {
    "none": None,  # everything: no recompute
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # every projection's output
    # q, k, v and the attention output: the attention kernel is never rerun, the MLP and the
    # norms are (MaxText's "qkv_proj" + "context" choice)
    "attention": jax.checkpoint_policies.save_only_these_names(QKV, ATTENTION_OUT),
    # the same, plus MoE's gathered expert weights: the backward pass reuses the forward's
    # FSDP gather instead of repeating it (one gather of the experts per step, not two), for
    # their compute-dtype size in HBM per chip; the same as `attention` for the other families
    "attention_experts": jax.checkpoint_policies.save_only_these_names(QKV, ATTENTION_OUT, EXPERT_WEIGHTS),
    # the same arrays, moved to pinned host memory between the passes (on a CPU it runs, saving nothing)
    "attention_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[QKV, ATTENTION_OUT],
        offload_src="device", offload_dst="pinned_host"),
}


def checkpointed(fn, remat: str):
    """`fn` under the `model.remat` policy (none: unchanged)."""
    return fn if remat == "none" else jax.checkpoint(fn, policy=REMAT_POLICIES[remat])


# ----------------------------------------------------------------------------- pure math


def rms_norm(x, weight, eps):
    """RMSNorm in fp32, cast back to the input dtype (as HF Qwen3RMSNorm)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x.astype(dtype)


def rope(x, positions, theta):
    """Rotary embedding, non-interleaved (rotate_half). x: [B, T, N, D], positions: [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@jax.custom_vjp
def swiglu_mlp(x, w_gate, w_up, w_down):
    """The SwiGLU feed-forward down(silu(x·gate) ⊙ (x·up)); x [..., d] → [..., d].

    Its backward pass is written out: it keeps x, g = x·gate and u = x·up, where autodiff of
    silu keeps four [tokens, d_ff] arrays, and it forms the weight gradients as plain
    x-contractions. Same values and gradients as autodiff (fp32: ~1e-6 relative); faster on
    XLA:CPU (docs/notes/performance-log.md, "Later changes")."""
    return _swiglu_fwd(x, w_gate, w_up, w_down)[0]


def _swiglu_fwd(x, w_gate, w_up, w_down):
    g = constrain(x @ w_gate, ("batch", "seq", "act_mlp"))
    u = constrain(x @ w_up, ("batch", "seq", "act_mlp"))
    hid = constrain(jax.nn.silu(g) * u, ("batch", "seq", "act_mlp"))
    return hid @ w_down, (x, w_gate, w_up, w_down, g, u)


def _swiglu_bwd(res, dy):
    x, w_gate, w_up, w_down, g, u = res
    dt = x.dtype
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    sg = jax.nn.sigmoid(g32)
    hid = (g32 * sg * u32).astype(dt)
    dhid = (dy @ w_down.T).astype(jnp.float32)
    dg = (dhid * u32 * sg * (1.0 + g32 * (1.0 - sg))).astype(dt)  # d silu(g)/dg = σ(g)(1 + g(1 − σ(g)))
    du = (dhid * g32 * sg).astype(dt)
    return (
        dg @ w_gate.T + du @ w_up.T,
        jnp.einsum("...d,...f->df", x, dg),
        jnp.einsum("...d,...f->df", x, du),
        # (dyᵀ·hid)ᵀ, not hidᵀ·dy: the latter makes XLA:CPU fuse the recompute of hid into a
        # strided transposing write (docs/notes/performance-log.md, "Later changes (2026-12-02)").
        jnp.einsum("...d,...f->df", dy, hid).T,
    )


swiglu_mlp.defvjp(_swiglu_fwd, _swiglu_bwd)


def cached_attention(q, k, v, length, start):
    """Incremental decoding: T new queries at cache slots length..length+T−1 attend over a
    K/V cache [B, S, n_kv, hd] (slots ≥ length+T unwritten). Key slot j is visible to query
    slot i when start_b ≤ j ≤ i: causal, and not one of row b's `start` [B] left pads.
    Grouped heads as `jax.nn.dot_product_attention` (query head n reads KV head n // (N/K));
    logits and softmax in fp32, scale head_dim^-½. A query with no visible key (a pad) gets
    a uniform average of the slots, never NaN. Returns [B, T, N, hd] in v's dtype."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k, preferred_element_type=jnp.float32
    )
    logits = logits * jnp.float32(1.0 / math.sqrt(H))
    q_slot = length + jnp.arange(T)
    k_slot = jnp.arange(S)
    visible = (k_slot[None, None, :] <= q_slot[None, :, None]) & (k_slot[None, None, :] >= start[:, None, None])
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, N, H)


def zeros_stacked(cache, count: int):
    """A zero cache with a leading `layers` axis of `count` (a scanned, stacked layer)."""
    return jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), cache)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps, axis="norm", stack=None):
        self.weight = param((dim,), (axis,), "ones", stack=stack)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query attention with QK-norm (one weight of size head_dim shared by heads)."""

    def __init__(self, cfg, stack=None):
        d, n, k, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = param((d, n, hd), ("embed", "heads", "head_dim"), stack=stack)
        self.k = param((d, k, hd), ("embed", "kv_heads", "head_dim"), stack=stack)
        self.v = param((d, k, hd), ("embed", "kv_heads", "head_dim"), stack=stack)
        self.o = param((n, hd, d), ("heads", "head_dim", "embed"), stack=stack)
        self.q_norm = RMSNorm(hd, cfg.norm_eps, "head_dim", stack=stack)
        self.k_norm = RMSNorm(hd, cfg.norm_eps, "head_dim", stack=stack)
        self.theta, self.impl = cfg.rope_theta, cfg.attention_impl

    def _qkv(self, x, positions):
        """Projections, QK-norm and RoPE: q [B, T, n, hd], k and v [B, T, n_kv, hd]."""
        dt = x.dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))
        return rope(self.q_norm(q), positions, self.theta), rope(self.k_norm(k), positions, self.theta), v

    def __call__(self, x, positions, segments=None):
        """`segments` [B, T]: a query sees only keys of its own document (onona_jax/packing.py)."""
        dt = x.dtype
        q, k, v = self._qkv(x, positions)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        q, k, v = (checkpoint_name(a, QKV) for a in (q, k, v))
        o = checkpoint_name(causal_attention(q, k, v, self.impl, segments), ATTENTION_OUT)
        return jnp.einsum("btnh,nhd->btd", o, self.o[...].astype(dt))

    # -- incremental decoding (see Model.extend)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """Empty K/V buffers [batch, max_len, n_kv, head_dim] in the compute dtype."""
        kv, hd = self.k[...].shape[-2:]
        zeros = jnp.zeros((batch, max_len, kv, hd), dtype)
        return {"k": zeros, "v": zeros}

    def extend(self, x, positions, cache, length, start):
        """`__call__` for T new tokens x [B, T, d] written at cache slots length..length+T−1,
        attending over the cache (`cached_attention`). Returns (y [B, T, d], cache)."""
        dt = x.dtype
        q, k, v = self._qkv(x, positions)
        k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), length, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), length, axis=1)
        o = cached_attention(q, k, v, length, start)
        return jnp.einsum("btnh,nhd->btd", o.astype(dt), self.o[...].astype(dt)), {"k": k, "v": v}


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg, stack=None):
        d, f = cfg.d_model, cfg.d_ff
        self.gate = param((d, f), ("embed", "mlp"), stack=stack)
        self.up = param((d, f), ("embed", "mlp"), stack=stack)
        self.down = param((f, d), ("mlp", "embed"), stack=stack)

    def __call__(self, x):
        dt = x.dtype
        return swiglu_mlp(x, self.gate[...].astype(dt), self.up[...].astype(dt), self.down[...].astype(dt))

