"""A periodic action added from outside the package, the worked example of adding one to the
training loop (`onona_jax/train/actions.py`).

`ParamNorm`: every `EVERY` steps, the global norm of the parameters as one JSON line in
`<workdir>/param_norm.jsonl`. It is a class with `due(step, last)` and `__call__(step, state)`,
written here and registered with one line, `actions.register(ParamNorm)`; nothing in the package
names it. A run pre-empted and resumed writes the same rows, bit for bit, as one that ran
through (the action keeps nothing but its file, and the resumed run restores the parameters
exactly); once removed (`actions.unregister`), the loop runs without it.
"""

import json
import os
import signal

import jax
import optax
import pytest

from conftest import tiny_config
from onona_jax import train as trainer
from onona_jax.train import actions

STEPS, EVERY = 4, 1


class ParamNorm(actions.Action):
    """The parameters' global norm every EVERY steps, a line of <workdir>/param_norm.jsonl."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.path = os.path.join(trainer.workdir, "param_norm.jsonl")

    def due(self, step, last):
        return step % EVERY == 0

    def __call__(self, step, state):
        norm = float(optax.global_norm(state["params"]))  # every process computes: the params are sharded
        if jax.process_index() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "param_norm": norm}) + "\n")


@pytest.fixture
def registered():
    actions.register(ParamNorm)  # the one line that adds it
    yield
    if ParamNorm in actions.ACTIONS:
        actions.unregister(ParamNorm)


def rows(workdir):
    return [json.loads(line) for line in open(workdir / "param_norm.jsonl")]


def test_an_added_action_runs_resumes_exactly_and_is_removed(tiny_data, tmp_path, registered):
    cfg = tiny_config(tiny_data, "standard", micro_batch=8, steps=STEPS)
    cfg.mesh.data = 1
    through, resumed = tmp_path / "through", tmp_path / "resumed"
    trainer.train(cfg, str(through), devices=jax.devices()[:1], progress=False)
    expected = rows(through)
    assert [r["step"] for r in expected] == list(range(EVERY, STEPS + 1, EVERY))

    # Pre-empted after step 2 (SIGTERM to this process, sent by a one-off action of its own):
    # step 2 is saved, and the rerun resumes there.
    class SigtermAtStep2(actions.Action):
        def due(self, step, last):
            return step == 2

        def __call__(self, step, state):
            os.kill(os.getpid(), signal.SIGTERM)

    actions.register(SigtermAtStep2)
    try:
        first = trainer.train(cfg, str(resumed), devices=jax.devices()[:1], progress=False)
    finally:
        actions.unregister(SigtermAtStep2)
    assert first == {"step": 2, "preempted": True}
    assert [r["step"] for r in rows(resumed)] == list(range(EVERY, 3, EVERY))
    trainer.train(cfg, str(resumed), devices=jax.devices()[:1], progress=False)
    assert rows(resumed) == expected  # the same steps, the same values bit for bit

    # Registered before the save, so a step a pre-emption saves has run it.
    assert actions.ACTIONS.index(ParamNorm) == actions.ACTIONS.index(actions.Save) - 1
    actions.unregister(ParamNorm)
    assert ParamNorm not in actions.ACTIONS  # (the loop builds its actions from ACTIONS at each start)
