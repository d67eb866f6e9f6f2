"""Decoder families (SPEC §3) and the model: a family's trunk plus one of the heads (SPEC §2).

    x0 = head.embed(tokens)            # E[x] or M[x] = (A[x]+B[x])/2
    h  = trunk(x0)                     # the family's blocks, then the final RMSNorm
    log p = head.log_probs(h, x0)      # the gate reads x0

The trunk knows nothing of the head, so another head or a fused loss plugs in on `hidden`.

A family is one file here (`dense`, `moe`, `gdn`, `attnres`) and one `Family` record in
`FAMILIES` (`register`); `config` derives `model.arch`'s choices from it. The record says
everything the package knows of the family, the summary's accounting included: which
component each trunk parameter counts in (`components`, checked for every path when the
config is validated), its extra FLOPs beyond the weights' and the attention scores
(`extra_flops`), the initialisers it names (`initializers`) and its Hugging Face mapping for
export and import (`hf`, a `hf_map.HFMap`). Adding a family touches its own file and this
registry only (docs/extending.md, "Adding a decoder family").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from fractions import Fraction
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from onona_jax import heads as heads_lib
from onona_jax import packing
from onona_jax import params as params_lib
from onona_jax.layers import DTYPES, MLP, Attention
from onona_jax.models import attnres, dense, gdn, hf_map, moe
from onona_jax.sharding import constrain

# Token mixers and feed-forwards of the residual trunk, by the names a layer pattern uses:
# name -> (attribute name = parameter path, module class).
MIXERS = {"attention": ("attn", Attention), "gdn": ("gdn", gdn.GatedDeltaNet)}
FEED_FORWARDS = {"mlp": ("mlp", MLP), "moe": ("moe", moe.MoE)}


def _no_problems(cfg_model) -> list[str]:
    return []


def _no_mesh_problems(cfg_model, mesh) -> list[str]:
    return []


def _unchanged(cfg_model):
    return cfg_model


def _no_aux_loss(stats: dict, cfg_model):
    return jnp.zeros((), jnp.float32), {}


def _no_extra_flops(cfg_model, seq_len: int) -> dict[str, float]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """What the rest of the package knows of a decoder family."""

    # cfg_model -> the body module: trunk(x, positions) -> (h, stats), and with packed documents
    # trunk(x, positions, segments) (onona_jax/packing.py; a trunk without it trains on windows only)
    trunk: Callable
    # The summary's rows of every trunk parameter (`params.ParamGroup`s; each path matches
    # exactly one, checked by config validation before anything is written).
    components: tuple[params_lib.ParamGroup, ...]
    layer_pattern: str = "attention"  # default of model.layer_pattern
    validate: Callable = _no_problems  # cfg_model -> [problem messages naming key and fix]
    mesh_problems: Callable = _no_mesh_problems  # (cfg_model, cfg.mesh) -> [the same, of the mesh]
    eval_config: Callable = _unchanged  # cfg_model -> the config evaluation and serving build
    aux_loss: Callable = _no_aux_loss  # (trunk stats, cfg_model) -> (term added to the loss, metrics)
    # (cfg_model, seq_len) -> {term: forward FLOPs per token} beyond 2 per matmul weight and the
    # attention layers' scores, which the summary counts for every family (GDN's recurrence,
    # AttnRes's depth mixing).
    extra_flops: Callable = _no_extra_flops
    initializers: dict = dataclasses.field(default_factory=dict)  # name -> fn(key, shape), see params
    # Export and import (serve/hf_format.py): parameter names, config fields, the HF body; None:
    # the family is not exported.
    hf: hf_map.HFMap | None = None


def _residual(ffn: str):
    """The pre-norm residual trunk (`dense.Trunk`) with this feed-forward."""
    return lambda cfg: dense.Trunk(cfg, layer_pattern(cfg), MIXERS, FEED_FORWARDS[ffn])


# Per-layer extra FLOPs of the residual trunk's mixers, by layer-pattern name (attention's
# scores are the summary's own).
MIXER_FLOPS = {"gdn": gdn.layer_flops}


def _residual_flops(cfg_model, seq_len: int) -> dict[str, float]:
    pattern = layer_pattern(cfg_model)
    repeats = cfg_model.n_layers // len(pattern)
    out: dict[str, float] = {}
    for kind in dict.fromkeys(pattern):
        if kind in MIXER_FLOPS:
            for term, flops in MIXER_FLOPS[kind](cfg_model, seq_len).items():
                out[term] = out.get(term, 0.0) + repeats * pattern.count(kind) * flops
    return out


# The config checks of the residual trunk's mixers, read when the layer pattern holds one.
MIXER_PROBLEMS = {"gdn": gdn.config_problems}


def _mixer_problems(cfg_model) -> list[str]:
    kinds = dict.fromkeys(layer_pattern(cfg_model))
    return [p for kind in kinds for p in MIXER_PROBLEMS.get(kind, _no_problems)(cfg_model)]


def _moe_problems(cfg_model) -> list[str]:
    return moe.config_problems(cfg_model) + _mixer_problems(cfg_model)


# What the residual trunk may hold, whatever its family's default pattern (model.layer_pattern
# may put GDN layers into a Dense or MoE model): every mixer's and feed-forward's parameters,
# initialisers, config checks and Hugging Face names, and the mixers' extra FLOPs.
RESIDUAL = dict(components=dense.COMPONENTS + gdn.COMPONENTS + moe.COMPONENTS,
                initializers=gdn.INITIALIZERS, extra_flops=_residual_flops)
HF_RESIDUAL = dict(layer={**dense.HF_LAYER, **gdn.HF_LAYER, **moe.HF_LAYER}, trunk=dense.HF_TRUNK)

FAMILIES: dict[str, Family] = {}


def register(name: str, fam: Family) -> None:
    """Make `fam` model.arch=`name` (its initialisers join `params.INITIALIZERS`)."""
    if name in FAMILIES:
        raise ValueError(f"model.arch {name!r} is registered already; give the new family a name of its own")
    params_lib.register_initializers(fam.initializers)
    FAMILIES[name] = fam


register("dense", Family(trunk=_residual("mlp"), validate=_mixer_problems, **RESIDUAL,
                         hf=hf_map.HFMap("dense", **HF_RESIDUAL, plain=dense.HF_PLAIN)))
register("moe", Family(trunk=_residual("moe"), validate=_moe_problems, mesh_problems=moe.mesh_problems,
                       eval_config=moe.eval_config, aux_loss=moe.aux_loss, **RESIDUAL,
                       hf=hf_map.HFMap("moe", **HF_RESIDUAL, plain=moe.HF_PLAIN, config_fields=moe.hf_config,
                                       config_from_hf=moe.config_from_hf)))
register("gdn", Family(trunk=_residual("mlp"), layer_pattern="gdn,gdn,gdn,attention", validate=_mixer_problems,
                       **RESIDUAL, hf=hf_map.HFMap("gdn", **HF_RESIDUAL, config_fields=gdn.hf_config,
                                                   config_from_hf=gdn.config_from_hf, pattern=True)))
register("attnres", Family(trunk=attnres.AttnResTrunk, validate=attnres.config_problems,
                           components=attnres.COMPONENTS, extra_flops=attnres.extra_flops,
                           hf=hf_map.HFMap("attnres", attnres.HF_LAYER, attnres.HF_TRUNK,
                                           config_fields=attnres.hf_config, config_from_hf=attnres.config_from_hf)))


def family(cfg_model) -> Family:
    if cfg_model.arch not in FAMILIES:
        raise ValueError(f"unknown model.arch {cfg_model.arch!r}; choose one of {tuple(FAMILIES)}")
    return FAMILIES[cfg_model.arch]


def layer_pattern(cfg_model) -> list[str]:
    """The mixer of each layer in one repeat of the pattern, e.g. [gdn, gdn, gdn, attention]."""
    return (cfg_model.get("layer_pattern") or family(cfg_model).layer_pattern).split(",")


def eval_config(cfg_model):
    """The model config evaluation and serving build (MoE: the evaluation capacity)."""
    return family(cfg_model).eval_config(cfg_model)


class Model(nnx.Module):
    """A decoder family's trunk plus one of the heads of SPEC §2."""

    def __init__(self, cfg, head=None):
        """`head`: a head module in place of the config's (serving: `heads.NoHead`, when the
        caller computes the input rows and the output from folded tables itself)."""
        self.dtype = DTYPES[cfg.dtype]
        self.head = heads_lib.make_head(cfg) if head is None else head
        self.trunk = family(cfg).trunk(cfg)

    def forward(self, tokens, positions=None, x0=None, eot: int | None = None):
        """(h, x0, aux): final hidden states [B, T, d] in the compute dtype, the fp32 input
        rows the gate reads, and the trunk's statistics (MoE routing) summed over layers.
        `eot`: each row holds documents packed after one another, each ended by this token
        (`packing.documents`: its own positions, attention and recurrent state); None: each
        row is one sequence."""
        segments = None
        if eot is not None:
            positions, segments = packing.documents(tokens, eot)
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        if x0 is None:
            x0 = self.head.embed(tokens)
        x = constrain(x0.astype(self.dtype), ("batch", "seq", "act_embed"))
        h, aux = self.trunk(x, positions) if segments is None else self.trunk(x, positions, segments)
        return h, x0, aux

    def hidden(self, tokens, positions=None, x0=None, eot: int | None = None):
        """(h, x0) of `forward`, without the statistics."""
        h, x0, _ = self.forward(tokens, positions, x0, eot)
        return h, x0

    def __call__(self, tokens):
        """fp32 log-probabilities [B, T, V]."""
        h, x0 = self.hidden(tokens)
        return self.head.log_probs(h, x0)

    def target_log_probs(self, tokens, targets, ablation: str | None = None, layout=None, eot: int | None = None):
        """fp32 log p(targets) [B, T]; the training loss is its negative mean. `layout`
        (`sharding.loss_layout(mesh)`) shards the fused loss over the mesh; `eot`: packed
        documents (`forward`; the targets after an eot are scored too: `packing.kept` says
        which the loss counts).

        `ablation` names one of the head's `ablations` (`heads.ABLATION_KINDS`): "a_only" reads
        and predicts with table A alone, no gate (SPEC §2); "a_in" feeds A[x] to the body under
        the model's own output; "a_out" predicts with A alone from the model's own input rows."""
        if ablation is None:
            h, x0 = self.hidden(tokens, eot=eot)
            return self.head.target_log_probs(h, x0, targets, layout)
        if ablation not in self.head.ablations:
            raise ValueError(
                f"table ablation {ablation!r}: head {type(self.head).__name__} has "
                f"{', '.join(self.head.ablations) or 'none'}"
            )
        table, kind = heads_lib.ablation_parts(ablation)
        E = self.head.ablation_table(table)
        own = None if kind == "only" else self.head.embed(tokens)  # the model's input rows (its gate's)
        h, _ = self.hidden(tokens, x0=own if kind == "out" else jnp.take(E, tokens, axis=0), eot=eot)
        if kind == "in":
            return self.head.target_log_probs(h, own, targets, layout)
        return heads_lib.table_target_log_probs(h, (E,), targets, None, self.head.loss, self.head.chunk, layout,
                                                self.head.token_tile)

    # -- incremental decoding (serve/server.py). A cache is
    #    {"layers": per-layer caches (Trunk.init_cache), "length": slots written (int32 []),
    #     "start": left-pad slots of each row (int32 [B])}.
    # Rows are left-padded to a common length: row b's real tokens sit at slots start_b.. and
    # take positions slot − start_b, its pads are invisible to attention and zero inputs to
    # GDN, so each row decodes as if alone (the MoE sees pads too: at the evaluation capacity
    # nothing is dropped, so they change nothing).

    def init_cache(self, batch: int, max_len: int, start=None) -> dict:
        """An empty cache for `batch` rows of at most `max_len` slots (pads included)."""
        layers = self.trunk.init_cache(batch, max_len, self.dtype)
        start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        return {"layers": layers, "length": jnp.zeros((), jnp.int32), "start": start}

    def extend(self, tokens, cache, x0=None):
        """Run T new tokens [B, T] after `cache`: (h [B, T, d], x0 [B, T, d], cache), h and x0
        as `forward` gives them for these positions of the whole sequence."""
        T = tokens.shape[-1]
        length, start = cache["length"], cache["start"]
        positions = length + jnp.arange(T, dtype=jnp.int32)[None, :] - start[:, None]
        if x0 is None:
            x0 = self.head.embed(tokens)
        x = x0.astype(self.dtype)
        h, layers = self.trunk.extend(x, positions, cache["layers"], length, start)
        return h, x0, {"layers": layers, "length": length + T, "start": start}

    def prefill(self, tokens, max_len: int, start=None, x0=None):
        """A fresh cache of `max_len` slots filled with the prompt `tokens` [B, T] (row b
        left-padded with start_b pad tokens): (h [B, T, d], x0 [B, T, d], cache)."""
        return self.extend(tokens, self.init_cache(tokens.shape[0], max_len, start), x0)

    def decode_step(self, token, cache, x0=None):
        """One token per row, token [B]: (h [B, d], x0 [B, d], cache)."""
        h, x0, cache = self.extend(token[:, None], cache, None if x0 is None else x0[:, None])
        return h[:, 0], x0[:, 0], cache


# ----------------------------------------------------------------------------- functional API


def abstract(cfg, head=None):
    """(graphdef, abstract state) of `Model(cfg)`: shapes and metadata only, no allocation."""
    return params_lib.abstract_state(lambda: Model(cfg, head() if head is not None else None))


class Counted(NamedTuple):
    """A parameter as the summary counts it: its path (`params.path_str`), size, summary row,
    whether it is a matmul weight and the fraction of tokens that use it."""

    path: str
    size: int
    component: str
    matmul: bool
    used: Fraction


def _head_group(cfg_model, name: str) -> params_lib.ParamGroup:
    """The head's rows, from what the head declares: its vocabulary tables, its gate, and any
    other head weight (MoS's context and prior projections) a matmul weight of `head`."""
    if name in heads_lib.head_class(cfg_model.head).tables:
        return params_lib.ParamGroup("tables", (), matmul=False)
    return params_lib.ParamGroup(*(("gate", (), False) if name == "gate" else ("head", ())))


# _accounting's results by (family record, head class, model config): validation, the summary
# and the training loop ask about the same model several times, each would trace it anew. The
# records are kept in the values, so their ids cannot be reused while cached.
_ACCOUNTED: dict = {}


def _accounting(cfg_model) -> tuple[tuple[Counted, ...], tuple[str, ...]]:
    fam, head = family(cfg_model), heads_lib.head_class(cfg_model.head)
    key = (id(fam), id(head), json.dumps(cfg_model.to_dict(), sort_keys=True, default=str))
    if key not in _ACCOUNTED:
        if len(_ACCOUNTED) >= 256:
            _ACCOUNTED.clear()
        _ACCOUNTED[key] = (fam, head, *_trace_accounting(cfg_model, fam))
    return _ACCOUNTED[key][2:]


def _trace_accounting(cfg_model, fam) -> tuple[tuple[Counted, ...], tuple[str, ...]]:
    _, state = abstract(cfg_model)
    counted, problems = [], []
    for path, var in params_lib.flat_variables(state):
        name, size = params_lib.path_str(path), int(np.prod(var.shape))
        if name.startswith("head/"):
            groups = [_head_group(cfg_model, name.rsplit("/", 1)[-1])]
        else:
            groups = [g for g in fam.components if any(fnmatch.fnmatchcase(name, p) for p in g.paths)]
        if len(groups) != 1:
            problems.append(
                f"parameter {name!r} of model.arch={cfg_model.arch!r} matches {len(groups)} of its family's "
                f"components ({', '.join(g.component for g in groups)}); narrow their globs (ParamGroup.paths) "
                "so that exactly one matches it" if groups else
                f"parameter {name!r} of model.arch={cfg_model.arch!r} is in none of its family's components; "
                "declare it in the family's components (a params.ParamGroup in its Family record, models.register)")
            continue
        g = groups[0]
        used = Fraction(1) if g.used is None else Fraction(g.used(cfg_model))
        counted.append(Counted(name, size, g.component, g.matmul, used))
    return tuple(counted), tuple(problems)


def accounting_problems(cfg_model) -> tuple[str, ...]:
    """Each parameter of Model(cfg_model) that its family's `components` do not place in
    exactly one summary row (config validation: from the abstract model, before any write)."""
    return _accounting(cfg_model)[1]


def accounting(cfg_model) -> tuple[Counted, ...]:
    """Every parameter of Model(cfg_model) as the summary counts it (abstract: no allocation)."""
    counted, problems = _accounting(cfg_model)
    if problems:
        raise ValueError(problems[0])
    return counted


def placed(cfg, mesh):
    """The abstract parameters of `Model(cfg)` as ShapeDtypeStructs carrying their
    NamedShardings on `mesh` (the one rules table), checked to divide evenly."""
    from onona_jax import sharding

    _, state = abstract(cfg)
    logical = params_lib.logical_axes(state)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    sharding.check_divisible(logical, shapes, mesh)
    shardings = sharding.named_shardings(logical, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init(cfg, seed: int, out_shardings=None):
    """(graphdef, params): fp32 parameters keyed by path and seed (see `params.py`), created
    directly with `out_shardings` when given."""
    graphdef, state = abstract(cfg)
    params = jax.jit(lambda: params_lib.init_params(state, seed), out_shardings=out_shardings)()
    return graphdef, params


def bind(graphdef, params) -> Model:
    """A Model that reads `params` (a pure dict of arrays, possibly traced)."""
    return nnx.merge(graphdef, params)
