"""Output heads: pure functions of arrays, and thin modules that own the vocabulary tables.

Every head answers three questions for a hidden state h (after the final norm) and the
input-embedding row x0 of the same position:

* `embed(tokens)`            -> x0, what the decoder body reads,
* `log_probs(h, x0)`         -> fp32 log-probabilities [..., V] (evaluation, parity tests),
* `target_log_probs(h, x0, targets)` -> fp32 log p(target) [...] (evaluation),
* `nll(h, x0, targets, weights)` -> the weighted training loss and log p(target).

Every head's output is a `Mixture` of softmax components, and the losses read only that.
Neither builds a [tokens, V] log-probability tensor; with `model.loss = "fused"` (the
default) not even the logits exist whole: `loss.py` computes them one tile of tokens at a
time, with the gradients, in the forward pass. Every reduction runs in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from onona_jax import loss as loss_lib
from onona_jax import loss_vocab
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


def sigsoftmax_scores(z: jax.Array) -> jax.Array:
    """log(exp(z)·σ(z)) = 2z − softplus(z), fp32: sigsoftmax's unnormalised log-probabilities."""
    z = z.astype(jnp.float32)
    return 2.0 * z - jax.nn.softplus(z)


def _mos_parts(h, W, W_prior):
    """Mixture prior log π = log_softmax(h W_π) [..., K] and contexts tanh(W_k h) [..., K, d]."""
    log_prior = log_softmax(h @ W_prior.astype(h.dtype))
    contexts = jnp.tanh(jnp.einsum("...d,kde->...ke", h, W.astype(h.dtype)))
    return log_prior, contexts


def input_gate_rows(a_rows, b_rows, w):
    """The input-gate control: g·A[x] + (1−g)·B[x] with g = σ(wᵀ rmsnorm(M[x]))."""
    g = jax.nn.sigmoid(gate_logit((a_rows + b_rows) * 0.5, w))[..., None]
    return g * a_rows + (1.0 - g) * b_rows


class Mixture(NamedTuple):
    """A head's output distribution for hidden states h, as a mixture of K softmax components:

        p(v) = Σ_k exp(log_weights_k) · softmax_v(score(hs_k · tables_kᵀ))

    hs: [..., d] (every component reads h) or [..., K, d] (one per component: MoS contexts);
    tables: K tables [V, d], or one table shared by every component; log_weights: [..., K]
    fp32, None for K = 1; score: None, or "sigsoftmax" (2z − softplus(z) in place of z).
    Standard: K = 1. Twin: tables (A, B), log weights logσ(±z). MoS: K contexts over E,
    log π. The loss (`loss.py`) and evaluation read only this, never the head's internals."""

    hs: jax.Array
    tables: tuple
    log_weights: jax.Array | None = None
    score: str | None = None

    @property
    def shared_h(self) -> bool:
        return len(self.tables) > 1 or self.log_weights is None


def component_scores(m: Mixture) -> list[jax.Array]:
    """Each component's scores [..., V]: its logits, or their sigsoftmax transform."""
    K = 1 if m.log_weights is None else m.log_weights.shape[-1]
    out = []
    for k in range(K):
        h = m.hs if m.shared_h else m.hs[..., k, :]
        z = logits(h, m.tables[k if len(m.tables) > 1 else 0])
        out.append(sigsoftmax_scores(z) if m.score == "sigsoftmax" else z)
    return out


def component_logits(m: Mixture) -> list[jax.Array]:
    """fp32 log-softmax of each component, [..., V] each."""
    return [log_softmax(z) for z in component_scores(m)]


def mixture_log_probs(m: Mixture) -> jax.Array:
    """fp32 log p [..., V] of a mixture (evaluation, serving; builds [..., V] per component)."""
    parts = component_logits(m)
    if m.log_weights is None:
        return parts[0]
    if len(parts) == 2:  # the twin form, logaddexp: bitwise as `mix` and `twin_log_probs`
        return jnp.logaddexp(parts[0] + m.log_weights[..., 0:1], parts[1] + m.log_weights[..., 1:2])
    return jax.nn.logsumexp(jnp.stack(parts, axis=-2) + m.log_weights[..., None], axis=-2)


def mixture_target_log_probs(m: Mixture, targets, loss: str = "plain", chunk: int = 4096, layout=None,
                             token_tile: int = 0):
    """log p(target) [...] of a mixture (`model.loss`): "fused", the token-tiled loss of
    `loss.py` for every mixture; "fused_vocab", the vocabulary-tiled one of `loss_vocab.py`
    (tiles of `chunk` rows) where it covers the mixture (components sharing h, no score
    transform); "plain", one component's logits at a time. `layout` =
    `sharding.loss_layout(mesh)` splits the vocabulary over the mesh."""
    if loss == "fused":
        zeros = jnp.zeros(targets.shape, jnp.float32)
        return loss_lib.head_nll(m.hs, m.tables, m.log_weights, targets, zeros, score=m.score,
                                 token_tile=token_tile, layout=layout)[1]
    if loss == "fused_vocab" and m.shared_h and m.score is None:
        return loss_vocab.target_log_probs(m.hs, m.tables, targets, m.log_weights, chunk, layout)
    parts = [target_log_softmax(z, targets) for z in component_scores(m)]
    if m.log_weights is None:
        return parts[0]
    if len(parts) == 2:
        return jnp.logaddexp(parts[0] + m.log_weights[..., 0], parts[1] + m.log_weights[..., 1])
    return jax.nn.logsumexp(jnp.stack(parts, axis=-1) + m.log_weights, axis=-1)


def gate_log_weights(z: jax.Array) -> jax.Array:
    """[..., 2] log mixture weights (logσ(z), logσ(−z)) of a gate logit z [...]."""
    return jnp.stack([jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)], axis=-1)


def table_target_log_probs(h, tables, targets, z=None, loss: str = "plain", chunk: int = 4096, layout=None,
                           token_tile: int = 0):
    """log p(target) under softmax(h Tᵀ) (one table) or the gated mixture of two (z the gate
    logit); see `mixture_target_log_probs`."""
    lw = None if z is None else gate_log_weights(z)
    return mixture_target_log_probs(Mixture(h, tuple(tables), lw), targets, loss, chunk, layout, token_tile)


# ----------------------------------------------------------------------------- modules
#
# Every head is a thin module that owns its parameters and declares everything the rest of
# the package needs to know of it, so nothing outside this file tests a head's name or
# counts its tables:
#
#   tables        names of its [V, d] vocabulary tables, any number (parameter counts)
#   ablations     the table ablations it reports (`ABLATION_KINDS`; twin: a_only, b_only, a_in,
#                 b_in, a_out, b_out), the table each names by `ablation_table(letter)`
#   embed(tokens), mixture(h, x0)   the forward: input rows and output distribution
#   output_projections(cfg)         V×d projections per position (FLOPs)
#   fold()        the serving and export form (`Fold`): input table, K output tables, the
#                 gate lookup (log mixture weights per input token, or None) and the mixture
#                 rule (`score`); None when the output needs more than one projection per
#                 table (MoS), so serving evaluates `log_probs` instead
#   upcycle(init_params, E)  its parameters started from a tied Standard checkpoint's table E
#                 (a method: the base refuses; a table it leaves unfilled is an error)
#   gate_reads    (symbol, definition) of the rows its gate reads, None without a gate
#   gate_probs(tokens)  the gate's weights per input token (gate analysis)
#   gate_stats(tokens)  the gate statistics the train step logs (moments; {} without a gate)


class Fold(NamedTuple):
    """A head with its input-side work done once for the whole vocabulary (serving, export).
    The body reads `input[x]`; the output is the mixture of K softmaxes

        log p(v | h, x) = logsumexp_k(log_weights[x, k] + log_softmax(score(h · outputs_kᵀ))_v)

    `log_weights` [V, K] fp32 is the gate as a lookup by input token (None: K = 1); since it
    depends on x alone, a sample of the mixture is a component k ~ exp(log_weights[x]) and
    then a sample of softmax(score(h · outputs_kᵀ)): one V×d projection per token
    (`serve.server`). `score` is the mixture rule's transform of the logits (`Mixture`)."""

    input: jax.Array  # [V, d] fp32
    outputs: tuple  # K tables [V, d]
    log_weights: jax.Array | None = None  # [V, K] fp32, the gate lookup
    score: str | None = None


# The table ablations (evaluation only: eval.py, the training loop's final validation), for a head
# whose tables include X (`<x>_<kind>`, x the table's name in lower case):
#   only   the body reads X[x] and the output is softmax(X h): one table at input and output, no
#          gate (the paper's one-table ablation, SPEC §2);
#   in     the body reads X[x]; the output is the model's own (its mixture, its gate of the input
#          token): what X alone is worth as the input table;
#   out    the body reads the model's own input rows; the output is softmax(X h): what X alone is
#          worth as the output table.
# A head declares the ones that differ from the model itself and from each other.
ABLATION_KINDS = ("only", "in", "out")


def ablation_parts(name: str) -> tuple[str, str]:
    """'a_out' -> ('a', 'out'); a name of another form is a ValueError naming the forms."""
    table, _, kind = name.rpartition("_")
    if not table or kind not in ABLATION_KINDS:
        raise ValueError(f"table ablation {name!r}: expected <table>_<kind> with kind one of "
                         f"{', '.join(ABLATION_KINDS)} (e.g. a_only, b_out)")
    return table, kind


class CannotUpcycle(ValueError):
    """A head that does not start from a Standard checkpoint (`Head.upcycle`)."""


def _rows(table: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take(table, tokens, axis=0)


# Init names: the tables that play the same role share a name across heads, so the 2×2
# factorial cells (and standard vs twin) start from identical A (SPEC §2). `scale` is
# model.table_init_scale: every table of the head at scale × 0.02 (twin at √2 gives M = (A+B)/2
# Standard's 0.02; Standard at 1/√2 gives E twin's M scale), nothing else changed.
def _table(cfg, name):
    return param((cfg.vocab_size, cfg.d_model), ("vocab", "embed"), init_name=f"tables/{name}",
                 scale=cfg.get("table_init_scale", 1.0))


def _gate(d):
    return param((d,), ("embed",), init_name="tables/gate")


class Head(nnx.Module):
    """Base: the declarations (see above) and the generic forward over `mixture`."""

    tables: tuple[str, ...] = ()
    score: str | None = None  # a score transform of the logits (sigsoftmax), see `Mixture`
    ablations: tuple[str, ...] = ()  # `ABLATION_KINDS`: the ones that differ from the model
    gate_reads: tuple[str, str] | None = None

    def __init__(self, cfg):
        self.loss, self.chunk, self.token_tile = cfg.loss, cfg.loss_chunk, cfg.loss_token_tile

    @classmethod
    def output_projections(cls, cfg) -> int:
        return 1

    @classmethod
    def foldable(cls) -> bool:
        """Whether the head has a serving fold (it overrides `fold`)."""
        return cls.fold is not Head.fold

    def log_probs(self, h, x0):
        """fp32 log-probabilities [..., V]."""
        return mixture_log_probs(self.mixture(h, x0))

    def target_log_probs(self, h, x0, targets, layout=None):
        """fp32 log p(target) [...], never a [..., V] log-probability tensor (`model.loss`)."""
        return mixture_target_log_probs(self.mixture(h, x0), targets, self.loss, self.chunk, layout, self.token_tile)

    def nll(self, h, x0, targets, weights, layout=None):
        """(Σ weights·(−log p(target)), log p(target)): the training loss with per-token
        weights [...] (1/N for the mean). With `model.loss = "fused"` its gradients are
        computed in the forward pass (`loss.mixture_nll`); `layout` shards it over the mesh."""
        m = self.mixture(h, x0)
        if self.loss == "fused":
            return loss_lib.head_nll(m.hs, m.tables, m.log_weights, targets, weights, score=m.score,
                                     token_tile=self.token_tile, layout=layout)
        logp = mixture_target_log_probs(m, targets, self.loss, self.chunk, layout)
        return -jnp.sum(weights.astype(jnp.float32) * logp), logp

    def fold(self) -> Fold | None:
        return None

    def ablation_table(self, table: str):
        """The [V, d] table an ablation names (`ablation_parts`): 'a' -> A, 'embedding' -> embedding."""
        names = {t.lower(): t for t in self.tables}
        if table not in names:
            raise ValueError(f"table ablation of {table!r}: {type(self).__name__} has tables {', '.join(names)}")
        return getattr(self, names[table])[...]

    def gate_probs(self, tokens):
        """The gate's weights for input `tokens`: [...] for a two-way gate (the first table's
        weight, g) or [..., K]; what gate analysis reads. Heads with `gate_reads` define it."""
        raise NotImplementedError(f"{type(self).__name__} declares no gate (gate_reads is None)")

    def gate_stats(self, tokens) -> dict:
        """Gate moments over the input `tokens` for the train step's log: `gate_mean` and
        `gate_sq` (means of the gate value and of its square; a vector [K] for a K-way gate),
        from which the step reports `gate_std`. Empty without a gate."""
        return {}

    @classmethod
    def upcycle(cls, init_params: dict, E) -> dict:
        """This head's parameters started from a tied Standard checkpoint: `init_params` is its
        own initialised parameter dict, E [V, d] the Standard table. Runs abstractly first
        (`jax.eval_shape`), so a refusal comes before the checkpoint is read. The base
        refuses; heads that contain the Standard model override it with `fill_tables`."""
        raise CannotUpcycle(f"{cls.__name__} declares no upcycling (Head.upcycle)")

    @classmethod
    def fill_tables(cls, init_params: dict, E, names) -> dict:
        """`init_params` with each table in `names` set to E (a copy each: the train step donates
        its inputs, and one buffer donated twice is freed twice); every table of the head
        must be among them, else an error naming the table left at its random init."""
        left = [t for t in cls.tables if t not in names]
        if left:
            raise CannotUpcycle(f"{cls.__name__}.upcycle leaves table(s) {', '.join(left)} at random init; "
                                "fill every table from E (Head.fill_tables) or refuse upcycling")
        return {**init_params, **{t: jnp.copy(E) for t in names}}


class StandardHead(Head):
    """Tied head: one table E for input and output (E shares its init with twin's A)."""

    tables = ("embedding",)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.embedding = _table(cfg, "A")

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def mixture(self, h, x0):
        return Mixture(h, (self.embedding[...],))

    def fold(self):
        return Fold(self.embedding[...], (self.embedding[...],))


class TwinHead(Head):
    """onóna: tables A and B, the body reads M = (A+B)/2, the head mixes two softmaxes with
    a gate that reads only the input token."""

    tables = ("A", "B")
    ablations = ("a_only", "b_only", "a_in", "b_in", "a_out", "b_out")
    gate_reads = ("M", "M = (A+B)/2")  # (symbol, definition) of the rows the gate reads

    def __init__(self, cfg):
        super().__init__(cfg)
        self.A = _table(cfg, "A")
        self.B = _table(cfg, "B")
        self.gate = _gate(cfg.d_model)

    @classmethod
    def output_projections(cls, cfg) -> int:
        return 2

    @classmethod
    def upcycle(cls, init_params, E):
        """A = B = E; the gate keeps its initial value: while A = B every gate value gives the
        Standard model (SPEC §1, containment)."""
        return cls.fill_tables(init_params, E, ("A", "B"))

    def embed(self, tokens):
        # Gathering two rows is cheaper than forming M; (a+b)*0.5 is bitwise ((A+B)/2)[x].
        return (_rows(self.A[...], tokens) + _rows(self.B[...], tokens)) * 0.5

    def merged(self):
        return (self.A[...] + self.B[...]) * 0.5

    def gate_rows(self, tokens):
        """The rows the gate reads: the input rows, M[x] here."""
        return self.embed(tokens)

    def gate_table(self):
        """The rows the gate reads for every vocabulary entry, [V, d] fp32."""
        return self.merged()

    def gate_probs(self, tokens):
        """g = σ(wᵀ rmsnorm(gate rows)) per token, fp32: the weight of table A."""
        return jax.nn.sigmoid(gate_logit(self.gate_rows(tokens), self.gate[...]))

    def gate_stats(self, tokens):
        g = self.gate_probs(tokens)
        return {"gate_mean": jnp.mean(g), "gate_sq": jnp.mean(jnp.square(g))}

    def mixture(self, h, x0):
        return Mixture(h, (self.A[...], self.B[...]), gate_log_weights(gate_logit(x0, self.gate[...])))

    def fold(self):
        return Fold(self.embed_table(), (self.A[...], self.B[...]),
                    gate_log_weights(gate_logit(self.gate_table(), self.gate[...])))

    def embed_table(self):
        """The rows the body reads for every vocabulary entry (M here)."""
        return self.merged()


class UntiedHead(Head):
    """Separate input table E and output table W (+Vd)."""

    tables = ("embedding", "unembedding")
    # embedding_in and unembedding_out are the model; unembedding_in and embedding_out its _only
    ablations = ("embedding_only", "unembedding_only")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.embedding = _table(cfg, "A")
        self.unembedding = _table(cfg, "unembedding")

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def mixture(self, h, x0):
        return Mixture(h, (self.unembedding[...],))

    def fold(self):
        return Fold(self.embedding[...], (self.unembedding[...],))


class SigsoftmaxHead(StandardHead):
    """Tied table, sigsoftmax output p ∝ exp(z)σ(z) (no extra parameters)."""

    score = "sigsoftmax"

    def mixture(self, h, x0):
        return Mixture(h, (self.embedding[...],), None, self.score)

    def fold(self):
        return Fold(self.embedding[...], (self.embedding[...],), None, self.score)


class MoSHead(Head):
    """Tied table, K-component mixture of softmaxes (or sigsoftmaxes: MoSS); bias-free,
    +K·d² + K·d parameters (2d² + 2d at K = 2). Not foldable: each component projects its
    own context, so serving evaluates `log_probs`."""

    tables = ("embedding",)

    def __init__(self, cfg, sig: bool = False):
        super().__init__(cfg)
        d, K = cfg.d_model, cfg.mos_components
        self.embedding = _table(cfg, "A")
        self.mos_proj = param((K, d, d), (None, "embed", None))
        self.mos_prior = param((d, K), ("embed", None))
        self.sig = sig

    @classmethod
    def output_projections(cls, cfg) -> int:
        return int(cfg.mos_components)

    def embed(self, tokens):
        return _rows(self.embedding[...], tokens)

    def mixture(self, h, x0):
        log_prior, contexts = _mos_parts(h, self.mos_proj[...], self.mos_prior[...])
        return Mixture(contexts, (self.embedding[...],), log_prior, "sigsoftmax" if self.sig else None)


class MoSSHead(MoSHead):
    """MoS with sigsoftmax components."""

    score = "sigsoftmax"

    def __init__(self, cfg):
        super().__init__(cfg, sig=True)


class InputGateHead(TwinHead):
    """Control: the gate mixes the *input* rows, g·A[x] + (1−g)·B[x]; the output is a single
    softmax(Mh) with M = (A+B)/2."""

    ablations = TwinHead.ablations  # input g·A+(1−g)·B and output M: each of the six differs

    @classmethod
    def output_projections(cls, cfg) -> int:
        return 1

    def embed(self, tokens):
        return input_gate_rows(_rows(self.A[...], tokens), _rows(self.B[...], tokens), self.gate[...])

    def gate_rows(self, tokens):
        return TwinHead.embed(self, tokens)  # the gate reads M[x], the body reads the gated mix

    def mixture(self, h, x0):
        return Mixture(h, (self.merged(),))

    def fold(self):
        return Fold(input_gate_rows(self.A[...], self.B[...], self.gate[...]), (self.merged(),))


class TwinInputOnlyHead(Head):
    """Factorial cell: twin input M[x], single output softmax(Ah) (+Vd)."""

    tables = ("A", "B")
    ablations = ("a_only", "b_only", "b_in", "b_out")  # output A: a_in is a_only, a_out is the model

    def __init__(self, cfg):
        super().__init__(cfg)
        self.A = _table(cfg, "A")
        self.B = _table(cfg, "B")

    @classmethod
    def upcycle(cls, init_params, E):
        return cls.fill_tables(init_params, E, ("A", "B"))

    def embed(self, tokens):
        return (_rows(self.A[...], tokens) + _rows(self.B[...], tokens)) * 0.5

    def mixture(self, h, x0):
        return Mixture(h, (self.A[...],))

    def fold(self):
        return Fold((self.A[...] + self.B[...]) * 0.5, (self.A[...],))


class TwinOutputOnlyHead(TwinHead):
    """Factorial cell: input A[x], the twin output mixture with the gate reading A[x]."""

    ablations = ("a_only", "b_only", "b_in", "b_out")  # input A: a_in is the model, a_out is a_only
    gate_reads = ("A", "the table A")

    def embed(self, tokens):
        return _rows(self.A[...], tokens)

    def gate_table(self):
        return self.A[...]

    def embed_table(self):
        return self.A[...]


class NoHead(nnx.Module):
    """No parameters: the model of a server that reads its input rows and computes its output
    from a head's `Fold`, so the unfolded tables need not stay in memory."""

    def embed(self, tokens):
        raise ValueError("a model served from folded tables takes its input rows as x0")


HEADS: dict[str, type[Head]] = {
    "standard": StandardHead,
    "twin": TwinHead,
    "untied": UntiedHead,
    "mos": MoSHead,
    "sigsoftmax": SigsoftmaxHead,
    "moss": MoSSHead,
    "input_gate": InputGateHead,
    "twin_input_only": TwinInputOnlyHead,
    "twin_output_only": TwinOutputOnlyHead,
}


def register(name: str, cls: type[Head]) -> type[Head]:
    """Add a head under `name` (`model.head`): a `Head` subclass whose constructor takes the
    model config. Everything else (training, evaluation, serving, export, upcycling, gate
    statistics) reads its declarations. Returns `cls`, so it works as a decorator's body."""
    if not (isinstance(cls, type) and issubclass(cls, Head)):
        raise TypeError(f"register({name!r}, {cls!r}): a head is a subclass of heads.Head")
    if name in HEADS and HEADS[name] is not cls:
        raise ValueError(f"head {name!r} is registered already ({HEADS[name].__name__}); pick another name")
    HEADS[name] = cls
    return cls


def head_class(name: str) -> type[Head]:
    """The class of head `name` (its declarations without building it)."""
    if name not in HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of {tuple(HEADS)}")
    return HEADS[name]


def make_head(cfg) -> nnx.Module:
    return head_class(cfg.head)(cfg)
