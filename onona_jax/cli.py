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

Exit status: 0 done; 2 bad usage or bad input found before any write (an unknown flag or
config key, a bad value: `ValueError`); 1 an anticipated runtime failure (`Failure`).
"""

from __future__ import annotations

import sys

from absl import flags


class Failure(RuntimeError):
    """An anticipated runtime failure (a failed write, a non-finite loss): exit status 1."""


class UsageError(ValueError):
    """Bad usage: exit status 2."""


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
    except OSError:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    paths.remove(probe)


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


def run(define, main, argv=None, doc: str = "", prog: str | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) with the flags `define(fv, argv)` declares, then
    `main(fv, positional args)`; an anticipated failure becomes one `error:` line and its
    exit status."""
    argv = [prog or sys.argv[0], *(sys.argv[1:] if argv is None else list(argv))]
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax logs every file it touches at INFO/WARNING
    fv = flags.FlagValues()
    flags.DEFINE_boolean("help", False, "show this help and exit", flag_values=fv, short_name="h")
    try:
        explain = define(fv, argv)
        try:
            rest = fv(argv)[1:]
        except flags.Error as err:
            raise UsageError(f"{err}; see --help") from None
        except (AttributeError, KeyError) as err:  # a config override of a key that does not exist
            raise UsageError((explain and explain(argv)) or f"bad config override: {err}") from None
        if fv["help"].value:
            print((doc or "").strip() + "\n\nflags:\n" + fv.get_help())
            return 0
        result = main(fv, rest)
    except Failure as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # bad usage or bad input, found before any write
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if result is None else int(result)


def run_module(define, main, doc: str = ""):
    """`sys.exit(run(...))` for `if __name__ == "__main__"` (jax.distributed first)."""
    from onona_jax import platform

    platform.initialize()
    sys.exit(run(define, main, None, doc))
