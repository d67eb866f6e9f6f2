"""A sweep's runs on a fleet, whatever engine places them (`ray_engine`; `sweep --engine=ray`):
which arm × seed runs are left to do, each one's state read from its workdir, how an attempt
ended, the budgets that decide whether it is tried again, and the accounting the sweep keeps.

The workdir is the source of truth: a run is done once eval.py's result for its last step is
there (`DIR/<arm>/seed<k>/eval/step_<steps>.json`), and an unfinished one has reached the newest
step in its `checkpoints/`; train.py resumes from it bit for bit and holds the workdir's lock, so a
second copy of a run exits 2 ("is in use") instead of writing beside the first.

An attempt ends in one of four ways (`outcome`):

    done        train.py and eval.py exited 0
    pre-empted  the node was lost, or train.py stopped on SIGTERM (it saves its step and exits 0
                with a "pre-empted: saved step N" line; killed by it first: -15 / 143); Ctrl-C (130)
    failed      any other non-zero exit: its last `error:` line (or stderr line) says why
    busy        train.py found the workdir locked by another live run: neither, tried again later

Budgets (as levanter and marin keep them): pre-emptions are retried without limit by default
(`max_preemptions`), failures `max_failures` times (2), then the run is left failed. Each run's
accounting is `DIR/fleet/<arm>.seed<k>.json` (written atomically): its state (queued, running,
pre-empted, failed, done), step / steps, pre-emptions, failures, the last `error:` line, its logs
and one entry per attempt. `table` is `sweep --status`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import time

from onona_jax import paths
from onona_jax.experiments.grids import run_dir

FLEET = "fleet"  # DIR/fleet/<arm>.seed<k>.json
PREEMPTED_LINE = "pre-empted: saved step"  # train.py's line when SIGTERM stopped it (train/actions.py)
IN_USE = " is in use by "  # the workdir lock's refusal (train/lock.py)
INTERRUPTED = 130  # cli.INTERRUPTED: Ctrl-C, the step saved
STATES = ("queued", "running", "pre-empted", "failed", "done")
TAIL = 4000  # characters of an attempt's stderr kept


@dataclasses.dataclass(frozen=True)
class Run:
    """One arm × seed of a sweep in `sweepdir`; `arm` as `sweep.grid_info` gives it (with "budget")."""

    arm: dict
    seed: int
    sweepdir: str

    @property
    def key(self) -> str:
        return f"{self.arm['name']}/seed{self.seed}"

    @property
    def workdir(self) -> str:
        return run_dir(self.sweepdir, self.arm["name"], self.seed)

    @property
    def steps(self) -> int:
        return int(self.arm["budget"]["steps"])

    @property
    def record_path(self) -> str:
        return paths.join(self.sweepdir, FLEET, f"{self.arm['name']}.seed{self.seed}.json")


def runs(arms, seeds, sweepdir: str) -> list[Run]:
    return [Run(arm, seed, sweepdir) for arm in arms for seed in seeds]


@dataclasses.dataclass(frozen=True)
class Budgets:
    max_preemptions: int | None = None  # None: unlimited
    max_failures: int = 2  # failed attempts retried; the next failure leaves the run failed


# ---------------------------------------------------------------------------------- the workdir


def checkpoint_steps(workdir: str) -> list[int]:
    """The finished checkpoints' steps (Orbax writes `checkpoints/<step>/` under a temporary name
    and renames it when complete)."""
    ckpts = paths.Workdir(workdir).checkpoints
    if not paths.isdir(ckpts):
        return []
    return sorted(int(p.name) for p in paths.path(ckpts).iterdir() if p.name.isdigit())


def is_done(run: Run) -> bool:
    """eval.py's result for the run's last step is there."""
    return paths.exists(paths.Workdir(run.workdir).eval_result(run.steps))


def held(workdir: str) -> bool:
    """A live process holds the workdir's lock (train.py running there). Local disk and NFS: the
    OS lock on lock.json is asked about, not taken; a bucket: lock.json exists."""
    lock = paths.Workdir(workdir).lock
    if paths.is_cloud(lock):
        return paths.exists(lock)
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        import fcntl
        import struct

        query = struct.pack("@hhqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # struct flock
        cmd = getattr(fcntl, "F_OFD_GETLK", fcntl.F_GETLK)
        return struct.unpack("@hhqqixxxx", fcntl.fcntl(fd, cmd, query))[0] != fcntl.F_UNLCK
    except OSError:
        return True  # (a lock that cannot be asked about: assume its holder lives)
    finally:
        os.close(fd)


def step_reached(run: Run) -> int:
    steps = checkpoint_steps(run.workdir)
    return steps[-1] if steps else 0


# ---------------------------------------------------------------------------------- an attempt


def error_line(stderr: str) -> str:
    """The last `error:` line of a command's stderr, else its "pre-empted:" line, else its last
    non-empty line."""
    lines = [ln.strip() for ln in stderr.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")] or [ln for ln in lines if ln.startswith(PREEMPTED_LINE)]
    return (errors or lines or [""])[-1]


def outcome(rc: int | None, stderr: str = "", lost: bool = False) -> str:
    """How a stage ended: "done", "pre-empted", "failed" or "busy" (the module's docstring).
    `lost`: the node or the process running it died (the engine says so); `rc`: the exit status
    (negative: killed by that signal)."""
    if lost:
        return "pre-empted"
    if rc == 0:
        return "pre-empted" if PREEMPTED_LINE in stderr else "done"
    if rc in (-signal.SIGTERM, 128 + signal.SIGTERM, INTERRUPTED):
        return "pre-empted"
    if rc == 2 and IN_USE in error_line(stderr):
        return "busy"
    return "failed"


def _with_parent(signum: int):
    """A run's process gets `signum` when the one that started it dies (Linux `PR_SET_PDEATHSIG`):
    a worker an engine loses, or a driver that dies, leaves no train.py running on and holding the
    workdir. SIGTERM for one process (the pre-emption: it saves its step and exits); SIGKILL for a
    gang's member, whose peers are gone (it would wait on them in a collective)."""
    def set_it():
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    return set_it


def attempt(argvs, cwd: str, log_dir: str, attempt_no: int = 0, env=None, suffix: str = "",
            on_parent_death: int = signal.SIGTERM) -> list[dict]:
    """Run each (stage, argv) of `argvs` in turn from `cwd` until one does not end "done";
    stdout/stderr appended to `log_dir/<stage><suffix>.{out,err}` under a header line naming
    the attempt and host. Returns [{stage, returncode, stderr_tail, outcome, log}] (what an
    engine sends back to the driver). Local log_dir only: an engine needs the logs where they
    can be read while the run goes on."""
    os.makedirs(log_dir, exist_ok=True)
    results = []
    for stage, argv in argvs:
        out_path, err_path = (os.path.join(log_dir, f"{stage}{suffix}.{x}") for x in ("out", "err"))
        header = (f"--- attempt {attempt_no} on {socket.gethostname()} pid {os.getpid()} "
                  f"at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n")
        with open(out_path, "a") as out, open(err_path, "a") as err:
            for f in (out, err):  # (on a line of its own: a progress bar may have left one open)
                f.write(("\n" if f.tell() else "") + header)
            err.flush()
            start = err.tell()
            out.flush()
            rc = subprocess.call(argv, cwd=cwd, stdout=out, stderr=err, env=env,
                                 preexec_fn=_with_parent(on_parent_death))
        with open(err_path, errors="replace") as f:
            f.seek(start)
            tail = f.read()[-TAIL:]
        results.append(dict(stage=stage, returncode=rc, stderr_tail=tail, outcome=outcome(rc, tail), log=err_path,
                            host=socket.gethostname()))
        if results[-1]["outcome"] != "done":
            break
    return results


# ---------------------------------------------------------------------------------- accounting


def load(run: Run) -> dict:
    """The run's record (a fresh one if it has none)."""
    import json

    try:
        rec = json.loads(paths.read_text(run.record_path))
    except FileNotFoundError:
        rec = {}
    base = dict(arm=run.arm["name"], seed=run.seed, workdir=run.workdir, state="queued", step=0,
                steps=run.steps, preemptions=0, failures=0, busy=0, last_error="", logs=paths.Workdir(run.workdir).logs,
                attempts=[])
    return {**base, **rec}


def save(run: Run, rec: dict) -> dict:
    rec["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    paths.write_json(run.record_path, rec)
    return rec


def started(run: Run, rec: dict) -> dict:
    rec["attempts"].append(dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), step=step_reached(run)))
    rec.update(state="running", step=step_reached(run))
    return save(run, rec)


def account(run: Run, rec: dict, how: str, budgets: Budgets, error: str = "", stage: str = "",
            returncode: int | None = None, node: str = "", before: tuple[int, int] = (0, 0)) -> bool:
    """Record an attempt that ended `how` ("done", "pre-empted", "failed", "busy") on `node`;
    True if the run is to be tried again: within its budgets, which count the pre-emptions and
    failures after `before` (the record's when this sweep command started: a rerun of the
    command gives a failed run its budget again)."""
    last = rec["attempts"][-1] if rec["attempts"] else {}
    last.update(ended=time.strftime("%Y-%m-%dT%H:%M:%S"), outcome=how, stage=stage, returncode=returncode,
                error=error, **({"node": node} if node else {}))
    rec["step"] = step_reached(run)
    again = False
    if how == "done":
        rec["state"], rec["last_error"] = "done", ""
    elif how == "busy":
        rec["busy"] += 1
        rec["last_error"] = error
        rec["state"], again = "queued", True
    elif how == "pre-empted":
        rec["preemptions"] += 1
        again = budgets.max_preemptions is None or rec["preemptions"] - before[0] <= budgets.max_preemptions
        rec["state"] = "pre-empted"
        if not again:
            rec["last_error"] = f"pre-empted {rec['preemptions']} times (--max_preemptions={budgets.max_preemptions})"
    else:
        rec["failures"] += 1
        rec["last_error"] = error
        again = rec["failures"] - before[1] <= budgets.max_failures
        rec["state"] = "queued" if again else "failed"
    save(run, rec)
    return again


def state(run: Run) -> dict:
    """The run's record brought up to date with its workdir: done once its final evaluation is
    there, running while train.py holds it, else as the engine left it (an attempt submitted but
    not started, or whose driver died: queued, or pre-empted if the last attempt was)."""
    rec = load(run)
    rec["step"] = step_reached(run)
    if is_done(run):
        rec["state"] = "done"
    elif held(run.workdir):
        rec["state"] = "running"
    elif rec["state"] == "running":
        ended = [a for a in rec["attempts"] if "outcome" in a]
        rec["state"] = "pre-empted" if ended and ended[-1]["outcome"] == "pre-empted" else "queued"
    return rec


def table(runs_, local_status: dict | None = None) -> str:
    """`sweep --status`: one row per run. `local_status`: sweep_status.json of `--engine=local`
    (its failed runs, for runs with no record here)."""
    rows = [("run", "state", "step", "pre-empted", "failed", "last error", "logs")]
    for run in runs_:
        r = state(run)
        local = (local_status or {}).get(run.key, {})
        if not r["attempts"] and r["state"] != "done" and local.get("status") in ("failed", "running", "interrupted"):
            r.update(state={"interrupted": "pre-empted"}.get(local["status"], local["status"]),
                     failures=int(local["status"] == "failed"), last_error=error_line(local.get("stderr_tail", "")),
                     attempts=[local])
        rows.append((run.key, r["state"], f"{r['step']}/{r['steps']}", str(r["preemptions"]), str(r["failures"]),
                     _short(r["last_error"]), r["logs"] if r["attempts"] or r["state"] == "done" else ""))
    counts = {s: sum(1 for row in rows[1:] if row[1] == s) for s in STATES}
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines + ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n)])


def _short(line: str, n: int = 100) -> str:
    line = re.sub(r"\s+", " ", line)
    return line if len(line) <= n else line[: n - 1] + "…"
