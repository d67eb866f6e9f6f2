"""A command's flags, its --help and its run: `run` parses the flags, calls the command and turns
an anticipated failure into one `error:` line and its exit status (the package docstring)."""

from __future__ import annotations

import sys

from absl import flags

import onona_jax
from onona_jax.cli.errors import Failure, UsageError
from onona_jax.cli.preflight import check_environment, environment_failure, quiet_libtpu
from onona_jax.cli.signals import INTERRUPTED, Interrupted, exit_process, sigint_handling

# The group absl lists these flags under in --help (otherwise this module's name).
MODULE = "onona_jax.cli"


def define_mesh(fv, default: str = "-1,1,1"):
    """`--mesh=data,fsdp,tensor`: the mesh a command places a checkpoint on."""
    flags.DEFINE_list("mesh", default.split(","), "data,fsdp,tensor sizes of this run's mesh "
                      "(one may be -1: the rest of the devices)", flag_values=fv, module_name=MODULE)


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
    printed without parsing (a required flag may be missing) and without importing jax (slow to
    start): a command's `define` defines its config flag with `define_config_for_help` instead.
    The flags after `--` are a sweep's, not ours."""
    for arg in argv:
        if arg == "--":
            return False
        if arg in HELP:
            return True
        if arg.startswith(("--help=", "-help=")) and arg.split("=", 1)[1].lower() in ("true", "t", "1"):
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
    flags.DEFINE_boolean("help", False, "show this help and exit", flag_values=fv, short_name="h",
                         module_name=MODULE)
    with sigint_handling():
        try:
            return _run(define, main, argv, doc, fv)
        except Interrupted as err:  # (a second SIGINT never gets here: it exits at once)
            _error(f"interrupted; {err}")
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
        _error(err)
        return 1
    except ValueError as err:  # bad usage or bad input, found before any write
        _error(err)
        return 2
    except Exception as err:  # the environment as input: a bucket without its extra, JAX_PLATFORMS
        why = environment_failure(err)
        if why is None:
            raise
        _error(why)
        return 2
    return 0 if result is None else int(result)


def _error(problem) -> None:
    """The one line an anticipated failure prints: `error: <problem and fix>`."""
    print(f"error: {problem}", file=sys.stderr)


def _print_help(doc, fv) -> int:
    print((doc or "").strip() + "\n\nflags:\n" + fv.get_help())
    return 0


def run_module(define, main, doc: str = ""):
    """`exit_process(run(...))` for `if __name__ == "__main__"` (jax.distributed first; for --help,
    nothing that imports jax)."""
    try:
        check_environment()
    except ValueError as err:
        _error(err)
        sys.exit(2)
    if help_asked(sys.argv[1:]):
        exit_process(run(define, main, None, doc))
    quiet_libtpu()  # before jax is imported: JAX reads JAX_PLATFORMS at import
    with sigint_handling():  # (jax.distributed may take a while to join: a Ctrl-C there is one line too)
        try:
            from onona_jax import platform

            platform.initialize()
        except Interrupted:
            _error(onona_jax.INTERRUPTED_WHILE_STARTING)
            exit_process(INTERRUPTED)
    exit_process(run(define, main, None, doc))
