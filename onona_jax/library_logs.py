"""What the libraries under the checkpoints print besides their exceptions, kept off stderr with
the controls each one offers. A command reports an Orbax failure itself (one `error:` line, or
one warning paragraph when it falls back to an older step), so the libraries' own account of it
would only repeat it, as tracebacks. `quiet_orbax()` installs it all, once per process.

- Orbax logs through absl (the "absl" logger) and, in a few modules, Python's root logger: every
  record logged from a file of the orbax package is dropped at those two loggers (a failed
  writer thread logs its traceback at ERROR; absl's verbosity, `cli.run`'s, is ERROR, as other
  absl users' records should still show). Every other record passes.
- asyncio reports a task whose exception nobody retrieved when the task is collected, maybe at
  exit: Orbax's own tasks (a failed save's other writes) and a failed read's per-array tasks
  are dropped at the "asyncio" logger. Every other task's report passes.
- The one filter outside logging, at sys.excepthook and sys.unraisablehook, for what no logger
  carries: TensorStore completes each read or write by calling back into the event loop of the
  Orbax thread that started it, and after a failure ended that loop the callback raises
  RuntimeError('Event loop is closed') in `call_soon_threadsafe`, which TensorStore reports
  through sys.excepthook from its own threads; and a failed read's coroutines, finalized late,
  print "Exception ignored in <coroutine ...>" (with TensorStore's spec) through
  sys.unraisablehook. Exactly those are dropped; every other exception reaches the hook below.
"""

from __future__ import annotations

import logging
import os
import re
import sys


def _from_orbax(text: str) -> bool:
    return "/orbax/" in text.replace(os.sep, "/")


def _failed_read(err: BaseException | None) -> bool:
    """True for the error of one array read of a damaged checkpoint (Orbax's wrapper, or
    TensorStore's own status: 'OUT_OF_RANGE: Error opening "zarr" driver: Error reading ...'),
    or for a read's completion callback into its closed event loop."""
    text = str(err)
    return ("Encountered error while reading array" in text or "Event loop is closed" in text
            or bool(re.match(r'[A-Z_]+: Error (opening|reading) "', text)))


def _not_orbax_record(record: logging.LogRecord) -> bool:
    return not _from_orbax(record.pathname)


def _not_orbax_task(record: logging.LogRecord) -> bool:
    """False for asyncio's "Task exception was never retrieved" of an Orbax coroutine (its
    message names the coroutine's file) or of a failed array read."""
    err = record.exc_info[1] if record.exc_info else None
    message = record.getMessage()
    return not ("exception was never retrieved" in message and (_from_orbax(message) or _failed_read(err)))


def _closed_loop_callback(err, tb) -> bool:
    """True for asyncio's RuntimeError('Event loop is closed') raised in `call_soon_threadsafe`:
    a completion callback into an event loop that already ended."""
    if not (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"):
        return False
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def _filtered(name: str, previous):
    """sys.excepthook or sys.unraisablehook (`name`) less the reports of the module docstring's
    last item, passing every other one to `previous`."""
    if name == "excepthook":
        def hook(kind, value, tb):
            if not _closed_loop_callback(value, tb):
                previous(kind, value, tb)
    else:
        def hook(unraisable):
            where = f"{getattr(unraisable.object, '__qualname__', '')} {unraisable.object!r}"
            if not (_closed_loop_callback(unraisable.exc_value, unraisable.exc_traceback)
                    or _failed_read(unraisable.exc_value) or "orbax" in where or "_read_array" in where):
                previous(unraisable)
    hook.previous, hook.quiets_orbax = previous, True
    return hook


def chain(hook):
    """`hook` and the hooks below it, in a chain of hooks that name the one they call as
    `.previous` (these and cli's SIGINT hook do); a circle is walked once."""
    seen = set()
    while hook is not None and id(hook) not in seen:
        yield hook
        seen.add(id(hook))
        hook = getattr(hook, "previous", None)


def in_chain(hook, target) -> bool:
    """Whether `target` is `hook` or below it (installing it on top again would make a circle)."""
    return any(h is target for h in chain(hook))


def quiet_orbax() -> None:
    """Install the filters above, each once (calling it again, or after another hook chained on
    top of ours, changes nothing)."""
    for name, keep in (("absl", _not_orbax_record), ("", _not_orbax_record), ("asyncio", _not_orbax_task)):
        if keep not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(keep)
    for name in ("excepthook", "unraisablehook"):
        if not any(getattr(h, "quiets_orbax", False) for h in chain(getattr(sys, name))):
            setattr(sys, name, _filtered(name, getattr(sys, name)))
