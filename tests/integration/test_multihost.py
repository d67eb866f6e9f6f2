"""Multi-host training for real: two processes on this machine, joined by jax.distributed
(gloo CPU collectives, 4 fake devices each), run `train.py` on a mesh that spans both.

They must train exactly like one process with 8 devices (same per-step losses), each must
read only its own share of every global batch, and the checkpoint they write together must
restore in a single process to the same validation loss.

Every run goes through tests/multihost_driver.py, which runs train.py unchanged but records,
per process, the training windows it read, the rows it fed each step, and which rows of the
global batch its devices hold.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # ~2.5 min on 2 CPU cores: three train.py runs plus compiles

STEPS, GLOBAL_BATCH, SEQ_LEN = 3, 8, 32
TIMEOUT_S = 300
READ_AHEAD = 16  # global batches a process may have read by the end (grain prefetches)
DRIVER = os.path.join(REPO, "tests", "multihost_driver.py")
NOISE = ("[Gloo]", "Involuntary full rematerialization", "it/s]", "s/it]")


def train_flags(data_dir: str, workdir: str, mesh) -> list[str]:
    data, fsdp, tensor = mesh
    return [
        f"--config={REPO}/configs/paper.py:dense-tiny-twin",
        f"--workdir={workdir}",
        "--config.model.n_heads=8", "--config.model.n_kv_heads=4", "--config.model.head_dim=8",
        f"--config.train.global_batch={GLOBAL_BATCH}", "--config.train.micro_batch=1",
        f"--config.train.steps={STEPS}", "--config.train.log_every=1", "--config.train.warmup_steps=2",
        "--config.train.eval_every=1000", f"--config.train.checkpoint_every={STEPS}",
        "--config.eval.windows=8", "--config.eval.batch=8",
        f"--config.data.seq_len={SEQ_LEN}", f"--config.data.dir={data_dir}",
        f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}", f"--config.mesh.tensor={tensor}",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path, chars=4000) -> str:
    """The end of a log, without gloo/SPMD/progress-bar noise."""
    try:
        text = open(path, errors="replace").read()
    except OSError as err:
        return f"<{err}>"
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if not any(n in ln for n in NOISE)]
    return "\n".join(lines)[-chars:]


class Launch:
    """`processes` copies of the driver, 8 // processes devices each; waits, kills leftovers."""

    def __init__(self, root, name: str, mesh, data_dir: str, processes: int, flags=(), extra_env=None):
        self.workdir = root / name
        self.record_dir = root / f"{name}-record"
        self.record_dir.mkdir(parents=True)
        self.logs = [(root / f"{name}-p{p}.out", root / f"{name}-p{p}.err") for p in range(processes)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                            "ONONA_DISTRIBUTED")}
        env.update(JAX_PLATFORMS="cpu", ONONA_TEST_RECORD=str(self.record_dir), ONONA_TEST_STEPS=str(STEPS),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}", **(extra_env or {}))
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
                       JAX_NUM_PROCESSES=str(processes))
        cmd = [sys.executable, DRIVER, *train_flags(data_dir, str(self.workdir), mesh), *flags]
        procs, files = [], []
        try:
            for p, (out, err) in enumerate(self.logs):
                files += [open(out, "w"), open(err, "w")]
                procs.append(subprocess.Popen(
                    cmd, cwd=REPO, stdout=files[-2], stderr=files[-1],
                    env={**env, "JAX_PROCESS_ID": str(p)} if processes > 1 else env,
                ))
            deadline = time.monotonic() + TIMEOUT_S
            while any(pr.poll() is None for pr in procs):
                if time.monotonic() > deadline:
                    pytest.fail(f"{name}: timed out after {TIMEOUT_S} s\n{self.describe()}")
                if any(pr.poll() not in (None, 0) for pr in procs):
                    break  # the others would wait on it forever; they are killed below
                time.sleep(0.5)
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
            for f in files:
                f.close()
        self.returncodes = [pr.returncode for pr in procs]
        if any(self.returncodes):
            pytest.fail(f"{name}: exit codes {self.returncodes}\n{self.describe()}")
        self.records = []
        for p in range(processes):
            with np.load(self.record_dir / f"record-{p}.npz") as rec:
                self.records.append({k: rec[k] for k in rec.files})
        self.metrics = [json.loads(ln) for ln in open(self.workdir / "metrics.jsonl")]
        self.stdout = [open(out).read() for out, _ in self.logs]

    def describe(self) -> str:
        return "\n".join(f"--- process {p} stderr (tail) ---\n{tail(err)}\n--- stdout ---\n{tail(out, 1000)}"
                         for p, (out, err) in enumerate(self.logs))

    def losses(self) -> np.ndarray:
        rows = [m for m in self.metrics if "loss" in m]
        assert [m["step"] for m in rows] == list(range(1, STEPS + 1)), (rows, self.describe())
        return np.array([m["loss"] for m in rows])

    def final_eval(self) -> dict:
        rows = [m for m in self.metrics if "val_loss" in m]
        assert len(rows) == 1 and rows[0]["step"] == STEPS, (rows, self.describe())
        return rows[0]


def global_window_ids(data_dir: str, n_batches: int) -> np.ndarray:
    """[n_batches, GLOBAL_BATCH] window indices of the single-process global batches: the
    pipeline run with each window replaced by its own index."""
    from onona_jax import config
    from onona_jax.data import pipeline

    seed = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin")).data.seed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline.WindowSource, "windows",  # (how train_batches reads a batch share)
                   lambda self, ids: np.stack([np.full(SEQ_LEN + 1, int(i), np.int32) for i in ids]))
        it = pipeline.train_batches(data_dir, SEQ_LEN, GLOBAL_BATCH, seed=seed)
        return np.stack([next(it)[:, 0] for _ in range(n_batches)])


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """One process, 8 devices, the same config."""
    return Launch(tmp_path_factory.mktemp("reference"), "one", (8, 1, 1), tiny_data, processes=1)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_two_processes_train_like_one(tiny_data, reference, tmp_path, mesh):
    import jax

    from onona_jax.eval import validation as evaluation
    from onona_jax.data import pipeline

    two = Launch(tmp_path, "two", mesh, tiny_data, processes=2)
    ctx = two.describe()

    # Same per-step losses as one process with 8 devices (metrics.jsonl: process 0 only).
    ref_losses = reference.losses()
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(two.losses(), ref_losses, rtol=1e-5, err_msg=ctx)

    # Each process read and fed only its contiguous share of every global batch.
    ids = global_window_ids(tiny_data, READ_AHEAD)
    assert len(np.unique(ids)) == ids.size  # one epoch: shares are disjoint
    windows = pipeline.WindowSource(pipeline.TokenStore(tiny_data, "train"), SEQ_LEN)
    local = GLOBAL_BATCH // 2
    ref_fed = reference.records[0]["fed"]
    assert ref_fed.shape == (STEPS, GLOBAL_BATCH, SEQ_LEN + 1)
    for p, rec in enumerate(two.records):
        assert (int(rec["process_index"]), int(rec["process_count"])) == (p, 2)
        assert (int(rec["local_devices"]), int(rec["devices"])) == (4, 8)
        share = slice(p * local, (p + 1) * local)
        assert rec["fed"].shape == (STEPS, local, SEQ_LEN + 1), p
        for step in range(STEPS):
            expected = np.stack([windows[i] for i in ids[step, share]])
            np.testing.assert_array_equal(rec["fed"][step], expected, err_msg=f"process {p} step {step}")
            np.testing.assert_array_equal(rec["fed"][step], ref_fed[step][share])
        # this process's devices hold exactly its rows of the global batch
        assert rec["rows"].tolist() == [list(range(share.start, share.stop))] * STEPS, p
        read = set(rec["ids"].tolist())
        mine = set(ids[:, share].ravel().tolist())
        theirs = set(ids[:, slice((1 - p) * local, (2 - p) * local)].ravel().tolist())
        assert set(ids[:STEPS, share].ravel().tolist()) <= read, p
        assert read <= mine, f"process {p} read windows outside its share: {sorted(read - mine)[:10]}"
        assert not read & theirs
        # the single process read whole global batches
        assert set(ids[:STEPS].ravel().tolist()) <= set(reference.records[0]["ids"].tolist())

    # One checkpoint at step 3, written by both processes, restores in one process (1 device).
    assert "3" in os.listdir(two.workdir / "checkpoints"), ctx
    final = two.final_eval()
    ev = evaluation.validation(str(two.workdir), mesh=(1, 1, 1), devices=jax.devices()[:1])
    assert ev["step"] == STEPS
    for key in ("val_loss", "val_loss_a_only", "val_loss_b_only"):
        assert ev[key] == pytest.approx(final[key], rel=1e-5), key
        assert final[key] == pytest.approx(reference.final_eval()[key], rel=1e-5), key
    for out in two.stdout:  # both processes print the final evaluation
        printed = re.search(r"final step (\d+): val_loss=([0-9.]+)", out)
        assert printed and int(printed[1]) == STEPS, ctx
        assert float(printed[2]) == pytest.approx(ev["val_loss"], abs=1e-4)


def test_two_processes_take_process_0s_timer_save(tiny_data, reference, tmp_path):
    """train.checkpoint_minutes on two processes whose clocks disagree (the driver's: process 0's
    advances a minute per step, process 1's stands still): both save on process 0's timer after
    step 2, together (a save is a collective: had process 1 decided alone, process 0 would wait
    for it in Orbax's save until the test's timeout), and the timer save is deleted once the
    scheduled save of step 3 is complete. The losses are the single process's."""
    two = Launch(tmp_path, "timer", (8, 1, 1), tiny_data, processes=2,
                 flags=["--config.train.checkpoint_minutes=1.5"], extra_env={"ONONA_TEST_STEP_SECONDS": "60"})
    ctx = two.describe()
    for p, rec in enumerate(two.records):
        assert rec["saves"].tolist() == [2, 3] and rec["timer_saves"].tolist() == [2], (p, ctx)
    assert sorted(n for n in os.listdir(two.workdir / "checkpoints") if n.isdigit()) == ["3"], ctx
    np.testing.assert_allclose(two.losses(), reference.losses(), rtol=1e-5, err_msg=ctx)
