"""The vocabulary-tiled fused loss (`model.loss = "fused_vocab"`): log p(target) for one
table, or a two-table mixture with per-token log weights (the twin head), without
materialising [tokens, V] logits. `loss.py`'s token-tiled loss, which computes the gradients
in its forward pass, is the default; this one recomputes each vocabulary tile's logits in the
backward pass, and needs less memory only where a device holds fewer than ~1,024 tokens
(docs/notes/performance-log.md).

The forward pass streams the vocabulary in chunks of `chunk` rows and keeps a running
log-sum-exp per token (the online-softmax recurrence); the target's logit is one row dot
product. The backward pass recomputes each chunk's logits from the saved log-sum-exp, so the
largest temporary is one [tokens, chunk] tile per table, in fp32.

For a two-table mixture with log weights (w_A, w_B) (twin: logσ(z), logσ(−z)) and per-table
log-probabilities lp_A, lp_B:

    log p = logaddexp(lp_A + w_A, lp_B + w_B)
    r_A = exp(lp_A + w_A − log p),  r_B = exp(lp_B + w_B − log p)   (component posteriors)
    ∂log p/∂logits_A = r_A (onehot − softmax_A),  ∂log p/∂w_A = r_A

With the vocabulary sharded on a mesh axis (`vocab_axis`), each device streams its own rows
and the running statistics combine across the axis (pmax / psum); the same holds for the
target logit (only the owning shard contributes) and for ∂h. The layout is an argument
(`sharding.loss_layout(mesh)`), never read from a context: whether the loss is sharded is
decided by the caller's arguments alone.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _chunks(table, chunk):
    """[V, d] -> ([n, chunk, d] zero-padded, n). Padded rows are masked out by index."""
    V, d = table.shape
    n = max(1, math.ceil(V / chunk))
    padded = jnp.pad(table, ((0, n * chunk - V), (0, 0)))
    return padded.reshape(n, chunk, d), n


def _chunk_logits(h, Tc, start, V):
    logits = jnp.einsum("nd,vd->nv", h, Tc.astype(h.dtype), preferred_element_type=F32)
    valid = (start + jnp.arange(Tc.shape[0])) < V
    return jnp.where(valid[None, :], logits, -jnp.inf)


def _lse(h, table, chunk, axis):
    """log Σ_v exp(h·T_v) per token, over this shard's rows, combined across `axis`."""
    V = table.shape[0]
    tiles, n = _chunks(table, chunk)

    def body(carry, inputs):
        m, s = carry
        i, Tc = inputs
        logits = _chunk_logits(h, Tc, i * chunk, V)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=-1)
        return (m_new, s), None

    init = (jnp.full(h.shape[:1], -jnp.inf, F32), jnp.zeros(h.shape[:1], F32))
    (m, s), _ = jax.lax.scan(body, init, (jnp.arange(n), tiles))
    if axis is not None:
        m_all = jax.lax.pmax(m, axis)
        s = jax.lax.psum(s * jnp.exp(m - m_all), axis)
        m = m_all
    return m + jnp.log(s)


def _local_targets(table, targets, axis):
    """(row index into this shard, mask of tokens whose target lives on this shard)."""
    V = table.shape[0]
    offset = 0 if axis is None else jax.lax.axis_index(axis) * V
    local = targets - offset
    owned = (local >= 0) & (local < V)
    return jnp.where(owned, local, 0), owned


def _target_logit(h, table, targets, axis):
    rows, owned = _local_targets(table, targets, axis)
    t = jnp.einsum("nd,nd->n", h, table[rows].astype(h.dtype), preferred_element_type=F32)
    t = jnp.where(owned, t, 0.0)
    return t if axis is None else jax.lax.psum(t, axis)


def _forward(h, tables, z, targets, chunk, axis):
    """z: None (one table) or the [N, 2] log weights of the two tables."""
    lps = [_target_logit(h, T, targets, axis) - _lse(h, T, chunk, axis) for T in tables]
    if len(tables) == 1:
        return lps[0], lps
    return jnp.logaddexp(lps[0] + z[:, 0], lps[1] + z[:, 1]), lps


def _table_grads(h, table, lse, coef, targets, chunk, axis):
    """∂/∂h and ∂/∂T of Σ_n coef_n · log_softmax(h_n Tᵀ)[target_n]."""
    V, d = table.shape
    tiles, n = _chunks(table, chunk)

    def body(dh, inputs):
        i, Tc = inputs
        p = jnp.exp(_chunk_logits(h, Tc, i * chunk, V) - lse[:, None])  # 0 on padding
        dlogits = -coef[:, None] * p
        dh = dh + jnp.einsum("nv,vd->nd", dlogits, Tc.astype(F32))
        dT = jnp.einsum("nv,nd->vd", dlogits, h.astype(F32))
        return dh, dT

    dh, dT = jax.lax.scan(body, jnp.zeros(h.shape, F32), (jnp.arange(n), tiles))
    dT = dT.reshape(n * chunk, d)[:V]
    rows, owned = _local_targets(table, targets, axis)  # the one-hot term
    c = jnp.where(owned, coef, 0.0)
    dh = dh + c[:, None] * table[rows].astype(F32)
    dT = dT.at[rows].add(c[:, None] * h.astype(F32))
    return dh, dT


def _backward(h, tables, z, targets, lses, lps, logp, g, chunk, axis, batch_axes):
    """Gradients of Σ g·log p. Under shard_map, ∂h sums over the vocabulary shards and each
    table's gradient over the batch shards (`batch_axes`)."""
    g = g.astype(F32)
    if len(tables) == 1:
        coefs, dz = [g], None
    else:
        r_a = jnp.exp(lps[0] + z[:, 0] - logp)
        r_b = jnp.exp(lps[1] + z[:, 1] - logp)
        coefs = [g * r_a, g * r_b]
        dz = jnp.stack([g * r_a, g * r_b], axis=-1)
    dh = jnp.zeros(h.shape, F32)
    dtables = []
    for T, lse, c in zip(tables, lses, coefs):
        dh_t, dT = _table_grads(h, T, lse, c, targets, chunk, axis)
        dh = dh + dh_t
        if batch_axes:
            dT = jax.lax.psum(dT, batch_axes)
        dtables.append(dT.astype(T.dtype))
    if axis is not None:
        dh = jax.lax.psum(dh, axis)
    return dh.astype(h.dtype), tuple(dtables), dz


def _residuals(h, tables, z, targets, chunk, axis):
    logp, lps = _forward(h, tables, z, targets, chunk, axis)
    lses = tuple(_target_logit(h, T, targets, axis) - lp for T, lp in zip(tables, lps))
    return logp, tuple(lps), lses


# `layout` is None (plain arrays) or (mesh, batch axes, vocab axis): then forward and backward
# each run as one shard_map, and autodiff never differentiates through shard_map itself.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(h, tables, z, targets, chunk, layout):
    return _fused_fwd(h, tables, z, targets, chunk, layout)[0]


def _specs(layout, n_tables, has_z):
    mesh, batch, vocab = layout
    P = jax.sharding.PartitionSpec
    row, tok = P(batch, None), P(batch)
    return row, tok, tuple(P(vocab, None) for _ in range(n_tables))


def _weights_spec(layout):
    return jax.sharding.PartitionSpec(layout[1], None)


def _fused_fwd(h, tables, z, targets, chunk, layout):
    if layout is None:
        logp, lps, lses = _residuals(h, tables, z, targets, chunk, None)
    else:
        mesh, _, vocab = layout
        row, tok, tab = _specs(layout, len(tables), z is not None)
        n = len(tables)
        fn = lambda h, t, y, z: _residuals(h, t, z, y, chunk, vocab)  # noqa: E731
        logp, lps, lses = jax.shard_map(
            fn, mesh=mesh, in_specs=(row, tab, tok, None if z is None else _weights_spec(layout)),
            out_specs=(tok, (tok,) * n, (tok,) * n), check_vma=False,
        )(h, tables, targets, z)
    return logp, (h, tables, z, targets, lses, lps, logp)


def _fused_bwd(chunk, layout, res, g):
    h, tables, z, targets, lses, lps, logp = res
    if layout is None:
        dh, dtables, dz = _backward(h, tables, z, targets, lses, lps, logp, g, chunk, None, None)
    else:
        mesh, batch, vocab = layout
        row, tok, tab = _specs(layout, len(tables), z is not None)
        n = len(tables)
        fn = lambda h, t, z, y, ls, lp, lg, g: _backward(h, t, z, y, ls, lp, lg, g, chunk, vocab, batch)  # noqa: E731
        dh, dtables, dz = jax.shard_map(
            fn, mesh=mesh,
            in_specs=(row, tab, None if z is None else _weights_spec(layout), tok, (tok,) * n, (tok,) * n, tok, tok),
            out_specs=(row, tab, None if z is None else _weights_spec(layout)), check_vma=False,
        )(h, tables, z, targets, lses, lps, logp, g)
    return dh, dtables, (None if z is None else dz.astype(z.dtype)), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def target_log_probs(h, tables, targets, z=None, chunk: int = 4096, layout=None):
    """fp32 log p(targets) for one table (`tables=(E,)`) or a two-table mixture (`tables=(A, B)`
    and `z`: the gate logit [...] (twin: weights σ(±z)) or the log weights [..., 2]).
    h: [..., d]; targets: [...]. `layout` = (mesh, batch axes, vocab axis) from
    `sharding.loss_layout` runs each pass as a shard_map with the vocabulary split over the
    vocab axis; None: plain arrays."""
    tables = tuple(tables)
    if len(tables) not in (1, 2) or (len(tables) == 2) != (z is not None):
        raise ValueError("pass one table, or two tables and a gate logit z (or log weights)")
    lead = targets.shape
    flat_h = h.reshape(-1, h.shape[-1])
    flat_z = None
    if z is not None:
        z = z.astype(F32)
        if z.shape == lead:  # a gate logit: log weights logσ(±z)
            z = jnp.stack([jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)], axis=-1)
        flat_z = z.reshape(-1, 2)
    out = _fused(flat_h, tables, flat_z, targets.reshape(-1), chunk, layout)
    return out.reshape(lead)
