"""The fault battery: every failure users found (issues 12 and 24) as a table of cases, each
run as the real command on real files, and kill -9 at random moments over N cycles, checked
bit for bit against an uninterrupted run.

    python benchmarks/faults.py                              # every case; 3 kill cycles, local disk and GCS emulator
    python benchmarks/faults.py --cycles=10 --stores=local,gcs --seed=1
    python benchmarks/faults.py --groups=lock,storage --cycles=0
    python benchmarks/faults.py --list                       # the table, nothing run
    python benchmarks/faults.py --groups=storage --cycles=0 --load=8   # timed cases on a loaded machine

A case is (command, fault, expected exit, expected bytes on disk): the fault is set up before
the command or injected while it runs, and the case holds when the exit status, the one
`error:` line (no traceback), the time it took and the files on disk are as the row says. A kill
cycle trains a fresh workdir (12 steps, a checkpoint every 2, validation every 4) and kills it
1-3 times at a random moment of a random kind (during a step, a checkpoint save, a validation,
a SIGTERM, or the prepare of its data), reruns until it finishes, and holds when every logged
loss and the final validation equal the uninterrupted run's bit for bit, no lock and no
temporary checkpoint is left, and the data prepared after the kill equals a clean prepare's.
On `--stores=gcs` the workdir is a bucket on the local GCS emulator (tests/fake_gcs.py).

It prints one line per case and cycle, then `N cases tried, M held`, and exits 1 if any did not
hold. Cases that need what this machine does not allow (root for `mount`/`chattr`, `unshare`)
are reported as skipped, with the reason. `tests/test_faults.py` (slow) runs it in CI.

Every subprocess shares a JAX compilation cache in the battery's temporary directory, so the
tiny model compiles once and each command costs little more than its imports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli

REPO = Path(__file__).resolve().parent.parent
TINY = f"{REPO}/configs/paper.py:dense-tiny-twin"
# The tiny twin model on one device with 8 x 32-token batches (tests/test_reliability.py's).
BASE = {
    "data.seq_len": 32, "model.n_heads": 8, "model.n_kv_heads": 4, "model.head_dim": 8,
    "train.global_batch": 8, "train.micro_batch": 8, "train.steps": 4, "train.warmup_steps": 2,
    "train.decay_fraction": 0.5,  # 4 steps: warm-up 1-2, decay 3-4 (step 4 at the final lr)
    "train.log_every": 1, "train.eval_every": 1000, "train.checkpoint_every": 2,
    "eval.windows": 8, "eval.batch": 8, "mesh.data": 1, "train.compile_cache_min_s": 0,
}
CYCLE = {"train.steps": 12, "train.eval_every": 4, "train.checkpoint_every": 2}
# A storage fault ends the run within this much of an idle machine's time after the write that
# meets it (issue 24 item 5). On a loaded machine a process gets cores/load of a core, so the
# bound in wall seconds is this times max(1, load / cores) (`exit_bound`): the run's own work
# after the fault, not the machine's other work. `--load=N` runs the timed cases beside N
# busy processes (CI: 8 on 2 cores), so the scaled bound is tried where it is tightest.
FAULT_EXIT_S = 10.0


class Load:
    """`n` busy processes for the duration of a timed case (the machine loaded on purpose)."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


LOAD = Load(0)  # the battery's (`--load`)


def exit_bound() -> tuple[float, float]:
    """(the wall-clock exit bound now, the load it was scaled for): FAULT_EXIT_S of an idle
    machine scaled by max(1, load / cores), the load being the 1-minute average or the busy
    processes running beside the case plus the run itself, whichever is higher (the average lags)."""
    cores = os.cpu_count() or 1
    load = max(os.getloadavg()[0], len(LOAD.procs) + 1.0)
    return FAULT_EXIT_S * max(1.0, load / cores), load


class NotHeld(Exception):
    """The case's expectation failed; the message says which."""


class Skip(Exception):
    """The case needs what this machine does not allow."""


@dataclasses.dataclass
class Result:
    rc: int | None
    out: str
    err: str
    seconds: float

    def errors(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("error: ")]

    def tail(self) -> str:
        """The end of stderr (else stdout) without progress-bar lines."""
        text = (self.err or self.out).replace("\r", "\n")
        return "\n".join(ln for ln in text.splitlines() if ln.strip() and "it/s" not in ln and "s/it" not in ln)[-1500:]


def expect(ok: bool, why: str):
    if not ok:
        raise NotHeld(why)


def one_error(res: Result, rc: int, *words: str) -> str:
    """Exit `rc` with exactly one `error:` line holding every word, and no traceback."""
    expect(res.rc == rc, f"exit {res.rc}, expected {rc}: {res.tail()}")
    lines = res.errors()
    expect(len(lines) == 1, f"{len(lines)} error lines: {lines or res.tail()}")
    for w in words:
        expect(w in lines[0], f"the error line lacks {w!r}: {lines[0]}")
    expect("Traceback" not in res.err and "Event loop is closed" not in res.err, f"a traceback: {_excerpt(res.err)}")
    return lines[0]


def _excerpt(err: str) -> str:
    """The first traceback in `err`, from its first line (or the event-loop line) on, a dozen lines."""
    lines = err.splitlines()
    at = next((i for i, ln in enumerate(lines) if "Traceback" in ln or "Event loop is closed" in ln), 0)
    return " | ".join(ln.strip()[:200] for ln in lines[max(0, at - 2):at + 12])


def ok(res: Result):
    expect(res.rc == 0, f"exit {res.rc}, expected 0: {res.tail()}")
    expect("Traceback" not in res.err, f"a traceback: {_excerpt(res.err)}")


def digest(path: Path) -> dict:
    """Every file (sha256) and directory under `path`, or {} when it does not exist."""
    path = Path(path)
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(path.rglob("*"))}


def unchanged(before: dict, path: Path, what: str = "the workdir"):
    after = digest(path)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    expect(not changed, f"{what} changed: {changed[:6]}")


def losses(metrics_text: str) -> dict[int, list[float]]:
    """{step: every loss logged for it} (a resumed run logs the steps after its checkpoint again)."""
    out: dict[int, list[float]] = {}
    for line in metrics_text.splitlines():
        row = json.loads(line)
        if "loss" in row:
            out.setdefault(row["step"], []).append(row["loss"])
    return out


def final_eval(metrics_text: str) -> dict:
    rows = [json.loads(ln) for ln in metrics_text.splitlines()]
    return [r for r in rows if "val_loss" in r][-1]


class Bench:
    """The battery's temporary root, its subprocess environment, the prepared data, a base run."""

    def __init__(self, root: Path, verbose: bool):
        self.root, self.verbose = root, verbose
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC",
                                                                             "JAX_PROCESS_ID", "ONONA_"))}
        self.env["XLA_FLAGS"] = " ".join(f for f in self.env.get("XLA_FLAGS", "").split()
                                         if not f.startswith("--xla_force_host_platform_device_count"))
        self.env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                        JAX_COMPILATION_CACHE_DIR=str(root / "jax-cache"),  # (what other commands read)
                        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                        # train.py and eval.py set JAX's cache themselves, from train.compile_cache
                        # (whose default this gives; BASE caches every program) and --compile_cache.
                        ONONA_COMPILE_CACHE=str(root / "jax-cache"))
        self.n = 0
        self._data = self._run_dir = self._hf = self._other = self._mixture_run = None
        self.gcs = None

    def path(self, name: str) -> Path:
        self.n += 1
        return self.root / f"{self.n:03d}-{name}"

    # -- commands

    def popen(self, args, **kw) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env={**self.env, **kw.pop("env", {})},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    def run(self, args, timeout: float = 600, **kw) -> Result:
        t = time.perf_counter()
        p = self.popen(args, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise NotHeld(f"hung: no exit after {timeout:.0f} s ({' '.join(map(str, args))[:200]}): {err[-800:]}")
        return Result(p.returncode, out, err, time.perf_counter() - t)

    def train_args(self, workdir, *extra, spec: str = TINY, data=None, **overrides) -> list[str]:
        flags_ = {**BASE, "data.dir": str(data or self.data), **overrides}
        return ["train.py", f"--config={spec}", f"--workdir={workdir}",
                *(f"--config.{k}={v}" for k, v in flags_.items()), *extra]

    def train(self, workdir, *extra, **kw) -> Result:
        timeout = kw.pop("timeout", 600)
        return self.run(self.train_args(workdir, *extra, **kw), timeout=timeout)

    def prepare(self, inputs, output, *extra) -> Result:
        return self.run(["-m", "onona_jax.data.prepare", "--input", *map(str, inputs), "--output", str(output),
                         "--heldout_fraction=0.1", *extra])

    # -- fixtures, made once

    @property
    def corpus(self) -> Path:
        """The first 300 KB of the bundled corpus (as tests/conftest.py's tiny_data)."""
        src = self.root / "corpus" / "austen_head.txt"
        if not src.exists():
            from onona_jax.tokenizer import bundled_corpus_path

            src.parent.mkdir(parents=True)
            with lzma.open(bundled_corpus_path(), "rt") as f:
                src.write_text(f.read(300_000))
        return src

    @property
    def data(self) -> Path:
        if self._data is None:
            out = self.root / "data"
            res = self.prepare([self.corpus], out)
            if res.rc != 0:
                raise RuntimeError(f"preparing the battery's data failed: {res.tail()}")
            self._data = out
        return self._data

    @property
    def run_dir(self) -> Path:
        """A finished 4-step run with checkpoints at steps 2 and 4."""
        if self._run_dir is None:
            wd = self.root / "base-run"
            res = self.train(wd)
            if res.rc != 0:
                raise RuntimeError(f"the battery's base run failed: {res.tail()}")
            self._run_dir = wd
        return self._run_dir

    def copy_run(self, name: str = "run") -> Path:
        dst = self.path(name)
        shutil.copytree(self.run_dir, dst)
        return dst

    def mixture(self, weights=(0.5, 0.5), **dirs) -> dict:
        """Overrides training on a mixture: source `a` the battery's data, `b` it prepared with
        another split seed (other data), unless `dirs` names them otherwise."""
        if self._other is None:
            self._other = self.root / "other-split-data"
            res = self.prepare([self.corpus], self._other, "--seed=7")
            if res.rc != 0:
                raise RuntimeError(f"preparing the battery's second data dir failed: {res.tail()}")
        dirs = {"a": self.data, "b": self._other, **dirs}
        entries = ",".join(f"{n}:{d}:{w}" for (n, d), w in zip(dirs.items(), weights))
        return {"data.dir": "", "data.mixture": entries}

    @property
    def mixture_run(self) -> Path:
        """A finished 4-step run on `mixture()` (checkpoints at steps 2 and 4)."""
        if self._mixture_run is None:
            wd = self.root / "base-mixture-run"
            res = self.train(wd, **self.mixture())
            if res.rc != 0:
                raise RuntimeError(f"the battery's mixture run failed: {res.tail()}")
            self._mixture_run = wd
        return self._mixture_run

    @property
    def hf_folder(self) -> Path:
        """The base run exported as a transformers folder."""
        if self._hf is None:
            out = self.root / "base-export"
            res = self.run(["-m", "onona_jax.serve.export", f"--workdir={self.run_dir}", f"--output={out}",
                            "--notokenizer"])
            if res.rc != 0:
                raise RuntimeError(f"exporting the base run failed: {res.tail()}")
            self._hf = out
        return self._hf


# ----------------------------------------------------------------------------- privileges


def _try(cmd) -> str | None:
    """None when `cmd` runs; else why not."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        return f"no {cmd[0]} here"
    return None if p.returncode == 0 else (p.stderr.strip() or f"{cmd[0]} failed")


def immutable(path: Path, on: bool = True):
    """`chattr +i` (root: even root cannot write there), else a read-only mode bit."""
    if os.geteuid() == 0:
        why = _try(["chattr", "+i" if on else "-i", str(path)])
        if why and on:
            raise Skip(f"chattr +i: {why}")
    else:
        path.chmod(0o555 if on else 0o755)


class Tmpfs:
    """A small tmpfs mounted at `path` (root only): a disk that fills for real."""

    def __init__(self, path: Path, size: str):
        path.mkdir(parents=True)
        why = _try(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
        if why:
            raise Skip(f"mount tmpfs: {why}")
        self.path = path

    def fill(self):
        """Fill the file system to its last byte (unbuffered writes, halving down to one byte)."""
        fd = os.open(self.path / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = 1 << 20
            while size:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    size //= 2
        finally:
            os.close(fd)

    def free(self):
        (self.path / "ballast").unlink(missing_ok=True)

    def close(self):
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise NotHeld(f"the command ended (exit {proc.returncode}) before {what}: "
                      f"{Result(proc.returncode, '', proc.stderr.read(), 0).tail()[-800:]}")
        if time.monotonic() > deadline:
            raise NotHeld(f"timed out waiting for {what}")
        time.sleep(poll)


def step_logged(workdir: Path, step: int) -> bool:
    try:
        return any(s >= step for s in losses((workdir / "metrics.jsonl").read_text()))
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------------------- the table

CASES: list = []


def case(group: str, command: str, fault: str, expected: str, timed: bool = False):
    """Register a case; `timed`: its expectation is a time bound, run beside `--load` busy processes."""
    def register(fn):
        CASES.append(dict(name=fn.__name__.replace("_", "-"), group=group, command=command, fault=fault,
                          expected=expected, fn=fn, timed=timed))
        return fn
    return register


# A process that holds a workdir's lock (lock.py alone: no jax, it holds within a second).
HOLD = """import importlib.util, sys, time
spec = importlib.util.spec_from_file_location('lock', sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
lock = m.WorkdirLock(sys.argv[2]).acquire()
print('held', flush=True); time.sleep(600)
"""


def holder(b: Bench, workdir: Path, prefix=()) -> subprocess.Popen:
    p = subprocess.Popen([*prefix, sys.executable, "-c", HOLD, str(REPO / "onona_jax/train/lock.py"), str(workdir)],
                         cwd=REPO, env=b.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line != "held\n":
        p.kill()
        raise NotHeld(f"the holder did not take the lock: {line}{p.communicate()[1][-800:]}")
    return p


def stop(p: subprocess.Popen):
    if p.poll() is None:
        p.kill()
    p.wait()


# -- the lock (issue 12 item 1; issue 24 item 1)


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
                why = _try(["mount", "--bind", str(shared), str(wd / "checkpoints")])
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
    why = _try([*unshare, "true"])
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


# -- bad values (issue 12 item 6; issue 24 item 2): exit 2, the workdir never created

BAD_VALUES = [
    ("train.steps", -5), ("train.lr", -1e-3), ("train.checkpoint_every", 0), ("train.log_every", 0),
    ("data.seq_len", 0), ("train.global_batch", 0), ("train.grad_clip", -1), ("train.b2", 2.0),
    ("train.eps", -1), ("train.b1", "nan"), ("train.weight_decay", "nan"), ("train.grad_clip", "nan"),
    ("model.rope_theta", "nan"), ("model.norm_eps", "nan"), ("train.lr", "inf"),
]


def _bad_value(key, value):
    def fn(b: Bench):
        wd = b.path("wd")
        one_error(b.train(wd, **{key: value}), 2, key)
        expect(not wd.exists(), f"{wd} was created")
    fn.__name__ = f"bad_{key.replace('.', '_')}_{value}"
    return fn


for _key, _value in BAD_VALUES:
    case("validation", f"train.py --config.{_key}={_value}", "a bad value", "exit 2 naming the key; no workdir")(
        _bad_value(_key, _value))


@case("validation", "train.py --config=configs/paper.py:nonsense", "a bad config spec", "exit 2, one line, no traceback")
def bad_config_spec(b: Bench):
    wd = b.path("wd")
    res = b.run(["train.py", f"--config={REPO}/configs/paper.py:nonsense", f"--workdir={wd}"])
    one_error(res, 2, "nonsense")
    expect("File \"" not in res.err, f"traceback text in the error: {res.err[-600:]}")
    expect(not wd.exists(), f"{wd} was created")


# -- resuming (issue 12 items 2-3; issue 24 items 3-4)


@case("resume", "train.py --config=...dense-tiny-standard", "a finished twin run's workdir", "exit 2 listing model.head; unchanged")
def changed_model(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.train(wd, spec=f"{REPO}/configs/paper.py:dense-tiny-standard"), 2, "model.head")
    unchanged(before, wd)


@case("resume", "train.py --config.train.lr=1e-3", "a finished run's workdir", "exit 2 listing train.lr; unchanged")
def changed_lr(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.train(wd, **{"train.lr": 1e-3}), 2, "train.lr")
    unchanged(before, wd)


@case("resume", "train.py --config.train.steps=8", "a run whose decay has begun", "exit 2 naming the choices; unchanged")
def extend_after_the_decay(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.train(wd, **{"train.steps": 8}), 2, "train.steps", "--workdir")
    unchanged(before, wd)


@case("resume", "train.py --config.train.steps=8", "a run checkpointed before its decay", "exit 0; the decay moves, no lr jump")
def extend_before_the_decay(b: Bench):
    wd = b.copy_run()
    shutil.rmtree(wd / "checkpoints" / "4")  # newest: step 2, still in the warm-up
    ok(b.train(wd, **{"train.steps": 8}))
    rows = [json.loads(ln) for ln in (wd / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}  # the last logged value of each step
    peak = 3e-3  # dense-tiny's lr; 8 steps decay over steps 5-8, where 4 steps decayed over 3-4
    expect(all(abs(lrs[s] - peak) <= 1e-9 for s in (3, 4, 5)) and lrs[8] < peak / 2,
           f"lr of steps 3-5 not the peak, or step 8 not decayed: {lrs}")


@case("resume", "train.py --config.data.dir=<a copy>", "the data dir moved (same manifest)", "exit 0, resumes")
def data_moved(b: Bench):
    wd = b.copy_run()
    moved = b.path("moved-data")
    shutil.copytree(b.data, moved)
    ok(b.train(wd, data=moved))


@case("resume", "train.py --config.data.cache_dir=<another>", "the cache dir changed", "exit 0, resumes")
def cache_dir_changed(b: Bench):
    wd = b.copy_run()
    ok(b.train(wd, **{"data.cache_dir": str(b.path("cache"))}))


@case("resume", "train.py --config.data.dir=<other data>", "data prepared with another split seed", "exit 2 naming both; unchanged")
def other_data(b: Bench):
    wd = b.copy_run()
    other = b.path("other-data")
    ok(b.prepare([b.corpus], other, "--seed=7"))
    before = digest(wd)
    one_error(b.train(wd, data=other), 2, str(other))
    unchanged(before, wd)


@case("data", "train.py", "a train shard replaced by random ids of the same size after the first start",
      "exit 2 naming the shard; unchanged")
def shard_replaced(b: Bench):
    import numpy as np

    wd = b.copy_run()
    data = b.path("data")
    shutil.copytree(b.data, data)
    ok(b.train(wd, data=data))  # the first start on this data dir records it
    shard = sorted(data.glob("train_*.bin"))[0]
    shard.write_bytes(np.random.default_rng(0).integers(0, 50257, shard.stat().st_size // 2, np.uint16).tobytes())
    before = digest(wd)
    one_error(b.train(wd, data=data), 2, shard.name)
    unchanged(before, wd)


@case("data", "train.py", "manifest.json truncated", "exit 2 naming it; no workdir")
def manifest_truncated(b: Bench):
    data = b.path("data")
    shutil.copytree(b.data, data)
    text = (data / "manifest.json").read_text()
    (data / "manifest.json").write_text(text[: len(text) // 2])
    wd = b.path("wd")
    one_error(b.train(wd, data=data), 2, "manifest.json")
    expect(not wd.exists(), f"{wd} was created")


@case("data", "train.py on a fresh workdir", "a shard damaged before the first start", "exit 2; the workdir left as it was")
def refused_start_leaves_nothing(b: Bench):
    data = b.path("data")
    shutil.copytree(b.data, data)
    shard = sorted(data.glob("train_*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[:2] = bytes([raw[0] ^ 1, raw[1]])  # one token id changed: same size, another hash
    shard.write_bytes(bytes(raw))
    wd = b.path("wd")
    wd.mkdir()
    one_error(b.train(wd, data=data), 2, shard.name)
    expect(digest(wd) == {}, f"the refused start left {sorted(digest(wd))}")


# -- mixtures (issue 40 item 7)


@case("mixture", "train.py --config.data.mixture=a:<data>:0.5,b:<missing>:0.5", "a mixture source missing",
      "exit 2 naming the source and prepare; no workdir")
def mixture_source_missing(b: Bench):
    wd, missing = b.path("wd"), b.path("missing")
    one_error(b.train(wd, **b.mixture(b=missing)), 2, "data.mixture source 'b'", str(missing), "onona_jax.data.prepare")
    expect(not wd.exists(), f"{wd} was created")


def _bad_weight(weight):
    def fn(b: Bench):
        wd = b.path("wd")
        one_error(b.train(wd, **b.mixture((0.5, weight))), 2, f"data.mixture source 'b' has weight {weight}",
                  "must be positive")
        expect(not wd.exists(), f"{wd} was created")
    fn.__name__ = f"mixture_weight_{'zero' if weight == 0 else 'negative'}"
    return fn


for _weight in (0, -0.5):
    case("mixture", f"train.py --config.data.mixture=a:<data>:0.5,b:<data>:{_weight}", "a weight that is not positive",
         "exit 2 naming the source and the weight; no workdir")(_bad_weight(_weight))


@case("mixture", "train.py --config.data.mixture=a:<data>:0.5,b:<other>:0.5", "b prepared with another tokenizer",
      "exit 2 naming source b and the tokenizers; no workdir")
def mixture_other_tokenizer(b: Bench):
    other = b.path("other-tokenizer")
    shutil.copytree(b.data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"] = {"kind": "hf", "name": "llama3", "sha256": "ab" * 32, "vocab": 50257, "eot": 0,
                             "config": {"tokenizer": "/models/llama3/tokenizer.json"}}
    (other / "manifest.json").write_text(json.dumps(manifest))
    wd = b.path("wd")
    one_error(b.train(wd, **b.mixture(b=other)), 2, "data.mixture source 'b'", "/models/llama3/tokenizer.json",
              "data.tokenizer is gpt2")
    expect(not wd.exists(), f"{wd} was created")


@case("mixture", "train.py --config.data.mixture=<new weights>", "a mixture run resumed from step 2 with other weights",
      "exit 0; the change recorded in metrics.jsonl")
def mixture_reweighted(b: Bench):
    wd = b.path("run")
    shutil.copytree(b.mixture_run, wd)
    shutil.rmtree(wd / "checkpoints" / "4")
    ok(b.train(wd, **b.mixture((0.25, 0.75))))
    rows = [json.loads(ln) for ln in (wd / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in rows if "mixture_change" in r]
    expect([(r["step"], r["mixture_change"]) for r in changes] == [(2, {"from": {"a": 0.5, "b": 0.5},
                                                                        "to": {"a": 0.25, "b": 0.75}})],
           f"metrics.jsonl records {changes}")


@case("mixture", "train.py --config.data.mixture=<other sources>", "a mixture run resumed with a source replaced",
      "exit 2 naming the run's mixture and --workdir; unchanged")
def mixture_sources_changed(b: Bench):
    wd = b.path("run")
    shutil.copytree(b.mixture_run, wd)
    before = digest(wd)
    run_mixture = b.mixture()["data.mixture"]
    renamed = {**b.mixture(), "data.mixture": run_mixture.replace("b:", "c:")}  # a source the run did not have
    one_error(b.train(wd, **renamed), 2, "may not change on resume", f"--config.data.mixture={run_mixture}",
              "--workdir")
    unchanged(before, wd)


# -- checkpoints (issue 12 items 4 and 8)


def _truncate_arrays(wd: Path, step: int):
    # Every array file, not only the largest: OCDBT's writer threads decide which file holds
    # the parameters, so a reader of the parameters alone (eval.py) might never touch the largest.
    files = [p for p in (wd / "checkpoints" / str(step) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


@case("checkpoint", "train.py", "the newest checkpoint's array file truncated", "exit 0; set aside; steps 3-4 again, bit-exact")
def damaged_newest_checkpoint(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    res = b.train(wd)
    ok(res)
    warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "step 4" in warnings[0], f"expected one warning about step 4: {res.err[-800:]}")
    expect(len(list((wd / "checkpoints" / "corrupt").iterdir())) == 1, "step 4 not set aside")
    got, ref = losses((wd / "metrics.jsonl").read_text()), losses((b.run_dir / "metrics.jsonl").read_text())
    expect(all(v == [ref[s][0]] * len(v) for s, v in got.items()), f"losses differ: {got} vs {ref}")


@case("checkpoint", "eval.py", "the newest checkpoint damaged", "exit 0 on step 2; checkpoints/ unchanged")
def eval_skips_a_damaged_step(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    before = digest(wd / "checkpoints")
    res = b.run(["eval.py", f"--workdir={wd}", "--mesh=1,1,1"])
    ok(res)
    expect(json.loads((wd / "eval" / "step_2.json").read_text())["step"] == 2, "eval did not use step 2")
    unchanged(before, wd / "checkpoints", "checkpoints/")


@case("checkpoint", "eval.py --step=4", "that step damaged", "exit 1, one line; unchanged")
def eval_of_a_damaged_step(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    before = digest(wd)
    one_error(b.run(["eval.py", f"--workdir={wd}", "--step=4", "--mesh=1,1,1"]), 1, "step 4")
    unchanged(before, wd)


@case("checkpoint", "eval.py --step=3", "no such step", "exit 2, one line; unchanged")
def eval_of_a_missing_step(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.run(["eval.py", f"--workdir={wd}", "--step=3", "--mesh=1,1,1"]), 2, "step 3")
    unchanged(before, wd)


@case("checkpoint", "train.py", "the newest checkpoint damaged, checkpoints/corrupt a file (and corrupt.1 a dangling link)",
      "exit 0; one warning; set aside to corrupt.2/; the file and link untouched; bit-exact")
def set_aside_with_corrupt_in_the_way(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    ckpts = wd / "checkpoints"
    (ckpts / "corrupt").write_text("a user's file\n")
    (ckpts / "corrupt.1").symlink_to(wd / "nowhere")
    res = b.train(wd)
    ok(res)
    warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "step 4" in warnings[0] and "corrupt.2/4-" in warnings[0],
           f"expected one warning moving step 4 to corrupt.2/: {warnings or res.tail()}")
    expect((ckpts / "corrupt").read_text() == "a user's file\n", "checkpoints/corrupt changed")
    expect((ckpts / "corrupt.1").is_symlink() and not (wd / "nowhere").exists(), "corrupt.1 changed")
    expect([p.name[:2] for p in (ckpts / "corrupt.2").iterdir()] == ["4-"], "step 4 not in corrupt.2/")
    got, ref = losses((wd / "metrics.jsonl").read_text()), losses((b.run_dir / "metrics.jsonl").read_text())
    expect(all(v == [ref[s][0]] * len(v) for s, v in got.items()) and sorted(got) == sorted(ref),
           f"losses differ: {got} vs {ref}")


DAMAGES = ("truncate", "other_step", "other_array", "flip", "delete", "empty")


def _damage(wd: Path, step: int, rng: random.Random) -> str:
    """Damage one random file of checkpoint `step` in one random way (DAMAGES); what was done, in words."""
    root = wd / "checkpoints"
    kind = rng.choice(DAMAGES)
    mine = sorted(p for p in (root / str(step)).rglob("*") if p.is_file())
    arrays = [p for p in mine if p.parent.name == "d"]
    # A role first (each item's metadata, its manifest, its array files...), then a file of it: drawn
    # uniformly over files, most seeds would hit one of the many array files, most of them never read.
    roles = {}
    for p in mine:
        rel = p.relative_to(root / str(step))
        roles.setdefault((rel.parts[0] if len(rel.parts) > 1 else "", p.parent.name == "d", p.name if
                          p.parent.name != "d" else ""), []).append(p)
    path = rng.choice(arrays if kind == "other_array" else rng.choice(sorted(roles.values())))
    rel = path.relative_to(root / str(step))
    detail = ""
    if kind == "truncate":
        size = path.stat().st_size
        keep = rng.randrange(size) if size else 0
        path.write_bytes(path.read_bytes()[:keep])
        detail = f" to {keep} of {size} bytes"
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "delete":
        path.unlink()
    elif kind == "flip":
        raw = bytearray(path.read_bytes())
        flips = [(rng.randrange(len(raw)), rng.randrange(8)) for _ in range(rng.randint(1, 8))] if raw else []
        for at, bit in flips:
            raw[at] ^= 1 << bit
        path.write_bytes(bytes(raw))
        detail = f" ({len(flips)} bits at bytes {sorted(at for at, _ in flips)})"
    elif kind == "other_step":
        other = root / str(6 - step) / rel  # steps 2 and 4
        if not other.is_file():  # array files have random names: the one of the same size rank
            here = sorted(path.parent.iterdir(), key=lambda p: (p.stat().st_size, p.name))
            there = sorted((p for p in other.parent.iterdir() if p.is_file()), key=lambda p: (p.stat().st_size, p.name))
            other = there[min(here.index(path), len(there) - 1)]
        shutil.copyfile(other, path)
        detail = f" (from {other.relative_to(root)})"
    else:  # other_array
        other = rng.choice([p for p in arrays if p != path] or [path])
        shutil.copyfile(other, path)
        detail = f" (from {other.relative_to(root / str(step))})"
    return f"{kind} {step}/{rel}{detail}"


def _fails_in_one_line_or_ok(res: Result, what: str) -> str:
    """Exit 0 (at most one warning), or exactly one `error:` line; never a traceback."""
    expect("Traceback" not in res.err and "Event loop is closed" not in res.err,
           f"{what}: a traceback: {_excerpt(res.err)}")
    if res.rc == 0:
        warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
        expect(len(warnings) <= 1, f"{what}: {len(warnings)} warnings: {warnings}")
        return f"{what} ok" + (" (skipped it)" if warnings else "")
    one_error(res, res.rc)
    return f"{what} exit {res.rc}: {res.errors()[0][7:90]}"


@case("checkpoint", "train.py, eval.py, serve.generate", "--damage_seeds random damages: a random file of step 2 or 4 "
      "truncated, emptied, deleted, bit-flipped, or replaced by step 4's/2's or another array file",
      "eval/generate exit 0 or one error line, workdir unchanged; train exit 0, at most one warning, bit-exact "
      "(flipped array bytes: no checksum, reported)")
def damage_fuzzer(b: Bench):
    notes = []
    for seed in range(b.damage_seeds):
        rng = random.Random(seed)
        wd = b.copy_run(f"damage-{seed}")
        step = rng.choice((2, 4))
        what = _damage(wd, step, rng)
        where = f"seed {seed}: {what}"
        try:
            before = digest(wd)
            outcome = []
            for cmd in ("eval", "generate"):
                explicit = rng.random() < 0.5
                args = (["eval.py", f"--workdir={wd}", "--mesh=1,1,1", f"--output={b.path('eval.json')}"]
                        if cmd == "eval" else
                        ["-m", "onona_jax.serve.generate", f"--workdir={wd}", "--prompt=It is", "--max_new_tokens=4",
                         "--greedy"])
                label = cmd + (f" --step={step}" if explicit else "")
                outcome.append(_fails_in_one_line_or_ok(b.run(args + ([f"--step={step}"] if explicit else [])), label))
            unchanged(before, wd)
            res = b.train(wd)
            if what.startswith("flip") and res.rc != 0:  # a flip that leaves valid JSON of other values
                outcome.append(f"train UNDETECTED flip, exit {res.rc}: {one_error(res, res.rc)[7:120]}")
                notes.append(f"{where} -> {', '.join(outcome)}")
                continue
            ok(res)
            warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
            expect(len(warnings) <= 1, f"train: {len(warnings)} warnings: {warnings}")
            aside = [p for d in (wd / "checkpoints").glob("corrupt*") for p in d.iterdir()]
            expect(len(aside) == len(warnings), f"train: {len(warnings)} warnings, {len(aside)} steps set aside")
            got, ref = losses((wd / "metrics.jsonl").read_text()), losses((b.run_dir / "metrics.jsonl").read_text())
            same = all(v == [ref[s][0]] * len(v) for s, v in got.items()) and sorted(got) == sorted(ref)
            val = final_eval((wd / "metrics.jsonl").read_text())["val_loss"]
            ref_val = final_eval((b.run_dir / "metrics.jsonl").read_text())["val_loss"]
            if what.startswith("flip") and not warnings and (not same or val != ref_val):
                outcome.append(f"train UNDETECTED: val_loss {val} vs {ref_val} (flipped bytes inside an array "
                               "chunk: Orbax's zarr chunks carry no checksum)")
            else:
                expect(same, f"train: losses differ: {got} vs {ref}")
                expect(val == ref_val, f"train: final val_loss {val} vs {ref_val}")
                outcome.append("train fell back, bit-exact" if warnings else "train ok, bit-exact")
        except NotHeld as why:
            raise NotHeld(f"{where}: {why}") from None
        notes.append(f"{where} -> {', '.join(outcome)}")
    return " | ".join(notes)


@case("checkpoint", "python -m onona_jax.serve.generate", "train.py saving every step, keeping 3 (a live run)",
      "exit 0 twice, on a step that exists")
def generate_on_a_live_run(b: Bench):
    wd = b.path("wd")
    run = b.popen(b.train_args(wd, **{"train.steps": 60, "train.checkpoint_every": 1, "train.keep_checkpoints": 3}))
    try:
        wait_for(lambda: step_logged(wd, 3), 300, "step 3", run)
        for _ in range(2):
            res = b.run(["-m", "onona_jax.serve.generate", f"--workdir={wd}", "--prompt=It is", "--max_new_tokens=4",
                         "--greedy"])
            ok(res)
    finally:
        stop(run)


# -- storage (issue 12 item 5; issue 24 item 5)


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


# -- prepare (issue 12 item 7; issue 24 items 1, 6, 7)


@case("prepare", "prepare --input D --output D --overwrite", "the output is the input", "exit 2; D unchanged")
def prepare_onto_its_input(b: Bench):
    d = b.path("corpus")
    d.mkdir()
    shutil.copy(b.corpus, d / "a.txt")
    before = digest(d)
    res = b.prepare([d], d, "--overwrite")
    one_error(res, 2)
    unchanged(before, d, "the input")


@case("prepare", "prepare --input D --output D/out", "the output inside the input", "exit 2; nothing written")
def prepare_inside_its_input(b: Bench):
    d = b.path("corpus")
    d.mkdir()
    shutil.copy(b.corpus, d / "a.txt")
    before = digest(d)
    one_error(b.prepare([d], d / "out"), 2)
    unchanged(before, d, "the input")


@case("prepare", "prepare --heldout_fraction=0.5", "a one-document corpus (a split would be empty)",
      "exit 2 naming the empty split; no output")
def prepare_with_an_empty_split(b: Bench):
    one = b.path("one-doc.txt")
    one.write_text("It is a truth universally acknowledged.\n")
    out = b.path("out")
    res = b.run(["-m", "onona_jax.data.prepare", "--input", str(one), "--output", str(out), "--heldout_fraction=0.5"])
    one_error(res, 2, "held-out")
    expect(not out.exists(), "output written")


def _big_corpus(b: Bench) -> Path:
    big = b.root / "corpus" / "big.txt"
    if not big.exists():
        from onona_jax.tokenizer import bundled_corpus_path

        with lzma.open(bundled_corpus_path(), "rt") as f:
            text = f.read()
        big.parent.mkdir(parents=True, exist_ok=True)
        big.write_text(text * 12)  # ~2 s of prepare with 2 workers on 2 idle cores: time to be interrupted
    return big


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] not in ("Z", "X"):
                found.add(int(d.name))
    return found


@case("prepare", "prepare --workers 2", "SIGTERM mid-way", "exit status of a signal; no output, no temporaries")
def prepare_sigterm(b: Bench):
    out = b.path("out")
    p = b.popen(["-m", "onona_jax.data.prepare", "--input", str(_big_corpus(b)), "--output", str(out), "--workers=2"])
    try:
        wait_for(lambda: any(out.parent.glob(f"{out.name}.tmp-*")), 120, "the partial output", p)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        stop(p)
    expect(p.returncode != 0, "exit 0 after SIGTERM")
    left = [x.name for x in out.parent.glob(f"{out.name}*")]
    expect(not left, f"left behind: {left}")


@case("prepare", "prepare --workers 2", "kill -9 of prepare mid-way", "its workers gone within 5 s; a rerun equals a clean prepare")
def prepare_sigkill(b: Bench):
    out = b.path("out")
    p = b.popen(["-m", "onona_jax.data.prepare", "--input", str(b.corpus), str(_big_corpus(b)), "--output", str(out),
                 "--workers=2"])
    try:
        wait_for(lambda: len(_children(p.pid)) >= 2 and any(out.parent.glob(f"{out.name}.tmp-*")), 120,
                 "two workers", p)
        workers = _children(p.pid)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 5
        while any(_state(w) not in ("Z", "X", "gone") for w in workers):
            if time.monotonic() > deadline:
                raise NotHeld(f"workers {sorted(workers)} still alive 5 s after the kill")
            time.sleep(0.1)
    finally:
        stop(p)
    clean = b.path("clean")
    ok(b.prepare([b.corpus, _big_corpus(b)], clean, "--workers=2"))
    ok(b.prepare([b.corpus, _big_corpus(b)], out, "--workers=2"))
    expect(digest(out) == digest(clean), "the rerun's output differs from a clean prepare's")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# -- export and import (issue 24 item 6)


@case("cli", "serve.export --output=<non-empty dir>", "a folder holding other files", "exit 2; folder unchanged")
def export_into_a_non_empty_dir(b: Bench):
    out = b.path("out")
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = digest(out)
    one_error(b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}"]), 2, "--overwrite")
    unchanged(before, out, "the folder")


@case("cli", "serve.export --overwrite", "a folder with a stale export and a file of the user's",
      "exit 0; the user's file kept; files 0644")
def export_overwrite(b: Bench):
    out = b.path("out")
    shutil.copytree(b.hf_folder, out)
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"stale")
    ok(b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}", "--overwrite",
              "--notokenizer"]))
    expect((out / "notes.txt").read_text() == "mine", "the user's file was removed")
    expect(digest(out)["model.safetensors"] == digest(b.hf_folder)["model.safetensors"], "stale weights kept")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file() and p.name != "notes.txt"}
    expect(set(modes.values()) == {"0o644"}, f"modes: {modes}")


@case("cli", "serve.export --output=<a file> | <under a file> | <read-only dir>", "an impossible output",
      "exit 2 each, before any checkpoint is read")
def export_to_impossible_places(b: Bench):
    f = b.path("file")
    f.write_text("x")
    ro = b.path("ro")
    ro.mkdir()
    immutable(ro)
    try:
        for out in (f, f / "sub", ro / "out"):
            res = b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}"])
            one_error(res, 2, str(out))
    finally:
        immutable(ro, False)


@case("cli", "serve.export | prepare --output=<a mount point>", "an empty volume as the output",
      "exit 2 each, before any work, naming a folder inside it; the volume unchanged")
def outputs_onto_a_mount_point(b: Bench):
    fs = Tmpfs(b.path("volume"), "64m")
    try:
        res = b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={fs.path}", "--notokenizer"])
        one_error(res, 2, "is a mount point", f"--output={fs.path / 'export'}")
        res = b.prepare([b.corpus], fs.path)
        one_error(res, 2, "is a mount point", f"--output={fs.path / 'data'}")
        expect(not list(fs.path.iterdir()) and not list(fs.path.parent.glob(f"{fs.path.name}.tmp-*")),
               "something was written")
        ok(b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={fs.path / 'export'}",
                  "--notokenizer"]))  # the folder it names works
    finally:
        fs.close()


@case("cli", "serve.export", "the disk fills while model.safetensors is written",
      "exit 1, one line naming the disk; no folder, no temporary")
def export_onto_a_full_disk(b: Bench):
    fs = Tmpfs(b.path("small"), "2m")  # the tiny model's weights: several MB
    try:
        out = fs.path / "export"
        res = b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}", "--notokenizer"])
        one_error(res, 1, "No space left on device", str(out))
        expect(not list(fs.path.iterdir()), f"left behind: {list(fs.path.iterdir())}")
    finally:
        fs.close()


@case("cli", "train.import_hf", "killed (SIGKILL) during its step-0 save", "the rerun exit 0, removing the partial save")
def import_killed_during_its_save(b: Bench):
    wd = b.path("wd")
    p = b.popen(["-m", "onona_jax.train.import_hf", f"--from_hf={b.hf_folder}", f"--workdir={wd}"])
    try:
        wait_for(lambda: any((wd / "checkpoints").glob("0.orbax-checkpoint-tmp*")), 300, "the step-0 save", p,
                 poll=0.005)
        p.kill()
        p.wait()
    finally:
        stop(p)
    if (wd / "checkpoints" / "0").is_dir():
        raise NotHeld("the save finished before the kill: rerun the case")
    res = b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={b.hf_folder}", f"--workdir={wd}"])
    ok(res)
    expect("unfinished save of an import that was killed" in res.err, f"no word of the partial save: {res.tail()}")
    expect(sorted(p.name for p in (wd / "checkpoints").iterdir()) == ["0"], "checkpoints/ holds more than step 0")
    ok(b.run(["eval.py", f"--workdir={wd}", "--mesh=1,1,1", f"--output={b.path('eval.json')}"]))


@case("cli", "train.py --config.train.steps=10**12", "more steps than an int32 counter holds",
      "exit 2 before the compile, one line; no workdir")
def steps_past_int32(b: Bench):
    wd = b.path("wd")
    res = b.train(wd, **{"train.steps": 10**12})
    one_error(res, 2, "train.steps", "2,147,483,647")
    expect(not wd.exists(), "a workdir was made")


@case("cli", "train.py --workdir=gs://...", "gcsfs not installed (the gcs extra)", "exit 2, one line naming the extra")
def bucket_without_its_extra(b: Bench):
    code = ("import sys; sys.modules['gcsfs'] = None; sys.argv[0] = 'train.py'; import train; "
            "sys.exit(train.main(sys.argv[1:]))")
    res = b.run(["-c", code, "--workdir=gs://bucket/run"])
    one_error(res, 2, "gs://", ".[gcs]")


@case("cli", "train.py, eval.py", "JAX_PLATFORMS naming a platform this machine lacks (tpu, cuda, nonsense)",
      "exit 2, one line naming JAX_PLATFORMS; nothing written")
def jax_platforms_this_machine_lacks(b: Bench):
    for platform in ("tpu", "cuda", "nonsense"):
        wd = b.path("wd")
        one_error(b.run(b.train_args(wd), env={"JAX_PLATFORMS": platform}), 2, f"JAX_PLATFORMS={platform}")
        expect(not wd.exists(), "a workdir was made")
    one_error(b.run(["eval.py", f"--workdir={b.run_dir}"], env={"JAX_PLATFORMS": "tpu"}), 2, "JAX_PLATFORMS=tpu")


@case("cli", "train.py", "ONONA_DISTRIBUTED=yes | ONONA_LOCK_LEASE_S=soon | ONONA_COMPILE_CACHE=<unwritable>",
      "exit 2, one line naming the variable; nothing written")
def onona_variables(b: Bench):
    for name, value in (("ONONA_DISTRIBUTED", "yes"), ("ONONA_LOCK_LEASE_S", "soon"),
                        ("ONONA_COMPILE_CACHE", "/proc/no-cache-here")):
        wd = b.path("wd")
        one_error(b.run(b.train_args(wd), env={name: value}), 2, name)
        expect(not wd.exists(), "a workdir was made")


@case("cli", "train.py (resume)", "config.json edited by hand", "exit 0; one warning naming the key; rewritten")
def config_json_edited_by_hand(b: Bench):
    wd = b.copy_run()
    cfg = json.loads((wd / "config.json").read_text())
    cfg["train"]["lr"] = 0.5
    (wd / "config.json").write_text(json.dumps(cfg))
    res = b.train(wd)
    ok(res)
    warnings = [ln for ln in res.err.replace("\r", "\n").splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "train.lr" in warnings[0] and "edited by hand" in warnings[0], f"{warnings}")
    expect(json.loads((wd / "config.json").read_text())["train"]["lr"] != 0.5, "config.json keeps the edit")


@case("cli", "train.import_hf", "model.safetensors truncated", "exit 2 naming the file; nothing written")
def import_truncated_weights(b: Bench):
    hf = b.path("hf")
    shutil.copytree(b.hf_folder, hf)
    w = hf / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    wd = b.path("wd")
    res = b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={hf}", f"--workdir={wd}"])
    expect(res.rc in (1, 2), f"exit {res.rc}")
    one_error(res, res.rc, "model.safetensors")
    expect(not (wd / "checkpoints").exists() and not (wd / "config.json").exists(), "written")


@case("cli", "train.import_hf", "config.json not JSON", "exit 2 naming the file; nothing written")
def import_config_not_json(b: Bench):
    hf = b.path("hf")
    shutil.copytree(b.hf_folder, hf)
    (hf / "config.json").write_text("{not json")
    wd = b.path("wd")
    res = b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={hf}", f"--workdir={wd}"])
    one_error(res, 2, str(hf / "config.json"))
    expect(not (wd / "checkpoints").exists(), "written")


@case("cli", "serve.generate --max_new_tokens=0", "a bad value", "exit 2, one line")
def generate_zero_tokens(b: Bench):
    one_error(b.run(["-m", "onona_jax.serve.generate", f"--workdir={b.run_dir}", "--max_new_tokens=0"]), 2,
              "--max_new_tokens")


# -- SIGINT (issue 39 item 3): the first stops cleanly (training: the step in flight saved, as on
# SIGTERM), the second at once; exit 130, one line, never a traceback or a hang.

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
    expect("Traceback" not in res.err and "KeyboardInterrupt" not in res.err, f"a traceback: {_excerpt(res.err)}")
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
    res = _sigint(b, ["-m", "onona_jax.data.prepare", "--input", str(_big_corpus(b)), "--output", str(out), "--workers=2"],
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


# ----------------------------------------------------------------------------- kill -9 cycles

KINDS = ("step", "save", "eval", "sigterm", "prepare")


class Store:
    """Where a cycle's workdir lives: local disk or a bucket on the GCS emulator."""

    def __init__(self, b: Bench, name: str):
        self.b, self.name = b, name
        if name == "gcs":
            if b.gcs is None:
                sys.path.insert(0, str(REPO / "tests"))
                import fake_gcs

                b.gcs = fake_gcs.start()
                b.env.update(fake_gcs.env(b.gcs.url))
                # A killed run's bucket lease expires after this (lock.LEASE_S is 120 s: each
                # kill would cost two minutes of waiting); renewed every 20/12 s meanwhile.
                b.env["ONONA_LOCK_LEASE_S"] = "20"
            self.bucket = b.gcs.new_bucket()

    def workdir(self, name: str) -> str:
        return f"gs://{self.bucket}/{name}" if self.name == "gcs" else str(self.b.path(name))

    def read(self, path: str) -> str:
        from onona_jax import paths

        return paths.read_text(path)

    def listing(self, path: str) -> list[str]:
        from onona_jax import paths

        return [os.path.basename(p) for p in paths.glob(path, "*")] if paths.isdir(path) else []

    def exists(self, path: str) -> bool:
        from onona_jax import paths

        return paths.exists(path)


def _metrics(store: Store, wd: str) -> str:
    try:
        return store.read(f"{wd}/metrics.jsonl")
    except (OSError, FileNotFoundError):
        return ""


def _kill_at(b: Bench, store: Store, wd: str, data: Path, kind: str, rng: random.Random) -> str:
    """Start the run and kill it at a moment of `kind`; what happened, in words."""
    steps = CYCLE["train.steps"]
    p = b.popen(b.train_args(wd, data=data, **CYCLE))
    try:
        def logged():
            return losses(_metrics(store, wd))

        if kind == "save":
            committed: set[str] = set()

            def saving():
                """A step being written: Orbax's temporary directory locally; in a bucket a step
                directory without its commit marker (Orbax writes that object last)."""
                for n in store.listing(f"{wd}/checkpoints"):
                    if "tmp" in n:
                        return True
                    if store.name == "gcs" and n.isdigit() and n not in committed:
                        if not store.exists(f"{wd}/checkpoints/{n}/commit_success.txt"):
                            return True
                        committed.add(n)
                return False
            deadline = time.monotonic() + 300
            while not saving():
                if p.poll() is not None or time.monotonic() > deadline:
                    return f"{kind}: no save seen before the run ended"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))
        elif kind == "eval":
            target = rng.choice([s for s in range(4, steps, CYCLE["train.eval_every"])])

            def validating():
                rows = [json.loads(ln) for ln in _metrics(store, wd).splitlines()]
                return any(r.get("step") == target and "loss" in r for r in rows)
            deadline = time.monotonic() + 300
            while not validating():
                if p.poll() is not None or time.monotonic() > deadline:
                    return f"{kind}: step {target} not reached before the run ended"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.2))
        else:  # step, sigterm: after a random logged step
            done = max(logged(), default=0)
            target = rng.randint(done + 1, steps - 1) if done + 1 < steps else steps
            deadline = time.monotonic() + 300
            while max(logged(), default=0) < target:
                if p.poll() is not None or time.monotonic() > deadline:
                    return f"{kind}: step {target} not reached before the run ended"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.3))
        if p.poll() is not None:
            return f"{kind}: the run ended first"
        if kind == "sigterm":
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=120)
            if p.returncode != 0 or "Traceback" in err:
                raise NotHeld(f"SIGTERM: exit {p.returncode}: {err[-800:]}")
            return f"sigterm after step {max(logged(), default=0)}"
        p.kill()
        p.wait()
        return f"kill -9 {kind} (logged up to step {max(logged(), default=0)})"
    finally:
        stop(p)


def _prepare_killed(b: Bench, rng: random.Random) -> tuple[Path, str]:
    """Prepare the battery's corpus into a new dir, kill -9 it at a random moment, rerun it."""
    out = b.path("cycle-data")
    p = b.popen(["-m", "onona_jax.data.prepare", "--input", str(b.corpus), "--output", str(out),
                 "--heldout_fraction=0.1", "--workers=2"])
    time.sleep(rng.uniform(0.5, 4.0))
    finished = p.poll() is not None
    stop(p)
    if finished:
        moment = "after it finished"
    else:  # the rerun must find nothing that training would accept, and start clean
        moment = "mid-way"
        expect(not (out / "manifest.json").exists(), "a killed prepare left a manifest")
        ok(b.prepare([b.corpus], out))
    expect(digest(out) == digest(b.data), "the data prepared after the kill differs from a clean prepare's")
    return out, f"kill -9 prepare {moment}"


def cycle(b: Bench, store: Store, reference: str, rng: random.Random, index: int) -> str:
    wd = store.workdir(f"cycle-{index}")
    kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, 3))]
    data, events = b.data, []
    for kind in kinds:
        if kind == "prepare":
            data, event = _prepare_killed(b, rng)
        else:
            event = _kill_at(b, store, wd, data, kind, rng)
        events.append(event)
    res = b.train(wd, data=data, **CYCLE)
    ok(res)
    got, ref = losses(_metrics(store, wd)), losses(reference)
    expect(sorted(got) == sorted(ref), f"steps logged {sorted(got)}")
    for s, values in got.items():
        expect(all(v == ref[s][0] for v in values), f"step {s}: losses {values} vs {ref[s][0]} uninterrupted")
    mine, theirs = final_eval(_metrics(store, wd)), final_eval(reference)
    expect(all(mine[k] == theirs[k] for k in theirs if k.startswith("val_loss")), f"final eval {mine} vs {theirs}")
    expect(not store.exists(f"{wd}/lock.json"), "lock.json left behind")
    left = [n for n in store.listing(f"{wd}/checkpoints") if "tmp" in n]
    expect(not left, f"temporary checkpoints left: {left}")
    return "; ".join(events)


# ----------------------------------------------------------------------------- the command


def define(fv, argv):
    flags.DEFINE_list("groups", [], "case groups to run (default: all): " + ", ".join(sorted({c["group"] for c in CASES})),
                      flag_values=fv)
    flags.DEFINE_list("cases", [], "case names to run (default: all; see --list)", flag_values=fv)
    flags.DEFINE_integer("cycles", 3, "kill -9 cycles per store", flag_values=fv)
    flags.DEFINE_list("stores", ["local", "gcs"], "where the cycles' workdirs live: local, gcs", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "the cycles' random moments", flag_values=fv)
    flags.DEFINE_integer("damage_seeds", 3, "damage-fuzzer's seeds (0, 1, ...): each damages one random file of a "
                         "checkpoint, then runs eval, generate and train", flag_values=fv)
    flags.DEFINE_bool("list", False, "print the table and run nothing", flag_values=fv)
    flags.DEFINE_string("keep", None, "keep the battery's files in this directory (default: a temporary one)",
                        flag_values=fv)
    flags.DEFINE_bool("verbose", False, "print each case's stderr tail", flag_values=fv)
    flags.DEFINE_integer("load", 0, "busy processes beside each timed case (CI: 8, a loaded 2-core host)",
                         flag_values=fv)


def _main(fv, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    unknown = sorted(set(fv.groups) - {c["group"] for c in CASES}) + sorted(set(fv.cases) - {c["name"] for c in CASES})
    if unknown:
        raise cli.UsageError(f"unknown groups or cases {unknown}; see --list")
    if set(fv.stores) - {"local", "gcs"}:
        raise cli.UsageError(f"--stores={','.join(fv.stores)}: local and/or gcs")
    chosen = [c for c in CASES if (not fv.groups or c["group"] in fv.groups) and (not fv.cases or c["name"] in fv.cases)]
    if fv.load < 0:
        raise cli.UsageError(f"--load={fv.load}: give a number of busy processes, 0 or more")
    if fv.list:
        for c in CASES:
            print(f"{c['group']:10s} {c['name']:36s} {c['command']} | fault: {c['fault']} | expect: {c['expected']}")
        return 0
    if fv.keep:
        root = Path(fv.keep).resolve()
        root.mkdir(parents=True, exist_ok=False)
        return _battery(fv, chosen, root)
    with tempfile.TemporaryDirectory(prefix="onona-faults-") as tmp:
        return _battery(fv, chosen, Path(tmp))


def _battery(fv, chosen, root: Path) -> int:
    b = Bench(root, fv.verbose)
    b.damage_seeds = fv.damage_seeds
    tried = held = skipped = 0
    failed = []
    t0 = time.perf_counter()
    print(f"fault battery on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M')}: {len(chosen)} cases, "
          f"{fv.cycles} kill cycles on {','.join(fv.stores) if fv.cycles else 'no store'}"
          + (f"; timed cases beside {fv.load} busy processes" if fv.load else ""), flush=True)

    def report(name: str, fn):
        nonlocal tried, held, skipped
        t = time.perf_counter()
        try:
            note = fn()
        except Skip as why:
            skipped += 1
            print(f"  skipped  {name}  ({why})", flush=True)
            return
        except NotHeld as why:
            tried += 1
            failed.append(name)
            print(f"  FAILED   {name}  [{time.perf_counter() - t:5.1f} s]  {why}", flush=True)
            return
        except Exception as err:  # noqa: BLE001 - an expectation the case could not even check
            tried += 1
            failed.append(name)
            print(f"  FAILED   {name}  [{time.perf_counter() - t:5.1f} s]  {type(err).__name__}: {err}", flush=True)
            return
        tried += 1
        held += 1
        print(f"  held     {name}  [{time.perf_counter() - t:5.1f} s]{'  ' + note if note else ''}", flush=True)

    try:
        def loaded(c):
            global LOAD
            LOAD = Load(fv.load if c["timed"] else 0)
            with LOAD:
                return c["fn"](b)

        for c in chosen:
            report(f"{c['group']}/{c['name']}", lambda c=c: loaded(c))
        if fv.cycles:
            rng = random.Random(fv.seed)
            for store_name in fv.stores:
                store = Store(b, store_name)
                reference = {}

                def uninterrupted(store=store, reference=reference):
                    wd = store.workdir("reference")
                    ok(b.train(wd, **CYCLE))
                    reference["text"] = _metrics(store, wd)
                    return f"val_loss {final_eval(reference['text'])['val_loss']:.6f}"

                report(f"cycles/{store_name}/uninterrupted", uninterrupted)
                if "text" not in reference:
                    continue
                for i in range(fv.cycles):
                    report(f"cycles/{store_name}/{i}", lambda store=store, i=i: cycle(b, store, reference["text"], rng, i))
    finally:
        if b.gcs is not None:
            b.gcs.stop()
    print(f"{tried} cases tried, {held} held, {skipped} skipped ({time.perf_counter() - t0:.0f} s)"
          + (f"; not held: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__))
