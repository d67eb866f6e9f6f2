"""The workdir lock: one writer at a time, through symlinks, bind mounts and PID namespaces."""

from __future__ import annotations

import json
import subprocess

from .harness import (Bench, Result, Skip, case, digest, expect, final_eval, holder, losses, ok, one_error, stop,
                      unchanged, wait_for, why_not)


@case("lock", "train.py beside a running train.py (another lr)", "a live writer", "exit 2 naming it; the first finishes alone")
def two_writers(b: Bench):
    wd = b.path("wd")
    first = b.popen(b.train_args(wd, **{"train.steps": 12}))
    try:
        wait_for(lambda: (wd / "lock.json").exists(), 300, "the first run's lock", first)
        second = b.train(wd, **{"train.steps": 12, "train.lr": 1e-3})
        one_error(second, 2, f"pid {first.pid} ")
        out, err = first.communicate(timeout=600)
        ok(Result(first.returncode, out, err, 0))
    finally:
        stop(first)
    steps = losses((wd / "metrics.jsonl").read_text())
    expect(sorted(steps) == list(range(1, 13)) and all(len(v) == 1 for v in steps.values()),
           f"metrics.jsonl does not hold one run: {steps}")
    expect(not (wd / "lock.json").exists(), "lock.json left behind")


def _shared_checkpoints(b: Bench, link: str):
    """Two fresh workdirs whose checkpoints/ lead to one directory (`link`: symlink or bind), two
    train.py at once with another lr: the second exits 2 naming the first; the first's eval
    reports the first's own model."""
    shared = b.path("big-disk")
    shared.mkdir()
    first, second = b.path("wd"), b.path("wd")
    mounted = []
    try:
        for wd in (first, second):
            wd.mkdir()
            if link == "symlink":
                (wd / "checkpoints").symlink_to(shared)
            else:
                (wd / "checkpoints").mkdir()
                why = why_not(["mount", "--bind", str(shared), str(wd / "checkpoints")])
                if why:
                    raise Skip(f"mount --bind: {why}")
                mounted.append(wd / "checkpoints")
        run = b.popen(b.train_args(first, **{"train.steps": 12}))
        try:
            wait_for(lambda: (shared / "lock.json").exists(), 300, "the first run's lock of the shared directory", run)
            one_error(b.train(second, **{"train.steps": 12, "train.lr": 1e-3}), 2, f"pid {run.pid} ",
                      f"workdir {first})", "another workdir's run also writes")
            out, err = run.communicate(timeout=600)
            ok(Result(run.returncode, out, err, 0))
        finally:
            stop(run)
        expect(sorted(p.name for p in second.iterdir()) == ["checkpoints"], f"the second run wrote {list(second.iterdir())}")
        res = b.run(["eval.py", f"--workdir={first}", "--mesh=1,1,1", f"--output={b.path('eval.json')}"])
        ok(res)
        own = final_eval((first / "metrics.jsonl").read_text())["val_loss"]
        got = json.loads(res.out[res.out.index("{"):])["val_loss"]
        expect(got == own, f"eval of the first workdir reports {got}, its own run logged {own}")
        expect(not (shared / "lock.json").exists(), "the shared directory's lock.json left behind")
    finally:
        for m in mounted:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)


@case("lock", "train.py x2 (checkpoints/ symlinks to one directory)", "a second run, another lr, another workdir",
      "exit 2 naming the first; the first's model evaluated as its own")
def two_writers_through_symlinked_checkpoints(b: Bench):
    _shared_checkpoints(b, "symlink")


@case("lock", "train.py x2 (checkpoints/ bind mounts of one directory)", "a second run, another lr, another workdir",
      "exit 2 naming the first; the first's model evaluated as its own")
def two_writers_through_bind_mounted_checkpoints(b: Bench):
    _shared_checkpoints(b, "bind")


@case("lock", "train.py", "a holder in another PID namespace (unshare --pid), same host", "exit 2 naming it; unchanged")
def holder_in_a_container(b: Bench):
    unshare = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
    why = why_not([*unshare, "true"])
    if why:
        raise Skip(f"unshare --pid: {why}")
    wd = b.copy_run()
    h = holder(b, wd, unshare)
    try:
        before = digest(wd)
        one_error(b.train(wd), 2, "in another PID namespace")
        unchanged(before, wd)
        expect(h.poll() is None, "the holder died")
    finally:
        stop(h)


@case("lock", "train.py --break_lock", "a live holder on this host", "exit 2; unchanged; still held")
def break_lock_beside_a_live_holder(b: Bench):
    wd = b.copy_run()
    h = holder(b, wd)
    try:
        before = digest(wd)
        one_error(b.train(wd, "--break_lock"), 2, "--break_lock")
        unchanged(before, wd)
        one_error(b.train(wd), 2, f"pid {h.pid} ")  # still held
    finally:
        stop(h)


@case("lock", "train.py", "the last holder was killed with SIGKILL", "exit 0, no warning, resumes")
def lock_of_a_killed_holder(b: Bench):
    wd = b.copy_run()
    h = holder(b, wd)
    h.kill()
    h.wait()
    res = b.train(wd)
    ok(res)
    expect("lock" not in res.err.lower(), f"a lock message: {res.err[-600:]}")
    expect(not (wd / "lock.json").exists(), "lock.json left behind")


@case("lock", "python -m onona_jax.train.import_hf", "a live holder of the workdir", "exit 2; nothing written")
def import_hf_beside_a_holder(b: Bench):
    wd = b.path("wd")
    wd.mkdir()
    h = holder(b, wd)
    try:
        before = digest(wd)
        one_error(b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={b.hf_folder}", f"--workdir={wd}"]), 2,
                  f"pid {h.pid} ")
        unchanged(before, wd)
    finally:
        stop(h)


@case("lock", "python -m onona_jax.experiments.sweep", "a live holder of the sweep directory", "exit 2; nothing written")
def sweep_beside_a_holder(b: Bench):
    wd = b.path("sweep")
    wd.mkdir()
    h = holder(b, wd)
    try:
        before = digest(wd)
        one_error(b.run(["-m", "onona_jax.experiments.sweep", "--grid=factorial", "--size=tiny", f"--workdir={wd}",
                         "--", f"--config.data.dir={b.data}"]), 2, f"pid {h.pid} ")
        unchanged(before, wd)
    finally:
        stop(h)
