"""What the reliability tests share (issue 12: test_lock, test_resume_compatibility,
test_checkpoint_damage, test_storage_faults, test_preflight, test_config_validation): the tiny
run's command line (`argv`), a finished run whose checkpoints are written directly (`run_dir`,
`copy_run`: a fresh train state saved twice, no training step compiled), read-only directories
and a tmpfs that fills up (root only, else the test skips).

Fast tests call the entry points in-process (`train.main(argv)`, `eval.main(argv)` return exit
codes) on that run, and hold workdir locks from small subprocesses (test_lock's `HOLD`: lock.py
alone, no jax). Tests that need real training run train.py in a subprocess (`train_env`): the
two-process lock test and the storage-fault run on a tmpfs are slow (`python -m pytest -q -m slow
tests/integration/test_lock.py tests/integration/test_storage_faults.py`).
A test module takes the fixtures it uses by importing them (`from run_fixtures import copy_run, run_dir`).
"""

import errno
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax
import pytest

from conftest import REPO
from onona_jax import config as config_lib
from onona_jax import train as trainer
from onona_jax.checkpoint import Checkpoints

CONFIG = os.path.join(REPO, "configs/paper.py:dense-tiny-standard")
OVERRIDES = {
    "data.seq_len": 32, "model.n_heads": 8, "model.n_kv_heads": 4, "model.head_dim": 8,
    "train.global_batch": 8, "train.micro_batch": 8, "train.steps": 4, "train.warmup_steps": 2,
    "train.log_every": 1, "train.eval_every": 1000, "train.checkpoint_every": 2,
    "eval.windows": 8, "eval.batch": 8, "mesh.data": 1,
}


# In-process runs see conftest's 8 devices (mesh and micro-batch may change on resume).
IN_PROCESS = {"mesh.data": -1, "train.micro_batch": 1}
ONE_DEVICE = {"mesh.data": 1, "train.micro_batch": 8}


def argv(data_dir, workdir, *extra, spec=CONFIG, **overrides):
    flags = {**OVERRIDES, **IN_PROCESS, "data.dir": data_dir, **overrides}
    return [f"--config={spec}", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items()), *extra]


def the_config(data_dir):
    """The config `argv(...)` requests, as train.py builds it."""
    cfg = config_lib.load(CONFIG)
    for k, v in {**OVERRIDES, "data.dir": data_dir}.items():
        *path, leaf = k.split(".")
        node = cfg
        for p in path:
            node = node[p]
        node[leaf] = v
    return config_lib.validate(cfg)


def tree_digest(path: Path) -> dict:
    """Every file (sha256) and directory under `path`."""
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(path.rglob("*"))}


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory):
    """A run with checkpoints at steps 2 and 4 of `argv`'s config on one device (a fresh
    state saved twice: what restore and the config checks read, without training)."""
    workdir = tmp_path_factory.mktemp("reliability") / "run"
    cfg = the_config(tiny_data)
    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.init_state(run, cfg.seed)
    ckpts = Checkpoints(str(workdir / "checkpoints"), keep=10)
    for step in (2, 4):
        ckpts.save(step, state, {"step": step}, cfg.to_json())
    ckpts.wait()
    (workdir / "config.json").write_text(cfg.to_json(indent=2))
    (workdir / "metrics.jsonl").write_text('{"step": 4, "loss": 10.0}\n')
    return workdir


@pytest.fixture
def copy_run(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def damage_arrays(workdir: Path, step: int):
    """Truncate the biggest array file of a step, as a full disk would."""
    files = sorted((p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
                    if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    with open(files[-1], "r+b") as f:
        f.truncate(files[-1].stat().st_size // 2)

@pytest.fixture
def read_only(tmp_path):
    """Make a directory read-only for this process (chmod; as root also chattr +i), or skip."""
    made = []

    def make(path: Path):
        path.chmod(0o555)
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        made.append(path)
        try:
            (path / ".probe").write_text("x")
        except OSError:
            return
        (path / ".probe").unlink()
        pytest.skip("cannot make a read-only directory here")

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o755)

@pytest.fixture
def tmpfs():
    """`mount(dir, size)`: a small tmpfs at `dir`, a real filesystem that fills up (ENOSPC), or
    skip where mounting is not permitted (needs root); unmounted after the test."""
    mounted = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); needs root")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, name: str = "ballast") -> Path:
    """Fill `directory`'s filesystem: a file grown until the disk refuses more."""
    ballast = directory / name
    with open(ballast, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    return ballast

def train_env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    return env
