"""Output heads: pure functions of arrays, and thin modules that own the vocabulary tables.

Every head answers three questions for a hidden state h (after the final norm) and the
input-embedding row x0 of the same position:

* `embed(tokens)`            -> x0, what the decoder body reads,
* `log_probs(h, x0)`         -> fp32 log-probabilities [..., V] (evaluation, parity tests),
* `target_log_probs(h, x0, targets)` -> fp32 log p(target) [...] (the training loss).

`target_log_probs` never builds a [tokens, V] log-probability tensor: it needs only the
log-sum-exp of each table's logits and the target's logit. The logits themselves come out of
the matmul in the compute dtype and every reduction runs in fp32.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from onona_jax.params import param

# The paper's gate uses torch's `F.rms_norm(x0, (d,))` with eps=None, i.e. finfo(fp32).eps.
GATE_EPS = float(jnp.finfo(jnp.float32).eps)


# ----------------------------------------------------------------------------- pure math


def rms_normalize(x: jax.Array, eps: float = GATE_EPS) -> jax.Array:
    """RMS normalisation without a learned weight, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def gate_logit(x0: jax.Array, w: jax.Array) -> jax.Array:
    """z = wᵀ rmsnorm(x0), fp32, shape x0.shape[:-1]."""
    return rms_normalize(x0) @ w.astype(jnp.float32)


def logits(h: jax.Array, table: jax.Array) -> jax.Array:
    """h @ tableᵀ in h's dtype (bf16 matmul where the config asks)."""
    return jnp.einsum("...d,vd->...v", h, table.astype(h.dtype))


def log_softmax(z: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)


def target_log_softmax(z: jax.Array, targets: jax.Array) -> jax.Array:
    """log_softmax(z)[target] without materialising the full log-softmax."""
    lse = jax.nn.logsumexp(z.astype(jnp.float32), axis=-1)
    tgt = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return tgt - lse


def mix(log_p_a: jax.Array, log_p_b: jax.Array, z: jax.Array) -> jax.Array:
    """log(σ(z)·p_a + σ(−z)·p_b) in log space; stable for any |z| (logsigmoid, not log∘sigmoid)."""
    return jnp.logaddexp(log_p_a + jax.nn.log_sigmoid(z), log_p_b + jax.nn.log_sigmoid(-z))


def standard_log_probs(h, E):
    return log_softmax(logits(h, E))


def twin_log_probs(h, x0, A, B, w):
    """onóna (SPEC §1): logaddexp(log_softmax(hAᵀ) + logσ(z), log_softmax(hBᵀ) + logσ(−z))."""
    z = gate_logit(x0, w)[..., None]
    return mix(log_softmax(logits(h, A)), log_softmax(logits(h, B)), z)


def standard_target_log_probs(h, E, targets):
    return target_log_softmax(logits(h, E), targets)


def twin_target_log_probs(h, x0, A, B, w, targets):
    z = gate_logit(x0, w)
    return mix(
        target_log_softmax(logits(h, A), targets), target_log_softmax(logits(h, B), targets), z
    )


# ----------------------------------------------------------------------------- modules


def _rows(table: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(table, tokens, axis=0)


class StandardHead(nnx.Module):
    """Tied head: one table E for input and output. E shares its init key with twin's A,
    so the factorial cells start from the same table (SPEC §2)."""

    def __init__(self, vocab: int, d: int):
        self.embedding = param((vocab, d), ("vocab", "embed"), init_name="tables/A")

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def log_probs(self, h, x0):
        return standard_log_probs(h, self.embedding[...])

    def target_log_probs(self, h, x0, targets):
        return standard_target_log_probs(h, self.embedding[...], targets)


class TwinHead(nnx.Module):
    """onóna: tables A and B, the body reads M = (A+B)/2, the head mixes two softmaxes with
    a gate that reads only the input token."""

    def __init__(self, vocab: int, d: int):
        self.A = param((vocab, d), ("vocab", "embed"), init_name="tables/A")
        self.B = param((vocab, d), ("vocab", "embed"), init_name="tables/B")
        self.gate = param((d,), ("embed",), init_name="tables/gate")

    def embed(self, tokens):
        # Gathering two rows is cheaper than forming M; (a+b)*0.5 is bitwise ((A+B)/2)[x].
        return (_rows(self.A[...], tokens) + _rows(self.B[...], tokens)) * 0.5

    def merged(self):
        return (self.A[...] + self.B[...]) * 0.5

    def log_probs(self, h, x0):
        return twin_log_probs(h, x0, self.A[...], self.B[...], self.gate[...])

    def target_log_probs(self, h, x0, targets):
        return twin_target_log_probs(h, x0, self.A[...], self.B[...], self.gate[...], targets)


HEADS: dict[str, Callable[[int, int], nnx.Module]] = {
    "standard": StandardHead,
    "twin": TwinHead,
}


def make_head(name: str, vocab: int, d: int) -> nnx.Module:
    if name not in HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of {sorted(HEADS)}")
    return HEADS[name](vocab, d)
