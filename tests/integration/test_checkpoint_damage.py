""""Corrupt" means unreadable (issue 12 item 4): read-only readers (eval, generate) skip a broken
step and touch nothing, an explicit step missing or broken is one error line, and the writer sets
aside only unreadable steps, round whatever is in the way, moving nothing when it cannot.
"""

import json
import re
import shutil

import jax
import pytest

import eval as eval_cli
from onona_jax import train as trainer
from onona_jax.checkpoint import CheckpointMismatch, Checkpoints, restore_params, saved_config
from run_fixtures import damage_arrays, errors, the_config, tree_digest
from run_fixtures import copy_run, run_dir  # noqa: F401 - fixtures


def test_read_only_readers_skip_a_broken_step_and_touch_nothing(copy_run, capfd):
    """Damaged arrays at step 4: saved_config and restore_params (what eval, generate,
    export, analysis and serving use) use step 2, say so in one warning paragraph, and the
    run's tree hashes the same before and after."""
    damage_arrays(copy_run, 4)
    before = tree_digest(copy_run)
    assert saved_config(str(copy_run)).model.head == "standard"  # step 4's config reads fine
    _, step, cfg, _ = restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
    err = capfd.readouterr().err
    assert step == 2 and cfg.model.head == "standard"
    assert tree_digest(copy_run) == before
    assert re.search(r"^warning: checkpoint at step 4 could not be restored \(.*\); left in place \(this "
                     r"command only reads\) and falling back", err), err
    assert "using checkpoint step 2" in err and len(err.strip().splitlines()) == 2, err


def test_missing_config_metadata_falls_back_in_eval(run_dir, tmp_path, capfd):
    """eval.py on a run whose newest step lacks config/metadata: it evaluates step 2, writes
    its result, and leaves checkpoints/ as it was."""
    work = tmp_path / "run"
    shutil.copytree(run_dir, work)
    (work / "checkpoints" / "4" / "config" / "metadata").unlink()
    before = tree_digest(work / "checkpoints")
    out = tmp_path / "out" / "eval.json"
    rc = eval_cli.main([f"--workdir={work}", "--mesh=1,1,1", f"--output={out}"])
    err = capfd.readouterr().err
    assert rc == 0, err[-2000:]
    assert json.loads(out.read_text())["step"] == 2
    assert tree_digest(work / "checkpoints") == before
    assert "FileNotFoundError" in err and "Traceback" not in err


@pytest.mark.parametrize("step,rc,words", [
    (4, 1, "checkpoint at step 4 in"),  # broken
    (3, 2, "no checkpoint at step 3"),  # missing
])
def test_explicit_step_missing_or_broken_is_one_error_line(copy_run, capfd, step, rc, words):
    damage_arrays(copy_run, 4)
    before = tree_digest(copy_run)
    assert eval_cli.main([f"--workdir={copy_run}", f"--step={step}", "--mesh=1,1,1"]) == rc
    err = capfd.readouterr().err
    [line] = errors(err)
    assert words in line and "Traceback" not in err, err
    assert tree_digest(copy_run) == before


def test_writer_sets_aside_only_unreadable_steps(tiny_data, copy_run, capfd):
    """train.py's restore: a shape mismatch (another model) is an error naming the array and
    moves nothing; damaged arrays are set aside to corrupt/ with one warning paragraph (no
    Orbax or asyncio noise)."""
    other = the_config(tiny_data)
    other.model.d_model = 128
    run = trainer.setup(other, jax.devices()[:1])
    ckpts = Checkpoints(str(copy_run / "checkpoints"))
    with pytest.raises(CheckpointMismatch, match=r"step 4 .*holds a different model: .*shape \(50304, 64\) saved, "
                       r"\(50304, 128\) wanted"):
        ckpts.restore_latest(trainer.abstract_train_state(run))
    assert ckpts.steps() == [2, 4] and not (copy_run / "checkpoints" / "corrupt").exists()

    damage_arrays(copy_run, 4)
    capfd.readouterr()
    cfg = the_config(tiny_data)
    run = trainer.setup(cfg, jax.devices()[:1])
    step, *_ = ckpts.restore_latest(trainer.abstract_train_state(run))
    err = capfd.readouterr().err
    assert step == 2 and ckpts.steps() == [2]
    assert len(list((copy_run / "checkpoints" / "corrupt").glob("4-*"))) == 1
    assert len(err.strip().splitlines()) == 1 and "moved to" in err, err


def test_damaged_metadata_files_are_skipped_or_harmless(tiny_data, copy_run, capfd):
    """Step 4's state/_METADATA garbled: read-only readers use step 2 and change nothing. Its
    metrics item garbled (Orbax read it to list the steps: every command stopped with a
    traceback): the step lists and restores, and a writer keeps it (its arrays are whole)."""
    ckpts = copy_run / "checkpoints"
    metadata = ckpts / "4" / "state" / "_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:100])
    before = tree_digest(copy_run)
    _, step, _, _ = restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
    assert step == 2 and tree_digest(copy_run) == before
    assert "warning: checkpoint at step 4 could not be restored" in capfd.readouterr().err
    shutil.copyfile(ckpts / "2" / "state" / "_METADATA", metadata)  # (the same tree: whole again)

    (ckpts / "4" / "metrics" / "metrics").write_text('{"timer": ')
    assert saved_config(str(copy_run)).model.head == "standard"
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    writer = Checkpoints(str(ckpts))
    assert writer.steps() == [2, 4] and writer.timer_steps() == []
    assert writer.restore_latest(trainer.abstract_train_state(run))[0] == 4
    assert not (ckpts / "corrupt").exists() and "Traceback" not in capfd.readouterr().err


def test_another_steps_data_state_is_unreadable(tiny_data, copy_run, capfd):
    """Step 2's data iterator state copied over step 4's (a resume would replay batches 3-4):
    the writer sets step 4 aside with one warning and resumes from step 2."""
    ckpts = copy_run / "checkpoints"
    shutil.copyfile(ckpts / "2" / "data" / "metadata", ckpts / "4" / "data" / "metadata")
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    step, _, data, _ = Checkpoints(str(ckpts)).restore_latest(trainer.abstract_train_state(run))
    err = capfd.readouterr().err
    assert step == 2 and data == {"step": 2}
    [line] = err.strip().splitlines()
    assert "step 4 could not be restored" in line and "data iterator state: step 2" in line, err


def test_set_aside_goes_round_whatever_is_in_the_way(tiny_data, copy_run, capfd):
    """checkpoints/corrupt a file and corrupt.1 a dangling symlink: step 4 goes to corrupt.2/,
    both left as they were; a name already taken there gets a suffix, never merges."""
    from onona_jax import checkpoint as checkpoint_lib

    ckpts = copy_run / "checkpoints"
    (ckpts / "corrupt").write_text("mine\n")
    (ckpts / "corrupt.1").symlink_to(copy_run / "nowhere")
    damage_arrays(copy_run, 4)
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    writer = Checkpoints(str(ckpts))
    assert writer.restore_latest(trainer.abstract_train_state(run))[0] == 2
    [line] = capfd.readouterr().err.strip().splitlines()
    [aside] = (ckpts / "corrupt.2").iterdir()
    assert aside.name.startswith("4-") and f"moved to {aside} " in line, line
    assert (ckpts / "corrupt").read_text() == "mine\n" and (ckpts / "corrupt.1").is_symlink()
    assert writer.steps() == [2]

    (ckpts / "2.copy").mkdir()
    (ckpts / "corrupt.2" / "2-7").mkdir()  # empty: a plain rename would replace it
    dst = checkpoint_lib._rename_aside(str(ckpts / "2.copy"), str(ckpts), "2-7")
    assert dst == str(ckpts / "corrupt.2" / "2-7.1") and (ckpts / "corrupt.2" / "2-7").is_dir()


def test_set_aside_impossible_or_not_damage_is_one_failure_and_moves_nothing(tiny_data, copy_run, monkeypatch):
    """No folder takes the step (every corrupt* name a file): one Failure naming the fix,
    the step left in place. A read that failed for want of memory or permission says nothing
    about the files: one Failure, nothing moved, not skipped (read-only readers too)."""
    from onona_jax import cli

    ckpts = copy_run / "checkpoints"
    run = trainer.setup(the_config(tiny_data), jax.devices()[:1])
    abstract = trainer.abstract_train_state(run)
    for name in ["corrupt"] + [f"corrupt.{i}" for i in range(1, 10)]:
        (ckpts / name).write_text("x")
    damage_arrays(copy_run, 4)
    with pytest.raises(cli.Failure, match=r"step 4 .* could not be set aside .*: move .*/4 out of .* by hand"):
        Checkpoints(str(ckpts)).restore_latest(abstract)
    assert Checkpoints(str(ckpts)).steps() == [2, 4]

    for err in (MemoryError(), RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes"),
                PermissionError(13, "Permission denied")):
        def fail(self, step, abstract_state, err=err):
            raise err
        monkeypatch.setattr(Checkpoints, "restore", fail)
        with pytest.raises(cli.Failure, match=r"step 4 .* may be whole, so it was left in place"):
            Checkpoints(str(ckpts)).restore_latest(abstract)
        monkeypatch.setattr(Checkpoints, "restore_params", lambda *a, **k: fail(None, None, None))
        with pytest.raises(cli.Failure, match=r"step 4 .* may be whole"):
            restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
        assert Checkpoints(str(ckpts)).steps() == [2, 4]
