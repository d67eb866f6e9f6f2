"""The training loop: resume, step, log, validate, checkpoint, and stop cleanly on
pre-emption or a non-finite loss.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import cli, summary
from onona_jax.checkpoint import Checkpoints
from onona_jax.eval.validation import Evaluator, variants
from onona_jax.train.state import abstract_train_state, init_state, setup
from onona_jax.train.step import global_batch, make_train_step
from onona_jax.train.upcycle import upcycle

# Peak dense bf16 TFLOP/s per device, for model FLOPs utilisation.
PEAK_TFLOPS = {
    "H100": 989.0, "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0,
}


def peak_tflops(cfg) -> float | None:
    if cfg.train.peak_tflops > 0:
        return float(cfg.train.peak_tflops)
    kind = jax.devices()[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops
    return None


# ----------------------------------------------------------------------------- the loop


class NonFiniteLoss(cli.Failure):
    """A non-finite loss or state: the run stops, the last good checkpoint untouched."""


class Preemption:
    """SIGTERM sets a flag; the loop saves a checkpoint after the step in flight and exits."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if jax.process_count() == 1:  # several hosts agree through jax's preemption sync point
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class MetricsLog:
    """metrics.jsonl (one JSON object per logged step) and TensorBoard, from process 0 only."""

    def __init__(self, workdir: str):
        self.primary = jax.process_index() == 0
        if self.primary:
            from tensorboardX import SummaryWriter

            self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
            self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict):
        if not self.primary:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)

    def close(self):
        if self.primary:
            self.jsonl.close()
            self.tb.close()


def prepare_data(cfg, workdir: str) -> str:
    """The token shards: cfg.data.dir, or the bundled corpus prepared once into the workdir."""
    from onona_jax.data import pipeline

    if cfg.data.dir:
        return cfg.data.dir
    data_dir = os.path.join(workdir, "data")
    if jax.process_index() == 0:
        pipeline.ensure_bundled_data(data_dir, cfg.data.seq_len)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bundled data prepared")
    return data_dir


def train(cfg, workdir: str, devices=None, progress: bool = True) -> dict:
    """Train (or resume) in `workdir`; returns the final evaluation."""
    from tqdm import tqdm

    from onona_jax.data import pipeline

    run = setup(cfg, devices)  # every config check, before any write
    if cfg.data.dir:  # user data: check it before writing anything
        pipeline.TokenStore(cfg.data.dir, "train", vocab_size=cfg.model.vocab_size).num_windows(cfg.data.seq_len)
        pipeline.validation_windows(cfg.data.dir, cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed)
    if cfg.init_from and not os.path.isdir(os.path.join(cfg.init_from, "checkpoints")):
        raise ValueError(f"init_from={cfg.init_from!r} has no checkpoints/; give a standard run's workdir")
    os.makedirs(workdir, exist_ok=True)
    data_dir = prepare_data(cfg, workdir)
    val_windows = pipeline.validation_windows(data_dir, cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(cfg.to_json(indent=2))

    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"), keep=cfg.train.keep_checkpoints)
    restored = ckpts.restore_latest(abstract_train_state(run))
    batches = pipeline.train_batches(
        data_dir, cfg.data.seq_len, cfg.train.global_batch, seed=cfg.data.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    if restored is None:
        start, state = 0, init_state(run, cfg.seed)
        if cfg.init_from:
            state = upcycle(run, state, cfg.init_from)
    else:
        start, state, data_state, _ = restored
        batches.set_state(data_state)
        print(f"resumed from step {start} in {ckpts.directory}", file=sys.stderr)

    evaluator = Evaluator(run.graphdef, run.mesh, run.param_shardings)
    train_step = make_train_step(run)
    all_finite = jax.jit(lambda t: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(t)])),
                         out_shardings=NamedSharding(run.mesh, P()))
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    flops = summary.flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    peak = peak_tflops(cfg)
    log = MetricsLog(workdir)
    pending: list[tuple[int, dict]] = []
    last_time, last_step = time.perf_counter(), start
    bar = tqdm(total=run.steps, initial=start, disable=not progress or jax.process_index() != 0,
               dynamic_ncols=True, desc=cfg.name or "train")

    def flush():
        """Bring logged metrics to the host (one transfer per log interval); stop on NaN."""
        nonlocal last_time, last_step
        if not pending:
            return
        host = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        tok_s = (pending[-1][0] - last_step) * tokens_per_step / max(now - last_time, 1e-9)
        last_time, last_step = now, pending[-1][0]
        for (s, _), m in zip(pending, host):
            m = {k: float(v) for k, v in m.items()}
            if not math.isfinite(m["loss"]):
                raise NonFiniteLoss(
                    f"non-finite loss {m['loss']} at step {s}; stopping. The last good checkpoint "
                    f"(step {ckpts.latest()}) is untouched; lower train.lr or check the data"
                )
            m["tokens_per_s"] = tok_s
            if peak:
                m["mfu"] = tok_s * flops / (peak * 1e12 * jax.device_count())
            log.write(s, m)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        pending.clear()

    def save(step):
        flush()  # never save parameters that produced a non-finite loss,
        if not bool(all_finite(state)):  # nor non-finite ones behind a finite loss (an inf lr, a preemption)
            raise NonFiniteLoss(
                f"non-finite parameters or optimizer state after step {step}; not saving them. "
                f"The last good checkpoint (step {ckpts.latest()}) is untouched; lower train.lr or check the data"
            )
        ckpts.save(step, state, batches.get_state(), cfg.to_json())

    def validate(step, tables=(None,)):
        result = evaluator(state["params"], val_windows, tables, cfg.eval.batch)
        log.write(step, result)
        return result

    result = {}
    try:
        with Preemption() as preempt:
            if start == 0 and cfg.init_from:  # the upcycled model's starting point, logged
                validate(0)
            for step in range(start + 1, run.steps + 1):
                state, metrics = train_step(state, global_batch(run, next(batches)))
                bar.update(1)
                if step % cfg.train.log_every == 0 or step == run.steps:
                    pending.append((step, metrics))
                    flush()
                elif step % cfg.train.checkpoint_every == 0 or step % cfg.train.eval_every == 0:
                    pending.append((step, metrics))
                if step % cfg.train.eval_every == 0 and step != run.steps:
                    validate(step)
                if step % cfg.train.checkpoint_every == 0 or step == run.steps:
                    save(step)
                if preempt.reached(step) and step != run.steps:
                    save(step)
                    ckpts.wait()
                    print(f"pre-empted: saved step {step}; rerun the same command to resume",
                          file=sys.stderr)
                    return {"step": step, "preempted": True}
            ckpts.wait()
            result = validate(run.steps, variants(cfg.model))
    finally:
        bar.close()
        log.close()
        ckpts.wait()
    result["step"] = run.steps
    return result
