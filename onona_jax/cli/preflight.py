"""What a command checks before its work: that its outputs are writable (`unwritable`, the one
probe), that the environment variables it reads are valid, and what the machine lacks when that
is why something failed (`environment_failure`); which accelerators the machine may have
(`accelerators`, `quiet_libtpu`)."""

from __future__ import annotations

import os
import sys

from onona_jax.cli.errors import UsageError


def reason(err: BaseException) -> str:
    """Why `err` happened, in one line for an `error:` line: an OSError's strerror ("Permission
    denied"), else the first line of its text, else its type's name."""
    return getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]


def unwritable(directory: str, *, leave_nothing: bool = False) -> str | None:
    """Why `directory` (local or a bucket) cannot be written, in one line (`reason`), or None
    where it can: every "is this writable?" of the package asks it, before the work, so that a
    read-only or full disk, or a bucket without write permission, is found now and not inside an
    asynchronous write. Each caller words its own error line around the reason.

    The probe creates `directory` and a file in it, then removes the file. The directories it
    made are removed again when it fails and, with `leave_nothing`, when it succeeds (a default
    output the command may never write). What is not an OSError (a bucket's fsspec package
    missing, which `environment_failure` names; a Ctrl-C) is raised, after the same clean-up."""
    import socket

    from onona_jax import paths

    probe = paths.join(directory, f".write-test-{socket.gethostname()}-{os.getpid()}")  # one per process
    made = []  # the local directories this creates, deepest first (a bucket has none)
    if not paths.is_cloud(directory):
        d = os.path.abspath(directory)
        while not os.path.exists(d):
            made.append(d)
            d = os.path.dirname(d)
    try:
        paths.makedirs(directory)
        paths.write_atomic(probe, "ok")
        paths.remove(probe)
    except BaseException as err:  # (a failure, or a Ctrl-C: `Interrupted`)
        try:
            paths.remove(probe)
        except Exception:  # noqa: BLE001 - not written
            pass
        _remove_dirs(made)
        if isinstance(err, OSError):
            return reason(err)
        raise
    if leave_nothing:
        _remove_dirs(made)
    return None


def _remove_dirs(made: list[str]) -> None:
    """Remove the directories `made`, deepest first, as far as they are empty."""
    for d in made:
        try:
            os.rmdir(d)
        except OSError:
            break


def check_output_file(path: str, example: str) -> None:
    """An `--output=PATH` file (local or a bucket) must be writable: found before the work, not
    after it. `example`: a file name for the hint when PATH is a directory."""
    from onona_jax import paths

    if not path:
        return
    directory = os.fspath(paths.path(paths.absolute(path)).parent)
    why = unwritable(directory)
    if why:
        raise UsageError(f"--output={path}: cannot write to {directory} ({why}); give a writable path")
    if paths.isdir(path):
        raise UsageError(f"--output={path} is a directory; give a file path, e.g. {path}/{example}")


def check_output_dir(directory: str, fix: str) -> None:
    """A command's default output directory must be writable: found before the work, by a probe
    that leaves nothing behind, not even the directory it made. `fix`: what to give instead."""
    why = unwritable(directory, leave_nothing=True)
    if why:
        raise UsageError(f"cannot write {directory} ({why}), where the result goes by default; give {fix}")


# The fsspec implementation a URL scheme needs, and the extra that installs it (pyproject.toml).
EXTRAS = {"gcsfs": ("gs://", "gcs"), "s3fs": ("s3://", "cloud")}


def environment_failure(err: BaseException) -> str | None:
    """What the machine lacks, when that is why `err` was raised, or None: a bucket URL whose
    fsspec package is not installed (fsspec's ImportError), or a JAX_PLATFORMS naming a platform
    this machine has not (JAX fails to start its backend). Asked only once something failed."""
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
    value = os.environ.get("ONONA_DISTRIBUTED", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"ONONA_DISTRIBUTED={value!r}: give 1 (join the other hosts JAX discovers: TPU pods, "
                         "SLURM) or 0/unset")
    seconds_from_env("ONONA_LOCK_LEASE_S", "the workdir lock's lease in seconds, e.g. 120")


def seconds_from_env(name: str, what: str) -> float | None:
    """A positive finite number of seconds from the environment variable `name` (None if unset):
    anything else is one ValueError naming the variable and `what` to give."""
    import math

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
