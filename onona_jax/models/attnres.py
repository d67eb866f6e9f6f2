"""Attention Residuals (AttnRes, Kimi Team 2026, arXiv 2603.15031): SPEC §3.

No running residual sum. Each sublayer (attention and MLP separately) reads its input as a
softmax mixture of its *sources* over depth,

    h = Σ_i softmax_i(wᵀ rmsnorm_g(v_i)) · v_i

with its own pseudo-query w ∈ R^d (initialised to zero, so h starts as the plain average of
the sources) and its own key-norm weight g, shared over its sources; keys are the normalised
sources, values the sources themselves; fp32, no 1/√d scale. The usual pre-norm then applies
to h before the sublayer, and the sublayer's output becomes a source of later sublayers. A
final AttnRes (own query and norm) precedes the final norm.

Block AttnRes, `model.attnres.block_size` = k sublayers per block (our reading of §3.2 Eq. 5-6
and Figure 2 of the paper, and of fla `fla/ops/attnres/naive.py` for the mixing itself):

* b_0 = the token embedding is a source of its own, always present; it is *not* part of the
  first block's sum (Eq. 6 defines b_0 = h_1; Figure 2's "blocks already include token
  embedding": the boundary test fires before layer 0, so the embedding is appended as
  blocks[0] and the first partial sum starts from the first attention output).
* b_n = the sum of the outputs of block n's k sublayers (Eq. 5); sublayer outputs only.
* The j-th sublayer of block n (j = 1..k) reads [b_0, ..., b_{n-1}] if j = 1 and
  [b_0, ..., b_{n-1}, b_n^{j-1}] otherwise, b_n^{j-1} being the partial sum of the block's
  first j-1 outputs. So sublayer s (0-based over the 2L sublayers) has 1 + ceil(s/k) sources.
* Blocks count sublayers, so with odd k a boundary can fall between a layer's attention and
  its MLP; if 2L is not a multiple of k the last block is partial (as the paper says).
* The final AttnRes reads [b_0, b_1, ..., b_N], N = ceil(2L/k), the last one complete or not.
* k = 1 is Full AttnRes: every sublayer output is its own source, sublayer s reads
  [embedding, f_0, ..., f_{s-1}] and the final one all 2L+1.

Sources are kept in the compute dtype (like Dense's residual stream); the mixing itself runs
in fp32 and is checkpointed, so only the compute-dtype sources are kept for the backward
pass, never fp32 copies of them.

Unscanned, the sources are a Python list, each stored once for the backward pass, and the
mixing is written source by source (`_mix_list`). Scanned (`scan_layers`), the sources live
in a fixed buffer [1 + ceil(2L/k), B, T, d] carried through `lax.scan`: slot 0 holds the
embedding, slot 1 + n block n (its partial sum while it fills, added to in place with
dynamic_update_slice), and a mask hides the slots a sublayer may not read yet (masked slots
are zero and get softmax weight exactly 0). Both give the same outputs up to float
reassociation. Differentiated through `lax.scan`, the carried buffer would be kept once per
layer, O(L · (1 + ceil(2L/k))) sources; the scanned trunk's own backward pass
(`_scanned_trained`) keeps the final buffer once and rebuilds each layer's input buffer from
it, O(L) like the unscanned trunk, while compiling one layer (unscanned compiles 2L mixes of up
to 2L+1 sources each, so its compile time grows quadratically with depth: docs/training.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from onona_jax.layers import MLP, Attention, RMSNorm, checkpointed, rms_norm, zeros_stacked
from onona_jax.models import dense, hf_map
from onona_jax.models.hf_map import Entry
from onona_jax.params import ParamGroup, Stack, param
from onona_jax.sharding import constrain

ACT = ("batch", "seq", "act_embed")
BUFFER = (None, *ACT)


# ----------------------------------------------------------------------------- pure math


def attnres_mix(sources, query, norm_weight, eps, mask=None):
    """h = Σ_i softmax_i(queryᵀ rmsnorm(v_i; norm_weight)) v_i over the leading axis.

    sources: [S, ..., d]; query, norm_weight: [d]; mask: optional [S] bool, False = source
    absent (a fixed-size buffer's empty slots; at least one must be True). fp32 throughout
    (multiply-and-sum, no matmul, so no TF32 on GPUs), no 1/√d scale; returns h [..., d] in
    the sources' dtype. With a zero query h is the plain average of the present sources."""
    v = sources.astype(jnp.float32)
    keys = rms_norm(v, norm_weight.astype(jnp.float32), eps)
    logits = jnp.sum(keys * query.astype(jnp.float32), axis=-1)  # [S, ...]
    if mask is not None:
        mask = jnp.reshape(mask, mask.shape + (1,) * (logits.ndim - 1))
        logits = jnp.where(mask, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=0)
    return jnp.sum(p[..., None] * v, axis=0).astype(sources.dtype)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _mix_list(sources, query, norm_weight, eps):
    """`attnres_mix` over a list of [B, T, d] sources, written source by source: only the
    [S, B, T] logits are stacked, never the sources, so neither the backward pass nor XLA
    keeps [S, B, T, d] copies (an unrolled 16-layer Full AttnRes needs about a quarter of
    the temporary memory of the stacked form). Checkpointed: only the sources are saved."""
    g, u = norm_weight.astype(jnp.float32), query.astype(jnp.float32)
    logits = jnp.stack([jnp.sum(rms_norm(v.astype(jnp.float32), g, eps) * u, axis=-1) for v in sources])
    p = jax.nn.softmax(logits, axis=0)
    h = functools.reduce(jnp.add, [p[i][..., None] * v.astype(jnp.float32) for i, v in enumerate(sources)])
    return h.astype(sources[0].dtype)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _mix_buffer(buffer, n_valid, query_and_norm, eps, extra=None, slot=None):
    """`attnres_mix` over the first `n_valid` slots of a [S, B, T, d] buffer, after adding
    `extra` to slot `slot` when given (the sublayer output not yet written into the carried
    buffer: the backward pass then keeps the layer's input buffer once, not a second updated
    copy). Checkpointed: only the buffer (compute dtype) is saved, no fp32 copy of it."""
    S = buffer.shape[0]
    if extra is not None:
        hit = (jnp.arange(S) == slot).reshape(S, 1, 1, 1)
        buffer = buffer + jnp.where(hit, extra[None], jnp.zeros((), buffer.dtype))
    return attnres_mix(buffer, *query_and_norm, eps, mask=jnp.arange(S) < n_valid)


def _add_to_slot(buffer, slot, y):
    """buffer[slot] += y (slot may be traced)."""
    old = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, old + y, slot, 0)


def n_sources(s: int | jax.Array, block_size: int):
    """Sources read by sublayer s (0-based): the embedding plus ceil(s / block_size) blocks."""
    return 1 + (s + block_size - 1) // block_size


def config_problems(cfg_model) -> list[str]:
    """What is wrong with the model config for this family, each naming the key and the fix."""
    out = []
    k = cfg_model.attnres.block_size
    if int(k) != k or int(k) < 1:
        out.append(f"model.attnres.block_size={k} must be ≥ 1 (1 = full AttnRes)")
    if cfg_model.layer_pattern not in ("", "attention"):
        out.append(f"model.layer_pattern={cfg_model.layer_pattern!r}: arch attnres supports only "
                   "attention layers; leave model.layer_pattern empty")
    return out


# Hugging Face: the shared layers' names (`dense.HF_LAYER`) plus each layer's queries and key
# norms `attnres.{attn,mlp}_query`, `attnres.{attn,mlp}_key_norm.weight` [d] and the final
# mixture's `model.final_attnres.query`, `model.final_attnres.key_norm.weight`.
def _hf_vectors(prefix: str, paths: tuple):
    return hf_map.entries(lambda m: [Entry(p, prefix + ".".join(p), (m.d_model,), (m.d_model,), False)
                                     for p in paths])


def hf_config(cfg_model) -> dict:
    return dict(attnres_block_size=int(cfg_model.attnres.block_size))


def config_from_hf(hf: dict, cfg_model) -> None:
    cfg_model.attnres.block_size = int(hf.get("attnres_block_size", 1))


HF_LAYER = dict(dense.HF_LAYER, attnres=_hf_vectors(
    "attnres.", (("attn_query",), ("mlp_query",), ("attn_key_norm", "weight"), ("mlp_key_norm", "weight"))))
HF_TRUNK = dict(dense.HF_TRUNK, final_attnres=_hf_vectors("model.final_attnres.", (("query",), ("key_norm", "weight"))))


def sources_per_token(cfg_model) -> int:
    """Sources summed over all AttnRes mixings of one token: sublayer s (0..2L−1) reads
    1 + ceil(s/k) of them and the final AttnRes 1 + ceil(2L/k) (k = block size)."""
    k, L = int(cfg_model.attnres.block_size), cfg_model.n_layers
    return sum(n_sources(s, k) for s in range(2 * L + 1))


def extra_flops(cfg_model, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of the depth mixing beyond the weights': 2·d per source per
    AttnRes mixing (the pseudo-query dot with each normed source), summed over every sublayer
    and the final mixing. The mixing's elementwise work is not counted."""
    return {"attnres": 2 * cfg_model.d_model * sources_per_token(cfg_model)}


# The summary's rows of an AttnRes trunk: Dense's attention, SwiGLU and norms (the same
# attribute names, `dense.COMPONENTS`), plus the mixings' queries and key-norm weights, which
# are no matmul weights (their dots are `extra_flops`).
COMPONENTS = dense.COMPONENTS + (
    ParamGroup("attnres", ("trunk/layers/attnres/*", "trunk/final_attnres/*"), matmul=False),
)


# ----------------------------------------------------------------------------- modules


class SublayerQueries(nnx.Module):
    """One layer's AttnRes parameters: pseudo-query and key-norm weight of each sublayer."""

    def __init__(self, d, eps, stack=None):
        self.attn_query = param((d,), ("norm",), "zeros", stack=stack)
        self.attn_key_norm = RMSNorm(d, eps, stack=stack)
        self.mlp_query = param((d,), ("norm",), "zeros", stack=stack)
        self.mlp_key_norm = RMSNorm(d, eps, stack=stack)

    def attn(self):
        return self.attn_query[...], self.attn_key_norm.weight[...]

    def mlp(self):
        return self.mlp_query[...], self.mlp_key_norm.weight[...]


class FinalQuery(nnx.Module):
    def __init__(self, d, eps):
        self.query = param((d,), ("norm",), "zeros")
        self.key_norm = RMSNorm(d, eps)

    def __call__(self):
        return self.query[...], self.key_norm.weight[...]


class AttnResLayer(nnx.Module):
    """Attention and SwiGLU sublayers with pre-norms (Dense's names: attn_norm, attn,
    mlp_norm, mlp) plus their AttnRes parameters under `attnres`. No residual adds."""

    def __init__(self, cfg, stack=None):
        d, eps = cfg.d_model, cfg.norm_eps
        self.attn_norm = RMSNorm(d, eps, stack=stack)
        self.attn = Attention(cfg, stack=stack)
        self.mlp_norm = RMSNorm(d, eps, stack=stack)
        self.mlp = MLP(cfg, stack=stack)
        self.attnres = SublayerQueries(d, eps, stack=stack)

    def attention(self, h, positions, segments=None):
        return constrain(self.attn(self.attn_norm(h), positions, segments), ACT)

    def feed_forward(self, h):
        return constrain(self.mlp(self.mlp_norm(h)), ACT)


class AttnResTrunk(nnx.Module):
    """The AttnRes decoder body: `trunk(x, positions, segments) -> (h, {})`, h final-normed
    [B, T, d]. Depth mixing reads only the same token's sources, so packed documents
    (`segments`, onona_jax/packing.py) concern the attention sublayers alone.

    Parameters: trunk/layers/<i>/{attn_norm, attn, mlp_norm, mlp} as Dense, plus
    trunk/layers/<i>/attnres/{attn_query, attn_key_norm, mlp_query, mlp_key_norm},
    trunk/final_attnres/{query, key_norm} and trunk/final_norm (stacked on a leading layers
    axis, without <i>, under `scan_layers`)."""

    def __init__(self, cfg):
        if cfg.layer_pattern not in ("", "attention"):
            raise ValueError(
                f"model.layer_pattern={cfg.layer_pattern!r}: arch attnres supports attention "
                "layers only; leave model.layer_pattern empty"
            )
        k = cfg.attnres.block_size
        if int(k) != k or k < 1:
            raise ValueError(f"model.attnres.block_size={k} must be a positive integer (1 = full AttnRes)")
        self.block_size, self.n_layers, self.eps = int(k), cfg.n_layers, cfg.norm_eps
        self.scan, self.remat = cfg.scan_layers, cfg.remat
        L = cfg.n_layers
        if self.scan:
            self.layers = AttnResLayer(cfg, stack=Stack(L))
        else:
            self.layers = nnx.List([AttnResLayer(cfg) for _ in range(L)])
        self.final_attnres = FinalQuery(cfg.d_model, cfg.norm_eps)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    @property
    def n_slots(self) -> int:
        """Sources of the final AttnRes: the embedding plus ceil(2L / block_size) blocks."""
        return n_sources(2 * self.n_layers, self.block_size)

    def __call__(self, x, positions, segments=None):
        if self.scan:  # the forward that is differentiated: see `_scanned_trained`
            return self.final_norm(self._scanned_trained(x, (positions, segments))), {}
        h, _ = self._unrolled(x, lambda layer, h, c: (layer.attention(h, positions, segments), c), None)
        return self.final_norm(h), {}

    # -- incremental decoding (Model.extend). Depth mixing reads only the same position's
    #    sources, so the caches are the attention layers' K/V buffers alone; the sources of the
    #    new positions are built afresh by the same recurrence as the full forward.

    def init_cache(self, batch: int, max_len: int, dtype):
        """The attention layers' caches: a list over layers, or stacked (scanned)."""
        if self.scan:
            return zeros_stacked(self.layers.attn.init_cache(batch, max_len, dtype), self.n_layers)
        return [layer.attn.init_cache(batch, max_len, dtype) for layer in self.layers]

    def extend(self, x, positions, cache, length, start):
        """`__call__` for T new tokens after `cache`: (final-normed h [B, T, d], cache)."""
        def attend(layer, h, c):
            return layer.attn.extend(layer.attn_norm(h), positions, c, length, start)

        h, cache = self._mix(x, attend, cache)
        return self.final_norm(h), cache

    # -- the recurrence. `attend(layer, h, c) -> (y, c)` runs a layer's attention sublayer
    #    with its per-layer carry c (a decoding cache; None in the full forward).

    def _mix(self, x, attend, caches):
        return (self._scanned if self.scan else self._unrolled)(x, attend, caches)

    def _checkpointed(self, fn):
        return checkpointed(fn, self.remat)

    # Unscanned: the recurrence over a list of completed blocks and the current partial sum.
    def _unrolled(self, x, attend, caches):
        k, eps = self.block_size, self.eps
        caches = [None] * self.n_layers if caches is None else caches

        def layer_fn(layer, blocks, partial, c, s):
            """Sublayers s (attention) and s + 1 (MLP); returns the new (blocks, partial, c)."""
            for j, params in enumerate((layer.attnres.attn, layer.attnres.mlp)):
                sources = blocks + ([partial] if partial is not None else [])
                h = _mix_list(sources, *params(), eps)
                if j == 0:
                    y, c = attend(layer, h, c)
                else:
                    y = layer.feed_forward(h)
                partial = y if partial is None else partial + y
                if (s + j + 1) % k == 0:  # block complete
                    blocks, partial = blocks + [partial], None
            return blocks, partial, c

        blocks, partial, new = [x], None, []  # b_0 = the token embedding, a source of its own
        for i, layer in enumerate(self.layers):
            fn = self._checkpointed(functools.partial(layer_fn, s=2 * i))
            blocks, partial, c = fn(layer, blocks, partial, caches[i])
            new.append(c)
        sources = blocks + ([partial] if partial is not None else [])
        assert len(sources) == self.n_slots
        return _mix_list(sources, *self.final_attnres(), eps), new

    # Scanned: the same recurrence on a fixed buffer of slots with a mask. Layer i's two
    # sublayers write slots `_slots(i)`; `_scanned` is the decoding form, `_scanned_trained`
    # the full forward with its own backward pass.
    def _slots(self, i):
        return 1 + (2 * i) // self.block_size, 1 + (2 * i + 1) // self.block_size

    def _mix_attn(self, layer, buffer, i):
        return _mix_buffer(buffer, n_sources(2 * i, self.block_size), layer.attnres.attn(), self.eps)

    def _mix_mlp(self, layer, buffer, y_attn, i):
        n = n_sources(2 * i + 1, self.block_size)
        return _mix_buffer(buffer, n, layer.attnres.mlp(), self.eps, y_attn, self._slots(i)[0])

    def _advance(self, buffer, y_attn, y_mlp, i):
        slot_attn, slot_mlp = self._slots(i)
        return constrain(_add_to_slot(_add_to_slot(buffer, slot_attn, y_attn), slot_mlp, y_mlp), BUFFER)

    def _scanned(self, x, attend, caches):
        eps, S = self.eps, self.n_slots

        def layer_fn(layer, buffer, c, i):
            y_attn, c = attend(layer, self._mix_attn(layer, buffer, i), c)
            y_mlp = layer.feed_forward(self._mix_mlp(layer, buffer, y_attn, i))
            return self._advance(buffer, y_attn, y_mlp, i), c

        apply = self._checkpointed(layer_fn)
        graphdef, stacked = nnx.split(self.layers)

        def body(buffer, xs):
            layer_state, c, i = xs
            return apply(nnx.merge(graphdef, layer_state), buffer, c, i)

        buffer = jnp.zeros((S, *x.shape), x.dtype).at[0].set(x)
        xs = (stacked, caches, jnp.arange(self.n_layers))
        buffer, caches = jax.lax.scan(body, constrain(buffer, BUFFER), xs)
        return _mix_buffer(buffer, S, self.final_attnres(), eps), caches

    def _scanned_trained(self, x, where):
        """The scanned full forward with a backward pass that keeps O(L) sources, not O(L·S).

        Differentiated through `lax.scan`, the carried buffer would be kept once per layer
        ([L, S, B, T, d]: 16 × 33 slots for the paper's 142M full AttnRes, more than a v5e
        chip holds at micro-batch 16). But a slot, once its block is complete, never changes
        again, so layer i's input buffer is the *final* buffer's slots before its own, its own
        slot as the layer found it (`pre`, kept only for block sizes > 1: with k = 1 it starts
        empty) and zeros after. The custom VJP keeps the final buffer and, per layer, `pre`, the
        attention output (k > 1; with k = 1 it is the final buffer's slot) and the residuals of
        the two sublayers as `model.remat` decides (`jax.vjp` in the forward scan); the reverse
        scan rebuilds each input buffer and recomputes only the mixings (elementwise), as the
        checkpointed `_mix_buffer` already did. `where`: (positions, segments) of the tokens."""
        k, eps, S, L = self.block_size, self.eps, self.n_slots, self.n_layers
        graphdef, stacked = nnx.split(self.layers)

        def sublayers(where):
            def attn(state, h):
                return nnx.merge(graphdef, state).attention(h, *where)

            def mlp(state, h):
                return nnx.merge(graphdef, state).feed_forward(h)

            return self._checkpointed(attn), self._checkpointed(mlp)

        def mix_attn(state, buffer, i):
            return self._mix_attn(nnx.merge(graphdef, state), buffer, i)

        def mix_mlp(state, buffer, y_attn, i):
            return self._mix_mlp(nnx.merge(graphdef, state), buffer, y_attn, i)

        @jax.custom_vjp
        def run(stacked, buffer, where):
            attn, mlp = sublayers(where)

            def body(buffer, xs):
                state, i = xs
                y_attn = attn(state, mix_attn(state, buffer, i))
                y_mlp = mlp(state, mix_mlp(state, buffer, y_attn, i))
                return self._advance(buffer, y_attn, y_mlp, i), None

            return jax.lax.scan(body, buffer, (stacked, jnp.arange(L)))[0]

        def run_fwd(stacked, buffer, where):
            attn, mlp = sublayers(where)

            def body(buffer, xs):
                state, i = xs
                y_attn, pull_attn = jax.vjp(attn, state, mix_attn(state, buffer, i))
                y_mlp, pull_mlp = jax.vjp(mlp, state, mix_mlp(state, buffer, y_attn, i))
                kept = ()  # with k = 1 the bwd reads both from the final buffer
                if k > 1:
                    kept = (jax.lax.dynamic_index_in_dim(buffer, self._slots(i)[0], 0, keepdims=False), y_attn)
                return self._advance(buffer, y_attn, y_mlp, i), (kept, pull_attn, pull_mlp)

            final, per_layer = jax.lax.scan(body, buffer, (stacked, jnp.arange(L)))
            return final, (stacked, final, per_layer)

        def run_bwd(residuals, g_final):
            stacked, final, per_layer = residuals

            def body(g, xs):  # g: the cotangent of layer i's output buffer
                state, i, (kept, pull_attn, pull_mlp) = xs
                slot_attn, slot_mlp = self._slots(i)
                before = (jnp.arange(S) < slot_attn).reshape(S, 1, 1, 1)
                buffer = jnp.where(before, final, jnp.zeros((), final.dtype))
                if k > 1:
                    pre, y_attn = kept
                    buffer = jax.lax.dynamic_update_index_in_dim(buffer, pre, slot_attn, 0)
                else:
                    y_attn = jax.lax.dynamic_index_in_dim(final, slot_attn, 0, keepdims=False)
                take = functools.partial(jax.lax.dynamic_index_in_dim, g, axis=0, keepdims=False)
                d_state_mlp, d_h = pull_mlp(take(slot_mlp))
                _, pull = jax.vjp(lambda st, b, y: mix_mlp(st, b, y, i), state, buffer, y_attn)
                d_state_mix_mlp, d_buffer_mlp, d_y_attn = pull(d_h)
                d_state_attn, d_h = pull_attn(take(slot_attn) + d_y_attn)
                _, pull = jax.vjp(lambda st, b: mix_attn(st, b, i), state, buffer)
                d_state_mix_attn, d_buffer_attn = pull(d_h)
                d_state = jax.tree.map(lambda *d: functools.reduce(jnp.add, d),
                                       d_state_mlp, d_state_mix_mlp, d_state_attn, d_state_mix_attn)
                return constrain(g + d_buffer_mlp + d_buffer_attn, BUFFER), d_state

            g_buffer, d_stacked = jax.lax.scan(body, g_final, (stacked, jnp.arange(L), per_layer), reverse=True)
            return d_stacked, g_buffer, None

        run.defvjp(run_fwd, run_bwd)
        buffer = jnp.zeros((S, *x.shape), x.dtype).at[0].set(x)
        final = run(stacked, constrain(buffer, BUFFER), where)
        return _mix_buffer(final, S, self.final_attnres(), eps)


__all__ = ["attnres_mix", "AttnResTrunk", "AttnResLayer", "n_sources"]
