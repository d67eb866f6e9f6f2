"""The training loop: resume, step, log, validate, checkpoint, and stop cleanly on
pre-emption or a non-finite loss.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import chips, cli, compile_cache, paths, summary
from onona_jax.checkpoint import Checkpoints
from onona_jax.data import storage
from onona_jax.eval.validation import Evaluator, variants
from onona_jax.train import downstream
from onona_jax.train.lock import LockLost, WorkdirLock, check as check_lock
from onona_jax.train.state import abstract_train_state, init_state, setup
from onona_jax.train.step import global_batch, make_train_step
from onona_jax.train.upcycling import upcycle

def peak_tflops(cfg) -> float | None:
    """Peak dense bf16 TFLOP/s per device, for model FLOPs utilisation: train.peak_tflops, else
    the chip's (`chips.CHIPS`); None on a CPU."""
    if cfg.train.peak_tflops > 0:
        return float(cfg.train.peak_tflops)
    chip = chips.by_device_kind(jax.devices()[0].device_kind)
    return chip.peak_tflops if chip else None


# ----------------------------------------------------------------------------- the loop


class NonFiniteLoss(cli.Failure):
    """A non-finite loss or state: the run stops, the last good checkpoint untouched."""


# The clock of train.checkpoint_minutes (a module attribute, so a test can run a run on a clock
# of its own: tests/multihost_driver.py).
timer_clock = time.monotonic


class SaveTimer:
    """train.checkpoint_minutes: whether a timer save is due, asked at logged steps only. Process
    0's clock decides and every process gets its answer (one broadcast of a scalar per logged
    step, beside that step's metrics transfer), so all of them save the same steps: a save is a
    collective. Restarted by every save, timer or scheduled."""

    def __init__(self, minutes: float):
        self.seconds = 60.0 * minutes
        self.restart()

    def restart(self):
        self.last = timer_clock()

    def due(self) -> bool:
        if not self.seconds:
            return False
        due = timer_clock() - self.last >= self.seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due


class Preemption:
    """SIGTERM, or the first SIGINT (Ctrl-C: `cli.graceful_stop`), sets a flag; the loop saves a
    checkpoint after the step in flight (or lets the save of that step already in flight finish)
    and exits; `interrupted`: it was SIGINT (exit 130). Several hosts agree on the step through
    jax's preemption sync point, which hears SIGTERM: a SIGINT is passed on to it as one."""

    def __init__(self):
        self.requested = self.interrupted = False
        self._previous = self._stop = None

    def __enter__(self):
        if jax.process_count() == 1:  # several hosts agree through jax's preemption sync point
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._stop = cli.graceful_stop(self._on_sigint)
        self._stop.__enter__()
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def _on_sigint(self):
        self.interrupted = True
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption notifier
        else:
            self.requested = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        self._stop.__exit__(*exc)
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def tensorboard_records(step: int, metrics: dict, wall_time: float, first: bool = False) -> bytes:
    """One logged step's scalars as TensorBoard event-file records (TFRecord framing: length,
    its CRC, the `Event` proto, its CRC), one event per scalar as tensorboardX's add_scalar
    writes them; `first`: the file's version record before them."""
    import struct

    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c
    from tensorboardX.summary import scalar

    events = [event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2")] if first else []
    events += [event_pb2.Event(wall_time=wall_time, step=step, summary=scalar(k, v)) for k, v in metrics.items()]
    out = bytearray()
    for event in events:
        data = event.SerializeToString()
        head = struct.pack("Q", len(data))
        out += head + struct.pack("I", masked_crc32c(head)) + data + struct.pack("I", masked_crc32c(data))
    return bytes(out)


class MetricsLog:
    """metrics.jsonl (one JSON object per logged step) and TensorBoard events, from process 0 only,
    and every logged step fanned out to the other loggers the config asks for (`self.others`:
    Weights & Biases with train.wandb_project, `wandb_log.WandbLog`).

    Both are written alike, on the calling thread: one append per logged step (`paths.Appender`:
    no torn line or record, locally or in a bucket), and a failed append (a full disk) stops the
    run with one error line. (tensorboardX's SummaryWriter writes from a thread of its own: on a
    full disk that thread died with a traceback, and its close() raised over the run's own error.)
    The events file is made at the first logged step, so a start refused before it leaves none.
    A torn last line of metrics.jsonl left by an older version or a crash is removed when a run
    resumes, and the restart is marked by a line `{"step": S, "restart": true}`."""

    def __init__(self, workdir: str, cfg=None):
        import socket

        self.primary = jax.process_index() == 0
        wd = paths.Workdir(workdir)
        self.path = wd.metrics
        self.tb_path = paths.join(wd.tensorboard, f"events.out.tfevents.{int(time.time())}."
                                                  f"{socket.gethostname()}.{os.getpid()}")
        self.file = self.tb = None
        self.others = []  # each with write(step, metrics) and close() (never raising)
        if self.primary:
            try:
                self.file = paths.Appender(self.path)
                self.resumed = self._repair()
            except OSError as err:
                raise cli.Failure(f"cannot write {self.path} ({err.strerror or err}); make the workdir "
                                  "writable (or free space), then rerun the same command") from None
            # tensorboardX's first import takes seconds (it imports torch where installed): paid
            # here, at start-up, not inside the second logged interval's tokens/s.
            import tensorboardX.summary  # noqa: F401
            if cfg is not None and cfg.train.wandb_project:
                from onona_jax.train.wandb_log import WandbLog

                try:
                    self.others.append(WandbLog(cfg, workdir))
                except BaseException:
                    self.close()  # (no caller holds this log yet to close it)
                    raise

    def _repair(self) -> bool:
        """Cut a torn last line (no newline); True when the file already held lines."""
        size = self.file.size()
        if size == 0:
            return False
        tail = self.file.tail(65536)
        if tail.endswith(b"\n"):
            return True
        keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        self.file.truncate(keep)
        print(f"warning: {self.path} ended in a torn line ({size - keep} bytes of a write cut short); "
              "removed it", file=sys.stderr)
        return keep > 0

    def _append(self, data: bytes, tensorboard: bool = False):
        path = self.tb_path if tensorboard else self.path
        try:
            if tensorboard and self.tb is None:
                self.tb = paths.Appender(self.tb_path)
            (self.tb if tensorboard else self.file).append(data)
        except OSError as err:
            raise cli.Failure(
                f"could not write {path} ({err.strerror or err}); stopping. Free space on that "
                f"filesystem (or make it writable), then rerun the same command to resume from the last checkpoint"
            ) from None

    def restart(self, step: int):
        if self.primary and self.resumed:
            self._append((json.dumps({"step": step, "restart": True, "time": time.time()}) + "\n").encode())

    def note(self, step: int, **fields):
        """A line of metrics.jsonl alone (not a scalar: TensorBoard and W&B get none), e.g. a mixture change."""
        if self.primary:
            self._append((json.dumps({"step": step, **fields, "time": time.time()}) + "\n").encode())

    def write(self, step: int, metrics: dict):
        if not self.primary:
            return
        self._append((json.dumps({"step": step, **metrics}) + "\n").encode())
        self._append(tensorboard_records(step, metrics, time.time(), first=self.tb is None), tensorboard=True)
        for other in self.others:
            other.write(step, metrics)

    def close(self):
        """Never raises: every logged step is already written whole."""
        for f in (self.file, self.tb):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self.file = self.tb = None
        for other in self.others:
            other.close()
        self.others = []


class Profiler:
    """A `jax.profiler` trace of steps train.profile_start .. + train.profile_steps - 1 into
    <workdir>/profile/ (plugins/profile/<run>/<host>.xplane.pb, what TensorBoard's profile plugin
    and Perfetto read), on process 0 or, with train.profile_all_hosts, on every process. A bucket
    workdir is traced into a local temporary directory and uploaded when the trace stops (the
    profiler writes through its own file layer, not through `paths`). A start that resumes inside
    the range traces the rest of it; one that resumes after it traces nothing."""

    def __init__(self, cfg, workdir: str):
        t = cfg.train
        self.first, self.last = t.profile_start, t.profile_start + t.profile_steps - 1
        self.on = t.profile_start > 0 and (t.profile_all_hosts or jax.process_index() == 0)
        self.directory = paths.Workdir(workdir).profile
        self.local = None
        self.tracing = self.done = False

    def check(self):
        """Before the first step: an unwritable profile directory is one error line, not a lost trace."""
        if self.on:
            check_writable(self.directory)

    def before(self, step: int):
        if self.on and not self.tracing and not self.done and self.first <= step <= self.last:
            self.local = (tempfile.mkdtemp(prefix="onona-profile-") if paths.is_cloud(self.directory)
                          else self.directory)
            jax.profiler.start_trace(self.local)
            self.tracing = True

    def after(self, step: int, state, last: bool) -> float:
        """Stop after the range's last step (or the run's); the seconds spent writing the trace."""
        if not self.tracing or (step < self.last and not last):
            return 0.0
        jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
        began = time.perf_counter()
        self.stop()
        print(f"wrote a profile of steps {self.first}-{min(step, self.last)} to {self.directory}", file=sys.stderr)
        return time.perf_counter() - began

    def stop(self):
        if not self.tracing:
            return
        self.tracing, self.done = False, True
        jax.profiler.stop_trace()
        if self.local != self.directory:
            try:
                for root, _, files in os.walk(self.local):
                    for name in files:
                        rel = os.path.relpath(os.path.join(root, name), self.local)
                        paths.upload(os.path.join(root, name), paths.join(self.directory, rel))
            except OSError as err:
                raise cli.Failure(f"could not write the profile to {self.directory} ({err.strerror or err}); "
                                  "make it writable, then rerun the same command") from None
            finally:
                shutil.rmtree(self.local, ignore_errors=True)


def check_writable(directory: str):
    """Create `directory` and a file in it, now: a read-only or full disk is found before the
    first step, not inside an asynchronous checkpoint write."""
    try:
        cli.probe_writable(directory)
    except OSError as err:
        raise cli.Failure(f"cannot write to {directory} ({err.strerror or err}); make it writable "
                          "(or free space), then rerun the same command") from None


def check_resume(cfg, run, workdir: str, data=None):
    """A rerun on a workdir with checkpoints must be the same run: every key outside
    config.RESUMABLE_KEYS as saved with the newest checkpoint, the same data (wherever it now
    lies: `check_same_data`; `data`: the requested data as `train` opened it) and, if
    train.steps changed, the same learning rate for every step already taken
    (`check_schedule`). Read-only; before any write."""
    from onona_jax import config as config_lib

    directory = paths.Workdir(workdir).checkpoints
    if not paths.isdir(directory):
        return
    newest = Checkpoints(directory, read_only=True).newest_config()
    if newest is None:
        return
    step, saved = newest
    saved = config_lib.from_saved(saved, f"{directory}/{step}")
    conflicts = config_lib.resume_conflicts(saved, cfg)
    if conflicts:
        listed = "; ".join(f"{k}: {a!r} → {b!r}" for k, a, b in conflicts)
        raise ValueError(
            f"{workdir} holds a run whose checkpoint (step {step}) has a different config (saved → "
            f"requested): {listed}. These keys change the parameters, optimizer state or data, so "
            f"this would be a different run. Either drop those overrides to resume that run, or "
            f"train the new one in a new --workdir (keys that may change on resume: "
            f"onona_jax/config.py RESUMABLE_KEYS)"
        )
    check_same_data(saved, cfg, workdir, data)
    if run.steps < step:
        raise ValueError(f"train.steps resolves to {run.steps}, below the checkpoint's step {step} in "
                         f"{directory}; give train.steps >= {step} (or use a new --workdir)")
    check_schedule(saved, run, step, workdir)


def check_schedule(saved, run, step: int, workdir: str):
    """A changed step budget moves the WSD decay; it may change on resume only while that
    leaves the learning rate of every step already taken (optimizer steps 0..step-1) as it
    was, i.e. while the decay has begun under neither budget. The schedules themselves are
    compared (`optimizer.first_changed_step`), so this rule follows `optimizer.wsd`."""
    from onona_jax.train import optimizer
    from onona_jax import summary

    planned = summary.budget(saved)["steps"]  # train.steps=0 or another budget: derived
    if planned == run.steps:
        return
    before = optimizer.schedule(saved, planned)
    changed = optimizer.first_changed_step(before, run.schedule, step)
    if changed is None:
        return
    was, now = float(before(changed)), float(run.schedule(changed))
    keep = saved.train.steps or f"0 (derived: {planned})"
    raise ValueError(
        f"train.steps resolves to {run.steps} but the run in {workdir} was planned for {planned} steps and "
        f"has taken {step}; under the WSD schedule that changes the learning rate of a step already taken "
        f"(step {changed + 1}: {was:.4g} → {now:.4g}): under one of the two budgets the decay (over the last "
        f"train.decay_fraction of the steps) begins by step {step}. Either keep train.steps={keep} to finish "
        f"the run as planned, or train the "
        f"{'longer' if run.steps > planned else 'shorter'} run in a new --workdir (train.steps may change on "
        "resume only before the decay begins)"
    )


def _sources(c, wd) -> dict:
    """{name: data dir} of a config's data: data.mixture's named sources, else {"": data.dir}
    (the bundled corpus in the workdir when data.dir is "")."""
    from onona_jax.data import mixture

    return {e.name: e.data_dir for e in mixture.parse(c.data.get("mixture", ""))} or {"": wd.data_dir(c.data.dir)}


def check_same_data(saved, cfg, workdir: str, data=None):
    """data.dir, data.cache_dir and a mixture's dirs and weights may change on resume (the data
    moved, its local copy did, or the mixture is reweighted) when the data is the same: the
    same sources (a mixture's by name), and the identity of each requested data dir
    (storage.data_identity: its manifest's shard list; the opened source's when `train` has
    opened `data`) equal to the one recorded when the run last started
    (WORKDIR/data_verified.json), or else the saved data dir's. Read-only."""
    wd = paths.Workdir(workdir)
    was, now = _sources(saved, wd), _sources(cfg, wd)
    if sorted(was) != sorted(now):
        def told(sources):
            return f"data.dir {sources['']}" if "" in sources else f"the data.mixture sources {', '.join(sources)}"

        keep = (f"--config.data.mixture={saved.data.mixture} (its weights may change)" if "" not in was
                else f"--config.data.dir={saved.data.dir!r} --config.data.mixture=''")
        raise ValueError(
            f"{workdir} holds a run trained on {told(was)}, but this run asks for {told(now)}: a run's sources may "
            f"not change on resume (a mixture's weights may). Resume that run with {keep}, or train on the new "
            "sources in a new --workdir")
    opened = {s.name: s.identity for s in data.sources} if data is not None else {}
    for name, saved_dir in was.items():
        requested_dir = now[name]
        what = f"data.mixture source {name!r} ({saved_dir})" if name else saved_dir
        keep = f"data.mixture source {name}:{saved_dir}" if name else f"data.dir={saved.data.dir!r}"
        recorded = storage.recorded_identity(workdir, name)
        if recorded is None:  # a workdir of an older version: the saved data dir's manifest, if it is there
            try:
                recorded = storage.data_identity(saved_dir)
            except (ValueError, OSError):
                pass
        requested = opened.get(name)
        if requested is None:
            try:
                requested = storage.data_identity(requested_dir)
            except (ValueError, OSError):
                pass  # the bundled corpus not prepared yet (train() opened a given data.dir)
        if recorded is None or requested is None:
            if saved_dir == requested_dir:  # nothing to compare with, and the same data dir
                continue
            why = (f"no {wd.data_record} and no readable manifest in {saved_dir}"
                   if recorded is None else f"no readable manifest in {requested_dir}")
            raise ValueError(
                f"{workdir} holds a run trained on {what}; cannot tell whether {requested_dir} holds the same "
                f"data ({why}). Resume that run with its data ({keep}), or train on {requested_dir} in a new "
                "--workdir")
        if requested != recorded:
            raise ValueError(
                f"{workdir} holds a run trained on {what}, but {requested_dir} holds other data (its manifest "
                f"lists other shards: identity {requested[:12]}, the run's {recorded[:12]}). Resume that run with "
                f"its data ({keep}, or wherever that data now lies), or train on {requested_dir} in a new --workdir")


def save_failure(ckpts, err) -> cli.Failure:
    """The error line of a failed save: the step whose save failed (`Checkpoints.saved`), the
    directory, the cause, and the last step that is whole."""
    from onona_jax.checkpoint import short_error

    what = f"a checkpoint (step {ckpts.saved})" if ckpts.saved is not None else "a checkpoint"
    reason = short_error(err)
    code = re.search(r"os_error_code='(\d+)'", str(err))  # TensorStore's: the OS's reason first, before its paths
    if code:
        reason = f"{os.strerror(int(code.group(1)))}; {reason}"
    # Listed afresh: Orbax drops the steps a save will rotate away from its list when the save
    # starts, though they stay until it is complete (a timer save just before, say).
    listed = sorted(int(p.name) for p in ckpts.directory.iterdir() if p.name.isdigit())
    good = [s for s in listed if paths.exists(paths.join(ckpts.directory, str(s), "commit_success.txt"))]
    return cli.Failure(
        f"could not write {what} to {ckpts.directory} ({reason}); stopping. The last good "
        f"checkpoint (step {good[-1] if good else 'none'}) is intact; free space or fix the directory's "
        "permissions, then rerun the same command to resume"
    )


# What a start creates directly under the workdir (`_run`, before its first step; the lock's files
# are the lock's), removed again when that start is refused (`_remove_new`).
STARTUP_ENTRIES = (paths.Workdir.CHECKPOINTS, paths.Workdir.CONFIG, paths.Workdir.DATA, paths.Workdir.DATA_RECORD,
                   paths.Workdir.METRICS, paths.Workdir.PROFILE, paths.Workdir.TENSORBOARD, paths.Workdir.WANDB,
                   paths.Workdir.WANDB_ID)


def _entries(workdir: str) -> set[str] | None:
    """Which of STARTUP_ENTRIES exist under `workdir` (process 0; None elsewhere)."""
    if jax.process_index() != 0:
        return None
    return {name for name in STARTUP_ENTRIES if paths.exists(paths.Workdir(workdir).entry(name))}


def _remove_new(workdir: str, before: set[str] | None):
    """After a start that failed before its first step: remove the STARTUP_ENTRIES it created
    (an empty checkpoints/, config.json, metrics.jsonl, a prepared data/, ...), so a refused
    start leaves the workdir as it found it. The run holds the workdir's lock: they are its own."""
    if before is None:
        return
    for name in set(STARTUP_ENTRIES) - before:
        entry = paths.path(paths.Workdir(workdir).entry(name))
        try:
            if entry.is_dir():
                entry.rmtree()
            elif entry.exists():
                entry.unlink()
        except Exception:  # noqa: BLE001 - already failing: that error is the one reported
            pass


def config_edits(path: str, checkpoints: str) -> str:
    """The keys in which an existing config.json differs from the config saved with the newest
    checkpoint, which the run that wrote the file also saved: a hand edit ("" when none, or no
    file or checkpoint to compare)."""
    if not paths.exists(path) or not paths.isdir(checkpoints):
        return ""
    newest = Checkpoints(checkpoints, read_only=True).newest_config()
    if newest is None:
        return ""
    from onona_jax.config import flatten

    try:
        written = json.loads(paths.read_text(path))
    except (OSError, ValueError):
        return "it no longer reads as JSON"
    old, new = flatten(newest[1]), flatten(written if isinstance(written, dict) else {})
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    listed = ", ".join(f"{k}: {old.get(k, '-')!r} → {new.get(k, '-')!r}" for k in keys[:5])
    return listed + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def open_data(cfg, data_dir: str = ""):
    """The run's data opened and checked once (`pipeline.RunData`): data.mixture's sources, else
    `data_dir`; made by data.tokenizer, the train splits, ids below model.vocab_size too, and
    the validation windows."""
    from onona_jax.data import mixture, pipeline

    return pipeline.open_for_training(mixture.parse(cfg.data.mixture) or data_dir, cfg.data.seq_len,
                                      cfg.eval.windows, cfg.eval.seed,
                                      model_vocab=cfg.model.vocab_size, cache_dir=cfg.data.cache_dir or None,
                                      bucket_read=cfg.data.bucket_read, tokenizer=cfg.data)


def prepare_data(cfg, workdir: str, data=None):
    """The run's data (`pipeline.RunData`): `data` (cfg.data.dir, as `train` opened it), or the
    bundled corpus prepared once into the workdir (with data.tokenizer), then opened."""
    from onona_jax.data import pipeline

    if data is not None:
        return data
    data_dir = paths.Workdir(workdir).data
    if jax.process_index() == 0:
        pipeline.prepare_bundled(data_dir, tokenizer=cfg.data)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bundled data prepared")
    return open_data(cfg, data_dir)


def take_lock(workdir: str) -> WorkdirLock:
    """Process 0 takes the workdir's lock, and no process goes on before every process knows it
    did: one racing ahead would create checkpoints/ while process 0 still checks the run, and
    the processes would then disagree on what to restore (Orbax's collectives hang or fail)."""
    failure = None
    try:
        lock = WorkdirLock(workdir).acquire()
    except ValueError as err:  # held by another run
        failure = err
    except OSError as err:
        failure = cli.Failure(f"cannot write to {workdir} ({err.strerror or err}); make it writable "
                              "or choose another --workdir")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        took = multihost_utils.broadcast_one_to_all(np.int32(failure is None))
        if failure is None and not took:
            failure = cli.Failure(f"process 0 could not take the lock of {workdir}; its error line says why")
    if failure is not None:
        raise failure from None
    return lock


def train(cfg, workdir: str, devices=None, progress: bool = True) -> dict:
    """Train (or resume) in `workdir`; returns the final evaluation. Holds the workdir's lock
    (`lock.json`) from its first write to its return, whatever ends the run."""
    run = setup(cfg, devices)  # every config check, before any write
    task_files = downstream.resolve(cfg)  # train.tasks: names and files, likewise (every host reads its own)
    if cfg.train.profile_start > run.steps:
        raise ValueError(f"train.profile_start={cfg.train.profile_start} lies after the run's last step {run.steps}; "
                         f"give a step in 1..{run.steps} (or 0: no trace)")
    # Before anything compiles; an unwritable cache is an error line here, before the workdir is touched.
    compile_cache.use(cfg.train.compile_cache, cfg.train.compile_cache_min_s)
    # User data is opened and checked here, once, before anything is written; the run reads it as
    # opened (a bucket's shards copied into data.cache_dir, data/storage.py). The bundled corpus
    # is prepared into the workdir, so after the lock is taken (`prepare_data`).
    data = open_data(cfg, cfg.data.dir) if cfg.data.dir or cfg.data.mixture else None
    if cfg.init_from and not paths.isdir(paths.Workdir(cfg.init_from).checkpoints):
        raise ValueError(f"init_from={cfg.init_from!r} has no checkpoints/; give a standard run's workdir")
    check_resume(cfg, run, workdir, data)  # the same run, or exit 2 before any write
    fresh = not paths.is_cloud(workdir) and not os.path.exists(workdir)
    # From the lock on, a first SIGINT (Ctrl-C) stops at the next safe point of the start-up (`_run`),
    # never inside a write: the workdir is left as a refused start leaves it.
    try:
        with cli.graceful_stop() as startup:
            lock = take_lock(workdir)
            try:
                check_resume(cfg, run, workdir, data)  # again, now that no other run can write meanwhile
                if jax.process_count() > 1:  # every process has read the workdir before any writes to it
                    from jax.experimental import multihost_utils

                    multihost_utils.sync_global_devices("resume checked")
                return _train(cfg, run, workdir, progress, data, startup, task_files)
            finally:
                lock.release()
    finally:
        if fresh:  # a start refused before its first step leaves no empty workdir either
            try:
                os.rmdir(workdir)  # (only if empty)
            except OSError:
                pass


def _train(cfg, run, workdir: str, progress: bool, data=None, startup=None, task_files=None) -> dict:
    before = _entries(workdir)
    held = {}  # what `_run` opened: "ckpts", "log", "bar", "profiler"; "stepping" once start-up is done
    failed = True
    try:
        result = _run(cfg, run, workdir, progress, held, data, startup or cli.GracefulStop(), task_files)
        failed = False
        return result
    finally:
        for part in ("bar", "log"):
            if part in held:
                held[part].close()
        if "profiler" in held:  # a run that stops inside the traced range still leaves its trace
            try:
                held["profiler"].stop()
            except Exception as err:  # noqa: BLE001 - already stopping: the run's own error is reported
                print(f"warning: the profile was not written ({err})", file=sys.stderr)
        ours = failed and _still_locked()  # (a lost lock: the workdir may be another run's now)
        if failed and "ckpts" in held:
            held["ckpts"].stop(remove=ours)  # the save in flight ends; failed saves' directories go
        if ours and "stepping" not in held:
            _remove_new(workdir, before)  # a refused start leaves the workdir as it found it


def _still_locked() -> bool:
    try:
        check_lock()
    except LockLost:
        return False
    return True


def _run(cfg, run, workdir: str, progress: bool, held: dict, data=None, startup=None, task_files=None) -> dict:
    """`startup`: the start-up's `cli.GracefulStop`, checked at its safe points (a SIGINT before
    the first step stops the start there, and `_train` leaves the workdir as it found it)."""
    from tqdm import tqdm

    from onona_jax.data import pipeline

    flops = summary.flops_per_token(cfg.model, cfg.data.seq_len)  # the family's count, before any write
    wd = paths.Workdir(workdir)

    def check_startup(resume_from=None):
        """A safe point of the start-up: stop here if a SIGINT came."""
        if startup.requested and resume_from is None and paths.isdir(wd.checkpoints):  # (not restored yet)
            resume_from = max((int(p.name) for p in paths.path(wd.checkpoints).iterdir() if p.name.isdigit()),
                              default=None)
        startup.check(f"stopped during start-up, before the first step; {workdir} is left as it was (rerun the same "
                      f"command to {f'resume from step {resume_from}' if resume_from else 'start'})")

    check_writable(wd.checkpoints)
    profiler = held["profiler"] = Profiler(cfg, workdir)
    profiler.check()
    try:  # (a full disk here is a runtime refusal: `_train` removes what this start made)
        data = prepare_data(cfg, workdir, data)
        if jax.process_index() == 0:  # every shard against the manifest's hash, once per change of the shard
            data.verify(workdir)
    except OSError as err:
        what = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
        raise cli.Failure(f"could not prepare or check the data for {workdir} ({what}); free space (or fix "
                          "that file's permissions), then rerun the same command") from None
    check_startup()
    val_windows = data.val_windows
    if jax.process_index() == 0:
        edited = config_edits(wd.config, wd.checkpoints)
        if edited:
            print(f"warning: {wd.config} differs from the config saved with the newest checkpoint ({edited}): "
                  "edited by hand? It records a run's config and is never read back, so the edit is ignored and "
                  "the file rewritten with this run's config; change a run with --config flags", file=sys.stderr)
        try:  # atomic: a failed write leaves the old config.json
            paths.write_json(wd.config, json.loads(cfg.to_json()))
        except OSError as err:
            raise cli.Failure(f"could not write {wd.config} ({err.strerror or err}); free space "
                              "or make the workdir writable, then rerun the same command") from None

    ckpts = held["ckpts"] = Checkpoints(wd.checkpoints, keep=cfg.train.keep_checkpoints)
    removed = ckpts.remove_unfinished()  # a failed or killed save's leftovers
    if removed:
        print(f"removed unfinished checkpoint directories {removed} from {ckpts.directory} (saves that "
              "failed or were killed)", file=sys.stderr)
    restored = ckpts.restore_latest(abstract_train_state(run))
    batches = pipeline.train_batches(
        data, cfg.data.seq_len, cfg.train.global_batch, seed=cfg.data.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
        read_threads=cfg.data.read_threads, prefetch=cfg.data.prefetch,
    )
    if restored is None:
        start, state = 0, init_state(run, cfg.seed)
        if cfg.init_from:
            state = upcycle(run, state, cfg.init_from)
    else:
        start, state, data_state, _ = restored
        batches.set_state(data_state)
        print(f"resumed from step {start} in {ckpts.directory}", file=sys.stderr)
    check_startup(start)

    evaluator = Evaluator(run.graphdef, run.mesh, run.param_shardings, run.eot)
    train_tasks = downstream.TrainTasks(cfg, run.mesh, task_files or {})
    train_step = make_train_step(run)
    all_finite = jax.jit(lambda t: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(t)])),
                         out_shardings=NamedSharding(run.mesh, P()))
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    peak = peak_tflops(cfg)
    log = held["log"] = MetricsLog(workdir, cfg)
    log.restart(start)
    if batches.mixture_change:  # the weights changed on resume: allowed, and recorded
        log.note(start, mixture_change=batches.mixture_change)
        print(f"resumed with data.mixture's shares {batches.mixture_change['to']} (the run's were "
              f"{batches.mixture_change['from']}): the new composition applies from step {start + 1}", file=sys.stderr)
    pending: list[tuple[int, dict]] = []
    last_time, last_step = time.perf_counter(), start
    # Seconds of the current log interval that were not training (the first step's compile, a
    # validation, a checkpoint's device-to-host copy, writing a profile, scoring train.tasks): kept out
    # of tokens/s and MFU, logged apart.
    paused = {"compile_s": 0.0, "validation_s": 0.0, "checkpoint_s": 0.0, "profile_s": 0.0, "task_s": 0.0}
    # Seconds of the interval's training time spent waiting for the next batch (the iterator and
    # the host-to-device copy): counted in tokens/s (an input-bound run is that slow), logged apart
    # per step as data_wait_s beside step_s, so an input-bound run shows at once.
    data_wait = [0.0]
    first_step = {}  # the first step's compile: whether it came from the persistent cache
    bar = held["bar"] = tqdm(total=run.steps, initial=start, disable=not progress or jax.process_index() != 0,
                             dynamic_ncols=True, desc=cfg.name or "train")

    def flush():
        """Bring logged metrics to the host (one transfer per log interval); stop on NaN."""
        nonlocal last_time, last_step
        if not pending:
            return
        host = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        training = now - last_time - sum(paused.values())
        steps = pending[-1][0] - last_step
        tok_s = steps * tokens_per_step / max(training, 1e-9)
        times = {"step_s": max(training - data_wait[0], 0.0) / steps, "data_wait_s": data_wait[0] / steps}
        last_time, last_step = now, pending[-1][0]
        apart = {k: v for k, v in paused.items() if v and k != "task_s"}  # (task_s: logged with its scores)
        apart.update(first_step)
        paused.update(dict.fromkeys(paused, 0.0))
        data_wait[0] = 0.0
        first_step.clear()
        for (s, _), m in zip(pending, host):
            m = {k: float(v) for k, v in m.items()}
            if not math.isfinite(m["loss"]):
                raise NonFiniteLoss(
                    f"non-finite loss {m['loss']} at step {s}; stopping. The last good checkpoint "
                    f"(step {ckpts.latest()}) is untouched; lower train.lr or check the data"
                )
            m["tokens_per_s"] = tok_s
            m.update(times)
            # each named source's training tokens through step s
            m.update({f"tokens/{n}": c * cfg.data.seq_len for n, c in batches.consumed(s).items()})
            if peak:  # causal attention at half the square (summary.flops_per_token); PaLM's beside it
                m["mfu"] = tok_s * flops["train"] / (peak * 1e12 * jax.device_count())
                m["mfu_full_square"] = tok_s * flops["train_full_square"] / (peak * 1e12 * jax.device_count())
            if s == pending[-1][0]:
                m.update(apart)
            log.write(s, m)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        pending.clear()

    def check_saves():
        """A failed asynchronous save stops the run after the step it is found in."""
        try:
            ckpts.check()
        except Exception as err:  # noqa: BLE001
            raise save_failure(ckpts, err) from None

    def save(step, timer=False):
        flush()  # never save parameters that produced a non-finite loss,
        if not bool(all_finite(state)):  # nor non-finite ones behind a finite loss (an inf lr, a preemption)
            raise NonFiniteLoss(
                f"non-finite parameters or optimizer state after step {step}; not saving them. "
                f"The last good checkpoint (step {ckpts.latest()}) is untouched; lower train.lr or check the data"
            )
        began = time.perf_counter()
        try:
            ckpts.save(step, state, batches.get_state(), cfg.to_json(), timer=timer)
        except Exception as err:  # noqa: BLE001 - a failed write (full disk, read-only, quota)
            raise save_failure(ckpts, err) from None
        paused["checkpoint_s"] += time.perf_counter() - began
        save_timer.restart()

    def wait():
        try:
            ckpts.wait()
        except Exception as err:  # noqa: BLE001 - the asynchronous part of a save failed
            raise save_failure(ckpts, err) from None

    def validate(step, tables=(None,)):
        jax.block_until_ready(state)  # the steps in flight are training time
        began = time.perf_counter()
        result = evaluator(state["params"], val_windows, tables, cfg.eval.batch, groups=data.val_groups)
        log.write(step, result)
        paused["validation_s"] += time.perf_counter() - began
        return result

    def score_tasks(step):
        """train.tasks on the live parameters; every process scores (the batches are sharded over
        all of them), process 0 writes."""
        jax.block_until_ready(state)  # the steps in flight are training time
        began = time.perf_counter()
        row = train_tasks(state["params"])
        row["task_s"] = time.perf_counter() - began  # in the scores' own row: the last step's too is logged
        log.write(step, row)
        paused["task_s"] += time.perf_counter() - began
        return row

    held["stepping"] = True
    save_timer = SaveTimer(cfg.train.checkpoint_minutes)
    with Preemption() as preempt:
        if start == 0 and cfg.init_from:  # the upcycled model's starting point, logged
            validate(0)
        for step in range(start + 1, run.steps + 1):
            check_lock()  # a run whose workdir lock was lost (a bucket lease) stops here
            began = time.perf_counter()
            batch = global_batch(run, next(batches))
            data_wait[0] += time.perf_counter() - began
            profiler.before(step)
            if step == start + 1:  # the call compiles (or loads from the cache) before it dispatches
                began, hits = time.perf_counter(), compile_cache.hits()
                state, metrics = train_step(state, batch)
                paused["compile_s"] += time.perf_counter() - began
                if cfg.train.compile_cache:
                    first_step["compile_cache_hits"] = compile_cache.hits() - hits
                if startup.requested or preempt.interrupted:  # a Ctrl-C in the start-up or the compile:
                    startup.requested = True  # the step is not kept, and the workdir left as a refused start leaves it
                    del held["stepping"]
                    check_startup(start)
            else:
                state, metrics = train_step(state, batch)
            paused["profile_s"] += profiler.after(step, state, last=step == run.steps)
            bar.update(1)
            check_saves()
            if step % cfg.train.log_every == 0 or step == run.steps:
                pending.append((step, metrics))
                flush()
            elif (step % cfg.train.checkpoint_every == 0 or step % cfg.train.eval_every == 0
                  or train_tasks.due(step, run.steps)):
                pending.append((step, metrics))
            if step % cfg.train.eval_every == 0 and step != run.steps:
                validate(step)
            if train_tasks.due(step, run.steps) and step != run.steps:  # (the last step's: after its validation)
                score_tasks(step)
            if step % cfg.train.checkpoint_every == 0 or step == run.steps:
                save(step)
            elif step % cfg.train.log_every == 0 and save_timer.due():
                save(step, timer=True)
            if preempt.reached(step) and step != run.steps:
                if ckpts.saved != step:  # (not when this step's scheduled save is in flight: it is waited for)
                    save(step)
                wait()
                tqdm.write(f"{'interrupted' if preempt.interrupted else 'pre-empted'}: saved step {step}; rerun "
                           "the same command to resume", file=sys.stderr)  # (on a line of its own, not the bar's)
                return {"step": step, "preempted": True, **({"interrupted": True} if preempt.interrupted else {})}
        wait()
        if preempt.interrupted:  # in the last step or its save: the final validation is left to the rerun
            tqdm.write(f"interrupted: saved step {run.steps}, the last; rerun the same command for the final "
                       "validation", file=sys.stderr)
            return {"step": run.steps, "preempted": True, "interrupted": True}
        result = validate(run.steps, variants(cfg.model))
        if train_tasks.due(run.steps, run.steps):
            result.update(score_tasks(run.steps))
    result["step"] = run.steps
    return result
