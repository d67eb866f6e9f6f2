"""Storage failures are one `error:` line (issue 12 item 5): metrics never torn (a resume repairs
the tail; deleted or replaced mid-run, recreated), read-only checkpoints and a full disk (a tmpfs,
root only) at the start, at a save, at metrics and TensorBoard writes, failed saves' tasks
silent; the slow test meets three faults in one real run, then resumes.
"""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import train as train_cli
from conftest import REPO
from onona_jax import paths
from onona_jax import train as trainer
from onona_jax.checkpoint import Checkpoints, restore_params
from onona_jax.train import loop
from run_fixtures import ONE_DEVICE, argv, errors, fill, the_config, train_env, tree_digest
from run_fixtures import copy_run, read_only, run_dir, tmpfs  # noqa: F401 - fixtures


def test_metrics_never_torn_and_a_resume_repairs_the_tail(tmp_path, monkeypatch, capfd):
    """A write that fails half-way (disk full) leaves metrics.jsonl as it was and stops with
    cli.Failure; a torn tail left by a crash is cut on resume and the restart marked."""
    from onona_jax import cli

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n{"step": 2, "lo')
    log = loop.MetricsLog(str(tmp_path))
    log.restart(2)
    assert "ended in a torn line (15 bytes" in capfd.readouterr().err
    log.write(3, {"loss": 9.0})
    good = (tmp_path / "metrics.jsonl").read_bytes()
    assert [json.loads(x) for x in good.decode().splitlines()][1:] == [
        {"step": 2, "restart": True, "time": json.loads(good.decode().splitlines()[1])["time"]},
        {"step": 3, "loss": 9.0}]

    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.os, "write", half_then_full)
    with pytest.raises(cli.Failure, match=r"could not write .*metrics.jsonl \(No space left on device\); stopping"):
        log.write(4, {"loss": 8.0})
    monkeypatch.undo()
    log.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == good


def test_metrics_deleted_or_replaced_mid_run_are_recreated_from_the_runs_record(tmp_path, capfd):
    """metrics.jsonl deleted (a clean-up script) or replaced (log rotation, another file) while a
    run writes it: the next logged step notices, recreates it from the run's own bytes with one
    warning, and moves a non-empty file found in its place aside; TensorBoard's file alike."""
    log = loop.MetricsLog(str(tmp_path))
    log.write(1, {"loss": 3.0})
    log.write(2, {"loss": 2.5})
    assert capfd.readouterr().err == ""
    (tmp_path / "metrics.jsonl").unlink()
    [events] = (tmp_path / "tensorboard").iterdir()
    events.unlink()
    log.write(3, {"loss": 2.0})
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("warning: ") and "was deleted while this run wrote it; recreated it "
                                 "from the run's own record" in e for e in err), err
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert {s for s, _, _ in tensorboard_scalars(events)} == {1, 2, 3}

    (tmp_path / "metrics.jsonl").rename(tmp_path / "metrics.jsonl.1")  # rotated, another file in its place
    (tmp_path / "metrics.jsonl").write_text('{"someone": "else"}\n')
    log.write(4, {"loss": 1.5})
    [line] = capfd.readouterr().err.splitlines()
    [aside] = tmp_path.glob("metrics.jsonl.found-*")
    assert "was replaced while this run wrote it" in line and f"the file found in its place is now {aside}" in line
    assert aside.read_text() == '{"someone": "else"}\n'
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    log.write(5, {"loss": 1.0})  # attached to the new file: no further word
    log.close()
    assert capfd.readouterr().err == ""
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5

def test_read_only_checkpoints_is_one_error_line_at_once(tiny_data, copy_run, read_only, capfd):
    """Before: a traceback and a 5-minute hang inside Orbax. Now: exit 1 within seconds, one
    error line naming the directory, checkpoints intact, the lock released."""
    before = tree_digest(copy_run)
    read_only(copy_run / "checkpoints")
    t = time.perf_counter()
    rc = train_cli.main(argv(tiny_data, copy_run, **{"train.steps": 6}))
    err = capfd.readouterr().err
    assert rc == 1 and time.perf_counter() - t < 30, err[-2000:]
    [line] = errors(err)
    assert f"cannot write to {copy_run / 'checkpoints'}" in line and "Traceback" not in err, err
    assert tree_digest(copy_run) == before  # nothing new anywhere in the workdir, the lock gone

@pytest.mark.parametrize("moment", ["checkpoints probe", "data record"])
@pytest.mark.parametrize("workdir_kind", ["new", "resumed"])
def test_a_start_refused_on_a_full_disk_leaves_nothing(tiny_data, run_dir, tmp_path, tmpfs, monkeypatch, capfd,
                                                        moment, workdir_kind):
    """The disk fills once the lock is held, before the first write of the start-up that needs
    space (the checkpoints/ probe, or the data check's record after checkpoints/ was made): exit
    1 with one error line, and the disk holds exactly what it held before: no empty
    checkpoints/, no new workdir, no lock, no temporary."""
    disk = tmpfs(tmp_path / "disk", "120m")
    workdir = disk / "run"
    if workdir_kind == "resumed":
        shutil.copytree(run_dir, workdir)
        (workdir / "data_verified.json").unlink(missing_ok=True)
    before = tree_digest(disk)
    from onona_jax.data import storage

    target = (loop, "require_writable") if moment == "checkpoints probe" else (storage, "verify_once")
    real = getattr(*target)

    def full_then(*args, **kwargs):
        fill(disk, ".ballast")
        return real(*args, **kwargs)

    monkeypatch.setattr(*target, full_then)
    rc = train_cli.main(argv(tiny_data, workdir, **{"train.steps": 6}))
    err = capfd.readouterr().err
    assert rc == 1, err[-2000:]
    [line] = errors(err)
    assert "No space left on device" in line and "Traceback" not in err, err
    (disk / ".ballast").unlink()
    assert tree_digest(disk) == before


def test_a_save_into_a_read_only_checkpoints_dir_fails_at_once(tiny_data, copy_run, read_only):
    """The save itself raises (its directories are made on the caller's thread) and no Orbax
    thread is left behind. Before: save() returned, and its writer threads waited 300 s for a
    "directory created" signal, holding the process open, then printed their tracebacks."""
    from onona_jax import checkpoint

    cfg = the_config(tiny_data)
    state = trainer.init_state(trainer.setup(cfg, jax.devices()[:1]), cfg.seed)
    ckpts = Checkpoints(str(copy_run / "checkpoints"))
    read_only(copy_run / "checkpoints")
    t = time.perf_counter()
    with pytest.raises(PermissionError):
        ckpts.save(6, state, {"step": 6}, cfg.to_json())
    ckpts.stop()
    assert time.perf_counter() - t < 5 and checkpoint._orbax_threads() == []
    assert ckpts.saved == 6 and ckpts.steps() == [2, 4]


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_remove_unfinished_removes_only_failed_saves(tmp_path, where, request):
    """Locally Orbax's `<step>.orbax-checkpoint-tmp*` directories, in a bucket a `<step>/` without
    its commit marker; never a committed step, `corrupt/` (no marker there either) or other files."""
    from etils import epath

    root = epath.Path(f"{request.getfixturevalue('fake_gcs')}/ck" if where == "bucket" else tmp_path / "ck")
    files = ["3/commit_success.txt", "3/state/d/x", "corrupt/4-1700000000/state/d/x", "notes.txt"]
    failed = (["5/state/d/x", "6/_CHECKPOINT_METADATA"] if where == "bucket" else
              ["5.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/d/x", "6.orbax-checkpoint-tmp-1712/x"])
    for name in files + failed:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    assert sorted(Checkpoints(str(root)).remove_unfinished()) == sorted({f.split("/")[0] for f in failed})
    import fsspec

    fs, key = fsspec.core.url_to_fs(str(root))
    assert sorted(f[len(key) + 1:] for f in fs.find(key)) == sorted(files)


def test_metrics_and_tensorboard_on_a_full_disk(tmp_path, tmpfs):
    """Logged steps on a real filesystem until it is full: the write that does not fit stops
    the run as one `cli.Failure` naming its file (TensorBoard's events included: no writer
    thread, no traceback), and both files hold whole lines and whole event records."""
    from onona_jax import cli

    disk = tmpfs(tmp_path / "disk", "64k")
    log = loop.MetricsLog(str(disk))
    with pytest.raises(cli.Failure, match=r"could not write .*(metrics\.jsonl|tfevents\S*) \((No space left on "
                                          r"device|short write \(disk full\?\))\); stopping"):
        for step in range(1, 100_000):
            log.write(step, {"loss": 1.0 / step, "lr": 1e-3, "tokens_per_s": 1e4})
    log.close()
    steps = [json.loads(x)["step"] for x in (disk / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 100
    [events] = (disk / "tensorboard").iterdir()
    scalars = tensorboard_scalars(events)
    assert {s for s, _, _ in scalars} == set(range(1, max(s for s, _, _ in scalars) + 1))


def tensorboard_scalars(path: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in a TensorBoard event file, every record's CRCs
    checked (a torn record fails)."""
    import struct

    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        head = data[i:i + 8]
        (n,) = struct.unpack("Q", head)
        assert struct.unpack("I", data[i + 8:i + 12])[0] == masked_crc32c(head)
        body = data[i + 12:i + 12 + n]
        assert struct.unpack("I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(body)
        event = event_pb2.Event.FromString(body)
        out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
        i += 16 + n
    return out


def test_tensorboard_events_as_tensorboardX_writes_them(tmp_path):
    from tensorboardX import SummaryWriter

    metrics = {3: {"loss": 2.5, "lr": 1e-3}, 4: {"loss": 2.25, "lr": 5e-4}}
    writer = SummaryWriter(str(tmp_path / "reference"))
    for step, m in metrics.items():
        for k, v in m.items():
            writer.add_scalar(k, v, step)
    writer.close()
    log = loop.MetricsLog(str(tmp_path / "run"))
    for step, m in metrics.items():
        log.write(step, m)
    log.close()
    [reference] = (tmp_path / "reference").iterdir()
    [ours] = (tmp_path / "run" / "tensorboard").iterdir()
    assert tensorboard_scalars(ours) == tensorboard_scalars(reference) != []


@pytest.fixture
def task_reports(monkeypatch):
    """What the root logger prints (asyncio's reports of abandoned tasks among it); the asyncio
    logger's filters and sys.unraisablehook, which a test's scopes may add to, restored after."""
    import io
    import logging

    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    logging.getLogger().addHandler(handler)
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    yield sink
    logging.getLogger().removeHandler(handler)


def _abandon(coroutine):
    """Run a failing task to its end and never retrieve its exception, then collect it."""
    import asyncio
    import gc

    loop = asyncio.new_event_loop()
    task = loop.create_task(coroutine())
    loop.run_until_complete(asyncio.sleep(0.01))
    assert task.done()
    loop.close()
    del task
    gc.collect()


async def _a_bug_of_ours():
    raise ValueError("OUT_OF_RANGE: a bug of ours")


def test_a_failed_saves_unretrieved_tasks_print_nothing(task_reports):
    """A failed save's Orbax coroutines end as tasks nobody awaits; asyncio reports each when
    it is collected, whenever that is (how one reached CI's stderr). Those reports go; any other
    task's still prints."""
    from onona_jax.library_logs import quiet_orbax

    namespace = {}
    exec(compile("async def async_serialize_from_host():\n    raise ValueError('RESOURCE_EXHAUSTED')\n",
                 "/site-packages/orbax/checkpoint/serialization.py", "exec"), namespace)
    quiet_orbax()  # (what every Checkpoints does)
    _abandon(namespace["async_serialize_from_host"])
    _abandon(namespace["async_serialize_from_host"])
    assert task_reports.getvalue() == ""
    _abandon(_a_bug_of_ours)
    assert "a bug of ours" in task_reports.getvalue() and "Task exception was never retrieved" in task_reports.getvalue()


def test_a_failed_reads_unretrieved_tasks_print_nothing(task_reports):
    """A damaged checkpoint's read fails in one of Orbax's per-array tasks; a sibling task that
    failed too is reported when collected, maybe at exit, after the one error line (how
    `eval.py --step=N` of a damaged step printed a traceback in CI's fault battery, 2026-12-04).
    Those reports go; any other task's still prints."""
    from onona_jax.library_logs import quiet_orbax

    damaged = 'OUT_OF_RANGE: Error opening "zarr" driver: Error reading "params.q/.zarray" in OCDBT database'

    async def read():
        raise ValueError(damaged)

    quiet_orbax()  # (what every Checkpoints does)
    _abandon(read)  # collected after the failed read was reported
    assert task_reports.getvalue() == ""
    _abandon(_a_bug_of_ours)
    assert "a bug of ours" in task_reports.getvalue() and "Task exception was never retrieved" in task_reports.getvalue()

@pytest.mark.slow
def test_storage_faults_during_a_run_then_resume(tiny_data, tmp_path, tmpfs):
    """One run on a real filesystem (a tmpfs workdir) meets three storage faults in turn, each
    at a chosen moment; after each the fault is mended and the command rerun:
    1. checkpoints/ turns read-only (chattr +i) once step 2 is saved (the next save's rename or
       mkdir fails);
    2. the disk fills while Orbax writes a step's arrays in the background;
    3. the disk fills as the logged steps' TensorBoard records need a new page (no save due).
    After each: exit 1 within 10 s of the fault, exactly one `error:` line, no traceback and no
    "Event loop is closed", lock.json gone, no failed save's temporary left (the read-only
    directory's own is removed by the rerun's start), every committed step restorable. Each rerun
    resumes from the last good step; the last one finishes. ~100 s: four train.py starts."""
    if subprocess.run(["chattr", "-i", str(tmp_path)], capture_output=True).returncode != 0:
        pytest.skip("chattr is not available here")
    disk = tmpfs(tmp_path / "disk", "200m")
    workdir, steps = disk / "run", 32  # (run 3 needs ~20 steps to fill its first page of events)
    ckpt_dir = workdir / "checkpoints"
    saving, logging_only = ([sys.executable, "train.py", *argv(tiny_data, workdir, **ONE_DEVICE, **{
        "train.steps": steps, "train.checkpoint_every": every, "train.keep_checkpoints": 2})] for every in (1, 1000))

    def committed() -> list[int]:
        return sorted(int(p.name) for p in (ckpt_dir.iterdir() if ckpt_dir.is_dir() else ())
                      if p.name.isdigit() and (p / "commit_success.txt").exists())

    def run(command, ready=None, fault=None):
        """(exit status, stdout, stderr, seconds from the fault to the exit) of `command`, with
        `fault()` applied as soon as `ready(pid)` holds."""
        out, err = open(tmp_path / "out.txt", "w+"), open(tmp_path / "err.txt", "w+")  # (a pipe can stall it)
        p = subprocess.Popen(command, cwd=REPO, env=train_env(), stdout=out, stderr=err)
        def holds():
            try:
                return ready(p.pid)
            except OSError:  # a directory renamed while it was listed
                return False

        try:
            deadline = time.monotonic() + 300
            while ready is not None and not holds():
                assert p.poll() is None and time.monotonic() < deadline, open(err.name).read()[-3000:]
                time.sleep(0.005)
            if fault is not None:
                fault()
            t = time.monotonic()
            p.wait(timeout=300)
            return p.returncode, open(out.name).read(), open(err.name).read(), time.monotonic() - t
        finally:
            if p.poll() is None:
                p.kill()

    def stopped_cleanly(rc, err, seconds, words):
        assert rc == 1, err[-3000:]
        [line] = errors(err)
        assert re.search(words, line), line
        assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
        assert seconds < 10, (seconds, line)
        assert not (workdir / "lock.json").exists()
        for step in committed():  # every committed step reads (read-only)
            assert restore_params(str(workdir), step, (1, 1, 1), jax.devices()[:1])[1] == step
        return seconds

    # 1. read-only checkpoints/ mid-run
    freeze = lambda: subprocess.run(["chattr", "+i", str(ckpt_dir)], check=True)  # noqa: E731
    rc, _, err, seconds = run(saving, lambda pid: committed()[-1:] >= [2], freeze)
    subprocess.run(["chattr", "-i", str(ckpt_dir)], check=True)
    read_only_s = stopped_cleanly(rc, err, seconds, r"could not write a checkpoint \(step \d+\) to .*Operation not permitted")
    good = committed()

    # 2. full disk while Orbax writes a step in the background
    def writing(pid):  # a step after the resumed one being written (any: one step's window is short)
        return any(int(p.parent.name.split(".")[0]) > good[-1] + 1 for p in ckpt_dir.glob("*.orbax-checkpoint-tmp/state.*"))

    rc, _, err, seconds = run(saving, writing, lambda: fill(disk))
    assert f"resumed from step {good[-1]} " in err and not any("tmp" in p.name for p in ckpt_dir.iterdir())
    save_s = stopped_cleanly(rc, err, seconds, r"could not write a checkpoint \(step \d+\) to .*No space left")
    (disk / "ballast").unlink()
    assert committed()[-1] > good[-1]
    good = committed()

    # 3. full disk at a logged step's TensorBoard write
    def page_nearly_full(pid):
        events = list((workdir / "tensorboard").glob(f"*.{pid}"))
        return events and -events[0].stat().st_size % 4096 < 1000  # (a step's records: 179 bytes)

    rc, _, err, seconds = run(logging_only, page_nearly_full, lambda: fill(disk))
    assert f"resumed from step {good[-1]} " in err
    metrics_s = stopped_cleanly(rc, err, seconds, r"could not write .*(tfevents\S*|metrics\.jsonl) \((No space left "
                                                  r"on device|short write \(disk full\?\))\); stopping")
    assert committed() == good
    (disk / "ballast").unlink()

    # the same command again: it resumes and finishes
    rc, out, err, _ = run(logging_only)
    assert rc == 0 and f"resumed from step {good[-1]} " in err and f"final step {steps}:" in out, err[-3000:]
    assert committed()[-1] == steps and not any("tmp" in p.name for p in ckpt_dir.iterdir())
    print(f"seconds from fault to exit: read-only {read_only_s:.1f}, full disk in a save {save_s:.1f}, "
          f"full disk at a metrics write {metrics_s:.1f}")
