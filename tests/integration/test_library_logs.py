"""onona_jax/library_logs.py: Orbax's, asyncio's and TensorStore's own reports of a checkpoint
failure stay off stderr, and the failure itself still reaches the user as the command's one
`error:` line (or its one warning paragraph when it falls back). The commands run as
subprocesses, so what the interpreter prints at exit counts too."""

import logging
import re
import subprocess
import sys
import types

import pytest
from conftest import REPO
from run_fixtures import (ONE_DEVICE, argv, copy_run, damage_arrays, run_dir, tmpfs,  # noqa: F401 - fixtures
                          train_env)

from onona_jax import library_logs

ORBAX_FILE = "/site-packages/orbax/checkpoint/_src/futures/future.py"


def eval_py(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval.py", *args, "--mesh=1,1,1"], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=300)


def test_a_damaged_step_asked_for_is_its_one_error_line(copy_run):  # noqa: F811 - the fixture
    """eval.py --step=4 of a step whose biggest array file is cut short: TensorStore's read
    error, through Orbax, is the whole of stderr: one `error:` line, exit 1."""
    damage_arrays(copy_run, 4)
    p = eval_py(f"--workdir={copy_run}", "--step=4")
    assert p.returncode == 1, p.stderr[-3000:]
    [line] = p.stderr.splitlines()
    assert line.startswith(f"error: checkpoint at step 4 in {copy_run}/checkpoints could not be read (") and \
        line.endswith("); omit --step to use the newest readable one (steps: [2, 4])"), p.stderr
    assert "could not be read (Exception: Encountered error while reading array index: (" in line, line  # Orbax's


def test_a_damaged_newest_step_is_one_warning_and_no_library_noise(copy_run, tmp_path):  # noqa: F811
    """eval.py of a run whose newest step is damaged: it evaluates step 2. Orbax's INFO and
    WARNING lines, its failed read's task reports and TensorStore's callbacks into the closed
    event loop print nothing: stderr is the warning, the step used and the file written."""
    damage_arrays(copy_run, 4)
    p = eval_py(f"--workdir={copy_run}", f"--output={tmp_path / 'eval.json'}")
    assert p.returncode == 0, p.stderr[-3000:]
    warning, used, wrote = p.stderr.splitlines()
    assert warning.startswith("warning: checkpoint at step 4 could not be restored (") and warning.endswith(
        "; left in place (this command only reads) and falling back to the one before"), p.stderr
    assert used == f"using checkpoint step 2 of {copy_run} (the newest readable one)", p.stderr
    assert wrote == f"wrote {tmp_path / 'eval.json'}", p.stderr


@pytest.mark.slow  # ~1 min: train.py compiles and trains until its first save
def test_a_save_onto_a_full_disk_is_its_one_error_line(tiny_data, tmp_path, tmpfs):  # noqa: F811 - the fixture
    """train.py whose first checkpoint does not fit its disk: Orbax's writer threads fail (each
    logs its traceback through absl) and TensorStore's writes still in flight call back into
    their closed event loop (dozens of "Event loop is closed" tracebacks through sys.excepthook).
    None of it is printed: stderr is the progress bar and the run's one `error:` line, exit 1."""
    disk = tmpfs(tmp_path / "disk", "20m")  # the start-up fits, a checkpoint (~40 MB) does not
    ckpts = disk / "run" / "checkpoints"
    p = subprocess.run([sys.executable, "train.py", *argv(tiny_data, disk / "run", **ONE_DEVICE, **{"train.steps": 6})],
                       cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr[-3000:]
    [line] = [x for x in re.split(r"[\r\n]", p.stderr) if x.strip() and not x.startswith("dense-tiny-standard:")]
    assert line.startswith(f"error: could not write a checkpoint (step 2) to {ckpts} (No space left on device; "
                           "ValueError: RESOURCE_EXHAUSTED: Error writing ") and line.endswith(
        "); stopping. The last good checkpoint (step none) is intact; free space or fix the directory's permissions, "
        "then rerun the same command to resume"), p.stderr[-3000:]


def record(pathname: str, level=logging.ERROR) -> logging.LogRecord:
    try:
        raise RuntimeError("a writer thread failed")
    except RuntimeError:
        return logging.LogRecord("absl", level, pathname, 1, "Failed to run Commit operations", None, sys.exc_info())


def test_orbax_records_are_dropped_and_others_pass():
    library_logs.quiet_orbax()
    absl = logging.getLogger("absl")
    assert not absl.filter(record(ORBAX_FILE)) and not absl.filter(record(ORBAX_FILE, logging.WARNING))
    assert absl.filter(record("/site-packages/etils/epath/gpath.py"))
    assert logging.getLogger().filter(record("/work/onona_jax/train/loop.py"))


def closed_loop_error():
    """RuntimeError('Event loop is closed') from `call_soon_threadsafe`, as a TensorStore
    completion callback raises it."""
    import asyncio

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as err:
        return err


def test_the_hooks_drop_only_callbacks_into_a_closed_loop(monkeypatch):
    """Installed once however often it is called; a closed loop's callback error goes, any other
    exception (the same message raised elsewhere included) reaches the hook below."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(str(value)))
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    for _ in range(3):
        library_logs.quiet_orbax()
    assert sys.excepthook.previous.__name__ == "<lambda>" == sys.unraisablehook.previous.__name__
    err = closed_loop_error()
    sys.excepthook(RuntimeError, err, err.__traceback__)
    sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=err, exc_traceback=err.__traceback__,
                                             err_msg=None, object=None))
    elsewhere = RuntimeError("Event loop is closed")
    sys.excepthook(RuntimeError, elsewhere, None)
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("a bug of ours"),
                                             exc_traceback=None, err_msg=None, object=None))
    assert seen == ["Event loop is closed", "a bug of ours"]
