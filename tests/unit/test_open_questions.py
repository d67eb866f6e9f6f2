"""The paper's open questions as configs (issue 38): resource-matched budgets, the
parameter-matched Standard, the init-scale control, ablations that separate input from output,
long-context specs, and the grids that ask them. Every number is checked against an independent
computation (integer arithmetic, a numpy head) or exactly."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from onona_jax import config, heads, models, summary
from onona_jax.experiments import grids, report, sweep
from onona_jax.params import path_str

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = grids.load_paper_configs(REPO)
TOKENS_PER_STEP = 256 * 1024


def load(spec, **overrides):
    return grids.configure(spec, overrides)


# ---------------------------------------------------------------------------------- budgets


def test_flops_budget_gives_twin_the_standard_steps_times_the_flop_ratio():
    """train.budget=flops: dense-142m-twin trains round(21,740 × F_standard / F_twin) steps, with
    F the training FLOPs per token; `params`: ⌈40 × its own parameters / tokens per step⌉, in
    integers; `tokens`: the paper's 21,740 for both."""
    std, twin = load("dense-142m-standard"), load("dense-142m-twin")
    f_std = summary.flops_per_token(std.model, 1024)["train"]
    f_twin = summary.flops_per_token(twin.model, 1024)["train"]
    assert summary.budget(std)["steps"] == summary.budget(twin)["steps"] == 21_740
    flops = summary.budget(load("dense-142m-twin", **{"train.budget": "flops"}))
    assert flops["steps"] == round(21_740 * f_std / f_twin) == 17_403
    assert flops["tokens"] == 17_403 * TOKENS_PER_STEP
    assert abs(flops["flops"] - flops["reference_flops"]) <= 0.5 * TOKENS_PER_STEP * f_twin  # to the step
    params = summary.budget(load("dense-142m-twin", **{"train.budget": "params"}))
    assert params["steps"] == -(-40 * 181_104_128 // TOKENS_PER_STEP) == 27_635
    # the reference arm is its own reference under every budget
    for kind in ("flops", "params"):
        assert summary.budget(load("dense-142m-standard", **{"train.budget": kind}))["steps"] == 21_740


def test_budgets_scale_an_explicit_step_count():
    """With train.steps set (the small sizes' 200), those are the reference's steps."""
    twin = load("dense-small-twin", **{"train.budget": "flops"})
    ratio = summary.flops_per_token(load("dense-small-standard").model, 128)["train"] / \
        summary.flops_per_token(twin.model, 128)["train"]
    assert summary.budget(twin)["steps"] == round(200 * ratio)
    b = summary.budget(load("dense-small-twin", **{"train.budget": "params"}))
    assert b["steps"] == -(-200 * b["params"] // b["reference_params"])


@pytest.mark.parametrize("size", ["142m", "330m", "1b"])
def test_parameter_matched_standard_is_within_one_percent_of_twin(size):
    """The matched grid's Standard is widened (d_ff, a multiple of 64) to within 1% of twin's
    total, and still trains its size's token budget (train.reference), as the depth control does."""
    arms = {a.name: a for a in grids.grid("matched", size)}
    matched = arms[f"dense-{size}-standard-matched"]
    twin = summary.param_counts(load(f"dense-{size}-twin").model)["total"]
    cfg = load(matched.spec, **matched.overrides)
    total = summary.param_counts(cfg.model)["total"]
    assert abs(total - twin) <= 0.01 * twin, (total, twin)
    assert cfg.model.d_ff % 64 == 0 and cfg.model.d_ff > load(matched.spec).model.d_ff
    assert cfg.model.n_layers == load(matched.spec).model.n_layers  # wider, not deeper
    assert summary.budget(cfg)["steps"] == summary.budget(load(f"dense-{size}-standard"))["steps"]
    # the nearest multiple of 64: one step either way is further from twin
    for other in (cfg.model.d_ff - 64, cfg.model.d_ff + 64):
        cfg.model.d_ff = other
        assert abs(summary.param_counts(cfg.model)["total"] - twin) > abs(total - twin)


def test_depth_control_trains_the_size_budget():
    """The paper: every arm at a size gets 40 × the Dense Standard parameters (50,349 steps at
    330M), the 28-layer control included (it used to get 40 × its own)."""
    arm = {a.name: a for a in grids.grid("depth")}["standard-28l"]
    assert arm.overrides == {"model.n_layers": 28, "train.reference": "n_layers=24"}
    assert summary.budget(load(arm.spec, **arm.overrides))["steps"] == 50_349


def test_matched_grid_dry_run_shows_every_arms_budget(tmp_path, capsys):
    """The sweep's --dry_run prints each arm's steps, tokens and FLOPs before anything trains, and
    writes nothing; the same numbers go into grid.json."""
    assert sweep.main(["--grid=matched", "--size=142m", f"--workdir={tmp_path / 'm'}", "--dry_run"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line.split()[2:] for line in out.splitlines() if line.startswith("# dense-")}
    assert rows["dense-142m-twin-flops"][:4] == ["flops", "181,104,128", "17,403", f"{17_403 * TOKENS_PER_STEP:,}"]
    assert rows["dense-142m-twin-params"][2] == "27,635"
    assert rows["dense-142m-standard-matched"][2] == "21,740"
    assert rows["dense-142m-twin-flops"][-1] == "1.0000"  # the reference's FLOPs, to the step
    assert not (tmp_path / "m").exists()
    info = sweep.grid_info("matched", None, REPO)
    assert {a["name"]: a["budget"]["steps"] for a in info["arms"]}["dense-330m-twin-flops"] == round(
        50_349 * summary.flops_per_token(load("dense-330m-standard").model, 1024)["train"]
        / summary.flops_per_token(load("dense-330m-twin").model, 1024)["train"])


@pytest.mark.parametrize("grid,arms", [
    ("init_scale", {"standard": ("dense-142m-standard", 1.0), "standard-at-m-scale": ("dense-142m-standard", 0.5 ** 0.5),
                    "twin": ("dense-142m-twin", 1.0), "twin-at-e-scale": ("dense-142m-twin", 2 ** 0.5)}),
    ("context", {"standard": ("dense-142m-standard", 1024), "twin": ("dense-142m-twin", 1024),
                 "standard-4x": ("dense-142m-standard@4x", 4096), "twin-4x": ("dense-142m-twin@4x", 4096),
                 "standard-docs": ("dense-142m-standard", 1024), "twin-docs": ("dense-142m-twin", 1024),
                 "standard-4x-docs": ("dense-142m-standard@4x", 4096),
                 "twin-4x-docs": ("dense-142m-twin@4x", 4096)}),
])
def test_init_scale_and_context_grids_dry_run(grid, arms, tmp_path, capsys):
    """Their arms, each arm's init scale or context, and the paper's 21,740 steps of 262,144 tokens
    for every arm (the context grid keeps the batch in tokens)."""
    info = sweep.grid_info(grid, None, REPO)
    assert [a["name"] for a in info["arms"]] == list(arms)
    for a in info["arms"]:
        spec, value = arms[a["name"]]
        cfg = load(a["spec"], **a["overrides"])
        assert a["spec"] == spec
        assert (cfg.model.table_init_scale if grid == "init_scale" else cfg.data.seq_len) == pytest.approx(value)
        assert a["budget"]["steps"] == 21_740 and a["budget"]["tokens"] == 21_740 * TOKENS_PER_STEP
    if grid == "context":
        assert info["interaction"] == dict(baseline="standard", input="standard-4x", output="twin", both="twin-4x")
        assert {a["group"] for a in info["arms"]} == {f"dense-142m-{g}" for g in ("1x", "4x", "1x-docs", "4x-docs")}
        packings = {a["name"]: load(a["spec"], **a["overrides"]).data.packing for a in info["arms"]}
        assert packings == {name: "documents" if name.endswith("-docs") else "windows" for name in arms}
    assert sweep.main([f"--grid={grid}", f"--workdir={tmp_path / 'g'}", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert sum(" 21,740 " in line for line in out.splitlines() if line.startswith("# ")) == len(arms)


def test_sweep_flags_reach_the_matched_rule():
    """A `--` flag that changes the vocabulary changes the twin arm's size, and the matched
    Standard follows it (it is built from the arm's own command line)."""
    small = sweep.grid_info("matched", "small", REPO, ["--config.data.tokenizer=size:2048"])
    arms = {a["name"]: a for a in small["arms"]}
    twin = arms["dense-small-twin"]["budget"]["params"]
    matched = arms["dense-small-standard-matched"]["budget"]["params"]
    assert abs(matched - twin) <= 0.01 * twin and twin == 1_049_984 + 2048 * 128 + 128


# ---------------------------------------------------------------------------------- init scale


def test_init_scale_changes_the_tables_and_nothing_else():
    """The init_scale grid's four cells: every non-table parameter is bit-identical at init; each
    scaled table is scale × the unscaled one (the key is the path's; to fp32 rounding, as XLA folds
    0.02 × scale into one constant: 2 roundings, rtol 2.4e-7); twin at √2 starts
    M = (A+B)/2 at Standard's std 0.02 and Standard at 1/√2 starts E at M's 0.0141."""
    cells = {a.name: a for a in grids.grid("init_scale", "tiny")}
    params = {}
    for name, arm in cells.items():
        cfg = load(arm.spec, **arm.overrides)
        params[name] = {path_str(p): np.asarray(v) for p, v in
                        nnx.to_flat_state(nnx.State(models.init(cfg.model, 0)[1]))}
    body = {k for k in params["standard"] if not k.startswith("head/")}
    assert body and all(body <= set(p) for p in params.values())
    for name in cells:
        for k in body:
            np.testing.assert_array_equal(params[name][k], params["standard"][k], err_msg=f"{name} {k}")
        np.testing.assert_array_equal(params[name].get("head/gate", 0), params["twin"].get("head/gate", 0)
                                      if "twin" in name else 0)
    E, A, B = params["standard"]["head/embedding"], params["twin"]["head/A"], params["twin"]["head/B"]
    np.testing.assert_array_equal(A, E)  # twin's A and Standard's E share their init
    s = np.float32(math.sqrt(2))
    np.testing.assert_allclose(params["twin-at-e-scale"]["head/A"], A * s, rtol=2.4e-7, atol=0)
    np.testing.assert_allclose(params["twin-at-e-scale"]["head/B"], B * s, rtol=2.4e-7, atol=0)
    np.testing.assert_allclose(params["standard-at-m-scale"]["head/embedding"], E / s, rtol=2.4e-7, atol=0)
    M = (params["twin-at-e-scale"]["head/A"] + params["twin-at-e-scale"]["head/B"]) / 2
    assert abs(M.std() / 0.02 - 1) < 0.01 and abs(((A + B) / 2).std() / (0.02 / math.sqrt(2)) - 1) < 0.01
    assert abs(params["standard-at-m-scale"]["head/embedding"].std() / (0.02 / math.sqrt(2)) - 1) < 0.01


# ---------------------------------------------------------------------------------- ablations


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_input_and_output_ablations_against_a_numpy_head():
    """Each table ablation of the twin head, from the model's hidden states and a float64 head:
    `_only` feeds and predicts with one table; `_in` feeds it under the model's own gated mixture
    (the gate of the token's own M row); `_out` predicts with it from the model's own input M."""
    cfg = load("dense-tiny-twin").model
    graphdef, params = models.init(cfg, 0)
    params = jax.tree.map(lambda x: x, params)
    rng = np.random.default_rng(0)
    params["head"]["B"] = params["head"]["B"] + 0.05 * rng.standard_normal(params["head"]["B"].shape)
    params["head"]["gate"] = jnp.asarray(rng.standard_normal(params["head"]["gate"].shape), jnp.float32)
    model = models.bind(graphdef, params)
    tokens = jnp.asarray(rng.integers(0, 50_257, (2, 17)), jnp.int32)
    x, y = tokens[:, :-1], np.asarray(tokens[:, 1:])
    A, B, w = (np.asarray(params["head"][k], np.float64) for k in ("A", "B", "gate"))
    M = (A + B) / 2
    xm = M[np.asarray(x)]
    z = (xm / np.sqrt((xm ** 2).mean(-1, keepdims=True) + heads.GATE_EPS)) @ w
    log_g = np.stack([-np.logaddexp(0, -z), -np.logaddexp(0, z)], -1)

    def h_of(rows):
        return np.asarray(model.hidden(x, x0=jnp.asarray(rows, jnp.float32))[0], np.float64)

    def pick(lp):
        return np.take_along_axis(lp, y[..., None], -1)[..., 0]

    def mixture(h):
        return pick(np.logaddexp(log_g[..., :1] + _log_softmax(h @ A.T), log_g[..., 1:] + _log_softmax(h @ B.T)))

    tables = {"a": A, "b": B}
    want = {None: mixture(h_of(xm))}
    for t, T in tables.items():
        want[f"{t}_only"] = pick(_log_softmax(h_of(T[np.asarray(x)]) @ T.T))
        want[f"{t}_in"] = mixture(h_of(T[np.asarray(x)]))
        want[f"{t}_out"] = pick(_log_softmax(h_of(xm) @ T.T))
    assert set(want) == {None, *heads.TwinHead.ablations}
    for name, lp in want.items():
        got = np.asarray(model.target_log_probs(x, jnp.asarray(y), ablation=name))
        np.testing.assert_allclose(got, lp, rtol=2e-5, atol=2e-5, err_msg=str(name))
    assert len({float(v.mean()) for v in want.values()}) == len(want)  # every variant is its own
    with pytest.raises(ValueError, match="a_sideways"):
        model.target_log_probs(x, jnp.asarray(y), ablation="a_sideways")


def test_every_head_with_two_tables_declares_ablations_that_differ():
    """Every head with two or more tables has ablations, each naming one of its tables; their
    validation keys are what eval.py writes and the report reads."""
    for name, head in heads.HEADS.items():
        assert bool(head.ablations) == (len(head.tables) >= 2), name
        for ablation in head.ablations:
            table, kind = heads.ablation_parts(ablation)
            assert table in {t.lower() for t in head.tables} and kind in heads.ABLATION_KINDS
            assert report.ABLATION_KEY.match(f"val_loss_{ablation}")


# ---------------------------------------------------------------------------------- contexts


def test_long_context_keeps_the_batch_in_tokens():
    """`<spec>@4096`: 64 windows of 4,096 tokens a step (the paper's 262,144), micro batch 4, 256
    validation windows (the same 1M evaluated tokens), the same steps; a length that does not
    divide the batch is one error naming the divisors."""
    base, long = load("dense-142m-twin"), load("dense-142m-twin@4096")
    assert (long.data.seq_len, long.train.global_batch, long.train.micro_batch, long.eval.windows) == (4096, 64, 4, 256)
    assert long.train.global_batch * 4096 == base.train.global_batch * 1024
    assert summary.budget(long)["steps"] == summary.budget(base)["steps"] == 21_740
    c8 = load("dense-330m-standard@8192")
    assert (c8.train.global_batch, c8.train.micro_batch, c8.eval.windows) == (32, 2, 128)
    with pytest.raises(ValueError, match="does not divide into whole windows of 3000 tokens"):
        PAPER.get_config("dense-142m-twin@3000")


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override,words", [
    ("--config.model.table_init_scale=0", "model.table_init_scale=0.0 must be positive"),
    ("--config.train.budget=chinchilla", "train.budget='chinchilla': one of tokens, flops, params"),
    ("--config.train.reference=n_layers", "train.reference='n_layers': expected <model key>=<positive integer>"),
    ("--config.train.reference=d_model=x", "train.reference='d_model=x'"),
    ("--config.train.reference=head=3", "train.reference='head=3'"),
])
def test_new_keys_are_one_error_line_before_any_write(tmp_path, capfd, override, words):
    import train as train_cli

    workdir = tmp_path / "run"
    assert train_cli.main(["--config=configs/paper.py:dense-tiny-twin", f"--workdir={workdir}", override]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err
    assert not workdir.exists()


# ---------------------------------------------------------------------------------- the report


def test_report_states_budgets_and_data_passes(tmp_path):
    """The report's budget table: each arm's steps, tokens and FLOPs from grid.json, and the
    passes over each run's training pool (its config's data dir's manifest)."""
    d = tmp_path / "sweep"
    info = sweep.grid_info("matched", "tiny", REPO)
    info["seeds"] = [0]
    d.mkdir()
    (d / "grid.json").write_text(json.dumps(info))
    pool = 123_456
    for arm in info["arms"]:
        run = d / arm["name"] / "seed0"
        (run / "eval").mkdir(parents=True)
        (run / "eval" / "step_5.json").write_text(json.dumps(dict(config=arm["spec"], step=5, val_loss=3.0)))
        (run / "config.json").write_text(json.dumps({"data": {"dir": str(tmp_path / "data")}}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text(json.dumps({"splits": {"train": {"tokens": pool}}}))
    rep = report.write(str(d))
    md = (d / "report.md").read_text()
    for arm in rep["arms"]:
        b = arm["budget"]
        assert b["passes"] == [pytest.approx(b["tokens"] / pool)]
        line = next(x for x in md.split("## Budgets")[1].splitlines() if x.startswith(f"| {arm['name']} |"))
        assert f"| {b['steps']:,} | {b['tokens']:,} |" in line and f"| {b['tokens'] / pool:.3f} |" in line


@pytest.mark.slow  # suite-time margin (cover: test_hf_export's dense-twin export, its RoPE at the tiny context)
def test_a_long_context_export_loads_in_transformers_with_its_rope(tmp_path):
    """A twin model at 2,048 tokens and RoPE base 500,000: the export's config carries both
    (max_position_embeddings, rope_theta) and transformers' log-probabilities over 1,500 tokens —
    past the 1,024 every paper config uses, where a wrong base or table length would show —
    equal ours to 1e-4 (fp32, two implementations: test_hf_export's tolerance)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from onona_jax.serve import hf_format

    cfg = load("dense-tiny-twin", **{"model.rope_theta": 500_000.0, "data.seq_len": 2048})
    assert cfg.data.seq_len == 2048
    _, params = models.init(cfg.model, 0)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(np.float32), params)
    out = str(tmp_path / "export")
    hf_format.export(params, cfg, out)
    written = json.load(open(os.path.join(out, "config.json")))
    assert written["max_position_embeddings"] == 2048
    assert written["rope_parameters"]["rope_theta"] == 500_000.0
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokens = rng.integers(0, 50_257, (1, 1500))
    ours = np.asarray(models.bind(models.abstract(cfg.model)[0], params)(tokens))
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(theirs[0, 1024:], ours[0, 1024:], rtol=0, atol=1e-4)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------- the CPU replication


@pytest.mark.slow  # 4 tiny runs through train.py and eval.py, two gate analyses (~3 min); the grid's
# budgets, the report and the BPE's prepare are each covered by default tests
def test_replicate_runs_the_pair_end_to_end(tmp_path, capsys):
    """`experiments.replicate` on a text of the user's (one flag): prepare with a BPE trained on
    it, the headline pair over two seeds, the report's paired Δ from the runs' own eval files,
    each twin run's gate analysis, and the stages' times; a rerun reuses the data and refuses a
    different --entries."""
    import lzma

    from onona_jax.experiments import replicate
    from onona_jax.tokenizer import bundled_corpus_path

    text = tmp_path / "corpus.txt"
    with lzma.open(bundled_corpus_path(), "rt") as f:
        text.write_text(f.read(400_000))
    w = tmp_path / "rep"
    args = [f"--workdir={w}", f"--text={text}", "--entries=512", "--size=tiny", "--seeds=0,1"]
    assert replicate.main(args) == 0
    manifest = json.loads((w / "data" / "manifest.json").read_text())
    assert manifest["tokenizer"]["trained"]["entries"] == 512
    rep = json.loads((w / "sweep" / "report.json").read_text())
    twin = next(a for a in rep["arms"] if a["name"] == "twin")
    losses = {arm: {s: json.loads((w / "sweep" / arm / f"seed{s}" / "eval" / "step_50.json").read_text())
                    for s in (0, 1)} for arm in ("standard", "twin")}
    for s in (0, 1):
        assert twin["delta"]["per_seed"][str(s)] == pytest.approx(
            losses["twin"][s]["val_loss"] - losses["standard"][s]["val_loss"])
        assert "val_loss_a_out" in losses["twin"][s] and "val_loss_a_out" not in losses["standard"][s]
        assert (w / "sweep" / "twin" / f"seed{s}" / "analysis" / "gate_step_50.md").exists()
    record = json.loads((w / "replicate.json").read_text())
    assert set(record["runs_s"]) == {f"{a}/seed{s}" for a in ("standard", "twin") for s in (0, 1)}
    assert record["machine_before"]["cores"] == os.cpu_count()
    assert twin["budget"]["passes"] and "Δ twin − standard" in capsys.readouterr().out
    assert replicate.main(args[:2] + ["--entries=256"] + args[3:]) == 2  # another tokenizer: another workdir
