"""One fused output-layer loss for every head: a mixture of K softmax components with
per-token log-weights, its gradients computed in the forward pass, tiled over tokens.

Every head's next-token distribution is

    log p(y | n) = logsumexp_k ( lw_nk + log_softmax_v( s(h_nk · T_k,v) )[y] )

* standard / untied / input-gate: K = 1, one table, lw absent;
* twin: K = 2 over one shared h and tables (A, B), lw = (logσ(z), logσ(−z));
* MoS / MoSS: K contexts h_nk = tanh(W_k h_n) over one shared table E, lw = log π_n;
* sigsoftmax (and MoSS's components): the score s(z) = log(exp(z)σ(z)) = 2z − softplus(z).

`mixture_nll` returns loss = Σ_n w_n·(−log p_n) for per-token weights w (1/N: the mean) and
log p. Its custom VJP computes ∂hs, ∂tables and ∂lw in the FORWARD pass (Liger-Kernel's
fused linear cross-entropy): for each tile of tokens, the logits over this device's rows of
the vocabulary are computed once; their log-sum-exp (combined across vocabulary shards), the
loss, the posteriors r_k = exp(lw_k + lp_k − log p) and

    ∂L/∂s_k = −w r_k (onehot(y) − softmax(s_k)),   ∂L/∂lw_k = −w r_k,
    ∂L/∂z_k = ∂L/∂s_k · s'(z_k)     (s'(z) = 1, or 2 − σ(z) for sigsoftmax)

all come from them, and two matmuls of ∂L/∂z_k give that tile's ∂h_k and its share of ∂T_k
(accumulated over tiles). The backward pass only scales these by the scalar cotangent of
the loss, so training costs the plain loss's FLOPs (forward 2·V·d, ∂h 2·V·d, ∂T 2·V·d per
token and component) with no recompute, and the largest temporaries are [token tile, V /
shards] fp32 tiles (logits and their exp) of one component at a time. Every reduction is
fp32; matmul operands are in hs's dtype (the config's compute dtype) with fp32 accumulation.

`layout` = (mesh, batch mesh axes, vocab mesh axis or None) runs the forward pass as one
`jax.shard_map`: tokens split over the batch axes, table rows over the vocab axis; the
per-token statistics combine across the vocab axis (pmax / psum), ∂h sums over it, and each
table's gradient sums over the batch axes.

log p is returned for evaluation. A gradient through it (rare: analysis, tests) is correct
but not fused: it falls back to autodiff of the plain reference, which builds the logits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import custom_derivatives as cd

from onona_jax import sharding

F32 = jnp.float32
SCORES = (None, "sigsoftmax")
# Tokens per tile (per device), by platform (`resolve_token_tile`). Accelerators: HBM decides, and
# a short tile keeps the twin head's [tile, V] temporaries small beside the rest of the step
# (docs/notes/scaling-log.md). CPU: memory is no constraint, and each tile's ∂T product writes the
# whole [V, d] gradient, so short tiles are slow GEMMs; 512 was the fastest whole loss of the
# tiles tried (benchmarks/peer.py --what=parts; figures in docs/notes/performance-log.md).
ACCELERATOR_TOKEN_TILE = 256
CPU_TOKEN_TILE = 512


def resolve_token_tile(configured: int = 0) -> int:
    """`model.loss_token_tile`: itself when positive; 0 (auto) is CPU_TOKEN_TILE where the step
    compiles for the CPU and ACCELERATOR_TOKEN_TILE for TPU and GPU (`sharding.platform`: the
    active mesh's devices, so a deviceless TPU compile on this CPU gets the TPU's tile)."""
    if configured < 0:
        raise ValueError(f"token_tile={configured}: a positive number of tokens, or 0 for the platform's default")
    if configured:
        return int(configured)
    return CPU_TOKEN_TILE if sharding.platform() == "cpu" else ACCELERATOR_TOKEN_TILE


# ----------------------------------------------------------------------------- plain reference


def _score(z, score):
    """(s(z), s'(z)) in fp32; s'(z) is None for the identity score."""
    if score is None:
        return z, None
    return 2.0 * z - jax.nn.softplus(z), 2.0 - jax.nn.sigmoid(z)


def _check(hs, tables, log_weights, score):
    """K (number of components), validated against the arguments."""
    tables = tuple(tables)
    if score not in SCORES:
        raise ValueError(f"score {score!r}: choose one of {SCORES}")
    if hs.ndim not in (2, 3):
        raise ValueError(f"hs must be [N, d] or [N, K, d], got shape {hs.shape}")
    K = hs.shape[1] if hs.ndim == 3 else len(tables)
    if len(tables) not in (1, K) or (hs.ndim == 3 and len(tables) != 1 and hs.shape[1] != len(tables)):
        raise ValueError(f"{len(tables)} tables for {K} components: pass one table or one per component")
    if (log_weights is None) != (K == 1):
        raise ValueError(f"log_weights: None exactly when K = 1 (K = {K})")
    if log_weights is not None and log_weights.shape != (hs.shape[0], K):
        raise ValueError(f"log_weights shape {log_weights.shape}, expected {(hs.shape[0], K)}")
    return K, tables


def _component(hs, tables, k):
    h = hs[:, k] if hs.ndim == 3 else hs
    return h, tables[k if len(tables) > 1 else 0]


def plain_log_probs(hs, tables, log_weights, targets, *, score=None):
    """log p(targets) [N] through whole [N, V] logits per component (autodiff reference)."""
    K, tables = _check(hs, tables, log_weights, score)
    lps = []
    for k in range(K):
        h, T = _component(hs, tables, k)
        z = jnp.einsum("nd,vd->nv", h, T.astype(h.dtype), preferred_element_type=F32)
        s = _score(z, score)[0]
        lps.append(jnp.take_along_axis(s, targets[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(s, axis=-1))
    if K == 1:
        return lps[0]
    return jax.nn.logsumexp(log_weights.astype(F32) + jnp.stack(lps, axis=1), axis=1)


# ----------------------------------------------------------------------------- one shard


def _tile_stats(hs, tables, lw, y, score, vocab):
    """One token tile on one shard: log p [T], the per-component pieces the gradient needs
    (h_k, T_k, e_k = exp(s_k − max), s'(z_k), Σe_k), the posteriors and the target's local row."""
    K = hs.shape[1]
    V_local = tables[0].shape[0]
    offset = 0 if vocab is None else jax.lax.axis_index(vocab) * V_local
    local = y - offset
    owned = (local >= 0) & (local < V_local)
    idx = jnp.where(owned, local, 0)
    comps, lps = [], []
    for k in range(K):
        h, T = _component(hs, tables, k)
        z = jnp.einsum("td,vd->tv", h, T, preferred_element_type=F32)  # the tile's logits, once
        s, ds = _score(z, score)
        m = jnp.max(s, axis=-1)
        if vocab is not None:
            m = jax.lax.pmax(m, vocab)
        # exp(s − m) once, as its own array: the gradient reuses it (p = e / Σe), and without
        # the barrier XLA:CPU fuses the exp into a slow reduction (docs/notes/performance-log.md).
        e = jax.lax.optimization_barrier(jnp.exp(s - m[:, None]))
        se = jnp.sum(e, axis=-1)
        st = jnp.where(owned, jnp.take_along_axis(s, idx[:, None], axis=-1)[:, 0], 0.0)
        if vocab is not None:
            se, st = jax.lax.psum((se, st), vocab)
        lps.append(st - m - jnp.log(se))
        comps.append((h, T, e, ds, se))
    lps = jnp.stack(lps, axis=1)  # [T, K]
    if lw is None:
        logp = lps[:, 0]
        r = jnp.ones_like(lps)
    else:
        joint = lw + lps
        logp = jax.nn.logsumexp(joint, axis=1)
        r = jnp.exp(joint - logp[:, None])  # component posteriors, Σ_k r_k = 1
    return logp, comps, r, idx, owned


def _tile_grads(comps, r, w, idx, owned, shared_h):
    """∂L/∂h (per component, or summed for a shared h) and each component's ∂T for one
    tile, where L = Σ_t w_t·(−log p_t); and ∂L/∂lw = −w r."""
    c = -w[:, None] * r  # ∂L/∂lp_k
    dhs, dTs = [], []
    for k, (h, T, e, ds, se) in enumerate(comps):
        p = e * (1.0 / se)[:, None]
        onehot = (jnp.arange(e.shape[1])[None, :] == idx[:, None]) & owned[:, None]
        dz = c[:, k, None] * (onehot.astype(F32) - p)
        if ds is not None:
            dz = dz * ds
        dz = dz.astype(h.dtype)
        dhs.append(jnp.einsum("tv,vd->td", dz, T, preferred_element_type=F32))
        dTs.append(jnp.einsum("tv,td->vd", dz, h, preferred_element_type=F32))
    dh = functools.reduce(jnp.add, dhs)[:, None] if shared_h else jnp.stack(dhs, axis=1)
    return dh, dTs, c


def _shard(hs, tables, lw, y, w, score, tile, vocab, batch, grads):
    """The fused loss over this device's tokens and vocabulary rows. hs: [n, K', d] (K' = 1
    for a shared h). Returns (loss, log p, ∂hs, ∂tables, ∂lw); the gradients are None
    without `grads`."""
    n, Kh, d = hs.shape
    shared_h = Kh == 1
    cdt = hs.dtype
    tables_c = tuple(T.astype(cdt) for T in tables)  # one cast of each table, outside the tile loop
    t = min(tile, n)
    n_tiles = math.ceil(n / t)
    pad = n_tiles * t - n
    padt = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(n_tiles, t, *x.shape[1:])  # noqa: E731
    w = w.astype(F32)
    xs = (padt(hs), None if lw is None else padt(lw.astype(F32)), padt(y), padt(w))  # padding has w = 0

    def body(dT_acc, x):
        h_t, lw_t, y_t, w_t = x
        if shared_h and len(tables_c) > 1:  # twin: one h, K tables
            h_in = jnp.broadcast_to(h_t, (t, len(tables_c), d))
        else:
            h_in = h_t
        logp, comps, r, idx, owned = _tile_stats(h_in, tables_c, lw_t, y_t, score, vocab)
        if not grads:
            return dT_acc, (logp,)
        dh, dTs, c = _tile_grads(comps, r, w_t, idx, owned, shared_h)
        if len(tables_c) == 1:  # one table shared by every component: its gradients add
            dTs = [functools.reduce(jnp.add, dTs)]
        dT_acc = tuple(dTs) if dT_acc is None else tuple(a + g for a, g in zip(dT_acc, dTs))
        return dT_acc, (logp, dh, None if lw is None else c)

    if grads:  # the first tile starts the ∂T sums: no zero-filled [V, d] buffer, one add fewer
        dT, out0 = body(None, jax.tree.map(lambda a: a[0], xs))
        out = jax.tree.map(lambda a: a[None], out0)
        if n_tiles > 1:
            dT, rest = jax.lax.scan(body, dT, jax.tree.map(lambda a: a[1:], xs))
            out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, rest)
    else:
        dT, out = jax.lax.scan(body, (), xs)
    unpad = lambda x: x.reshape(n_tiles * t, *x.shape[2:])[:n]  # noqa: E731
    logp = unpad(out[0])
    loss = -jnp.sum(w * logp)
    if batch:
        loss = jax.lax.psum(loss, batch)
    if not grads:
        return loss, logp, None, None, None
    dhs = unpad(out[1])
    if vocab is not None:
        dhs = jax.lax.psum(dhs, vocab)
    if batch:
        dT = jax.lax.psum(dT, batch)
    dlw = None if lw is None else unpad(out[2])
    return loss, logp, dhs.astype(cdt), tuple(g.astype(T.dtype) for g, T in zip(dT, tables)), dlw


def _run(hs, tables, lw, y, w, score, tile, layout, grads):
    """`_shard` on plain arrays, or as one shard_map over `layout`. hs is [N, K', d]."""
    if layout is None:
        return _shard(hs, tables, lw, y, w, score, tile, None, None, grads)
    mesh, batch, vocab = layout
    P = jax.sharding.PartitionSpec
    rows, tok, tab = P(batch, None, None), P(batch), P(vocab, None)
    tok2 = P(batch, None)
    has_lw = lw is not None

    def fn(hs, tables, y, w, lw=None):
        out = _shard(hs, tables, lw, y, w, score, tile, vocab, batch, grads)
        return out if grads else out[:2]

    args = (hs, tables, y, w) + ((lw,) if has_lw else ())
    in_specs = (rows, tuple(tab for _ in tables), tok, tok) + ((tok2,) if has_lw else ())
    out_specs = (P(), tok)
    if grads:
        out_specs += (rows, tuple(tab for _ in tables), tok2 if has_lw else None)
    out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
    return out if grads else (*out, None, None, None)


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _nll(hs, tables, lw, y, w, score, tile, layout):
    loss, logp, *_ = _run(hs, tables, lw, y, w, score, tile, layout, grads=False)
    return loss, logp


def _value(x):
    return x.value if isinstance(x, cd.CustomVJPPrimal) else x


def _nll_fwd(hs, tables, lw, y, w, score, tile, layout):
    hs, lw, y, w = map(_value, (hs, lw, y, w))
    tables = jax.tree.map(_value, tables, is_leaf=lambda x: isinstance(x, cd.CustomVJPPrimal))
    loss, logp, dhs, dtables, dlw = _run(hs, tables, lw, y, w, score, tile, layout, grads=True)
    # hs, tables and lw are kept for the rare gradient through log p (they are live anyway).
    return (loss, logp), (dhs, dtables, dlw, hs, tables, lw, y)


def _nll_bwd(score, tile, layout, res, cts):
    dhs, dtables, dlw, hs, tables, lw, y = res
    g_loss, g_logp = cts
    scale = lambda x: None if x is None else (x.astype(F32) * g_loss).astype(x.dtype)  # noqa: E731
    if isinstance(g_loss, cd.SymbolicZero):
        out = [jnp.zeros_like(hs), tuple(jnp.zeros_like(T) for T in tables), None if lw is None else jnp.zeros_like(lw)]
    else:
        g_loss = g_loss.astype(F32)
        out = [scale(dhs), tuple(scale(g) for g in dtables), scale(dlw)]
    if not isinstance(g_logp, cd.SymbolicZero):  # not fused: autodiff of the plain reference
        def lp(hs, tables, lw):
            h = hs[:, 0] if hs.shape[1] == 1 else hs
            return plain_log_probs(h, tables, lw, y, score=score)

        _, vjp = jax.vjp(lp, hs, tables, lw)
        extra = vjp(g_logp.astype(F32))
        out = [out[0] + extra[0], tuple(a + b for a, b in zip(out[1], extra[1])),
               None if lw is None else out[2] + extra[2]]
    return (*out, None, None)


_nll.defvjp(_nll_fwd, _nll_bwd, symbolic_zeros=True)


def mixture_nll(hs, tables, log_weights, targets, weights, *, score=None, token_tile=0,
                layout=None):
    """(loss, log p): loss = Σ_n weights_n·(−log p_n) (scalar fp32, differentiable; its
    gradients are computed in the forward pass), log p [N] fp32.

    hs: [N, d] (one hidden state for every component) or [N, K, d] (one per component);
    tables: K tables [V, d], or one shared by the K components; log_weights: [N, K] log
    mixture weights, None for K = 1; targets [N] int; weights [N] per-token loss weights;
    score: None or "sigsoftmax"; token_tile: tokens per tile (per device), 0 for the platform's
    (`resolve_token_tile`); layout: None or
    (mesh, batch mesh axes, vocab mesh axis or None)."""
    K, tables = _check(hs, tables, log_weights, score)
    tile = resolve_token_tile(token_tile)
    hs3 = hs[:, None] if hs.ndim == 2 else hs
    lw = None if log_weights is None else log_weights.astype(F32)
    return _nll(hs3, tables, lw, targets, weights.astype(F32), score, tile, layout)


def head_nll(hs, tables, log_weights, targets, weights, *, score=None, token_tile=0,
             layout=None):
    """`mixture_nll` for a head's arrays with leading dims (hs [..., (K,) d], log_weights
    [..., K], targets and weights [...]); log p keeps the leading dims. `layout`:
    `sharding.loss_layout(mesh)` or None (an argument, never read from a context)."""
    lead = targets.shape
    n = math.prod(lead)
    flat = lambda x, tail: None if x is None else x.reshape(n, *x.shape[x.ndim - tail:])  # noqa: E731
    hs_tail = 1 if (hs.ndim == len(lead) + 1) else 2
    loss, logp = mixture_nll(flat(hs, hs_tail), tables, flat(log_weights, 1), targets.reshape(n),
                             weights.reshape(n), score=score, token_tile=token_tile, layout=layout)
    return loss, logp.reshape(lead)
