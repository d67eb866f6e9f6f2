"""Every file a run reads or writes, on local disk or in a bucket, through one place.

A workdir, a data dir, an eval output may be a local path or a cloud URL (`gs://bucket/run`,
`s3://...`). Both go through `etils.epath` (what Orbax uses for checkpoints), whose cloud
backend is fsspec (`gcsfs` for gs://: `pip install -e '.[gcs]'`). What each store guarantees:

* local disk / NFS: a file is written under a private temporary name, fsynced, then renamed over
  its target: a reader sees the old file or the new one, never half of one. (The workdir lock
  is train/lock.py's own: an fcntl lock locally, a lease in a bucket.)
* object stores (GCS, S3): a file is one object upload; an object appears whole or not at all and
  replaces the previous version in one step, so the same guarantee holds without a rename.
  Appending (metrics.jsonl, TensorBoard events): objects are immutable, so in GCS an append
  uploads only the new bytes as a temporary object and composes the file with it (server-side
  compose: one step, a reader sees the file before or after the append); in other stores the
  whole object is rewritten from this process's copy at each append.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

from etils import epath


def is_cloud(p) -> bool:
    """True for URLs such as gs://bucket/dir (file:// and plain paths are local)."""
    s = os.fspath(p)
    return "://" in s and not s.startswith("file://")


_FRESH = False


def fresh_listings() -> None:
    """Make gcsfs and s3fs (epath's `gs://` and `s3://` backends) list a bucket afresh each time
    in this process. By default they keep every directory listing for the life of the process
    and see only their own writes, so a checkpoint step, lock or shard written by another process
    (another host, a resumed run, or TensorStore inside this one) stays invisible to `exists()`
    and `iterdir()`. Our listings are few and small. A setting of the user's own (FSSPEC_GCS,
    FSSPEC_S3 or fsspec's config files) is kept. Every cloud path of this module calls it first
    (it also drops epath's cached filesystems, so a later call still takes effect)."""
    global _FRESH
    if _FRESH:
        return
    import fsspec.config

    changed = False
    for protocol in ("gcs", "s3"):
        conf = fsspec.config.conf.setdefault(protocol, {})
        if "use_listings_cache" not in conf:
            conf["use_listings_cache"], changed = False, True
    if changed:
        from etils.epath import backend

        backend.fsspec_backend._get_filesystem.cache_clear()
    _FRESH = True


def path(p) -> epath.Path:
    """An epath.Path; for a URL, with fresh listings (`fresh_listings`)."""
    if is_cloud(p):
        fresh_listings()
    return epath.Path(p)


def join(p, *parts) -> str:
    """`os.path.join` that keeps a URL's scheme (`gs://b/run` + `eval` -> `gs://b/run/eval`)."""
    return os.fspath(epath.Path(p).joinpath(*parts))


def absolute(p) -> str:
    """A local path made absolute; a URL as given."""
    return os.fspath(p) if is_cloud(p) else os.path.abspath(p)


def exists(p) -> bool:
    return path(p).exists()


def isdir(p) -> bool:
    return path(p).is_dir()


def isfile(p) -> bool:
    return path(p).is_file()


def makedirs(p) -> None:
    path(p).mkdir(parents=True, exist_ok=True)


def read_text(p) -> str:
    return path(p).read_text()


def read_bytes(p) -> bytes:
    return path(p).read_bytes()


def glob(p, pattern: str) -> list[str]:
    d = path(p)
    return sorted(os.fspath(x) for x in d.glob(pattern)) if d.is_dir() else []


def remove(p) -> None:
    """Delete a file; a missing one is not an error."""
    try:
        path(p).unlink()
    except FileNotFoundError:
        pass


def mount_points() -> set[str]:
    """Every mount point of this process's mount namespace (Linux's /proc/self/mountinfo), bind
    mounts included, which `os.path.ismount` cannot see (a bind mount of a folder on the same file
    system has the same device as its parent). Empty where there is no /proc."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
    return {unescape(ln.split()[4]) for ln in lines if len(ln.split()) > 4}


def is_mount_point(p) -> bool:
    """True when the local directory `p` is a mount point (a volume or a bind mount): a file system
    boundary that nothing can be renamed onto or across."""
    if is_cloud(p) or not os.path.isdir(p):
        return False
    return os.path.ismount(p) or os.path.realpath(p) in mount_points()


def check_rename_target(out, flag: str, example: str) -> None:
    """Before any work: a command that builds its output beside `out` and renames it into place
    (staging.py) cannot do so onto a mount point (an empty volume, a bind mount of a folder): the
    rename fails with EBUSY or EXDEV after all the work. ValueError naming a folder inside it."""
    if is_mount_point(out):
        raise ValueError(f"{flag}={out} is a mount point (a volume or a bind mount): the output is built beside its "
                         f"target and renamed into place, which a mount point cannot take; give a folder inside "
                         f"it, e.g. {flag}={os.path.join(os.fspath(out), example)}")


def _fs(p):
    import fsspec

    fresh_listings()
    return fsspec.core.url_to_fs(os.fspath(p))


def write_atomic(p, data: str | bytes) -> None:
    """Replace `p` with `data` in one step (see the module docstring for what each store does)."""
    data = data.encode() if isinstance(data, str) else data
    if is_cloud(p):
        fs, key = _fs(p)
        fs.pipe_file(key, data)
        return
    directory = os.path.dirname(os.path.abspath(p))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)}.tmp-", dir=directory)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from the run's readers
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def upload(local_file, p) -> None:
    """Copy a local file to `p` whole: a cloud upload is finalised (made visible) only at its end."""
    if is_cloud(p):
        fs, key = _fs(p)
        fs.put_file(os.fspath(local_file), key)
        return
    import shutil

    directory = os.path.dirname(os.path.abspath(p))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{p}.tmp-{os.getpid()}"
    try:
        shutil.copyfile(local_file, tmp)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(p, obj) -> None:
    write_atomic(p, json.dumps(obj, indent=2))


def _composes(fs) -> bool:
    """Whether `fs` concatenates objects server-side (GCS's compose), so that an append need not
    upload the whole file again."""
    # By name: a test's fresh import of gcsfs makes a class isinstance() would not recognise.
    return any(c.__name__ == "GCSFileSystem" and c.__module__.startswith("gcsfs") for c in type(fs).__mro__)


class Appender:
    """Append-only text file (metrics.jsonl): one append per call, never a torn line.

    Locally each `append` is one `write` on an O_APPEND descriptor and a failed write is cut back
    to the previous length. In GCS an append uploads the new bytes alone and composes the object
    with them (the bytes appended are all that travel; a failed append leaves the object as it
    was); in another store the object is rewritten whole from this process's copy (read once at
    open). Either way a reader sees the file as of the last complete append. (One writer: the
    run's process 0, holding the workdir's lock.)"""

    def __init__(self, p):
        self.path = os.fspath(p)
        self.cloud = is_cloud(p)
        self.compose = False
        if self.cloud:
            self.fs, self.key = _fs(p)
            self.compose = _composes(self.fs)
            if self.compose:
                try:
                    self._size = int(self.fs.info(self.key)["size"])
                except FileNotFoundError:
                    self._size = 0
                return
            try:
                self.data = bytearray(read_bytes(p))
            except FileNotFoundError:
                self.data = bytearray()
        else:
            os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
            self.fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)  # (read: `_reattach`)

    def size(self) -> int:
        if self.compose:
            return self._size
        return len(self.data) if self.cloud else os.fstat(self.fd).st_size

    def tail(self, n: int) -> bytes:
        if self.compose:
            return self.fs.cat_file(self.key, start=max(0, self._size - n), end=self._size) if self._size else b""
        if self.cloud:
            return bytes(self.data[-n:])
        size = self.size()
        with open(self.path, "rb") as f:
            f.seek(max(0, size - n))
            return f.read()

    def truncate(self, size: int) -> None:
        if self.compose:  # rare (a torn line cut at resume): the kept part rewritten whole
            write_atomic(self.path, self.fs.cat_file(self.key, start=0, end=size) if size else b"")
            self._size = size
        elif self.cloud:
            del self.data[size:]
            write_atomic(self.path, bytes(self.data))
        else:
            os.ftruncate(self.fd, size)

    def append(self, data: bytes) -> None:
        if self.compose:
            if self._size == 0:
                self.fs.pipe_file(self.key, data)
            else:
                # A hidden name next to the file: no glob of the file's own pattern sees it.
                head, _, name = self.key.rpartition("/")
                part = f"{head}/.{name}.append-{os.getpid()}"
                try:
                    self.fs.pipe_file(part, data)
                    self.fs.merge(self.key, [self.key, part])
                except OSError:
                    raise
                except Exception as err:  # gcsfs's HttpError: an OSError, as the callers' error line expects
                    raise OSError(f"appending to {self.path} failed ({err})") from err
                finally:
                    try:
                        self.fs.rm_file(part)
                    except OSError:
                        pass  # a leftover part is harmless: never read, replaced by the next append
            self._size += len(data)
            return
        if self.cloud:
            write_atomic(self.path, bytes(self.data) + data)  # raises before the copy changes
            self.data += data
            return
        import errno

        self._reattach()
        size = self.size()
        try:
            if os.write(self.fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write (disk full?)")
        except OSError:
            try:
                os.ftruncate(self.fd, size)
            except OSError:
                pass
            raise

    def _reattach(self) -> None:
        """Locally, before each append: if the path no longer names the file this process writes
        (deleted by a clean-up script, moved away by log rotation, replaced), recreate it from that
        file's own bytes (still readable through the open descriptor), so no line is lost; a
        non-empty file found in its place is moved aside, not overwritten. One warning line says so."""
        import sys
        import time

        mine = os.fstat(self.fd)
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return
        record = os.pread(self.fd, mine.st_size, 0)
        aside = None
        if st is not None and st.st_size > 0:
            aside = f"{self.path}.found-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.path, aside)
        write_atomic(self.path, record)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        os.close(self.fd)
        self.fd = fd
        found = "deleted" if st is None else "replaced"
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):  # on a line of its own, not after a progress bar
            print(f"warning: {self.path} was {found} while this run wrote it; recreated it from the run's own record "
                  f"({len(record):,} bytes) and went on" + (f"; the file found in its place is now {aside}" if aside else ""),
                  file=sys.stderr)

    def close(self) -> None:
        if not self.cloud:
            os.close(self.fd)


class Workdir:
    """Every file of a run's directory (`--workdir`), named here once; a local path or a URL
    alike (`join`). Who writes each:

        config.json          the run's config, at each start (train/loop.py; import_hf.py)
        checkpoints/         Orbax's steps, `checkpoints/corrupt/` set aside (checkpoint.py)
        metrics.jsonl        one JSON object per logged step (train/metrics.py `MetricsLog`)
        tensorboard/         the same scalars as TensorBoard event files
        profile/             `jax.profiler` traces (train.profile_start)
        data/                the bundled corpus, prepared here when data.dir is empty
        data_verified.json   the data's identity and its verified shards (data/storage.py)
        lock.json            the one-writer lock (train/lock.py)
        wandb_id, wandb/     the W&B run's id and W&B's local files (train/wandb_log.py)
        eval/step_N.json     eval.py's results
        analysis/            the gate analysis's report (analysis/gate.py)
        logs/                a sweep's logs of the run's commands (experiments/sweep.py)
        tokenizer/           an imported folder's tokenizer files, its data.tokenizer (train/import_hf.py)
    """

    CONFIG = "config.json"
    CHECKPOINTS = "checkpoints"
    METRICS = "metrics.jsonl"
    TENSORBOARD = "tensorboard"
    PROFILE = "profile"
    DATA = "data"
    DATA_RECORD = "data_verified.json"
    LOCK = "lock.json"
    WANDB_ID = "wandb_id"
    WANDB = "wandb"
    EVAL = "eval"
    ANALYSIS = "analysis"
    LOGS = "logs"
    TOKENIZER = "tokenizer"

    def __init__(self, root):
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"Workdir({self.root!r})"

    def entry(self, name: str) -> str:
        """`root/name` (a file or directory directly under the workdir)."""
        return join(self.root, name)

    config = property(lambda self: self.entry(self.CONFIG))
    checkpoints = property(lambda self: self.entry(self.CHECKPOINTS))
    metrics = property(lambda self: self.entry(self.METRICS))
    tensorboard = property(lambda self: self.entry(self.TENSORBOARD))
    profile = property(lambda self: self.entry(self.PROFILE))
    data = property(lambda self: self.entry(self.DATA))
    data_record = property(lambda self: self.entry(self.DATA_RECORD))
    lock = property(lambda self: self.entry(self.LOCK))
    wandb_id = property(lambda self: self.entry(self.WANDB_ID))
    eval = property(lambda self: self.entry(self.EVAL))
    analysis = property(lambda self: self.entry(self.ANALYSIS))
    logs = property(lambda self: self.entry(self.LOGS))
    tokenizer = property(lambda self: self.entry(self.TOKENIZER))

    def data_dir(self, configured: str = "") -> str:
        """The run's data: data.dir when given, else the bundled corpus prepared into `data/`."""
        return configured or self.data

    def eval_result(self, step: int) -> str:
        """eval.py's result for checkpoint step `step`."""
        return join(self.eval, f"step_{int(step)}.json")

    def eval_results(self) -> dict[int, str]:
        """Every eval.py result in `eval/`, by step."""
        import re

        found = {}
        for p in glob(self.eval, "step_*.json"):
            m = re.fullmatch(r"step_(\d+)\.json", path(p).name)
            if m:
                found[int(m.group(1))] = p
        return found


class Sweepdir:
    """The files of a sweep's directory (experiments/sweep.py writes them, report.py reads them):
    `grid.json`, `sweep_status.json`, each arm × seed's run in `ARM/seedN/` (a `Workdir`), and
    the report (`report.json`, `report.md`, `report.png`); the sweep's lock is a `Workdir`'s
    (`lock.json`, train/lock.py)."""

    GRID, STATUS = "grid.json", "sweep_status.json"

    def __init__(self, root):
        self.root = os.fspath(root)

    grid = property(lambda self: join(self.root, self.GRID))
    status = property(lambda self: join(self.root, self.STATUS))

    def run(self, arm: str, seed: int) -> Workdir:
        return Workdir(join(self.root, arm, f"seed{seed}"))

    def report(self, suffix: str) -> str:
        """`report.json`, `report.md` or `report.png` (`suffix` "json", "md", "png")."""
        return join(self.root, f"report.{suffix}")
