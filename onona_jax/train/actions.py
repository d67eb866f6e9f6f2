"""The periodic actions of the training loop: what runs after a step when it is due.

Each action is a small object built from the `loop.Trainer` (`Action(trainer)`), with
`due(step, last) -> bool` and `__call__(step, state)`; after every step the loop asks each of
`ACTIONS` in turn and runs those that are due, `state` being the train state after the step
(`state["params"]`, ...) and `last` whether it was the run's last step. The trainer's parts they
use: `cfg`, `run`, `workdir`, `clock`, `log` (metrics.jsonl), `ckpts`, `batches`, `profiler`,
`preemption`, `metrics` (the step's, on the device), `pending` (`MetricsQueue`).

Adding one (an EMA of the weights, histograms, an export every N steps) is a class and one line,
`register(MyAction)` (tests/examples/test_action_extension.py shows one that trains, resumes and is
removed). An action keeps no state a resume needs, or it keeps it in the workdir itself: a resumed
run builds every action afresh and runs the steps after the checkpoint's.

The run's last step ends differently (`loop.Trainer.finish`): its save is waited for, then a
validation with the model's variants, then train.tasks.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time

import jax

from onona_jax import cli, paths


class NonFiniteLoss(cli.Failure):
    """A non-finite loss or state: the run stops, the last good checkpoint untouched."""


class StopRun(Exception):
    """Raised by an action to end the run after this step with `result`."""

    def __init__(self, result: dict):
        super().__init__(result)
        self.result = result


class MetricsQueue:
    """Each logged step's metrics stay on the device until its log interval ends; then one
    transfer brings them over, a non-finite loss stops the run, and every row is written with
    the interval's rates (`clock.Clock.lap`), each named source's tokens and MFU."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.steps: list[tuple[int, dict]] = []

    def add(self, step: int, metrics: dict):
        self.steps.append((step, metrics))

    def flush(self):
        t, seq_len = self.trainer, self.trainer.cfg.data.seq_len
        if not self.steps:
            return
        host = jax.device_get([m for _, m in self.steps])
        tokens_per_s, times, pauses = t.clock.lap(self.steps[-1][0])
        for (s, _), m in zip(self.steps, host):
            m = {k: float(v) for k, v in m.items()}
            if not math.isfinite(m["loss"]):
                raise NonFiniteLoss(
                    f"non-finite loss {m['loss']} at step {s}; stopping. The last good checkpoint "
                    f"(step {t.ckpts.latest()}) is untouched; lower train.lr or check the data"
                )
            m["tokens_per_s"] = tokens_per_s
            m.update(times)
            # each named source's training tokens through step s
            m.update({f"tokens/{n}": c * seq_len for n, c in t.batches.consumed(s).items()})
            if t.peak:  # causal attention at half the square (summary.flops_per_token); PaLM's beside it
                m["mfu"] = tokens_per_s * t.flops["train"] / (t.peak * 1e12 * jax.device_count())
                m["mfu_full_square"] = tokens_per_s * t.flops["train_full_square"] / (t.peak * 1e12 * jax.device_count())
            if s == self.steps[-1][0]:
                m.update(pauses)
            t.log.write(s, m)
        t.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        self.steps.clear()


def save_failure(ckpts, err) -> cli.Failure:
    """The error line of a failed save: the step whose save failed (`Checkpoints.saved`), the
    directory, the cause, and the last step that is whole."""
    from onona_jax.checkpoint import short_error

    what = f"a checkpoint (step {ckpts.saved})" if ckpts.saved is not None else "a checkpoint"
    reason = short_error(err)
    code = re.search(r"os_error_code='(\d+)'", str(err))  # TensorStore's: the OS's reason first, before its paths
    if code:
        reason = f"{os.strerror(int(code.group(1)))}; {reason}"
    # Listed afresh: Orbax drops the steps a save will rotate away from its list when the save
    # starts, though they stay until it is complete (a timer save just before, say).
    listed = sorted(int(p.name) for p in ckpts.directory.iterdir() if p.name.isdigit())
    good = [s for s in listed if paths.exists(paths.join(ckpts.directory, str(s), "commit_success.txt"))]
    return cli.Failure(
        f"could not write {what} to {ckpts.directory} ({reason}); stopping. The last good "
        f"checkpoint (step {good[-1] if good else 'none'}) is intact; free space or fix the directory's "
        "permissions, then rerun the same command to resume"
    )


def save(t, step: int, timer: bool = False):
    """Save `step` now, never parameters that produced a non-finite loss, nor non-finite ones
    behind a finite loss (an inf lr, a pre-emption)."""
    t.pending.flush()
    if not bool(t.all_finite(t.state)):
        raise NonFiniteLoss(
            f"non-finite parameters or optimizer state after step {step}; not saving them. "
            f"The last good checkpoint (step {t.ckpts.latest()}) is untouched; lower train.lr or check the data"
        )
    with t.clock.pause("checkpoint_s"):
        try:
            t.ckpts.save(step, t.state, t.batches.get_state(), t.cfg.to_json(), timer=timer)
        except Exception as err:  # noqa: BLE001 - a failed write (full disk, read-only, quota)
            raise save_failure(t.ckpts, err) from None


def wait_for_saves(ckpts):
    try:
        ckpts.wait()
    except Exception as err:  # noqa: BLE001 - the asynchronous part of a save failed
        raise save_failure(ckpts, err) from None


def validate(t, step: int, tables=(None,)) -> dict:
    jax.block_until_ready(t.state)  # the steps in flight are training time
    with t.clock.pause("validation_s"):
        result = t.evaluator(t.state["params"], t.data.val_windows, tables, t.cfg.eval.batch, groups=t.data.val_groups)
        t.log.write(step, result)
    return result


def score_tasks(t, step: int) -> dict:
    """train.tasks on the live parameters; every process scores (the batches are sharded over
    all of them), process 0 writes."""
    jax.block_until_ready(t.state)  # the steps in flight are training time
    with t.clock.pause("task_s"):
        began = time.perf_counter()
        row = t.tasks(t.state["params"])
        row["task_s"] = time.perf_counter() - began  # in the scores' own row: the last step's too is logged
        t.log.write(step, row)
    return row


class Preemption:
    """SIGTERM, or the first SIGINT (Ctrl-C: `cli.graceful_stop`), sets a flag; the loop saves a
    checkpoint after the step in flight (or lets the save of that step already in flight finish)
    and exits; `interrupted`: it was SIGINT (exit 130). Several hosts agree on the step through
    jax's preemption sync point, which hears SIGTERM: a SIGINT is passed on to it as one."""

    def __init__(self):
        self.requested = self.interrupted = False
        self._previous = self._stop = None

    def __enter__(self):
        if jax.process_count() == 1:  # several hosts agree through jax's preemption sync point
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._stop = cli.graceful_stop(self._on_sigint)
        self._stop.__enter__()
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def _on_sigint(self):
        self.interrupted = True
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption notifier
        else:
            self.requested = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        self._stop.__exit__(*exc)
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# ----------------------------------------------------------------------------- the actions


class Action:
    """The base of the periodic actions (optional: any object with `due` and `__call__` will do)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def due(self, step: int, last: bool) -> bool:
        raise NotImplementedError

    def __call__(self, step: int, state) -> None:
        raise NotImplementedError


class StopProfile(Action):
    """The trace ends after its range's last step (or the run's): written, its time paused."""

    def due(self, step, last):
        return self.trainer.profiler.stop_due(step, last)

    def __call__(self, step, state):
        self.trainer.clock.add_pause("profile_s", self.trainer.profiler.finish(step, state))


class Progress(Action):
    """The progress bar, a step on."""

    def due(self, step, last):
        return True

    def __call__(self, step, state):
        self.trainer.bar.update(1)


class FailedSave(Action):
    """A failed asynchronous save stops the run after the step it is found in."""

    def due(self, step, last):
        return True

    def __call__(self, step, state):
        try:
            self.trainer.ckpts.raise_failed_save()
        except Exception as err:  # noqa: BLE001
            raise save_failure(self.trainer.ckpts, err) from None


class LogMetrics(Action):
    """Every train.log_every steps and the last: the interval's metrics written. A step that is
    validated, saved or scored keeps its metrics too, for the next write (and a save's check)."""

    def logged(self, step, last):
        return step % self.trainer.cfg.train.log_every == 0 or last

    def due(self, step, last):
        every = self.trainer.cfg.train
        return (self.logged(step, last) or step % every.checkpoint_every == 0 or step % every.eval_every == 0
                or self.trainer.tasks.due(step, self.trainer.run.steps))

    def __call__(self, step, state):
        self.trainer.pending.add(step, self.trainer.metrics)
        if self.logged(step, step == self.trainer.run.steps):
            self.trainer.pending.flush()


class Validate(Action):
    """Every train.eval_every steps (the last step's, with variants: `Trainer.finish`)."""

    def due(self, step, last):
        return step % self.trainer.cfg.train.eval_every == 0 and not last

    def __call__(self, step, state):
        validate(self.trainer, step)


class ScoreTasks(Action):
    """train.tasks every train.tasks_every steps (the last step's: after its validation, `Trainer.finish`)."""

    def due(self, step, last):
        return self.trainer.tasks.due(step, self.trainer.run.steps) and not last

    def __call__(self, step, state):
        score_tasks(self.trainer, step)


class Save(Action):
    """Every train.checkpoint_every steps, the last, and by train.checkpoint_minutes at logged
    steps: `Checkpoints.maybe_save` decides, asked after every step (a timer save is a collective
    every process asks at the same step)."""

    def due(self, step, last):
        return True

    def __call__(self, step, state):
        t = self.trainer
        t.ckpts.maybe_save(step, step == t.run.steps, lambda timer: save(t, step, timer))


class StopOnPreemption(Action):
    """SIGTERM or Ctrl-C (`Preemption`): this step saved (unless its save is in flight already:
    it is waited for), and the run ends. The last step's own save and `Trainer.finish` see to it there."""

    def due(self, step, last):
        return self.trainer.preemption.reached(step) and not last  # (reached: a sync point every step)

    def __call__(self, step, state):
        t = self.trainer
        if t.ckpts.saved != step:
            save(t, step)
        wait_for_saves(t.ckpts)
        from tqdm import tqdm

        interrupted = t.preemption.interrupted
        tqdm.write(f"{'interrupted' if interrupted else 'pre-empted'}: saved step {step}; rerun "
                   "the same command to resume", file=sys.stderr)  # (on a line of its own, not the bar's)
        raise StopRun({"step": step, "preempted": True, **({"interrupted": True} if interrupted else {})})


# The actions, in the order they run after each step.
ACTIONS: list = [StopProfile, Progress, FailedSave, LogMetrics, Validate, ScoreTasks, Save, StopOnPreemption]


def register(action, before=Save):
    """Add an action (a class built from the trainer) to ACTIONS, by default just before the
    save, so that a step a pre-emption saves has run it; returns it (usable as a decorator)."""
    ACTIONS.insert(ACTIONS.index(before), action)
    return action


def unregister(action):
    ACTIONS.remove(action)
