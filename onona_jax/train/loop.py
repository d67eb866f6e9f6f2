"""The training loop: resume, step, then the periodic actions that are due (log, validate,
score train.tasks, save, profile, stop on pre-emption: `train/actions.py`), and stop cleanly on
pre-emption or a non-finite loss.

`train` checks the config, the data and the workdir's run before any write, then holds the
workdir's lock; `Trainer` opens the run's resources into one `contextlib.ExitStack`, so they are
closed in one order whatever ends the run, and steps.
"""

from __future__ import annotations

import contextlib
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import cli, compile_cache, paths, summary
from onona_jax.checkpoint import Checkpoints
from onona_jax.eval.validation import Evaluator, variants
from onona_jax.train import actions, downstream
from onona_jax.train.actions import Preemption, StopRun
from onona_jax.train.clock import Clock, peak_tflops
from onona_jax.train.lock import LockLost, raise_if_lost as raise_if_lock_lost
from onona_jax.train.metrics import MetricsLog
from onona_jax.train.profile import Profiler
from onona_jax.train.resume import check_resume
from onona_jax.train.startup import (existing_entries, open_data, prepare_data, remove_if_empty, remove_new_entries,
                                     require_writable, take_lock, write_config)
from onona_jax.train.state import abstract_train_state, init_state, setup
from onona_jax.train.step import global_batch, make_train_step
from onona_jax.train.upcycling import upcycle

# Names the tests and tools import from here, each living in its concept's module.
from onona_jax.train.resume import check_same_data, config_edits  # noqa: F401


def train(cfg, workdir: str, devices=None, progress: bool = True) -> dict:
    """Train (or resume) in `workdir`; returns the final evaluation. Holds the workdir's lock
    (`lock.json`) from its first write to its return, whatever ends the run."""
    run = setup(cfg, devices)  # every config check, before any write
    task_files = downstream.resolve(cfg)  # train.tasks: names and files, likewise (every host reads its own)
    if cfg.train.profile_start > run.steps:
        raise ValueError(f"train.profile_start={cfg.train.profile_start} lies after the run's last step {run.steps}; "
                         f"give a step in 1..{run.steps} (or 0: no trace)")
    # Before anything compiles; an unwritable cache is an error line here, before the workdir is touched.
    compile_cache.use(cfg.train.compile_cache, cfg.train.compile_cache_min_s)
    # User data is opened and checked here, once, before anything is written; the run reads it as
    # opened (a bucket's shards copied into data.cache_dir, data/storage.py). The bundled corpus
    # is prepared into the workdir, so after the lock is taken (`prepare_data`).
    data = open_data(cfg, cfg.data.dir) if cfg.data.dir or cfg.data.mixture else None
    if cfg.init_from and not paths.isdir(paths.Workdir(cfg.init_from).checkpoints):
        raise ValueError(f"init_from={cfg.init_from!r} has no checkpoints/; give a standard run's workdir")
    check_resume(cfg, run, workdir, data)  # the same run, or exit 2 before any write
    new_workdir = not paths.is_cloud(workdir) and not os.path.exists(workdir)
    with contextlib.ExitStack() as resources:  # closed in reverse: the lock last but the workdir itself
        if new_workdir:
            resources.callback(remove_if_empty, workdir)
        # From the lock on, a first SIGINT (Ctrl-C) stops at the next safe point of the start-up
        # (`Trainer.stop_if_interrupted`), never inside a write: the workdir is left as a refused start leaves it.
        startup = resources.enter_context(cli.graceful_stop())
        resources.callback(take_lock(workdir).release)
        check_resume(cfg, run, workdir, data)  # again, now that no other run can write meanwhile
        if jax.process_count() > 1:  # every process has read the workdir before any writes to it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("resume checked")
        return Trainer(cfg, run, workdir, data, startup, task_files).train(resources, progress)


class Trainer:
    """One run in a locked workdir: its start-up (data, config.json, checkpoints, metrics),
    the step loop and the final evaluation. The parts the periodic actions use are its
    attributes (`actions` lists them)."""

    def __init__(self, cfg, run, workdir: str, data=None, startup=None, task_files=None):
        self.cfg, self.run, self.workdir, self.data = cfg, run, workdir, data
        self.startup = startup or cli.GracefulStop()
        self.task_files = task_files or {}
        self.wd = paths.Workdir(workdir)
        self.ckpts = None
        self.started = False  # start-up done: a failure from here on is no refused start
        self._still_ours = None

    def train(self, resources: contextlib.ExitStack, progress: bool) -> dict:
        """Open the run's resources into `resources`, then train."""
        resources.push(self._roll_back_refused_start(existing_entries(self.workdir)))
        self._prepare()
        self._restore(resources)
        self._build(resources, progress)
        self.started = True
        self.ckpts.schedule_saves(self.cfg.train.checkpoint_every, self.cfg.train.checkpoint_minutes,
                                  self.cfg.train.log_every)
        self.preemption = resources.enter_context(Preemption())
        return self.steps()

    def stop_if_interrupted(self, resume_from=None):
        """A safe point of the start-up: stop here if a SIGINT came."""
        if self.startup.requested and resume_from is None and paths.isdir(self.wd.checkpoints):  # (not restored yet)
            resume_from = max((int(p.name) for p in paths.path(self.wd.checkpoints).iterdir() if p.name.isdigit()),
                              default=None)
        self.startup.raise_if_requested(f"stopped during start-up, before the first step; {self.workdir} is left as it was (rerun "
                           f"the same command to {f'resume from step {resume_from}' if resume_from else 'start'})")

    def _prepare(self):
        """The outputs writable, the data prepared and checked, config.json written."""
        cfg, workdir = self.cfg, self.workdir
        self.flops = summary.flops_per_token(cfg.model, cfg.data.seq_len)  # the family's count, before any write
        require_writable(self.wd.checkpoints)
        self.profiler = Profiler(cfg, workdir)
        self.profiler.require_writable()
        try:  # (a full disk here is a runtime refusal: the start's roll-back removes what it made)
            self.data = prepare_data(cfg, workdir, self.data)
            if jax.process_index() == 0:  # every shard against the manifest's hash, once per change of the shard
                self.data.verify(workdir)
        except OSError as err:
            what = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
            raise cli.Failure(f"could not prepare or check the data for {workdir} ({what}); free space (or fix "
                              "that file's permissions), then rerun the same command") from None
        self.stop_if_interrupted()
        write_config(cfg, workdir)

    def _restore(self, resources: contextlib.ExitStack):
        """The checkpoints opened, the newest restored (or a new state), the batches from there."""
        from onona_jax.data import pipeline

        cfg, run = self.cfg, self.run
        self.ckpts = Checkpoints(self.wd.checkpoints, keep=cfg.train.keep_checkpoints)
        resources.push(self._stop_saves_if_failed)
        resources.callback(self._stop_profile)  # a run that stops inside the traced range still leaves its trace
        removed = self.ckpts.remove_unfinished()  # a failed or killed save's leftovers
        if removed:
            print(f"removed unfinished checkpoint directories {removed} from {self.ckpts.directory} (saves that "
                  "failed or were killed)", file=sys.stderr)
        restored = self.ckpts.restore_latest(abstract_train_state(run))
        self.batches = pipeline.train_batches(
            self.data, cfg.data.seq_len, cfg.train.global_batch, seed=cfg.data.seed,
            process_index=jax.process_index(), process_count=jax.process_count(),
            read_threads=cfg.data.read_threads, prefetch=cfg.data.prefetch,
        )
        if restored is None:
            self.start, self.state = 0, init_state(run, cfg.seed)
            if cfg.init_from:
                self.state = upcycle(run, self.state, cfg.init_from)
        else:
            self.start, self.state, data_state, _ = restored
            self.batches.set_state(data_state)
            print(f"resumed from step {self.start} in {self.ckpts.directory}", file=sys.stderr)
        self.stop_if_interrupted(self.start)

    def _build(self, resources: contextlib.ExitStack, progress: bool):
        """The step, the evaluators, the clock, metrics.jsonl and the progress bar."""
        from tqdm import tqdm

        cfg, run, start = self.cfg, self.run, self.start
        self.evaluator = Evaluator(run.graphdef, run.mesh, run.param_shardings, run.eot)
        self.tasks = downstream.TrainTasks(cfg, run.mesh, self.task_files)
        self.train_step = make_train_step(run)
        self.all_finite = jax.jit(lambda t: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(t)])),
                                  out_shardings=NamedSharding(run.mesh, P()))
        self.clock = Clock(start, cfg.train.global_batch * cfg.data.seq_len)
        self.peak = peak_tflops(cfg)
        self.log = resources.enter_context(contextlib.closing(MetricsLog(self.workdir, cfg)))
        self.log.restart(start)
        change = self.batches.mixture_change
        if change:  # the weights changed on resume: allowed, and recorded
            self.log.note(start, mixture_change=change)
            print(f"resumed with data.mixture's shares {change['to']} (the run's were {change['from']}): "
                  f"the new composition applies from step {start + 1}", file=sys.stderr)
        self.pending = actions.MetricsQueue(self)
        self.bar = resources.enter_context(contextlib.closing(tqdm(
            total=run.steps, initial=start, disable=not progress or jax.process_index() != 0,
            dynamic_ncols=True, desc=cfg.name or "train")))

    def steps(self) -> dict:
        """The step loop: a batch, a step, then each periodic action that is due."""
        due_after_step = [make(self) for make in actions.ACTIONS]
        if self.start == 0 and self.cfg.init_from:  # the upcycled model's starting point, logged
            actions.validate(self, 0)
        try:
            for step in range(self.start + 1, self.run.steps + 1):
                raise_if_lock_lost()  # a run whose workdir lock was lost (a bucket lease) stops here
                with self.clock.waiting_for_data():
                    batch = global_batch(self.run, next(self.batches))
                self.profiler.start_if_due(step)
                self.state, self.metrics = self.step(step, batch)
                last = step == self.run.steps
                for action in due_after_step:
                    if action.due(step, last):
                        action(step, self.state)
        except StopRun as stop:
            return stop.result
        return self.finish()

    def step(self, step: int, batch):
        if step > self.start + 1:
            return self.train_step(self.state, batch)
        with self.clock.compiling(self.cfg.train.compile_cache):
            out = self.train_step(self.state, batch)
        if self.startup.requested or self.preemption.interrupted:  # a Ctrl-C in the start-up or the compile:
            self.startup.requested = True  # the step is not kept, and the workdir left as a refused start leaves it
            self.started = False
            self.stop_if_interrupted(self.start)
        return out

    def finish(self) -> dict:
        """After the last step: its save complete, a validation with the model's variants, train.tasks."""
        steps = self.run.steps
        actions.wait_for_saves(self.ckpts)
        if self.preemption.interrupted:  # in the last step or its save: the final validation is left to the rerun
            from tqdm import tqdm

            tqdm.write(f"interrupted: saved step {steps}, the last; rerun the same command for the final "
                       "validation", file=sys.stderr)
            return {"step": steps, "preempted": True, "interrupted": True}
        result = actions.validate(self, steps, variants(self.cfg.model))
        if self.tasks.due(steps, steps):
            result.update(actions.score_tasks(self, steps))
        result["step"] = steps
        return result

    # The clean-up after a failure, in `resources` (the profile's and the files' closing run first).

    def _stop_profile(self):
        try:
            self.profiler.stop()
        except Exception as err:  # noqa: BLE001 - already stopping: the run's own error is reported
            print(f"warning: the profile was not written ({err})", file=sys.stderr)

    def _still_locked(self) -> bool:
        """After a failure: whether the workdir is still this run's (a lost lock: it may be another run's now)."""
        if self._still_ours is None:
            try:
                raise_if_lock_lost()
                self._still_ours = True
            except LockLost:
                self._still_ours = False
        return self._still_ours

    def _stop_saves_if_failed(self, exc_type, *_):
        if exc_type is not None:  # the save in flight ends; failed saves' directories go
            self.ckpts.stop(remove=self._still_locked())

    def _roll_back_refused_start(self, before: set[str] | None):
        def roll_back(exc_type, *_):
            if exc_type is not None and self._still_locked() and not self.started:
                remove_new_entries(self.workdir, before)  # a refused start leaves the workdir as it found it
        return roll_back
