"""Gated DeltaNet (SPEC §3, GDN hybrid): the gated delta rule and the GDN token mixer.

Layout: every sequence tensor is [B, T, H, D] (batch, time, heads, head dim) as in the rest
of the model; per-step decays `g` and learning rates `beta` are [B, T, H]; the recurrent
state is [B, H, dk, dv] (S maps keys to values: o_t = Sᵀ q_t). The state math is fp32; the
matmuls' operands are bf16 or fp32 as `precision` says (PRECISIONS, config model.gdn.precision).

Recurrence per head (the naive form, the test oracle and the decoding step):

    S ← e^{g_t} S;   u_t = β_t (v_t − Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = Sᵀ q_t

The pure functions take q, k as they enter the recurrence: the layer L2-normalises q and k
and scales q by dk^-½ before calling them (no scaling inside).

Chunked form (training; chunk C, WY/UT transform). Inside a chunk with cumulative log-decay
γ_i = Σ_{j≤i} g_j and entering state S₀:

    (I + A) U = diag(β) V − diag(β e^{γ}) K S₀,   A_ij = β_i e^{γ_i−γ_j} k_i·k_j  (j < i)
    o_i = e^{γ_i} S₀ᵀ q_i + Σ_{j≤i} e^{γ_i−γ_j} (q_i·k_j) u_j
    S_C = e^{γ_C} S₀ + Σ_j e^{γ_C−γ_j} k_j u_jᵀ

Only differences γ_i − γ_j with j ≤ i (≤ 0) and γ_i ≤ 0 are exponentiated (the others are
masked to −inf first), so strongly negative g underflows to 0 and never overflows. T is
padded to a multiple of C with q = k = v = 0, g = 0, β = 0: a padded step neither decays
nor writes the state and comes after every real step, so outputs and state are unchanged.

Document resets (packed rows, `segments` → `resets` [B, T] bool, `document_starts`): the state
is zeroed before each token with resets_t, so every document runs as if alone. In the chunked
form, inside fixed chunks (a document may start anywhere in one), with same(i, j) = "i and j in
one document" and carry_i = "no reset at chunk positions ≤ i" (i's document continues from the
previous chunk):

    γ_i = Σ g_j over j ≤ i of i's document in the chunk (a segment-wise cumulative sum)
    A_ij, e^{γ_i−γ_j} terms: only where same(i, j);   S₀ reaches only tokens with carry_i
    S_C = carry_C e^{γ_C} S₀ + Σ_{j: same(j, C)} e^{γ_C−γ_j} k_j u_jᵀ   (C: the chunk's last position)

A reset is never a huge negative g added into a running cumulative sum: in fp32 γ_i − γ_j would
then be the difference of two large numbers, and the small decays inside a document would be
lost to cancellation; each segment's γ sums its own g only. `segments=None` is the plain form.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from onona_jax.models import hf_map
from onona_jax.params import ParamGroup, param
from onona_jax.sharding import constrain

# The precision of the recurrence's matmuls (config key model.gdn.precision):
#   "highest": fp32 operands at Precision.HIGHEST — full fp32 on every backend, which on the
#       TPU matrix unit (bf16 passes) is multi-pass emulation: more HBM and far longer compiles.
#   "default": operands rounded to bf16, products accumulated in fp32 (one matrix-unit pass;
#       the same numbers on CPU and GPU, where bf16 × bf16 products are exact in fp32).
# Either way the state S is kept and carried in fp32, and so are decays, β and the elementwise
# work; only the matmul operands are rounded. tests/unit/test_gdn.py states and checks the error.
PRECISIONS = ("default", "highest")
DEFAULT_PRECISION = "default"
L2_EPS = 1e-6


# ----------------------------------------------------------------------------- the gated delta rule


def matmul(precision: str):
    """`einsum(spec, *operands)` for the recurrence's products at `precision` (PRECISIONS);
    fp32 results either way."""
    if precision == "highest":
        return lambda spec, *ops: jnp.einsum(spec, *ops, precision=jax.lax.Precision.HIGHEST)
    if precision == "default":
        # DEFAULT named explicitly, so that a global jax_default_matmul_precision cannot
        # turn these into multi-pass products again.
        bf16 = jnp.bfloat16
        return lambda spec, *ops: jnp.einsum(spec, *(x.astype(bf16) for x in ops),
                                             precision=jax.lax.Precision.DEFAULT,
                                             preferred_element_type=jnp.float32)
    raise ValueError(f"GDN matmul precision {precision!r}: one of {', '.join(PRECISIONS)}")


def gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t, precision=DEFAULT_PRECISION):
    """One step of the recurrence. state [B, H, dk, dv]; q_t, k_t [B, H, dk]; v_t [B, H, dv];
    g_t, beta_t [B, H]. Returns (o_t [B, H, dv], new state), fp32. `precision`: of the two
    state products (the write k uᵀ is an elementwise outer product, always fp32)."""
    f32 = jnp.float32
    ein = matmul(precision)
    state = state.astype(f32) * jnp.exp(g_t.astype(f32))[..., None, None]
    k_t = k_t.astype(f32)
    kv = ein("bhkv,bhk->bhv", state, k_t)
    u = beta_t.astype(f32)[..., None] * (v_t.astype(f32) - kv)
    state = state + k_t[..., :, None] * u[..., None, :]
    o = ein("bhkv,bhk->bhv", state, q_t.astype(f32))
    return o, state


def _zero_state(q, v):
    B, _, H, dk = q.shape
    return jnp.zeros((B, H, dk, v.shape[-1]), jnp.float32)


def document_starts(segments):
    """resets [B, T] bool from segments [B, T] (each token's document id): True where a token's
    id differs from the previous token's. Position 0 is never a start: a row's first document
    (perhaps the tail of one begun in an earlier window) begins with the initial state, zeros
    unless one is given."""
    segments = jnp.asarray(segments)
    return jnp.concatenate([jnp.zeros_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, precision=DEFAULT_PRECISION, resets=None):
    """The naive per-step recurrence (lax.scan over time). q, k [B, T, H, dk], v [B, T, H, dv],
    g, beta [B, T, H]; initial_state [B, H, dk, dv] or None (zeros); resets [B, T] bool or None:
    the state is zeroed before each token where True (a document starts there; resets[:, 0]
    zeroes the initial state).
    Returns (o [B, T, H, dv] fp32, final state [B, H, dk, dv] fp32: the last document's)."""
    state = _zero_state(q, v) if initial_state is None else initial_state.astype(jnp.float32)

    def body(S, xs):
        if resets is not None:
            *xs, r = xs
            S = jnp.where(r[:, None, None, None], 0.0, S)
        o, S = gated_delta_step(S, *xs, precision=precision)
        return S, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    if resets is not None:
        xs += (jnp.moveaxis(jnp.asarray(resets, bool), 1, 0),)
    state, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def unit_lower_inverse(A, precision=DEFAULT_PRECISION):
    """(I + A)⁻¹ for strictly lower-triangular A [..., C, C], by recursive block inversion:

        [[I + A₁₁, 0], [A₂₁, I + A₂₂]]⁻¹ = [[T₁₁, 0], [−T₂₂ A₂₁ T₁₁, T₂₂]]

    applied to diagonal blocks of size 1, 2, 4, … (C is padded to a power of two P with
    identity). Round s holds D, block-diagonal with the inverses of the s × s diagonal blocks,
    and L, the lower-left quarters A₂₁ of the 2s × 2s diagonal blocks (A masked, zero
    elsewhere); then D − D (L D) is block-diagonal with the 2s × 2s inverses (the formula
    above, block by block). Each round is two whole P × P products: matrix-unit-sized, where
    the blocks themselves (1 × 1 … P/2 × P/2) would be batches of tiny products, and exact, as
    the extra terms are products with exact zeros. log₂ P rounds, 4P³ log₂ P FLOPs; never waits
    on XLA's intra-op thread pool as a batched LAPACK trsm on CPU does (jaxlib 0.10 splits large
    trsm batches over it, which can deadlock a host with few cores: docs/notes/performance-log.md).
    Each D block is the exact inverse of a principal block of I + A — the UT transform of a
    sub-chunk, bounded like the recurrence — so no intermediate grows the way the power series
    Σ(−A)ᵏ's terms do (binomially, for aligned keys).

    The gradient is the inverse's own, dA = −Tᵀ dT Tᵀ on the strictly lower triangle (two
    products; a custom VJP that keeps only T, not every round's D and L D for the backward)."""
    return _unit_lower_inverse(precision, A)


def _blocked_inverse(precision, A):
    C = A.shape[-1]
    batch = A.shape[:-2]
    P = 1 << (C - 1).bit_length()  # next power of two ≥ C
    if P != C:
        A = jnp.pad(A, [(0, 0)] * len(batch) + [(0, P - C), (0, P - C)])
    ein = matmul(precision)
    i = jnp.arange(P)
    D = jnp.broadcast_to(jnp.eye(P, dtype=A.dtype), A.shape)  # inverses of the 1 × 1 blocks
    s = 1
    while s < P:
        # (i, j) in a lower-left quarter: the same 2s-block, i in its second half, j in its first.
        quarter = ((i[:, None] // (2 * s) == i[None, :] // (2 * s))
                   & ((i[:, None] // s) % 2 == 1) & ((i[None, :] // s) % 2 == 0))
        L = jnp.where(quarter, A, 0.0)
        D = D - ein("...ij,...jk->...ik", D, ein("...ij,...jk->...ik", L, D))
        s *= 2
    return D[..., :C, :C]


_unit_lower_inverse = jax.custom_vjp(_blocked_inverse, nondiff_argnums=(0,))


def _inverse_fwd(precision, A):
    T = _blocked_inverse(precision, A)
    return T, T


def _inverse_bwd(precision, T, dT):
    # d(M⁻¹) = −M⁻¹ dM M⁻¹ with M = I + A; only A's strictly lower entries are inputs.
    ein = matmul(precision)
    dA = -ein("...ji,...jk->...ik", T, ein("...ij,...kj->...ik", dT, T))
    C = T.shape[-1]
    return (jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), dA, 0.0),)


_unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _segment_cumsum(g, starts):
    """Σ g_l over s ≤ l ≤ i along the last axis, s the last position ≤ i with starts_s (else 0):
    an associative scan whose sums hold one segment's own terms only (no subtraction of running
    sums, which in fp32 would lose a document's small decays next to an earlier one's large)."""

    def combine(a, b):
        (ga, sa), (gb, sb) = a, b
        return jnp.where(sb, gb, ga + gb), sa | sb

    return jax.lax.associative_scan(combine, (g, starts), axis=-1)[0]


def chunked_gated_delta_rule(q, k, v, g, beta, chunk=64, initial_state=None, precision=DEFAULT_PRECISION,
                             resets=None):
    """The chunked (WY/UT-transform) form, equal to `recurrent_gated_delta_rule` for any T.
    Same arguments and results; `chunk` is the block length C (T is padded to a multiple);
    `precision` of every matmul (PRECISIONS: the state and every elementwise term stay fp32);
    `resets` [B, T] bool or None as the recurrence's (document starts, anywhere in a chunk:
    the module docstring's masks)."""
    f32 = jnp.float32
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    state = _zero_state(q, v) if initial_state is None else initial_state.astype(f32)
    C = int(chunk)
    pad = (-T) % C
    if pad:
        pad_t = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        q, k, v, g, beta = (pad_t(a) for a in (q, k, v, g, beta))
        if resets is not None:  # padded steps continue the last document: its state is the result
            resets = pad_t(resets)
    N = (T + pad) // C

    # [B, N*C, H, ...] -> [N, B, H, C, ...]: chunks lead (the scan axis), positions last-but-one.
    def chunks(a):
        a = a.reshape(B, N, C, H, *a.shape[3:])
        return jnp.moveaxis(a, (1, 2, 3), (0, 3, 2))

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))  # g, beta: [N, B, H, C]
    ein = matmul(precision)

    if resets is None:
        gamma = jnp.cumsum(g, axis=-1)  # [N, B, H, C], ≤ 0, non-increasing
    else:
        r = jnp.moveaxis(jnp.asarray(resets, bool).reshape(B, N, C), 1, 0)[:, :, None, :]  # [N, B, 1, C]
        gamma = _segment_cumsum(g, jnp.broadcast_to(r, g.shape))  # per document, ≤ 0
        doc = jnp.cumsum(r, axis=-1, dtype=jnp.int32)  # documents begun in the chunk up to i
        same = doc[..., :, None] == doc[..., None, :]  # [N, B, 1, C, C]: i, j in one document
        carry = doc == 0  # i's document continues from the previous chunk: S₀ reaches it
        last = doc == doc[..., -1:]  # j's document is the chunk's last: it writes S_C
    i = jnp.arange(C)
    causal = i[:, None] >= i[None, :]  # j ≤ i
    strict = i[:, None] > i[None, :]  # j < i
    diff = gamma[..., :, None] - gamma[..., None, :]  # γ_i − γ_j
    # [N, B, H, C, C], 0 above the diagonal (and between documents: A and intra inherit it)
    decay = jnp.exp(jnp.where(causal if resets is None else causal & same, diff, -jnp.inf))

    kk = ein("nbhid,nbhjd->nbhij", k, k)
    A = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gamma))[..., None] * k], axis=-1)
    sol = ein("nbhij,nbhjd->nbhid", unit_lower_inverse(A, precision), rhs)
    U, W = sol[..., :dv], sol[..., dv:]  # U = T βV, W = T βe^γK with T = (I + A)⁻¹
    if resets is not None:
        # S₀ reaches carried tokens only. T couples one document's tokens only (A is block-
        # diagonal, and so, exactly, is the blocked inverse) and carry is constant over a
        # document, so masking W's rows equals masking the right-hand side's.
        W = jnp.where(carry[..., None], W, 0.0)

    intra = ein("nbhid,nbhjd->nbhij", q, k) * decay
    q_dec = q * jnp.exp(gamma)[..., None]
    if resets is None:
        k_dec = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
        chunk_decay = jnp.exp(gamma[..., -1])[..., None, None]  # [N, B, H, 1, 1]
    else:
        q_dec = jnp.where(carry[..., None], q_dec, 0.0)
        # Only the last document writes S_C (masked before exp: other documents' γ_C − γ_j may
        # be > 0), and S₀ survives the chunk only if no document started in it.
        k_dec = k * jnp.exp(jnp.where(last, gamma[..., -1:] - gamma, -jnp.inf))[..., None]
        chunk_decay = jnp.where(carry[..., -1], jnp.exp(gamma[..., -1]), 0.0)[..., None, None]

    def body(S, xs):
        U, W, intra, q_dec, k_dec, cd = xs
        u = U - ein("bhck,bhkv->bhcv", W, S)
        o = ein("bhck,bhkv->bhcv", q_dec, S) + ein("bhij,bhjv->bhiv", intra, u)
        S = cd * S + ein("bhck,bhcv->bhkv", k_dec, u)
        return S, o

    state, o = jax.lax.scan(body, state, (U, W, intra, q_dec, k_dec, chunk_decay))
    o = jnp.moveaxis(o, (0, 3, 2), (1, 2, 3)).reshape(B, N * C, H, dv)  # back to [B, T, H, dv]
    return o[:, :T], state


# ----------------------------------------------------------------------------- the layer


def causal_conv(x, w, state=None, resets=None):
    """Depthwise causal conv1d, no bias: out_t = Σ_j w[j] · x_{t−K+1+j} (w[K−1] weighs the
    current step, as torch's conv1d with padding K−1). x [B, T, H, D], w [K, H, D], state
    [B, K−1, H, D] (the previous K−1 inputs; zeros at the start of a sequence); resets [B, T]
    bool or None: document starts (`document_starts`), before which inputs (the state's too)
    read as zeros, as at the start of a sequence.
    Returns (out [B, T, H, D], new state = the last K−1 inputs, of the last document only)."""
    K, T = w.shape[0], x.shape[1]
    if state is None:
        state = jnp.zeros((x.shape[0], K - 1, *x.shape[2:]), x.dtype)
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    w = w.astype(x.dtype)
    if resets is None:
        out = sum(w[j] * xp[:, j : j + T] for j in range(K))
        return out, xp[:, xp.shape[1] - (K - 1) :]
    # Each input's document index (the state's inputs: 0, before any start); a tap reads its
    # input only from the output's own document.
    doc = jnp.cumsum(jnp.asarray(resets, bool), axis=1, dtype=jnp.int32)  # [B, T]
    docp = jnp.pad(doc, ((0, 0), (K - 1, 0)))
    mine = lambda d, ref: (d == ref)[..., None, None]  # noqa: E731
    out = w[K - 1] * x + sum(w[j] * jnp.where(mine(docp[:, j : j + T], doc), xp[:, j : j + T], 0)
                             for j in range(K - 1))
    tail = xp.shape[1] - (K - 1)
    return out, jnp.where(mine(docp[:, tail:], doc[:, -1:]), xp[:, tail:], 0)


def l2_normalize(x, eps=L2_EPS):
    """x · rsqrt(Σx² + eps) over the last axis, fp32 (as fla and HF's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrence_flops(cfg_model, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one GDN layer's chunked gated delta rule
    (`chunked_gated_delta_rule`), all heads; C = chunk, N = ceil(T/C) chunks, T padded
    to N·C (the padded steps cost as much as real ones, hence the factor N·C/T):

        intra  = N·C/T · H · (2C·dk [K Kᵀ] + 2C·dk [Q Kᵀ] + 2C·dv [(QKᵀ∘decay) U])
        solve  = N·C/T · H · (4P³·log₂P/C + 2C(dk+dv))
                 [T = (I+A)⁻¹ by blocked inversion (P = C rounded up to a power of two:
                  two P×P products per round, log₂P rounds), then T [βV, βe^γK]]
        state  = N·C/T · H · 2·dk·dv · (2 + (N−1)/N)
                 [u = U − W S₀ and the readout e^γ Q S₀ each chunk; the write S += Kᵀu for
                  all but the last chunk, whose state is unused in training and dead code]

    The C×C products are full squares, as computed (cf. attention's T×T). Elementwise
    decay/mask work is not counted."""
    G = cfg_model.gdn
    H, dk, dv, C = G.n_heads, G.head_dim_k, G.head_dim_v, int(G.chunk)
    N = -(-seq_len // C)
    pad = N * C / seq_len
    P = 1 << (C - 1).bit_length()
    return {
        "intra": pad * H * (4 * C * dk + 2 * C * dv),
        "solve": pad * H * (4 * P**3 * (P.bit_length() - 1) / C + 2 * C * (dk + dv)),
        "state": pad * H * 2 * dk * dv * (2 + (N - 1) / N),
    }


def layer_flops(cfg_model, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one GDN layer beyond its weights' (summary's extra term):
    the chunked recurrence, `recurrence_flops` summed."""
    return {"gdn_recurrence": sum(recurrence_flops(cfg_model, seq_len).values())}


def _dt_bias(key, shape):
    # softplus⁻¹(dt) with dt log-uniform in [1e-3, 0.1] (Mamba-2 / Gated DeltaNet init).
    dt = jnp.exp(jax.random.uniform(key, shape) * (np.log(0.1) - np.log(1e-3)) + np.log(1e-3))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


# The initialisers GatedDeltaNet names beyond params' own, registered through the Family
# record of every family whose trunk may hold GDN layers (`models.register`).
INITIALIZERS = {
    "a_log": lambda key, shape: jnp.log(jax.random.uniform(key, shape, minval=1e-4, maxval=16.0)),
    "dt_bias": _dt_bias,
}

# GatedDeltaNet's parameters under the residual trunk's `gdn` attribute, for the summary:
# projections and conv taps are matmul weights (the depthwise conv's 2·K FLOPs per channel are
# 2 per tap weight); the decay parameters and the gated norm's weight are not.
_GDN = "trunk/layers/gdn/"
COMPONENTS = (
    ParamGroup("gdn", tuple(_GDN + n for n in ("q", "k", "v", "gate", "a", "b", "o", "conv_q", "conv_k", "conv_v"))),
    ParamGroup("gdn", tuple(_GDN + n for n in ("A_log", "dt_bias", "norm")), matmul=False),
)


def config_problems(cfg_model) -> list[str]:
    """What is wrong with the model config's gdn keys (read when the layer pattern has GDN
    layers), each naming the key and the fix."""
    G = cfg_model.gdn
    problems = [f"model.gdn.{key}={G[key]} must be positive" + why
                for key, why in (("n_heads", ""), ("head_dim_k", ""), ("head_dim_v", ""),
                                 ("conv_kernel", " (the causal convolution's width; 1 = none)"),
                                 ("chunk", " (positions per block of the chunked recurrence)"))
                if G[key] < 1]
    if G.precision not in PRECISIONS:
        problems.append(f"model.gdn.precision {G.precision!r}: one of {', '.join(PRECISIONS)} (the recurrence's "
                        "matmuls: default = bf16 operands with fp32 accumulation, highest = fp32 throughout)")
    return problems


# ----------------------------------------------------------------------------- Hugging Face


def to_hf(layer_params: Mapping, cfg_model) -> dict[str, np.ndarray]:
    """One of our `gdn.GatedDeltaNet` layers (its unstacked params: q, k, v, gate, a, b,
    A_log, dt_bias, conv_q, conv_k, conv_v, norm, o) -> the state dict of HF transformers'
    `Qwen3NextGatedDeltaNet` (names relative to the module) with
    linear_num_key_heads = linear_num_value_heads = H (ours has no grouped value heads).

    Layout differences, all resolved here:
      * `in_proj_qkvz` [H·(2dk+2dv), d] fuses q, k, v and the output gate z, grouped per key
        head: rows of head h are [q_h | k_h | v_h | z_h] (HF's `fix_query_key_value_ordering`).
      * `in_proj_ba` [2H, d] fuses b and a, per head [b_h | a_h] (b first).
      * `conv1d.weight` [2H·dk + H·dv, 1, K]: one depthwise conv over the concatenated
        channels [q (H·dk) | k (H·dk) | v (H·dv)], each head-major; tap K−1 weighs the
        current step in both (torch conv1d, left padding K−1).
      * `out_proj.weight` [d, H·dv]; `norm.weight` [dv] (Qwen3NextRMSNormGated: a plain
        weight, not 1 + weight); `A_log`, `dt_bias` [H] unchanged.
    Numerics that match without conversion: L2 norm x·rsqrt(Σx²+1e-6) in fp32, q scaled by
    dk^-½, g = −exp(A_log)·softplus(a + dt_bias), β = σ(b), gated norm eps = rms_norm_eps
    (set it to our norm_eps), SiLU on the conv output."""
    G = cfg_model.gdn
    H, dk, dv = G.n_heads, G.head_dim_k, G.head_dim_v
    p = {name: np.asarray(x, np.float32) for name, x in layer_params.items()}
    d = p["q"].shape[0]
    per_head = np.concatenate([p["q"], p["k"], p["v"], p["gate"]], axis=-1)  # [d, H, 2dk+2dv]
    ba = np.stack([p["b"], p["a"]], axis=-1)  # [d, H, 2]
    conv = np.concatenate(
        [p[f"conv_{n}"].reshape(p[f"conv_{n}"].shape[0], -1) for n in ("q", "k", "v")], axis=1
    )  # [K, 2H·dk + H·dv]
    out = {
        "in_proj_qkvz.weight": per_head.reshape(d, H * (2 * dk + 2 * dv)).T,
        "in_proj_ba.weight": ba.reshape(d, 2 * H).T,
        "conv1d.weight": conv.T[:, None, :],
        "dt_bias": p["dt_bias"],
        "A_log": p["A_log"],
        "norm.weight": p["norm"],
        "out_proj.weight": p["o"].reshape(H * dv, d).T,
    }
    return {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in out.items()}


def from_hf(sd: Mapping[str, np.ndarray], cfg_model) -> dict[str, np.ndarray]:
    """The inverse of `to_hf`: a Qwen3NextGatedDeltaNet state dict (names relative
    to the module) -> our GDN layer's parameters (unstacked)."""
    G = cfg_model.gdn
    H, dk, dv = G.n_heads, G.head_dim_k, G.head_dim_v
    qkvz = sd["in_proj_qkvz.weight"].T
    d = qkvz.shape[0]
    per_head = qkvz.reshape(d, H, 2 * dk + 2 * dv)
    ba = sd["in_proj_ba.weight"].T.reshape(d, H, 2)
    conv = sd["conv1d.weight"][:, 0, :].T  # [K, 2H·dk + H·dv]
    K = conv.shape[0]
    out = {
        "q": per_head[..., :dk], "k": per_head[..., dk:2 * dk],
        "v": per_head[..., 2 * dk:2 * dk + dv], "gate": per_head[..., 2 * dk + dv:],
        "b": ba[..., 0], "a": ba[..., 1],
        "conv_q": conv[:, :H * dk].reshape(K, H, dk), "conv_k": conv[:, H * dk:2 * H * dk].reshape(K, H, dk),
        "conv_v": conv[:, 2 * H * dk:].reshape(K, H, dv),
        "dt_bias": sd["dt_bias"], "A_log": sd["A_log"], "norm": sd["norm.weight"],
        "o": sd["out_proj.weight"].T.reshape(H, dv, d),
    }
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_config(cfg_model) -> dict:
    """model.gdn's keys as Qwen3-Next names them (OnonaConfig; no grouped value heads)."""
    G = cfg_model.gdn
    return dict(linear_num_key_heads=int(G.n_heads), linear_num_value_heads=int(G.n_heads),
                linear_key_head_dim=int(G.head_dim_k), linear_value_head_dim=int(G.head_dim_v),
                linear_conv_kernel_dim=int(G.conv_kernel))


def config_from_hf(hf: dict, cfg_model) -> None:
    """model.gdn's keys from a config.json (the inverse of `hf_config`)."""
    if int(hf["linear_num_key_heads"]) != int(hf["linear_num_value_heads"]):
        raise ValueError("cannot import grouped GDN value heads (linear_num_value_heads != linear_num_key_heads)")
    cfg_model.gdn.update(n_heads=int(hf["linear_num_key_heads"]), head_dim_k=int(hf["linear_key_head_dim"]),
                         head_dim_v=int(hf["linear_value_head_dim"]), conv_kernel=int(hf["linear_conv_kernel_dim"]))


HF_LAYER = {"gdn": hf_map.prefixed("linear_attn.", hf_map.Part(to_hf, from_hf))}  # Qwen3-Next's `linear_attn`


class GatedDeltaNet(nnx.Module):
    """The GDN token mixer of SPEC §3.

    Parameters (bias-free; [in, ..., out] like the attention layer):
        q, k       [d, H, dk]     v, gate [d, H, dv]      a, b [d, H]
        A_log [H] (init log U(1e-4, 16))      dt_bias [H] (init softplus⁻¹ dt, dt ∈ [1e-3, 0.1])
        conv_q, conv_k [K, H, dk], conv_v [K, H, dv]: depthwise causal conv1d weights, the
            channels (H·D, head-major as in HF) split as [H, D]; init N(0, 0.02²) as HF's
            `_init_weights` does for nn.Conv1d.
        norm [dv]: the gated RMSNorm weight shared by heads (init ones, eps = cfg.norm_eps)
        o [H, dv, d]

    Projections and the conv run in x's dtype; L2 norm, decay, β, the recurrence and the
    gated norm in fp32; o_proj in x's dtype. The recurrence's matmuls (chunked, naive and the
    decoding step alike) run at cfg.gdn.precision (PRECISIONS).
    """

    def __init__(self, cfg, stack=None):
        d, G = cfg.d_model, cfg.gdn
        H, dk, dv, K = G.n_heads, G.head_dim_k, G.head_dim_v, G.conv_kernel
        self.q = param((d, H, dk), ("embed", "gdn_heads", "head_dim"), stack=stack)
        self.k = param((d, H, dk), ("embed", "gdn_heads", "head_dim"), stack=stack)
        self.v = param((d, H, dv), ("embed", "gdn_heads", "head_dim"), stack=stack)
        self.gate = param((d, H, dv), ("embed", "gdn_heads", "head_dim"), stack=stack)
        self.a = param((d, H), ("embed", "gdn_heads"), stack=stack)
        self.b = param((d, H), ("embed", "gdn_heads"), stack=stack)
        self.A_log = param((H,), ("gdn_heads",), "a_log", stack=stack)
        self.dt_bias = param((H,), ("gdn_heads",), "dt_bias", stack=stack)
        self.conv_q = param((K, H, dk), ("conv", "gdn_heads", "head_dim"), stack=stack)
        self.conv_k = param((K, H, dk), ("conv", "gdn_heads", "head_dim"), stack=stack)
        self.conv_v = param((K, H, dv), ("conv", "gdn_heads", "head_dim"), stack=stack)
        self.norm = param((dv,), ("norm",), "ones", stack=stack)
        self.o = param((H, dv, d), ("gdn_heads", "head_dim", "embed"), stack=stack)
        self.eps, self.chunk, self.kernel, self.precision = cfg.norm_eps, G.chunk, K, G.precision
        self.heads, self.dk, self.dv = H, dk, dv

    # -- pieces shared by the full-sequence and the step forms

    def _inputs(self, x, conv_state, resets=None):
        """(q, k, v, g, beta, gate, new conv state) for x [B, T, d]; `resets` (document starts)
        for the conv."""
        dt = x.dtype
        proj = lambda w: jnp.einsum("btd,dhe->bthe", x, w[...].astype(dt))  # noqa: E731
        conv_state = conv_state or {}
        new_conv, qkv = {}, []
        for name in ("q", "k", "v"):
            y = constrain(proj(getattr(self, name)), ("batch", "seq", "act_heads", None))
            y, new_conv[name] = causal_conv(y, getattr(self, f"conv_{name}")[...], conv_state.get(name), resets)
            qkv.append(jax.nn.silu(y))
        q, k, v = qkv
        q = l2_normalize(q) * (self.dk**-0.5)
        k = l2_normalize(k)
        a = jnp.einsum("btd,dh->bth", x, self.a[...].astype(dt)).astype(jnp.float32)
        b = jnp.einsum("btd,dh->bth", x, self.b[...].astype(dt)).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...])
        beta = jax.nn.sigmoid(b)
        gate = proj(self.gate)
        return q, k, v.astype(jnp.float32), g, beta, gate, new_conv

    def _output(self, o, gate, dtype):
        """o_proj(rmsnorm(o) · w · silu(gate)); o [B, T, H, dv] fp32."""
        o = o * jax.lax.rsqrt(jnp.mean(jnp.square(o), axis=-1, keepdims=True) + self.eps)
        o = o * self.norm[...].astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        o = constrain(o.astype(dtype), ("batch", "seq", "act_heads", None))
        return jnp.einsum("bthv,hvd->btd", o, self.o[...].astype(dtype))

    # -- public forms

    def init_cache(self, batch: int, max_len: int = 0, dtype=jnp.float32) -> dict:
        """Decoding cache: the last K−1 projected q/k/v inputs of the conv, and the state
        (its size does not grow with `max_len`, which is accepted to match attention's)."""
        conv = {
            n: jnp.zeros((batch, self.kernel - 1, self.heads, dim), dtype)
            for n, dim in (("q", self.dk), ("k", self.dk), ("v", self.dv))
        }
        return {"conv": conv, "state": jnp.zeros((batch, self.heads, self.dk, self.dv), jnp.float32)}

    def forward(self, x, cache=None, recurrent: bool = False, segments=None):
        """(y [B, T, d] in x's dtype, cache after the last step). `cache` (from `init_cache`
        or a previous call) continues a sequence; `recurrent` uses the naive per-step scan
        instead of the chunked form (same result); `segments` [B, T] int (each token's document
        id, packed rows) or None: conv and state restart at each document's first token
        (`document_starts`), and the cache returned is the last document's."""
        cache = cache or {}
        resets = None if segments is None else document_starts(segments)
        q, k, v, g, beta, gate, conv = self._inputs(x, cache.get("conv"), resets)
        if recurrent:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, cache.get("state"), self.precision, resets)
        else:
            o, state = chunked_gated_delta_rule(q, k, v, g, beta, self.chunk, cache.get("state"), self.precision,
                                                resets)
        return self._output(o, gate, x.dtype), {"conv": conv, "state": state}

    def step(self, x_t, cache):
        """One decoding step with `gated_delta_step`: x_t [B, d] -> (y_t [B, d], cache)."""
        q, k, v, g, beta, gate, conv = self._inputs(x_t[:, None], cache["conv"])
        o, state = gated_delta_step(cache["state"], q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], self.precision)
        y = self._output(o[:, None], gate, x_t.dtype)
        return y[:, 0], {"conv": conv, "state": state}

    def extend(self, x, positions, cache, length, start):
        """T new tokens x [B, T, d] after `cache` (the decoding interface attention has):
        the chunked form for a prompt, `step` (the naive recurrence) for one token. Left pads
        (slots before `start`) get a zero input: the layer has no biases, so their q, k, v are
        zero and they write nothing into the (still zero) state and leave zeros in the conv
        window, exactly as if they were absent. `positions` is unused."""
        T = x.shape[1]
        valid = (length + jnp.arange(T))[None, :] >= start[:, None]
        x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
        if T == 1:
            y, cache = self.step(x[:, 0], cache)
            return y[:, None], cache
        return self.forward(x, cache)

    def __call__(self, x, positions=None, segments=None):
        """y [B, T, d] in x's dtype; `positions` is unused (GDN has no positional encoding);
        `segments` [B, T] int or None: packed documents, each computed as if alone (`forward`)."""
        return self.forward(x, segments=segments)[0]
