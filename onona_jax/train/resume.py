"""May this workdir continue with this config? Every rule a resumed run must keep, asked once
before the lock is taken and again under it (`loop.train`), read-only, before any write:

- the config keys outside `config.RESUMABLE_KEYS` as saved with the newest checkpoint
  (`resume_conflicts`);
- the step budget, while it leaves every step already taken at its learning rate (`check_schedule`);
- the same data wherever it now lies (`check_same_data`: the sources, and each data dir's
  identity, `data/storage.py`'s manifest hash and the record of the last start).

Three rules stay in lower layers, where the state they compare is read when the checkpoint is
restored (`checkpoint.Checkpoints.restore_latest`, after these checks): the data iterator's saved
state must match the data's windows and order, a mixture's sources too while its shares may
change, recorded as a `mixture_change` (`pipeline` batches' `set_state`); a step's data state
must be its own (`Checkpoints.restore`); a checkpoint of another model is a `CheckpointMismatch`.
`config_edits` tells a hand edit of config.json apart (a warning, never a refusal).
"""

from __future__ import annotations

import json

from ml_collections import ConfigDict

from onona_jax import config, paths
from onona_jax.checkpoint import Checkpoints
from onona_jax.data import storage


def check_resume(cfg, run, workdir: str, data=None):
    """A rerun on a workdir with checkpoints must be the same run: every key outside
    config.RESUMABLE_KEYS as saved with the newest checkpoint, the same data (wherever it now
    lies: `check_same_data`; `data`: the requested data as `train` opened it) and, if
    train.steps changed, the same learning rate for every step already taken
    (`check_schedule`). Read-only; before any write."""
    directory = paths.Workdir(workdir).checkpoints
    if not paths.isdir(directory):
        return
    newest = Checkpoints(directory, read_only=True).newest_config()
    if newest is None:
        return
    step, saved = newest
    saved = config.from_saved(saved, f"{directory}/{step}")
    conflicts = resume_conflicts(saved, cfg)
    if conflicts:
        listed = "; ".join(f"{k}: {a!r} → {b!r}" for k, a, b in conflicts)
        raise ValueError(
            f"{workdir} holds a run whose checkpoint (step {step}) has a different config (saved → "
            f"requested): {listed}. These keys change the parameters, optimizer state or data, so "
            f"this would be a different run. Either drop those overrides to resume that run, or "
            f"train the new one in a new --workdir (keys that may change on resume: "
            f"onona_jax/config.py RESUMABLE_KEYS)"
        )
    check_same_data(saved, cfg, workdir, data)
    if run.steps < step:
        raise ValueError(f"train.steps resolves to {run.steps}, below the checkpoint's step {step} in "
                         f"{directory}; give train.steps >= {step} (or use a new --workdir)")
    check_schedule(saved, run, step, workdir)


def resume_conflicts(saved, requested) -> list[tuple[str, object, object]]:
    """(key, saved value, requested value) of every key outside config.RESUMABLE_KEYS that differs
    (both compared as JSON, so 1e-3 equals 0.001; a key one side lacks is `<absent>`)."""

    def norm(c):
        return config.flatten(json.loads(c.to_json() if isinstance(c, ConfigDict) else json.dumps(c)))

    a, b = norm(saved), norm(requested)
    return [(k, a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b))
            if k not in config.RESUMABLE_KEYS and a.get(k, "<absent>") != b.get(k, "<absent>")]


def check_schedule(saved, run, step: int, workdir: str):
    """A changed step budget moves the WSD decay; it may change on resume only while that
    leaves the learning rate of every step already taken (optimizer steps 0..step-1) as it
    was, i.e. while the decay has begun under neither budget. The schedules themselves are
    compared (`optimizer.first_changed_step`), so this rule follows `optimizer.wsd`."""
    from onona_jax.train import optimizer
    from onona_jax import summary

    planned = summary.budget(saved)["steps"]  # train.steps=0 or another budget: derived
    if planned == run.steps:
        return
    before = optimizer.schedule(saved, planned)
    changed = optimizer.first_changed_step(before, run.schedule, step)
    if changed is None:
        return
    was, now = float(before(changed)), float(run.schedule(changed))
    keep = saved.train.steps or f"0 (derived: {planned})"
    raise ValueError(
        f"train.steps resolves to {run.steps} but the run in {workdir} was planned for {planned} steps and "
        f"has taken {step}; under the WSD schedule that changes the learning rate of a step already taken "
        f"(step {changed + 1}: {was:.4g} → {now:.4g}): under one of the two budgets the decay (over the last "
        f"train.decay_fraction of the steps) begins by step {step}. Either keep train.steps={keep} to finish "
        f"the run as planned, or train the "
        f"{'longer' if run.steps > planned else 'shorter'} run in a new --workdir (train.steps may change on "
        "resume only before the decay begins)"
    )


def _sources(c, wd) -> dict:
    """{name: data dir} of a config's data: data.mixture's named sources, else {"": data.dir}
    (the bundled corpus in the workdir when data.dir is "")."""
    from onona_jax.data import mixture

    return {e.name: e.data_dir for e in mixture.parse(c.data.get("mixture", ""))} or {"": wd.data_dir(c.data.dir)}


def check_same_data(saved, cfg, workdir: str, data=None):
    """data.dir, data.cache_dir and a mixture's dirs and weights may change on resume (the data
    moved, its local copy did, or the mixture is reweighted) when the data is the same: the
    same sources (a mixture's by name), and the identity of each requested data dir
    (storage.data_identity: its manifest's shard list; the opened source's when `train` has
    opened `data`) equal to the one recorded when the run last started
    (WORKDIR/data_verified.json), or else the saved data dir's. Read-only."""
    wd = paths.Workdir(workdir)
    was, now = _sources(saved, wd), _sources(cfg, wd)
    if sorted(was) != sorted(now):
        def told(sources):
            return f"data.dir {sources['']}" if "" in sources else f"the data.mixture sources {', '.join(sources)}"

        keep = (f"--config.data.mixture={saved.data.mixture} (its weights may change)" if "" not in was
                else f"--config.data.dir={saved.data.dir!r} --config.data.mixture=''")
        raise ValueError(
            f"{workdir} holds a run trained on {told(was)}, but this run asks for {told(now)}: a run's sources may "
            f"not change on resume (a mixture's weights may). Resume that run with {keep}, or train on the new "
            "sources in a new --workdir")
    opened = {s.name: s.identity for s in data.sources} if data is not None else {}
    for name, saved_dir in was.items():
        requested_dir = now[name]
        what = f"data.mixture source {name!r} ({saved_dir})" if name else saved_dir
        keep = f"data.mixture source {name}:{saved_dir}" if name else f"data.dir={saved.data.dir!r}"
        recorded = storage.recorded_identity(workdir, name)
        if recorded is None:  # a workdir of an older version: the saved data dir's manifest, if it is there
            try:
                recorded = storage.data_identity(saved_dir)
            except (ValueError, OSError):
                pass
        requested = opened.get(name)
        if requested is None:
            try:
                requested = storage.data_identity(requested_dir)
            except (ValueError, OSError):
                pass  # the bundled corpus not prepared yet (train() opened a given data.dir)
        if recorded is None or requested is None:
            if saved_dir == requested_dir:  # nothing to compare with, and the same data dir
                continue
            why = (f"no {wd.data_record} and no readable manifest in {saved_dir}"
                   if recorded is None else f"no readable manifest in {requested_dir}")
            raise ValueError(
                f"{workdir} holds a run trained on {what}; cannot tell whether {requested_dir} holds the same "
                f"data ({why}). Resume that run with its data ({keep}), or train on {requested_dir} in a new "
                "--workdir")
        if requested != recorded:
            raise ValueError(
                f"{workdir} holds a run trained on {what}, but {requested_dir} holds other data (its manifest "
                f"lists other shards: identity {requested[:12]}, the run's {recorded[:12]}). Resume that run with "
                f"its data ({keep}, or wherever that data now lies), or train on {requested_dir} in a new --workdir")



def config_edits(path: str, checkpoints: str) -> str:
    """The keys in which an existing config.json differs from the config saved with the newest
    checkpoint, which the run that wrote the file also saved: a hand edit ("" when none, or no
    file or checkpoint to compare)."""
    if not paths.exists(path) or not paths.isdir(checkpoints):
        return ""
    newest = Checkpoints(checkpoints, read_only=True).newest_config()
    if newest is None:
        return ""
    try:
        written = json.loads(paths.read_text(path))
    except (OSError, ValueError):
        return "it no longer reads as JSON"
    old, new = config.flatten(newest[1]), config.flatten(written if isinstance(written, dict) else {})
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    listed = ", ".join(f"{k}: {old.get(k, '-')!r} → {new.get(k, '-')!r}" for k in keys[:5])
    return listed + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
