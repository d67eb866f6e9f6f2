"""Orbax checkpoints: train state, data-iterator state and config, every N steps, and on a
timer if asked (train.checkpoint_minutes); a timer save is kept only until a later save is
complete (`KeepScheduled`).

Orbax writes each step into a temporary directory and renames it when complete, so a
checkpoint either exists whole or not at all. Restoring tries the newest step first; if it
cannot be read (a missing or damaged file, unparsable metadata), train.py moves it aside to
`checkpoints/corrupt/` (never deleted), one warning paragraph is printed, and the step before
is tried. Read-only readers (`saved_config`, `restore_params`: evaluation, generation, export,
analysis, serving) skip it in memory and leave `checkpoints/` exactly as it was; on a run that
is training they read the newest step, and if its rotation deletes that step during the read,
they list the steps again and read the newest, once. A readable checkpoint of a different
model (names, shapes, dtypes) is never "corrupt": it is a `CheckpointMismatch` error naming
the difference. What Orbax and TensorStore print of a failure besides their exception stays off
stderr (`library_logs`): the command reports it, in one line or one warning paragraph.

Evaluation, serving, export and analysis restore the parameters only (`restore_params`):
no optimizer state, no training run, so a read needs the parameters' memory and nothing more.

The checkpoint directory may be a bucket (`gs://...`): paths are `etils.epath` paths, as in
Orbax. There Orbax marks a finished step with a `commit_success.txt` object instead of a rename
(an object store has none), and setting a step aside copies its objects and then deletes them,
the marker first, so a step is never lost and never half-listed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from onona_jax import cli, library_logs, paths


class CheckpointMismatch(ValueError):
    """A readable checkpoint of a different model (names, shapes, dtypes): exit 2, never
    set aside."""


class StepGone(ValueError):
    """A step that is not (or no longer) there: asked for by number, or deleted while a
    read-only reader read it (a running train.py keeps only its newest train.keep_checkpoints)."""


def rotated_twice(directory, first: int, second: int) -> cli.Failure:
    """The error of a read-only reader whose retry's step was deleted too (exit 1)."""
    return cli.Failure(f"checkpoints at steps {first} and {second} in {directory} were deleted while being read: "
                       "the run deletes steps faster than this reads them; raise its train.keep_checkpoints, or "
                       "read after it ends")


def _leaves(tree) -> dict:
    """{'trunk/layers/attn/q': (shape, dtype name)} of arrays or ShapeDtypeStructs or
    Orbax's array metadata."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        out[key] = (tuple(leaf.shape), str(jax.numpy.dtype(leaf.dtype)))
    return out


def short_error(err: BaseException) -> str:
    """An exception's type and first line, cut to 300 characters (TensorStore errors run long)."""
    first = (str(err).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return f"{type(err).__name__}: {first[:300]}"


def _not_damage(err: BaseException) -> str | None:
    """Why a failed read of a step says nothing about its files, or None: memory ran out
    (host or device), or the files are there but this user may not read them. Such a step may
    be whole, so it is never set aside nor skipped: the command stops with one line instead."""
    text = str(err)
    if isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "memory ran out while reading it: free memory (or read with more devices)"
    if isinstance(err, PermissionError) or "PERMISSION_DENIED" in text or "Permission denied" in text:
        return "this user may not read its files: make them readable"
    return None


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, listing a step whose `metrics` item cannot be read (a damaged
    `<step>/metrics/metrics`: Orbax lists steps by reading it, and raises any error but
    FileNotFoundError, which would stop every command, even eval.py, at the listing) as a step
    without metrics: the metrics only say whether it is a timer save (`_timer_flag`), nothing a
    restore needs, so the step counts as a scheduled save, as one without a `metrics` item."""

    def _get_metrics(self, step: int):
        try:
            metrics = super()._get_metrics(step)
        except Exception:  # noqa: BLE001 - unparsable or unreadable: unknown, as if missing
            return None
        return metrics if isinstance(metrics, dict) else None


def _timer_flag(metrics) -> float:
    """1.0 for a timer save's step metrics, 0.0 for a scheduled save's (and for a step without a
    `metrics` item: None)."""
    return float(bool((metrics or {}).get("timer")))


@dataclasses.dataclass
class KeepScheduled(ocp.checkpoint_managers.PreservationPolicy):
    """Which steps a save keeps (levanter's policy): the newest `keep` scheduled saves
    (train.checkpoint_every, the last step, a pre-emption's) and the newest save whatever it
    is. So a timer save (train.checkpoint_minutes) lives until a later save, timer or
    scheduled, is complete, and never costs a scheduled one its place.

    Orbax asks this at `save(step)` with `step` listed last, and deletes what it does not keep
    only after `step` is committed (its finalize thread): a failed save deletes nothing, so the
    newest whole checkpoint is never lost. Every process decides alike, from the steps' saved
    `metrics` and the saves of this run."""

    keep: int

    def should_preserve(self, checkpoints, *, context):
        scheduled = sorted(c.step for c in checkpoints if not _timer_flag(c.metrics))
        kept = set(scheduled[-self.keep:]) | {max((c.step for c in checkpoints), default=None)}
        return [c.step in kept for c in checkpoints]


# The clock of train.checkpoint_minutes (a module attribute, so a test can run a run on a clock
# of its own: tests/multihost_driver.py).
timer_clock = time.monotonic


class SaveTimer:
    """train.checkpoint_minutes: whether a timer save is due, asked at logged steps only. Process
    0's clock decides and every process gets its answer (one broadcast of a scalar per logged
    step, beside that step's metrics transfer), so all of them save the same steps: a save is a
    collective. Restarted by every save, timer or scheduled."""

    def __init__(self, minutes: float):
        self.seconds = 60.0 * minutes
        self.restart()

    def restart(self):
        self.last = timer_clock()

    def due(self) -> bool:
        if not self.seconds:
            return False
        due = timer_clock() - self.last >= self.seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due


class Checkpoints:
    def __init__(self, directory, keep: int = 3, read_only: bool = False):
        if paths.is_cloud(directory):
            self.directory = paths.path(directory)  # fresh listings: steps other processes wrote
        else:
            self.directory = epath.Path(os.path.abspath(directory))
        self.read_only = read_only
        library_logs.quiet_orbax()  # the libraries' own reports of a failure this module reports
        self.saved: int | None = None  # the step of the newest save started
        self.every = self.log_every = 0  # no save is due before `schedule_saves`
        self.timer = None
        self.manager = _listed(lambda: _Manager(
            self.directory,
            item_names=("state", "data", "config"),
            options=ocp.CheckpointManagerOptions(
                preservation_policy=KeepScheduled(keep), create=not read_only, read_only=read_only,
                # Orbax writes a step's `metrics` item (here {"timer": 0|1}: `save`) only when a
                # best_fn is set; this one is never used to rank (KeepScheduled decides what goes).
                best_fn=_timer_flag,
                # The step's temporary directories are made inside save(), on the caller's thread,
                # so a read-only or full checkpoints/ fails there. Made asynchronously (Orbax's
                # default), a failed mkdir leaves every writer thread waiting 300 s
                # (multihost.coordination_timeout) for a "directory created" signal that never
                # comes, and the process cannot exit before they give up. Costs one mkdir per item.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            ),
        ))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, data_state: dict, config_json: str, timer: bool = False):
        """Start writing `step` (the arrays are written in the background). Raises the error of
        the previous save if that one failed, or of this one's synchronous part: `saved` is the
        step whose save failed, whichever raises (as for `wait` and `raise_failed_save`). `timer`: a save
        of train.checkpoint_minutes, marked so in the step (`KeepScheduled` deletes it once a
        later save is complete, in this run or a resumed one)."""
        self.manager.wait_until_finished()  # (Orbax's save starts with it too)
        self.saved = step
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(json.loads(config_json)),
            ),
            metrics={"timer": int(timer)},
        )
        if self.timer is not None:
            self.timer.restart()  # every save, timer or scheduled

    def schedule_saves(self, every: int, minutes: float, log_every: int):
        """When `maybe_save` saves: every `every` steps (train.checkpoint_every) and the last;
        else, at a step logged every `log_every`, once `minutes` (train.checkpoint_minutes) have
        passed since the last save. The timer starts now."""
        self.every, self.log_every, self.timer = every, log_every, SaveTimer(minutes)

    def maybe_save(self, step: int, last: bool, write) -> bool:
        """Save `step` if a save is due (`schedule_saves`): `write(timer)` writes it (the caller's:
        it checks the state first, then calls `save`). Whether one was due."""
        if step % self.every == 0 or last:
            write(False)
        elif step % self.log_every == 0 and self.timer.due():
            write(True)
        else:
            return False
        return True

    def timer_steps(self) -> list[int]:
        """The steps saved by train.checkpoint_minutes' timer (their `metrics` item says so)."""
        return [s for s in self.steps() if _timer_flag(self.manager.metrics(s))]

    def wait(self):
        self.manager.wait_until_finished()

    def raise_failed_save(self):
        """Raise the error of the newest save if it has finished and failed; never waits for a
        save still writing (cheap enough for every step). Orbax's own check_for_errors misses
        most failures: its finalize thread takes the error first and keeps it for
        wait_until_finished."""
        if not self.manager.is_saving_in_progress():
            self.manager.wait_until_finished()  # finished: returns at once, raising its error

    def stop(self, remove: bool = True, timeout: float = 30.0):
        """After a failure: let the save in flight finish or fail (errors ignored: the caller
        reports its own), wait up to `timeout` s more for Orbax's other writer threads (a
        failed save's per-item threads), then, if `remove` (the caller still holds the workdir's
        lock), remove the temporaries of failed saves (`remove_unfinished`), so a full disk is
        not kept full. A writer left running at exit would fail again as the interpreter ends."""
        try:
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001 - already failing: that error is the one reported
            pass
        deadline = time.monotonic() + timeout
        for thread in _orbax_threads():
            try:
                thread.join(max(0.0, deadline - time.monotonic()))
            except (KeyboardInterrupt, cli.Interrupted):  # the user's, not the thread's
                raise
            except BaseException:  # noqa: BLE001 - Orbax's join re-raises the thread's own error
                pass
        # Another host may still write its part of a failed step: there the next start removes it.
        if remove and jax.process_count() == 1 and not _orbax_threads():
            self.remove_unfinished()

    def remove_unfinished(self) -> list[str]:
        """Remove the step directories no save will finish: Orbax's `<step>.orbax-checkpoint-tmp*`
        locally, a `<step>/` without its commit marker in a bucket. Only for the run's writer
        (train.py holds the workdir's lock, so no other process writes here), with no save of
        its own in flight; a committed step and anything else (`corrupt/`) are never touched.
        Returns what was removed."""
        if self.read_only or jax.process_index() != 0 or not self.directory.is_dir():
            return []
        marker = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE
        removed = []
        for entry in self.directory.iterdir():
            step, _, rest = entry.name.partition(".")
            if not step.isdigit():
                continue
            if rest.startswith("orbax-checkpoint-tmp") or (not rest and paths.is_cloud(entry)
                                                           and not (entry / marker).exists()):
                try:
                    entry.rmtree()
                except Exception:  # noqa: BLE001 - e.g. read-only: it stays until a start can remove it
                    continue
                removed.append(entry.name)
        return removed

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
        data = out["data"]
        if not isinstance(data, dict) or data.get("step", step) != step:
            # e.g. another step's data/metadata copied over this one's: resuming would replay batches
            said = data.get("step") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"Error reading data iterator state: step {said!r} in the checkpoint of step {step}")
        return out["state"], data, out["config"]

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

    def newest_config(self) -> tuple[int, dict] | None:
        """(step, saved config dict) of the newest step whose config reads, or None (no file
        moved: restoring decides what is unreadable)."""
        for step in reversed(self.steps()):
            try:
                return step, self.restore_config(step)
            except Exception:  # noqa: BLE001 - unreadable: restore_latest reports it
                continue
        return None

    def check_params(self, step: int, abstract_params):
        """Raise CheckpointMismatch when the saved parameters' names, shapes or dtypes differ
        from `abstract_params` (read from the metadata, no array read); an unreadable metadata
        file raises its read error (the checkpoint is then unreadable, not mismatched)."""
        meta = ocp.PyTreeCheckpointer().metadata(self.directory / str(step) / "state")
        tree = getattr(meta, "item_metadata", meta)
        if tree is None or "params" not in tree:
            raise OSError(f"no readable array metadata in {self.directory}/{step}/state")
        saved = _leaves(tree["params"])
        wanted = _leaves(abstract_params)
        problems = [f"{k}: missing from the checkpoint" for k in wanted if k not in saved]
        problems += [f"{k}: in the checkpoint, not in this model" for k in saved if k not in wanted]
        for k in wanted.keys() & saved.keys():
            (s_shape, s_dtype), (w_shape, w_dtype) = saved[k], wanted[k]
            if s_shape != w_shape:
                problems.append(f"{k}: shape {s_shape} saved, {w_shape} wanted")
            elif s_dtype != w_dtype:
                problems.append(f"{k}: dtype {s_dtype} saved, {w_dtype} wanted")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CheckpointMismatch(
                f"checkpoint at step {step} in {self.directory} holds a different model: "
                f"{'; '.join(sorted(problems)[:5])}{more}. It was left in place; restore it with the "
                "config it was saved with"
            )

    def restore_latest(self, abstract_state, step: int | None = None, read=None, validate=None):
        """Newest readable checkpoint (or exactly `step`): (step, state, data_state, config),
        or None when there is none. `read` (step -> result tuple) replaces the full restore
        (e.g. parameters only); `validate` (step -> None) runs first (default: the parameters'
        structure against `abstract_state`).

        Only a read failure (a missing or damaged file, unparsable metadata) makes a step
        unusable; a structure mismatch is a CheckpointMismatch (exit 2), never "corrupt". An
        unreadable newest step is set aside to `checkpoints/corrupt/` by a writer, skipped in
        memory (left in place) by a read-only reader; either way with one warning paragraph.
        A read-only reader whose step was deleted during the read (a live run rotating its
        checkpoints) lists the steps again and reads the newest, once, with a note; `step`
        deleted so is a StepGone (exit 2), as is a `step` that does not exist."""
        read = read or (lambda s: self.restore(s, abstract_state))
        if validate is None and abstract_state is not None:
            validate = lambda s: self.check_params(s, abstract_state["params"])  # noqa: E731

        def attempt(s):
            if validate is not None:
                validate(s)
            return (s, *read(s))

        if step is not None:
            if step not in self.steps():
                raise StepGone(f"no checkpoint at step {step} in {self.directory}; have {self.steps() or 'none'}")
            try:
                return attempt(step)
            except CheckpointMismatch:
                raise
            except Exception as err:  # noqa: BLE001 - a read failure of the step asked for
                if self._rotated_away(step):
                    raise StepGone(f"checkpoint at step {step} in {self.directory} was deleted while it was read "
                                   f"(a running train.py keeps only its newest); have {self.steps()}") from None
                self._not_damage(step, err)
                raise cli.Failure(f"checkpoint at step {step} in {self.directory} could not be read ({short_error(err)}); "
                                  f"omit --step to use the newest readable one (steps: {self.steps()})") from None
        gone = None  # a step deleted while it was read: list again and retry once, from the newest
        while True:
            for candidate in reversed(self.steps()):
                try:
                    return attempt(candidate)
                except CheckpointMismatch:
                    raise
                except Exception as err:  # noqa: BLE001 - any read failure means "not usable"
                    if self._rotated_away(candidate):
                        break
                    self._not_damage(candidate, err)  # memory, permissions: the step may be whole
                    if self.read_only:
                        fate = "left in place (this command only reads)"
                    else:
                        fate = f"moved to {self._set_aside(candidate)}"
                    print(f"warning: checkpoint at step {candidate} could not be restored ({short_error(err)}); "
                          f"{fate} and falling back to the one before", file=sys.stderr)
            else:
                return None
            if gone is not None:
                raise rotated_twice(self.directory, gone, candidate)
            gone = candidate
            if self.steps():
                print(f"note: checkpoint at step {gone} was deleted while it was read (a running train.py keeps only "
                      f"its newest); reading step {self.latest()}, the newest now", file=sys.stderr)

    def _not_damage(self, step: int, err: BaseException):
        """Raise a one-line Failure when `err` says nothing about the step's files (`_not_damage`):
        the step is left in place and not skipped, as it may well be whole."""
        why = _not_damage(err)
        if why is not None:
            raise cli.Failure(f"checkpoint at step {step} in {self.directory} could not be read ({short_error(err)}), "
                              f"but it may be whole, so it was left in place: {why}, then rerun the same "
                              "command") from None

    def _rotated_away(self, step: int) -> bool:
        """After a failed read by a read-only reader: whether `step` is gone from a fresh listing
        (a live run's rotation deleted it; its listing was a snapshot), not unreadable."""
        if not self.read_only:
            return False
        _listed(self.manager.reload)
        return step not in self.steps()

    def _set_aside(self, step: int) -> str:
        """Move the unreadable `step` out of Orbax's sight, whole, to `corrupt/<step>-<time>`,
        or to the first of `corrupt.1/`, `corrupt.2/`, ... that takes it when something is in
        the way (`corrupt` a file, a dangling or cross-device symlink, an unwritable directory;
        an existing entry of that name gets a `.N` suffix). Returns where it went; raises a
        one-line Failure, the step left in place, when it cannot be moved at all."""
        src = self.directory / str(step)
        stamp = f"{step}-{int(time.time())}"
        dst = self.directory / "corrupt" / stamp  # what other processes report
        if jax.process_index() == 0 and src.exists():
            try:
                if paths.is_cloud(src):
                    dst = _free_name(self.directory / "corrupt", stamp)
                    _move_objects(src, dst)
                else:
                    dst = _rename_aside(str(src), str(self.directory), stamp)
            except OSError as err:
                raise cli.Failure(
                    f"checkpoint at step {step} in {self.directory} cannot be read, and could not be set aside "
                    f"({err.strerror or err}): move {src} out of {self.directory} by hand (nothing was deleted), "
                    "then rerun the same command") from None
        # Reload the manager's view of which steps exist.
        _listed(self.manager.reload)
        return str(dst)


def _free_name(folder: epath.Path, name: str) -> epath.Path:
    """`folder/name`, or `folder/name.N` for the first N that does not exist."""
    dst, n = folder / name, 0
    while dst.exists():
        n += 1
        dst = folder / f"{name}.{n}"
    return dst


def _rename_aside(src: str, directory: str, name: str, folders: int = 10) -> str:
    """Rename `src` to `<folder>/<name>` for the first folder among `directory`'s `corrupt`,
    `corrupt.1`, ... that is (or can be made) a directory the rename succeeds into; the name
    gets a `.N` suffix when taken (a rename onto an empty directory would replace it). Never
    copies: one rename or nothing. Raises OSError naming every folder tried when none took it."""
    tried = []
    for i in range(folders):
        folder = os.path.join(directory, "corrupt" if i == 0 else f"corrupt.{i}")
        if os.path.lexists(folder) and not os.path.isdir(folder):
            tried.append(f"{folder} is not a directory")
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            dst, n = os.path.join(folder, name), 0
            while os.path.lexists(dst):
                n += 1
                dst = os.path.join(folder, f"{name}.{n}")
            os.rename(src, dst)
            return dst
        except OSError as err:
            tried.append(f"{folder}: {err.strerror or err}")
            if not os.path.isdir(os.path.dirname(src)) or not os.access(directory, os.W_OK):
                break  # the step's own directory cannot be changed: no other folder helps
    raise OSError(f"tried {'; '.join(tried)}")


LISTING_RETRY_S = 30.0  # how long a reader keeps listing while a live run's rotation races it


def _listed(list_steps, within_s: float = LISTING_RETRY_S):
    """`list_steps()` (a CheckpointManager made or reloaded), listed again when a step vanished
    under it: Orbax lists the step directories, then reads each one's metadata and mtime in
    threads, so a step a live run's rotation deletes in between raises FileNotFoundError from
    that read. A fresh listing no longer holds it. Retried for `within_s` seconds, not a fixed
    number of times: a run saving every step on a loaded host can race several listings in a
    row. A listing still racing after that raises. (A missing
    checkpoints directory is no race: Orbax lists it as empty.)"""
    deadline, pause = time.monotonic() + within_s, 0.05
    while True:
        try:
            return list_steps()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.5)


def _orbax_threads() -> list[threading.Thread]:
    """Orbax's live writer threads (its save, finalize and per-item commit threads)."""
    def module(t):
        target = getattr(t, "_target", None)  # a plain Thread's target, e.g. AsyncCheckpointer's
        return f"{type(t).__module__} {getattr(target, '__module__', '')}"

    return [t for t in threading.enumerate()
            if t is not threading.current_thread() and t.is_alive() and "orbax." in module(t)]


def _move_objects(src: epath.Path, dst: epath.Path) -> None:
    """Move a directory of a bucket: copy every object (in the store, no download), then delete
    the originals, Orbax's commit marker first, so Orbax stops listing the step before any of it
    goes, and every object exists in one place or both at any moment."""
    import fsspec

    fs, src_key = fsspec.core.url_to_fs(str(src))
    dst_key = fsspec.core.url_to_fs(str(dst))[1]
    fs.copy(src_key, dst_key, recursive=True)
    marker = f"{src_key}/{ocp.path.atomicity_types.COMMIT_SUCCESS_FILE}"
    if fs.exists(marker):
        fs.rm(marker)
    fs.rm(src_key, recursive=True)


def _config(ckpts: Checkpoints, step: int):
    """The validated config saved at `step` (older versions' configs filled from defaults).
    A config that cannot be used (a newer version's keys, an invalid value) is a mismatch, not
    a read failure: it is the same whatever step is tried."""
    from onona_jax import config as config_lib

    saved = ckpts.restore_config(step)
    try:
        return config_lib.validate(config_lib.from_saved(saved, f"{ckpts.directory}/{step}"), training=False)
    except CheckpointMismatch:
        raise
    except ValueError as err:
        raise CheckpointMismatch(str(err)) from None


def saved_config(workdir: str, step: int | None = None):
    """The config saved with a run's checkpoint (the newest readable one unless `step`), no
    array read. Read-only: an unreadable step is skipped, never moved."""
    ckpts = Checkpoints(paths.Workdir(workdir).checkpoints, read_only=True)
    if not ckpts.steps():
        raise ValueError(f"no checkpoints in {ckpts.directory}; train first with train.py --workdir={workdir}")
    restored = ckpts.restore_latest(None, step, read=lambda s: (_config(ckpts, s),))
    if restored is None:
        raise cli.Failure(f"no checkpoint in {ckpts.directory} is readable (steps {ckpts.steps()}); "
                          "see the warnings above")
    return restored[1]


def restore_params(workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None, parts=None,
                   via_host: bool = False):
    """(params, step, cfg, mesh) of a run's checkpoint (the newest readable one unless `step`),
    the parameters alone, placed on a (data, fsdp, tensor) mesh of `devices` (or on `mesh`
    itself when it is a Mesh) whatever mesh trained them. Read-only: an unreadable step (its arrays or its config) is skipped with a
    warning and left in place, and the step used is reported. `parts` (e.g. ("head",))
    restores only those top-level parts of the tree, so a caller can hold one part at a time
    (serving folds the head before the trunk); `via_host` places them one array at a time
    (`Checkpoints.restore_params`)."""
    from onona_jax import models, sharding

    ckpts = Checkpoints(paths.Workdir(workdir).checkpoints, read_only=True)
    if not ckpts.steps():
        raise ValueError(f"no checkpoints in {ckpts.directory}; train first with train.py --workdir={workdir}")
    grid = mesh if isinstance(mesh, jax.sharding.Mesh) else sharding.make_mesh(
        *mesh, devices, slices=sharding.device_slices(devices))  # a reader on a multi-slice job

    def read(s):
        cfg = _config(ckpts, s)
        abstract = models.placed(cfg.model, grid)
        ckpts.check_params(s, abstract)  # the whole tree: the model must be the one saved
        if parts is not None:
            abstract = {k: abstract[k] for k in parts}
        return ckpts.restore_params(s, abstract, via_host), cfg

    restored = ckpts.restore_latest(None, step, read=read)
    if restored is None:
        raise cli.Failure(f"no checkpoint in {ckpts.directory} is readable (steps {ckpts.steps()}); "
                          "see the warnings above")
    used, params, cfg = restored
    if step is None and used != ckpts.latest():
        print(f"using checkpoint step {used} of {workdir} (the newest readable one)", file=sys.stderr)
    return params, used, cfg, grid
