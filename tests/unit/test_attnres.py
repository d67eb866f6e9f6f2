"""Attention Residuals (SPEC §3): the mixing function, uniform averaging at initialisation,
the model against a literal PyTorch transcription of the paper's recurrence (Eq. 3-4 for
Full AttnRes, Figure 2 for Block AttnRes), parameter counts, scanned == unscanned. fp32."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO
from onona_jax import config, summary
from onona_jax.aot.hlo import materialised_arrays
from onona_jax import models as model
from onona_jax.models.attnres import AttnResTrunk, _mix_list, attnres_mix, n_sources
from reference.torch_ref import TwinTables, hf_qwen3_config

PAPER = os.path.join(REPO, "configs", "paper.py")
T = 16


def _cfg(block_size=1, scan=False, n_layers=4, head="twin", **overrides):
    cfg = config.load(f"{PAPER}:attnres-tiny-{head}")
    cfg.model.update(n_layers=n_layers, scan_layers=scan, dtype="float32", **overrides)
    cfg.model.attnres.block_size = block_size
    return config.validate(cfg).model


def _noisy(params, seed=0, query_std=0.3, queries=True):
    """Every leaf + N(0, 0.1²) (norm weights off one, tables of order one); the AttnRes
    queries, zero at init, are drawn N(0, query_std²) so the depth softmax is far from
    uniform, or kept at zero (`queries=False`)."""
    r = np.random.default_rng(seed)

    def f(path, x):
        name = jax.tree_util.keystr(path)
        if "query" in name:
            return x + query_std * r.standard_normal(x.shape, np.float32) if queries else x
        return x + 0.1 * r.standard_normal(x.shape, np.float32)

    return jax.tree_util.tree_map_with_path(f, params)


def _tokens(m, seed=0):
    return np.random.default_rng(seed).integers(0, m.vocab_size, (2, T))


# Compiling dominates this file's time: one init per layout (the block size changes no
# shapes) and one compiled forward per config, shared by the tests.
@functools.lru_cache(maxsize=None)
def _init(scan):
    return model.init(_cfg(scan=scan), 0)[1]


@functools.lru_cache(maxsize=None)
def _forward(block_size, scan, remat="none"):
    graphdef, _ = model.abstract(_cfg(block_size, scan, remat=remat))
    return jax.jit(lambda p, t: model.bind(graphdef, p)(t))


def _log_probs(m, params, tokens):
    return np.asarray(_forward(m.attnres.block_size, m.scan_layers, m.remat)(params, tokens))


# ----------------------------------------------------------------------------- mixing


def test_mix_matches_naive_and_averages_at_zero_query():
    r = np.random.default_rng(1)
    S, d = 5, 32
    scales = r.uniform(0.1, 10, (S, 1, 1, 1)).astype(np.float32)  # the key norm must level these
    v = r.standard_normal((S, 2, 3, d)).astype(np.float32) * scales
    g = (1 + 0.1 * r.standard_normal(d)).astype(np.float32)
    w = r.standard_normal(d).astype(np.float32)
    mask = np.array([True, True, False, True, False])

    # fla naive_attnres, scale 1: softmax over sources of wᵀ rms_norm(v; g), weights on v.
    def naive(v, w, mask=None):
        v = torch.from_numpy(v)
        keys = F.rms_norm(v, (d,), torch.from_numpy(g), 1e-6)
        logits = torch.einsum("sbtd,d->sbt", keys, torch.from_numpy(w))
        if mask is not None:
            logits = logits.masked_fill(~torch.from_numpy(mask)[:, None, None], float("-inf"))
        return torch.einsum("sbt,sbtd->btd", logits.softmax(0), v).numpy()

    np.testing.assert_allclose(attnres_mix(v, w, g, 1e-6), naive(v, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attnres_mix(v, w, g, 1e-6, mask=mask), naive(v, w, mask), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attnres_mix(v, w, g, 1e-6, mask=mask), naive(v[mask], w), rtol=1e-5, atol=1e-5)
    # The unscanned trunk's source-by-source form (a list, only present sources).
    np.testing.assert_allclose(_mix_list(list(v[mask]), w, g, 1e-6), naive(v[mask], w), rtol=1e-5, atol=1e-5)
    # A zero query gives the plain average of the (unmasked) sources, whatever the norm weight.
    zero = np.zeros(d, np.float32)
    np.testing.assert_allclose(attnres_mix(v, zero, g, 1e-6), v.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(attnres_mix(v, zero, g, 1e-6, mask=mask), v[mask].mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_mix_list(list(v), zero, g, 1e-6), v.mean(0), rtol=1e-6, atol=1e-6)
    # bf16 sources: the mix runs in fp32 and returns bf16.
    out = attnres_mix(jnp.asarray(v, jnp.bfloat16), w, g, 1e-6)
    assert out.dtype == jnp.bfloat16


def test_sources_per_sublayer():
    assert [n_sources(s, 1) for s in range(9)] == list(range(1, 10))
    assert [n_sources(s, 4) for s in range(9)] == [1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert [n_sources(s, 3) for s in range(9)] == [1, 2, 2, 2, 3, 3, 3, 4, 4]


# ----------------------------------------------------------------------------- torch reference


class TorchAttnRes(nn.Module):
    """The recurrence transcribed from the paper on HF Qwen3 sublayers, with onóna's twin
    head (torch_ref.TwinTables). Full AttnRes (block_size 1): Eq. 3-4, the sources of
    sublayer l are [h_1, f_1(h_1), ..., f_{l-1}(h_{l-1})], h_1 the token embedding. Block
    AttnRes: Figure 2 line by line (block_size counts sublayers; layer_number from 0, so
    the embedding is blocks[0]). A final AttnRes precedes the final norm. Queries and key
    norms are indexed by sublayer: 2i attention, 2i+1 MLP of layer i, 2L the final one.
    `uniform=True` replaces the softmax by the plain mean."""

    def __init__(self, m, uniform=False):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import (
            Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding)

        hf = hf_qwen3_config(m)
        d, L = m.d_model, m.n_layers
        self.L, self.d, self.eps, self.uniform = L, d, m.norm_eps, uniform
        self.block_size = m.attnres.block_size
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(
                input_layernorm=Qwen3RMSNorm(d, m.norm_eps), self_attn=Qwen3Attention(hf, i),
                post_attention_layernorm=Qwen3RMSNorm(d, m.norm_eps), mlp=Qwen3MLP(hf),
            )) for i in range(L)
        )
        self.query = nn.Parameter(torch.zeros(2 * L + 1, d))
        self.key_norm = nn.Parameter(torch.ones(2 * L + 1, d))
        self.norm = Qwen3RMSNorm(d, m.norm_eps)
        self.rotary = Qwen3RotaryEmbedding(hf)
        self.twin = TwinTables(m.vocab_size, d)

    def attn_res(self, sources, j):
        V = torch.stack(sources)  # [S, B, T, D]
        if self.uniform:
            return V.mean(0)
        K = F.rms_norm(V, (self.d,), self.key_norm[j], self.eps)
        logits = torch.einsum("d, n b t d -> n b t", self.query[j], K)
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V)

    def forward(self, ids):
        x0 = self.twin.embed(ids)
        T = ids.shape[1]
        pe = self.rotary(x0, torch.arange(T)[None])
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

        def attn(layer, h):
            return layer["self_attn"](layer["input_layernorm"](h), pe, mask)[0]

        def mlp(layer, h):
            return layer["mlp"](layer["post_attention_layernorm"](h))

        if self.block_size == 1:  # Eq. 3-4
            v = [x0]
            for i, layer in enumerate(self.layers):
                v.append(attn(layer, self.attn_res(v, 2 * i)))
                v.append(mlp(layer, self.attn_res(v, 2 * i + 1)))
            h = self.attn_res(v, 2 * self.L)
        else:  # Figure 2
            assert self.block_size % 2 == 0
            blocks, hidden_states = [], x0
            for layer_number, layer in enumerate(self.layers):
                partial_block = hidden_states
                h = self.attn_res(blocks + [partial_block], 2 * layer_number)
                if layer_number % (self.block_size // 2) == 0:
                    blocks.append(partial_block)
                    partial_block = None
                attn_out = attn(layer, h)
                partial_block = partial_block + attn_out if partial_block is not None else attn_out
                h = self.attn_res(blocks + [partial_block], 2 * layer_number + 1)
                mlp_out = mlp(layer, h)
                partial_block = partial_block + mlp_out
                hidden_states = partial_block
            h = self.attn_res(blocks + [hidden_states], 2 * self.L)
        return self.twin.log_probs(self.norm(h), x0)

    @torch.no_grad()
    def load_from_jax(self, params, m):
        t = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
        d, n, k, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
        tr = params["trunk"]
        for i, layer in enumerate(self.layers):
            p = tr["layers"][i]
            a = layer["self_attn"]
            layer["input_layernorm"].weight.copy_(t(p["attn_norm"]["weight"]))
            a.q_proj.weight.copy_(t(p["attn"]["q"]).reshape(d, n * hd).T)
            a.k_proj.weight.copy_(t(p["attn"]["k"]).reshape(d, k * hd).T)
            a.v_proj.weight.copy_(t(p["attn"]["v"]).reshape(d, k * hd).T)
            a.o_proj.weight.copy_(t(p["attn"]["o"]).reshape(n * hd, d).T)
            a.q_norm.weight.copy_(t(p["attn"]["q_norm"]["weight"]))
            a.k_norm.weight.copy_(t(p["attn"]["k_norm"]["weight"]))
            layer["post_attention_layernorm"].weight.copy_(t(p["mlp_norm"]["weight"]))
            layer["mlp"].gate_proj.weight.copy_(t(p["mlp"]["gate"]).T)
            layer["mlp"].up_proj.weight.copy_(t(p["mlp"]["up"]).T)
            layer["mlp"].down_proj.weight.copy_(t(p["mlp"]["down"]).T)
            r = p["attnres"]
            self.query[2 * i].copy_(t(r["attn_query"]))
            self.key_norm[2 * i].copy_(t(r["attn_key_norm"]["weight"]))
            self.query[2 * i + 1].copy_(t(r["mlp_query"]))
            self.key_norm[2 * i + 1].copy_(t(r["mlp_key_norm"]["weight"]))
        self.query[-1].copy_(t(tr["final_attnres"]["query"]))
        self.key_norm[-1].copy_(t(tr["final_attnres"]["key_norm"]["weight"]))
        self.norm.weight.copy_(t(tr["final_norm"]["weight"]))
        h = params["head"]
        self.twin.A.copy_(t(h["A"]))
        self.twin.B.copy_(t(h["B"]))
        self.twin.w.weight.copy_(t(h["gate"])[None])
        return self.eval()


def _torch_log_probs(m, params, tokens, uniform=False):
    ref = TorchAttnRes(m, uniform=uniform).load_from_jax(params, m)
    with torch.no_grad():
        return ref(torch.from_numpy(tokens)).numpy()


@pytest.mark.parametrize("block_size", [1, 4])
def test_matches_torch_recurrence(block_size):
    m = _cfg(block_size)
    params = _noisy(_init(False))
    assert float(np.abs(params["trunk"]["layers"][0]["attnres"]["attn_query"]).mean()) > 0.1
    tokens = _tokens(m)
    ours = _log_probs(m, params, tokens)
    theirs = _torch_log_probs(m, params, tokens)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    # The queries matter: the same weights with uniform mixing give other log-probs.
    uniform = _torch_log_probs(m, params, tokens, uniform=True)
    assert np.abs(ours - uniform).max() > 1e-2


@pytest.mark.parametrize("block_size", [1, 4])
def test_init_is_uniform_average(block_size):
    """At initialisation (zero queries) every sublayer reads the plain mean of its sources:
    the model (other weights randomised) equals the reference with mean mixing, and the key
    norms, which only scale the zero logits, change nothing at all."""
    m = _cfg(block_size)
    params = _init(False)
    assert all(not np.any(x) for p, x in jax.tree_util.tree_leaves_with_path(params)
               if "query" in jax.tree_util.keystr(p))
    params = _noisy(params, queries=False)
    tokens = _tokens(m)
    ours = _log_probs(m, params, tokens)
    np.testing.assert_allclose(ours, _torch_log_probs(m, params, tokens, uniform=True), rtol=0, atol=1e-4)
    rescaled = jax.tree_util.tree_map_with_path(
        lambda p, x: 3.0 * x if "key_norm" in jax.tree_util.keystr(p) else x, params)
    np.testing.assert_array_equal(_log_probs(m, rescaled, tokens), ours)


# ----------------------------------------------------------------------------- structure


def test_parameter_counts():
    std = summary.param_counts(config.load(f"{PAPER}:attnres-142m-standard").model)
    dense = summary.param_counts(config.load(f"{PAPER}:dense-142m-standard").model)
    assert std["non_embedding"] == 103_887_104
    assert std["attnres"] == (2 * 16 + 1) * 2 * 768
    assert std["non_embedding"] - dense["non_embedding"] == std["attnres"]
    for c in ("attention", "mlp", "norms", "tables"):
        assert std[c] == dense[c]
    twin = summary.param_counts(config.load(f"{PAPER}:attnres-142m-twin").model)
    assert twin["total"] - std["total"] == 50304 * 768 + 768


def _unstack(params, L):
    """Scanned params -> the unscanned tree: layer i of the stack is layer i."""
    out = dict(params, trunk=dict(params["trunk"]))
    out["trunk"]["layers"] = {i: jax.tree.map(lambda a: a[i], params["trunk"]["layers"]) for i in range(L)}
    return out


def test_scanned_init_equals_unscanned():
    """Path-keyed init: layer i of the stacked parameters is layer i of the unscanned ones."""
    p_scan, p_loop = _unstack(_init(True), 4), _init(False)
    assert jax.tree.structure(p_scan) == jax.tree.structure(p_loop)
    for a, b in zip(jax.tree.leaves(p_scan), jax.tree.leaves(p_loop)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("block_size,remat", [(1, "none"), (3, "full"), (4, "dots")])
def test_scanned_equals_unscanned(block_size, remat):
    """Same log-probs (to fp32 reassociation: the unscanned mixing sums source by source,
    the scanned one reduces a masked buffer; log-probs are about -11). Block size 3 puts
    block boundaries between a layer's attention and its MLP and leaves the last block
    partial (8 sublayers); with remat (the scan body checkpointed) too."""
    scanned, unscanned = _cfg(block_size, scan=True, remat=remat), _cfg(block_size, scan=False)
    p_scan = _noisy(_init(True))
    tokens = _tokens(scanned)
    ours = _log_probs(scanned, p_scan, tokens)
    np.testing.assert_allclose(ours, _log_probs(unscanned, _unstack(p_scan, 4), tokens), rtol=0, atol=2e-5)


@pytest.mark.parametrize("block_size,remat", [  # blocks of 1 and 3 are slow: suite-time margin
    pytest.param(1, "none", marks=pytest.mark.slow), (2, "attention"), pytest.param(3, "full", marks=pytest.mark.slow)])
def test_scanned_gradients_equal_unscanned(block_size, remat):
    """The scanned backward is our own (`_scanned_trained`: rebuilt input buffers, the
    sublayers' residuals as the remat policy keeps them); the unscanned one is JAX's. Block
    size 1 reads the attention output from the final buffer, 2 and 3 keep it and the slot's
    partial sum; 3 puts a block boundary inside a layer."""
    scanned, unscanned = _cfg(block_size, scan=True, remat=remat), _cfg(block_size, scan=False)
    p_scan = _noisy(_init(True))
    tokens = _tokens(scanned)

    def grads(m, params):
        graphdef, _ = model.abstract(m)
        def loss(p):
            return -model.bind(graphdef, p).target_log_probs(tokens[:, :-1], tokens[:, 1:]).mean()

        return jax.jit(jax.grad(loss))(params)

    g_scan, g_loop = _unstack(grads(scanned, p_scan), 4), grads(unscanned, _unstack(p_scan, 4))
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_loop)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max()))
    # Gradients reach the queries and key norms.
    assert float(np.abs(g_scan["trunk"]["layers"][1]["attnres"]["attn_query"]).max()) > 0
    assert float(np.abs(g_loop["trunk"]["layers"][1]["attnres"]["mlp_query"]).max()) > 0
    assert float(np.abs(g_loop["trunk"]["final_attnres"]["key_norm"]["weight"]).max()) > 0


def test_scanned_backward_keeps_no_buffer_per_layer():
    """Differentiated through `lax.scan`, the carried [S, B, T, d] buffer of sources would be
    kept once per layer, [L, S, B, T, d], O(L²) sources for full AttnRes (the paper's 142M
    did not fit a v5e chip at micro-batch 16). The compiled training gradient materialises
    no such array."""
    m = _cfg(1, scan=True, n_layers=8, remat="full")
    graphdef, params = model.abstract(m)
    tokens = jax.ShapeDtypeStruct((4, T + 1), jnp.int32)

    def loss(p, t):
        return -model.bind(graphdef, p).target_log_probs(t[:, :-1], t[:, 1:]).mean()

    hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    S = n_sources(2 * 8, 1)
    per_layer = f"[8,{S},4,{T},{m.d_model}]"
    shapes = {shape for shape, _ in materialised_arrays(hlo)}
    assert any(f"[{S},4,{T},{m.d_model}]" in s for s in shapes)  # the buffer itself, once
    assert not [s for s in shapes if s.endswith(per_layer)]


@pytest.mark.parametrize("field,value,words", [
    ("block_size", 0, "block_size"),
    ("layer_pattern", "gdn,attention", "attention layers only"),
])
def test_rejects_bad_config(field, value, words):
    m = _cfg()
    if field == "block_size":
        m.attnres.block_size = value
    else:
        m.layer_pattern = value
    with pytest.raises(ValueError, match=words):
        AttnResTrunk(m)
