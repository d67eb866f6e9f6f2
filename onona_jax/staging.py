"""A local output directory built beside its target and moved into place when complete
(`build`: prepare's data dir, export's folder, import's copy of a tokenizer), so that an
interrupted or failed command leaves the target as it was.

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
from typing import Callable, Collection, TypeVar

LOCK = ".lock"  # inside the temp dir, locked while its command runs
T = TypeVar("T")


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
        lock = d / LOCK
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
    fd = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return tmp, fd


def build(out: Path, write: Callable[[Path], T], *, overwrite: bool, filled: str = "",
          owned: Collection[str] | None = None) -> T:
    """Build `out` beside itself and move it into place; returns `write(tmp)`'s result.

    `write` fills a fresh locked directory (`new`; its `.lock`, `LOCK`, is ours). Then a new
    or empty `out` is replaced by the directory in one rename. A non-empty one needs
    `overwrite` (else ValueError(`filled`): it was filled while we worked): with `owned`
    None the whole directory is swapped (the old one moved aside, then deleted); with
    `owned` (the names such a command writes) each file written replaces its namesake by a
    rename, the other `owned` names are removed, and nothing else there is touched. Any
    failure, a Ctrl-C included, removes the temp dir and leaves `out` as it was. Leftovers of
    killed commands are the caller's to clear first (`remove_stale`), which may report them."""
    tmp, lock_fd = new(out)
    try:
        result = write(tmp)
        (tmp / LOCK).unlink()  # our fd keeps the lock until the directory is in place
        _place(tmp, out, overwrite, filled, owned)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock_fd)
    return result


def _place(tmp: Path, out: Path, overwrite: bool, filled: str, owned: Collection[str] | None) -> None:
    # A file in the way: the whole-directory swap replaces it (the caller checked --overwrite),
    # the per-file merge needs a directory.
    if out.is_dir() and any(out.iterdir()) or owned is not None and out.exists() and not out.is_dir():
        if not overwrite:
            raise ValueError(filled)
        if owned is not None:
            files = os.listdir(tmp)
            for name in files:
                os.replace(tmp / name, out / name)
            for name in set(owned) - set(files):
                try:
                    os.remove(out / name)
                except FileNotFoundError:
                    pass
            tmp.rmdir()
            return
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
        return
    if out.is_dir():
        out.rmdir()
    elif out.exists():
        out.unlink()
    tmp.rename(out)
