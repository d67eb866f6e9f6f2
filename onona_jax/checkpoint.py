"""Orbax checkpoints: train state, data-iterator state and config, every N steps.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint either exists whole or not at all. Restoring tries the newest step first; if it
cannot be read, it is moved aside to `checkpoints/corrupt/` (never deleted), a warning is
printed, and the step before is tried.

Evaluation, serving, export and analysis restore the parameters only (`restore_params`):
no optimizer state, no training run, so a read needs the parameters' memory and nothing more.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: str, keep: int = 3, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "data", "config"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=not read_only, read_only=read_only
            ),
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, data_state: dict, config_json: str):
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(json.loads(config_json)),
            ),
        )

    def wait(self):
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state):
        """(state, data_state, config dict) at `step`, placed as `abstract_state`'s shardings say."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(),
            ),
        )
        return out["state"], out["data"], out["config"]

    def restore_params(self, step: int, abstract_params, via_host: bool = False):
        """Only the parameters of the train state at `step`, placed as `abstract_params`'s
        shardings say (ShapeDtypeStructs with shardings): the optimizer moments stay on disk.
        `via_host` (one device): read host arrays and place them one at a time, so the read
        never holds a second copy of more than one array (Orbax places all at once)."""
        if via_host:
            arg = lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype)  # noqa: E731
        else:
            arg = lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)  # noqa: E731
        restore_args = jax.tree.map(arg, abstract_params)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item={"params": abstract_params}, restore_args={"params": restore_args},
                    partial_restore=True,
                ),
            ),
        )
        params = out["state"]["params"]
        if via_host:
            flat, treedef = jax.tree.flatten(params)
            shardings = jax.tree.leaves(jax.tree.map(lambda a: a.sharding, abstract_params))
            del params, out
            for i, sharding in enumerate(shardings):
                flat[i] = jax.device_put(flat[i], sharding)  # the host copy goes with the slot
            params = jax.tree.unflatten(treedef, flat)
        return params

    def restore_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def restore_latest(self, abstract_state, step: int | None = None, read=None):
        """Newest readable checkpoint (or exactly `step`): (step, state, data_state, config),
        or None when there is none. A broken newest checkpoint is set aside loudly. `read`
        (step -> result tuple) replaces the full restore (e.g. parameters only)."""
        read = read or (lambda s: self.restore(s, abstract_state))
        if step is not None:
            if step not in self.steps():
                raise ValueError(f"no checkpoint at step {step} in {self.directory}; have {self.steps()}")
            return (step, *read(step))
        for candidate in reversed(self.steps()):
            try:
                return (candidate, *read(candidate))
            except Exception as err:  # noqa: BLE001 - any read failure means "not usable"
                moved = self._set_aside(candidate)
                warnings.warn(
                    f"checkpoint at step {candidate} could not be restored ({type(err).__name__}: "
                    f"{str(err)[:300]}); moved to {moved} and falling back to the one before",
                    stacklevel=2,
                )
        return None

    def _set_aside(self, step: int) -> str:
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(self.directory, "corrupt", f"{step}-{int(time.time())}")
        if jax.process_index() == 0 and os.path.exists(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(src, dst)
        # Reload the manager's view of which steps exist.
        self.manager.reload()
        return dst


def saved_config(workdir: str, step: int | None = None):
    """The config saved with a run's checkpoint (the latest unless `step`), no array read."""
    import ml_collections

    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
    if not ckpts.steps():
        raise ValueError(f"no checkpoints in {ckpts.directory}; train first with train.py --workdir={workdir}")
    use = step if step is not None else ckpts.latest()
    if use not in ckpts.steps():
        raise ValueError(f"no checkpoint at step {use} in {ckpts.directory}; have {ckpts.steps()}")
    return ml_collections.ConfigDict(ckpts.restore_config(use))


def restore_params(workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None, parts=None,
                   via_host: bool = False):
    """(params, step, cfg, mesh) of a run's checkpoint (the latest readable one unless `step`),
    the parameters alone, placed on a (data, fsdp, tensor) mesh of `devices` whatever mesh
    trained them. `parts` (e.g. ("head",)) restores only those top-level parts of the tree,
    so a caller can hold one part at a time (serving folds the head before the trunk);
    `via_host` places them one array at a time (`Checkpoints.restore_params`)."""
    from onona_jax import models, sharding
    from onona_jax.config import validate

    cfg = validate(saved_config(workdir, step))
    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
    grid = sharding.make_mesh(*mesh, devices)
    abstract = models.placed(cfg.model, grid)
    if parts is not None:
        abstract = {k: abstract[k] for k in parts}
    restored = ckpts.restore_latest(None, step, read=lambda s: (ckpts.restore_params(s, abstract, via_host),))
    step, params = restored
    return params, step, cfg, grid
