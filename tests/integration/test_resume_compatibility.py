"""A rerun with a changed config is refused before any write (issue 12 items 2-3): which keys
may change on resume, steps that may change until the decay begins, data that moved (resumes)
against other data (refused), shards hashed only when changed and a replaced one caught, and
configs saved by older versions or under looser rules still read.
"""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import train as train_cli
from conftest import REPO
from onona_jax import config as config_lib
from onona_jax import summary
from onona_jax import train as trainer
from onona_jax.checkpoint import saved_config
from onona_jax.train import loop
from run_fixtures import CONFIG, argv, errors, the_config, tree_digest
from run_fixtures import copy_run, run_dir  # noqa: F401 - fixtures


@pytest.mark.parametrize("spec,overrides,key", [
    (CONFIG, {"model.d_model": 128}, "model.d_model: 64 → 128"),  # parameters
    (CONFIG, {"train.lr": 1e-3}, "train.lr: 0.003 → 0.001"),  # optimizer trajectory (issue 12 item 3)
    (CONFIG, {"data.seed": 7}, "data.seed: 0 → 7"),  # data stream
    (CONFIG, {"eval.windows": 4}, "eval.windows: 8 → 4"),  # what val_loss means
    (CONFIG.replace("standard", "twin"), {}, "model.head: 'standard' → 'twin'"),  # another config
])
def test_changed_config_exits_2_before_any_write(tiny_data, copy_run, capfd, spec, overrides, key):
    """Each class of non-resumable key: exit 2, one error line naming the key (saved →
    requested) and both fixes; checkpoints, config.json and metrics.jsonl untouched."""
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run, spec=spec, **overrides))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert key in line and "drop those overrides" in line and "new --workdir" in line, line
    assert tree_digest(copy_run) == before


def test_resumable_keys_pass_and_fewer_steps_do_not(tiny_data, run_dir):
    cfg = the_config(tiny_data)
    cfg.train.update(log_every=5, eval_every=7, checkpoint_every=3, keep_checkpoints=9, micro_batch=4)
    cfg.eval.batch = 4
    cfg.data.cache_dir = str(run_dir / "elsewhere")  # another cache of the same data
    cfg.data.bucket_read = "stream"  # streamed instead of copied: the same batches
    loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(run_dir))  # no error
    cfg.train.steps = 3
    with pytest.raises(ValueError, match=r"train.steps resolves to 3, below the checkpoint's step 4"):
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(run_dir))


def plan(workdir: Path, **train):
    """Rewrite train.* keys of the config saved with each checkpoint: the run was planned so."""
    for meta in (workdir / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(meta.read_text())
        saved["train"].update(train)
        meta.write_text(json.dumps(saved))


def resumes(cfg, workdir: Path) -> bool:
    try:
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(workdir))
    except ValueError:
        return False
    return True


def test_steps_may_change_until_the_decay_begins(tiny_data, copy_run):
    """A new train.steps moves the WSD decay; it is accepted exactly while every step taken
    keeps its learning rate (checkpoint at step 4: optimizer steps 0-3 taken)."""
    from onona_jax.train import optimizer

    cfg = the_config(tiny_data)
    cfg.train.decay_fraction = 0.5
    plan(copy_run, decay_fraction=0.5, steps=8)  # decay over steps 5-8 (lr 0.003 up to step 5)
    for steps, ok in ((16, True), (5, True), (4, False)):  # 4: step 4 would decay (0.003 → 0.0003)
        cfg.train.steps = steps
        assert resumes(cfg, copy_run) == ok, steps
        # the criterion itself: the old and the new schedule agree on the steps taken
        same = [float(optimizer.schedule(cfg, 8)(c)) == float(optimizer.schedule(cfg, steps)(c)) for c in range(4)]
        assert all(same) == ok
    # A budget derived from tokens_per_param (train.steps=0, here 8 steps) is compared as the
    # number it resolves to.
    tpp = 7.5 * 8 * 32 / summary.budget(cfg)["reference_params"]
    plan(copy_run, steps=0, tokens_per_param=tpp)
    for steps, ok in ((0, True), (8, True), (4, False)):
        cfg.train.update(steps=steps, tokens_per_param=tpp)
        assert resumes(cfg, copy_run) == ok, steps


@pytest.mark.parametrize("planned,steps,words", [
    (4, 8, "train.steps resolves to 8 but the run in {run} was planned for 4 steps and has taken 4; under the WSD "
           "schedule that changes the learning rate of a step already taken (step 4: 0.0003 → 0.003): under one of "
           "the two budgets the decay (over the last train.decay_fraction of the steps) begins by step 4. Either "
           "keep train.steps=4 to finish the run as planned, or train the longer run in a new --workdir"),
    (8, 4, "(step 4: 0.003 → 0.0003): under one of the two budgets the decay (over the last train.decay_fraction "
           "of the steps) begins by step 4. Either keep train.steps=8 to finish the run as planned, or train "
           "the shorter run in a new --workdir"),
    (8, 3, "train.steps resolves to 3, below the checkpoint's step 4"),
])
def test_steps_change_that_alters_a_taken_step_exits_2(tiny_data, copy_run, capfd, planned, steps, words):
    """The issue's case: a run planned for 4 steps, its decay over steps 3-4, extended to 8 at
    its end, would restart the decay at the peak (lr 3e-4 at step 4, 3e-3 at step 5); or one
    planned for 8 shortened to 4 at step 4 would have decayed at step 4. Exit 2 with the
    choices, nothing written."""
    plan(copy_run, decay_fraction=0.5, steps=planned)
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run, **{"train.steps": steps, "train.decay_fraction": 0.5}))
    err = capfd.readouterr().err
    assert rc == 2, err[-2000:]
    [line] = errors(err)
    assert words.format(run=copy_run) in line, line
    assert tree_digest(copy_run) == before


def test_moved_data_resumes_and_other_data_does_not(tiny_data, copy_run, tmp_path, capfd):
    """data.dir may change on resume when the data's identity (its manifest's shard list) is
    the run's: a data dir moved away from where the run was trained (the record of its last
    start vouches for it); data prepared otherwise is refused naming both data dirs."""
    from onona_jax.data import storage
    from onona_jax.data.prepare import prepare

    old, moved = tmp_path / "old", tmp_path / "moved"
    shutil.copytree(tiny_data, old)
    storage.verify_once(old, copy_run)  # what the run's last start recorded
    for meta in (copy_run / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(meta.read_text())
        saved["data"]["dir"] = str(old)
        meta.write_text(json.dumps(saved))
    old.rename(moved)
    cfg = the_config(str(moved))
    assert resumes(cfg, copy_run)
    (copy_run / "data_verified.json").unlink()  # no record, and the old dir gone: cannot tell
    with pytest.raises(ValueError, match=rf"trained on {old}; cannot tell whether {moved} holds the same data"):
        loop.check_resume(cfg, trainer.setup(cfg, jax.devices()[:1]), str(copy_run))
    storage.verify_once(moved, copy_run)  # a start on the moved data records it again

    other = tmp_path / "other"
    prepare([str(Path(tiny_data).parent / "austen_head.txt")], str(other), heldout_fraction=0.2)
    before = tree_digest(copy_run)
    assert train_cli.main(argv(str(other), copy_run)) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"{copy_run} holds a run trained on {old}, but {other} holds other data" in line, line
    assert "in a new --workdir" in line
    assert tree_digest(copy_run) == before


def test_bundled_data_is_identified_like_any_other(tiny_data, copy_run):
    """data.dir="" (the bundled corpus, prepared into WORKDIR/data) is compared by identity
    too: the same data named explicitly resumes; WORKDIR/data not yet prepared, with
    data.dir="" as saved, resumes (it is prepared again)."""
    from onona_jax.data import storage

    for meta in (copy_run / "checkpoints").glob("*/config/metadata"):
        saved = json.loads(meta.read_text())
        saved["data"]["dir"] = ""
        meta.write_text(json.dumps(saved))
    cfg = the_config("")
    assert resumes(cfg, copy_run)  # nothing prepared yet, nothing recorded: the same data.dir
    shutil.copytree(tiny_data, copy_run / "data")
    storage.verify_once(copy_run / "data", copy_run)
    assert resumes(cfg, copy_run)
    assert resumes(the_config(tiny_data), copy_run)  # the same shards elsewhere


def test_replaced_shard_is_caught_at_the_next_start(tiny_data, copy_run, tmp_path, capfd):
    """A shard replaced by other (valid) ids of the same size after the run's first start:
    the next start exits 2 naming the shard, writing nothing (issue: it trained, exit 0)."""
    import numpy as np

    from onona_jax.data import storage

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    storage.verify_once(data, copy_run)  # the first start's record
    shard = data / "train_00000.bin"
    st = shard.stat()
    ids = np.random.default_rng(0).integers(0, 50257, st.st_size // 2, dtype=np.uint16)
    shard.write_bytes(ids.tobytes())
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a copy made a second later would
    before = tree_digest(copy_run)
    assert train_cli.main(argv(str(data), copy_run)) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"shard {shard} ({st.st_size} bytes, sha256 " in line and "does not match" in line, line
    assert "restore that shard, or run `python -m onona_jax.data.prepare" in line
    assert tree_digest(copy_run) == before


def test_shards_are_hashed_only_when_changed(tiny_data, tmp_path, monkeypatch):
    """At every start each shard's size and mtime are compared with the record; only a changed
    one is hashed (a touched one whose hash still matches updates the record); an untouched
    resume reads no shard. A moved data dir is hashed again (the record vouches for its own
    directory only)."""
    from onona_jax.data import storage

    hashed = []
    real = storage.shard_sha256
    monkeypatch.setattr(storage, "shard_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_data, data)
    run.mkdir()

    def start():
        hashed.clear()
        storage.verify_once(data, run)
        return sorted(hashed)

    assert start() == ["heldout_00000.bin", "train_00000.bin"]
    record = json.loads((run / "data_verified.json").read_text())
    assert record["identity"] == storage.data_identity(tiny_data)
    assert start() == []  # untouched: nothing read
    shard = data / "train_00000.bin"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert start() == ["train_00000.bin"]  # touched, same bytes: hashed once, recorded
    assert start() == []
    moved = tmp_path / "moved"
    data.rename(moved)
    data = moved
    assert start() == ["heldout_00000.bin", "train_00000.bin"]
    assert start() == []


def test_resumable_keys_are_listed_in_the_training_guide():
    guide = (Path(REPO) / "docs" / "training.md").read_text()
    section = guide[guide.index("### Resuming with a changed config"):]
    section = section[:section.index("\n#", 1)]
    assert [k for k in config_lib.RESUMABLE_KEYS if f"`{k}`" not in section] == []


def test_config_of_an_older_version_is_filled_from_defaults(copy_run, capfd):
    meta = copy_run / "checkpoints" / "4" / "config" / "metadata"
    saved = json.loads(meta.read_text())
    del saved["model"]["loss_chunk"]
    meta.write_text(json.dumps(saved))
    cfg = saved_config(str(copy_run))
    assert cfg.model.loss_chunk == config_lib.base_config().model.loss_chunk
    assert "predates keys model.loss_chunk; using their defaults" in capfd.readouterr().err
    saved["model"]["from_the_future"] = 1
    meta.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"model.from_the_future.*newer onona-jax"):
        saved_config(str(copy_run))


def test_run_saved_under_looser_rules_stays_readable(tiny_data, copy_run, capfd):
    """A run trained before the optimizer's values were checked (here final_lr above lr, a
    negative grad_clip) is still read by eval, serving and export (they read no train.* key);
    resuming it is refused naming the key."""
    plan(copy_run, lr=1e-4, final_lr=3e-4, grad_clip=-1.0)
    cfg = saved_config(str(copy_run))
    assert (cfg.train.lr, cfg.train.final_lr, cfg.model.head) == (1e-4, 3e-4, "standard")
    before = tree_digest(copy_run)
    rc = train_cli.main(argv(tiny_data, copy_run, **{"train.lr": 1e-4, "train.grad_clip": -1.0}))
    assert rc == 2
    [line] = errors(capfd.readouterr().err)
    assert "train.final_lr=0.0003 must lie in [0, train.lr=0.0001]" in line, line
    assert tree_digest(copy_run) == before
