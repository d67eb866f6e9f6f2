"""The libraries' own reports of a checkpoint failure, kept off stderr through each one's controls
(the command reports it, in one `error:` line or warning paragraph); `quiet_orbax()` installs them.

- Orbax logs through absl's and the root logger (a failed writer thread its traceback, at ERROR,
  which `cli.run`'s absl verbosity passes): records from orbax's files are dropped there. asyncio
  logs "Task exception was never retrieved" as it collects a failed task, maybe at exit: Orbax's
  and a failed array read's are dropped.
- No logger carries the rest, so one filter sits at sys.excepthook and sys.unraisablehook:
  TensorStore calls back into the event loop of the Orbax thread that started a write or read,
  and after a failure ended that loop, reports the RuntimeError('Event loop is closed') of its
  `call_soon_threadsafe` through sys.excepthook; a failed read's coroutines, finalized late, print
  "Exception ignored in <coroutine ...>" through sys.unraisablehook. Only those go.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback


def _failed_read(err: BaseException | None) -> bool:
    """An array read's error from a damaged step (Orbax's or TensorStore's words), or a closed loop's."""
    text = str(err)
    return ("Encountered error while reading array" in text or "Event loop is closed" in text
            or bool(re.match(r'[A-Z_]+: Error (opening|reading) "', text)))


def _not_orbax(record: logging.LogRecord) -> bool:
    """False for a record logged from orbax's files, or for asyncio's report of an Orbax task (its
    message names the coroutine's file) or of a failed array read."""
    message = record.getMessage()
    return "/orbax/" not in record.pathname.replace("\\", "/") and not (
        "exception was never retrieved" in message
        and ("/orbax/" in message or _failed_read(record.exc_info and record.exc_info[1])))


def _closed_loop_callback(err, tb) -> bool:
    """RuntimeError('Event loop is closed') raised in `call_soon_threadsafe`."""
    return (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"
            and any(frame.f_code.co_name == "call_soon_threadsafe" for frame, _ in traceback.walk_tb(tb)))


def _filtered(name: str, previous):
    """sys.`name` (excepthook or unraisablehook) less the reports the module docstring names."""
    def excepthook(kind, value, tb):
        if not _closed_loop_callback(value, tb):
            previous(kind, value, tb)

    def unraisablehook(unraisable):
        where = f"{getattr(unraisable.object, '__qualname__', '')} {unraisable.object!r}"
        if not (_failed_read(unraisable.exc_value) or "orbax" in where or "_read_array" in where):
            previous(unraisable)

    hook = excepthook if name == "excepthook" else unraisablehook
    hook.previous, hook.quiets_orbax = previous, True
    return hook


def chain(hook):
    """`hook` and those below it, each naming the one it calls `.previous` (as cli's SIGINT hook does)."""
    seen = set()
    while hook is not None and id(hook) not in seen:
        yield hook
        seen.add(id(hook))
        hook = getattr(hook, "previous", None)


def in_chain(hook, target) -> bool:
    """Whether `target` is `hook` or below it (installed on top again, it would make a circle)."""
    return any(h is target for h in chain(hook))


def quiet_orbax() -> None:
    """Install the filters above, each once (again, or under a hook chained on top since: no change)."""
    for name in ("absl", "", "asyncio"):
        if _not_orbax not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_not_orbax)
    for name in ("excepthook", "unraisablehook"):
        if not any(getattr(h, "quiets_orbax", False) for h in chain(getattr(sys, name))):
            setattr(sys, name, _filtered(name, getattr(sys, name)))
