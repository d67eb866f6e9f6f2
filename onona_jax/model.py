"""The decoder: a Qwen3-style trunk (SPEC §3) and a head that owns the vocabulary tables.

    x0 = head.embed(tokens)            # E[x] or M[x] = (A[x]+B[x])/2
    h  = trunk(x0)                     # blocks, then the final RMSNorm
    log p = head.log_probs(h, x0)      # the gate reads x0

The trunk knows nothing of the head, so another head or a fused loss plugs in on `hidden`.
Parameters are declared with logical axis names; values come from `params.init_params`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from onona_jax import heads as heads_lib
from onona_jax import params as params_lib
from onona_jax.params import Stack, param
from onona_jax.sharding import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ----------------------------------------------------------------------------- pure math


def rms_norm(x, weight, eps):
    """RMSNorm in fp32, cast back to the input dtype (as HF Qwen3RMSNorm)."""
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x.astype(dtype)


def rope(x, positions, theta):
    """Rotary embedding, non-interleaved (rotate_half). x: [B, T, N, D], positions: [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def cached_attention(q, k, v, length, start):
    """Incremental decoding: T new queries at cache slots length..length+T−1 attend over a
    K/V cache [B, S, n_kv, hd] (slots ≥ length+T unwritten). Key slot j is visible to query
    slot i when start_b ≤ j ≤ i: causal, and not one of row b's `start` [B] left pads.
    Grouped heads as `jax.nn.dot_product_attention` (query head n reads KV head n // (N/K));
    logits and softmax in fp32, scale head_dim^-½. A query with no visible key (a pad) gets
    a uniform average of the slots, never NaN. Returns [B, T, N, hd] in v's dtype."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k, preferred_element_type=jnp.float32
    )
    logits = logits * jnp.float32(1.0 / math.sqrt(H))
    q_slot = length + jnp.arange(T)
    k_slot = jnp.arange(S)
    visible = (k_slot[None, None, :] <= q_slot[None, :, None]) & (k_slot[None, None, :] >= start[:, None, None])
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, N, H)


def _zeros_stacked(cache, count: int):
    """A zero cache with a leading `layers` axis of `count` (a scanned, stacked layer)."""
    return jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), cache)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps, axis="norm", stack=None):
        self.weight = param((dim,), (axis,), "ones", stack=stack)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query attention with QK-norm (one weight of size head_dim shared by heads)."""

    def __init__(self, cfg, stack=None):
        d, n, k, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = param((d, n, hd), ("embed", "heads", "head_dim"), stack=stack)
        self.k = param((d, k, hd), ("embed", "kv_heads", "head_dim"), stack=stack)
        self.v = param((d, k, hd), ("embed", "kv_heads", "head_dim"), stack=stack)
        self.o = param((n, hd, d), ("heads", "head_dim", "embed"), stack=stack)
        self.q_norm = RMSNorm(hd, cfg.norm_eps, "head_dim", stack=stack)
        self.k_norm = RMSNorm(hd, cfg.norm_eps, "head_dim", stack=stack)
        self.theta, self.impl = cfg.rope_theta, cfg.attention_impl

    def _qkv(self, x, positions):
        """Projections, QK-norm and RoPE: q [B, T, n, hd], k and v [B, T, n_kv, hd]."""
        dt = x.dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))
        return rope(self.q_norm(q), positions, self.theta), rope(self.k_norm(k), positions, self.theta), v

    def __call__(self, x, positions):
        dt = x.dtype
        q, k, v = self._qkv(x, positions)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        o = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]), implementation=self.impl
        )
        return jnp.einsum("btnh,nhd->btd", o, self.o[...].astype(dt))

    # -- incremental decoding (see Model.extend)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        """Empty K/V buffers [batch, max_len, n_kv, head_dim] in the compute dtype."""
        kv, hd = self.k[...].shape[-2:]
        zeros = jnp.zeros((batch, max_len, kv, hd), dtype)
        return {"k": zeros, "v": zeros}

    def extend(self, x, positions, cache, length, start):
        """`__call__` for T new tokens x [B, T, d] written at cache slots length..length+T−1,
        attending over the cache (`cached_attention`). Returns (y [B, T, d], cache)."""
        dt = x.dtype
        q, k, v = self._qkv(x, positions)
        k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), length, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), length, axis=1)
        o = cached_attention(q, k, v, length, start)
        return jnp.einsum("btnh,nhd->btd", o.astype(dt), self.o[...].astype(dt)), {"k": k, "v": v}


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg, stack=None):
        d, f = cfg.d_model, cfg.d_ff
        self.gate = param((d, f), ("embed", "mlp"), stack=stack)
        self.up = param((d, f), ("embed", "mlp"), stack=stack)
        self.down = param((f, d), ("mlp", "embed"), stack=stack)

    def __call__(self, x):
        dt = x.dtype
        g = x @ self.gate[...].astype(dt)
        u = x @ self.up[...].astype(dt)
        hid = constrain(jax.nn.silu(g) * u, ("batch", "seq", "act_mlp"))
        return hid @ self.down[...].astype(dt)


def mixer(kind: str):
    """Token mixers by name; the other families' modules are imported on first use."""
    if kind == "attention":
        return Attention
    if kind == "gdn":
        from onona_jax.gdn import GatedDeltaNet

        return GatedDeltaNet
    raise ValueError(f"unknown layer kind {kind!r} in model.layer_pattern; use attention or gdn")


def feed_forward(kind: str):
    if kind == "mlp":
        return MLP
    if kind == "moe":
        from onona_jax.moe import MoE

        return MoE
    raise ValueError(f"unknown feed-forward {kind!r}; use mlp or moe")


def gdn_extend(layer, x, cache, length, start):
    """A Gated DeltaNet mixer on T new tokens after its cache: the chunked form for a prompt,
    `step` (the naive recurrence) for one token. Left pads (slots before `start`) get a zero
    input: the layer has no biases, so their q, k, v are zero and they write nothing into the
    (still zero) state and leave zeros in the conv window, exactly as if they were absent."""
    T = x.shape[1]
    valid = (length + jnp.arange(T))[None, :] >= start[:, None]
    x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    if T == 1:
        y, cache = layer.step(x[:, 0], cache)
        return y[:, None], cache
    return layer.forward(x, cache)


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + ffn(norm(x)).

    The mixer is attention (`attn`) or Gated DeltaNet (`gdn`), the feed-forward a SwiGLU
    (`mlp`) or a mixture of experts (`moe`); the attribute names are the parameter paths.
    Returns (x, aux) where aux holds per-layer statistics to be summed over layers (MoE)."""

    def __init__(self, cfg, kind: str = "attention", stack=None):
        self.kind, self.ffn = kind, ffn_kind(cfg)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack)
        setattr(self, MIXER_ATTR[kind], mixer(kind)(cfg, stack=stack))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack)
        setattr(self, self.ffn, feed_forward(self.ffn)(cfg, stack=stack))

    def __call__(self, x, positions):
        x = x + getattr(self, MIXER_ATTR[self.kind])(self.attn_norm(x), positions)
        aux = {}
        y = getattr(self, self.ffn)(self.mlp_norm(x))
        if isinstance(y, tuple):  # MoE: (output, statistics)
            y, aux = y
        x = x + y
        return constrain(x, ("batch", "seq", "act_embed")), aux

    def init_cache(self, batch: int, max_len: int, dtype):
        """The mixer's decoding cache (attention: K/V buffers; GDN: conv window and state);
        the feed-forward needs none."""
        mixer = getattr(self, MIXER_ATTR[self.kind])
        if self.kind == "attention":
            return mixer.init_cache(batch, max_len, dtype)
        return mixer.init_cache(batch, dtype)

    def extend(self, x, positions, cache, length, start):
        """`__call__` for T new tokens after `cache`: (x, cache). A MoE sees only the new
        tokens (capacity per call): serve from `moe.eval_config`, where nothing is dropped."""
        mixer = getattr(self, MIXER_ATTR[self.kind])
        if self.kind == "attention":
            y, cache = mixer.extend(self.attn_norm(x), positions, cache, length, start)
        else:
            y, cache = gdn_extend(mixer, self.attn_norm(x), cache, length, start)
        x = x + y
        y = getattr(self, self.ffn)(self.mlp_norm(x))
        if isinstance(y, tuple):
            y = y[0]
        return x + y, cache


MIXER_ATTR = {"attention": "attn", "gdn": "gdn"}

# arch -> (layer pattern, feed-forward); model.layer_pattern overrides the pattern.
ARCH_LAYOUT = {
    "dense": ("attention", "mlp"),
    "moe": ("attention", "moe"),
    "gdn": ("gdn,gdn,gdn,attention", "mlp"),
    "attnres": ("attention", "mlp"),
}


def layer_pattern(cfg) -> list[str]:
    return (cfg.get("layer_pattern") or ARCH_LAYOUT[cfg.arch][0]).split(",")


def ffn_kind(cfg) -> str:
    return ARCH_LAYOUT[cfg.arch][1]


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def add_aux(total: dict, aux: dict) -> dict:
    return {k: total.get(k, 0) + v for k, v in aux.items()} if aux else total


class Trunk(nnx.Module):
    """The decoder body: L blocks following `layer_pattern`, then the final norm.

    With `scan_layers` each position of the pattern is stacked on a leading `layers` axis
    (Dense: one block stacked L times; GDN hybrid: a group of 3 GDN + 1 attention blocks
    stacked L/4 times) and one compiled group runs under lax.scan."""

    def __init__(self, cfg):
        pattern = layer_pattern(cfg)
        P, L = len(pattern), cfg.n_layers
        self.scan, self.remat = cfg.scan_layers, cfg.remat
        if self.scan and P == 1:
            self.layers = Block(cfg, pattern[0], stack=Stack(L))
        elif self.scan:
            self.layers = nnx.List(
                [Block(cfg, kind, stack=Stack(L // P, P, j)) for j, kind in enumerate(pattern)]
            )
        else:
            self.layers = nnx.List([Block(cfg, pattern[i % P]) for i in range(L)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def __call__(self, x, positions):
        """(h, aux): final-normed hidden states and the blocks' statistics summed over layers."""

        def apply(block, x):
            return block(x, positions)

        if self.remat != "none":
            apply = jax.checkpoint(apply, policy=REMAT_POLICIES[self.remat])
        aux = {}
        if self.scan:
            graphdef, stacked = nnx.split(self.layers)

            def body(carry, layer_state):
                x, aux = carry
                group = nnx.merge(graphdef, layer_state)
                for block in group if isinstance(group, nnx.List) else [group]:
                    x, a = apply(block, x)
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
            _zeros_stacked(block.init_cache(batch, max_len, dtype), block.attn_norm.weight[...].shape[0])
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


class Model(nnx.Module):
    """A decoder family's trunk plus one of the heads of SPEC §2."""

    def __init__(self, cfg):
        self.dtype = DTYPES[cfg.dtype]
        self.head = heads_lib.make_head(cfg)
        if cfg.arch == "attnres":
            from onona_jax.attnres import AttnResTrunk

            self.trunk = AttnResTrunk(cfg)
        else:
            self.trunk = Trunk(cfg)

    def forward(self, tokens, positions=None, x0=None):
        """(h, x0, aux): final hidden states [B, T, d] in the compute dtype, the fp32 input
        rows the gate reads, and the trunk's statistics (MoE routing) summed over layers."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        if x0 is None:
            x0 = self.head.embed(tokens)
        x = constrain(x0.astype(self.dtype), ("batch", "seq", "act_embed"))
        h, aux = self.trunk(x, positions)
        return h, x0, aux

    def hidden(self, tokens, positions=None, x0=None):
        """(h, x0) of `forward`, without the statistics."""
        h, x0, _ = self.forward(tokens, positions, x0)
        return h, x0

    def __call__(self, tokens):
        """fp32 log-probabilities [B, T, V]."""
        h, x0 = self.hidden(tokens)
        return self.head.log_probs(h, x0)

    def target_log_probs(self, tokens, targets, table: str | None = None):
        """fp32 log p(targets) [B, T]; the training loss is its negative mean.

        `table="a"|"b"` is the one-table ablation of a twin model (SPEC §2): that table at
        both input and output, no gate."""
        if table is None:
            h, x0 = self.hidden(tokens)
            return self.head.target_log_probs(h, x0, targets)
        if not hasattr(self.head, "B") or table not in ("a", "b"):
            raise ValueError(f"one-table ablation {table!r} needs a two-table head and table 'a' or 'b'")
        E = (self.head.A if table == "a" else self.head.B)[...]
        h, _ = self.hidden(tokens, x0=jnp.take(E, tokens, axis=0))
        return heads_lib.standard_target_log_probs(h, E, targets)

    # -- incremental decoding (serving.py). A cache is
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


def abstract(cfg):
    """(graphdef, abstract state) of `Model(cfg)`: shapes and metadata only, no allocation."""
    return params_lib.abstract_state(lambda: Model(cfg))


def init(cfg, seed: int, out_shardings=None):
    """(graphdef, params): fp32 parameters keyed by path and seed (see `params.py`), created
    directly with `out_shardings` when given."""
    graphdef, state = abstract(cfg)
    params = jax.jit(lambda: params_lib.init_params(state, seed), out_shardings=out_shardings)()
    return graphdef, params


def bind(graphdef, params) -> Model:
    """A Model that reads `params` (a pure dict of arrays, possibly traced)."""
    return nnx.merge(graphdef, params)
