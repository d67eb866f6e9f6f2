"""Output heads: pure functions of arrays, and thin modules that own the vocabulary tables.

Every head answers three questions for a hidden state h (after the final norm) and the
input-embedding row x0 of the same position:

* `embed(tokens)`            -> x0, what the decoder body reads,
* `log_probs(h, x0)`         -> fp32 log-probabilities [..., V] (evaluation, parity tests),
* `target_log_probs(h, x0, targets)` -> fp32 log p(target) [...] (the training loss).

`target_log_probs` never builds a [tokens, V] log-probability tensor: it needs only the
log-sum-exp of each table's logits and the target's logit. With `model.loss = "fused"` (the
default) not even the logits exist whole: `fused.py` streams the vocabulary in tiles and
recomputes them in the backward pass. Every reduction runs in fp32.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from onona_jax import fused, fused_mixture
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
    return table_target_log_probs(h, (A, B), targets, gate_logit(x0, w))


def sigsoftmax_scores(z: jax.Array) -> jax.Array:
    """log(exp(z)·σ(z)) = 2z − softplus(z), fp32: sigsoftmax's unnormalised log-probabilities."""
    z = z.astype(jnp.float32)
    return 2.0 * z - jax.nn.softplus(z)


def sigsoftmax_log_probs(h, E):
    """p ∝ exp(z)σ(z), z = hEᵀ (Kanai et al., 2018)."""
    return log_softmax(sigsoftmax_scores(logits(h, E)))


def sigsoftmax_target_log_probs(h, E, targets):
    return target_log_softmax(sigsoftmax_scores(logits(h, E)), targets)


def _mos_parts(h, W, W_prior):
    """Mixture prior log π = log_softmax(h W_π) [..., K] and contexts tanh(W_k h) [..., K, d]."""
    log_prior = log_softmax(h @ W_prior.astype(h.dtype))
    contexts = jnp.tanh(jnp.einsum("...d,kde->...ke", h, W.astype(h.dtype)))
    return log_prior, contexts


def mos_log_probs(h, E, W, W_prior, sig: bool = False):
    """Mixture of softmaxes (Yang et al., 2018): Σ_k π_k softmax(E tanh(W_k h)), in log space;
    `sig` makes each component a sigsoftmax (MoSS)."""
    log_prior, contexts = _mos_parts(h, W, W_prior)
    z = logits(contexts, E)  # [..., K, V]
    comp = log_softmax(sigsoftmax_scores(z) if sig else z)
    return jax.nn.logsumexp(log_prior[..., None] + comp, axis=-2)


def mos_target_log_probs(h, E, W, W_prior, targets, sig: bool = False):
    log_prior, contexts = _mos_parts(h, W, W_prior)
    z = logits(contexts, E)
    k_targets = jnp.broadcast_to(targets[..., None], z.shape[:-1])
    comp = target_log_softmax(sigsoftmax_scores(z) if sig else z, k_targets)  # [..., K]
    return jax.nn.logsumexp(log_prior + comp, axis=-1)


def input_gate_rows(a_rows, b_rows, w):
    """The input-gate control: g·A[x] + (1−g)·B[x] with g = σ(wᵀ rmsnorm(M[x]))."""
    g = jax.nn.sigmoid(gate_logit((a_rows + b_rows) * 0.5, w))[..., None]
    return g * a_rows + (1.0 - g) * b_rows


def table_target_log_probs(h, tables, targets, z=None, loss: str = "plain", chunk: int = 4096):
    """log p(target) under softmax(h Tᵀ) (one table) or the gated mixture of two (z the gate
    logit): plainly, or fused and chunked over the vocabulary (`fused.py`), which never holds
    more than a [tokens, chunk] tile of logits and shards the vocabulary on the mesh."""
    if loss == "fused":
        return fused.sharded_target_log_probs(h, tables, targets, z, chunk)
    parts = [target_log_softmax(logits(h, T), targets) for T in tables]
    return parts[0] if len(parts) == 1 else mix(*parts, z)


# ----------------------------------------------------------------------------- modules


def _rows(table: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(table, tokens, axis=0)


# Init names: the tables that play the same role share a name across heads, so the 2×2
# factorial cells (and standard vs twin) start from identical A (SPEC §2).
def _table(vocab, d, name):
    return param((vocab, d), ("vocab", "embed"), init_name=f"tables/{name}")


def _gate(d):
    return param((d,), ("embed",), init_name="tables/gate")


class Head(nnx.Module):
    """Base: the loss implementation (`model.loss`: fused | fused_vocab | plain), its token
    tile (fused) and vocabulary chunk (fused_vocab).

    Every head is a mixture of softmaxes (`mixture`), and with `loss="fused"` its loss and
    log p(target) come from `fused_mixture.mixture_nll`, which never builds [tokens, V]
    logits and computes the gradients in its forward pass."""

    def __init__(self, cfg):
        self.loss, self.chunk = cfg.loss, cfg.loss_chunk
        self.token_tile = cfg.get("loss_token_tile", fused_mixture.DEFAULT_TOKEN_TILE)

    def mixture(self, h, x0):
        """(hs, tables, log_weights, score) of `fused_mixture.mixture_nll` (no leading-dim
        flattening): h shared by one table here; heads with more components override."""
        raise NotImplementedError

    def nll(self, h, x0, targets, weights):
        """(Σ weights·(−log p(target)), log p(target)): the training loss with per-token
        weights [...] (1/N for the mean), fused (gradients in the forward pass) or plain."""
        if self.loss == "fused":
            hs, tables, lw, score = self.mixture(h, x0)
            return fused_mixture.head_nll(hs, tables, lw, targets, weights, score=score,
                                          token_tile=self.token_tile)
        logp = self.target_log_probs(h, x0, targets)
        return -jnp.sum(weights.astype(jnp.float32) * logp), logp

    def _fused_target(self, h, x0, targets):
        return self.nll(h, x0, targets, jnp.zeros(targets.shape, jnp.float32))[1]

    def _target(self, h, tables, targets, z=None):
        if self.loss == "fused":  # the mixture of these tables (logσ(±z) weights for two)
            lw = None if z is None else jnp.stack([jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)], axis=-1)
            zeros = jnp.zeros(targets.shape, jnp.float32)
            return fused_mixture.head_nll(h, tables, lw, targets, zeros, token_tile=self.token_tile)[1]
        loss = "fused" if self.loss == "fused_vocab" else self.loss  # the vocabulary-tiled fused.py
        return table_target_log_probs(h, tables, targets, z, loss, self.chunk)


class StandardHead(Head):
    """Tied head: one table E for input and output (E shares its init with twin's A)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.embedding = _table(cfg.vocab_size, cfg.d_model, "A")

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def mixture(self, h, x0):
        return h, (self.embedding[...],), None, None

    def log_probs(self, h, x0):
        return standard_log_probs(h, self.embedding[...])

    def target_log_probs(self, h, x0, targets):
        return self._target(h, (self.embedding[...],), targets)


class TwinHead(Head):
    """onóna: tables A and B, the body reads M = (A+B)/2, the head mixes two softmaxes with
    a gate that reads only the input token."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.A = _table(cfg.vocab_size, cfg.d_model, "A")
        self.B = _table(cfg.vocab_size, cfg.d_model, "B")
        self.gate = _gate(cfg.d_model)

    def embed(self, tokens):
        # Gathering two rows is cheaper than forming M; (a+b)*0.5 is bitwise ((A+B)/2)[x].
        return (_rows(self.A[...], tokens) + _rows(self.B[...], tokens)) * 0.5

    def merged(self):
        return (self.A[...] + self.B[...]) * 0.5

    def gate_rows(self, tokens):
        """The rows the gate reads: the input rows, M[x] here."""
        return self.embed(tokens)

    def gate_probs(self, tokens):
        """g = σ(wᵀ rmsnorm(gate rows)) per token, fp32 (for logging and serving)."""
        return jax.nn.sigmoid(gate_logit(self.gate_rows(tokens), self.gate[...]))

    def mixture(self, h, x0):
        z = gate_logit(x0, self.gate[...])
        return h, (self.A[...], self.B[...]), jnp.stack([jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)], -1), None

    def log_probs(self, h, x0):
        return twin_log_probs(h, x0, self.A[...], self.B[...], self.gate[...])

    def target_log_probs(self, h, x0, targets):
        return self._target(h, (self.A[...], self.B[...]), targets, gate_logit(x0, self.gate[...]))


class UntiedHead(Head):
    """Separate input table E and output table W (+Vd)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.embedding = _table(cfg.vocab_size, cfg.d_model, "A")
        self.unembedding = _table(cfg.vocab_size, cfg.d_model, "unembedding")

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def mixture(self, h, x0):
        return h, (self.unembedding[...],), None, None

    def log_probs(self, h, x0):
        return standard_log_probs(h, self.unembedding[...])

    def target_log_probs(self, h, x0, targets):
        return self._target(h, (self.unembedding[...],), targets)


class SigsoftmaxHead(StandardHead):
    """Tied table, sigsoftmax output p ∝ exp(z)σ(z) (no extra parameters)."""

    def mixture(self, h, x0):
        return h, (self.embedding[...],), None, "sigsoftmax"

    def log_probs(self, h, x0):
        return sigsoftmax_log_probs(h, self.embedding[...])

    def target_log_probs(self, h, x0, targets):
        if self.loss == "fused":
            return self._fused_target(h, x0, targets)
        return sigsoftmax_target_log_probs(h, self.embedding[...], targets)


class MoSHead(Head):
    """Tied table, K-component mixture of softmaxes (or sigsoftmaxes: MoSS); bias-free,
    +K·d² + K·d parameters (2d² + 2d at K = 2)."""

    def __init__(self, cfg, sig: bool = False):
        super().__init__(cfg)
        d, K = cfg.d_model, cfg.mos_components
        self.embedding = _table(cfg.vocab_size, d, "A")
        self.mos_proj = param((K, d, d), (None, "embed", None))
        self.mos_prior = param((d, K), ("embed", None))
        self.sig = sig

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def mixture(self, h, x0):
        log_prior, contexts = _mos_parts(h, self.mos_proj[...], self.mos_prior[...])
        return contexts, (self.embedding[...],), log_prior, ("sigsoftmax" if self.sig else None)

    def log_probs(self, h, x0):
        return mos_log_probs(h, self.embedding[...], self.mos_proj[...], self.mos_prior[...], self.sig)

    def target_log_probs(self, h, x0, targets):
        if self.loss == "fused":
            return self._fused_target(h, x0, targets)
        return mos_target_log_probs(
            h, self.embedding[...], self.mos_proj[...], self.mos_prior[...], targets, self.sig
        )


class InputGateHead(TwinHead):
    """Control: the gate mixes the *input* rows, g·A[x] + (1−g)·B[x]; the output is a single
    softmax(Mh) with M = (A+B)/2."""

    def embed(self, tokens):
        return input_gate_rows(_rows(self.A[...], tokens), _rows(self.B[...], tokens), self.gate[...])

    def gate_rows(self, tokens):
        return TwinHead.embed(self, tokens)  # the gate reads M[x], the body reads the gated mix

    def mixture(self, h, x0):
        return h, (self.merged(),), None, None

    def log_probs(self, h, x0):
        return standard_log_probs(h, self.merged())

    def target_log_probs(self, h, x0, targets):
        return self._target(h, (self.merged(),), targets)


class TwinInputOnlyHead(Head):
    """Factorial cell: twin input M[x], single output softmax(Ah) (+Vd)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.A = _table(cfg.vocab_size, cfg.d_model, "A")
        self.B = _table(cfg.vocab_size, cfg.d_model, "B")

    def embed(self, tokens):
        return (_rows(self.A[...], tokens) + _rows(self.B[...], tokens)) * 0.5

    def mixture(self, h, x0):
        return h, (self.A[...],), None, None

    def log_probs(self, h, x0):
        return standard_log_probs(h, self.A[...])

    def target_log_probs(self, h, x0, targets):
        return self._target(h, (self.A[...],), targets)


class TwinOutputOnlyHead(TwinHead):
    """Factorial cell: input A[x], the twin output mixture with the gate reading A[x]."""

    def embed(self, tokens):
        return _rows(self.A[...], tokens)


HEADS: dict[str, Callable] = {
    "standard": StandardHead,
    "twin": TwinHead,
    "untied": UntiedHead,
    "mos": MoSHead,
    "sigsoftmax": SigsoftmaxHead,
    "moss": lambda cfg: MoSHead(cfg, sig=True),
    "input_gate": InputGateHead,
    "twin_input_only": TwinInputOnlyHead,
    "twin_output_only": TwinOutputOnlyHead,
}


def make_head(cfg) -> nnx.Module:
    if cfg.head not in HEADS:
        raise ValueError(f"unknown head {cfg.head!r}; choose one of {sorted(HEADS)}")
    return HEADS[cfg.head](cfg)
