"""Model structure: exact parameter counts from the parameter tree, the summary CLI, FLOPs
against XLA's own count, config validation, and path-keyed initialisation."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO
from onona_jax import config, summary
from onona_jax import models as model


def load(spec):
    return config.load(os.path.join(REPO, f"configs/paper.py:{spec}"))


@pytest.mark.parametrize(
    "spec,total,non_embedding",
    [
        ("dense-142m-standard", 142_469_888, 103_836_416),
        ("dense-142m-twin", 181_104_128, 103_836_416 + 768),
        ("dense-330m-standard", 329_961_472, 278_450_176),
        ("dense-1b-standard", 1_031_098_880, 928_076_288),
    ],
)
def test_exact_parameter_counts(spec, total, non_embedding):
    counts = summary.param_counts(load(spec).model)
    assert counts["total"] == total
    assert counts["non_embedding"] == non_embedding


@pytest.mark.parametrize("size", ["142m", "330m", "1b"])
def test_twin_adds_vd_plus_d(size):
    std = summary.param_counts(load(f"dense-{size}-standard").model)["total"]
    twin = summary.param_counts(load(f"dense-{size}-twin").model)["total"]
    d = load(f"dense-{size}-twin").model.d_model
    assert twin - std == 50304 * d + d


def dense_count(V, d, layers, heads, kv_heads, head_dim, d_ff, head):
    """Dense parameters by a closed formula, independent of the model code: the tied table V·d
    (twin: a second V·d table and the gate's d); per layer q and o (d · heads·head_dim each),
    k and v (d · kv_heads·head_dim each), QK-norm (2 · head_dim), SwiGLU (3 · d · d_ff) and two
    RMSNorms (2d); the final RMSNorm (d)."""
    attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 2 * head_dim
    layer = attention + 3 * d * d_ff + 2 * d
    tables = (2 if head == "twin" else 1) * V * d
    return tables + (d if head == "twin" else 0) + layers * layer + d


def load_at(spec, tokenizer):
    cfg = config.from_spec(os.path.join(REPO, f"configs/paper.py:{spec}"))
    cfg.data.tokenizer = tokenizer
    return config.validate(cfg)


# (d, layers, heads, kv_heads, head_dim, d_ff) of configs/paper.py's sizes, restated
SHAPES = {"142m": (768, 16, 12, 6, 64, 2048), "1b": (2048, 20, 32, 16, 64, 5504),
          "3b": (3072, 28, 24, 8, 128, 8192), "8b": (4096, 32, 32, 8, 128, 14336)}


@pytest.mark.parametrize("head", ["standard", "twin"])
@pytest.mark.parametrize(
    "size,tokenizer,V,standard",
    [
        ("142m", "size:128256", 128_256, 202_337_024),  # Llama-3's vocabulary
        ("142m", "size:151936", 151_936, 220_523_264),  # Qwen's (151,936 is a multiple of 128)
        ("1b", "size:128256", 128_256, 1_190_744_576),
        ("1b", "size:151936", 151_936, 1_239_241_216),
        ("3b", "gpt2", 50_304, 2_973_288_448),
        ("3b", "size:128256", 128_256, 3_212_756_992),
        ("8b", "gpt2", 50_304, 7_185_641_472),
        ("8b", "size:128256", 128_256, 7_504_932_864),
    ],
)
def test_exact_parameter_counts_at_other_vocabularies(size, tokenizer, V, standard, head, capsys):
    """Any tokenizer's vocabulary (data.tokenizer=size:N, rounded up to 128) and the sizes past
    the paper: the closed formula, the parameter tree `init` builds (abstractly: jax.eval_shape,
    nothing allocated or compiled) and the summary CLI agree, to the parameter."""
    from onona_jax import params as params_lib

    cfg = load_at(f"dense-{size}-{head}", tokenizer)
    d = SHAPES[size][0]
    assert cfg.model.vocab_size == V
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads,
            cfg.model.head_dim, cfg.model.d_ff) == SHAPES[size]
    expected = dense_count(V, *SHAPES[size], head)
    assert expected == (standard if head == "standard" else standard + V * d + d)
    _, state = model.abstract(cfg.model)
    tree = jax.eval_shape(lambda: params_lib.init_params(state, 0))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)) == expected
    assert summary.main([f"--config={REPO}/configs/paper.py:dense-{size}-{head}",
                         f"--config.data.tokenizer={tokenizer}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == expected
    assert out["tables"] == (2 if head == "twin" else 1) * V * d
    assert out["non_embedding"] == expected - out["tables"]


def test_summary_cli_json(capsys):
    assert summary.main([f"--config={REPO}/configs/paper.py:dense-142m-twin", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 181_104_128
    assert out["tables"] == 2 * 50304 * 768 and out["gate"] == 768
    assert sum(out[c] for c in out["components"]) == out["total"]


def test_summary_cli_rejects_unknown_config(capsys):
    assert summary.main([f"--config={REPO}/configs/paper.py:dense-142m-nohead"]) == 2
    assert "head" in capsys.readouterr().err


def test_flops_formula_matches_xla_cost_analysis():
    """Our matmul FLOPs per token agree with XLA's count of the compiled forward pass
    (which also counts elementwise work, hence the one-sided margin). Unscanned: XLA's cost
    analysis counts a scan body once, not once per layer."""
    cfg = load("dense-tiny-twin")
    cfg.model.update(n_layers=4, scan_layers=False, loss="plain")  # scans (fused loss too) count once
    T, B = 64, 2
    graphdef, params = model.init(cfg.model, 0)
    tokens = jnp.zeros((B, T), jnp.int32)
    fwd = jax.jit(lambda p, t: model.bind(graphdef, p).target_log_probs(t, t))
    xla = fwd.lower(params, tokens).compile().cost_analysis()["flops"]
    ours = summary.flops_per_token(cfg.model, T, causal=False)["forward"] * B * T  # XLA computes the square
    assert ours <= xla <= 1.05 * ours


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("arch", "rnn", "model.arch"),
        ("head", "tripled", "model.head"),
        ("n_kv_heads", 3, "not divisible by model.n_kv_heads"),
        ("n_heads", 5, "not divisible"),
        ("remat", "some", "model.remat"),
        ("attention_impl", "flash", "model.attention_impl"),
    ],
)
def test_invalid_config_values(field, value, words):
    cfg = load("dense-tiny-twin")
    cfg.model[field] = value
    with pytest.raises(ValueError, match=words):
        config.validate(cfg)


def test_unknown_config_arg():
    with pytest.raises(ValueError, match="expected <arch>-<size>-<head>|arch in"):
        load("dense-huge-twin")


def test_init_is_keyed_by_path():
    """Body and table A start identical across heads, and the draw is N(0, 0.02²)."""
    cfg = load("dense-tiny-twin")
    _, twin = model.init(cfg.model, 7)
    cfg.model.head = "standard"
    _, std = model.init(cfg.model, 7)
    np.testing.assert_array_equal(std["head"]["embedding"], twin["head"]["A"])
    for a, b in zip(jax.tree.leaves(std["trunk"]), jax.tree.leaves(twin["trunk"])):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(twin["head"]["A"], twin["head"]["B"])
    assert float(jnp.std(twin["head"]["B"])) == pytest.approx(0.02, rel=0.01)
    _, other_seed = model.init(cfg.model, 8)
    assert not np.array_equal(other_seed["head"]["embedding"], std["head"]["embedding"])


def test_swiglu_backward_matches_autodiff():
    """`swiglu_mlp`'s written-out backward pass against autodiff of the plain formula: every
    gradient to fp32 rounding (1e-5 relative to the largest entry)."""
    import jax.numpy as jnp

    from onona_jax.layers import swiglu_mlp

    r = np.random.default_rng(0)
    x, dy = r.standard_normal((2, 7, 16), np.float32), r.standard_normal((2, 7, 16), np.float32)
    wg, wu = (r.standard_normal((16, 24), np.float32) for _ in range(2))
    wd = r.standard_normal((24, 16), np.float32)
    plain = lambda x, a, b, c: (jax.nn.silu(x @ a) * (x @ b)) @ c  # noqa: E731
    out, vjp = jax.vjp(swiglu_mlp, x, wg, wu, wd)
    ref, vjp_ref = jax.vjp(plain, x, wg, wu, wd)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * float(jnp.abs(ref).max()))
    for g, g_ref in zip(vjp(dy), vjp_ref(dy)):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5 * float(jnp.abs(g_ref).max()))
