"""A run's start-up, before its first step: the workdir's lock, the data opened and checked,
config.json written, and what a refused start removes again so that it leaves the workdir as it
found it (`STARTUP_ENTRIES`)."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

from onona_jax import cli, paths
from onona_jax.train.lock import WorkdirLock
from onona_jax.train.resume import config_edits


def require_writable(directory: str):
    """Create `directory` and a file in it, now: a read-only or full disk is found before the
    first step, not inside an asynchronous checkpoint write."""
    why = cli.unwritable(directory)
    if why:
        raise cli.Failure(f"cannot write to {directory} ({why}); make it writable "
                          "(or free space), then rerun the same command")


# What a start creates directly under the workdir (`loop.Trainer`, before its first step; the
# lock's files are the lock's), removed again when that start is refused (`remove_new_entries`).
STARTUP_ENTRIES = (paths.Workdir.CHECKPOINTS, paths.Workdir.CONFIG, paths.Workdir.DATA, paths.Workdir.DATA_RECORD,
                   paths.Workdir.METRICS, paths.Workdir.PROFILE, paths.Workdir.TENSORBOARD, paths.Workdir.WANDB,
                   paths.Workdir.WANDB_ID)


def existing_entries(workdir: str) -> set[str] | None:
    """Which of STARTUP_ENTRIES exist under `workdir` (process 0; None elsewhere)."""
    if jax.process_index() != 0:
        return None
    return {name for name in STARTUP_ENTRIES if paths.exists(paths.Workdir(workdir).entry(name))}


def remove_new_entries(workdir: str, before: set[str] | None):
    """After a start that failed before its first step: remove the STARTUP_ENTRIES it created
    (an empty checkpoints/, config.json, metrics.jsonl, a prepared data/, ...), so a refused
    start leaves the workdir as it found it. The run holds the workdir's lock: they are its own."""
    if before is None:
        return
    for name in set(STARTUP_ENTRIES) - before:
        entry = paths.path(paths.Workdir(workdir).entry(name))
        try:
            if entry.is_dir():
                entry.rmtree()
            elif entry.exists():
                entry.unlink()
        except Exception:  # noqa: BLE001 - already failing: that error is the one reported
            pass


def remove_if_empty(workdir: str):
    """A start refused before its first step leaves no empty workdir either."""
    try:
        os.rmdir(workdir)  # (only if empty)
    except OSError:
        pass


def open_data(cfg, data_dir: str = ""):
    """The run's data opened and checked once (`pipeline.RunData`): data.mixture's sources, else
    `data_dir`; made by data.tokenizer, the train splits, ids below model.vocab_size too, and
    the validation windows."""
    from onona_jax.data import mixture, pipeline

    return pipeline.open_for_training(mixture.parse(cfg.data.mixture) or data_dir, cfg.data.seq_len,
                                      cfg.eval.windows, cfg.eval.seed,
                                      model_vocab=cfg.model.vocab_size, cache_dir=cfg.data.cache_dir or None,
                                      bucket_read=cfg.data.bucket_read, tokenizer=cfg.data)


def prepare_data(cfg, workdir: str, data=None):
    """The run's data (`pipeline.RunData`): `data` (cfg.data.dir, as `train` opened it), or the
    bundled corpus prepared once into the workdir (with data.tokenizer), then opened."""
    from onona_jax.data import pipeline

    if data is not None:
        return data
    data_dir = paths.Workdir(workdir).data
    if jax.process_index() == 0:
        pipeline.prepare_bundled(data_dir, tokenizer=cfg.data)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bundled data prepared")
    return open_data(cfg, data_dir)


def take_lock(workdir: str) -> WorkdirLock:
    """Process 0 takes the workdir's lock, and no process goes on before every process knows it
    did: one racing ahead would create checkpoints/ while process 0 still checks the run, and
    the processes would then disagree on what to restore (Orbax's collectives hang or fail)."""
    failure = None
    try:
        lock = WorkdirLock(workdir).acquire()
    except ValueError as err:  # held by another run
        failure = err
    except OSError as err:
        failure = cli.Failure(f"cannot write to {workdir} ({err.strerror or err}); make it writable "
                              "or choose another --workdir")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        took = multihost_utils.broadcast_one_to_all(np.int32(failure is None))
        if failure is None and not took:
            failure = cli.Failure(f"process 0 could not take the lock of {workdir}; its error line says why")
    if failure is not None:
        raise failure from None
    return lock


def write_config(cfg, workdir: str):
    """config.json, the run's config at each start (process 0), with a warning if it was edited
    by hand since the newest checkpoint's save (it is never read back)."""
    wd = paths.Workdir(workdir)
    # Read on every process: opening and reading the checkpoints joins Orbax's barriers, which
    # process 0 alone would wait at (a multi-host run resumed from its checkpoints).
    edited = config_edits(wd.config, wd.checkpoints)
    if jax.process_index() != 0:
        return
    if edited:
        print(f"warning: {wd.config} differs from the config saved with the newest checkpoint ({edited}): "
              "edited by hand? It records a run's config and is never read back, so the edit is ignored and "
              "the file rewritten with this run's config; change a run with --config flags", file=sys.stderr)
    try:  # atomic: a failed write leaves the old config.json
        paths.write_json(wd.config, json.loads(cfg.to_json()))
    except OSError as err:
        raise cli.Failure(f"could not write {wd.config} ({err.strerror or err}); free space "
                          "or make the workdir writable, then rerun the same command") from None
