"""SIGINT (issue 39 item 3): the first stops cleanly (training: the step in flight saved, as on
SIGTERM), the second at once; exit 130, one line, never a traceback or a hang."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .harness import (Bench, NotHeld, Result, case, digest, excerpt, expect, final_eval, losses, ok, one_error,
                      step_logged, stop, unchanged, wait_for)
from .prepare import big_corpus


INTERRUPT = {"train.steps": 12, "train.checkpoint_every": 3, "train.eval_every": 4, "train.keep_checkpoints": 10}
INTERRUPT_EXIT_S = 15.0  # from the SIGINT to the exit: the step in flight, its save, the tiny model's validation


def _sigint(b: Bench, args, moment, what: str, signals: int = 1, gap: float = 0.05, timeout: float = 120) -> Result:
    """Run `args`, SIGINT it `signals` times once `moment()` holds; its Result, `seconds` from the first SIGINT."""
    p = b.popen(args)
    try:
        wait_for(moment, 300, what, p, poll=0.003)
        t = time.monotonic()
        for i in range(signals):
            if i:
                time.sleep(gap)
            p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise NotHeld(f"hung: no exit {timeout:.0f} s after SIGINT") from None
        return Result(p.returncode, out, err, time.monotonic() - t)
    finally:
        stop(p)


def _stop_line(res: Result) -> int:
    """Exit 130, one line `interrupted: saved step N; ...` and no error line or traceback: N."""
    expect(res.rc == 130, f"exit {res.rc}, expected 130: {res.tail()}")
    expect("Traceback" not in res.err and "KeyboardInterrupt" not in res.err, f"a traceback: {excerpt(res.err)}")
    lines = [ln for ln in res.err.replace("\r", "\n").splitlines() if ln.startswith(("interrupted:", "error:"))]
    expect(len(lines) == 1 and lines[0].startswith("interrupted: saved step "), f"lines: {lines or res.tail()}")
    expect(res.seconds < INTERRUPT_EXIT_S, f"exit {res.seconds:.1f} s after SIGINT")
    return int(lines[0].split()[3].rstrip(";"))


def _resumes_exactly(b: Bench, wd: Path):
    """The rerun finishes, and every logged loss and the final validation equal an uninterrupted run's."""
    ok(b.train(wd, **INTERRUPT))
    ref = b.root / "interrupt-reference"
    if not (ref / "metrics.jsonl").exists():
        ok(b.train(ref, **INTERRUPT))
    got, want = losses((wd / "metrics.jsonl").read_text()), losses((ref / "metrics.jsonl").read_text())
    expect(sorted(got) == sorted(want), f"steps logged {sorted(got)}")
    for s, values in got.items():
        expect(all(v == want[s][0] for v in values), f"step {s}: losses {values} vs {want[s][0]} uninterrupted")
    mine, theirs = final_eval((wd / "metrics.jsonl").read_text()), final_eval((ref / "metrics.jsonl").read_text())
    expect(all(mine[k] == theirs[k] for k in theirs if k.startswith("val_loss")), f"final eval {mine} vs {theirs}")
    expect(not (wd / "lock.json").exists(), "lock.json left behind")


def _saved(wd: Path) -> list[int]:
    return sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit())


@case("interrupt", "train.py (fresh workdir)", "SIGINT at start-up (the lock just taken)",
      "exit 130, one error line; no workdir left")
def train_sigint_at_start_up(b: Bench):
    wd = b.path("wd")
    res = _sigint(b, b.train_args(wd, **INTERRUPT), lambda: (wd / "lock.json").exists(), "the lock")
    line = one_error(res, 130, "interrupted; stopped during start-up", "rerun the same command to start")
    expect(not wd.exists(), f"left {sorted(digest(wd))}")
    return f"{res.seconds:.1f} s: {line}"


@case("interrupt", "train.py (fresh workdir)", "SIGINT in the first step's compile",
      "exit 130, one error line; the step not kept, no workdir left")
def train_sigint_in_the_compile(b: Bench):
    wd = b.path("wd")
    res = _sigint(b, b.train_args(wd, **{**INTERRUPT, "train.steps": 13}),  # another program: compiled anew
                  lambda: (wd / "metrics.jsonl").exists(), "the first step's compile")
    one_error(res, 130, "interrupted; stopped during start-up")
    expect(not wd.exists(), f"left {sorted(digest(wd))}")
    return f"{res.seconds:.1f} s"


@case("interrupt", "train.py (a run resumed from step 3)", "SIGINT at start-up",
      "exit 130, one error line naming step 3; checkpoints/ unchanged")
def train_sigint_at_the_start_of_a_resume(b: Bench):
    wd = b.path("wd")
    res = _sigint(b, b.train_args(wd, **INTERRUPT), lambda: step_logged(wd, 4), "step 4")
    expect(_stop_line(res) >= 4, "no step saved")
    shutil.rmtree(wd / "checkpoints" / str(_saved(wd)[-1]))  # newest: step 3
    before = digest(wd / "checkpoints")
    res = _sigint(b, b.train_args(wd, **INTERRUPT), lambda: (wd / "lock.json").exists(), "the lock")
    one_error(res, 130, "interrupted; stopped during start-up", "resume from step 3")
    unchanged(before, wd / "checkpoints", "checkpoints/")


def _train_sigint_at(b: Bench, moment: str, rng: random.Random) -> str:
    wd = b.path("wd")
    ckpts = wd / "checkpoints"
    if moment == "step":
        target = rng.randint(4, 10)
        when, what = (lambda: step_logged(wd, target)), f"step {target}"
    elif moment == "save":
        when, what = (lambda: ckpts.is_dir() and any("orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())), "a save"
    else:  # validation: step 4's line is written before its validation starts
        when, what = (lambda: step_logged(wd, 4)), "step 4's validation"
    res = _sigint(b, b.train_args(wd, **INTERRUPT), when, what)
    step = _stop_line(res)
    expect(_saved(wd)[-1] == step, f"said step {step}, saved {_saved(wd)}")
    expect(not [p.name for p in ckpts.iterdir() if "tmp" in p.name], "a temporary checkpoint left")
    if moment == "save":
        expect(step == 3, f"saved step {step}, not the step 3 whose save was in flight")
    _resumes_exactly(b, wd)
    return f"{what}: stopped at step {step} in {res.seconds:.1f} s; resumed bit for bit"


for _moment in ("step", "save", "validation"):
    def _fn(b: Bench, _moment=_moment):
        return _train_sigint_at(b, _moment, random.Random(_moment))
    _fn.__name__ = f"train_sigint_mid_{_moment}"
    case("interrupt", "train.py", f"SIGINT during a {_moment}",
         f"exit 130 within {INTERRUPT_EXIT_S:.0f} s, one line naming the step saved; the rerun bit for bit")(_fn)


@case("interrupt", "train.py", "SIGINT twice (50 ms apart) during a save",
      "exit 130 within 2 s of the second, one line; the rerun finishes bit for bit")
def train_double_sigint(b: Bench):
    wd = b.path("wd")
    ckpts = wd / "checkpoints"
    res = _sigint(b, b.train_args(wd, **INTERRUPT), lambda: ckpts.is_dir() and any("orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir()),
                  "a save", signals=2)
    line = one_error(res, 130, "interrupted again; exiting at once")
    expect(res.seconds < 2.05, f"exit {res.seconds:.1f} s after the first SIGINT")
    _resumes_exactly(b, wd)
    return line


@case("interrupt", "eval.py", "SIGINT mid-evaluation", "exit 130, one line; no eval file; checkpoints/ unchanged")
def eval_sigint(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    res, at = _sigint_after(b, ["eval.py", f"--workdir={wd}", "--mesh=1,1,1"], lambda: any((wd / "eval").glob("*.json")))
    one_error(res, 130, "interrupted", "nothing was written")
    unchanged(before, wd)
    return f"at {at:.1f} s"


def _sigint_after(b: Bench, args, finished, seconds: float = 4.0) -> tuple[Result, float]:
    """SIGINT `args` at a random moment of its first `seconds` (imports, restore, compile, work); when it
    had `finished()` first, again, earlier. (Result, the moment)."""
    rng = random.Random(" ".join(map(str, args)))
    for _ in range(4):
        at = rng.uniform(0.5, seconds)
        p = b.popen(args)
        try:
            time.sleep(at)
            t = time.monotonic()
            p.send_signal(signal.SIGINT)
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                raise NotHeld("hung: no exit 60 s after SIGINT") from None
        finally:
            stop(p)
        if not finished():
            return Result(p.returncode, out, err, time.monotonic() - t), at
        seconds = at
    raise NotHeld(f"the command finished before every SIGINT (the last at {at:.1f} s)")


@case("interrupt", "prepare --workers 2", "SIGINT mid-way", "exit 130, one line; no output, no temporary")
def prepare_sigint(b: Bench):
    out = b.path("out")
    res = _sigint(b, ["-m", "onona_jax.data.prepare", "--input", str(big_corpus(b)), "--output", str(out), "--workers=2"],
                  lambda: any(out.parent.glob(f"{out.name}.tmp-*")), "the partial output")
    one_error(res, 130, f"{out} was not written")
    left = [x.name for x in out.parent.glob(f"{out.name}*")]
    expect(not left, f"left behind: {left}")


@case("interrupt", "serve.export --overwrite (onto an earlier export)", "SIGINT mid-export",
      "exit 130, one line; the earlier export unchanged, no temporary")
def export_sigint(b: Bench):
    out = b.path("export")
    shutil.copytree(b.hf_folder, out)
    before = digest(out)
    res, at = _sigint_after(b, ["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}",
                                "--notokenizer", "--overwrite"], lambda: digest(out) != before)
    one_error(res, 130, "interrupted", "was not written" if res.err.count("interrupted while starting") == 0 else "")
    unchanged(before, out, "the earlier export")
    expect(not list(out.parent.glob(f"{out.name}.tmp-*")), "a temporary left")


@case("interrupt", "serve.generate", "SIGINT mid-generation", "exit 130, one line")
def generate_sigint(b: Bench):
    done = []
    res, at = _sigint_after(b, ["-m", "onona_jax.serve.generate", f"--workdir={b.run_dir}", "--prompt=It is",
                                "--max_new_tokens=16"], lambda: bool(done))
    one_error(res, 130, "interrupted")
    expect("new tokens" not in res.out, "it finished")
    return f"at {at:.1f} s"


@case("interrupt", "train.import_hf", "SIGINT during its step-0 save", "exit 130, one line; no workdir left")
def import_hf_sigint(b: Bench):
    wd = b.path("wd")
    res = _sigint(b, ["-m", "onona_jax.train.import_hf", f"--from_hf={b.hf_folder}", f"--workdir={wd}"],
                  lambda: any((wd / "checkpoints").glob("0.orbax-checkpoint-tmp*")), "the step-0 save")
    one_error(res, 130, "nothing was imported")
    expect(not wd.exists(), f"left {sorted(digest(wd))}")


@case("interrupt", "experiments.sweep", "SIGINT to the sweep alone (kill -INT) during a run",
      "exit 130, one line naming the run; the run saved its step (exit 0); status 'interrupted'")
def sweep_sigint(b: Bench):
    wd = b.path("sweep")
    res = _sigint(b, ["-m", "onona_jax.experiments.sweep", "--grid=factorial", "--size=tiny", f"--workdir={wd}",
                      "--arms=standard", "--", f"--config.data.dir={b.data}", "--config.train.steps=200",
                      "--config.train.checkpoint_every=5", "--config.mesh.data=1"],
                  lambda: any(wd.glob("*/seed0/checkpoints/5")), "the run's first checkpoint")
    one_error(res, 130, "interrupted; stopped standard/seed0", "rerun the same command to resume the sweep")
    status = json.loads((wd / "sweep_status.json").read_text())["standard/seed0"]
    expect(status["status"] == "interrupted" and status["returncode"] in (0, 130), f"status {status}")
    expect(not (wd / "lock.json").exists() and not (wd / "standard" / "seed0" / "lock.json").exists(), "a lock left")
