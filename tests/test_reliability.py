"""Reliability (issue 12): one writer per workdir (lock.json), a rerun with a changed config
is refused before any write, "corrupt" means unreadable, read-only commands never touch
checkpoints/, storage failures are one `error:` line, and bad values are refused up front.

Fast tests call the entry points in-process (`train.main(argv)`, `eval.main(argv)` return
exit codes) on a run whose checkpoints are written directly (`Checkpoints.save` of a fresh
train state: no training step compiled). Tests that need real training run train.py in a
subprocess; the two-process lock test stays in the default suite, the storage-fault one (a
tmpfs workdir that fills up) is marked slow: `python -m pytest -q -m slow tests/test_reliability.py`.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import eval as eval_cli
import train as train_cli
from conftest import REPO, tiny_config
from onona_jax import config as config_lib
from onona_jax import paths
from onona_jax import train as trainer
from onona_jax.checkpoint import CheckpointMismatch, Checkpoints, restore_params, saved_config
from onona_jax.train import loop
from onona_jax.train.lock import WorkdirLock, _proc_start

CONFIG = os.path.join(REPO, "configs/paper.py:dense-tiny-standard")
OVERRIDES = {
    "data.seq_len": 32, "model.n_heads": 8, "model.n_kv_heads": 4, "model.head_dim": 8,
    "train.global_batch": 8, "train.micro_batch": 8, "train.steps": 4, "train.warmup_steps": 2,
    "train.log_every": 1, "train.eval_every": 1000, "train.checkpoint_every": 2,
    "eval.windows": 8, "eval.batch": 8, "mesh.data": 1,
}


# In-process runs see conftest's 8 devices (mesh and micro-batch may change on resume).
IN_PROCESS = {"mesh.data": -1, "train.micro_batch": 1}
ONE_DEVICE = {"mesh.data": 1, "train.micro_batch": 8}


def argv(data_dir, workdir, *extra, spec=CONFIG, **overrides):
    flags = {**OVERRIDES, **IN_PROCESS, "data.dir": data_dir, **overrides}
    return [f"--config={spec}", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items()), *extra]


def the_config(data_dir):
    """The config `argv(...)` requests, as train.py builds it."""
    cfg = config_lib.load(CONFIG)
    for k, v in {**OVERRIDES, "data.dir": data_dir}.items():
        *path, leaf = k.split(".")
        node = cfg
        for p in path:
            node = node[p]
        node[leaf] = v
    return config_lib.validate(cfg)


def tree_digest(path: Path) -> dict:
    """Every file (sha256) and directory under `path`."""
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(path.rglob("*"))}


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory):
    """A run with checkpoints at steps 2 and 4 of `argv`'s config on one device (a fresh
    state saved twice: what restore and the config checks read, without training)."""
    workdir = tmp_path_factory.mktemp("reliability") / "run"
    cfg = the_config(tiny_data)
    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.init_state(run, cfg.seed)
    ckpts = Checkpoints(str(workdir / "checkpoints"), keep=10)
    for step in (2, 4):
        ckpts.save(step, state, {"step": step}, cfg.to_json())
    ckpts.wait()
    (workdir / "config.json").write_text(cfg.to_json(indent=2))
    (workdir / "metrics.jsonl").write_text('{"step": 4, "loss": 10.0}\n')
    return workdir


@pytest.fixture
def copy_run(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def damage_arrays(workdir: Path, step: int):
    """Truncate the biggest array file of a step, as a full disk would."""
    files = sorted((p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
                    if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    with open(files[-1], "r+b") as f:
        f.truncate(files[-1].stat().st_size // 2)


# ----------------------------------------------------------------------------- 1. the lock


def lock_info(pid, host=None, proc_start="auto"):
    return {"host": host or socket.gethostname(), "pid": pid,
            "proc_start": _proc_start(pid) if proc_start == "auto" else proc_start,
            "started": time.time(), "argv": ["train.py"]}


def test_second_train_exits_2_naming_the_holder(tiny_data, copy_run, capfd):
    """A live process on this host holds the lock: train.py exits 2 with one error line naming
    its pid and the fix, and writes nothing (the workdir byte for byte as it was)."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (copy_run / "lock.json").write_text(json.dumps(lock_info(holder.pid)))
        before = tree_digest(copy_run)
        rc = train_cli.main(argv(tiny_data, copy_run))
        err = capfd.readouterr().err
        assert rc == 2, err[-2000:]
        [line] = errors(err)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in line and "another --workdir" in line, line
        assert tree_digest(copy_run) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_concurrent_lockers_exactly_one_wins(tmp_path, where, request):
    """Four processes race for one workdir's lock: exactly one holds it, the others are refused
    naming that one's pid. In a bucket (the local GCS emulator) the store's conditional create
    decides."""
    wd = f"{request.getfixturevalue('fake_gcs')}/wd" if where == "bucket" else str(tmp_path / "wd")
    script = ("import importlib.util, sys, time\n"  # lock.py and paths.py: no jax
              f"spec = importlib.util.spec_from_file_location('lock', {os.path.join(REPO, 'onona_jax/train/lock.py')!r})\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); WorkdirLock = m.WorkdirLock\n"
              "try:\n    lock = WorkdirLock(sys.argv[1]).acquire()\nexcept ValueError as e:\n"
              "    print('refused', e); sys.exit(2)\nprint('held'); sys.stdout.flush(); time.sleep(4); lock.release()\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, wd], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [(p.pid, p.communicate(timeout=120)[0], p.returncode) for p in procs]
    winners = [pid for pid, out, rc in outs if rc == 0 and out.startswith("held")]
    assert len(winners) == 1, outs
    for pid, out, rc in outs:
        if pid != winners[0]:
            assert rc == 2 and f"pid {winners[0]} " in out, outs
    assert not paths.exists(f"{wd}/lock.json")  # released at exit


def test_stale_lock_on_this_host_is_replaced(tmp_path, capfd):
    """A dead pid, or a live pid whose process start differs (the pid was reused): replaced
    with a warning; the lock is ours until released, then gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for info in (lock_info(dead.pid, proc_start="1"), lock_info(os.getpid(), proc_start="1")):
        wd = tmp_path / str(info["pid"])
        wd.mkdir()
        (wd / "lock.json").write_text(json.dumps(info))
        lock = WorkdirLock(str(wd)).acquire()
        assert json.loads((wd / "lock.json").read_text())["pid"] == os.getpid()
        assert f"replacing a stale lock on {wd} left by pid {info['pid']}" in capfd.readouterr().err
        lock.release()
        assert not (wd / "lock.json").exists()


def test_lock_from_another_host_needs_break_lock(tmp_path, capfd):
    (tmp_path / "lock.json").write_text(json.dumps(lock_info(12345, host="node-7", proc_start=None)))
    with pytest.raises(ValueError, match=r"pid 12345 on host node-7.*rerun with --break_lock"):
        WorkdirLock(str(tmp_path)).acquire()
    lock = WorkdirLock(str(tmp_path), break_lock=True).acquire()
    assert "--break_lock: took the lock" in capfd.readouterr().err
    assert json.loads((tmp_path / "lock.json").read_text())["pid"] == os.getpid()
    lock.release()


# ----------------------------------------------------------------------------- 2-3. changed configs


@pytest.mark.parametrize("spec,overrides,key", [
    (CONFIG, {"model.d_model": 128}, "model.d_model: 64 → 128"),  # parameters
    (CONFIG, {"train.lr": 1e-4}, "train.lr: 0.003 → 0.0001"),  # optimizer trajectory (issue 12 item 3)
    (CONFIG, {"data.seed": 7}, "data.seed: 0 → 7"),  # data stream
    (CONFIG, {"eval.windows": 4}, "eval.windows: 8 → 4"),  # what val_loss means
    (CONFIG.replace("standard", "twin"), {}, "model.head: 'standard' → 'twin'"),  # another config
])
def test_changed_config_exits_2_before_any_write(tiny_data, copy_run, capfd, spec, overrides, key):
    """Each class of non-resumable key: exit 2, one error line naming the key (saved →
    requested) and both fixes; checkpoints, config.json and metrics.jsonl untouched."""
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run, spec=spec, **overrides))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert key in line and "drop those overrides" in line and "new --workdir" in line, line
    assert tree_digest(copy_run) == before


def test_resumable_keys_pass_and_fewer_steps_do_not(tiny_data, run_dir):
    cfg = the_config(tiny_data)
    cfg.train.update(steps=40, log_every=5, eval_every=7, checkpoint_every=3, keep_checkpoints=9, micro_batch=4)
    cfg.eval.batch = 4
    loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(run_dir))  # no error
    cfg.train.steps = 3
    with pytest.raises(ValueError, match=r"train.steps resolves to 3, below the checkpoint's step 4"):
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(run_dir))


def test_resumable_keys_are_listed_in_the_readme():
    readme = (Path(REPO) / "README.md").read_text()
    section = readme[readme.index("### Resuming with a changed config"):]
    section = section[:section.index("\n#", 1)]
    assert [k for k in config_lib.RESUMABLE_KEYS if f"`{k}`" not in section] == []


def test_config_of_an_older_version_is_filled_from_defaults(copy_run, capfd):
    meta = copy_run / "checkpoints" / "4" / "config" / "metadata"
    saved = json.loads(meta.read_text())
    del saved["model"]["loss_chunk"]
    meta.write_text(json.dumps(saved))
    cfg = saved_config(str(copy_run))
    assert cfg.model.loss_chunk == config_lib.base_config().model.loss_chunk
    assert "predates keys model.loss_chunk; using their defaults" in capfd.readouterr().err
    saved["model"]["from_the_future"] = 1
    meta.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"model.from_the_future.*newer onona-jax"):
        saved_config(str(copy_run))


# ----------------------------------------------------------------------------- 4. corrupt = unreadable


def test_read_only_readers_skip_a_broken_step_and_touch_nothing(copy_run, capfd):
    """Damaged arrays at step 4: saved_config and restore_params (what eval, generate,
    export, analysis and serving use) use step 2, say so in one warning paragraph, and the
    run's tree hashes the same before and after."""
    damage_arrays(copy_run, 4)
    before = tree_digest(copy_run)
    assert saved_config(str(copy_run)).model.head == "standard"  # step 4's config reads fine
    _, step, cfg, _ = restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
    err = capfd.readouterr().err
    assert step == 2 and cfg.model.head == "standard"
    assert tree_digest(copy_run) == before
    assert re.search(r"^warning: checkpoint at step 4 could not be restored \(.*\); left in place \(this "
                     r"command only reads\) and falling back", err), err
    assert "using checkpoint step 2" in err and len(err.strip().splitlines()) == 2, err


def test_missing_config_metadata_falls_back_in_eval(run_dir, tmp_path, capfd):
    """eval.py on a run whose newest step lacks config/metadata: it evaluates step 2, writes
    its result, and leaves checkpoints/ as it was."""
    work = tmp_path / "run"
    shutil.copytree(run_dir, work)
    (work / "checkpoints" / "4" / "config" / "metadata").unlink()
    before = tree_digest(work / "checkpoints")
    out = tmp_path / "out" / "eval.json"
    rc = eval_cli.main([f"--workdir={work}", "--mesh=1,1,1", f"--output={out}"])
    err = capfd.readouterr().err
    assert rc == 0, err[-2000:]
    assert json.loads(out.read_text())["step"] == 2
    assert tree_digest(work / "checkpoints") == before
    assert "FileNotFoundError" in err and "Traceback" not in err


@pytest.mark.parametrize("step,rc,words", [
    (4, 1, "checkpoint at step 4 in"),  # broken
    (3, 2, "no checkpoint at step 3"),  # missing
])
def test_explicit_step_missing_or_broken_is_one_error_line(copy_run, capfd, step, rc, words):
    damage_arrays(copy_run, 4)
    before = tree_digest(copy_run)
    assert eval_cli.main([f"--workdir={copy_run}", f"--step={step}", "--mesh=1,1,1"]) == rc
    err = capfd.readouterr().err
    [line] = errors(err)
    assert words in line and "Traceback" not in err, err
    assert tree_digest(copy_run) == before


def test_writer_sets_aside_only_unreadable_steps(tiny_data, copy_run, capfd):
    """train.py's restore: a shape mismatch (another model) is an error naming the array and
    moves nothing; damaged arrays are set aside to corrupt/ with one warning paragraph (no
    Orbax or asyncio noise)."""
    other = the_config(tiny_data)
    other.model.d_model = 128
    run = trainer.setup(other, jax.devices()[:1])
    ckpts = Checkpoints(str(copy_run / "checkpoints"))
    with pytest.raises(CheckpointMismatch, match=r"step 4 .*holds a different model: .*shape \(50304, 64\) saved, "
                       r"\(50304, 128\) wanted"):
        ckpts.restore_latest(trainer.abstract_train_state(run))
    assert ckpts.steps() == [2, 4] and not (copy_run / "checkpoints" / "corrupt").exists()

    damage_arrays(copy_run, 4)
    capfd.readouterr()
    cfg = the_config(tiny_data)
    run = trainer.setup(cfg, jax.devices()[:1])
    step, *_ = ckpts.restore_latest(trainer.abstract_train_state(run))
    err = capfd.readouterr().err
    assert step == 2 and ckpts.steps() == [2]
    assert len(list((copy_run / "checkpoints" / "corrupt").glob("4-*"))) == 1
    assert len(err.strip().splitlines()) == 1 and "moved to" in err, err


# ----------------------------------------------------------------------------- 5. storage failures


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


@pytest.fixture
def read_only(tmp_path):
    """Make a directory read-only for this process (chmod; as root also chattr +i), or skip."""
    made = []

    def make(path: Path):
        path.chmod(0o555)
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        made.append(path)
        try:
            (path / ".probe").write_text("x")
        except OSError:
            return
        (path / ".probe").unlink()
        pytest.skip("cannot make a read-only directory here")

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o755)


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


@pytest.fixture
def tmpfs():
    """`mount(dir, size)`: a small tmpfs at `dir`, a real filesystem that fills up (ENOSPC), or
    skip where mounting is not permitted (needs root); unmounted after the test."""
    mounted = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); needs root")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, name: str = "ballast") -> Path:
    """Fill `directory`'s filesystem: a file grown until the disk refuses more."""
    ballast = directory / name
    with open(ballast, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return ballast


def test_create_exclusive_on_a_full_disk_leaves_no_temporary(tmp_path, tmpfs):
    """The lock's primitive on a full disk: ENOSPC, and neither the file nor its temporary
    (`lock.json.tmp-PID`, which kept the disk full) is left."""
    disk = tmpfs(tmp_path / "disk", "1m")
    fill(disk)
    with pytest.raises(OSError) as err:
        paths.create_exclusive(disk / "lock.json", "x" * 10_000)
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in disk.iterdir()) == ["ballast"]


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

    target = (loop, "check_writable") if moment == "checkpoints probe" else (storage, "verify_once")
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


def test_eval_output_checked_before_the_work(run_dir, tmp_path, read_only, capfd):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    t = time.perf_counter()
    assert eval_cli.main([f"--workdir={run_dir}", f"--output={ro / 'eval.json'}", "--mesh=1,1,1"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"--output={ro / 'eval.json'}: cannot write to {ro}" in line
    assert time.perf_counter() - t < 5  # nothing restored or compiled


# ----------------------------------------------------------------------------- 6. validation


@pytest.mark.parametrize("key,value,words", [
    ("train.steps", -5, "train.steps=-5 must be positive"),
    ("train.lr", -1e-3, "train.lr=-0.001 must be positive"),
    ("train.lr", 0.0, "train.lr=0.0 must be positive"),
    ("train.checkpoint_every", 0, "train.checkpoint_every=0 must be positive"),
    ("train.log_every", 0, "train.log_every=0 must be positive"),
    ("train.eval_every", 0, "train.eval_every=0 must be positive"),
    ("data.seq_len", 0, "data.seq_len=0 must be positive"),
    ("train.global_batch", 0, "train.global_batch=0 must be positive"),
])
def test_bad_values_rejected_before_any_write(tiny_data, tmp_path, capfd, key, value, words):
    workdir = tmp_path / "wd"
    assert train_cli.main(argv(tiny_data, workdir, **{key: value})) == 2
    [line] = errors(capfd.readouterr().err)
    assert words in line, line
    assert not workdir.exists()


def test_generate_max_new_tokens_and_long_prompt(run_dir, capfd):
    from onona_jax.serve import generate

    assert generate.main([f"--workdir={run_dir}", "--max_new_tokens=0"]) == 2
    assert errors(capfd.readouterr().err) == ["error: --max_new_tokens=0: give at least 1 token to generate"]
    prompt = list(range(100))
    assert generate.fit_prompt(prompt, 32, 8) == (list(range(76, 100)), 76)  # the END is kept
    assert generate.fit_prompt(prompt[:5], 32, 8) == (prompt[:5], 0)


# ----------------------------------------------------------------------------- real train.py runs


def train_env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    return env


def test_two_train_processes_on_one_workdir(tiny_data, tmp_path):
    """The issue's reproduction: a second train.py (another lr) started while the first runs
    exits 2 naming the first; the first finishes alone (metrics.jsonl holds one run). In the
    default suite: ~20 s, the one real two-process test of the lock."""
    workdir = tmp_path / "wd"
    first = subprocess.Popen([sys.executable, "train.py", *argv(tiny_data, workdir, **ONE_DEVICE, **{"train.steps": 6})],
                             cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "lock.json").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "train.py", *argv(tiny_data, workdir, **ONE_DEVICE,
                                **{"train.steps": 6, "train.lr": 1e-4})], cwd=REPO, env=train_env(), capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"pid {first.pid} " in errors(second.stderr)[0]
        out, _ = first.communicate(timeout=600)
        assert first.returncode == 0, out[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert not (workdir / "lock.json").exists()


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
        try:
            deadline = time.monotonic() + 300
            while ready is not None and not ready(p.pid):
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
    rc, _, err, seconds = run(saving, lambda pid: 2 in committed(), freeze)
    subprocess.run(["chattr", "-i", str(ckpt_dir)], check=True)
    read_only_s = stopped_cleanly(rc, err, seconds, r"could not write a checkpoint \(step \d+\) to .*Operation not permitted")
    good = committed()

    # 2. full disk while Orbax writes a step in the background
    writing = lambda pid: (ckpt_dir / f"{good[-1] + 2}.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp").exists()  # noqa: E731
    rc, _, err, seconds = run(saving, writing, lambda: fill(disk))
    assert f"resumed from step {good[-1]} " in err and not any("tmp" in p.name for p in ckpt_dir.iterdir())
    save_s = stopped_cleanly(rc, err, seconds, r"could not write a checkpoint \(step \d+\) to .*No space left")
    (disk / "ballast").unlink()
    assert committed()[-1] > good[-1]
    good = committed()

    # 3. full disk at a logged step's TensorBoard write
    def page_nearly_full(pid):
        events = list((workdir / "tensorboard").glob(f"*.{pid}"))
        return events and -events[0].stat().st_size % 4096 < 400  # (a step's records: 179 bytes)

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
