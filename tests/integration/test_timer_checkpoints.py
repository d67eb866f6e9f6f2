"""Time-based checkpoints (train.checkpoint_minutes): a run on a clock of its own, where every
step takes a minute, saves on the timer between its scheduled saves; a timer save is deleted
once a later save is complete (never before), by a resumed run too; and a run resumed from a
timer save trains on bit for bit as the uninterrupted run did.

In-process on one device: every run here compiles the same program in the same process, so
"bit for bit" compares like with like (tests/integration/test_resume.py says why its runs are subprocesses).
"""

import json
import os
import shutil

import jax

from conftest import tiny_config
from onona_jax import checkpoint, train as trainer
from onona_jax.checkpoint import Checkpoints
from onona_jax.train import loop

STEPS = 8
# checkpoint_every 4 and a timer of 2.5 minutes at a minute a step: timer saves after steps 3
# and 7 (2.5 minutes after the start and after step 4's save), scheduled ones after 4 and 8.
SAVES = [(3, True, []), (4, False, [3]), (7, True, [4]), (8, False, [4, 7])]


def config(data_dir):
    cfg = tiny_config(data_dir, "standard", micro_batch=8, steps=STEPS, checkpoint_every=4, keep_checkpoints=10,
                      checkpoint_minutes=2.5)
    cfg.mesh.data = 1
    return cfg


def committed(directory) -> list[int]:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def run(cfg, workdir, monkeypatch, keep_aside=None) -> list[tuple[int, bool, list[int]]]:
    """Train in-process with a clock that advances a minute per step; returns each save as
    (step, timer save?, the steps on disk once the save before it is complete). `keep_aside`
    {step: dir}: a copy of that step's checkpoint, taken while it is on disk."""
    steps_fed = [0]
    global_batch = loop.global_batch

    def counting(run_, local):
        steps_fed[0] += 1
        return global_batch(run_, local)

    saves = []
    save = Checkpoints.save

    def recording(self, step, *args, timer=False):
        self.wait()
        on_disk = committed(self.directory)
        saves.append((step, timer, on_disk))
        for s, target in (keep_aside or {}).items():
            if s in on_disk and not os.path.exists(target):
                shutil.copytree(self.directory / str(s), target)
        return save(self, step, *args, timer=timer)

    monkeypatch.setattr(loop, "global_batch", counting)
    monkeypatch.setattr(checkpoint, "timer_clock", lambda: 60.0 * steps_fed[0])
    monkeypatch.setattr(Checkpoints, "save", recording)
    trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    return saves


def metrics(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def test_timer_saves_are_deleted_after_the_next_save_and_resume_exactly(tiny_data, tmp_path, monkeypatch):
    cfg = config(tiny_data)
    reference = tmp_path / "reference"
    aside = tmp_path / "step3"
    assert run(cfg, reference, monkeypatch, keep_aside={3: aside}) == SAVES
    assert committed(reference / "checkpoints") == [4, 8]  # 7 went once 8 was complete
    ref = {m["step"]: m["loss"] for m in metrics(reference) if "loss" in m}
    assert sorted(ref) == list(range(1, STEPS + 1))
    ref_val = [m["val_loss"] for m in metrics(reference) if "val_loss" in m]

    # Marked as such in the step (Orbax's `metrics` item), so a resumed run knows it too.
    shutil.copytree(aside, tmp_path / "resumed" / "checkpoints" / "3")
    ckpts = Checkpoints(str(tmp_path / "resumed" / "checkpoints"), read_only=True)
    assert ckpts.steps() == [3] and ckpts.timer_steps() == [3]

    # Resumed from the timer save at step 3: steps 4-8 bit for bit, the same saves, and 3 deleted
    # once the scheduled save of step 4 is complete.
    resumed = tmp_path / "resumed"
    assert run(cfg, resumed, monkeypatch) == SAVES[1:]
    assert committed(resumed / "checkpoints") == [4, 8]
    logged = [m for m in metrics(resumed) if "loss" in m]
    assert [m["step"] for m in logged] == list(range(4, STEPS + 1))
    for m in logged:
        assert m["loss"] == ref[m["step"]], m["step"]
    assert [m["val_loss"] for m in metrics(resumed) if "val_loss" in m] == ref_val


def test_timer_off_at_zero_and_restarted_by_every_save(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(checkpoint, "timer_clock", lambda: now[0])
    off, timer = checkpoint.SaveTimer(0), checkpoint.SaveTimer(2.5)
    now[0] = 1e9
    assert not off.due() and timer.due()
    timer.restart()  # (what a save does)
    now[0] += 149.0
    assert not timer.due()
    now[0] += 1.0
    assert timer.due()


def test_keep_checkpoints_counts_scheduled_saves_only(tmp_path):
    """keep 2 of the scheduled saves whatever the timer saved between them; the newest save,
    timer or not, always stays; and a timer save goes once a later one (timer too) is complete."""
    import jax.numpy as jnp

    ckpts = Checkpoints(str(tmp_path / "checkpoints"), keep=2)
    state = {"params": {"w": jnp.ones(3)}}
    after = []
    for step, timer in [(1, False), (2, True), (3, True), (4, False), (5, False), (6, True), (7, False)]:
        ckpts.save(step, state, {"step": step}, "{}", timer=timer)
        ckpts.wait()
        after.append(committed(ckpts.directory))
    assert after == [[1], [1, 2], [1, 3], [1, 4], [4, 5], [4, 5, 6], [5, 7]]


def test_negative_checkpoint_minutes_is_refused_before_any_write(tiny_data, tmp_path):
    """(The command line's one error line: tests/integration/test_config_validation.py BAD_VALUES.)"""
    from test_bad_input import assert_rejected

    cfg = config(tiny_data)
    cfg.train.checkpoint_minutes = -1
    assert_rejected(cfg, tmp_path, "train.checkpoint_minutes=-1", "or 0 (no timer saves)")
