"""Experiment grids (experiments/grids.py), the sweep driver and the report. Fast: the report reads
eval files written here, the driver runs a fake train/eval command; one real tiny sweep is
marked slow."""

import dataclasses
import json
import math
import os
import sys

import pytest

from onona_jax.experiments import grids, report, sweep

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = grids.load_paper_configs(REPO)


# ---------------------------------------------------------------------------------- grids


def test_factorial_grid_has_the_four_cells():
    arms = grids.grid("factorial")
    assert [(a.name, a.spec, a.overrides) for a in arms] == [
        ("standard", "dense-142m-standard", {}),
        ("twin_input_only", "dense-142m-twin_input_only", {}),
        ("twin_output_only", "dense-142m-twin_output_only", {}),
        ("twin", "dense-142m-twin", {}),
    ]
    assert {a.baseline for a in arms} == {"standard"}
    info = grids.grid_info("factorial")
    assert info["interaction"] == dict(baseline="standard", input="twin_input_only",
                                       output="twin_output_only", both="twin")


def test_depth_grid_adds_four_layers_at_330m_and_one_at_small():
    arms = {a.name: a for a in grids.grid("depth")}
    assert list(arms) == ["standard", "standard-28l", "twin"]
    assert arms["standard-28l"].spec == "dense-330m-standard"
    assert arms["standard-28l"].overrides == {"model.n_layers": 28, "train.reference": "n_layers=24"}
    assert PAPER.get_config("dense-330m-standard").model.n_layers == 24
    small = {a.name: a for a in grids.grid("depth", "small")}
    assert small["standard-5l"].overrides == {"model.n_layers": 5, "train.reference": "n_layers=4"}
    assert grids.grid_info("depth", "small")["compare"] == [["twin", "standard-5l"]]


def test_table1_has_16_arms_with_a_baseline_per_family_and_size():
    arms = grids.grid("table1")
    assert len(arms) == 16
    assert {a.spec for a in arms} == {f"{x}-{s}-{h}" for x in ("dense", "gdn", "moe", "attnres")
                                      for s in ("142m", "330m") for h in ("standard", "twin")}
    for a in arms:
        arch, size, head = a.spec.split("-")
        assert a.group == f"{arch}-{size}" and a.baseline == f"{arch}-{size}-standard"
        assert a.is_baseline == (head == "standard")


@pytest.mark.parametrize("name", list(grids.GRIDS))
def test_small_size_maps_every_spec_to_small_and_configs_validate(name):
    from onona_jax.config import validate

    arms = grids.grid(name, "small")
    assert arms and all(a.spec.split("-")[1] == "small" for a in arms)
    assert len({a.name for a in arms}) == len(arms)
    for a in arms:
        validate(grids.configure(a.spec, a.overrides))
    paper = grids.grid(name)
    # Table 1's 142m and 330m groups coincide at one size and are run once.
    # Table 1's and matched's 142m and 330m (and 1b) groups coincide at one size and are run once.
    assert len(arms) == {"table1": 8, "matched": 6}.get(name, len(paper))


def test_cells_are_named_records_and_an_arm_is_its_commands():
    """A grid's cells and arms name every value; `commands` maps an Arm (or its dict, as grid.json
    holds it) × seed to the train.py and eval.py argv the sweep runs and --emit writes."""
    cells = {c.name: c for c in grids.GRIDS["matched"].cells}
    assert cells["standard-matched-params"] == grids.Cell(
        name="standard-matched-params", head="standard", rule="matched", overrides={"train.budget": "params"})
    assert cells["twin"].rule is None and cells["twin"].tag == ""
    arm = {a.name: a for a in grids.grid("init_scale", "small")}["twin-at-e-scale"]
    rd = "--workdir=/w/twin-at-e-scale/seed1"
    argv = [("train", ["py", "train.py", "--config=configs/paper.py:dense-small-twin", rd, "--config.seed=1",
                       f"--config.model.table_init_scale={math.sqrt(2)}", "--config.train.steps=3"]),
            ("eval", ["py", "eval.py", rd])]
    assert grids.commands(arm, 1, "/w", ["--config.train.steps=3"], "py") == argv
    assert grids.commands(dataclasses.asdict(arm), 1, "/w", ["--config.train.steps=3"], "py") == argv
    assert grids.config_flags({"train.decay_vectors": True, "train.lr": 3e-4}) == [
        "--config.train.decay_vectors=true", "--config.train.lr=0.0003"]


def test_output_layer_and_controls_grids():
    assert [a.spec for a in grids.grid("output_layer")] == [
        f"dense-142m-{h}" for h in ("standard", "twin", "mos", "sigsoftmax", "moss", "untied")]
    assert [a.spec for a in grids.grid("controls")] == [
        f"dense-142m-{h}" for h in ("standard", "twin", "untied", "mos", "input_gate")]
    with pytest.raises(ValueError, match="unknown grid"):
        grids.grid("nope")


# ---------------------------------------------------------------------------------- report


def t975(df):
    return {1: 12.706, 2: 4.303}[df]


def write_grid(d, arms, seeds, name="test", interaction=None):
    d.mkdir(parents=True, exist_ok=True)
    info = dict(grid=name, size="small", seeds=seeds, compare=[], interaction=interaction,
                arms=[dict(name=a, spec=f"dense-small-{a}", overrides={}, group="dense-small",
                           baseline=arms[0]) for a in arms])
    (d / "grid.json").write_text(json.dumps(info))


def write_eval(d, arm, seed, step, val_loss, **extra):
    path = d / arm / f"seed{seed}" / "eval" / f"step_{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(config=f"dense-small-{arm}", step=step, windows=64,
                                    val_loss=val_loss, **extra)))
    return path


def table(md, section="## Validation loss", key=None):
    """{arm: {column: cell}} from a markdown table under the section heading (`key(cells)`: another key)."""
    lines = md.split(section, 1)[1].strip().splitlines()
    lines = lines[next(i for i, x in enumerate(lines) if x.startswith("|")):]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        k = key(cells) if key else cells[1] if "arm" in header[1:2] else cells[0]
        rows[k] = dict(zip(header, cells))
    return rows


def ablation_rows(md):
    """{(arm, ablation): {column: cell}} of the report's table ablations."""
    return table(md, "## Table ablations", key=lambda cells: (cells[0], cells[1]))


def test_the_report_spells_the_ablation_kinds_as_the_heads_do():
    from onona_jax import heads

    assert report.ABLATION_ORDER == heads.ABLATION_KINDS
    for head in heads.HEADS.values():
        for name in head.ablations:
            assert report.ABLATION_KEY.match(f"val_loss_{name}"), name
            assert heads.ablation_parts(name)[0] in {t.lower() for t in head.tables}, (head, name)


def close(cell, x, decimals=4):
    """A table cell equals x to its printed precision (t(0.975, 1) = 12.706 to 3 decimals)."""
    return abs(float(cell) - x) <= 0.51 * 10**-decimals + 2e-5 * abs(x)


def mean(xs):
    return sum(xs) / len(xs)


def sd(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_t_quantiles():
    assert report.t_quantile(1) == pytest.approx(12.706, abs=1e-3)
    assert report.t_quantile(2) == pytest.approx(4.303, abs=1e-3)
    assert report.t_quantile(30) == pytest.approx(2.042, abs=1e-3)
    assert report.t_quantile(60) == pytest.approx(2.000, abs=1e-3)
    assert report.t_quantile(10_000) == pytest.approx(1.960, abs=1e-3)


def test_report_numbers_trace_to_the_eval_files(tmp_path):
    d = tmp_path / "sweep"
    write_grid(d, ["standard", "twin"], [0, 1])
    values = {("standard", 0): 3.1250, ("standard", 1): 3.1410, ("twin", 0): 3.1010, ("twin", 1): 3.1230}
    abl = {0: (3.35, 3.41, 3.20), 1: (3.37, 3.44, 3.18)}
    for (arm, seed), v in values.items():
        extra = dict(val_loss_a_only=abl[seed][0], val_loss_b_only=abl[seed][1], val_loss_b_out=abl[seed][2],
                     val_loss_b_in_window=1.0) if arm == "twin" else {}  # the last: not an ablation's key
        write_eval(d, arm, seed, 1000, v, **extra)
        # An earlier evaluation, and one whose step sorts after 1000 as text: neither is used.
        write_eval(d, arm, seed, 200, 9.0)
        write_eval(d, arm, seed, 100, 9.0)
    assert report.main([str(d)]) == 0
    md = (d / "report.md").read_text()
    rows = table(md)
    for arm in ("standard", "twin"):
        xs = [values[arm, 0], values[arm, 1]]
        r = rows[arm]
        assert r["n"] == "2"
        assert r["val_loss"] == f"{mean(xs):.4f}"
        assert r["std"] == f"{sd(xs):.4f}"
        assert close(r["95% CI ±"], t975(1) * sd(xs) / math.sqrt(2))
    diffs = [values["twin", s] - values["standard", s] for s in (0, 1)]
    assert rows["standard"]["Δ vs baseline"] == "(baseline)"
    assert rows["twin"]["Δ vs baseline"] == f"{mean(diffs):+.5f}"
    assert rows["twin"]["Δ n"] == "2"
    assert rows["twin"]["Δ std"] == f"{sd(diffs):.5f}"
    assert close(rows["twin"]["Δ 95% CI ±"], t975(1) * sd(diffs) / math.sqrt(2), 5)
    ablations = ablation_rows(md)
    assert list(ablations) == [("twin", "a_only"), ("twin", "b_only"), ("twin", "b_out")]  # the paper's first
    assert ablations["twin", "a_only"]["val_loss"] == f"{mean([abl[0][0], abl[1][0]]):.4f}"
    for name, i in (("b_only", 1), ("b_out", 2)):
        gaps = [abl[s][i] - values["twin", s] for s in (0, 1)]
        assert ablations["twin", name]["gap"] == f"{mean(gaps):+.5f}"
        assert close(ablations["twin", name]["gap 95% CI ±"], t975(1) * sd(gaps) / math.sqrt(2), 5)

    rep = json.loads((d / "report.json").read_text())
    arms = {a["name"]: a for a in rep["arms"]}
    for (arm, seed), v in values.items():
        run = arms[arm]["runs"][str(seed)]
        assert run["path"] == f"{arm}/seed{seed}/eval/step_1000.json"
        assert json.loads((d / run["path"]).read_text())["val_loss"] == run["val_loss"] == v
    assert arms["twin"]["delta"]["per_seed"] == {str(s): pytest.approx(diffs[s]) for s in (0, 1)}
    assert arms["twin"]["delta"]["ci95"] == pytest.approx(t975(1) * sd(diffs) / math.sqrt(2), rel=1e-4)
    assert (d / "report.png").stat().st_size > 0


def test_missing_and_failed_runs_are_not_averaged_in(tmp_path):
    d = tmp_path / "sweep"
    write_grid(d, ["standard", "twin"], [0, 1, 2])
    write_eval(d, "standard", 0, 50, 3.00)
    write_eval(d, "standard", 1, 50, 3.50)  # but the sweep says this run failed (stale file)
    write_eval(d, "standard", 2, 50, 3.10)
    write_eval(d, "twin", 0, 50, 2.90)
    write_eval(d, "twin", 1, 50, 2.95)
    # twin seed 2: no eval file -> missing
    status = {"standard/seed1": dict(arm="standard", seed=1, status="failed", stage="train",
                                     returncode=1, stderr_tail="Traceback\nRuntimeError: boom\n")}
    (d / "sweep_status.json").write_text(json.dumps(status))
    report.write(str(d))
    rep = {a["name"]: a for a in json.loads((d / "report.json").read_text())["arms"]}
    assert rep["standard"]["n"] == 2 and rep["standard"]["seeds_used"] == [0, 2]
    assert rep["standard"]["mean"] == pytest.approx((3.00 + 3.10) / 2)
    assert rep["standard"]["failed"] == [1] and rep["standard"]["runs"]["1"]["status"] == "failed"
    assert rep["twin"]["n"] == 2 and rep["twin"]["missing"] == [2]
    assert rep["twin"]["mean"] == pytest.approx((2.90 + 2.95) / 2)
    # Only seed 0 has both arms: one pair, no std or CI.
    assert rep["twin"]["delta"]["n"] == 1
    assert rep["twin"]["delta"]["mean"] == pytest.approx(2.90 - 3.00)
    assert rep["twin"]["delta"]["std"] is None and rep["twin"]["delta"]["ci95"] is None
    md = (d / "report.md").read_text()
    rows = table(md)
    assert rows["standard"]["n"] == "2" and rows["standard"]["failed seeds"] == "1"
    assert rows["standard"]["val_loss"] == f"{(3.00 + 3.10) / 2:.4f}"
    assert rows["twin"]["missing seeds"] == "2" and rows["twin"]["Δ n"] == "1"
    assert "`standard/seed1` failed in train with exit code 1: `RuntimeError: boom`" in md
    runs = md.split("## Runs", 1)[1]
    assert "| twin | 2 | missing |" in runs and "| standard | 1 | failed |" in runs


def test_factorial_interaction(tmp_path):
    d = tmp_path / "sweep"
    cells = ["standard", "twin_input_only", "twin_output_only", "twin"]
    write_grid(d, cells, [0, 1], name="factorial",
               interaction=dict(baseline="standard", input="twin_input_only",
                                output="twin_output_only", both="twin"))
    v = {"standard": (2.81, 2.80), "twin_input_only": (2.80, 2.795),
         "twin_output_only": (2.815, 2.81), "twin": (2.79, 2.78)}
    for arm, xs in v.items():
        for s, x in enumerate(xs):
            write_eval(d, arm, s, 10, x)
    rep = report.write(str(d))
    per_seed = [(v["twin"][s] - v["standard"][s]) - (v["twin_input_only"][s] - v["standard"][s])
                - (v["twin_output_only"][s] - v["standard"][s]) for s in (0, 1)]
    assert rep["interaction"]["n"] == 2
    assert rep["interaction"]["mean"] == pytest.approx(mean(per_seed))
    row = table((d / "report.md").read_text(), "## Interaction")
    (only,) = row.values()
    assert only["mean"] == f"{mean(per_seed):+.5f}"
    assert close(only["95% CI ±"], t975(1) * sd(per_seed) / math.sqrt(2), 5)


# ---------------------------------------------------------------------------------- sweep


def test_emit_writes_one_line_per_arm_and_seed_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "commands.sh"
    d = tmp_path / "sweep"
    rc = sweep.main(["--grid=depth", "--size=small", "--seeds=0,1", f"--workdir={d}", f"--emit={out}",
                     "--", "--config.train.steps=7"])
    assert rc == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 3 * 2
    for line in lines:
        assert line.startswith(f"cd {REPO} && ")
        train, ev = line.split(" && ")[1:]
        assert "train.py --config=configs/paper.py:dense-small-" in train
        assert train.endswith("--config.train.steps=7")
        assert "eval.py --workdir=" in ev
    assert f"--workdir={d}/standard-5l/seed1 --config.seed=1 --config.model.n_layers=5" in lines[3]
    grid = json.loads((d / "grid.json").read_text())
    assert grid["grid"] == "depth" and grid["seeds"] == [0, 1] and len(grid["arms"]) == 3
    assert sorted(os.listdir(d)) == ["grid.json"]  # nothing ran
    # a later call with another seed keeps the earlier seeds in grid.json
    sweep.main(["--grid=depth", "--size=small", "--seeds=2", f"--workdir={d}", f"--emit={out}"])
    assert json.loads((d / "grid.json").read_text())["seeds"] == [0, 1, 2]
    assert sweep.main(["--grid=controls", "--size=small", f"--workdir={d}", f"--emit={out}"]) == 2
    assert "describes grid" in capsys.readouterr().err


def test_dry_run_prints_commands_and_writes_nothing(tmp_path, capsys):
    d = tmp_path / "sweep"
    assert sweep.main(["--grid=table1", "--seeds=0", f"--workdir={d}", "--dry_run"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    lines = [x for x in out if not x.startswith("# ")]  # the rest: the budget table (test_open_questions)
    assert len(lines) == 16 and len(out) == 16 + 1 + 16
    assert any("--config=configs/paper.py:moe-330m-twin" in x for x in lines)
    assert not d.exists()
    # train.py's flags belong after `--`: before it they are unknown flags of the sweep
    assert sweep.main(["--grid=table1", f"--workdir={d}", "--dry_run", "--config.train.steps=2"]) == 2
    assert "error: Unknown command line flag 'config.train.steps'" in capsys.readouterr().err


FAKE = """
import json, os, sys
stage, workdir, seed, spec = sys.argv[1:5]
if "twin_output_only" in spec and seed == "1":
    print("RuntimeError: fake failure", file=sys.stderr); sys.exit(3)
if stage == "eval":
    os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
    loss = 3.0 + 0.01 * int(seed) - 0.02 * ("twin" in spec)
    json.dump(dict(config=spec, step=5, val_loss=loss), open(os.path.join(workdir, "eval", "step_5.json"), "w"))
"""


def test_sweep_continues_past_a_failure_and_records_it(tmp_path):
    d = tmp_path / "sweep"
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)

    def command_fn(arm, seed, workdir, extra):
        rd = sweep.run_dir(workdir, arm["name"], seed)
        return [(stage, [sys.executable, str(fake), stage, rd, str(seed), arm["spec"]])
                for stage in ("train", "eval")]

    info = sweep.grid_info("factorial", "small", REPO)
    sweep.write_grid_json(str(d), info, [0, 1])
    status = sweep.run_sweep(info["arms"], [0, 1], str(d), root=REPO, command_fn=command_fn, log=lambda *_: None)
    assert status == json.loads((d / "sweep_status.json").read_text())
    failed = status["twin_output_only/seed1"]
    assert failed["status"] == "failed" and failed["stage"] == "train" and failed["returncode"] == 3
    assert "RuntimeError: fake failure" in failed["stderr_tail"]
    assert [k for k, v in status.items() if v["status"] == "ok"] == [
        f"{a}/seed{s}" for a in ("standard", "twin_input_only", "twin_output_only", "twin") for s in (0, 1)
        if (a, s) != ("twin_output_only", 1)]
    rep = {a["name"]: a for a in report.write(str(d))["arms"]}
    assert rep["twin_output_only"]["n"] == 1 and rep["twin_output_only"]["failed"] == [1]
    assert rep["twin"]["delta"]["mean"] == pytest.approx(-0.02)
    assert rep["twin"]["delta"]["n"] == 2


@pytest.mark.slow
def test_real_tiny_sweep_trains_and_evaluates(tmp_path, tiny_data, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the runs see this machine's one CPU device
    d = tmp_path / "sweep"
    rc = sweep.main(["--grid=factorial", "--size=tiny", "--seeds=0", "--arms=standard,twin",
                     f"--workdir={d}", "--", "--config.train.steps=2", f"--config.data.dir={tiny_data}",
                     "--config.eval.windows=8"])
    assert rc == 0
    rep = {a["name"]: a for a in report.write(str(d))["arms"]}
    assert rep["standard"]["n"] == rep["twin"]["n"] == 1
    assert rep["twin"]["delta"]["n"] == 1 and "ablations" in rep["twin"]
    assert rep["twin_input_only"]["missing"] == [0]
