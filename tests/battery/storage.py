"""Storage faults: read-only checkpoints, a disk that fills, files deleted mid-run, unwritable
outputs; each ends the run in one line within a load-scaled time bound."""

from __future__ import annotations

import subprocess
import time

from .harness import (Bench, FAULT_EXIT_S, NotHeld, Result, Tmpfs, case, digest, exit_bound, expect, final_eval,
                      immutable, losses, ok, one_error, step_logged, stop, unchanged, wait_for)


@case("storage", "train.py (a finished run)", "checkpoints/ read-only before the start", "exit 1 in seconds; unchanged")
def read_only_checkpoints_at_start(b: Bench):
    wd = b.copy_run()
    before = digest(wd / "checkpoints")
    immutable(wd / "checkpoints")
    try:
        res = b.train(wd)  # finished: it would only validate, but checks that it can save first
        one_error(res, 1, str(wd / "checkpoints"))
        expect(res.seconds < 60, f"took {res.seconds:.0f} s")
        unchanged(before, wd / "checkpoints", "checkpoints/")
        expect(not (wd / "lock.json").exists(), "lock.json left behind")
    finally:
        immutable(wd / "checkpoints", False)


@case("storage", "train.py", "checkpoints/ turned read-only mid-run",
      f"exit 1 within {FAULT_EXIT_S:.0f} s × max(1, load/cores) of it; steps intact", timed=True)
def read_only_checkpoints_mid_run(b: Bench):
    wd = b.path("wd")
    run = b.popen(b.train_args(wd, **{"train.steps": 400, "train.checkpoint_every": 5}))
    ckpts = wd / "checkpoints"
    try:
        wait_for(lambda: (ckpts / "5").is_dir(), 300, "the checkpoint of step 5", run)
        wait_for(lambda: step_logged(wd, 6), 60, "step 6", run)
        immutable(ckpts)
        t = time.monotonic()
        bound, load = exit_bound()
        try:
            out, err = run.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            raise NotHeld("no exit 120 s after checkpoints/ turned read-only") from None
        took = time.monotonic() - t
        one_error(Result(run.returncode, out, err, took), 1, str(ckpts))
        expect(took < bound, f"exit {took:.1f} s after the fault, past the bound {bound:.1f} s at load {load:.1f}")
    finally:
        stop(run)
        immutable(ckpts, False)
    expect(not (wd / "lock.json").exists(), "lock.json left behind")
    ok(b.run(["eval.py", f"--workdir={wd}", "--mesh=1,1,1"]))  # the steps it kept restore
    return f"exit {took:.1f} s after the fault (bound {bound:.1f} s at load {load:.1f})"


def _full_disk(b: Bench, at: str):
    """Fill the workdir's file system while a run trains; `at`: the write that meets it first."""
    fs = Tmpfs(b.path("tmpfs"), "512m")  # a checkpoint of the tiny twin model: 77 MB
    try:
        wd = fs.path / "wd"
        # save: nothing logged between checkpoints, so a save meets the full disk first;
        # metrics: no checkpoint before the run would end, so a metrics line or event does.
        cadence = ({"train.checkpoint_every": 5, "train.log_every": 1000} if at == "save" else
                   {"train.checkpoint_every": 1000, "train.log_every": 1})
        run = b.popen(b.train_args(wd, **{"train.steps": 400, **cadence}))
        try:
            if at == "save":
                wait_for(lambda: (wd / "checkpoints" / "5").is_dir(), 300, "the checkpoint of step 5", run)
            else:
                wait_for(lambda: step_logged(wd, 6), 300, "step 6", run)
            fs.fill()
            t = time.monotonic()
            bound, load = exit_bound()
            try:
                out, err = run.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                raise NotHeld("no exit 120 s after the disk filled") from None
            took = time.monotonic() - t
        finally:
            stop(run)
        line = one_error(Result(run.returncode, out, err, took), 1, "rerun the same command")
        expect(took < bound, f"exit {took:.1f} s after the disk filled, past the bound {bound:.1f} s at load {load:.1f}")
        left = [p.name for p in (wd / "checkpoints").glob("*tmp*")] + [p.name for p in wd.glob("*.tmp-*")]
        expect(not left, f"temporaries left behind: {left}")
        expect(not (wd / "lock.json").exists(), "lock.json left behind")
        text = (wd / "metrics.jsonl").read_text()
        expect(text.endswith("\n"), "a torn metrics line")
        fs.free()
        ok(b.train(wd, **{"train.steps": 12, **cadence}))  # resumes once space is back
        return f"exit {took:.1f} s after the disk filled (bound {bound:.1f} s at load {load:.1f})"
    finally:
        fs.close()


@case("storage", "train.py", "the disk fills during a checkpoint save",
      f"exit 1 within {FAULT_EXIT_S:.0f} s × max(1, load/cores), no temporaries; resumes once freed", timed=True)
def full_disk_during_a_save(b: Bench):
    return _full_disk(b, "save")


@case("storage", "train.py", "the disk fills at a metrics/TensorBoard write",
      f"exit 1 within {FAULT_EXIT_S:.0f} s × max(1, load/cores), no traceback; resumes once freed", timed=True)
def full_disk_at_a_metrics_write(b: Bench):
    return _full_disk(b, "metrics")


@case("storage", "train.py", "metrics.jsonl deleted mid-run (a clean-up script)",
      "exit 0; one warning; every step and the final validation in metrics.jsonl")
def metrics_deleted_mid_run(b: Bench):
    wd = b.path("wd")
    steps = 100  # enough of them left after the fault
    run = b.popen(b.train_args(wd, **{"train.steps": steps, "train.checkpoint_every": 100}))
    try:
        wait_for(lambda: step_logged(wd, 5), 300, "step 5", run)
        (wd / "metrics.jsonl").unlink()
        out, err = run.communicate(timeout=600)
    finally:
        stop(run)
    res = Result(run.returncode, out, err, 0)
    ok(res)
    warnings = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "metrics.jsonl was deleted while this run wrote it" in warnings[0],
           f"expected one warning about metrics.jsonl: {warnings or res.tail()}")
    text = (wd / "metrics.jsonl").read_text()
    expect(sorted(losses(text)) == list(range(1, steps + 1)), f"steps in metrics.jsonl: {sorted(losses(text))}")
    final_eval(text)  # the final validation's line is there


@case("storage", "eval.py --output=<read-only dir>/e.json", "an unwritable output", "exit 2 before the work")
def eval_output_unwritable(b: Bench):
    ro = b.path("ro")
    ro.mkdir()
    immutable(ro)
    try:
        res = b.run(["eval.py", f"--workdir={b.run_dir}", f"--output={ro / 'e.json'}", "--mesh=1,1,1"])
        one_error(res, 2, str(ro))
    finally:
        immutable(ro, False)


@case("storage", "eval.py (no --output)", "a read-only workdir (its default output eval/ unwritable)",
      "exit 2 before the work, naming --output; unchanged")
def eval_default_output_unwritable(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    immutable(wd)
    try:
        res = b.run(["eval.py", f"--workdir={wd}", "--mesh=1,1,1"])
        one_error(res, 2, str(wd / "eval"), "--output=")
        expect(res.seconds < 30, f"took {res.seconds:.0f} s: the evaluation ran first?")
    finally:
        immutable(wd, False)
    unchanged(before, wd)
