"""Reference math the tests hold the package to (not used by the package itself): the heads'
log-probabilities written out per head, and the fused loss's whole-logits counterparts."""

import jax
import jax.numpy as jnp

from onona_jax import heads
from onona_jax.loss import F32, _check, _component, _score, plain_log_probs


def mix(log_p_a: jax.Array, log_p_b: jax.Array, z: jax.Array) -> jax.Array:
    """log(σ(z)·p_a + σ(−z)·p_b) in log space; stable for any |z| (logsigmoid, not log∘sigmoid)."""
    return jnp.logaddexp(log_p_a + jax.nn.log_sigmoid(z), log_p_b + jax.nn.log_sigmoid(-z))


def standard_log_probs(h, E):
    return heads.log_softmax(heads.logits(h, E))


def twin_log_probs(h, x0, A, B, w):
    """onóna (SPEC §1): logaddexp(log_softmax(hAᵀ) + logσ(z), log_softmax(hBᵀ) + logσ(−z))."""
    z = heads.gate_logit(x0, w)[..., None]
    return mix(heads.log_softmax(heads.logits(h, A)), heads.log_softmax(heads.logits(h, B)), z)


def standard_target_log_probs(h, E, targets):
    return heads.target_log_softmax(heads.logits(h, E), targets)


def twin_target_log_probs(h, x0, A, B, w, targets):
    return heads.table_target_log_probs(h, (A, B), targets, heads.gate_logit(x0, w))


def sigsoftmax_log_probs(h, E):
    """p ∝ exp(z)σ(z), z = hEᵀ (Kanai et al., 2018)."""
    return heads.log_softmax(heads.sigsoftmax_scores(heads.logits(h, E)))


def sigsoftmax_target_log_probs(h, E, targets):
    return heads.target_log_softmax(heads.sigsoftmax_scores(heads.logits(h, E)), targets)


def mos_log_probs(h, E, W, W_prior, sig: bool = False):
    """Mixture of softmaxes (Yang et al., 2018): Σ_k π_k softmax(E tanh(W_k h)), in log space;
    `sig` makes each component a sigsoftmax (MoSS)."""
    log_prior, contexts = heads._mos_parts(h, W, W_prior)
    z = heads.logits(contexts, E)  # [..., K, V]
    comp = heads.log_softmax(heads.sigsoftmax_scores(z) if sig else z)
    return jax.nn.logsumexp(log_prior[..., None] + comp, axis=-2)


def mixture_log_probs(hs, tables, log_weights, *, score=None):
    """Full fp32 log-probabilities [N, V] of a `loss` mixture (parity reference)."""
    K, tables = _check(hs, tables, log_weights, score)
    comps = []
    for k in range(K):
        h, T = _component(hs, tables, k)
        z = jnp.einsum("nd,vd->nv", h, T.astype(h.dtype), preferred_element_type=F32)
        comps.append(jax.nn.log_softmax(_score(z, score)[0], axis=-1))
    if K == 1:
        return comps[0]
    return jax.nn.logsumexp(log_weights.astype(F32)[:, :, None] + jnp.stack(comps, axis=1), axis=1)


def plain_mixture_nll(hs, tables, log_weights, targets, weights, *, score=None, token_tile=None, layout=None):
    """`loss.mixture_nll` by plain autodiff (parity reference; token_tile and layout are ignored)."""
    logp = plain_log_probs(hs, tables, log_weights, targets, score=score)
    return -jnp.sum(weights.astype(F32) * logp), logp
