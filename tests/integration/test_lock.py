"""One writer per workdir (lock.json; issue 12 item 1): a second train.py, import_hf or sweep
exits 2 naming the holder and writes nothing, whether the holder is in another PID namespace or
the checkpoints are reached through a symlink; a killed holder's lock is free at once;
`--break_lock` never takes a live holder's lock; in a bucket, a live holder's lease is renewed
and kept, a killed one's taken after the lease, and a holder that cannot renew stops.
"""

import errno
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import train as train_cli
from conftest import REPO, tiny_config
from onona_jax import paths
from onona_jax.train import lock as lock_lib
from onona_jax.train.lock import WorkdirLock
from run_fixtures import ONE_DEVICE, argv, errors, train_env, tree_digest
from run_fixtures import copy_run, run_dir  # noqa: F401 - fixtures


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
    lock.raise_if_lost()  # reading lock.json above did not release it (a POSIX lock would have been)
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
    within one heartbeat and `raise_if_lost()` stops it."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "0.4")
    lock = WorkdirLock(str(tmp_path)).acquire()
    (tmp_path / "lock.json").unlink()
    assert until(lambda: lock.lost is not None)
    with pytest.raises(lock_lib.LockLost, match=r"lock.json was removed or replaced while this run held it"):
        lock_lib.raise_if_lost()
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
    """The store unreachable for more than half the lease (the emulator paused): `raise_if_lost()` raises
    LockLost (the training loop calls it at every step), well before another process could take
    the lease. A lease taken away (the object removed) is noticed at the next renewal."""
    monkeypatch.setenv("ONONA_LOCK_LEASE_S", "1")
    wd = f"{fake_gcs}/wd"
    lock = WorkdirLock(wd).acquire()
    with _gcs_emulator.lock:  # every request waits
        time.sleep(0.8)
        with pytest.raises(lock_lib.LockLost, match=r"lost its lock on gs:.*: its lease on .*lock.json has not "
                           r"been renewed for [\d.]+ s of its 1 s"):
            lock_lib.raise_if_lost()
    assert until(lambda: lock_lib.raise_if_lost() is None)  # renewed again, and nobody took it meanwhile
    paths.remove(f"{wd}/lock.json")
    assert until(lambda: lock.lost == f"{wd}/lock.json was removed")
    with pytest.raises(lock_lib.LockLost, match=r"lock.json was removed"):
        lock_lib.raise_if_lost()
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
