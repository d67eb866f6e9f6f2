"""What every case of the battery shares: the tiny run it starts from (BASE), the battery's temporary
root and subprocess environment (`Bench`), the checks a case makes (`expect`, `one_error`,
`unchanged`), what needs root (`immutable`, `Tmpfs`), and the table every case registers in (`case`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO}/configs/paper.py:dense-tiny-twin"
# The tiny twin model on one device with 8 x 32-token batches (tests/run_fixtures.py's).
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
    expect("Traceback" not in res.err and "Event loop is closed" not in res.err, f"a traceback: {excerpt(res.err)}")
    return lines[0]


def excerpt(err: str) -> str:
    """The first traceback in `err`, from its first line (or the event-loop line) on, a dozen lines."""
    lines = err.splitlines()
    at = next((i for i, ln in enumerate(lines) if "Traceback" in ln or "Event loop is closed" in ln), 0)
    return " | ".join(ln.strip()[:200] for ln in lines[max(0, at - 2):at + 12])


def ok(res: Result):
    expect(res.rc == 0, f"exit {res.rc}, expected 0: {res.tail()}")
    expect("Traceback" not in res.err, f"a traceback: {excerpt(res.err)}")


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


def why_not(cmd) -> str | None:
    """None when `cmd` runs; else why not."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        return f"no {cmd[0]} here"
    return None if p.returncode == 0 else (p.stderr.strip() or f"{cmd[0]} failed")


def immutable(path: Path, on: bool = True):
    """`chattr +i` (root: even root cannot write there), else a read-only mode bit."""
    if os.geteuid() == 0:
        why = why_not(["chattr", "+i" if on else "-i", str(path)])
        if why and on:
            raise Skip(f"chattr +i: {why}")
    else:
        path.chmod(0o555 if on else 0o755)


class Tmpfs:
    """A small tmpfs mounted at `path` (root only): a disk that fills for real."""

    def __init__(self, path: Path, size: str):
        path.mkdir(parents=True)
        why = why_not(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
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
