"""The vLLM plugin's torch-only pieces (`onona_jax/serve/vllm/head.py`, `weights.py`), without
vLLM: the input id carried in the hidden rows, the mixture log-probs (against float64 and
against `Server.log_probs` through an export's own tensors), the export -> vLLM weight plan of
real exports, the one-projection request check and component draws. The plugin end to end
(vLLM itself) is tests/integration/test_vllm_e2e.py (slow)."""

import json
import os
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import tiny_config
from onona_jax import models as model_lib
from onona_jax.serve import hf_format
from onona_jax.serve import server as serving
from onona_jax.serve.vllm import head, weights
from test_serving import _gof, _init, _model_cfg

GPT2_V = 50_304


# ----------------------------------------------------------------------------- the carried input id


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_carried_ids_round_trip_exactly(dtype):
    """Every id of a 50,304 vocabulary survives carry_ids -> dtype -> read_ids (2 digits)."""
    ids = torch.arange(GPT2_V)
    columns = head.id_columns(GPT2_V)
    assert columns == 2 and head.id_columns(256) == 1 and head.id_columns(257) == 2 and head.id_columns(2**24) == 3
    carried = head.carry_ids(ids, columns, dtype)
    assert carried.dtype == dtype and carried.shape == (GPT2_V, 2)
    assert torch.equal(head.read_ids(carried, GPT2_V), ids)
    # beside hidden columns of the same dtype, as forward returns them
    rows = torch.cat([torch.randn(GPT2_V, 3).to(dtype), carried], dim=-1)
    h, back = head.split_rows(rows, 3, GPT2_V)
    assert torch.equal(back, ids) and torch.equal(h, rows[:, :3])


def test_noise_columns_read_as_valid_ids():
    """vLLM's dummy sampler run fills the rows with uniform [0, 1) noise: each digit rounds
    to 0 or 1, so the ids are 0, 1, 256, 257; out-of-range digits and ids are clamped."""
    noise = torch.rand(10_000, 2, generator=torch.Generator().manual_seed(0))
    got = head.read_ids(noise, GPT2_V)
    assert torch.equal(got, noise[:, 0].round().long() + 256 * noise[:, 1].round().long())
    assert set(got.tolist()) == {0, 1, 256, 257}
    wild = torch.tensor([[-7.0, -3.0], [300.0, 300.0], [255.0, 255.0], [10.4, 1.6]])
    assert head.read_ids(wild, GPT2_V).tolist() == [0, GPT2_V - 1, GPT2_V - 1, 10 + 2 * 256]


# ----------------------------------------------------------------------------- the mixture


def _reference(logits, log_weights, score):
    """float64 numpy: log Σ_k w_k softmax(score(z_k))."""
    z = np.stack([np.asarray(x, np.float64) for x in logits])  # [K, N, V]
    if score == "sigsoftmax":
        z = 2 * z - np.logaddexp(0, z)
    log_sm = z - np.max(z, -1, keepdims=True)
    log_sm -= np.log(np.sum(np.exp(log_sm), -1, keepdims=True))
    if log_weights is None:
        return log_sm[0]
    t = log_sm + np.asarray(log_weights, np.float64).T[:, :, None]
    m = t.max(0)
    return m + np.log(np.exp(t - m).sum(0))


@pytest.mark.parametrize("K,score", [(1, ""), (2, ""), (2, "sigsoftmax"), (3, ""), (3, "sigsoftmax")])
def test_mixture_log_probs_match_float64(K, score):
    """fp32 mixture log-probs = the float64 reference to 2e-5: logits of scale 4 over V = 4,096 give
    log-probs down to about -47, and fp32's relative rounding (6e-8) over the log_softmax's
    few operations on numbers of that size is ~1e-5 at worst. A component weight of e^-200 (0
    in fp32 probability) still counts in log space, and the rows normalise."""
    g = torch.Generator().manual_seed(K)
    N, V = 16, 4096
    logits = [4 * torch.randn(N, V, generator=g) for _ in range(K)]
    log_w = None
    if K > 1:
        log_w = torch.log_softmax(torch.randn(N, K, generator=g), -1)
        log_w[0] = torch.tensor([0.0] + [-200.0] * (K - 1))
    got = head.mixture_log_probs(logits, log_w, score)
    assert got.dtype == torch.float32 and got.shape == (N, V)
    want = _reference(logits, None if log_w is None else log_w.numpy(), score)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(torch.logsumexp(got.double(), -1).numpy(), 0.0, atol=1e-5)
    # one-projection's logits of one table (score applied) give that table's component
    one = torch.log_softmax(head.score_logits(logits[0], score), -1).numpy()
    np.testing.assert_allclose(one, _reference(logits[:1], None, score), rtol=0, atol=2e-5)
    if K > 1:  # row 0: the first table's softmax alone, to fp32 rounding
        np.testing.assert_allclose(got[0].numpy(), _reference(logits[:1], None, score)[0], rtol=0, atol=2e-5)
        assert not np.allclose(got[1].numpy(), _reference(logits[:1], None, score)[1], atol=1e-2)


def test_mixture_from_export_tensors_equals_server_log_probs():
    """The plugin's head on the JAX model's final hidden states and the export's own tensors
    (`hf_format.to_hf_described`: the tables config.json names, the gate lookup by input
    token carried through the hidden rows) = `Server.log_probs` of the twin model, to 1e-5
    (fp32 both sides; summation order)."""
    m = _model_cfg("dense", True)
    graphdef, params = _init(m, seed=3)
    server = serving.Server(m, params)
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (2, 9))
    h, _ = model_lib.bind(graphdef, params).hidden(jnp.asarray(tokens))
    tensors, desc = hf_format.to_hf_described(params, m)
    assert desc["head_outputs"] == ["twin.A", "twin.B"] and desc["head_log_weights"] == "head.log_weights"

    h = torch.from_numpy(np.array(h, np.float32)).reshape(-1, m.d_model)
    ids = torch.from_numpy(tokens).reshape(-1)
    rows = torch.cat([h, head.carry_ids(ids, head.id_columns(m.vocab_size))], -1)  # forward's output
    h, ids = head.split_rows(rows, m.d_model, m.vocab_size)
    tables = [torch.tensor(tensors[n]) for n in desc["head_outputs"]]
    log_w = torch.tensor(tensors[desc["head_log_weights"]])[ids]
    got = head.mixture_log_probs([h @ T.T for T in tables], log_w, desc["head_score"])
    want = server.log_probs(tokens).reshape(-1, m.vocab_size)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5)
    # the gate matters here: the first table alone is far off
    assert np.abs(head.mixture_log_probs([h @ tables[0].T]).numpy() - want).max() > 0.05


def test_mos_log_probs_equal_the_export_model():
    """head_rule "mos" (moss: sigsoftmax components): `mos_log_probs` from the prior logits
    h W_π and the context logits tanh(h W_k) Eᵀ = modeling_onona's head (transformers 5.x,
    the export's own code) to 1e-5."""
    from onona_jax.serve.hf.modeling_onona import mixture_log_probs as hf_mixture

    g = torch.Generator().manual_seed(1)
    N, d, K, V = 6, 16, 3, 300
    h, E = torch.randn(N, d, generator=g), torch.randn(V, d, generator=g)
    proj, prior = 0.3 * torch.randn(K, d, d, generator=g), torch.randn(d, K, generator=g)
    for score in ("", "sigsoftmax"):
        contexts = torch.tanh(torch.einsum("nd,kde->nke", h, proj))
        got = head.mos_log_probs(h @ prior, contexts @ E.T, score)
        # modeling_onona.OnonaForCausalLM.head_log_probs, mos branch, spelled out
        want = torch.logsumexp(torch.log_softmax(h @ prior, -1).unsqueeze(-1)
                               + hf_mixture(contexts, [E], None, score), dim=-2)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(torch.logsumexp(got.double(), -1).numpy(), 0.0, atol=1e-5)


# ----------------------------------------------------------------------------- the weight plan


def _layer_targets(i, family):
    p = f"model.layers.{i}."
    own = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
           "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    own += (["mlp.gate_up_proj.weight", "mlp.down_proj.weight"] if family == "dense" else
            ["mlp.gate.weight", "mlp.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w2_weight"])
    return {p + n for n in own}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A real tiny export per (family, head) (no tokenizer files), made on first use."""
    made = {}

    def get(arch, head_name):
        if (arch, head_name) not in made:
            root = tmp_path_factory.mktemp("vllm-plan")
            cfg = tiny_config(str(root / "no-data"), head=head_name, arch=arch)
            params = model_lib.init(cfg.model, 0)[1]
            out = str(root / f"{arch}-{head_name}")
            hf_format.export(params, cfg, out, tokenizer=False)
            from safetensors import safe_open

            with safe_open(os.path.join(out, "model.safetensors"), "np") as f:
                names = set(f.keys())
            made[(arch, head_name)] = json.load(open(os.path.join(out, "config.json"))), names
        return made[(arch, head_name)]

    return get


# head -> (export name -> vLLM target of the head tensors, dropped by name)
HEAD_PLANS = {
    "twin": ({"twin.A": ("tables.0.weight", None), "twin.B": ("tables.1.weight", None),
              "head.log_weights": ("log_weights", None)}, ("twin.gate.weight",)),
    "sigsoftmax": ({}, ()),  # one table, the input table itself (tied)
    "mos": ({"mos.proj": ("mos_proj", None), "mos.prior": ("mos_prior", None)}, ()),
}


@pytest.mark.parametrize("arch,head_name", [("dense", "twin"), ("moe", "twin"), ("dense", "sigsoftmax"),
                                            ("dense", "mos")])
def test_weight_plan_of_real_exports(arch, head_name, exports):
    """Every tensor of a real export is loaded into a named vLLM parameter (Qwen3's stacked
    qkv_proj / gate_up_proj with their shards, FusedMoE's w13 / w2, the head's tables) or
    dropped by name; the parameters filled are exactly the ones the vLLM model builds (the
    model checks the same at load time)."""
    config, names = exports(arch, head_name)
    plan = weights.weight_plan(names, config)
    assert set(plan.targets) | set(plan.dropped) == names and not set(plan.targets) & set(plan.dropped)
    head_targets, dropped = HEAD_PLANS[head_name]
    assert plan.dropped == dropped
    L = config["num_hidden_layers"]
    assert L == 2
    want_params = {"model.embed_tokens.weight", "model.norm.weight"}
    want_params |= set().union(*(_layer_targets(i, arch) for i in range(L)))
    want_params |= {t for t, _ in head_targets.values()} - {weights.LOG_WEIGHTS}
    assert plan.parameters() == want_params
    for name, (target, shard) in head_targets.items():
        assert plan.targets[name] == (target, shard)
    q = plan.targets["model.layers.1.self_attn.q_proj.weight"]
    v = plan.targets["model.layers.1.self_attn.v_proj.weight"]
    assert q == ("model.layers.1.self_attn.qkv_proj.weight", "q") and v.shard == "v"
    if arch == "dense":
        assert plan.targets["model.layers.0.mlp.up_proj.weight"] == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    else:
        assert plan.targets["model.layers.0.mlp.experts.gate_up_proj"].name.endswith("routed_experts.w13_weight")

    with pytest.raises(ValueError, match=r"neither reads nor lists as unused: \['twin.extra'\]"):
        weights.weight_plan(names | {"twin.extra"}, config)
    with pytest.raises(ValueError, match=r"lacks tensors .*\['model.norm.weight'\]"):
        weights.weight_plan(names - {"model.norm.weight"}, config)


# ----------------------------------------------------------------------------- one-projection mode

# vLLM 0.32's SamplingParams defaults for the fields the check reads
DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, min_tokens=0, logprobs=None, prompt_logprobs=None, logprob_token_ids=None,
                prompt_logprob_token_ids=None, logit_bias=None, allowed_token_ids=None, bad_words=None,
                structured_outputs=None, watermarking=None, thinking_token_budget=None, seed=None, n=1, max_tokens=16)
BAD = dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
           frequency_penalty=0.5, min_tokens=3, logprobs=0, prompt_logprobs=1, logprob_token_ids=[5],
           prompt_logprob_token_ids=[5], logit_bias={5: 1.0}, allowed_token_ids=[1, 2], bad_words=["x"],
           structured_outputs=object(), watermarking=True, thinking_token_budget=10)


def test_one_projection_problems_accept_only_the_exact_request():
    """The temperature-1, untruncated, unpenalised request without logprobs is served (seed,
    n and max_tokens are free; top_k -1 is vLLM's other 'off'); each other setting is one
    problem that names it and the fix, greedy (temperature 0) included."""
    ok = SimpleNamespace(**DEFAULTS)
    assert head.one_projection_problems(ok) == []
    assert head.one_projection_problems(SimpleNamespace(**{**DEFAULTS, "top_k": -1, "seed": 7, "n": 4})) == []
    for name, value in {**BAD, "temperature_0": 0.0}.items():
        field = name.removesuffix("_0")
        problems = head.one_projection_problems(SimpleNamespace(**{**DEFAULTS, field: value}))
        assert len(problems) == 1, (name, problems)
        assert problems[0].startswith(f"{field}") and f"serve without one-projection, or drop {field}" in problems[0]
    every = head.one_projection_problems(SimpleNamespace(**{**DEFAULTS, **BAD}))
    assert len(every) == len(BAD)


def test_draw_components_follow_the_gate():
    """200,000 rows of draw_components fit exp(log_w) by chi-square (p > 0.01), per K = 2
    and K = 3 (each row its own weights: two row types interleaved); other weights are
    rejected (p < 1e-6); a seeded generator repeats its draws."""
    for weights_a, weights_b in (([0.35, 0.65], [0.9, 0.1]), ([0.2, 0.3, 0.5], [0.6, 0.0, 0.4])):
        N = 200_000
        log_w = torch.log(torch.tensor([weights_a, weights_b], dtype=torch.float32)).repeat(N // 2, 1)
        draws = head.draw_components(log_w, torch.Generator().manual_seed(0))
        assert draws.dtype == torch.int64 and draws.shape == (N,)
        a, b = draws[0::2].numpy(), draws[1::2].numpy()
        assert _gof(a, weights_a) > 0.01 and _gof(a, np.roll(weights_a, 1)) < 1e-6
        assert weights_b[1] == 0.0 or _gof(b, weights_b) > 0.01
        if weights_b[1] == 0.0:  # a zero weight is never drawn
            assert not (b == 1).any() and _gof(b[b != 1] // 2, [0.6, 0.4]) > 0.01
        again = head.draw_components(log_w, torch.Generator().manual_seed(0))
        assert torch.equal(draws, again)
