"""SIGINT (Ctrl-C, `timeout -s INT`, `scancel --signal=INT`) as a user means it (issue 39 item 3;
`onona_jax/cli.py`): the first stops the command cleanly, as SIGTERM does for training (the step
in flight finished and saved, one line saying which, exit 130) and with one `error: interrupted;`
line elsewhere (nothing partial left); the second exits at once with one line. Never a
traceback, never a hang. Real subprocesses, signalled at start-up, mid-step, during a save and
during the first step's compile; the battery (`python -m tests.battery --groups=interrupt`) adds
validation, eval.py, export, generate, import_hf and the sweep.
"""

import lzma
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_resume import metrics as rows  # metrics.jsonl's whole lines

CONFIG = "configs/paper.py:dense-tiny-twin"
STEPS = 10
# the fault battery's BASE (tests/battery/harness.py) on one device; a checkpoint every 3 steps (all kept), so that a
# stop mid-run saves a step of its own.
OVERRIDES = {
    "data.seq_len": 32, "model.n_heads": 8, "model.n_kv_heads": 4, "model.head_dim": 8,
    "train.global_batch": 8, "train.micro_batch": 8, "train.steps": STEPS, "train.warmup_steps": 2,
    "train.decay_fraction": 0.5, "train.log_every": 1, "train.eval_every": 1000, "train.checkpoint_every": 3,
    "train.keep_checkpoints": 10, "eval.windows": 8, "eval.batch": 8, "mesh.data": 1,
    "train.compile_cache_min_s": 0,
}
MARGIN_S = 15.0  # start-up of nothing, a flush and an exit: what an interrupted run may take beyond its own work
STOP_LINE = re.compile(r"interrupted: saved step (\d+); rerun the same command to resume")


def env() -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return e  # (conftest's ONONA_COMPILE_CACHE: every run here shares the session's compiled programs)


def start(args, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=env(), stdout=out,
                                stderr=subprocess.STDOUT)


def train_args(data, workdir, **extra):
    flags = {**OVERRIDES, "data.dir": data, **extra}
    return ["train.py", f"--config={CONFIG}", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items())]


def finish(p: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"hung: no exit {timeout:.0f} s after SIGINT")


def wait_for(cond, p, log: Path, what: str, timeout=180, poll=0.003):
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            pytest.fail(f"exited ({p.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll)


def losses(workdir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in rows(workdir):
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def logged(workdir: Path) -> int:
    return max(losses(workdir), default=0)


def steps_saved(workdir: Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def clean(text: str) -> list[str]:
    """The output's lines, progress-bar redraws split off."""
    return [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]


def one_line(text: str, rc: int, expected_rc: int = 130) -> str:
    """Exit `expected_rc`, no traceback, exactly one `error:`/`interrupted:` line: returned."""
    assert rc == expected_rc, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    lines = [ln for ln in clean(text) if ln.startswith(("error:", "interrupted:", "pre-empted:"))]
    assert len(lines) == 1, lines or text[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The uninterrupted run: its per-step losses and final validation."""
    wd = tmp_path_factory.mktemp("interrupt") / "reference"
    log = wd.parent / "reference.log"
    rc = finish(start(train_args(tiny_data, wd), log), timeout=300)
    assert rc == 0, log.read_text()[-3000:]
    return losses(wd), [r for r in rows(wd) if "val_loss" in r][-1]


def resumes_bit_for_bit(tiny_data, wd: Path, reference, log: Path):
    rc = finish(start(train_args(tiny_data, wd), log), timeout=300)
    assert rc == 0, log.read_text()[-3000:]
    ref_losses, ref_eval = reference
    got = losses(wd)
    assert sorted(got) == sorted(ref_losses)
    for s, values in got.items():
        assert all(v == ref_losses[s][0] for v in values), (s, values, ref_losses[s])
    final = [r for r in rows(wd) if "val_loss" in r][-1]
    assert all(final[k] == ref_eval[k] for k in ref_eval if k.startswith("val_loss"))
    assert not (wd / "lock.json").exists()


def stopped(tiny_data, wd: Path, log: Path, moment) -> tuple[int, float]:
    """Start a run, SIGINT it once `moment()` holds; (the step it says it saved, seconds to exit)."""
    p = start(train_args(tiny_data, wd), log)
    wait_for(moment, p, log, "the moment")
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc = finish(p)
    took = time.monotonic() - t
    line = one_line(log.read_text(), rc)
    m = STOP_LINE.fullmatch(line.strip())
    assert m, line
    return int(m[1]), took


def bound(wd: Path) -> float:
    """The step in flight, its save and a validation (the slowest logged step, ten times over), plus a margin."""
    step_s = [r["step_s"] + r.get("checkpoint_s", 0.0) for r in rows(wd) if "step_s" in r]
    return 10 * max(step_s, default=1.0) + MARGIN_S


# The two tests on the `reference` fixture are slow: suite-time margin (cover: the in-process
# test_run_turns_sigint_into_one_line_and_graceful_stops_take_it, and test_resume's
# test_sigterm_then_rerun_is_bit_exact, the same graceful save and bit-exact resume on SIGTERM).
@pytest.mark.slow
def test_sigint_mid_step_saves_that_step_and_resumes_bit_for_bit(tiny_data, tmp_path, reference):
    wd = tmp_path / "run"
    step, took = stopped(tiny_data, wd, tmp_path / "a.log", lambda: logged(wd) >= 4)
    assert 4 <= step < STEPS and steps_saved(wd)[-1] == step and step in steps_saved(wd)
    assert took < bound(wd), f"{took:.1f} s to stop"
    assert not (wd / "lock.json").exists()
    resumes_bit_for_bit(tiny_data, wd, reference, tmp_path / "b.log")


@pytest.mark.slow
def test_sigint_during_a_save_lets_it_finish_and_saves_it_once(tiny_data, tmp_path, reference):
    wd = tmp_path / "run"
    ckpts = wd / "checkpoints"
    step, took = stopped(tiny_data, wd, tmp_path / "a.log",
                         lambda: ckpts.is_dir() and any("orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir()))
    assert step == 3, f"saved step {step}, not the step 3 whose save was in flight"  # (checkpoint_every=3)
    assert steps_saved(wd) == [3] and not [p.name for p in ckpts.iterdir() if "tmp" in p.name]
    assert took < bound(wd), f"{took:.1f} s to stop"
    resumes_bit_for_bit(tiny_data, wd, reference, tmp_path / "b.log")


def test_sigint_at_start_up_leaves_no_workdir(tiny_data, tmp_path):
    wd = tmp_path / "run"
    p = start(train_args(tiny_data, wd), tmp_path / "a.log")
    wait_for(lambda: (wd / "lock.json").exists(), p, tmp_path / "a.log", "the lock")
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc = finish(p)
    line = one_line((tmp_path / "a.log").read_text(), rc)
    assert line.startswith("error: interrupted; stopped during start-up") and "rerun the same command" in line
    assert time.monotonic() - t < MARGIN_S + 30  # at most the first step's compile
    assert not wd.exists(), sorted(p.name for p in wd.iterdir())


def test_second_sigint_exits_at_once_even_in_the_compile(tiny_data, tmp_path):
    wd = tmp_path / "run"
    log = tmp_path / "a.log"
    p = start(train_args(tiny_data, wd, **{"train.steps": STEPS + 1}), log)  # another program: compiled anew
    wait_for(lambda: (wd / "metrics.jsonl").exists(), p, log, "the first step's compile")
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc = finish(p, timeout=30)
    took = time.monotonic() - t
    line = one_line(log.read_text(), rc)
    assert line.startswith("error: interrupted again; exiting at once"), line
    assert took < 3, f"{took:.1f} s after the second SIGINT"


def test_prepare_interrupted_leaves_nothing(tmp_path):
    from onona_jax.tokenizer import bundled_corpus_path

    big = tmp_path / "big.txt"
    with lzma.open(bundled_corpus_path(), "rt") as f:
        big.write_text(f.read() * 12)
    out = tmp_path / "data"
    log = tmp_path / "a.log"
    p = start(["-m", "onona_jax.data.prepare", "--input", big, "--output", out, "--workers=2"], log)
    wait_for(lambda: any(tmp_path.glob("data.tmp-*")), p, log, "the partial output")
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    rc = finish(p, timeout=60)
    line = one_line(log.read_text(), rc)
    assert line == f"error: interrupted; {out} was not written (rerun the same command to start again)", line
    assert not list(tmp_path.glob("data*")), list(tmp_path.glob("data*"))


def test_run_turns_sigint_into_one_line_and_graceful_stops_take_it(capfd):
    """In-process: `cli.run` returns 130 with one line; a registered graceful stop gets the flag instead."""
    from onona_jax import cli

    def interrupted(fv, args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # (the handler raises here)
        return 0

    previous = signal.getsignal(signal.SIGINT)
    assert cli.run(lambda fv, argv: None, interrupted, []) == 130
    assert signal.getsignal(signal.SIGINT) is previous
    assert capfd.readouterr().err == "error: interrupted; nothing was written; rerun the same command to start again\n"

    def graceful(fv, args):
        with cli.graceful_stop() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(500):
                if stop.requested:
                    break
                time.sleep(0.01)
            assert stop.requested
        return 130

    assert cli.run(lambda fv, argv: None, graceful, []) == 130
    assert capfd.readouterr().err == ""


def test_unraisable_hooks_chain_without_a_circle(monkeypatch):
    """Runs in one process (a test worker's), each reading a checkpoint, whose filter chains on
    top of `cli.run`'s hook: the next run finds its hook in the chain and does not install it
    again on top (which made a circle: a RecursionError for any unraisable exception, seen at a
    CI worker's exit). An unraisable exception reaches the hook below them all once."""
    import types

    from onona_jax import cli, library_logs

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value).__name__))
    for _ in range(3):
        with cli.signals.sigint_handling():
            library_logs.quiet_orbax()
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"), exc_traceback=None,
                                             err_msg=None, object=None))
    assert seen == ["ValueError"]
