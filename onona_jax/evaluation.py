"""Evaluate a checkpoint: validation loss on the fixed held-out windows (SPEC §5) and, for
twin models, the one-table ablations `a_only` and `b_only`.

The checkpoint is restored onto this run's mesh, whatever mesh it was trained on.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from onona_jax import trainer
from onona_jax.checkpoint import Checkpoints


def load_run(workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None):
    """(run, params, step, cfg) for a workdir's checkpoint, on a (data, fsdp, tensor) mesh."""
    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
    if not ckpts.steps():
        raise ValueError(f"no checkpoints in {ckpts.directory}; train first with train.py --workdir={workdir}")
    use = step if step is not None else ckpts.latest()
    cfg = ml_collections.ConfigDict(ckpts.restore_config(use))
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh
    run = trainer.setup(cfg, devices)
    restored = ckpts.restore_latest(trainer.abstract_train_state(run), step=step)
    step, state, _, _ = restored
    return run, state["params"], step, cfg


def data_dir(cfg, workdir: str) -> str:
    return cfg.data.dir or os.path.join(workdir, "data")


def validation(workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None, loaded=None) -> dict:
    """`loaded`: a `load_run` result to evaluate instead of restoring (eval.py restores once
    for the validation loss and the downstream tasks)."""
    from onona_jax.data import pipeline

    run, params, step, cfg = loaded or load_run(workdir, step, mesh, devices)
    windows = pipeline.validation_windows(
        data_dir(cfg, workdir), cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed
    )
    tables = (None, "a", "b") if cfg.model.head == "twin" else (None,)
    result = trainer.evaluate(run, params, windows, tables, cfg.eval.batch)
    return {"config": cfg.name, "step": step, "windows": len(windows), **result}


def write_json(result: dict, path: str):
    """Atomic write: a reader never sees half a file."""
    if jax.process_index() != 0:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, path)
