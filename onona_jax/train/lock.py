"""One writer per workdir: `WORKDIR/lock.json`, created atomically by train.py before its
first write and removed when it exits (done, pre-empted or failed).

The lock holds the holder's host, pid, process start time and wall-clock start. A second
train.py on the same workdir stops with exit 2 naming the holder. A lock whose process is
gone (same host: no such pid, or the pid now belongs to a younger process) is stale: it is
replaced with a warning. A lock from another host cannot be checked from here, so it is
broken only with `--break_lock`. A multi-host run takes one lock: process 0 writes it.

In a bucket (`--workdir=gs://...`) the lock is created with the store's conditional upload (GCS:
`ifGenerationMatch=0`), so of two runs starting at once exactly one gets it, as locally. Breaking a
stale lock there is read-compare-delete, not the local rename-aside: two processes breaking the
same stale lock in the same instant could both proceed (locally only one can).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from onona_jax import paths

LOCK_NAME = "lock.json"


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux /proc; None elsewhere): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def holder_text(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {when}"


class WorkdirLock:
    """`with WorkdirLock(workdir, break_lock):` holds the workdir for this run."""

    def __init__(self, workdir: str, break_lock: bool = False):
        self.path = paths.join(workdir, LOCK_NAME)
        self.workdir = workdir
        self.break_lock = break_lock
        self.held = False
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "proc_start": _proc_start(os.getpid()),
                     "started": time.time(), "argv": sys.argv}

    # -- the holder

    def read(self) -> dict | None:
        try:
            return json.loads(paths.read_text(self.path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treated as held by an unknown process

    def stale(self, info: dict) -> bool:
        """True when the holder is certainly gone (same host only)."""
        if info.get("host") != self.info["host"] or not isinstance(info.get("pid"), int):
            return False
        if not _alive(info["pid"]):
            return True
        start = _proc_start(info["pid"])
        return start is not None and info.get("proc_start") is not None and start != info["proc_start"]

    def _create(self) -> bool:
        """Atomic and exclusive (`paths.create_exclusive`): no reader ever sees a half-written
        lock, and of two creators exactly one succeeds."""
        return paths.create_exclusive(self.path, json.dumps(self.info))

    def _remove_if(self, info: dict) -> bool:
        """Move the lock aside if it is still `info`'s (two processes breaking the same stale
        lock: only one wins; the other puts back what it moved and sees a live lock)."""
        if paths.is_cloud(self.path):  # no rename in a bucket: read, compare, delete
            if self.read() != info:
                return False
            paths.remove(self.path)
            return True
        aside = f"{self.path}.broken-{os.getpid()}"
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return True
        try:
            with open(aside) as f:
                moved = json.load(f)
        except (OSError, ValueError):
            moved = {}
        if moved != info:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        return True

    def acquire(self):
        jax = sys.modules.get("jax")  # a run has imported it; the lock itself needs no jax
        if jax is not None and jax.process_index() != 0:  # one lock per run: process 0 holds it
            return self
        paths.makedirs(self.workdir)
        for _ in range(3):
            if self._create():
                self.held = True
                return self
            info = self.read()
            if info is None:
                continue  # released meanwhile
            if self.stale(info):
                if self._remove_if(info):
                    print(f"warning: replacing a stale lock on {self.workdir} left by {holder_text(info)} "
                          "(that process is gone)", file=sys.stderr)
                continue
            if self.break_lock:
                if self._remove_if(info):
                    print(f"warning: --break_lock: took the lock on {self.workdir} from {holder_text(info)}",
                          file=sys.stderr)
                continue
            same_host = info.get("host") == self.info["host"]
            fix = ("wait for it to finish, stop it, or train in another --workdir" if same_host else
                   "if that process is really gone (its host died), rerun with --break_lock; "
                   "otherwise wait, or train in another --workdir")
            raise ValueError(f"{self.workdir} is in use by another train.py ({holder_text(info)}, lock "
                             f"{self.path}); one run writes a workdir at a time: {fix}")
        raise ValueError(f"could not take the lock {self.path} (it keeps changing hands); "
                         "is another train.py starting on this workdir?")

    def release(self):
        if self.held:
            self.held = False
            if self.read() == self.info:
                paths.remove(self.path)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
