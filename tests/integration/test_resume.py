"""Exact resume: a run stopped (SIGTERM, SIGKILL) and restarted on the same workdir logs the
same per-step losses, bit for bit, as the run left alone, and reads the same data windows; a
corrupt newest checkpoint is set aside, not deleted; a non-finite loss stops the run without
touching the last good checkpoint, and non-finite parameters are never saved.

Every run whose losses are compared is `python train.py` in a subprocess on one CPU device,
all in the same environment (an in-process run on conftest's 8-device client differs from it
in the last bit of some losses), so "bit for bit" compares the same compiled program. The
subprocesses share a persistent compilation cache, so only the first one pays for compiling.
Tests that need "a run with checkpoints 2 and 4" copy them from the reference run.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import REPO, tiny_config
from onona_jax import train as trainer
from onona_jax.checkpoint import Checkpoints
from onona_jax.data import pipeline

STEPS = 8
CONFIG = "configs/paper.py:dense-tiny-standard"
# The tiny model of conftest.tiny_config (8 heads, 4 KV heads) on one device, one micro-batch
# per step, a metrics line every step and a checkpoint every 2 (all kept).
OVERRIDES = {
    "data.seq_len": 32, "model.n_heads": 8, "model.n_kv_heads": 4, "model.head_dim": 8,
    "train.global_batch": 8, "train.micro_batch": 8, "train.steps": STEPS, "train.warmup_steps": 2,
    "train.log_every": 1, "train.eval_every": 1000, "train.checkpoint_every": 2, "train.keep_checkpoints": 10,
    "eval.windows": 8, "eval.batch": 8, "mesh.data": 1, "train.compile_cache_min_s": 0,
}
TIMEOUT = 300


@pytest.fixture(scope="module")
def cli(tiny_data, tmp_path_factory):
    """Runs train.py with OVERRIDES (plus extra overrides) on a workdir."""
    return TrainCLI(tiny_data, tmp_path_factory.mktemp("jax_cache"))


class TrainCLI:
    def __init__(self, data_dir, cache_dir):
        self.data_dir = data_dir
        self.cache_dir = cache_dir

    @property
    def env(self) -> dict:
        """This process's environment as it is now (so a fixture's settings made after this
        object, such as the fake GCS endpoint, reach the run), with conftest's 8 fake devices off
        (one device, as mesh.data=1 says) and a compilation cache shared by every run."""
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                    if not f.startswith("--xla_force_host_platform_device_count"))
        # train.py sets JAX's cache itself (train.compile_cache, whose default this variable
        # gives; OVERRIDES caches every program, however quick to compile).
        env.update(JAX_PLATFORMS="cpu", ONONA_COMPILE_CACHE=str(self.cache_dir),
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        return env

    def args(self, workdir, **extra):
        flags = {**OVERRIDES, "data.dir": self.data_dir, **{k.replace("__", "."): v for k, v in extra.items()}}
        return [sys.executable, "train.py", f"--config={CONFIG}", f"--workdir={workdir}",
                *(f"--config.{k}={v}" for k, v in flags.items())]

    def start(self, workdir: Path, log: Path, **extra) -> subprocess.Popen:
        """Start a run; its stdout+stderr go to `log` (a pipe could fill up and stall it)."""
        out = open(log, "w")
        try:
            return subprocess.Popen(self.args(workdir, **extra), cwd=REPO, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT)
        finally:
            out.close()

    def run(self, workdir: Path, log: Path, **extra) -> tuple[int, str]:
        p = self.start(workdir, log, **extra)
        try:
            rc = p.wait(timeout=TIMEOUT)
        finally:
            stop(p)
        return rc, log.read_text()


def stop(p: subprocess.Popen):
    if p.poll() is None:
        p.kill()
        p.wait()


def metrics(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def losses(workdir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training line of metrics.jsonl, in file order."""
    return [(m["step"], m["loss"]) for m in metrics(workdir) if "loss" in m]


def val_losses(workdir: Path) -> list[float]:
    return [m["val_loss"] for m in metrics(workdir) if "val_loss" in m]


def checkpoint_steps(workdir: Path) -> list[int]:
    """Steps with a finished checkpoint (Orbax renames its temporary directory when done)."""
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def data_state(workdir: Path, step: int) -> dict:
    """The data-iterator state saved with a checkpoint (Orbax item `data`, JSON)."""
    return json.loads((workdir / "checkpoints" / str(step) / "data" / "metadata").read_text())


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def wait_for(cond, p: subprocess.Popen, log: Path, what: str, timeout=TIMEOUT, poll=0.01):
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            pytest.fail(f"train.py exited ({p.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            stop(p)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll)


def preempt_after_step_3(cli, workdir, log: Path, logged, poll=0.01, **extra) -> int:
    """Start a run, SIGTERM it once `logged()` (its (step, loss) lines) reaches step 3; it must
    exit 0 saying which step it saved, which is returned."""
    p = cli.start(workdir, log, **extra)
    try:
        wait_for(lambda: any(s >= 3 for s, _ in logged()), p, log, "step 3 was logged", poll=poll)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=TIMEOUT)
    finally:
        stop(p)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    stopped = re.search(r"pre-empted: saved step (\d+); rerun the same command to resume", out)
    assert stopped, f"the run finished before SIGTERM took effect (make the run longer):\n{out[-3000:]}"
    return int(stopped[1])


def expected_data_state(tiny_data, step: int) -> dict:
    n = pipeline.TokenStore(tiny_data, "train").num_windows(OVERRIDES["data.seq_len"])
    return {"step": step, "seed": 0, "seq_len": OVERRIDES["data.seq_len"],
            "global_batch": OVERRIDES["train.global_batch"], "num_windows": n}


def assert_matches_reference(workdir: Path, reference: dict, first_step: int = 1):
    """Every step first_step..STEPS is logged, and every logged loss (a step logged twice, by a
    killed run and by its resumption, included) equals the uninterrupted run's, bit for bit."""
    logged = losses(workdir)
    assert sorted({s for s, _ in logged}) == list(range(first_step, STEPS + 1)), logged
    for step, loss in logged:
        assert loss == reference["loss"][step], f"step {step}: {loss!r} != reference {reference['loss'][step]!r}"
    assert val_losses(workdir) == [reference["val_loss"]]  # the final parameters are the same too


@pytest.fixture(scope="module")
def reference(cli, tmp_path_factory):
    """The uninterrupted run: losses by step, final val_loss, and its workdir (checkpoints 2..8)."""
    root = tmp_path_factory.mktemp("reference")
    workdir = root / "run"
    rc, out = cli.run(workdir, root / "log.txt")
    assert rc == 0, out[-3000:]
    logged = losses(workdir)
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    assert all(np.isfinite(loss) for _, loss in logged) and logged[-1][1] < logged[0][1]
    assert checkpoint_steps(workdir) == [2, 4, 6, 8]
    return {"loss": dict(logged), "val_loss": val_losses(workdir)[0], "workdir": workdir}


# ----------------------------------------------------------------------------- interruptions


def test_sigterm_then_rerun_is_bit_exact(cli, reference, tiny_data, tmp_path):
    workdir = tmp_path / "run"
    k = preempt_after_step_3(cli, workdir, tmp_path / "log1.txt", lambda: losses(workdir))
    assert 3 <= k < STEPS
    assert k in checkpoint_steps(workdir) and max(checkpoint_steps(workdir)) == k
    assert data_state(workdir, k) == expected_data_state(tiny_data, k)  # batches 0..k-1 consumed
    assert [s for s, _ in losses(workdir)] == list(range(1, k + 1))  # stopped right after step k
    assert not val_losses(workdir)

    rc, out = cli.run(workdir, tmp_path / "log2.txt")
    assert rc == 0, out[-3000:]
    assert f"resumed from step {k} " in out
    assert_matches_reference(workdir, reference)
    assert len(losses(workdir)) == STEPS  # no step ran twice
    for s in checkpoint_steps(workdir):
        assert data_state(workdir, s) == expected_data_state(tiny_data, s)


@pytest.mark.slow  # suite-time margin (cover: test_sigterm_then_rerun_is_bit_exact; kill -9 cycles: test_faults)
def test_sigkill_after_checkpoint_then_rerun_is_bit_exact(cli, reference, tiny_data, tmp_path):
    workdir, log = tmp_path / "run", tmp_path / "log1.txt"
    p = cli.start(workdir, log)

    def in_flight():  # a checkpoint being written: Orbax's temporary directory
        d = workdir / "checkpoints"
        return [n for n in os.listdir(d) if not n.isdigit()] if d.exists() else []

    try:  # kill after checkpoint 4 is complete: while a later one is half written, else after step 7
        wait_for(lambda: 4 in checkpoint_steps(workdir) and (in_flight() or any(s >= 7 for s, _ in losses(workdir))),
                 p, log, "checkpoint 4 was complete and a later one in flight or step 7 logged", poll=0.005)
        p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=TIMEOUT)
    finally:
        stop(p)
    assert rc == -signal.SIGKILL, log.read_text()[-3000:]
    print(f"killed after step {max(s for s, _ in losses(workdir))}; in flight: {in_flight()}")
    before = losses(workdir)
    complete = checkpoint_steps(workdir)
    assert 4 in complete and max(s for s, _ in before) < STEPS
    resume_from = max(complete)
    assert data_state(workdir, resume_from) == expected_data_state(tiny_data, resume_from)

    rc, out = cli.run(workdir, tmp_path / "log2.txt")
    assert rc == 0, out[-3000:]
    assert f"resumed from step {resume_from} " in out
    assert_matches_reference(workdir, reference)
    logged = losses(workdir)
    twice = sorted({s for s, _ in logged if sum(t == s for t, _ in logged) == 2})
    assert twice == [s for s, _ in before if s > resume_from]  # re-run after the kill, nothing else
    assert twice or resume_from == max(s for s, _ in before)
    assert checkpoint_steps(workdir) == [2, 4, 6, 8] and not in_flight()  # a half-written one is cleared
    for s in (2, 4, 6, 8):
        assert data_state(workdir, s) == expected_data_state(tiny_data, s)


@pytest.mark.slow  # suite-time margin (cover: test_sigterm_then_rerun_is_bit_exact, test_bucket_data_streamed_trains_bit_for_bit_as_local_data, test_cloud_checkpoint)
def test_bucket_workdir_and_data_sigterm_resume_eval(cli, reference, tiny_data, fake_gcs, tmp_path):
    """The whole cycle with the workdir and the data dir in a bucket (gs://, the local GCS
    emulator of tests/fake_gcs.py): prepare uploads the data, train.py copies it into its cache,
    logs and checkpoints to the bucket, stops on SIGTERM, resumes bit for bit, and eval.py writes
    its JSON there. Layers exercised for real: our epath/gcsfs reads and writes (config.json,
    metrics.jsonl and TensorBoard events appended by compose, the conditional-create lock,
    eval JSON, prepare's upload, the data cache) and Orbax's checkpoints through TensorStore's
    own GCS driver; what the emulator does not model is listed in tests/fake_gcs.py."""
    from onona_jax import paths
    from onona_jax.data.prepare import prepare

    data, workdir = f"{fake_gcs}/data", f"{fake_gcs}/run"
    local_manifest = json.loads((Path(tiny_data) / "manifest.json").read_text())
    prepare([str(Path(tiny_data).parent / "austen_head.txt")], data, heldout_fraction=0.1)
    uploaded = json.loads(paths.read_text(f"{data}/manifest.json"))
    assert uploaded["splits"] == local_manifest["splits"]  # the same shards, hash for hash

    def bucket_losses():
        try:
            text = paths.read_text(f"{workdir}/metrics.jsonl")
        except FileNotFoundError:
            return []
        return [(m["step"], m["loss"]) for m in map(json.loads, text.splitlines()) if "loss" in m]

    cache = tmp_path / "cache"
    extra = dict(data__dir=data, data__cache_dir=cache)
    k = preempt_after_step_3(cli, workdir, tmp_path / "log1.txt", bucket_losses, poll=0.1, **extra)
    assert paths.exists(f"{workdir}/checkpoints/{k}/commit_success.txt") or paths.isdir(f"{workdir}/checkpoints/{k}")
    assert not paths.exists(f"{workdir}/lock.json")  # released on the way out
    assert sorted(f.name for f in cache.rglob("*.bin")) == sorted(
        sh["file"] for sp in local_manifest["splits"].values() for sh in sp["shards"])

    rc, out = cli.run(workdir, tmp_path / "log2.txt", **extra)
    assert rc == 0, out[-3000:]
    assert f"resumed from step {k} " in out
    logged = bucket_losses()
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    assert all(loss == reference["loss"][s] for s, loss in logged), (logged, reference["loss"])
    assert json.loads(paths.read_text(f"{workdir}/config.json"))["data"]["dir"] == data
    assert paths.glob(f"{workdir}/tensorboard", "events.out.tfevents.*")

    rc = subprocess.call([sys.executable, "eval.py", f"--workdir={workdir}"], cwd=REPO, env=cli.env,
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "eval.txt", "w"))
    assert rc == 0, (tmp_path / "eval.txt").read_text()[-3000:]
    result = json.loads(paths.read_text(f"{workdir}/eval/step_{STEPS}.json"))
    assert result["step"] == STEPS and result["val_loss"] == reference["val_loss"]


def test_bucket_data_streamed_trains_bit_for_bit_as_local_data(cli, reference, tiny_data, fake_gcs, tmp_path):
    """data.bucket_read=stream: train.py reads a bucket data dir by ranged, verified block reads
    (onona_jax/data/stream.py), copies nothing into data.cache_dir, and logs the local-data run's
    losses and validation loss bit for bit."""
    from onona_jax.data.prepare import prepare

    data = f"{fake_gcs}/data"
    prepare([str(Path(tiny_data).parent / "austen_head.txt")], data, heldout_fraction=0.1, block_bytes=64)
    cache, workdir = tmp_path / "cache", tmp_path / "run"
    rc, out = cli.run(workdir, tmp_path / "log.txt", data__dir=data, data__cache_dir=cache,
                      data__bucket_read="stream")
    assert rc == 0, out[-3000:]
    assert losses(workdir) == sorted(reference["loss"].items())
    assert val_losses(workdir)[0] == reference["val_loss"]
    assert not cache.exists()


def test_saved_data_state_resumes_the_same_windows(reference, tiny_data):
    """An iterator restored from a checkpoint's `data` state yields the batches an uninterrupted
    iterator yields from that step on."""
    seq_len, gb = OVERRIDES["data.seq_len"], OVERRIDES["train.global_batch"]
    fresh = pipeline.train_batches(tiny_data, seq_len, gb, seed=0)
    batches = [next(fresh) for _ in range(STEPS + 2)]
    assert not np.array_equal(batches[0], batches[1])
    for step in (2, 4, 6, 8):
        it = pipeline.train_batches(tiny_data, seq_len, gb, seed=0)
        it.set_state(data_state(reference["workdir"], step))
        for b in range(step, step + 2):
            np.testing.assert_array_equal(next(it), batches[b])


def copy_checkpoints(reference, workdir: Path, steps, **saved_train) -> Path:
    """Checkpoints `steps` of the reference run; `saved_train` rewrites train.* keys of their
    saved config, so a rerun with those values resumes them rather than being refused as a
    different run (train.py compares the requested config with the saved one)."""
    ckpts = workdir / "checkpoints"
    ckpts.mkdir(parents=True)
    for s in steps:
        shutil.copytree(reference["workdir"] / "checkpoints" / str(s), ckpts / str(s))
        if saved_train:
            meta = ckpts / str(s) / "config" / "metadata"
            saved = json.loads(meta.read_text())
            saved["train"].update(saved_train)
            meta.write_text(json.dumps(saved))
    return ckpts


@pytest.mark.slow  # a train.py run that compiles a new budget's step; the default suite checks both rules in-process
def test_moved_data_and_a_longer_budget_resume_exactly(cli, reference, tiny_data, tmp_path):
    """The reference run's checkpoints 2 and 4 (with its record of the data), resumed with the
    data dir copied elsewhere and train.steps 8 → 10, before the decay (steps 7-8 of 8, 9-10 of
    10): the losses of steps 5-8 equal the reference's bit for bit (same data, same learning
    rates up to step 7), and every step's lr is the new schedule's, so the decay moved instead
    of jumping (step 8: 3e-3, where the 8-step run had decayed to 3e-4)."""
    from onona_jax.train import optimizer

    workdir = tmp_path / "run"
    copy_checkpoints(reference, workdir, (2, 4))
    shutil.copy(reference["workdir"] / "data_verified.json", workdir / "data_verified.json")
    moved = tmp_path / "moved_data"
    shutil.copytree(tiny_data, moved)

    rc, out = cli.run(workdir, tmp_path / "log.txt", data__dir=moved, train__steps=10)
    assert rc == 0, out[-3000:]
    assert "resumed from step 4 " in out
    logged = {m["step"]: m for m in metrics(workdir) if "loss" in m}
    assert sorted(logged) == list(range(5, 11))
    for step in range(5, 9):
        assert logged[step]["loss"] == reference["loss"][step], step
    new = optimizer.schedule(tiny_config(tiny_data, "standard", steps=10), 10)  # lr 3e-3 → 3e-4, warmup 2
    assert [logged[s]["lr"] for s in range(5, 11)] == pytest.approx([float(new(s - 1)) for s in range(5, 11)])
    assert logged[8]["lr"] == pytest.approx(3e-3) and logged[10]["lr"] == pytest.approx(3e-4)
    ref8 = [m for m in metrics(reference["workdir"]) if m.get("step") == 8 and "lr" in m][0]["lr"]
    assert ref8 == pytest.approx(3e-4)
    assert json.loads((workdir / "data_verified.json").read_text())["data_dir"] == str(moved.resolve())


def test_corrupt_latest_checkpoint_is_set_aside(cli, reference, tmp_path):
    """Checkpoints 2 and 4 of the reference run, 4 then damaged: the rerun warns naming step 4,
    moves it to checkpoints/corrupt/4-* whole, resumes from 2 and trains steps 3..8 exactly."""
    workdir = tmp_path / "run"
    ckpts = copy_checkpoints(reference, workdir, (2, 4))
    data_files = sorted((p for p in (ckpts / "4" / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                        key=lambda p: p.stat().st_size)
    victim = data_files[-1]  # the biggest array file: truncated, as by a full disk
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    damaged = tree_digest(ckpts / "4")

    rc, out = cli.run(workdir, tmp_path / "log.txt")
    assert rc == 0, out[-3000:]
    warning = re.search(r"checkpoint at step 4 could not be restored .*moved to (\S+) and falling back", out, re.S)
    assert warning, out[-3000:]
    assert "resumed from step 2 " in out
    assert_matches_reference(workdir, reference, first_step=3)
    aside = list((ckpts / "corrupt").glob("4-*"))
    assert len(aside) == 1 and str(aside[0]) in warning[1]
    assert tree_digest(aside[0]) == damaged  # every file kept, as it was
    assert checkpoint_steps(workdir) == [2, 4, 6, 8]  # 4 written afresh


def restore_latest(ckpts: Path, data_dir: str):
    cfg = tiny_config(data_dir, "standard", micro_batch=8, steps=STEPS)
    cfg.mesh.data = 1
    run = trainer.setup(cfg, jax.devices()[:1])
    return Checkpoints(str(ckpts), read_only=True).restore_latest(trainer.abstract_train_state(run))


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(cli, reference, tiny_data, tmp_path):
    """From the reference checkpoint 2 with a learning rate that blows the weights up (and no
    checkpoint due): train.py exits 1 naming the step whose loss is not finite, saves nothing,
    and leaves checkpoint 2 byte for byte as it was."""
    workdir = tmp_path / "run"
    ckpts = copy_checkpoints(reference, workdir, (2,), lr=1e30)
    digest = tree_digest(ckpts / "2")

    rc, out = cli.run(workdir, tmp_path / "log.txt", train__lr=1e30, train__checkpoint_every=1000)
    assert rc == 1, out[-3000:]
    err = re.search(r"error: non-finite loss (nan|inf|-inf) at step (\d+); stopping\. The last good checkpoint "
                    r"\(step 2\) is untouched; lower train\.lr or check the data", out)
    assert err, out[-3000:]
    assert "Traceback" not in out
    bad = int(err[2])
    logged = losses(workdir)
    assert [s for s, _ in logged] == list(range(3, bad)) and all(np.isfinite(loss) for _, loss in logged)
    assert sorted(p.name for p in ckpts.iterdir()) == ["2"]  # nothing saved, not even half
    assert tree_digest(ckpts / "2") == digest
    step, state, data, _ = restore_latest(ckpts, tiny_data)
    assert step == 2 and data["step"] == 2
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(state))


def test_non_finite_parameters_are_never_saved(reference, tiny_data, tmp_path):
    """The same learning rate with a checkpoint every step: at step 4 the loss (computed before
    the update) is still finite but the updated weights are not. The save after step 4 must
    refuse rather than write them as the "last good" checkpoint. (In-process, one device.)"""
    workdir = tmp_path / "run"
    ckpts = copy_checkpoints(reference, workdir, (2,), lr=1e30)
    digest = tree_digest(ckpts / "2")
    cfg = tiny_config(tiny_data, "standard", micro_batch=8, steps=STEPS, lr=1e30,
                      checkpoint_every=1)
    cfg.mesh.data = 1
    with pytest.raises(trainer.NonFiniteLoss, match=r"non-finite parameters or optimizer state after step (\d+); "
                       r"not saving them\. The last good checkpoint \(step (\d+)\) is untouched") as err:
        trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    bad, last_good = map(int, re.search(r"after step (\d+).*\(step (\d+)\)", str(err.value)).groups())
    assert bad > 2 and last_good == bad - 1
    logged = losses(workdir)
    assert [s for s, _ in logged] == list(range(3, bad + 1)) and all(np.isfinite(loss) for _, loss in logged)
    assert sorted(p.name for p in ckpts.iterdir()) == [str(s) for s in range(2, bad)]
    assert tree_digest(ckpts / "2") == digest
    step, state, data, _ = restore_latest(ckpts, tiny_data)
    assert step == last_good and data["step"] == last_good
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(state))
