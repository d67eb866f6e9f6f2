"""One command-line convention for every entry point (train.py, eval.py and every
`python -m onona_jax.<module>`): absl flags, with ml-collections config flags where a
command takes a config (`--config=configs/paper.py:<spec> --config.train.lr=...`, as
big_vision and MaxText do; `config.define_flag`), and one `error: <problem and fix>` line
for each anticipated failure, never a traceback.

An entry point defines its flags in a function (returning `config.define_flag`'s explainer
of bad config overrides, if it takes a config) and runs its body through `run`, which
builds a fresh `FlagValues` per call, so several entry points can be imported into one
process and their `main(argv)` called in-process (the tests do):

    def define(fv, argv):
        flags.DEFINE_string("workdir", None, "run directory", flag_values=fv)

    def _main(fv, args):          # args: the positional arguments
        ...

    def main(argv=None) -> int:
        return cli.run(define, _main, argv, __doc__)

`--help` (-h, --helpfull) prints the flags without parsing the rest (a required flag may be
missing) and without importing jax, which takes a minute on a loaded host: an entry point imports
jax, and what imports it (config, models, heads), inside its functions, and its `define` gives
the config flag by `define_config_for_help` when `help_asked(argv)` (tests/integration/test_startup.py).

Exit status: 0 done; 2 bad usage or bad input found before any write (an unknown flag or
config key, a bad value: `ValueError`); 1 an anticipated runtime failure (`Failure`); 130
interrupted (SIGINT, Ctrl-C: `Interrupted`).

SIGINT, while `run` runs: the first stops the command cleanly. Where the command registered a
graceful stop (`graceful_stop`: the training loop finishes the step in flight and saves it, as
on SIGTERM) it only sets that stop's flag; elsewhere it raises `Interrupted` in the main thread,
which `finally` blocks and staging directories clean up after, and `run` turns into one line
`error: interrupted; <what was and was not written, how to resume>`. The second exits at once
(`os._exit(130)`, one line), waiting for nothing: a watcher thread reads the signal from
`signal.set_wakeup_fd`, so even a main thread busy in native code (an XLA compile) is no wait.
After an interruption `exit` (the `__main__` path) leaves with `os._exit`, so no worker thread
(Orbax's writers, the data pipeline's) can hold the process open at interpreter shutdown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from absl import flags


class Failure(RuntimeError):
    """An anticipated runtime failure (a failed write, a non-finite loss): exit status 1."""


class UsageError(ValueError):
    """Bad usage: exit status 2."""


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

    def check(self, detail: str | None = None):
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


_unraisable.previous = sys.unraisablehook  # the hook it calls: set where `_sigint_handling` installs it


def _in_chain(hook, target) -> bool:
    """Whether `target` is `hook` or below it in a chain of hooks that name the one they call
    (`.previous`: ours do)."""
    seen = set()
    while hook is not None and id(hook) not in seen:
        if hook is target:
            return True
        seen.add(id(hook))
        hook = getattr(hook, "previous", None)
    return False


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
                import _thread
                import time

                time.sleep(0.001)
                _SIGINT.redelivered += 1  # (before the delivery writes its byte)
                _thread.interrupt_main(signal.SIGINT)
            _SIGINT.seen += data.count(int(signal.SIGINT))
            if _SIGINT.seen - _SIGINT.redelivered >= 2:  # (`_unraisable`'s own deliveries are not the user's)
                _exit_at_once()


@contextlib.contextmanager
def _sigint_handling():
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
    (`GracefulStop.check`, or its own test of `requested`). The innermost registered wins."""
    stop = GracefulStop(on_first, on_second)
    _SIGINT.stops.append(stop)
    try:
        yield stop
    finally:
        _SIGINT.stops.remove(stop)


def probe_writable(directory: str) -> None:
    """Create `directory` and a file in it, now (raises OSError): a read-only or full disk, or a
    bucket without write permission, is found before the work, not inside an asynchronous write."""
    import os
    import socket

    from onona_jax import paths

    probe = paths.join(directory, f".write-test-{socket.gethostname()}-{os.getpid()}")  # one per process
    made = []  # the directories this creates, deepest first: removed again if the probe fails
    if not paths.is_cloud(directory):
        d = os.path.abspath(directory)
        while not os.path.exists(d):
            made.append(d)
            d = os.path.dirname(d)
    try:
        paths.makedirs(directory)
        paths.write_atomic(probe, "ok")
        paths.remove(probe)
    except BaseException:  # (a failure, or a Ctrl-C: `Interrupted`)
        try:
            paths.remove(probe)
        except Exception:  # noqa: BLE001 - not written
            pass
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                break
        raise


def check_output_file(path: str, example: str) -> None:
    """An `--output=PATH` file (local or a bucket) must be writable: found before the work, not
    after it. `example`: a file name for the hint when PATH is a directory."""
    import os

    from onona_jax import paths

    if not path:
        return
    directory = os.fspath(paths.path(paths.absolute(path)).parent)
    try:
        probe_writable(directory)
    except OSError as err:
        raise UsageError(f"--output={path}: cannot write to {directory} ({err.strerror or err}); "
                         "give a writable path") from None
    if paths.isdir(path):
        raise UsageError(f"--output={path} is a directory; give a file path, e.g. {path}/{example}")


def check_output_dir(directory: str, fix: str) -> None:
    """A command's default output directory must be writable: found before the work (a probe
    that leaves nothing behind, not even the directory it made). `fix`: what to give instead."""
    from onona_jax import paths

    made = not paths.isdir(directory)
    try:
        probe_writable(directory)
    except OSError as err:
        raise UsageError(f"cannot write {directory} ({err.strerror or err}), where the result goes by default; "
                         f"give {fix}") from None
    finally:
        if made and not paths.is_cloud(directory):
            import os

            try:
                os.rmdir(directory)
            except OSError:
                pass


def define_mesh(fv, default: str = "-1,1,1"):
    """`--mesh=data,fsdp,tensor`: the mesh a command places a checkpoint on."""
    flags.DEFINE_list("mesh", default.split(","), "data,fsdp,tensor sizes of this run's mesh "
                      "(one may be -1: the rest of the devices)", flag_values=fv)


def mesh(fv) -> tuple[int, int, int]:
    try:
        sizes = tuple(int(x) for x in fv.mesh)
    except ValueError:
        sizes = ()
    if len(sizes) != 3:
        raise UsageError(f"--mesh={','.join(fv.mesh)}: give three integers data,fsdp,tensor, e.g. --mesh=-1,1,1")
    return sizes


def flag_value(argv, name: str, default: str | None = None) -> str | None:
    """The value of `--<name>=V` or `--<name> V` on a command line (the last one given, as absl
    takes it), else `default`: read before the flags are parsed (which config to load, which
    mode's flags to define)."""
    value = default
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg[len(name) + 3:]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


# What asks for the help (absl's spellings: `--helpfull` and `--helpshort` print the same, every
# flag being the command's own).
HELP = ("-h", "--help", "-help", "--helpfull", "-helpfull", "--helpshort", "-helpshort")


def help_asked(argv) -> bool:
    """Whether the command line `argv` (after the program) asks for --help. The help is then
    printed without parsing (a required flag may be missing) and without importing jax (seconds
    to a minute on a loaded host): a command's `define` defines its config flag with
    `define_config_for_help` instead. The flags after `--` are a sweep's, not ours."""
    for arg in argv:
        if arg == "--":
            return False
        if arg in HELP or (arg.startswith(("--help=", "-help=")) and arg.split("=", 1)[1].lower() in ("true", "t", "1")):
            return True
    return False


def define_config_for_help(fv, default: str | None, name: str = "config"):
    """`config.define_flag`'s flag as --help lists it (same name, help, default and group), without
    loading a config, which would import jax."""
    flags.DEFINE_string(name, default, "configs/<file>.py:<arg>", flag_values=fv, module_name="onona_jax.config")


def run(define, main, argv=None, doc: str = "", prog: str | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) with the flags `define(fv, argv)` declares, then
    `main(fv, positional args)`; an anticipated failure becomes one `error:` line and its
    exit status."""
    argv = [prog or sys.argv[0], *(sys.argv[1:] if argv is None else list(argv))]
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax logs every file it touches at INFO/WARNING
    fv = flags.FlagValues()
    flags.DEFINE_boolean("help", False, "show this help and exit", flag_values=fv, short_name="h")
    with _sigint_handling():
        try:
            return _run(define, main, argv, doc, fv)
        except Interrupted as err:  # (a second SIGINT never gets here: it exits at once)
            print(f"error: interrupted; {err}", file=sys.stderr)
            return INTERRUPTED


def _run(define, main, argv, doc, fv) -> int:
    try:
        explain = define(fv, argv)
        if help_asked(argv[1:]):  # before parsing: `--help` needs no other flag, not even a required one
            return _print_help(doc, fv)
        try:
            rest = fv(argv)[1:]
        except flags.Error as err:
            raise UsageError(f"{err}; see --help") from None
        except (AttributeError, KeyError) as err:  # a config override of a key that does not exist
            raise UsageError((explain and explain(argv)) or f"bad config override: {err}") from None
        if fv["help"].value:  # (--help from a --flagfile)
            return _print_help(doc, fv)
        result = main(fv, rest)
    except Failure as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # bad usage or bad input, found before any write
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the environment as input: a bucket without its extra, JAX_PLATFORMS
        why = environment_failure(err)
        if why is None:
            raise
        print(f"error: {why}", file=sys.stderr)
        return 2
    return 0 if result is None else int(result)


def _print_help(doc, fv) -> int:
    print((doc or "").strip() + "\n\nflags:\n" + fv.get_help())
    return 0


# The fsspec implementation a URL scheme needs, and the extra that installs it (pyproject.toml).
EXTRAS = {"gcsfs": ("gs://", "gcs"), "s3fs": ("s3://", "cloud")}


def environment_failure(err: BaseException) -> str | None:
    """What the machine lacks, when that is why `err` was raised, or None: a bucket URL whose
    fsspec package is not installed (fsspec's ImportError), or a JAX_PLATFORMS naming a platform
    this machine has not (JAX fails to start its backend). Asked only once something failed."""
    import os

    if isinstance(err, ImportError):
        cause = err.__cause__ if isinstance(err.__cause__, ImportError) else err
        for package, (scheme, extra) in EXTRAS.items():
            if cause.name == package or package in str(err):
                return (f"{scheme} paths need {package}, which is not installed here; install the extra: "
                        f"pip install -e '.[{extra}]' (or pip install {package})")
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if not platforms or "jax" not in sys.modules:
        return None
    try:
        sys.modules["jax"].devices()
    except Exception as failed:  # noqa: BLE001 - the backend JAX_PLATFORMS asked for does not start
        line = (str(failed).strip().splitlines() or [f"no backend of that name started: {type(failed).__name__}"])[0]
        line = line.split(" (set JAX_PLATFORMS=")[0]  # JAX's own hint, said below in our words
        return (f"JAX_PLATFORMS={platforms}: JAX cannot start that platform on this machine ({line}); unset "
                "JAX_PLATFORMS to use what this machine has, or name one it has, e.g. JAX_PLATFORMS=cpu")
    return None


def check_environment() -> None:
    """The ONONA_* variables are input: a bad value is one ValueError naming the variable, before
    anything starts (ONONA_DISTRIBUTED is read before jax.distributed starts)."""
    import os

    value = os.environ.get("ONONA_DISTRIBUTED", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"ONONA_DISTRIBUTED={value!r}: give 1 (join the other hosts JAX discovers: TPU pods, "
                         "SLURM) or 0/unset")
    seconds_from_env("ONONA_LOCK_LEASE_S", "the workdir lock's lease in seconds, e.g. 120")


def seconds_from_env(name: str, what: str) -> float | None:
    """A positive finite number of seconds from the environment variable `name` (None if unset):
    anything else is one ValueError naming the variable and `what` to give."""
    import math
    import os

    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={text!r}: give {what}")
    return value


def accelerators() -> list[str]:
    """What on this machine may be a TPU or a GPU (device nodes, PCI devices), or a TPU set up by
    hand (its variables): where JAX must be left to find it."""
    import glob

    found = [v for v in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "JAX_FORCE_TPU_INIT") if os.environ.get(v)]
    # TPUs: their device nodes (/dev/accel*; /dev/vfio/<group> from v5e on) and any PCI device of
    # Google's vendor id (JAX's own test) but GCE's network card, gVNIC. GPUs: NVIDIA's device
    # nodes, WSL's, AMD's KFD.
    found += glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*") + glob.glob("/dev/nvidia*")
    found += [d for d in ("/dev/dxg", "/dev/kfd") if os.path.exists(d)]
    for pci in glob.glob("/sys/bus/pci/devices/*"):
        try:
            with open(f"{pci}/vendor") as vendor, open(f"{pci}/device") as device:
                if vendor.read().strip() == "0x1ae0" and device.read().strip() != "0x0042":
                    found.append(pci)
        except OSError:
            pass
    return found


def quiet_libtpu() -> None:
    """JAX_PLATFORMS=cpu where JAX would end on the CPU anyway but libtpu would first print its
    start-up errors. Installed (the tpu-aot extra, for `python -m onona_jax.aot`), libtpu is
    tried by JAX on every machine when JAX_PLATFORMS is unset, and on one without a TPU prints
    lines such as `E0000 ... INVALID_ARGUMENT ... libtpu_init_utils.cc` that read as failures.
    Left alone: a JAX_PLATFORMS the user set (JAX_PLATFORMS=tpu on a machine without one still
    fails, libtpu's lines and then our one error line naming the variable), and a machine that may
    have a TPU or a GPU."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None or accelerators():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


def run_module(define, main, doc: str = ""):
    """`sys.exit(run(...))` for `if __name__ == "__main__"` (jax.distributed first; for --help,
    nothing that imports jax)."""
    try:
        check_environment()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if help_asked(sys.argv[1:]):
        exit(run(define, main, None, doc))
    quiet_libtpu()  # before jax is imported: JAX reads JAX_PLATFORMS at import
    with _sigint_handling():  # (jax.distributed may take a while to join: a Ctrl-C there is one line too)
        try:
            from onona_jax import platform

            platform.initialize()
        except Interrupted as err:
            print(f"error: interrupted; {err}", file=sys.stderr)
            exit(INTERRUPTED)
    exit(run(define, main, None, doc))


def exit(status: int):
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
