"""SIGINT while `command.run` runs: the first stops the command cleanly, the second exits at once.

The first SIGINT: where the command registered a graceful stop (`graceful_stop`: the training
loop finishes the step in flight and saves it, as on SIGTERM) it only sets that stop's flag;
elsewhere it raises `Interrupted` in the main thread, which `finally` blocks and staging
directories clean up after, and `run` turns into one line `error: interrupted; <what was and was
not written, how to resume>`. The second exits at once (`os._exit(130)`, one line), waiting for
nothing: a watcher thread reads the signal from `signal.set_wakeup_fd`, so even a main thread
busy in native code (an XLA compile) is no wait. After an interruption `exit_process` (the
`__main__` path) leaves with `os._exit`, so no worker thread (Orbax's writers, the data
pipeline's) can hold the process open at interpreter shutdown.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time

from onona_jax.library_logs import in_chain as _in_chain

INTERRUPTED = 130  # the exit status of a command stopped by SIGINT (128 + 2, as a shell reports it)


class Interrupted(BaseException):
    """The first SIGINT where no graceful stop is registered (`graceful_stop`), or a command's
    own stop after it: `run` prints `error: interrupted; <text>` and returns 130. The text says
    what was and was not written and how to resume (re-raise with a better one where a command
    knows). A BaseException, so that no `except Exception` swallows it."""

    def __init__(self, detail: str = "nothing was written; rerun the same command to start again"):
        super().__init__(detail)


class GracefulStop:
    """A registered stop (`graceful_stop`): the first SIGINT sets `requested` (and calls
    `on_first`) instead of raising; the command stops at its next safe point. `on_second`: run
    by the second SIGINT just before the process exits (a sweep kills its child run)."""

    def __init__(self, on_first=None, on_second=None):
        self.requested = False
        self.on_first, self.on_second = on_first, on_second

    def request(self):
        self.requested = True
        if self.on_first is not None:
            self.on_first()

    def raise_if_requested(self, detail: str | None = None):
        """Raise `Interrupted(detail)` if a SIGINT came (a safe point)."""
        if self.requested:
            raise Interrupted(*(() if detail is None else (detail,)))


class _Sigint:
    """SIGINT's state while `run` runs (one command at a time in a process)."""

    def __init__(self):
        self.depth = 0  # nested `run` calls: the outermost installs the handler
        self.handled = 0  # SIGINTs the main thread's handler has run for (several may coalesce into one)
        self.seen = 0  # SIGINTs the watcher has read (one byte each): the true count
        self.stops: list[GracefulStop] = []  # registered graceful stops, innermost last
        self.exiting = threading.Lock()
        self.pipe = None  # (read fd, write fd) of set_wakeup_fd, made once per process
        self.redelivered = 0  # the first SIGINT delivered again (`_unraisable`): not a second one
        self.pending = 0  # of those, the ones the handler has not run for yet


_SIGINT = _Sigint()
AT_ONCE = ("error: interrupted again; exiting at once, leaving the work in flight unfinished (a partial "
           "checkpoint or output is never used: rerun the same command to resume or start again)")


def interrupted() -> bool:
    """Whether a SIGINT came during the current (or last) `run`."""
    return bool(_SIGINT.handled or _SIGINT.seen)


def _exit_at_once():
    """The second SIGINT: one line, then `os._exit(130)`; waits for nothing (not even the locks
    of sys.stderr, which the main thread may hold: the line goes to fd 2 directly)."""
    if not _SIGINT.exiting.acquire(blocking=False):
        return  # another thread is exiting already
    for stop in list(_SIGINT.stops):
        if stop.on_second is not None:
            try:
                stop.on_second()
            except BaseException:  # noqa: BLE001 - exiting regardless
                pass
    try:
        os.write(2, ("\n" + AT_ONCE + "\n").encode())  # (a line of its own: a progress bar may hold the last)
    except OSError:
        pass
    os._exit(INTERRUPTED)


def _on_sigint(signum, frame):
    if _SIGINT.pending:
        _SIGINT.pending -= 1
    else:
        _SIGINT.handled += 1
    if _SIGINT.handled >= 2 or _SIGINT.seen - _SIGINT.redelivered >= 2:
        _exit_at_once()
    if _SIGINT.stops:
        _SIGINT.stops[-1].request()
    else:
        raise Interrupted()


def _unraisable(unraisable):
    """`Interrupted` raised where Python can only print and ignore it (a gc callback such as
    JAX's, a `__del__`, a weakref callback): delivered again, to land in the code around it."""
    if isinstance(unraisable.exc_value, Interrupted) and _SIGINT.depth:
        # By the watcher thread, a moment later: from here the handler would run again at once, inside
        # the same callback (and starting a thread here would be cut as well).
        _SIGINT.pending += 1
        try:
            os.write(_SIGINT.pipe[1], b"\0")
        except OSError:
            pass
        return
    _unraisable.previous(unraisable)


_unraisable.previous = sys.unraisablehook  # the hook it calls: set where `sigint_handling` installs it


def _watch(fd: int):
    """The second SIGINT's watcher: Python's own C-level handler writes each signal's number to
    the wakeup fd as it arrives, whatever the main thread is doing."""
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if _SIGINT.depth:
            for _ in range(data.count(0)):  # `_unraisable` asks for the first SIGINT again
                time.sleep(0.001)
                _SIGINT.redelivered += 1  # (before the delivery writes its byte)
                _thread.interrupt_main(signal.SIGINT)
            _SIGINT.seen += data.count(int(signal.SIGINT))
            if _SIGINT.seen - _SIGINT.redelivered >= 2:  # (`_unraisable`'s own deliveries are not the user's)
                _exit_at_once()


@contextlib.contextmanager
def sigint_handling():
    """`run`'s SIGINT handling (module docstring), in the main thread only (elsewhere Python
    allows no signal handler: a library call of `run` from a thread keeps the process's)."""
    if _SIGINT.depth or threading.current_thread() is not threading.main_thread():
        _SIGINT.depth += bool(_SIGINT.depth)
        try:
            yield
        finally:
            _SIGINT.depth -= bool(_SIGINT.depth)
        return
    if _SIGINT.pipe is None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        _SIGINT.pipe = (r, w)
        threading.Thread(target=_watch, args=(r,), name="onona-sigint-watcher", daemon=True).start()
    _SIGINT.handled = _SIGINT.seen = _SIGINT.redelivered = _SIGINT.pending = 0
    _SIGINT.stops = []
    # Once in the chain: an earlier run's hook left under a hook chained to it since (a checkpoint
    # read's filter), installed again on top, would chain to itself in a circle.
    installed = not _in_chain(sys.unraisablehook, _unraisable)
    if installed:
        _unraisable.previous, sys.unraisablehook = sys.unraisablehook, _unraisable
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        previous_fd = signal.set_wakeup_fd(_SIGINT.pipe[1], warn_on_full_buffer=False)
    except ValueError:
        previous_fd = None
    _SIGINT.depth = 1
    try:
        yield
    finally:
        _SIGINT.depth = 0
        if previous_fd is not None:
            signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous)
        if installed and sys.unraisablehook is _unraisable:  # (else another hook chained to it since: left)
            sys.unraisablehook = _unraisable.previous


@contextlib.contextmanager
def graceful_stop(on_first=None, on_second=None):
    """While inside, the first SIGINT sets the yielded `GracefulStop`'s `requested` (and calls
    `on_first`) instead of raising `Interrupted`: the block stops at its next safe point
    (`GracefulStop.raise_if_requested`, or its own test of `requested`). The innermost registered wins."""
    stop = GracefulStop(on_first, on_second)
    _SIGINT.stops.append(stop)
    try:
        yield stop
    finally:
        _SIGINT.stops.remove(stop)


def exit_process(status: int):
    """`sys.exit(status)` for a `__main__`; after a SIGINT, `os._exit(status)` once stdout and
    stderr are flushed: the command has stopped as the interruption asked, and no thread left
    running (an Orbax writer whose start the interruption cut, a data pipeline's reader) may
    then hold the process open at interpreter shutdown."""
    if interrupted():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)
    sys.exit(status)
