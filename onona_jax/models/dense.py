"""Dense (Qwen3-style) decoder body, and the pre-norm residual trunk it shares with the MoE
and Gated DeltaNet families (SPEC §3).

    x = x + mixer(norm(x))        # attention, or Gated DeltaNet in the hybrid
    x = x + ffn(norm(x))          # SwiGLU, or a mixture of experts
    h = final_norm(x)

A block is built from a *mixer* and a *feed-forward* named by the family's layer pattern
(`models.MIXERS`, `models.FEED_FORWARDS`); the attribute names are the parameter paths
(`attn`, `gdn`, `mlp`, `moe`). Weights are declared with logical axis names; values come
from `params.init_params`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from onona_jax.layers import RMSNorm, checkpointed, zeros_stacked
from onona_jax.models import hf_map
from onona_jax.models.hf_map import Entry
from onona_jax.params import ParamGroup, Stack
from onona_jax.sharding import constrain


# The summary's rows of the shared layers as this trunk names them (`attn`, `mlp` and the
# norms; AttnRes uses the same names): the attention and SwiGLU projections are matmul
# weights, the RMSNorm weights (QK-norm included) are not. The Dense, MoE and GDN families
# add their mixers' and feed-forwards' own (`models.RESIDUAL`).
COMPONENTS = (
    ParamGroup("attention", tuple(f"trunk/layers/attn/{n}" for n in ("q", "k", "v", "o"))),
    ParamGroup("mlp", tuple(f"trunk/layers/mlp/{n}" for n in ("gate", "up", "down"))),
    ParamGroup("norms", ("trunk/layers/attn/q_norm/weight", "trunk/layers/attn/k_norm/weight",
                         "trunk/layers/attn_norm/weight", "trunk/layers/mlp_norm/weight",
                         "trunk/final_norm/weight"), matmul=False),
)


# The shared layers as Hugging Face names them (Qwen3's): `HF_LAYER` by our sub-tree, the
# final norm `HF_TRUNK`. Attention projections are [d, heads, head_dim] here, torch Linear
# weights [heads·head_dim, d] there.
def _hf_attention(m) -> list[Entry]:
    d, n, k, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    return [
        Entry(("q",), "self_attn.q_proj.weight", (d, n, hd), (n * hd, d), True),
        Entry(("k",), "self_attn.k_proj.weight", (d, k, hd), (k * hd, d), True),
        Entry(("v",), "self_attn.v_proj.weight", (d, k, hd), (k * hd, d), True),
        Entry(("o",), "self_attn.o_proj.weight", (n, hd, d), (d, n * hd), True),
        Entry(("q_norm", "weight"), "self_attn.q_norm.weight", (hd,), (hd,), False),
        Entry(("k_norm", "weight"), "self_attn.k_norm.weight", (hd,), (hd,), False),
    ]


def _hf_mlp(m) -> list[Entry]:
    d, f = m.d_model, m.d_ff
    return [Entry(("gate",), "mlp.gate_proj.weight", (d, f), (f, d), True),
            Entry(("up",), "mlp.up_proj.weight", (d, f), (f, d), True),
            Entry(("down",), "mlp.down_proj.weight", (f, d), (d, f), True)]


def _hf_norm(name: str):
    return hf_map.entries(lambda m: [Entry(("weight",), name, (m.d_model,), (m.d_model,), False)])


HF_LAYER = {"attn_norm": _hf_norm("input_layernorm.weight"), "attn": hf_map.entries(_hf_attention),
            "mlp_norm": _hf_norm("post_attention_layernorm.weight"), "mlp": hf_map.entries(_hf_mlp)}
HF_TRUNK = {"final_norm": _hf_norm("model.norm.weight")}
# transformers' Qwen3 with a plain softmax head (the residual trunk of attention and SwiGLU).
HF_PLAIN = hf_map.Plain("qwen3", "Qwen3Config", "Qwen3ForCausalLM")


def add_aux(total: dict, aux: dict) -> dict:
    return {k: total.get(k, 0) + v for k, v in aux.items()} if aux else total


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + ffn(norm(x)).

    `mixer` and `ffn` are (attribute name, module class). Returns (x, aux) where aux holds
    per-layer statistics to be summed over layers (MoE routing)."""

    def __init__(self, cfg, mixer, ffn, stack=None):
        (self.mixer_name, mixer_cls), (self.ffn_name, ffn_cls) = mixer, ffn
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack)
        setattr(self, self.mixer_name, mixer_cls(cfg, stack=stack))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack)
        setattr(self, self.ffn_name, ffn_cls(cfg, stack=stack))

    def _feed_forward(self, x):
        y = getattr(self, self.ffn_name)(self.mlp_norm(x))
        return y if isinstance(y, tuple) else (y, {})  # MoE: (output, statistics)

    def __call__(self, x, positions, segments=None):
        x = x + getattr(self, self.mixer_name)(self.attn_norm(x), positions, segments)
        y, aux = self._feed_forward(x)
        return constrain(x + y, ("batch", "seq", "act_embed")), aux

    def init_cache(self, batch: int, max_len: int, dtype):
        """The mixer's decoding cache (attention: K/V buffers; GDN: conv window and state);
        the feed-forward needs none."""
        return getattr(self, self.mixer_name).init_cache(batch, max_len, dtype)

    def extend(self, x, positions, cache, length, start):
        """`__call__` for T new tokens after `cache`: (x, cache). A MoE sees only the new
        tokens (capacity per call): serve from the family's evaluation config, where nothing
        is dropped."""
        y, cache = getattr(self, self.mixer_name).extend(self.attn_norm(x), positions, cache, length, start)
        x = x + y
        return x + self._feed_forward(x)[0], cache


def _runs(blocks) -> list[list]:
    """Consecutive blocks of one kind (mixer and feed-forward), e.g. [[gdn, gdn, gdn], [attn]]."""
    runs = []
    for block in blocks:
        kind = (block.mixer_name, block.ffn_name)
        if runs and (runs[-1][0].mixer_name, runs[-1][0].ffn_name) == kind:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _apply_run(apply, run, x):
    """(x, aux) after the blocks of `run` in order. A run of several (the hybrid group's 3 GDN
    layers) is one inner scan over their weights stacked on the fly, so the compiler sees that
    kind of layer's code once, not once per position: fewer dots in the compiled step and a
    shorter compile for the same values (docs/notes/scaling-log.md, "GDN's recurrence
    precision"); the stacking copies the run's weight shards once per step."""
    if len(run) == 1:
        return apply(run[0], x)
    graphdef, first = nnx.split(run[0])
    treedef = jax.tree.structure(first)  # the positions' metadata differ (layer offset), not their shapes
    stacked = [jnp.stack(leaves) for leaves in zip(*(jax.tree.leaves(nnx.split(b)[1]) for b in run))]

    def step(x, leaves):
        return apply(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), x)

    x, aux = jax.lax.scan(step, x, stacked)
    return x, jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)


class Trunk(nnx.Module):
    """The decoder body: L blocks following `layer_pattern`, then the final norm.

    With `scan_layers` each position of the pattern is stacked on a leading `layers` axis
    (Dense: one block stacked L times; GDN hybrid: a group of 3 GDN + 1 attention blocks
    stacked L/4 times) and one compiled group runs under lax.scan."""

    def __init__(self, cfg, pattern: list[str], mixers: dict, ffn):
        P, L = len(pattern), cfg.n_layers
        self.scan, self.remat = cfg.scan_layers, cfg.remat
        if self.scan and P == 1:
            self.layers = Block(cfg, mixers[pattern[0]], ffn, stack=Stack(L))
        elif self.scan:
            self.layers = nnx.List(
                [Block(cfg, mixers[kind], ffn, stack=Stack(L // P, P, j)) for j, kind in enumerate(pattern)]
            )
        else:
            self.layers = nnx.List([Block(cfg, mixers[pattern[i % P]], ffn) for i in range(L)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def __call__(self, x, positions, segments=None):
        """(h, aux): final-normed hidden states and the blocks' statistics summed over layers.
        `segments` [B, T]: packed documents' ids (onona_jax/packing.py), None for one sequence
        per row; the mixers keep to a document, the feed-forwards are per token anyway."""

        def apply(block, x):
            return block(x, positions, segments)

        apply = checkpointed(apply, self.remat)
        aux = {}
        if self.scan:
            graphdef, stacked = nnx.split(self.layers)

            def body(carry, layer_state):
                x, aux = carry
                group = nnx.merge(graphdef, layer_state)
                for run in _runs(group if isinstance(group, nnx.List) else [group]):
                    x, a = _apply_run(apply, run, x)
                    aux = add_aux(aux, a)
                return (x, aux), None

            # One traced group gives the statistics' structure for the carry.
            aux0 = jax.eval_shape(lambda x, s: body((x, {}), s)[0][1], x, jax.tree.map(lambda a: a[0], stacked))
            aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux0)
            (x, aux), _ = jax.lax.scan(body, (x, aux), stacked)
        else:
            for block in self.layers:
                x, a = apply(block, x)
                aux = add_aux(aux, a)
        return self.final_norm(x), aux

    def init_cache(self, batch: int, max_len: int, dtype):
        """Per-layer caches: a list over layers, or (scanned) the stacked group's caches with a
        leading `layers` axis (a list over the pattern's positions when it has several)."""
        if not self.scan:
            return [block.init_cache(batch, max_len, dtype) for block in self.layers]
        grouped = isinstance(self.layers, nnx.List)
        caches = [
            zeros_stacked(block.init_cache(batch, max_len, dtype), block.attn_norm.weight[...].shape[0])
            for block in (self.layers if grouped else [self.layers])
        ]
        return caches if grouped else caches[0]

    def extend(self, x, positions, cache, length, start):
        """`__call__` for T new tokens after `cache`: (final-normed h [B, T, d], cache)."""
        if not self.scan:
            new = []
            for block, c in zip(self.layers, cache):
                x, c = block.extend(x, positions, c, length, start)
                new.append(c)
            return self.final_norm(x), new
        graphdef, stacked = nnx.split(self.layers)
        grouped = isinstance(self.layers, nnx.List)

        def body(x, xs):
            layer_state, caches = xs
            group = nnx.merge(graphdef, layer_state)
            new = []
            for block, c in zip(group if grouped else [group], caches if grouped else [caches]):
                x, c = block.extend(x, positions, c, length, start)
                new.append(c)
            return x, (new if grouped else new[0])

        x, cache = jax.lax.scan(body, x, (stacked, cache))
        return self.final_norm(x), cache
