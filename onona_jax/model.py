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
from onona_jax.params import param
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

    def __call__(self, x, positions):
        dt = x.dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))
        q = rope(self.q_norm(q), positions, self.theta)
        k = rope(self.k_norm(k), positions, self.theta)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        o = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]), implementation=self.impl
        )
        return jnp.einsum("btnh,nhd->btd", o, self.o[...].astype(dt))


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


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, stack=None):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack)
        self.attn = Attention(cfg, stack=stack)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, stack=stack)
        self.mlp = MLP(cfg, stack=stack)

    def __call__(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "seq", "act_embed"))


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Trunk(nnx.Module):
    """The decoder body: L blocks and the final norm. With `scan_layers` the blocks' weights
    are stacked on a leading `layers` axis and one compiled body runs under lax.scan."""

    def __init__(self, cfg):
        L = cfg.n_layers
        self.scan = cfg.scan_layers
        self.remat = cfg.remat
        if self.scan:
            self.layers = Block(cfg, stack=L)
        else:
            self.layers = nnx.List([Block(cfg) for _ in range(L)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def __call__(self, x, positions):
        policy = REMAT_POLICIES[self.remat]

        def apply(block, x):
            return block(x, positions)

        if self.remat != "none":
            apply = jax.checkpoint(apply, policy=policy, static_argnums=())
        if self.scan:
            graphdef, stacked = nnx.split(self.layers)

            def body(x, layer_state):
                return apply(nnx.merge(graphdef, layer_state), x), None

            x, _ = jax.lax.scan(body, x, stacked)
        else:
            for block in self.layers:
                x = apply(block, x)
        return self.final_norm(x)


class Model(nnx.Module):
    """A decoder family's trunk plus one of the heads of SPEC §2."""

    def __init__(self, cfg):
        self.dtype = DTYPES[cfg.dtype]
        self.head = heads_lib.make_head(cfg.head, cfg.vocab_size, cfg.d_model)
        self.trunk = Trunk(cfg)

    def hidden(self, tokens, positions=None, x0=None):
        """(h, x0): final hidden states [B, T, d] in the compute dtype and the fp32 input rows."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        if x0 is None:
            x0 = self.head.embed(tokens)
        x = constrain(x0.astype(self.dtype), ("batch", "seq", "act_embed"))
        return self.trunk(x, positions), x0

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
        if not isinstance(self.head, heads_lib.TwinHead) or table not in ("a", "b"):
            raise ValueError(f"one-table ablation {table!r} needs a twin head and table 'a' or 'b'")
        E = (self.head.A if table == "a" else self.head.B)[...]
        h, _ = self.hidden(tokens, x0=jnp.take(E, tokens, axis=0))
        return heads_lib.standard_target_log_probs(h, E, targets)


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
