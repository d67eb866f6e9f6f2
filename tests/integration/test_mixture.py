"""Weighted data mixtures (`data.mixture`, onona_jax/data/mixture.py) and per-domain validation:
parsing and its errors, the composition bound of every global batch over 1,000 steps, each
source walking its own permutation, determinism from the seed, the iterator's state (resume,
a weight change recorded, a source change refused), a source of another tokenizer or a missing
one refused naming it, `val_loss/<source>` equal to scoring that source's windows alone, and
whole runs: a 3-source run logs tokens and validation per source (eval.py's result too); slow:
train.py resumed with new weights records them and refuses new sources, and, killed with
SIGKILL, resumes bit for bit."""

import json
import re
import shutil
import signal
from fractions import Fraction
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import REPO, tiny_config
from onona_jax import config as config_lib
from onona_jax.data import mixture, pipeline
from test_resume import TIMEOUT, TrainCLI, checkpoint_steps, data_state, losses, metrics, stop, val_losses

SEQ, G = 32, 8
WEIGHTS = {"a": "0.5", "b": "0.3", "c": "0.2"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three small prepared data dirs (different parts of the bundled corpus): {name: dir}."""
    import lzma

    from onona_jax.data.prepare import prepare
    from onona_jax.tokenizer import bundled_corpus_path

    root = tmp_path_factory.mktemp("mixture")
    with lzma.open(bundled_corpus_path(), "rt") as f:
        text = f.read(240_000)
    out = {}
    for i, name in enumerate(WEIGHTS):
        (root / f"{name}.txt").write_text(text[i * 80_000 : (i + 1) * 80_000])
        prepare([str(root / f"{name}.txt")], str(root / name), heldout_fraction=0.1)
        out[name] = str(root / name)
    return out


def spec(sources, weights=WEIGHTS) -> str:
    return ",".join(f"{n}:{sources[n]}:{w}" for n, w in weights.items())


def opened(sources, weights=WEIGHTS, **kw):
    return pipeline.open_for_training(mixture.parse(spec(sources, weights)), SEQ, 8, **kw)


def lookup(data) -> dict:
    """{window bytes: (source index, window index)} of every training window of every source."""
    table = {}
    for k, s in enumerate(data.sources):
        src = pipeline.WindowSource(s.store("train"), SEQ)
        for i in range(len(src)):
            table[src[i].tobytes()] = (k, i)
    assert len(table) == sum(pipeline.WindowSource(s.store("train"), SEQ).__len__() for s in data.sources)
    return table


# ----------------------------------------------------------------------------- the config


def test_parse_reads_names_dirs_and_weights_from_both_ends():
    got = mixture.parse("climbmix:gs://bucket/climbmix:0.7, code:/data/co:de:0.3")
    assert [(e.name, e.data_dir, e.weight) for e in got] == [
        ("climbmix", "gs://bucket/climbmix", Fraction(7, 10)), ("code", "/data/co:de", Fraction(3, 10))]
    assert mixture.parse("") == []
    assert mixture.shares([Fraction(7), Fraction(3)]) == [Fraction(7, 10), Fraction(3, 10)]


@pytest.mark.parametrize("value,message", [
    ("a:/x:0", "data.mixture source 'a' has weight 0; a weight must be positive"),
    ("a:/x:0.5,b:/y:-1", "data.mixture source 'b' has weight -1; a weight must be positive"),
    ("a:/x:nan", "data.mixture source 'a' has weight 'nan', not a number"),
    ("a:/x:1,a:/y:1", "data.mixture names source 'a' twice"),
    ("a:/x", "data.mixture entry 'a:/x' is not name:dir:weight"),
    ("gs://bucket/web:0.7", "data.mixture entry 'gs://bucket/web:0.7' is not name:dir:weight"),
    ("a b:/x:1", "data.mixture source name 'a b' may hold only letters"),
])
def test_bad_mixtures_name_the_key_and_the_fix(value, message):
    cfg = config_lib.base_config()
    cfg.data.mixture = value
    with pytest.raises(ValueError, match=re.escape(message)):
        config_lib.validate(cfg)


def test_mixture_beside_data_dir_is_refused():
    cfg = config_lib.base_config()
    cfg.data.update(dir="/data/web", mixture="web:/data/web:1")
    with pytest.raises(ValueError, match=r"data.dir='/data/web' and data.mixture=.* are both given; .*"
                                         r"--config.data.dir=''"):
        config_lib.validate(cfg)
    assert "data.mixture" in config_lib.RESUMABLE_KEYS


# ----------------------------------------------------------------------------- the batches


def test_composition_within_the_bound_over_1000_steps_and_each_source_walks_its_permutation(sources):
    """Every global batch holds floor(w·G) or ceil(w·G) windows of each source (|count - w·G| < 1),
    over 1,000 steps each source's total stays within 3 windows of w·G·steps, and each source's
    windows come from its own permutation epoch after epoch (every window equally often, ±1)."""
    data = opened(sources)
    table = lookup(data)
    want = np.array([float(w) * G for w in mixture.shares([Fraction(w) for w in WEIGHTS.values()])])  # 4, 2.4, 1.6
    it = pipeline.train_batches(data, SEQ, G, seed=3)
    seen = [np.zeros(len(pipeline.WindowSource(s.store("train"), SEQ)), int) for s in data.sources]
    counts = np.zeros((1000, 3), int)
    for step in range(1000):
        for row in next(it):
            k, i = table[row.tobytes()]
            counts[step, k] += 1
            seen[k][i] += 1
    assert (np.abs(counts - want) < 1).all() and (counts.sum(1) == G).all()
    assert set(counts[:, 1]) == {2, 3} and set(counts[:, 2]) == {1, 2}  # the extra slot moves between them
    drift = np.abs(np.cumsum(counts, 0) - np.outer(np.arange(1, 1001), want))
    assert drift.max() <= 3, drift.max(0)
    for k in range(3):
        assert seen[k].max() - seen[k].min() <= 1 and seen[k].sum() == counts[:, k].sum()
    state = it.get_state()
    assert state["positions"] == dict(zip(WEIGHTS, counts.sum(0).tolist()))
    assert state["weights"] == {"a": 0.5, "b": 0.3, "c": 0.2} and state["step"] == 1000
    assert state["num_windows"] == {n: len(s) for n, s in zip(WEIGHTS, seen)}


def test_batches_follow_from_the_seed_and_compose_across_processes(sources):
    data = opened(sources)
    first = [next(it) for it in [pipeline.train_batches(data, SEQ, G, seed=1)] for _ in range(6)]
    again = [next(it) for it in [pipeline.train_batches(data, SEQ, G, seed=1, read_threads=0)] for _ in range(6)]
    other = [next(it) for it in [pipeline.train_batches(data, SEQ, G, seed=2)] for _ in range(6)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not any(np.array_equal(a, b) for a, b in zip(first, other))
    halves = [pipeline.train_batches(data, SEQ, G, seed=1, process_index=p, process_count=2) for p in (0, 1)]
    assert all(np.array_equal(np.concatenate([next(halves[0]), next(halves[1])]), b) for b in first)
    # The slots are shuffled: a source's windows are not all in one process's half.
    table = lookup(data)
    assert {table[r.tobytes()][0] for b in first for r in b[: G // 2]} == {0, 1, 2}


def test_a_mixture_of_one_source_reads_a_plain_runs_batches(sources):
    plain = pipeline.train_batches(sources["a"], SEQ, G, seed=4)
    named = pipeline.train_batches(opened(sources, {"a": "1"}), SEQ, G, seed=4)
    assert all(np.array_equal(next(plain), next(named)) for _ in range(5))


def test_state_resumes_bit_exact_a_weight_change_is_recorded_a_source_change_refused(sources):
    data = opened(sources)
    ref = [next(it) for it in [pipeline.train_batches(data, SEQ, G, seed=5)] for _ in range(40)]
    it = pipeline.train_batches(data, SEQ, G, seed=5)
    for _ in range(25):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    resumed = pipeline.train_batches(data, SEQ, G, seed=5, read_threads=0, prefetch=0)
    resumed.set_state(state)
    assert resumed.mixture_change is None
    assert all(np.array_equal(next(resumed), b) for b in ref[25:])
    started = pipeline.train_batches(data, SEQ, G, seed=5, start_step=25)
    assert all(np.array_equal(next(started), b) for b in ref[25:])

    # New weights: each source goes on from its saved position, with the new composition.
    reweighted = pipeline.train_batches(opened(sources, {"a": "1", "b": "1", "c": "2"}), SEQ, G, seed=5)
    reweighted.set_state(state)
    assert reweighted.mixture_change == {"from": {"a": 0.5, "b": 0.3, "c": 0.2}, "to": {"a": 0.25, "b": 0.25, "c": 0.5}}
    table = lookup(data)
    counts = np.zeros(3, int)
    for _ in range(10):
        batch = [table[r.tobytes()][0] for r in next(reweighted)]
        assert sorted(np.bincount(batch, minlength=3)) == [2, 2, 4]
        counts += np.bincount(batch, minlength=3)
    after = reweighted.get_state()
    assert after["positions"] == {n: state["positions"][n] + int(c) for n, c in zip(WEIGHTS, counts)}
    # ... and a later resume of that state with the new weights continues it.
    again = pipeline.train_batches(opened(sources, {"a": "1", "b": "1", "c": "2"}), SEQ, G, seed=5)
    again.set_state(json.loads(json.dumps(after)))
    assert again.mixture_change is None and again.get_state() == after

    two = pipeline.train_batches(opened(sources, {"a": "0.5", "b": "0.5"}), SEQ, G, seed=5)
    with pytest.raises(ValueError, match=r"sources \(windows each\) .*'c'.*may not change on resume .*new --workdir"):
        two.set_state(state)


# ----------------------------------------------------------------------------- opening the sources


def test_missing_source_or_another_tokenizers_is_refused_naming_it(sources, tmp_path):
    with pytest.raises(ValueError, match=rf"^data.mixture source 'b': no prepared data at {tmp_path}/nowhere "
                                         r".*python -m onona_jax.data.prepare"):
        opened({**sources, "b": str(tmp_path / "nowhere")}, tokenizer={"tokenizer": "gpt2"})
    other = tmp_path / "other"
    shutil.copytree(sources["c"], other)
    m = json.loads((other / "manifest.json").read_text())
    m["tokenizer"] = {"kind": "hf", "name": "llama3", "sha256": "ab" * 32, "vocab": 50257, "eot": 0,
                      "config": {"tokenizer": "/models/llama3/tokenizer.json"}}
    (other / "manifest.json").write_text(json.dumps(m))
    read = []
    real = pipeline.TokenStore.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline.TokenStore, "__init__", lambda self, *a, **k: read.append(a) or real(self, *a, **k))
        with pytest.raises(ValueError, match=rf"^data.mixture source 'c': data dir {other} was prepared with tokenizer "
                                             r"/models/llama3/tokenizer.json .*this run's data.tokenizer is gpt2"):
            opened({**sources, "c": str(other)}, tokenizer={"tokenizer": "gpt2"})
    assert read == []  # refused before any shard was opened


def test_a_source_change_is_refused_before_any_write_and_a_moved_source_accepted(sources, tmp_path):
    from onona_jax.train import loop

    saved, cfg = config_lib.base_config(), config_lib.base_config()
    saved.data.mixture = spec(sources)
    workdir = tmp_path / "run"
    workdir.mkdir()
    cfg.data.mixture = spec(sources, {"a": "2", "b": "1", "c": "1"})
    loop.check_same_data(saved, cfg, str(workdir))  # weights may change
    moved = tmp_path / "moved"
    shutil.copytree(sources["b"], moved)
    cfg.data.mixture = spec({**sources, "b": str(moved)})
    loop.check_same_data(saved, cfg, str(workdir))  # the same data elsewhere
    cfg.data.mixture = spec(sources, {"a": "1", "b": "1"})
    with pytest.raises(ValueError, match=rf"trained on the data.mixture sources a, b, c, but this run asks for the "
                                         rf"data.mixture sources a, b: .*--config.data.mixture={spec(sources)} \(its "
                                         r"weights may change\), or .* new --workdir"):
        loop.check_same_data(saved, cfg, str(workdir))
    cfg.data.mixture, cfg.data.dir = "", sources["a"]
    with pytest.raises(ValueError, match=rf"but this run asks for data.dir {sources['a']}"):
        loop.check_same_data(saved, cfg, str(workdir))
    cfg.data.mixture, cfg.data.dir = spec({**sources, "b": sources["c"]}), ""
    with pytest.raises(ValueError, match=rf"trained on data.mixture source 'b' \({sources['b']}\), but {sources['c']} "
                                         r"holds other data"):
        loop.check_same_data(saved, cfg, str(workdir))


# ----------------------------------------------------------------------------- per-domain validation


def test_val_loss_per_source_equals_scoring_its_windows_alone(sources):
    from onona_jax import train as trainer
    from onona_jax.eval.validation import Evaluator

    cfg = tiny_config(sources["a"], "standard")
    data = opened(sources)
    assert data.val_windows.shape == (24, SEQ + 1) and list(data.val_groups) == list(WEIGHTS)
    run = trainer.setup(cfg, jax.devices()[:1])
    params = trainer.init_state(run, cfg.seed)["params"]
    evaluator = Evaluator(run.graphdef, run.mesh, run.param_shardings)
    both = evaluator(params, data.val_windows, groups=data.val_groups)
    for name, rows in data.val_groups.items():
        alone = pipeline.validation_windows(data.sources[list(WEIGHTS).index(name)], SEQ, 8)
        assert np.array_equal(data.val_windows[rows], alone)
        assert both[f"val_loss/{name}"] == evaluator(params, alone)["val_loss"]
    assert len({both[f"val_loss/{n}"] for n in WEIGHTS}) == 3
    assert both["val_loss"] == pytest.approx(np.mean([both[f"val_loss/{n}"] for n in WEIGHTS]), rel=1e-6)


# ----------------------------------------------------------------------------- whole runs


def test_a_mixture_run_logs_tokens_and_validation_per_source_and_eval_reports_them(sources, tmp_path):
    """In process (the conftest client's 8 devices): 4 steps on the 3-source mixture, validation
    at steps 2 and 4; metrics.jsonl and TensorBoard get tokens/<name> and val_loss/<name>, the
    tokens matching the checkpoint's positions; eval.py's result has val_loss/<name>, equal to
    the run's final validation."""
    from eval import evaluate
    from onona_jax import train as trainer
    from test_storage_faults import tensorboard_scalars

    cfg = tiny_config("", "standard", steps=4, eval_every=2, checkpoint_every=2)
    cfg.data.mixture = spec(sources)
    cfg = config_lib.validate(cfg)
    workdir = tmp_path / "run"
    final = trainer.train(cfg, str(workdir), progress=False)
    rows = metrics(workdir)
    logged = [m for m in rows if "loss" in m]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    for m in logged:  # each source's tokens through that step
        assert sum(m[f"tokens/{n}"] for n in WEIGHTS) == m["step"] * G * SEQ
    state = data_state(workdir, 4)
    assert {n: logged[-1][f"tokens/{n}"] for n in WEIGHTS} == {n: p * SEQ for n, p in state["positions"].items()}
    assert state["weights"] == {"a": 0.5, "b": 0.3, "c": 0.2}
    vals = [m for m in rows if "val_loss" in m]
    assert [m["step"] for m in vals] == [2, 4] and all(f"val_loss/{n}" in m for m in vals for n in WEIGHTS)
    assert {k: v for k, v in final.items() if k.startswith("val_loss/")} == {
        f"val_loss/{n}": vals[-1][f"val_loss/{n}"] for n in WEIGHTS}
    [events] = (workdir / "tensorboard").iterdir()
    tags = {tag for _, tag, _ in tensorboard_scalars(events)}
    assert {f"val_loss/{n}" for n in WEIGHTS} | {f"tokens/{n}" for n in WEIGHTS} <= tags, tags

    result = evaluate(str(workdir))
    assert result["windows"] == 24 and result["val_loss"] == vals[-1]["val_loss"]
    assert {n: result[f"val_loss/{n}"] for n in WEIGHTS} == {n: vals[-1][f"val_loss/{n}"] for n in WEIGHTS}


@pytest.fixture(scope="module")
def cli(tiny_data, tmp_path_factory):
    return TrainCLI(tiny_data, tmp_path_factory.mktemp("jax_cache"))


def run_args(sources, weights=WEIGHTS, **extra) -> dict:
    return dict(data__dir="", data__mixture=spec(sources, weights), train__eval_every=4, **extra)


@pytest.fixture(scope="module")
def mixture_run(cli, sources, tmp_path_factory):
    """The uninterrupted 3-source train.py run (8 steps, checkpoints 2..8, validation at 4 and 8)."""
    root = tmp_path_factory.mktemp("mixture_run")
    rc, out = cli.run(root / "run", root / "log.txt", **run_args(sources))
    assert rc == 0, out[-3000:]
    return root / "run"


@pytest.mark.slow  # ~20 s with its reference run (cover: the iterator-state test, check_same_data's test above)
def test_resume_with_new_weights_is_recorded_and_with_new_sources_refused(cli, sources, mixture_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(mixture_run, workdir)
    for step in (6, 8):
        shutil.rmtree(workdir / "checkpoints" / str(step))
    rc, out = cli.run(workdir, tmp_path / "log.txt", **run_args(sources, {"a": "1", "b": "1"}))
    assert rc == 2 and "may not change on resume" in out and "--config.data.mixture=" in out, out[-3000:]
    assert checkpoint_steps(workdir) == [2, 4]
    rc, out = cli.run(workdir, tmp_path / "log2.txt", **run_args(sources, {"a": "1", "b": "1", "c": "2"}))
    assert rc == 0 and "resumed from step 4 " in out, out[-3000:]
    [change] = [m for m in metrics(workdir) if "mixture_change" in m]
    assert change["step"] == 4 and change["mixture_change"] == {"from": {"a": 0.5, "b": 0.3, "c": 0.2},
                                                              "to": {"a": 0.25, "b": 0.25, "c": 0.5}}
    before, after = data_state(workdir, 4)["positions"], data_state(workdir, 8)["positions"]
    assert {n: after[n] - before[n] for n in WEIGHTS} == {"a": 8, "b": 8, "c": 16}  # 4 steps of 2, 2, 4
    assert [s for s, _ in losses(workdir)] == list(range(1, 9)) + list(range(5, 9))


@pytest.mark.slow  # ~12 s past its reference run (cover: test_state_resumes_bit_exact_...)
def test_sigkill_then_rerun_is_bit_exact(cli, sources, mixture_run, tmp_path):
    """The 3-source train.py run killed with SIGKILL after checkpoint 4 and rerun logs the
    uninterrupted run's losses and validation, bit for bit, and saves its data states."""
    from test_resume import wait_for

    reference = dict(losses(mixture_run))
    workdir, log = tmp_path / "run", tmp_path / "log1.txt"
    p = cli.start(workdir, log, **run_args(sources))
    try:
        wait_for(lambda: 4 in checkpoint_steps(workdir) and any(s >= 5 for s, _ in losses(workdir)), p, log,
                 "checkpoint 4 complete and step 5 logged", poll=0.005)
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=TIMEOUT) == -signal.SIGKILL
    finally:
        stop(p)
    assert max(s for s, _ in losses(workdir)) < 8, "the run finished before the kill (make it longer)"
    rc, out = cli.run(workdir, tmp_path / "log2.txt", **run_args(sources))
    assert rc == 0 and "resumed from step " in out, out[-3000:]
    assert all(loss == reference[s] for s, loss in losses(workdir)), (losses(workdir), reference)
    assert sorted({s for s, _ in losses(workdir)}) == list(range(1, 9))
    assert val_losses(workdir) == val_losses(mixture_run)
    for step in (2, 4, 6, 8):
        assert data_state(workdir, step) == data_state(mixture_run, step)
