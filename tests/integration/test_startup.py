"""What a user sees when a command starts: `--help` without importing jax (a minute on a
loaded host), and no libtpu start-up errors on a machine without a TPU."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from onona_jax import cli

# Every command the README documents, and a flag its help must list.
COMMANDS = [
    (["train.py"], "--config"),
    (["eval.py"], "--tasks"),
    (["-m", "onona_jax.summary"], "--config"),
    (["-m", "onona_jax.aot"], "--topology"),
    (["-m", "onona_jax.data.prepare"], "--output"),
    (["-m", "onona_jax.analysis.gate"], "--min_count"),
    (["-m", "onona_jax.analysis.curves"], "--metric"),
    (["-m", "onona_jax.serve.generate"], "--prompt"),
    (["-m", "onona_jax.serve.export"], "--overwrite"),
    (["-m", "onona_jax.train.import_hf"], "--from_hf"),
    (["-m", "onona_jax.experiments.sweep"], "--grid"),
    (["-m", "onona_jax.experiments.report"], "--[no]help"),  # (its input: directories, no flag)
    (["-m", "onona_jax.experiments.replicate"], "--workdir"),
]
HEAVY = re.compile(r"\|\s+(jax|jaxlib|flax|optax|orbax|torch)(\.|$)")  # `-X importtime`'s lines


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # (conftest sets it for this process)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**e, **extra}


@pytest.mark.parametrize("command,flag", COMMANDS, ids=[c[-1] for c, _ in COMMANDS])
def test_help_lists_the_flags_without_importing_jax(command, flag):
    """Required flags (--workdir, ...) need not be given for --help, and nothing imports jax."""
    p = subprocess.run([sys.executable, "-X", "importtime", *command, "--help"], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "\nflags:\n" in p.stdout and flag in p.stdout, p.stdout
    heavy = [line for line in p.stderr.splitlines() if HEAVY.search(line)]
    assert not heavy, f"{' '.join(command)} --help imported: " + "\n".join(heavy[:5])


@pytest.mark.parametrize("asked", ["-h", "--helpfull", "--help=true"])
def test_every_spelling_of_help_is_fast(asked):
    p = subprocess.run([sys.executable, "-X", "importtime", "train.py", asked], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--config" in p.stdout, p.stderr[-3000:]
    assert not [line for line in p.stderr.splitlines() if HEAVY.search(line)]


def test_help_asked():
    assert cli.help_asked(["--workdir=x", "-h"]) and cli.help_asked(["--helpfull"])
    assert not cli.help_asked(["--nohelp"]) and not cli.help_asked(["--help=false"])
    assert not cli.help_asked(["--grid=table1", "--", "--help"])  # a sweep's flags for train.py


LIBTPU_LINES = re.compile(r"libtpu|E0000|InitGoogle|TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES|Source Location Trace")
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (the tpu-aot extra): nothing prints its start-up lines")
needs_no_accelerator = pytest.mark.skipif(bool(cli.accelerators()),
                                          reason="this machine may have a TPU or a GPU: JAX is left to find it")


@needs_libtpu
@needs_no_accelerator
@pytest.mark.parametrize("command,error", [
    (["eval.py", "--workdir={tmp}/run"], "error: no checkpoints in "),
    # a benchmark that starts JAX (its machine line names the backend) after importing onona_jax.config
    (["benchmarks/serve_bench.py", "--what=one_projection", "--vllm_python={tmp}/none"], "error: --vllm_python="),
], ids=["eval", "serve_bench"])
def test_a_cpu_command_prints_no_libtpu_startup_errors(tmp_path, command, error):
    """JAX_PLATFORMS unset, a command that starts JAX's backend (eval.py asks for its devices
    before it finds no checkpoint) prints its one error line and nothing of libtpu's."""
    p = subprocess.run([sys.executable, *(c.format(tmp=tmp_path) for c in command)], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert not LIBTPU_LINES.search(p.stderr), p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(error), p.stderr[-3000:]


@needs_libtpu
@needs_no_accelerator
def test_a_tpu_asked_for_still_fails_naming_the_variable(tmp_path):
    p = subprocess.run([sys.executable, "eval.py", f"--workdir={tmp_path}/run"], cwd=REPO,
                       env=env(JAX_PLATFORMS="tpu"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: JAX_PLATFORMS=tpu: JAX cannot start that platform"), \
        p.stderr[-3000:]


def test_ci_pins_the_torch_the_test_extra_pins():
    """.ci/run installs the CPU build of the torch the `test` extra pins (README: the test command)."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        test_extra = next(line for line in f if line.startswith("test = ["))
    version = re.search(r'"torch==([^"]+)"', test_extra).group(1)
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert f"pip install -q torch=={version}+cpu\n" in f.read()
