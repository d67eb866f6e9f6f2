"""Mixture-of-experts feed-forward (SPEC §3): top-k routing with expert capacity.

    logits = x Wr (fp32)        p = softmax(logits) over all E experts (fp32)
    (w, e) = top_k(p)           w /= Σw if moe.renormalize
    y_t    = Σ_j w_tj · SwiGLU_{e_tj}(x_t)   for the assignments that fit in capacity

Capacity. The capacity group is ONE SEQUENCE (a row of the batch): each expert takes at
most C = min(ceil(capacity_factor · T · top_k / E), T) assignments per row of T tokens.
Per-row groups keep routing independent of the micro-batch size, the data-parallel split
and the evaluation batch (a window's output never depends on its neighbours), and the
bookkeeping never crosses the batch axis, so it needs no communication when the batch is
sharded. An expert can receive at most T assignments from T tokens (a token's k choices
are distinct experts), hence the cap at T, and capacity_factor ≥ E/top_k (4.0 for 8
experts, top-2: the evaluation factor) drops nothing, which is HF Qwen3-MoE's behaviour.

Priority (GShard / Switch): all first choices before any second choice, and within one
choice rank the earlier token first; i.e. assignments are ranked by (choice j, position t)
and expert e keeps its first C. A dropped assignment contributes zero, so a token that
loses all k choices gets y = 0 and passes through the residual unchanged.

Dropless (capacity_factor = 0): C = T, every assignment kept, as HF Qwen3-MoE and MaxText's
default; the grouped dispatch then computes exactly the routed work.

Three dispatch implementations keeping the same assignments (`moe.dispatch`, equal to
fp32 rounding): 'grouped' (the kept assignments sorted by expert through grouped matmuls,
`jax.lax.ragged_dot`: no FLOP on an empty slot; with mesh.expert > 1, all-to-all to the
experts' devices inside one shard_map), 'dense' (one-hot dispatch/combine tensors and
einsums, GShard) and 'sort' (assignments stably sorted by expert, gathered into [E, C, d]
buffers, gathered back). 'auto' (the default) is grouped on TPU/GPU and under expert
parallelism, sort on CPU (`resolve_dispatch`).

Statistics. `MoE.__call__` returns (y, aux); the trunk sums aux over layers, and
`load_balancing_loss(aux, E, k)` then reproduces HF
`qwen3_moe.load_balancing_loss_func` on all layers' router logits (pooled over layers and
tokens); `router_stats(aux)` gives drop fraction and expert load.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from onona_jax.layers import EXPERT_WEIGHTS
from onona_jax.models import hf_map
from onona_jax.params import ParamGroup, param
from onona_jax import sharding
from onona_jax.sharding import constrain

AUX_KEYS = ("moe_assign", "moe_prob", "moe_tokens", "moe_dropped", "moe_layers")


# The MoE's parameters under the residual trunk's `moe` attribute, for the summary: the router
# is used by every token, each expert matrix by top_k/E of them (the model's work, not the
# capacity slots a dispatch computes), which the active parameter count and FLOPs follow.
COMPONENTS = (
    ParamGroup("moe", ("trunk/layers/moe/router",)),
    ParamGroup("moe", tuple(f"trunk/layers/moe/{n}" for n in ("gate", "up", "down")),
               used=lambda m: Fraction(m.moe.top_k, m.moe.n_experts)),
)


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Expert capacity C for a group of `tokens` tokens (see the module docstring);
    capacity_factor 0 is dropless: C = tokens, all an expert can receive."""
    if capacity_factor == 0:
        return tokens
    return int(min(math.ceil(capacity_factor * tokens * top_k / n_experts), tokens))


def eval_config(cfg_model):
    """A copy of the model config whose MoE capacity factor is the evaluation one (4.0):
    build the evaluation model from it (the factor is read when the MoE is constructed)."""
    c = cfg_model.copy_and_resolve_references()
    c.moe.capacity_factor = c.moe.eval_capacity_factor
    return c


def config_problems(cfg_model) -> list[str]:
    """What is wrong with the model config's moe keys, each naming the key and the fix."""
    mo = cfg_model.moe
    out = []
    if mo.n_experts < 1:
        out.append(f"model.moe.n_experts={mo.n_experts} must be at least 1")
    if not 0 < mo.top_k <= mo.n_experts:
        out.append(f"model.moe.top_k={mo.top_k} must be in 1..n_experts ({mo.n_experts})")
    if mo.d_expert < 1:
        out.append(f"model.moe.d_expert={mo.d_expert} must be positive (each expert's FFN width)")
    for key in ("capacity_factor", "eval_capacity_factor"):
        if not mo[key] >= 0:
            out.append(f"model.moe.{key}={mo[key]} must be positive (an expert's slots per token routed to it "
                       "on average; 1.25 in training, 4.0 in evaluation by default) or 0 (dropless)")
    if not mo.aux_coef >= 0:
        out.append(f"model.moe.aux_coef={mo.aux_coef} must be zero (no load-balancing loss) or positive")
    if mo.dispatch not in ("auto", *DISPATCH):
        out.append(f"model.moe.dispatch {mo.dispatch!r}: one of auto, {', '.join(DISPATCH)}")
    return out


# ----------------------------------------------------------------------------- Hugging Face
# Qwen3-MoE's names: `mlp.gate.weight` [E, d] the router, fused experts
# `mlp.experts.gate_up_proj` [E, 2f, d] (gate rows first) and `mlp.experts.down_proj` [E, d, f].


def to_hf(e: dict, cfg_model) -> dict[str, np.ndarray]:
    """One layer's experts (`moe` sub-tree, unstacked numpy) -> Qwen3-MoE's tensors."""
    return {"mlp.gate.weight": e["router"].T,
            "mlp.experts.gate_up_proj": np.concatenate([np.swapaxes(e["gate"], 1, 2), np.swapaxes(e["up"], 1, 2)],
                                                       axis=1),
            "mlp.experts.down_proj": np.swapaxes(e["down"], 1, 2)}


def from_hf(sd: dict, cfg_model) -> dict[str, np.ndarray]:
    """The inverse of `to_hf`; also reads per-expert checkpoints (transformers 4.x names)."""
    E, f = cfg_model.moe.n_experts, cfg_model.moe.d_expert
    if "mlp.experts.gate_up_proj" in sd:
        gate_up, down = sd["mlp.experts.gate_up_proj"], sd["mlp.experts.down_proj"]
    else:
        gate_up = np.stack([np.concatenate([sd[f"mlp.experts.{i}.gate_proj.weight"],
                                            sd[f"mlp.experts.{i}.up_proj.weight"]]) for i in range(E)])
        down = np.stack([sd[f"mlp.experts.{i}.down_proj.weight"] for i in range(E)])
    return {"router": sd["mlp.gate.weight"].T, "gate": np.swapaxes(gate_up[:, :f], 1, 2),
            "up": np.swapaxes(gate_up[:, f:], 1, 2), "down": np.swapaxes(down, 1, 2)}


def hf_config(cfg_model) -> dict:
    """model.moe's keys as Qwen3-MoE names them (top-k of a softmax over all experts)."""
    mo = cfg_model.moe
    return dict(num_experts=int(mo.n_experts), num_experts_per_tok=int(mo.top_k),
                moe_intermediate_size=int(mo.d_expert), norm_topk_prob=bool(mo.renormalize))


def config_from_hf(hf: dict, cfg_model) -> None:
    """model.moe's keys from a config.json (the inverse of `hf_config`)."""
    cfg_model.moe.update(n_experts=int(hf["num_experts"]), top_k=int(hf["num_experts_per_tok"]),
                         d_expert=int(hf["moe_intermediate_size"]), renormalize=bool(hf.get("norm_topk_prob", False)))


def _plain_problems(hf: dict) -> list[str]:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        return ["dense layers between MoE layers (mlp_only_layers / decoder_sparse_step)"]
    return []


HF_LAYER = {"moe": hf_map.Part(to_hf, from_hf)}
HF_PLAIN = hf_map.Plain(
    "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", problems=_plain_problems,
    fields=lambda m: dict(hf_config(m), decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                          router_aux_loss_coef=float(m.moe.aux_coef)))


def mesh_problems(cfg_model, mesh) -> list[str]:
    """What is wrong with the mesh for this model's experts."""
    if mesh.expert == 1 or cfg_model.moe.dispatch in ("auto", "grouped"):
        return []
    return [f"mesh.expert={mesh.expert} with model.moe.dispatch={cfg_model.moe.dispatch!r}: only the grouped "
            "dispatch sends tokens to experts on other devices; use model.moe.dispatch=grouped (or auto)"]


def resolve_dispatch(name: str) -> str:
    """The dispatch `name` means under the active mesh: `auto` is grouped on TPU and GPU
    (native grouped matmuls) and under expert parallelism, sort on CPU (whose ragged_dot
    computes every group densely, several times slower: benchmarks/bench.py --what=moe,
    docs/notes/scaling-log.md). Only grouped moves
    tokens to experts on other devices: sort or dense with mesh.expert > 1 is an error."""
    ep = expert_parallelism()
    if name == "auto":
        return "grouped" if ep > 1 or sharding.platform() != "cpu" else "sort"
    if ep > 1 and name != "grouped":
        raise ValueError(f"model.moe.dispatch={name!r} cannot run with mesh.expert={ep}: only the grouped "
                         "dispatch sends tokens to experts on other devices; use model.moe.dispatch=grouped "
                         "(or auto), or mesh.expert=1")
    return name


def expert_parallelism() -> int:
    """How many ways the active mesh splits the experts (1 outside a mesh)."""
    active = sharding.active()
    if active is None:
        return 1
    mesh, rules = active
    axes = sharding.logical_to_mesh(jax.sharding.PartitionSpec("expert"), rules)[0]
    return 1 if axes is None else _mesh_size(mesh, axes)


def aux_loss(stats: dict, cfg_model):
    """(aux_coef × the load-balancing loss, the router metrics the step logs) from the trunk's
    layer-summed statistics."""
    E = cfg_model.moe.n_experts
    balance = load_balancing_loss(stats, E)
    router = router_stats(stats)
    metrics = dict(moe_aux_loss=balance, moe_drop_fraction=router["drop_fraction"],
                   moe_max_load=router["max_load"], moe_load=router["expert_load"])
    return cfg_model.moe.aux_coef * balance, metrics


# ----------------------------------------------------------------------------- routing


def route(x, router, top_k: int, renormalize: bool):
    """fp32 (logits [B,T,E], probs [B,T,E], top-k weights [B,T,k], top-k experts [B,T,k])."""
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = _top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, probs, weights, experts


def _top_k(probs, k: int):
    """top_k over the experts on each device's rows of the batch (a shard_map under a mesh):
    left to the partitioner, every row's router probabilities would be gathered onto every device."""
    fn = lambda p: tuple(jax.lax.top_k(p, k))  # noqa: E731
    active = sharding.active()
    if active is None or active[0].size == 1:
        return fn(probs)
    mesh, rules = active
    rows = sharding.logical_to_mesh(jax.sharding.PartitionSpec("batch", None, None), rules)
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows,), out_specs=(rows, rows))(probs)


def priority_positions(experts, n_experts: int):
    """Each assignment's slot in its expert's buffer under the (choice, token) priority.

    experts: [B, T, k] -> (ids [B, k·T] in priority order a = j·T + t, pos [B, k·T])."""
    B, T, k = experts.shape
    ids = jnp.swapaxes(experts, 1, 2).reshape(B, k * T)
    onehot = jax.nn.one_hot(ids, n_experts, dtype=jnp.int32)  # [B, kT, E]
    pos = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    return ids, pos


def swiglu_experts(xe, gate, up, down):
    """xe: [B, E, C, d] -> [B, E, C, d], expert e's SwiGLU on its buffer."""
    dt = xe.dtype
    g = jnp.einsum("becd,edf->becf", xe, gate.astype(dt))
    u = jnp.einsum("becd,edf->becf", xe, up.astype(dt))
    h = constrain(jax.nn.silu(g) * u, ("batch", None, None, "act_mlp"))
    return jnp.einsum("becf,efd->becd", h, down.astype(dt))


def dispatch_dense(x, weights, experts, C, gate, up, down):
    """GShard: one-hot dispatch [B,T,E,C] and combine (= dispatch · router weight)."""
    B, T, k = experts.shape
    E = gate.shape[0]
    ids, pos = priority_positions(experts, E)
    # Per (token, expert): slot + 1 if the token chose the expert, else 0; and its weight.
    # A token's k choices are distinct experts, so summing over the choices is exact.
    chose = jax.nn.one_hot(ids, E, dtype=jnp.int32).reshape(B, k, T, E)
    slot = jnp.sum(chose * (pos.reshape(B, k, T) + 1)[..., None], axis=1) - 1  # [B, T, E]
    w = jnp.einsum("bjte,btj->bte", chose.astype(weights.dtype), weights)
    # one_hot of −1 (not chosen) or of a slot ≥ C (over capacity: the drop) is all zeros.
    dispatch = jax.nn.one_hot(slot, C, dtype=x.dtype)  # [B, T, E, C]
    combine = dispatch * w[..., None].astype(x.dtype)
    xe = jnp.einsum("btec,btd->becd", dispatch, x)
    out = swiglu_experts(xe, gate, up, down)
    return jnp.einsum("btec,becd->btd", combine, out)


def dispatch_sort(x, weights, experts, C, gate, up, down):
    """Sort assignments by expert (stable, so priority order is kept within an expert),
    gather each expert's first C into [E, C, d], run the experts, gather the results back
    to their assignments and sum a token's k weighted outputs."""
    B, T, k = experts.shape
    E, d = gate.shape[0], x.shape[-1]
    ids = jnp.swapaxes(experts, 1, 2).reshape(B, k * T)  # a = j·T + t
    w = jnp.swapaxes(weights, 1, 2).reshape(B, k * T)
    order = jnp.argsort(ids, axis=1, stable=True)  # sorted rank -> assignment
    rank = jnp.argsort(order, axis=1)  # assignment -> sorted rank (inverse permutation)
    counts = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.int32), axis=1)  # [B, E]
    starts = jnp.cumsum(counts, axis=1) - counts
    # Buffer slot (e, c) holds sorted entry starts[e] + c when c < counts[e].
    c = jnp.arange(C)
    valid = c[None, None, :] < jnp.minimum(counts, C)[:, :, None]  # [B, E, C]
    src = jnp.clip(starts[:, :, None] + c, 0, k * T - 1).reshape(B, E * C)
    token = jnp.take_along_axis(order, src, axis=1) % T
    token = jnp.where(valid.reshape(B, E * C), token, T)  # T: a zero row (empty slot)
    x_pad = jnp.concatenate([x, jnp.zeros((B, 1, d), x.dtype)], axis=1)
    xe = jnp.take_along_axis(x_pad, token[..., None], axis=1).reshape(B, E, C, d)
    out = swiglu_experts(xe, gate, up, down).reshape(B, E * C, d)
    # Back: assignment a sits at slot ids·C + pos, pos = rank − starts[ids]; ≥ C: dropped.
    pos = rank - jnp.take_along_axis(starts, ids, axis=1)
    slot = jnp.where(pos < C, ids * C + pos, E * C)
    out_pad = jnp.concatenate([out, jnp.zeros((B, 1, d), out.dtype)], axis=1)
    ya = jnp.take_along_axis(out_pad, slot[..., None], axis=1) * w[..., None].astype(x.dtype)
    return jnp.sum(ya.reshape(B, k, T, d), axis=1)


def _swiglu_grouped(rows, sizes, gate, up, down, tensor_axis):
    """Grouped SwiGLU: `rows` [N, d] sorted by expert, the first sizes[e] of what is left
    belonging to expert e (rows past Σ sizes are padding and come out zero); one
    `ragged_dot` per weight, so no FLOP is spent on an empty capacity slot. f may be this
    device's tensor shard: the down projection's partial sums add over `tensor_axis`."""
    dt = rows.dtype
    g = jax.lax.ragged_dot(rows, gate.astype(dt), sizes)  # in the compute dtype, as the MLP's
    u = jax.lax.ragged_dot(rows, up.astype(dt), sizes)
    # fp32 partial sums: a tensor shard's share is added to the others' before rounding.
    out = jax.lax.ragged_dot(jax.nn.silu(g) * u, down.astype(dt), sizes, preferred_element_type=jnp.float32)
    if tensor_axis is not None:
        out = jax.lax.psum(out, tensor_axis)
    return out.astype(dt)


def _grouped_rows(rows, groups, n_groups, gate, up, down, tensor_axis):
    """Expert outputs for `rows` [N, d] whose expert is groups[N] (n_groups: not kept):
    sorted by expert, run grouped, put back in the rows' order (zero for the unkept)."""
    order = jnp.argsort(groups, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(groups, n_groups, dtype=jnp.int32), axis=0)  # one_hot(n_groups) = 0
    out = _swiglu_grouped(rows[order], sizes, gate, up, down, tensor_axis)
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def _grouped_local(x, weights, experts, C, gate, up, down, expert_axis=None, ep=1, tensor_axis=None):
    """One device's part of `dispatch_grouped`: x [B, T, d] its rows, gate/up/down its
    experts (all E, or E/ep under `expert_axis` of size ep) with f its tensor shard, d whole."""
    B, T, k = experts.shape
    d = x.shape[-1]
    E = gate.shape[0]  # experts on this device
    ids, pos = priority_positions(experts, E * ep)
    kept = pos < C  # [B, kT], a = j·T + t: the same assignments every dispatch keeps
    w = jnp.swapaxes(weights, 1, 2).reshape(B, k * T)
    if expert_axis is None:  # every expert here: group the kept assignments, no buffers
        token = (jnp.arange(B)[:, None] * T + jnp.arange(k * T)[None, :] % T).reshape(-1)
        groups = jnp.where(kept, ids, E).reshape(-1)
        out = _grouped_rows(x.reshape(B * T, d)[token], groups, E, gate, up, down, tensor_axis)
        ya = out.reshape(B, k * T, d) * w[..., None].astype(x.dtype)
        return jnp.sum(ya.reshape(B, k, T, d), axis=1)
    # Expert parallel: each row's kept assignments go to capacity buffers [B, E_all, C, d]
    # (the sort dispatch's layout), an all-to-all sends expert e's buffers to the device that
    # holds it, the experts run grouped over the slots that are filled, and a second
    # all-to-all brings the outputs back.
    xe, valid, slot = _capacity_buffers(x, ids, kept, pos, E * ep, C)
    xe = jax.lax.all_to_all(xe, expert_axis, 1, 0, tiled=True)  # [ep·B, E, C, d]: this device's experts
    valid = jax.lax.all_to_all(valid, expert_axis, 1, 0, tiled=True)
    expert = jnp.broadcast_to(jnp.arange(E)[None, :, None], valid.shape)
    groups = jnp.where(valid, expert, E).reshape(-1)
    out = _grouped_rows(xe.reshape(-1, d), groups, E, gate, up, down, tensor_axis).reshape(xe.shape)
    out = jax.lax.all_to_all(out, expert_axis, 0, 1, tiled=True).reshape(B, E * ep * C, d)
    out_pad = jnp.concatenate([out, jnp.zeros((B, 1, d), out.dtype)], axis=1)
    ya = jnp.take_along_axis(out_pad, slot[..., None], axis=1) * w[..., None].astype(x.dtype)
    return jnp.sum(ya.reshape(B, k, T, d), axis=1)


def _capacity_buffers(x, ids, kept, pos, E, C):
    """(xe [B, E, C, d], valid [B, E, C], slot [B, kT]): assignment a of row b sits in slot
    (ids, pos) of its expert's buffer when kept; `slot` is its flat index ids·C + pos, or
    E·C (a zero row) when dropped."""
    B, T, d = x.shape
    kT = ids.shape[1]
    slot = jnp.where(kept, ids * C + pos, E * C)
    token = jnp.arange(kT) % T
    # Each kept slot is written once; the extra slot E·C takes the dropped and is cut off.
    src = jnp.full((B, E * C + 1), T, jnp.int32).at[jnp.arange(B)[:, None], slot].set(token[None, :])
    src = src[:, :-1]
    valid = (src < T).reshape(B, E, C)
    x_pad = jnp.concatenate([x, jnp.zeros((B, 1, d), x.dtype)], axis=1)
    xe = jnp.take_along_axis(x_pad, src[..., None], axis=1).reshape(B, E, C, d)
    return xe, valid, slot


def dispatch_grouped(x, weights, experts, C, gate, up, down):
    """Grouped matmuls (`jax.lax.ragged_dot`) over the kept assignments sorted by expert:
    the same assignments as the other dispatches are kept (per-row capacity, the same
    priority), but no FLOP goes to an empty slot. Under a mesh it runs as one `shard_map`:
    each device groups its own rows; with mesh.expert > 1 tokens reach the device holding
    their expert by all-to-all and come back, so expert weights are never gathered across
    the expert axis (only over fsdp, as FSDP gathers any weight)."""
    active = sharding.active()
    if active is None or active[0].size == 1:
        return _grouped_local(x, weights, experts, C, gate, up, down)
    mesh, rules = active
    P = jax.sharding.PartitionSpec
    spec = lambda *names: sharding.logical_to_mesh(P(*names), rules)  # noqa: E731
    w_in, w_out = spec("expert", "embed", "mlp"), spec("expert", "mlp", "embed")
    rows = spec("batch", None, None)
    ep = 1 if w_in[0] is None else _mesh_size(mesh, w_in[0])
    expert_axis = w_in[0] if ep > 1 else None
    tensor_axis = w_in[2]  # (a psum over one device is free, and tells shard_map y is whole)
    # The weights enter whole in d: gathered over fsdp in the compute dtype, as any FSDP
    # weight, and their gradients reduced back (XLA:TPU lowers that as an all-reduce here, not
    # a reduce-scatter: docs/notes/scaling-log.md, the MoE section). The gather is made explicit and
    # named so that `model.remat=attention_experts` keeps it for the backward pass.
    w_in, w_out = P(w_in[0], None, w_in[2]), P(w_out[0], w_out[1], None)
    dt = x.dtype

    def gathered(w, spec):
        w = jax.lax.with_sharding_constraint(w.astype(dt), jax.sharding.NamedSharding(mesh, spec))
        return checkpoint_name(w, EXPERT_WEIGHTS)

    def local(x, weights, experts, gate, up, down):
        return _grouped_local(x, weights, experts, C, gate, up, down, expert_axis, ep, tensor_axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, w_in, w_in, w_out), out_specs=rows)(
        x, weights, experts, gathered(gate, w_in), gathered(up, w_in), gathered(down, w_out))


def _mesh_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


DISPATCH = {"grouped": dispatch_grouped, "dense": dispatch_dense, "sort": dispatch_sort}


# ----------------------------------------------------------------------------- module


class MoE(nnx.Module):
    """Router Linear(d, E, bias=False) and E SwiGLU experts stacked as [E, d, f] arrays."""

    def __init__(self, cfg, stack=None):
        d, mo = cfg.d_model, cfg.moe
        E, f = mo.n_experts, mo.d_expert
        self.router = param((d, E), ("embed", "expert"), stack=stack)
        self.gate = param((E, d, f), ("expert", "embed", "mlp"), stack=stack)
        self.up = param((E, d, f), ("expert", "embed", "mlp"), stack=stack)
        self.down = param((E, f, d), ("expert", "mlp", "embed"), stack=stack)
        self.n_experts, self.top_k = E, mo.top_k
        self.renormalize, self.capacity_factor = bool(mo.renormalize), float(mo.capacity_factor)
        self.dispatch = mo.dispatch
        if self.dispatch not in ("auto", *DISPATCH):
            raise ValueError(f"model.moe.dispatch {self.dispatch!r}: one of auto, {', '.join(DISPATCH)}")

    def __call__(self, x):
        """x: [B, T, d] -> (y [B, T, d] in x.dtype, aux dict of fp32 statistics)."""
        B, T, _ = x.shape
        E, k = self.n_experts, self.top_k
        _, probs, weights, experts = route(x, self.router[...], k, self.renormalize)
        C = capacity(T, E, k, self.capacity_factor)
        y = DISPATCH[resolve_dispatch(self.dispatch)](x, weights, experts, C, self.gate[...], self.up[...],
                                                      self.down[...])
        # Statistics are not differentiated except moe_prob (the loss's gradient path, as HF).
        counts = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=(0, 1, 2)))
        _, pos = priority_positions(jax.lax.stop_gradient(experts), E)
        aux = {
            "moe_assign": counts,  # [E] top-k assignments before capacity (HF's f numerator)
            "moe_prob": jnp.sum(probs, axis=(0, 1)),  # [E] router probabilities summed over tokens
            "moe_tokens": jnp.asarray(B * T, jnp.float32),
            "moe_dropped": jnp.sum(pos >= C).astype(jnp.float32),  # assignments over capacity
            "moe_layers": jnp.asarray(1.0, jnp.float32),
        }
        return y, aux


# ----------------------------------------------------------------------------- losses and stats


def load_balancing_loss(aux, n_experts: int, top_k: int | None = None):
    """Switch load-balancing loss pooled over layers and tokens, as HF
    `load_balancing_loss_func(router_logits of all layers, E, top_k)` without a mask:

        E · Σ_e f_e · P_e,  f_e = (top-k assignments to e) / (tokens · layers),
                            P_e = (Σ router prob of e) / (tokens · layers)

    f is NOT divided by top_k (Σ_e f_e = top_k), so perfectly uniform routing gives top_k.
    `top_k` is what the counts were made with (it only enters through `aux`); it is accepted
    to mirror HF's signature. Multiply by `moe.aux_coef` and add to the loss; aux is the
    trunk's layer-summed statistics (`Model.forward(tokens)[2]`). 0 when there are none."""
    del top_k
    if "moe_tokens" not in aux:
        return jnp.zeros((), jnp.float32)
    rows = aux["moe_tokens"]
    return n_experts * jnp.sum((aux["moe_assign"] / rows) * (aux["moe_prob"] / rows))


def router_stats(aux) -> dict:
    """drop_fraction: assignments over capacity / all assignments; expert_load [E]: each
    expert's share of the top-k assignments (before capacity; 1/E balanced); max_load: the
    largest share."""
    assign = aux["moe_assign"]
    total = jnp.sum(assign)
    load = assign / total
    return {"drop_fraction": aux["moe_dropped"] / total, "expert_load": load, "max_load": jnp.max(load)}
