"""One writer per workdir: `WORKDIR/lock.json`, held by every command that writes a run
(train.py, `python -m onona_jax.train.import_hf`, the sweep for its own directory) from before its
first write until it ends. Liveness never rests on a pid:

* Local disk and NFS: the holder keeps an OS lock on `lock.json` for its whole life (an
  open-file-description `fcntl` lock on Linux, `flock` elsewhere; both are whole-file record
  locks that the kernel and NFS lock managers enforce, and that belong to the open file, so
  nothing else the process opens or closes releases them). The OS releases the lock when the
  holder ends in any way, SIGKILL included, so a lock is either held by a live process or free:
  no stale-pid guessing, which breaks across PID namespaces (containers sharing a hostname).
  The file's contents (host, pid, PID namespace, start time, argv) only name the holder in
  messages. The holder deletes the file on release; a process that opened the old file meanwhile
  sees, once it has the lock, that the path no longer names the file it locked, and starts over.
* A bucket (gs://): the lock is an object created with the store's conditional upload
  (`ifGenerationMatch=0`), so of two runs starting at once exactly one gets it, and it is a
  lease: the holder rewrites it every `lease/12` s from a daemon thread, each time conditioned on
  the generation it last wrote. Another process judges the lease by what it observes on its own
  clock: a lease whose object generation changes is alive (refused); one whose generation stays
  the same for `lease` seconds of the observer's monotonic clock has expired, and is taken over by
  a conditional rewrite of that very generation (two takers: one wins). No two clocks are ever
  compared, so clock skew between hosts cannot expire a live lease; only the rate of the clocks
  matters. The cost: a new run waits up to one renewal period to be refused, and up to one lease
  to take over from a holder that died.
  The holder that cannot renew (store unreachable, or its lease taken) stops: `raise_if_lost()` (called by
  the training loop at every step, by the sweep before every run) raises `LockLost` once its
  last successful renewal started `lease/2` s ago, at least `lease/2` s before any other
  process can take the lease over. A step or a save longer than that (minutes) is not covered.
  Only GCS is implemented (object generations); other object stores are refused.

The lease is `LEASE_S` seconds; the environment variable ONONA_LOCK_LEASE_S overrides it (tests
use seconds). A holder writes its lease into the object and observers judge it by that.

A multi-host run takes one lock: process 0 holds it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import math
import os
import socket
import sys
import threading
import time
import uuid

from onona_jax import cli, paths

# A bucket lease not renewed for this long (as its observer sees it) has expired. Renewed
# RENEWALS_PER_LEASE times per lease; long enough to ride out a slow or retried store request,
# short enough that a run restarted after its host died waits at most this long.
LEASE_S = 120.0
RENEWALS_PER_LEASE = 12


def lease_seconds() -> float:
    value = cli.seconds_from_env("ONONA_LOCK_LEASE_S", "the workdir lock's lease in seconds, e.g. 120")
    return LEASE_S if value is None else value


class LockLost(cli.Failure):
    """The run's lock was lost while it ran (a bucket lease it could not renew, or lock.json
    removed by hand): the run stops before writing more."""


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _command(argv) -> str:
    prog = os.path.basename(str(argv[0])) if isinstance(argv, list) and argv else ""
    return prog if prog not in ("", "-c", "-m") else "a Python process"


def holder_text(info: dict) -> str:
    """`train.py (pid 7 on host h, started 2026-12-02 10:00:00 UTC)` from a lock's contents."""
    if not info:
        return "a process that has not written its details yet"
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    where = f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"
    if info.get("host") == socket.gethostname() and info.get("pid_ns") not in (None, _pid_namespace()):
        where += " (in another PID namespace: a container)"
    run = f", workdir {info['workdir']}" if isinstance(info.get("workdir"), str) else ""
    return f"{_command(info.get('argv'))} ({where}, started {when}{run})"


def _in_use(workdir: str, info: dict, how: str) -> ValueError:
    return ValueError(f"{workdir} is in use by {holder_text(info)}, which {how}; one run writes a workdir at a "
                      "time: wait for it to finish, stop it, or use another --workdir")


def _parse(data: bytes | None) -> dict:
    try:
        info = json.loads(data)
    except (TypeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


# ----------------------------------------------------------------------------- local disk / NFS


# Open-file-description locks on Linux (an fcntl record lock, so NFS's lock managers enforce it,
# owned by the open file rather than the process, so closing another descriptor of lock.json in the
# same process does not drop it); flock elsewhere (also owned by the open file).
_OFD = sys.platform.startswith("linux") and hasattr(fcntl, "F_OFD_SETLK")


class _Flock(ctypes.Structure):  # struct flock of 64-bit Linux
    _fields_ = [("l_type", ctypes.c_short), ("l_whence", ctypes.c_short), ("l_start", ctypes.c_int64),
                ("l_len", ctypes.c_int64), ("l_pid", ctypes.c_int)]


def _set_lock(fd: int, held: bool) -> None:
    """Take (without waiting: OSError EAGAIN/EACCES if another holds it) or drop the whole-file lock."""
    if _OFD:
        kind = fcntl.F_WRLCK if held else fcntl.F_UNLCK
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, bytes(_Flock(kind, os.SEEK_SET, 0, 0, 0)))
    else:
        fcntl.flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if held else fcntl.LOCK_UN)


def _same_file(fd: int, path: str) -> bool:
    """True while `path` still names the file open as `fd` (not removed, not replaced)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_fd(fd: int) -> dict:
    """The holder's details; it writes them just after locking, so wait a moment for them."""
    deadline = time.monotonic() + 2.0
    while True:
        info = _parse(os.pread(fd, 1 << 16, 0))
        if info or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


# ----------------------------------------------------------------------------- a bucket (GCS)


class _Bucket:
    """The conditional operations a lease needs, on one GCS object (generation preconditions;
    gcsfs turns a failed precondition, HTTP 412, into FileExistsError)."""

    def __init__(self, url: str):
        fs, _ = paths._fs(url)
        try:
            from gcsfs.core import GCSFileSystem  # (gcsfs.GCSFileSystem is a subclass of it)
        except ImportError:
            GCSFileSystem = None
        if GCSFileSystem is None or not isinstance(fs, GCSFileSystem):
            raise ValueError(f"{url}: the workdir lock in a bucket is implemented for GCS (gs://) only (it needs "
                             "object generations); use a gs:// or a local/NFS --workdir")
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(url)

    def _upload(self, data: bytes, if_generation: str) -> str | None:
        try:
            j = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o", uploadType="media",
                             name=self.key, ifGenerationMatch=if_generation, data=data, json_out=True)
        except FileExistsError:  # the precondition failed
            return None
        return str(j["generation"])

    def create(self, data: bytes) -> str | None:
        """Write the object if none exists: its generation, or None."""
        return self._upload(data, "0")

    def replace(self, data: bytes, generation: str) -> str | None:
        """Rewrite the object if it is still `generation`: the new generation, or None."""
        return self._upload(data, generation)

    def delete(self, generation: str) -> bool:
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=generation)
        except (FileExistsError, FileNotFoundError):
            return False
        return True

    def generation(self) -> str | None:
        try:
            return str(self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)["generation"])
        except FileNotFoundError:
            return None

    def read(self, generation: str) -> dict:
        try:
            _, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media", generation=generation)
        except FileNotFoundError:
            return {}
        return _parse(data)


# ----------------------------------------------------------------------------- directories outside the workdir

# The workdir's entries a run writes into, and whether each is a directory (locked inside) or a file
# (locked in the directory that really holds it).
# (Not data/: a prepared corpus that several workdirs link to is read, and shared on purpose.)
WRITTEN = ((paths.Workdir.CHECKPOINTS, True), (paths.Workdir.TENSORBOARD, True), (paths.Workdir.PROFILE, True),
           (paths.Workdir.METRICS, False), (paths.Workdir.CONFIG, False))


def elsewhere(workdir: str) -> list[tuple[str, str]]:
    """(entry, real directory) for each directory a run in local `workdir` writes that is not the
    workdir itself: an entry that is a symlink, or a mount point (a volume, a bind mount). Two
    workdirs whose checkpoints/ lead to one directory would otherwise each hold its own lock and
    overwrite each other's steps; `WorkdirLock` also locks `<real directory>/lock.json` of each."""
    root = os.path.realpath(workdir)
    mounts = None
    out = {}
    for name, is_dir in WRITTEN:
        entry = os.path.join(workdir, name)
        if not os.path.lexists(entry):
            continue  # made later, inside the workdir: its lock covers it
        real = os.path.realpath(entry)
        directory = real if is_dir else os.path.dirname(real)
        if is_dir and not os.path.isdir(real):
            continue
        if directory == (os.path.join(root, name) if is_dir else root):
            if not is_dir:
                continue
            mounts = paths.mount_points() if mounts is None else mounts
            if real not in mounts:
                continue
        if directory != root:
            out.setdefault(directory, entry)
    return [(entry, real) for real, entry in sorted(out.items())]


# ----------------------------------------------------------------------------- the lock

_HELD: list[WorkdirLock] = []  # the locks this process holds, for `raise_if_lost()`


def raise_if_lost() -> None:
    """Raise `LockLost` if any lock this process holds has been lost (a long-running writer
    calls this between units of work: the training loop at every step)."""
    for lock in list(_HELD):
        lock.raise_if_lost()


class WorkdirLock:
    """`with WorkdirLock(workdir):` holds the workdir for this process (see the module docstring).
    A held lock raises ValueError naming its holder (exit 2: nothing was written)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = paths.Workdir(workdir).lock
        self.cloud = paths.is_cloud(self.path)
        self.lease_s = lease_seconds()
        self.held = False
        self.lost: str | None = None
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace(),
                     "started": time.time(), "argv": list(sys.argv), "token": uuid.uuid4().hex,
                     "workdir": workdir if self.cloud else os.path.abspath(workdir)}
        self._elsewhere: list[WorkdirLock] = []  # the locks of the run's directories outside the workdir
        self._fd: int | None = None
        self._store: _Bucket | None = None
        self._generation: str | None = None
        self._renewed_at = 0.0  # monotonic time at which the last successful renewal was sent
        self._error: Exception | None = None  # of the last renewal, if it failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it

    def acquire(self):
        jax = sys.modules.get("jax")  # a run has imported it; the lock itself needs no jax
        # One lock per multi-host run: process 0 holds it. (Asked only of a distributed run:
        # process_index() would start jax's backend, on an accelerator, in the sweep's process too.)
        if jax is not None and jax.distributed.is_initialized() and jax.process_index() != 0:
            return self
        paths.makedirs(self.workdir)
        if self.cloud:
            try:
                self._acquire_lease()
            except (ValueError, OSError):
                raise
            except Exception as err:  # gcsfs's HttpError (a 5xx, retries exhausted): an OSError like the rest
                raise OSError(errno.EIO, f"{type(err).__name__}: {err}") from None
        else:
            self._acquire_local()
            try:
                for entry, real in elsewhere(self.workdir):
                    sub = WorkdirLock(real)
                    sub.info["workdir"] = self.info["workdir"]  # who holds it, as another run's message names it
                    sub.reached_as = entry
                    sub._acquire_local()
                    self._elsewhere.append(sub)
            except BaseException:
                self._release_elsewhere()
                self._release_local()
                raise
        self.held = True
        _HELD.append(self)
        self._thread = threading.Thread(target=self._heartbeat, name=f"lock {self.path}", daemon=True)
        self._thread.start()
        return self

    reached_as: str | None = None  # a lock of a directory outside a workdir: the workdir's entry that leads there

    def _acquire_local(self):
        for _ in range(20):  # a new round only when the file was removed between open and lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    _set_lock(fd, True)
                except OSError as err:
                    if err.errno in (errno.EACCES, errno.EAGAIN):
                        where = self.workdir if self.reached_as is None else \
                            f"{self.reached_as} (really {self.workdir}, which another workdir's run also writes)"
                        raise _in_use(where, _read_fd(fd), f"holds {self.path}") from None
                    if err.errno == errno.ESTALE:  # NFS: removed by its holder meanwhile
                        os.close(fd)
                        continue
                    raise OSError(err.errno, f"cannot lock {self.path} ({err.strerror}); the workdir's file "
                                  "system must support fcntl locks (local disk, NFS with its lock manager)") from None
                if not _same_file(fd, self.path):  # released and removed after our open: take the new file
                    os.close(fd)
                    continue
                try:
                    data = json.dumps(self.info).encode()
                    os.ftruncate(fd, 0)
                    if os.pwrite(fd, data, 0) != len(data):
                        raise OSError(errno.ENOSPC, "short write (disk full?)")
                    os.fsync(fd)
                except OSError:
                    try:
                        os.unlink(self.path)  # ours (locked): leave nothing behind
                    except OSError:
                        pass
                    raise
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return
        raise ValueError(f"could not take the lock {self.path} (it keeps being removed); is another run "
                         "starting and stopping on this workdir?")

    def _lease_data(self) -> bytes:
        return json.dumps({**self.info, "lease_s": self.lease_s, "renewed": time.time()}).encode()

    def _acquire_lease(self):
        store = self._store = _Bucket(self.path)
        told = False
        for _ in range(5):  # a new round only when the lock changed hands while we watched
            sent = time.monotonic()
            gen = store.create(self._lease_data())
            if gen is not None:
                self._generation, self._renewed_at = gen, sent
                return
            seen = store.generation()
            if seen is None:
                continue  # released meanwhile
            info = store.read(seen)
            lease = info.get("lease_s")  # the holder's own; an older lock's or a garbled one's: ours
            if not (isinstance(lease, (int, float)) and math.isfinite(lease) and lease > 0):
                lease = self.lease_s
            if not told:
                print(f"{self.workdir} is locked by {holder_text(info)}; watching its lease for up to {lease:.0f} s "
                      "(a live holder renews it, a dead one's expires)", file=sys.stderr)
                told = True
            first_seen = time.monotonic()
            while True:
                time.sleep(min(1.0, lease / (3 * RENEWALS_PER_LEASE)))  # a metadata read: cheap
                now = store.generation()
                if now is None:
                    break  # released: try again to create it
                if now != seen:
                    raise _in_use(self.workdir, store.read(now) or info, f"keeps renewing its lease on {self.path}")
                if time.monotonic() - first_seen >= lease:
                    sent = time.monotonic()
                    gen = store.replace(self._lease_data(), seen)
                    if gen is None:
                        break  # another process took it first: watch that one
                    print(f"warning: took the lock on {self.workdir} from {holder_text(info)}: its lease was not "
                          f"renewed for {lease:.0f} s (that run was killed, or lost the store)", file=sys.stderr)
                    self._generation, self._renewed_at = gen, sent
                    return
        raise ValueError(f"could not take the lock {self.path} (it keeps changing hands); is another run "
                         "starting on this workdir?")

    # -- holding it

    def _heartbeat(self):
        """Renew the bucket lease; locally, notice lock.json removed or replaced by hand. Only proof
        that the lock changed hands ends it: a renewal that fails (the store unreachable) is retried
        at the next beat, and `raise_if_lost()` judges the time since the last one that succeeded."""
        period = self.lease_s / RENEWALS_PER_LEASE
        while not self._stop.wait(period):
            if not self.cloud:
                for lock in (self, *self._elsewhere):
                    try:
                        same = _same_file(lock._fd, lock.path)
                    except OSError:  # an NFS hiccup: look again at the next beat
                        continue
                    if not same:
                        self.lost = f"{lock.path} was removed or replaced while this run held it"
                        return
                continue
            sent = time.monotonic()
            try:
                gen = self._store.replace(self._lease_data(), self._generation)
                if gen is None:  # not ours any more, or an earlier renewal landed but its reply was lost
                    now = self._store.generation()
                    info = self._store.read(now) if now else {}
                    if info.get("token") != self.info["token"]:
                        self.lost = (f"its lease was taken over by {holder_text(info)}" if now else
                                     f"{self.path} was removed")
                        return
                    gen = self._store.replace(self._lease_data(), now)  # ours: renew that generation
                if gen is not None:
                    # No other process takes the lease before `sent` + lease: the write landed after
                    # `sent`, and an observer must then see it unchanged for a whole lease.
                    self._generation, self._renewed_at, self._error = gen, sent, None
            except Exception as err:  # noqa: BLE001 - the store unreachable: retried at the next beat
                self._error = err

    def raise_if_lost(self) -> None:
        """Raise `LockLost` if this lock has been lost, or (a bucket lease) not renewed for half
        its lease, the margin before any other process could take it (see the module docstring)."""
        if not self.held:
            return
        lost = self.lost
        since = time.monotonic() - self._renewed_at
        if lost is None and self.cloud and since > self.lease_s / 2:
            error = self._error
            lost = (f"its lease on {self.path} has not been renewed for {since:.3g} s of its {self.lease_s:g} s"
                    + (f" (last error: {type(error).__name__}: {error})" if error else " (the store does not answer)"))
        if lost is not None:
            raise LockLost(f"this run lost its lock on {self.workdir}: {lost}; stopped before writing more, as "
                           "another run may now hold the workdir. If none does, rerun the same command to resume "
                           "from the last checkpoint")

    # -- letting it go

    def release(self):
        if not self.held:
            return
        self.held = False
        _HELD.remove(self)
        self._stop.set()
        self._thread.join(timeout=60)  # a renewal in flight; a store that hangs longer: see below
        if self.cloud:
            if self.lost is None:
                try:
                    self._store.delete(self._generation)  # not if it changed hands meanwhile
                except Exception as err:  # noqa: BLE001 - it expires by itself
                    print(f"warning: could not remove the lock {self.path} ({err}); another run can take it "
                          f"once its lease of {self.lease_s:.0f} s has run out", file=sys.stderr)
            return
        self._release_elsewhere()
        self._release_local()

    def _release_elsewhere(self):
        while self._elsewhere:
            self._elsewhere.pop()._release_local()

    def _release_local(self):
        try:
            if _same_file(self._fd, self.path):
                os.unlink(self.path)  # while still locked: a process that opened it starts over
        except OSError:
            pass  # a read-only workdir now: the file stays, unlocked, and the next run takes it
        finally:
            try:
                _set_lock(self._fd, False)  # also for a forked child that shares the open file
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
