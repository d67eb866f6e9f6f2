"""A local output directory built beside its target and moved into place when complete
(prepare's data dir, export's folder), so that an interrupted or failed command leaves the
target as it was.

The work happens in `{target}.tmp-PID`, a sibling (same file system: the final rename is
atomic), which holds an exclusive flock on its `.lock` for as long as its process lives. A
command killed by SIGKILL or a power loss leaves that directory behind; the next command
writing the same target removes it (`remove_stale`), and never one whose process still runs.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
from pathlib import Path


def _lock_is_free(lock_path: Path) -> bool:
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False  # being moved into place right now
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Delete `{out}.tmp-PID` directories of commands that died before finishing.

    A running command holds an exclusive flock on `.lock` inside its temp dir; a dir whose lock can be
    taken (or, made before locks existed, whose PID is not running) is left over and is removed.
    """
    removed = []
    for d in sorted(out.parent.glob(f"{glob.escape(out.name)}.tmp-*")) if out.parent.is_dir() else []:
        lock = d / ".lock"
        if not d.is_dir():
            continue
        if lock.exists():
            stale = _lock_is_free(lock)
        else:
            pid = d.name.rsplit("-", 1)[-1]
            stale = pid.isdigit() and not _pid_alive(int(pid))
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def new(out: Path) -> tuple[Path, int]:
    """A fresh, locked temp dir beside `out`: (its path, the lock's fd). Unlink `.lock` before
    moving the dir into place and close the fd after: the lock is held until then."""
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fd = os.open(tmp / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return tmp, fd
