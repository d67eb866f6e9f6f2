"""Orbax checkpoints: train state, data-iterator state and config, every N steps.

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint either exists whole or not at all. Restoring tries the newest step first; if it
cannot be read, it is moved aside to `checkpoints/corrupt/` (never deleted), a warning is
printed, and the step before is tried.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import jax
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

    def restore_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def restore_latest(self, abstract_state, step: int | None = None):
        """Newest readable checkpoint (or exactly `step`): (step, state, data_state, config),
        or None when there is none. A broken newest checkpoint is set aside loudly."""
        if step is not None:
            if step not in self.steps():
                raise ValueError(f"no checkpoint at step {step} in {self.directory}; have {self.steps()}")
            return (step, *self.restore(step, abstract_state))
        for candidate in reversed(self.steps()):
            try:
                return (candidate, *self.restore(candidate, abstract_state))
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
