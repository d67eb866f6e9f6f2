"""Downstream tasks during training (train.tasks): the training loop scores the tasks on its
live parameters with eval.py's own code, and the numbers it logs equal eval.py's on the
checkpoint of the same step, exactly; the scoring compiles once, its seconds are logged and
kept out of tokens/s; bad task settings are one error line before anything is written; on two
processes every process scores and process 0 alone writes."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import pytest

from conftest import REPO, tiny_config
from onona_jax import train as trainer
from onona_jax.eval import tasks
from onona_jax.eval.tasks import scoring
from onona_jax.train import downstream

FIX = os.path.join(REPO, "tests", "fixtures")
TASKS = ["lambada", "hellaswag", "wikitext2"]  # a loglikelihood, a multiple-choice and a rolling task
LAMBADA = os.path.join(FIX, "lambada_openai.jsonl")
STEPS, EVERY = 5, 2  # scored after steps 2, 4 and the last, 5
LIMIT = 2  # examples per task (wikitext2: documents), as eval.py's --limit: the test's seconds
FAKE_TASK_SECONDS = 1000.0  # what each scoring appears to take on the test's clock


def eval_cli():
    spec = importlib.util.spec_from_file_location("onona_eval_cli", os.path.join(REPO, "eval.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def task_config(data_dir, **train):
    """Tiny twin with train.tasks: lambada's file named, the others found under the fixtures dir."""
    train = {"tasks": ",".join(TASKS), "task_data": f"lambada={LAMBADA}", "task_data_dir": FIX, **train}
    cfg = tiny_config(data_dir, head="twin", micro_batch=0, **train)
    cfg.mesh.data = 1
    return cfg


def task_rows(rows):
    return [r for r in rows if any(k.startswith("task/") for k in r)]


def flat(result_tasks) -> dict:
    return tasks.metrics_row(result_tasks)


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """A 5-step run scoring every 2 steps on one device, on a clock where each scoring takes
    FAKE_TASK_SECONDS more, recording every trace of the scoring function (one per compile)."""
    cfg = task_config(tiny_data, steps=STEPS, tasks_every=EVERY, tasks_limit=LIMIT, checkpoint_every=EVERY,
                      keep_checkpoints=5)
    workdir = tmp_path_factory.mktemp("train_tasks") / "run"
    traced = []
    offset = [0.0]
    real_clock, real_call, real_score_fn = time.perf_counter, downstream.TrainTasks.__call__, scoring._score_fn

    def slow_call(self, params):
        row = real_call(self, params)
        offset[0] += FAKE_TASK_SECONDS
        return row

    def traced_score_fn(graphdef, chunk, params, tokens, targets):
        traced.append(tokens.shape)
        return real_score_fn(graphdef, chunk, params, tokens, targets)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "perf_counter", lambda: real_clock() + offset[0])
        mp.setattr(downstream.TrainTasks, "__call__", slow_call)
        mp.setattr(scoring, "_score_fn", traced_score_fn)
        mp.setattr(scoring, "_JITTED", {})  # compiled here, not reused from another test's scorer
        result = trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    return {"cfg": cfg, "workdir": str(workdir), "rows": rows, "traced": traced, "result": result}


def test_task_metrics_at_the_right_steps_equal_eval_py(run):
    rows = task_rows(run["rows"])
    assert [r["step"] for r in rows] == [2, 4, 5]
    cli = eval_cli()
    cfg = run["cfg"]
    for row in rows:
        # eval.py on that step's checkpoint with the loop's settings: max_length = data.seq_len,
        # task_batch = eval.batch, --limit = train.tasks_limit, the files as train.task_data /
        # train.task_data_dir give them
        result = cli.evaluate(run["workdir"], row["step"], (1, 1, 1), TASKS,
                              cli.parse_task_data([f"lambada={LAMBADA}"]), FIX, batch=cfg.eval.batch,
                              max_length=cfg.data.seq_len, limit=LIMIT)
        assert all(r["samples"] == LIMIT for r in result["tasks"].values())
        want = flat(result["tasks"])
        assert {"task/lambada/acc", "task/lambada/perplexity", "task/hellaswag/acc",
                "task/hellaswag/acc_norm_bytes", "task/wikitext2/word_perplexity"} <= set(want)
        got = {k: v for k, v in row.items() if k.startswith("task/")}
        assert got == want, row["step"]  # the same numbers, exactly (JSON keeps every bit of a float)
    # the parameters changed between the scorings, and so did the scores
    assert rows[0]["task/wikitext2/word_perplexity"] != rows[-1]["task/wikitext2/word_perplexity"]
    assert run["result"]["task/lambada/perplexity"] == rows[-1]["task/lambada/perplexity"]  # train()'s return


def test_task_scoring_compiles_once(run):
    """Three scorings, each padded batch shape traced (compiled) once: the second and third
    reuse the first's executables."""
    traced = run["traced"]
    assert traced, "the scoring function was never traced"
    assert len(traced) == len(set(traced)), traced


def test_task_seconds_logged_and_kept_out_of_tokens_per_s(run):
    rows = run["rows"]
    tokens_per_step = run["cfg"].train.global_batch * run["cfg"].data.seq_len
    for row in task_rows(rows):
        assert row["task_s"] >= FAKE_TASK_SECONDS  # each scoring's seconds, beside its scores
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for row in train_rows:
        assert "task_s" not in row  # logged once, with the scores
        # the steps after a scoring (3, 5) span 1000 fake seconds of it: none of them is training time
        assert row["step_s"] + row["data_wait_s"] < 100, row
        assert tokens_per_step / row["tokens_per_s"] == pytest.approx(row["step_s"] + row["data_wait_s"], rel=1e-6)


def test_downstream_reuses_its_compiled_scoring(run, monkeypatch):
    """`tasks.Downstream` called again on other parameters compiles nothing new (what the loop
    relies on), and scores them differently."""
    from onona_jax.checkpoint import restore_params

    monkeypatch.setattr(scoring, "_JITTED", {})
    p2, _, cfg, grid = restore_params(run["workdir"], 2, (1, 1, 1), jax.devices()[:1])
    p4, _, _, _ = restore_params(run["workdir"], 4, grid)
    scorer = tasks.Downstream(cfg, grid, ["lambada"], {"lambada": LAMBADA}, max_length=cfg.data.seq_len)
    first = scorer(p2)
    fn = next(iter(scoring._JITTED.values()))
    compiled = fn._cache_size()
    second = scorer(p4)
    assert fn._cache_size() == compiled and len(scoring._JITTED) == 1
    assert first["lambada"]["metrics"] != second["lambada"]["metrics"]


# ----------------------------------------------------------------------------- bad settings


def assert_refused(cfg, tmp_path, *words):
    """train() raises one ValueError naming every word, and creates no workdir."""
    workdir = tmp_path / "wd"
    with pytest.raises(ValueError) as err:
        trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not workdir.exists()


def test_unknown_task_or_val_refused_before_any_write(tiny_data, tmp_path):
    assert_refused(task_config(tiny_data, tasks="lambada,hellaswog"), tmp_path,
                   "train.tasks", "'hellaswog'", "hellaswag")
    assert_refused(task_config(tiny_data, tasks="val,lambada"), tmp_path, "train.tasks", "train.eval_every")


def test_missing_or_bad_task_files_refused_before_any_write(tiny_data, tmp_path):
    cfg = task_config(tiny_data, tasks="piqa", task_data="", task_data_dir="")
    assert_refused(cfg, tmp_path, "no data for task piqa", "train.task_data=piqa=PATH", "train.task_data_dir")
    cfg = task_config(tiny_data, tasks="lambada", task_data=f"lambada={tmp_path / 'none.jsonl'}")
    assert_refused(cfg, tmp_path, "does not exist", "train.task_data=lambada=PATH")
    cfg = task_config(tiny_data, tasks="lambada", task_data="lambada")
    assert_refused(cfg, tmp_path, "train.task_data entry 'lambada'", "name=PATH")
    bad = tmp_path / "lambada.jsonl"
    bad.write_text('{"passage": "no text field"}\n')  # read at the start, not at the first scoring
    cfg = task_config(tiny_data, tasks="lambada", task_data=f"lambada={bad}")
    assert_refused(cfg, tmp_path, "train.tasks: lambada cannot read", "lacks field(s) ['text']", "train.task_data")


def test_config_checks_task_keys():
    from onona_jax import config

    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
    assert (cfg.train.tasks, cfg.train.task_data, cfg.train.task_data_dir) == ("", "", "")
    assert (cfg.train.tasks_every, cfg.train.tasks_limit) == (0, 0)
    for key in ("tasks", "task_data", "task_data_dir", "tasks_every", "tasks_limit"):
        assert f"train.{key}" in config.RESUMABLE_KEYS  # what is measured, not what is trained
    for key, value, words in (("tasks_every", -1, "train.tasks_every=-1"), ("tasks_limit", -5, "train.tasks_limit=-5")):
        bad = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
        bad.train[key] = value
        with pytest.raises(ValueError, match=words):
            config.validate(bad)


def test_cli_bad_task_name_is_one_error_line(tiny_data, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workdir = tmp_path / "wd"
    p = subprocess.run([sys.executable, "train.py", "--config=configs/paper.py:dense-tiny-twin",
                        f"--config.data.dir={tiny_data}", "--config.mesh.data=1", "--config.train.tasks=lambda",
                        f"--config.train.task_data_dir={FIX}", f"--workdir={workdir}"],
                       cwd=REPO, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "train.tasks='lambda'" in errors[0] and "lambada" in errors[0], p.stderr[-2000:]
    assert not workdir.exists()


# ----------------------------------------------------------------------------- two processes


@pytest.mark.slow  # two train.py processes joined by jax.distributed, plus compiles: about a minute
def test_two_processes_score_and_process_0_writes(tiny_data, tmp_path):
    from test_multihost import STEPS as MH_STEPS
    from test_multihost import Launch

    flags = ["--config.train.tasks=lambada,hellaswag", f"--config.train.task_data=lambada={LAMBADA}",
             f"--config.train.task_data_dir={FIX}", "--config.train.tasks_every=2"]
    launch = Launch(tmp_path, "two", (8, 1, 1), tiny_data, processes=2, flags=flags)
    rows = task_rows(launch.metrics)
    assert [r["step"] for r in rows] == [2, MH_STEPS]  # once each: process 1 writes nothing
    cli = eval_cli()
    result = cli.evaluate(str(launch.workdir), MH_STEPS, (8, 1, 1), ["lambada", "hellaswag"],
                          cli.parse_task_data([f"lambada={LAMBADA}"]), FIX, batch=8, max_length=32)
    assert {k: v for k, v in rows[-1].items() if k.startswith("task/")} == flat(result["tasks"])
