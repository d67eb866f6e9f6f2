"""Reliability (issue 12): one writer per workdir (lock.json), a rerun with a changed config
is refused before any write, "corrupt" means unreadable, read-only commands never touch
checkpoints/, storage failures are one `error:` line, and bad values are refused up front.

Fast tests call the entry points in-process (`train.main(argv)`, `eval.main(argv)` return
exit codes) on a run whose checkpoints are written directly (`Checkpoints.save` of a fresh
train state: no training step compiled), and hold workdir locks from small subprocesses
(`HOLD`: lock.py alone, no jax). Tests that need real training run train.py in a
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
import numpy as np
import pytest

import eval as eval_cli
import train as train_cli
from conftest import REPO, tiny_config
from onona_jax import config as config_lib
from onona_jax import paths, summary
from onona_jax import train as trainer
from onona_jax.checkpoint import CheckpointMismatch, Checkpoints, restore_params, saved_config
from onona_jax.train import loop
from onona_jax.train import lock as lock_lib
from onona_jax.train.lock import WorkdirLock

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


# A process that holds a workdir's lock for `seconds`, then releases it: lock.py loaded alone
# (it needs paths and cli, not jax), so it holds the lock within half a second of starting.
HOLD = """import importlib.util, sys, time
spec = importlib.util.spec_from_file_location('lock', sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
try:
    lock = m.WorkdirLock(sys.argv[2]).acquire()
except ValueError as e:
    print('refused', e, flush=True); sys.exit(2)
print('held', flush=True); time.sleep(float(sys.argv[3])); lock.release()
"""
LOCK_PY = os.path.join(REPO, "onona_jax/train/lock.py")


def hold(workdir, seconds=60.0, prefix=()):
    """Start a holder of `workdir`'s lock and return it once it holds the lock."""
    p = subprocess.Popen([*prefix, sys.executable, "-c", HOLD, LOCK_PY, str(workdir), str(seconds)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line != "held\n":
        p.kill()
        raise AssertionError(f"the holder did not take the lock: {line}{p.communicate()[1][-2000:]}")
    return p


@pytest.fixture
def holders():
    started = []

    def start(*args, **kwargs):
        started.append(hold(*args, **kwargs))
        return started[-1]

    yield start
    for p in started:
        p.kill()
        p.wait()


def refused(workdir) -> str:
    """The error of another process asking for `workdir`'s lock (it must be refused)."""
    with pytest.raises(ValueError) as err:
        WorkdirLock(str(workdir)).acquire()
    return str(err.value)


def test_second_train_exits_2_naming_the_holder(tiny_data, copy_run, holders, capfd):
    """A live process holds the lock: train.py exits 2 with one error line naming its pid and
    the fix, and writes nothing (the workdir byte for byte as it was)."""
    holder = holders(copy_run)
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in line and "another --workdir" in line, line
    assert tree_digest(copy_run) == before


def test_holder_in_another_pid_namespace_is_alive(tiny_data, copy_run, holders, capfd):
    """The issue's repro: a holder in its own PID namespace (`unshare --pid`, as in a container
    sharing the host's name) is pid 1 there. The lock's liveness is the OS lock, not that pid:
    train.py exits 2 naming it, writes nothing, and the holder still holds the lock."""
    unshare = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
    try:
        probe = subprocess.run([*unshare, "true"], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.strip()}")
    holders(copy_run, prefix=unshare)
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert f"pid 1 on host {socket.gethostname()} (in another PID namespace" in line, line
    assert "stale" not in err and tree_digest(copy_run) == before
    assert "pid 1 on host" in refused(copy_run)


def test_break_lock_is_refused_and_the_holder_keeps_the_lock(tiny_data, copy_run, holders, capfd):
    """--break_lock is retired (a live holder's lock is never taken; a dead one's needs no flag):
    exit 2 saying so, nothing written, and the live holder still holds the lock."""
    holder = holders(copy_run)
    before = tree_digest(copy_run)
    assert train_cli.main(argv(tiny_data, copy_run, "--break_lock")) == 2
    [line] = errors(capfd.readouterr().err)
    assert line == f"error: {train_cli.RETIRED_BREAK_LOCK}"
    assert tree_digest(copy_run) == before
    assert f"pid {holder.pid} on host" in refused(copy_run)


def test_killed_holders_lock_is_free_at_once(tmp_path, holders, capfd):
    """SIGKILL: the OS releases the lock; the next locker takes it at once, silently (no pid
    guessing, no warning), and removes lock.json when it is done."""
    holder = holders(tmp_path)
    holder.kill()
    holder.wait()
    assert (tmp_path / "lock.json").exists()  # left behind, but no longer locked
    t = time.perf_counter()
    lock = WorkdirLock(str(tmp_path)).acquire()
    assert time.perf_counter() - t < 1
    assert json.loads((tmp_path / "lock.json").read_text())["pid"] == os.getpid()
    lock.check()  # reading lock.json above did not release it (a POSIX lock would have been)
    assert "pid" in refused(tmp_path)
    lock.release()
    assert not (tmp_path / "lock.json").exists() and capfd.readouterr().err == ""


def test_checkpoints_reached_through_a_symlink_are_locked_where_they_live(tiny_data, tmp_path, holders, capfd):
    """Two fresh workdirs whose checkpoints/ are symlinks to one directory (checkpoints kept on a
    big disk): the run holding the first also holds that directory, so train.py on the second
    (another lr) exits 2 naming the first's workdir and the directory really shared, and writes
    nothing."""
    shared = tmp_path / "big-disk" / "ckpts"
    shared.mkdir(parents=True)
    first, other = tmp_path / "first", tmp_path / "other"
    for wd in (first, other):
        wd.mkdir()
        (wd / "checkpoints").symlink_to(shared)
    holders(first)
    assert (shared / "lock.json").exists()
    before = tree_digest(tmp_path)
    rc = train_cli.main(argv(tiny_data, other, **{"train.lr": 0.5}))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert f"{other}/checkpoints (really {shared}, which another workdir's run also writes) is in use by" in line, line
    assert f"workdir {first})" in line, line
    assert tree_digest(tmp_path) == before
    assert lock_lib.elsewhere(str(first)) == [(f"{first}/checkpoints", str(shared))]
    assert lock_lib.elsewhere(str(tmp_path / "nothing-here")) == []


def test_lock_file_removed_by_hand_is_noticed(tmp_path, monkeypatch):
    """A holder whose lock.json is deleted (another run could then lock a new one) notices
    within one heartbeat and `check()` stops it."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "0.4")
    lock = WorkdirLock(str(tmp_path)).acquire()
    (tmp_path / "lock.json").unlink()
    assert until(lambda: lock.lost is not None)
    with pytest.raises(lock_lib.LockLost, match=r"lock.json was removed or replaced while this run held it"):
        lock_lib.check()
    lock.release()


@pytest.mark.slow
def test_training_stops_at_the_step_after_its_lock_is_lost(tiny_data, tmp_path, monkeypatch, capfd):
    """The loop asks the lock at every step: a run whose lock is lost (here at once, as the
    heartbeat reports lock.json removed by hand or a bucket lease taken over) exits 1 with one
    error line before its first step, saving nothing. Slow (~20 s: a fresh state and evaluator
    are built before the first step)."""
    def lose(lock):
        lock.lost = "lost for this test"

    monkeypatch.setattr(WorkdirLock, "_heartbeat", lose)
    workdir = tmp_path / "wd"
    rc = train_cli.main(argv(tiny_data, workdir))
    err = capfd.readouterr().err
    assert rc == 1, err[-2000:]
    [line] = errors(err)
    assert line.startswith(f"error: this run lost its lock on {workdir}: lost for this test; stopped before "
                           "writing more") and "rerun the same command" in line, line
    assert not list((workdir / "checkpoints").glob("[0-9]*")) and not (workdir / "lock.json").exists()


def test_lock_on_a_full_disk_leaves_nothing(tmp_path):
    """The holder's details cannot be written (files limited to 8 bytes): OSError, and no
    lock.json or temporary file is left behind."""
    script = ("import importlib.util, resource, signal, sys\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (8, 8))\n"
              "spec = importlib.util.spec_from_file_location('lock', sys.argv[1])\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              "try:\n    m.WorkdirLock(sys.argv[2]).acquire()\nexcept OSError as e:\n    print(e.errno)\n")
    p = subprocess.run([sys.executable, "-c", script, LOCK_PY, str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.stdout.strip() in (str(errno.EFBIG), str(errno.ENOSPC)), p.stdout + p.stderr
    assert os.listdir(tmp_path) == []


def test_import_hf_beside_a_held_lock_writes_nothing(tmp_path, holders, capfd):
    """import_hf is a writer too: beside a live holder it exits 2 naming it, and the workdir
    is as it was (no config.json, no checkpoints/)."""
    from onona_jax import models as model_lib
    from onona_jax.serve import hf_format
    from onona_jax.train import import_hf

    cfg = tiny_config(str(tmp_path / "no-data"), head="twin")
    shapes = jax.eval_shape(lambda: model_lib.init(cfg.model, 0)[1])  # zeros do: nothing is computed
    hf_format.export(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), cfg, str(tmp_path / "hf"),
                     tokenizer=False)
    workdir = tmp_path / "run"
    holder = holders(workdir)
    before = tree_digest(workdir)
    assert import_hf.main([f"--from_hf={tmp_path / 'hf'}", f"--workdir={workdir}"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"pid {holder.pid} on host" in line and "another --workdir" in line, line
    assert tree_digest(workdir) == before == {"lock.json": before["lock.json"]}


def test_second_sweep_on_a_directory_exits_2(tmp_path, holders, capfd):
    """The sweep writes grid.json, sweep_status.json and its runs' logs in its directory: a second
    sweep there (held here by another process) exits 2 naming it and writes nothing."""
    from onona_jax.experiments import sweep

    holder = holders(tmp_path / "sweep")
    rc = sweep.main(["--grid=depth", "--size=small", "--seeds=0", f"--workdir={tmp_path / 'sweep'}",
                     f"--emit={tmp_path / 'commands.sh'}"])
    [line] = errors(capfd.readouterr().err)
    assert rc == 2 and f"pid {holder.pid} on host" in line, line
    assert sorted(os.listdir(tmp_path / "sweep")) == ["lock.json"] and not (tmp_path / "commands.sh").exists()


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_concurrent_lockers_exactly_one_wins(tmp_path, where, request, monkeypatch):
    """Four processes race for one workdir's lock: exactly one holds it, the others are refused
    naming that one's pid. In a bucket (the local GCS emulator) the store's conditional create
    decides, and the losers are refused once they see the winner renew its lease."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "2")
    wd = f"{request.getfixturevalue('fake_gcs')}/wd" if where == "bucket" else str(tmp_path / "wd")
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, LOCK_PY, wd, "4"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(4)]
    outs = [(p.pid, p.communicate(timeout=120)[0], p.returncode) for p in procs]
    winners = [pid for pid, out, rc in outs if rc == 0 and out.startswith("held")]
    assert len(winners) == 1, outs
    for pid, out, rc in outs:
        if pid != winners[0]:
            assert rc == 2 and f"pid {winners[0]} " in out, outs
    assert not paths.exists(f"{wd}/lock.json")  # released at exit


def _generation(url):
    fs, _ = paths._fs(url)
    return fs.info(url)["generation"]


def test_bucket_lease_of_a_live_holder_is_renewed_and_kept(fake_gcs, holders, monkeypatch):
    """A live holder renews its lease (the object's generation changes several times per lease);
    another locker watching it is refused within about one renewal, naming it, and the holder
    keeps the lease."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "2")
    wd = f"{fake_gcs}/wd"
    holder = holders(wd)
    seen = {_generation(f"{wd}/lock.json")}
    for _ in range(4):
        time.sleep(0.3)
        seen.add(_generation(f"{wd}/lock.json"))
    assert len(seen) >= 3, seen  # renewed every 2/12 s
    t = time.perf_counter()
    err = refused(wd)
    assert f"pid {holder.pid} on host" in err and "keeps renewing its lease" in err, err
    assert time.perf_counter() - t < 1.5
    time.sleep(0.5)
    assert holder.poll() is None and _generation(f"{wd}/lock.json") not in seen


def test_bucket_lease_of_a_killed_holder_is_taken_after_the_lease(fake_gcs, holders, monkeypatch, capfd):
    """SIGKILL leaves the lease object; the next locker watches it, and takes it over once it
    has gone the lease (2 s here) without renewal, saying from whom."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "2")
    wd = f"{fake_gcs}/wd"
    holder = holders(wd)
    holder.kill()
    holder.wait()
    t = time.perf_counter()
    lock = WorkdirLock(wd).acquire()
    took = time.perf_counter() - t
    assert 2 <= took < 5, took
    err = capfd.readouterr().err
    assert f"took the lock on {wd} from a Python process (pid {holder.pid} on host" in err, err
    assert "not renewed for 2 s" in err
    assert json.loads(paths.read_text(f"{wd}/lock.json"))["token"] == lock.info["token"]
    lock.release()
    assert not paths.exists(f"{wd}/lock.json")


def test_bucket_holder_that_cannot_renew_stops(fake_gcs, _gcs_emulator, monkeypatch):
    """The store unreachable for more than half the lease (the emulator paused): `check()` raises
    LockLost (the training loop calls it at every step), well before another process could take
    the lease. A lease taken away (the object removed) is noticed at the next renewal."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "1")
    wd = f"{fake_gcs}/wd"
    lock = WorkdirLock(wd).acquire()
    with _gcs_emulator.lock:  # every request waits
        time.sleep(0.8)
        with pytest.raises(lock_lib.LockLost, match=r"lost its lock on gs:.*: its lease on .*lock.json has not "
                           r"been renewed for [\d.]+ s of its 1 s"):
            lock_lib.check()
    assert until(lambda: lock_lib.check() is None)  # renewed again, and nobody took it meanwhile
    paths.remove(f"{wd}/lock.json")
    assert until(lambda: lock.lost == f"{wd}/lock.json was removed")
    with pytest.raises(lock_lib.LockLost, match=r"lock.json was removed"):
        lock_lib.check()
    lock.release()


def until(condition, seconds=5.0) -> bool:
    """Whether `condition()` holds (without raising) within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if condition():
                return True
        except Exception:  # noqa: BLE001
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# ----------------------------------------------------------------------------- 2-3. changed configs


@pytest.mark.parametrize("spec,overrides,key", [
    (CONFIG, {"model.d_model": 128}, "model.d_model: 64 → 128"),  # parameters
    (CONFIG, {"train.lr": 1e-3}, "train.lr: 0.003 → 0.001"),  # optimizer trajectory (issue 12 item 3)
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
    cfg.train.update(log_every=5, eval_every=7, checkpoint_every=3, keep_checkpoints=9, micro_batch=4)
    cfg.eval.batch = 4
    cfg.data.cache_dir = str(run_dir / "elsewhere")  # another cache of the same data
    cfg.data.bucket_read = "stream"  # streamed instead of copied: the same batches
    loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(run_dir))  # no error
    cfg.train.steps = 3
    with pytest.raises(ValueError, match=r"train.steps resolves to 3, below the checkpoint's step 4"):
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(run_dir))


def plan(workdir: Path, **train):
    """Rewrite train.* keys of the config saved with each checkpoint: the run was planned so."""
    for meta in (workdir / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(meta.read_text())
        saved["train"].update(train)
        meta.write_text(json.dumps(saved))


def resumes(cfg, workdir: Path) -> bool:
    try:
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(workdir))
    except ValueError:
        return False
    return True


def test_steps_may_change_until_the_decay_begins(tiny_data, copy_run):
    """A new train.steps moves the WSD decay; it is accepted exactly while every step taken
    keeps its learning rate (checkpoint at step 4: optimizer steps 0-3 taken)."""
    from onona_jax.train import optimizer

    cfg = the_config(tiny_data)
    cfg.train.decay_fraction = 0.5
    plan(copy_run, decay_fraction=0.5, steps=8)  # decay over steps 5-8 (lr 0.003 up to step 5)
    for steps, ok in ((16, True), (5, True), (4, False)):  # 4: step 4 would decay (0.003 → 0.0003)
        cfg.train.steps = steps
        assert resumes(cfg, copy_run) == ok, steps
        # the criterion itself: the old and the new schedule agree on the steps taken
        same = [float(optimizer.schedule(cfg, 8)(c)) == float(optimizer.schedule(cfg, steps)(c)) for c in range(4)]
        assert all(same) == ok
    # A budget derived from tokens_per_param (train.steps=0, here 8 steps) is compared as the
    # number it resolves to.
    tpp = 7.5 * 8 * 32 / summary.budget(cfg)["reference_params"]
    plan(copy_run, steps=0, tokens_per_param=tpp)
    for steps, ok in ((0, True), (8, True), (4, False)):
        cfg.train.update(steps=steps, tokens_per_param=tpp)
        assert resumes(cfg, copy_run) == ok, steps


@pytest.mark.parametrize("planned,steps,words", [
    (4, 8, "train.steps resolves to 8 but the run in {run} was planned for 4 steps and has taken 4; under the WSD "
           "schedule that changes the learning rate of a step already taken (step 4: 0.0003 → 0.003): under one of "
           "the two budgets the decay (over the last train.decay_fraction of the steps) begins by step 4. Either "
           "keep train.steps=4 to finish the run as planned, or train the longer run in a new --workdir"),
    (8, 4, "(step 4: 0.003 → 0.0003): under one of the two budgets the decay (over the last train.decay_fraction "
           "of the steps) begins by step 4. Either keep train.steps=8 to finish the run as planned, or train "
           "the shorter run in a new --workdir"),
    (8, 3, "train.steps resolves to 3, below the checkpoint's step 4"),
])
def test_steps_change_that_alters_a_taken_step_exits_2(tiny_data, copy_run, capfd, planned, steps, words):
    """The issue's case: a run planned for 4 steps, its decay over steps 3-4, extended to 8 at
    its end, would restart the decay at the peak (lr 3e-4 at step 4, 3e-3 at step 5); or one
    planned for 8 shortened to 4 at step 4 would have decayed at step 4. Exit 2 with the
    choices, nothing written."""
    plan(copy_run, decay_fraction=0.5, steps=planned)
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run, **{"train.steps": steps, "train.decay_fraction": 0.5}))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert words.format(run=copy_run) in line, line
    assert tree_digest(copy_run) == before


def test_moved_data_resumes_and_other_data_does_not(tiny_data, copy_run, tmp_path, capfd):
    """data.dir may change on resume when the data's identity (its manifest's shard list) is
    the run's: a data dir moved away from where the run was trained (the record of its last
    start vouches for it); data prepared otherwise is refused naming both data dirs."""
    from onona_jax.data import storage
    from onona_jax.data.prepare import prepare

    old, moved = tmp_path / "old", tmp_path / "moved"
    shutil.copytree(tiny_data, old)
    storage.verify_once(old, copy_run)  # what the run's last start recorded
    for meta in (copy_run / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(meta.read_text())
        saved["data"]["dir"] = str(old)
        meta.write_text(json.dumps(saved))
    old.rename(moved)
    cfg = the_config(str(moved))
    assert resumes(cfg, copy_run)
    (copy_run / "data_verified.json").unlink()  # no record, and the old dir gone: cannot tell
    with pytest.raises(ValueError, match=rf"trained on {old}; cannot tell whether {moved} holds the same data"):
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(copy_run))
    storage.verify_once(moved, copy_run)  # a start on the moved data records it again

    other = tmp_path / "other"
    prepare([str(Path(tiny_data).parent / "austen_head.txt")], str(other), heldout_fraction=0.2)
    before = tree_digest(copy_run)
    assert train_cli.main(argv(str(other), copy_run)) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"{copy_run} holds a run trained on {old}, but {other} holds other data" in line, line
    assert "in a new --workdir" in line
    assert tree_digest(copy_run) == before


def test_bundled_data_is_identified_like_any_other(tiny_data, copy_run):
    """data.dir="" (the bundled corpus, prepared into WORKDIR/data) is compared by identity
    too: the same data named explicitly resumes; WORKDIR/data not yet prepared, with
    data.dir="" as saved, resumes (it is prepared again)."""
    from onona_jax.data import storage

    for meta in (copy_run / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(meta.read_text())
        saved["data"]["dir"] = ""
        meta.write_text(json.dumps(saved))
    cfg = the_config("")
    assert resumes(cfg, copy_run)  # nothing prepared yet, nothing recorded: the same data.dir
    shutil.copytree(tiny_data, copy_run / "data")
    storage.verify_once(copy_run / "data", copy_run)
    assert resumes(cfg, copy_run)
    assert resumes(the_config(tiny_data), copy_run)  # the same shards elsewhere


def test_replaced_shard_is_caught_at_the_next_start(tiny_data, copy_run, tmp_path, capfd):
    """A shard replaced by other (valid) ids of the same size after the run's first start:
    the next start exits 2 naming the shard, writing nothing (issue: it trained, exit 0)."""
    import numpy as np

    from onona_jax.data import storage

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    storage.verify_once(data, copy_run)  # the first start's record
    shard = data / "train_00000.bin"
    st = shard.stat()
    ids = np.random.default_rng(0).integers(0, 50257, st.st_size // 2, dtype=np.uint16)
    shard.write_bytes(ids.tobytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a copy made a second later would
    before = tree_digest(copy_run)
    assert train_cli.main(argv(str(data), copy_run)) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"shard {shard} ({st.st_size} bytes, sha256 " in line and "does not match" in line, line
    assert "restore that shard, or run `python -m onona_jax.data.prepare" in line
    assert tree_digest(copy_run) == before


def test_shards_are_hashed_only_when_changed(tiny_data, tmp_path, monkeypatch):
    """At every start each shard's size and mtime are compared with the record; only a changed
    one is hashed (a touched one whose hash still matches updates the record); an untouched
    resume reads no shard. A moved data dir is hashed again (the record vouches for its own
    directory only)."""
    from onona_jax.data import storage

    hashed = []
    real = storage.shard_sha256
    monkeypatch.setattr(storage, "shard_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    run.mkdir()

    def start():
        hashed.clear()
        storage.verify_once(data, run)
        return sorted(hashed)

    assert start() == ["heldout_00000.bin", "train_00000.bin"]
    record = json.loads((run / "data_verified.json").read_text())
    assert record["identity"] == storage.data_identity(tiny_data)
    assert start() == []  # untouched: nothing read
    shard = data / "train_00000.bin"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert start() == ["train_00000.bin"]  # touched, same bytes: hashed once, recorded
    assert start() == []
    moved = tmp_path / "moved"
    data.rename(moved)
    data = moved
    assert start() == ["heldout_00000.bin", "train_00000.bin"]
    assert start() == []


def test_resumable_keys_are_listed_in_the_training_guide():
    guide = (Path(REPO) / "docs" / "training.md").read_text()
    section = guide[guide.index("### Resuming with a changed config"):]
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


def test_run_saved_under_looser_rules_stays_readable(tiny_data, copy_run, capfd):
    """A run trained before the optimizer's values were checked (here final_lr above lr, a
    negative grad_clip) is still read by eval, serving and export (they read no train.* key);
    resuming it is refused naming the key."""
    plan(copy_run, lr=1e-4, final_lr=3e-4, grad_clip=-1.0)
    cfg = saved_config(str(copy_run))
    assert (cfg.train.lr, cfg.train.final_lr, cfg.model.head) == (1e-4, 3e-4, "standard")
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run, **{"train.lr": 1e-4, "train.grad_clip": -1.0}))
    assert rc == 2
    [line] = errors(capfd.readouterr().err)
    assert "train.final_lr=0.0003 must lie in [0, train.lr=0.0001]" in line, line
    assert tree_digest(copy_run) == before


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


def test_damaged_metadata_files_are_skipped_or_harmless(tiny_data, copy_run, capfd):
    """Step 4's state/_METADATA garbled: read-only readers use step 2 and change nothing. Its
    metrics item garbled (Orbax read it to list the steps: every command stopped with a
    traceback): the step lists and restores, and a writer keeps it (its arrays are whole)."""
    ckpts = copy_run / "checkpoints"
    metadata = ckpts / "4" / "state" / "_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:100])
    before = tree_digest(copy_run)
    _, step, _, _ = restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
    assert step == 2 and tree_digest(copy_run) == before
    assert "warning: checkpoint at step 4 could not be restored" in capfd.readouterr().err
    shutil.copyfile(ckpts / "2" / "state" / "_METADATA", metadata)  # (the same tree: whole again)

    (ckpts / "4" / "metrics" / "metrics").write_text('{"timer": ')
    assert saved_config(str(copy_run)).model.head == "standard"
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    writer = Checkpoints(str(ckpts))
    assert writer.steps() == [2, 4] and writer.timer_steps() == []
    assert writer.restore_latest(trainer.abstract_train_state(run))[0] == 4
    assert not (ckpts / "corrupt").exists() and "Traceback" not in capfd.readouterr().err


def test_another_steps_data_state_is_unreadable(tiny_data, copy_run, capfd):
    """Step 2's data iterator state copied over step 4's (a resume would replay batches 3-4):
    the writer sets step 4 aside with one warning and resumes from step 2."""
    ckpts = copy_run / "checkpoints"
    shutil.copyfile(ckpts / "2" / "data" / "metadata", ckpts / "4" / "data" / "metadata")
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    step, _, data, _ = Checkpoints(str(ckpts)).restore_latest(trainer.abstract_train_state(run))
    err = capfd.readouterr().err
    assert step == 2 and data == {"step": 2}
    [line] = err.strip().splitlines()
    assert "step 4 could not be restored" in line and "data iterator state: step 2" in line, err


def test_set_aside_goes_round_whatever_is_in_the_way(tiny_data, copy_run, capfd):
    """checkpoints/corrupt a file and corrupt.1 a dangling symlink: step 4 goes to corrupt.2/,
    both left as they were; a name already taken there gets a suffix, never merges."""
    from onona_jax import checkpoint as checkpoint_lib

    ckpts = copy_run / "checkpoints"
    (ckpts / "corrupt").write_text("mine\n")
    (ckpts / "corrupt.1").symlink_to(copy_run / "nowhere")
    damage_arrays(copy_run, 4)
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    writer = Checkpoints(str(ckpts))
    assert writer.restore_latest(trainer.abstract_train_state(run))[0] == 2
    [line] = capfd.readouterr().err.strip().splitlines()
    [aside] = (ckpts / "corrupt.2").iterdir()
    assert aside.name.startswith("4-") and f"moved to {aside} " in line, line
    assert (ckpts / "corrupt").read_text() == "mine\n" and (ckpts / "corrupt.1").is_symlink()
    assert writer.steps() == [2]

    (ckpts / "2.copy").mkdir()
    (ckpts / "corrupt.2" / "2-7").mkdir()  # empty: a plain rename would replace it
    dst = checkpoint_lib._rename_aside(str(ckpts / "2.copy"), str(ckpts), "2-7")
    assert dst == str(ckpts / "corrupt.2" / "2-7.1") and (ckpts / "corrupt.2" / "2-7").is_dir()


def test_set_aside_impossible_or_not_damage_is_one_failure_and_moves_nothing(tiny_data, copy_run, monkeypatch):
    """No folder takes the step (every corrupt* name a file): one Failure naming the fix,
    the step left in place. A read that failed for want of memory or permission says nothing
    about the files: one Failure, nothing moved, not skipped (read-only readers too)."""
    from onona_jax import cli

    ckpts = copy_run / "checkpoints"
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    abstract = trainer.abstract_train_state(run)
    for name in ["corrupt"] + [f"corrupt.{i}" for i in range(1, 10)]:
        (ckpts / name).write_text("x")
    damage_arrays(copy_run, 4)
    with pytest.raises(cli.Failure, match=r"step 4 .* could not be set aside .*: move .*/4 out of .* by hand"):
        Checkpoints(str(ckpts)).restore_latest(abstract)
    assert Checkpoints(str(ckpts)).steps() == [2, 4]

    for err in (MemoryError(), RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes"),
                PermissionError(13, "Permission denied")):
        def fail(self, step, abstract_state, err=err):
            raise err
        monkeypatch.setattr(Checkpoints, "restore", fail)
        with pytest.raises(cli.Failure, match=r"step 4 .* may be whole, so it was left in place"):
            Checkpoints(str(ckpts)).restore_latest(abstract)
        monkeypatch.setattr(Checkpoints, "restore_params", lambda *a, **k: fail(None, None, None))
        with pytest.raises(cli.Failure, match=r"step 4 .* may be whole"):
            restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
        assert Checkpoints(str(ckpts)).steps() == [2, 4]


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


def test_eval_output_checked_before_the_work(run_dir, tmp_path, read_only, capfd):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    t = time.perf_counter()
    assert eval_cli.main([f"--workdir={run_dir}", f"--output={ro / 'eval.json'}", "--mesh=1,1,1"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"--output={ro / 'eval.json'}: cannot write to {ro}" in line
    assert time.perf_counter() - t < 5  # nothing restored or compiled


def test_eval_default_output_checked_before_the_work(copy_run, read_only, capfd):
    """No --output on a read-only workdir: its default, DIR/eval/, is probed first (exit 2, one
    line naming --output, in seconds); on a writable workdir the probe leaves nothing behind."""
    read_only(copy_run)
    t = time.perf_counter()
    assert eval_cli.main([f"--workdir={copy_run}", "--mesh=1,1,1"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert line.startswith(f"error: cannot write {copy_run}/eval (") and "give --output=PATH" in line, line
    assert time.perf_counter() - t < 5  # nothing restored or compiled


def test_default_output_probe_leaves_nothing(tmp_path):
    from onona_jax import cli

    cli.check_output_dir(str(tmp_path / "eval"), "--output")
    assert list(tmp_path.iterdir()) == []


def test_config_json_edited_by_hand_is_named(copy_run):
    """config.json against the config saved with the newest checkpoint: equal (as the run wrote
    it) says nothing; a hand edit is named by its keys (the run warns and rewrites the file)."""
    path, ckpts = str(copy_run / "config.json"), str(copy_run / "checkpoints")
    assert loop.config_edits(path, ckpts) == ""
    cfg = json.loads((copy_run / "config.json").read_text())
    cfg["train"]["lr"], cfg["model"]["n_layers"] = 0.5, 7
    (copy_run / "config.json").write_text(json.dumps(cfg))
    assert loop.config_edits(path, ckpts) == f"model.n_layers: {OVERRIDES.get('model.n_layers', 2)!r} → 7, " \
        f"train.lr: {the_config('x').train.lr!r} → 0.5"
    (copy_run / "config.json").write_text("{not json")
    assert loop.config_edits(path, ckpts) == "it no longer reads as JSON"
    assert loop.config_edits(path, str(copy_run / "no-checkpoints")) == ""


def test_steps_past_the_int32_counter_are_refused_up_front(tiny_data, tmp_path, capfd):
    workdir = tmp_path / "wd"
    assert train_cli.main(argv(tiny_data, workdir, **{"train.steps": 10**12})) == 2
    [line] = errors(capfd.readouterr().err)
    assert "train.steps resolves to 1,000,000,000,000, more than the 2,147,483,647 steps" in line, line
    assert not workdir.exists()


def test_the_environment_is_input(monkeypatch):
    """A bucket URL without its fsspec package names the extra; JAX_PLATFORMS is named only when
    JAX's backend really does not start; a bad ONONA_* value names the variable."""
    from onona_jax import cli

    missing = ImportError("Please install gcsfs to access Google Storage")
    missing.__cause__ = ModuleNotFoundError("No module named 'gcsfs'", name="gcsfs")
    assert cli.environment_failure(missing) == ("gs:// paths need gcsfs, which is not installed here; install the "
                                                "extra: pip install -e '.[gcs]' (or pip install gcsfs)")
    assert "pip install -e '.[cloud]'" in cli.environment_failure(ImportError("Install s3fs to access S3"))
    assert cli.environment_failure(ImportError("no module named foo")) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cli.environment_failure(RuntimeError("something else")) is None  # cpu starts: not the cause
    for name, value in (("ONONA_DISTRIBUTED", "yes"), ("ONONA_LOCK_LEASE_S", "-3")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"^{name}={value!r}"):
            cli.check_environment()
        monkeypatch.delenv(name)
    cli.check_environment()


def test_outputs_onto_a_mount_point_are_refused_before_the_work(tmp_path, monkeypatch):
    """export and prepare build their folder beside the target and rename it into place, which a
    mount point (here a bind mount, which os.path.ismount cannot see) cannot take."""
    from onona_jax.data import prepare

    volume = tmp_path / "volume"
    volume.mkdir()
    monkeypatch.setattr(paths, "mount_points", lambda: {str(volume)})
    with pytest.raises(ValueError, match=f"--output={volume} is a mount point .* --output={volume}/export$"):
        paths.check_rename_target(volume, "--output", "export")
    with pytest.raises(ValueError, match="is a mount point"):
        prepare.prepare([str(tmp_path / "in.txt")], str(volume), 0.1, 1000, 0)
    paths.check_rename_target(volume / "export", "--output", "export")  # a folder inside it is fine
    assert list(volume.iterdir()) == []


def test_export_onto_a_full_disk_is_an_oserror(tmpfs, tmp_path):
    """safetensors reports a full disk as its own SafetensorError; the export's writer turns it
    into OSError(ENOSPC), which export.py's one error line catches."""
    from onona_jax.serve import hf_format

    disk = tmpfs(tmp_path / "disk", "64k")
    with pytest.raises(OSError) as err:
        hf_format._save_safetensors({"w": np.zeros((256, 256), np.float32)}, str(disk / "model.safetensors"))
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(disk / "model.safetensors")


# ----------------------------------------------------------------------------- 6. validation


# (overrides, words of the one error line). NaN and inf are refused for any key, one the run
# reads or not (model.moe.* on a dense model); ranges for every value a step reads. MoE and GDN
# keys are checked when the model has such layers: those rows set model.arch (or a pattern with GDN).
BAD_VALUES = [
    ({"train.b1": "nan"}, "train.b1=nan is not a finite number"),
    ({"train.weight_decay": "nan"}, "train.weight_decay=nan is not a finite number"),
    ({"train.grad_clip": "nan"}, "train.grad_clip=nan is not a finite number"),
    ({"model.rope_theta": "nan"}, "model.rope_theta=nan is not a finite number"),
    ({"model.norm_eps": "nan"}, "model.norm_eps=nan is not a finite number"),
    ({"train.lr": "inf"}, "train.lr=inf is not a finite number"),
    ({"train.final_lr": "-inf"}, "train.final_lr=-inf is not a finite number"),
    ({"model.moe.aux_coef": "nan"}, "model.moe.aux_coef=nan is not a finite number"),
    ({"train.tokens_per_param": "inf"}, "train.tokens_per_param=inf is not a finite number"),
    ({"train.grad_clip": -1}, "train.grad_clip=-1.0 must be positive (the largest global gradient norm) or 0"),
    ({"train.b1": -0.1}, "train.b1=-0.1 must lie in [0, 1)"),
    ({"train.b2": 2.0}, "train.b2=2.0 must lie in [0, 1)"),
    ({"train.b2": 1.0}, "train.b2=1.0 must lie in [0, 1)"),
    ({"train.eps": -1}, "train.eps=-1.0 must be positive"),
    ({"train.eps": 0}, "train.eps=0.0 must be positive"),
    ({"train.weight_decay": -0.1}, "train.weight_decay=-0.1 must be zero (off) or positive"),
    ({"train.steps": -5}, "train.steps=-5 must be positive"),
    ({"train.steps": 0, "train.tokens_per_param": 0}, "train.tokens_per_param=0.0 must be positive when train.steps=0"),
    ({"train.lr": -1e-3}, "train.lr=-0.001 must be positive"),
    ({"train.lr": 0.0}, "train.lr=0.0 must be positive"),
    ({"train.final_lr": -1e-4}, "train.final_lr=-0.0001 must lie in [0, train.lr=0.003]"),
    ({"train.final_lr": 0.01}, "train.final_lr=0.01 must lie in [0, train.lr=0.003]"),
    ({"train.warmup_steps": -1}, "train.warmup_steps=-1 must be zero or positive"),
    ({"train.decay_fraction": 1.5}, "train.decay_fraction=1.5 must lie in [0, 1]"),
    ({"train.global_batch": 0}, "train.global_batch=0 must be positive"),
    ({"train.micro_batch": -1}, "train.micro_batch=-1 must be positive, or 0"),
    ({"train.checkpoint_every": 0}, "train.checkpoint_every=0 must be positive"),
    ({"train.log_every": 0}, "train.log_every=0 must be positive"),
    ({"train.eval_every": 0}, "train.eval_every=0 must be positive"),
    ({"train.keep_checkpoints": 0}, "train.keep_checkpoints=0 must be positive"),
    ({"train.checkpoint_minutes": -1}, "train.checkpoint_minutes=-1.0 must be positive (minutes between timer "
     "saves, besides train.checkpoint_every's) or 0 (no timer saves)"),
    ({"train.checkpoint_minutes": "nan"}, "train.checkpoint_minutes=nan is not a finite number"),
    ({"train.peak_tflops": -1}, "train.peak_tflops=-1.0 must be positive (per device, for MFU) or 0"),
    ({"model.rope_theta": 0}, "model.rope_theta=0.0 must be positive"),
    ({"model.norm_eps": -1e-6}, "model.norm_eps=-1e-06 must be positive"),
    ({"model.mos_components": 0}, "model.mos_components=0 must be at least 1"),
    ({"model.loss_token_tile": -1}, "model.loss_token_tile=-1: a positive number of tokens, or 0 for the platform's default"),
    ({"model.arch": "moe", "model.moe.n_experts": 0}, "model.moe.n_experts=0 must be at least 1"),
    ({"model.arch": "moe", "model.moe.top_k": 0}, "model.moe.top_k=0 must be in 1..n_experts (8)"),
    ({"model.arch": "moe", "model.moe.top_k": 9}, "model.moe.top_k=9 must be in 1..n_experts (8)"),
    ({"model.arch": "moe", "model.moe.d_expert": 0}, "model.moe.d_expert=0 must be positive"),
    ({"model.arch": "moe", "model.moe.capacity_factor": -0.5}, "model.moe.capacity_factor=-0.5 must be positive"),
    ({"model.arch": "moe", "model.moe.eval_capacity_factor": -1}, "model.moe.eval_capacity_factor=-1.0 must be positive"),
    ({"model.arch": "moe", "model.moe.aux_coef": -0.1}, "model.moe.aux_coef=-0.1 must be zero"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.chunk": 0}, "model.gdn.chunk=0 must be positive"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.conv_kernel": 0}, "model.gdn.conv_kernel=0 must be positive"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.head_dim_k": 0}, "model.gdn.head_dim_k=0 must be positive"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.precision": "bf16"},
     "model.gdn.precision 'bf16': one of default, highest"),
    ({"model.arch": "attnres", "model.attnres.block_size": 0}, "model.attnres.block_size=0 must be ≥ 1"),
    ({"data.seq_len": 0}, "data.seq_len=0 must be positive"),
    ({"data.seed": -1}, "data.seed=-1 must lie in [0, 2**32)"),
    ({"seed": 2**32}, "seed=4294967296 must lie in [0, 2**32)"),
    ({"eval.seed": -1}, "eval.seed=-1 must be zero or positive"),
    ({"eval.windows": 0}, "eval.windows=0 must be positive"),
    ({"eval.batch": 0}, "eval.batch=0 must be positive"),
    ({"mesh.fsdp": 0}, "mesh.fsdp=0 must be positive, or -1"),
    ({"mesh.tensor": -2}, "mesh.tensor=-2 must be positive, or -1"),
    ({"mesh.fsdp": -1}, "mesh.data=-1, mesh.fsdp=-1, mesh.expert=1, mesh.tensor=1: at most one mesh axis may be -1"),
]


@pytest.mark.parametrize("overrides,words", BAD_VALUES,
                         ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _ in BAD_VALUES])
def test_bad_values_rejected_before_any_write(tiny_data, tmp_path, capfd, overrides, words):
    """Exit 2, the one error line naming the key and its range, before anything is compiled
    or written (the workdir is not created)."""
    workdir = tmp_path / "wd"
    assert train_cli.main(argv(tiny_data, workdir, **overrides)) == 2
    [line] = errors(capfd.readouterr().err)
    assert words in line, line
    assert not workdir.exists()


def test_every_float_key_is_checked_for_finite_values():
    """The finite check walks the whole config: NaN in each float key of base_config() (a key
    added later included) is refused naming that key."""
    cfg = the_config("/nonexistent")
    floats = [k for k, v in config_lib.flatten(cfg).items() if isinstance(v, float)]
    assert len(floats) >= 15
    for key in floats:
        bad = the_config("/nonexistent")
        *path, leaf = key.split(".")
        node = bad
        for p in path:
            node = node[p]
        node[leaf] = float("nan")
        with pytest.raises(ValueError, match=rf": {re.escape(key)}=nan is not a finite number"):
            config_lib.validate(bad)


def test_grad_clip_0_is_no_clipping():
    """train.grad_clip=0 turns clipping off: the update equals the unclipped AdamW's (optax's
    clip_by_global_norm(0) would zero it), while 1.0 clips this gradient (norm 55)."""
    import jax.numpy as jnp
    import optax

    from onona_jax.train import optimizer

    cfg = the_config("/nonexistent")
    params = {"w": jnp.full((4, 4), 0.5), "b": jnp.zeros(4)}
    logical = {"w": jax.sharding.PartitionSpec("embed", "mlp"), "b": jax.sharding.PartitionSpec("embed")}
    grads = {"w": jnp.full((4, 4), 10.0), "b": jnp.arange(4.0) * 10}

    def update(tx):
        def two_steps():  # the second sees the first's moments
            state = tx.init(params)
            for _ in range(2):
                updates, state = tx.update(grads, state, params)
            return updates
        return jax.jit(two_steps)()

    def ours(grad_clip):
        cfg.train.grad_clip = grad_clip
        return update(optimizer.make_optimizer(cfg, 10, logical)[0])

    expected = update(optax.adamw(optimizer.schedule(cfg, 10), b1=cfg.train.b1, b2=cfg.train.b2, eps=cfg.train.eps,
                                  weight_decay=cfg.train.weight_decay, mask=optimizer.decay_mask(logical)))
    off = ours(0.0)
    for k in params:
        np_off, np_expected = jax.device_get(off[k]), jax.device_get(expected[k])
        assert (np_off == np_expected).all(), k
        assert abs(np_off).max() > 0
    clipped = ours(1.0)
    assert any((jax.device_get(clipped[k]) != jax.device_get(expected[k])).any() for k in params)


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


@pytest.mark.slow  # ~20 s; the default suite's lock tests hold the lock from a few lines of Python
def test_two_train_processes_on_one_workdir(tiny_data, tmp_path):
    """The issue's reproduction: a second train.py (another lr) started while the first runs
    exits 2 naming the first; the first finishes alone (metrics.jsonl holds one run)."""
    workdir = tmp_path / "wd"
    first = subprocess.Popen([sys.executable, "train.py", *argv(tiny_data, workdir, **ONE_DEVICE, **{"train.steps": 6})],
                             cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "lock.json").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "train.py", *argv(tiny_data, workdir, **ONE_DEVICE,
                                **{"train.steps": 6, "train.lr": 1e-3})], cwd=REPO, env=train_env(), capture_output=True, text=True,
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
