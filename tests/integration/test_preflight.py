"""What a command checks before its work: eval's output (given or default) writable, outputs onto a
mount point refused, an export onto a full disk an OSError, the environment read as input, a
config.json edited by hand named, steps past the int32 counter refused up front.
"""

import errno
import json
import time

import numpy as np
import pytest

import eval as eval_cli
import train as train_cli
from onona_jax import paths
from onona_jax.train import loop
from run_fixtures import OVERRIDES, argv, errors, the_config
from run_fixtures import copy_run, read_only, run_dir, tmpfs  # noqa: F401 - fixtures


def test_eval_output_checked_before_the_work(run_dir, tmp_path, read_only, capfd):
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(ro)
    t = time.perf_counter()
    assert eval_cli.main([f"--workdir={run_dir}", f"--output={ro / 'eval.json'}", "--mesh=1,1,1"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"--output={ro / 'eval.json'}: cannot write to {ro}" in line
    assert time.perf_counter() - t < 5  # nothing restored or compiled


def test_eval_default_output_checked_before_the_work(copy_run, read_only, capfd):
    """No --output on a read-only workdir: its default, DIR/eval/, is probed first (exit 2, one
    line naming --output, in seconds); on a writable workdir the probe leaves nothing behind."""
    read_only(copy_run)
    t = time.perf_counter()
    assert eval_cli.main([f"--workdir={copy_run}", "--mesh=1,1,1"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert line.startswith(f"error: cannot write {copy_run}/eval (") and "give --output=PATH" in line, line
    assert time.perf_counter() - t < 5  # nothing restored or compiled


def test_default_output_probe_leaves_nothing(tmp_path):
    from onona_jax import cli

    cli.check_output_dir(str(tmp_path / "eval"), "--output")
    assert list(tmp_path.iterdir()) == []


def test_config_json_edited_by_hand_is_named(copy_run):
    """config.json against the config saved with the newest checkpoint: equal (as the run wrote
    it) says nothing; a hand edit is named by its keys (the run warns and rewrites the file)."""
    path, ckpts = str(copy_run / "config.json"), str(copy_run / "checkpoints")
    assert loop.config_edits(path, ckpts) == ""
    cfg = json.loads((copy_run / "config.json").read_text())
    cfg["train"]["lr"], cfg["model"]["n_layers"] = 0.5, 7
    (copy_run / "config.json").write_text(json.dumps(cfg))
    assert loop.config_edits(path, ckpts) == f"model.n_layers: {OVERRIDES.get('model.n_layers', 2)!r} → 7, " \
        f"train.lr: {the_config('x').train.lr!r} → 0.5"
    (copy_run / "config.json").write_text("{not json")
    assert loop.config_edits(path, ckpts) == "it no longer reads as JSON"
    assert loop.config_edits(path, str(copy_run / "no-checkpoints")) == ""


def test_steps_past_the_int32_counter_are_refused_up_front(tiny_data, tmp_path, capfd):
    workdir = tmp_path / "wd"
    assert train_cli.main(argv(tiny_data, workdir, **{"train.steps": 10**12})) == 2
    [line] = errors(capfd.readouterr().err)
    assert "train.steps resolves to 1,000,000,000,000, more than the 2,147,483,647 steps" in line, line
    assert not workdir.exists()


def test_the_environment_is_input(monkeypatch):
    """A bucket URL without its fsspec package names the extra; JAX_PLATFORMS is named only when
    JAX's backend really does not start; a bad ONONA_* value names the variable."""
    from onona_jax import cli

    missing = ImportError("Please install gcsfs to access Google Storage")
    missing.__cause__ = ModuleNotFoundError("No module named 'gcsfs'", name="gcsfs")
    assert cli.environment_failure(missing) == ("gs:// paths need gcsfs, which is not installed here; install the "
                                                "extra: pip install -e '.[gcs]' (or pip install gcsfs)")
    assert "pip install -e '.[cloud]'" in cli.environment_failure(ImportError("Install s3fs to access S3"))
    assert cli.environment_failure(ImportError("no module named foo")) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cli.environment_failure(RuntimeError("something else")) is None  # cpu starts: not the cause
    for name, value in (("ONONA_DISTRIBUTED", "yes"), ("ONONA_LOCK_LEASE_S", "-3")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"^{name}={value!r}"):
            cli.check_environment()
        monkeypatch.delenv(name)
    cli.check_environment()


def test_outputs_onto_a_mount_point_are_refused_before_the_work(tmp_path, monkeypatch):
    """export and prepare build their folder beside the target and rename it into place, which a
    mount point (here a bind mount, which os.path.ismount cannot see) cannot take."""
    from onona_jax.data import prepare

    volume = tmp_path / "volume"
    volume.mkdir()
    monkeypatch.setattr(paths, "mount_points", lambda: {str(volume)})
    with pytest.raises(ValueError, match=f"--output={volume} is a mount point .* --output={volume}/export$"):
        paths.check_rename_target(volume, "--output", "export")
    with pytest.raises(ValueError, match="is a mount point"):
        prepare.prepare([str(tmp_path / "in.txt")], str(volume), 0.1, 1000, 0)
    paths.check_rename_target(volume / "export", "--output", "export")  # a folder inside it is fine
    assert list(volume.iterdir()) == []


def test_export_onto_a_full_disk_is_an_oserror(tmpfs, tmp_path):
    """safetensors reports a full disk as its own SafetensorError; the export's writer turns it
    into OSError(ENOSPC), which export.py's one error line catches."""
    from onona_jax.serve import hf_format

    disk = tmpfs(tmp_path / "disk", "64k")
    with pytest.raises(OSError) as err:
        hf_format._save_safetensors({"w": np.zeros((256, 256), np.float32)}, str(disk / "model.safetensors"))
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(disk / "model.safetensors")
