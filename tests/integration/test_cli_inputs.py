"""Every command's bad input is one `error:` line (issue 24): exit 2 before any write for bad
input, exit 1 for a runtime failure, no traceback. Export (its --output, --overwrite, file
modes, a failed export), import_hf (damaged folders), `--config=` specs, and read-only readers
(generate, eval, export) on a run whose checkpoint rotation deletes the step being read.
prepare's cases are in test_prepare_formats.py."""

import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import jax
import ml_collections
import pytest

import train as train_cli
from conftest import REPO, tiny_config
from onona_jax import checkpoint
from onona_jax import config as config_lib
from onona_jax import models as model_lib
from onona_jax.serve import export, generate, hf_format
from onona_jax.train import import_hf
from run_fixtures import copy_run, errors, run_dir, tree_digest  # noqa: F401 - the fixtures


def one_error(capfd) -> str:
    """The one line on stderr, an `error:` line, with no traceback anywhere."""
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    [line] = errors(err)
    return line


def umask_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


# ----------------------------------------------------------------------------- --config= specs


@pytest.mark.parametrize("case", ["missing-file", "unknown-name", "file-raises", "get_config-raises"])
def test_bad_config_spec_is_one_error_line(tmp_path, capfd, monkeypatch, case):
    """A missing file, a name get_config does not know, a config file that raises: one error
    line naming the spec and where the valid names are (before: a traceback inside the line)."""
    monkeypatch.chdir(REPO)
    (tmp_path / "raises.py").write_text("raise RuntimeError('broken on purpose')\n")
    (tmp_path / "get_raises.py").write_text('"""Specs: get_raises.py:<n>."""\ndef get_config(arg):\n'
                                            '    return {}[arg]\n')
    spec, words = {
        "missing-file": ("configs/nope.py:dense-tiny-twin",
                         "no config file 'configs/nope.py'; the config files are in configs/: paper.py"),
        "unknown-name": ("configs/paper.py:dense-tiny-nohead",
                         "config arg 'dense-tiny-nohead': arch in ('dense', "),
        "file-raises": (f"{tmp_path / 'raises.py'}:x",
                        f"{tmp_path / 'raises.py'} fails to load (RuntimeError: broken on purpose); fix it or "
                        "choose another (the config files are in configs/: paper.py)"),
        "get_config-raises": (f"{tmp_path / 'get_raises.py'}:big",
                              f"KeyError: 'big'; {tmp_path / 'get_raises.py'}'s get_config defines the names "
                              f"(Specs: get_raises.py:<n>)"),
    }[case]
    assert train_cli.main([f"--config={spec}", f"--workdir={tmp_path / 'w'}"]) == 2
    line = one_error(capfd)
    assert line.startswith(f"error: --config={spec}: ") and words in line, line
    if case == "unknown-name":
        assert line.endswith("configs/paper.py's get_config defines the names (The paper's models and training "
                             "recipe: `configs/paper.py:<arch>-<size>-<head>`)"), line
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match=f"^config {spec}: "):
        config_lib.load(spec)


# ----------------------------------------------------------------------------- import_hf


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """An OnonaForCausalLM export (dense twin, fresh parameters, no tokenizer)."""
    cfg = tiny_config(str(tmp_path_factory.mktemp("nodata")), head="twin")
    _, params = model_lib.init(cfg.model, 0)
    out = tmp_path_factory.mktemp("hf") / "dense-twin"
    assert hf_format.export(params, cfg, str(out), tokenizer=False)[0] == "onona"
    return out


def damaged(folder: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of `folder` damaged `how`: (the copy, the file the error must name)."""
    dst = tmp_path / "damaged"
    shutil.copytree(folder, dst)
    weights = dst / hf_format.WEIGHTS
    if how == "config-not-json":
        (dst / "config.json").write_text('{"model_type": "qwen3", ')
        return dst, str(dst / "config.json")
    if how == "train-config-not-json":
        (dst / hf_format.TRAIN_CONFIG).write_bytes(b"\xff\xfe not json")
        return dst, str(dst / hf_format.TRAIN_CONFIG)
    if how == "truncated-weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return dst, str(weights)
    if how == "garbage-weights":
        weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{nojson}" + b"\0" * 64)
        return dst, str(weights)
    assert how == "missing-shard"
    shard = "model-00001-of-00002.safetensors"
    weights.rename(dst / shard)
    (dst / hf_format.WEIGHTS_INDEX).write_text(json.dumps({"weight_map": {
        "model.norm.weight": shard, "model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
    return dst, str(dst / hf_format.WEIGHTS_INDEX)


@pytest.mark.parametrize("how", ["config-not-json", "train-config-not-json", "truncated-weights", "garbage-weights",
                                 "missing-shard"])
def test_import_of_a_damaged_folder_is_one_error_line_naming_the_file(hf_folder, tmp_path, capfd, how):
    folder, file = damaged(hf_folder, tmp_path, how)
    workdir = tmp_path / "w"
    assert import_hf.main([f"--from_hf={folder}", f"--workdir={workdir}"]) == 2
    line = one_error(capfd)
    assert line.startswith(f"error: {file} "), line
    assert "export or download the folder again" in line, line
    assert not (workdir / "checkpoints").exists() and not (workdir / "config.json").exists()


def test_stale_weight_files_beside_model_safetensors_are_not_read(hf_folder, tmp_path):
    """model.safetensors wins, as in transformers: an older download's shards left in the folder
    (which an export's --overwrite keeps) do not mix in."""
    folder = tmp_path / "f"
    shutil.copytree(hf_folder, folder)
    from safetensors.numpy import save_file
    import numpy as np

    save_file({"lm_head.weight": np.zeros((4, 4), np.float32)}, str(folder / "model-00001-of-00002.safetensors"))
    assert "lm_head.weight" not in hf_format.read_weights(str(folder))


# ----------------------------------------------------------------------------- export


def test_export_output_checked_before_any_checkpoint_is_read(run_dir, tmp_path, capfd):
    """--output a file, under a file, in a read-only place, non-empty, or the run's own
    directory: one error line (exit 2) within seconds, naming it; nothing created."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    before = tree_digest(tmp_path)
    cases = {
        a_file: f"--output={a_file} is a file; give a folder path",
        a_file / "hf": f"--output={a_file / 'hf'} is under {a_file}, which is a file; give a folder path",
        full: f"--output={full} is not empty; give a new or empty folder, or pass --overwrite to replace the "
              "files an export writes (config.json, model.safetensors, ",
        run_dir: f"--output={run_dir} is the run's --workdir; give another folder (e.g. {run_dir}/hf)",
    }
    for output, words in cases.items():
        t = time.perf_counter()
        # a workdir without checkpoints: the output's error comes first
        workdir = run_dir if output == run_dir else tmp_path / "no-run"
        assert export.main([f"--workdir={workdir}", f"--output={output}", "--mesh=1,1,1"]) == 2
        line = one_error(capfd)
        assert line.startswith(f"error: {words}"), line
        assert time.perf_counter() - t < 5
    assert tree_digest(tmp_path) == before


def test_export_into_a_read_only_place_is_one_error_line(tmp_path, capfd):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(ro)], capture_output=True)
    try:
        try:
            (ro / ".probe").write_text("x")
        except OSError:
            pass
        else:
            pytest.skip("cannot make a read-only directory here")
        for output in (ro / "hf", ro / "deeper" / "hf"):
            assert export.main([f"--workdir={tmp_path / 'no-run'}", f"--output={output}"]) == 2
            line = one_error(capfd)
            assert line.startswith(f"error: --output={output}: cannot write to {ro} ("), line
            assert line.endswith("give a writable place")
        assert list(ro.iterdir()) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
        ro.chmod(0o755)


def test_overwrite_replaces_only_export_files_with_0644_modes(run_dir, hf_folder, tmp_path, capfd):
    """An OnonaForCausalLM export, the user's own file and an old shard in OUT; a Qwen3 export of
    the run with --overwrite: the export files are the new kind's (the Onona code files are
    gone), the rest byte for byte as it was, every file 0644 (safetensors wrote 0600), and the
    folder reads back as import_hf reads it."""
    out = tmp_path / "out"
    shutil.copytree(hf_folder, out)
    onona_files = sorted(p.name for p in out.iterdir())
    assert set(hf_format.CODE_FILES) <= set(onona_files)
    (out / "README.md").write_text("my notes")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an older download")
    assert export.main([f"--workdir={run_dir}", f"--output={out}", "--notokenizer"]) == 2
    assert "is not empty" in one_error(capfd)

    assert export.main([f"--workdir={run_dir}", f"--output={out}", "--overwrite", "--notokenizer"]) == 0
    summary = json.loads(capfd.readouterr().out)
    assert summary["kind"] == "hf-qwen3" and summary["step"] == 4
    # EXPORT_FILES (what --overwrite replaces) lists every file of either kind (a MoE export's are
    # a Qwen3 export's; test_hf_export checks the tokenizer's)
    assert set(summary["files"]) | set(onona_files) <= set(hf_format.EXPORT_FILES)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        summary["files"] + ["README.md", "model-00001-of-00002.safetensors"])
    assert not set(hf_format.CODE_FILES) & {p.name for p in out.iterdir()}
    assert (out / "README.md").read_text() == "my notes"
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
        p.name: oct(umask_mode()) for p in out.iterdir()}
    assert not list(tmp_path.glob("out.tmp-*"))
    # what import_hf reads, every name and shape checked against the model: no stale file mixes in
    cfg = hf_format.model_config_from_hf(hf_format.read_config(str(out)),
                                         ml_collections.ConfigDict(hf_format.read_train_config(str(out))))
    assert cfg.model.head == "standard"
    hf_format.from_hf(hf_format.read_weights(str(out)), cfg.model)


def test_a_failed_export_leaves_the_old_folder_as_it_was(run_dir, tmp_path, capfd, monkeypatch):
    """The disk fills while the weights are written (an --overwrite export): exit 1, one error
    line, the old folder byte for byte, no temporary folder left."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"old weights")
    before = tree_digest(tmp_path)

    def full_disk(tensors, path):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_format, "_save_safetensors", full_disk)
    assert export.main([f"--workdir={run_dir}", f"--output={out}", "--overwrite", "--notokenizer"]) == 1
    line = one_error(capfd)
    assert line.startswith(f"error: cannot write the export to {out} (No space left on device)"), line
    assert tree_digest(tmp_path) == before


# ----------------------------------------------------------------------------- a run that rotates its steps


def rotate(workdir: Path, old: int, new: int):
    """What a live train.py with max_to_keep does meanwhile: a newer step appears, `old` is deleted."""
    ckpts = workdir / "checkpoints"
    shutil.copytree(ckpts / str(old), ckpts / str(new))
    shutil.rmtree(ckpts / str(old))


def test_read_only_restore_retries_a_step_deleted_while_read(copy_run, capfd, monkeypatch):
    """restore_params (eval, export, analysis) lists [2, 4] and reads 4; the run saves 6 and
    deletes 4 during the read: it reads 6, says so, and touches nothing."""
    real = checkpoint.Checkpoints.restore_params
    calls = []

    rotated = {}

    def read(self, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 1:
            rotate(copy_run, 4, 6)
            rotated.update(tree_digest(copy_run))
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Checkpoints, "restore_params", read)
    _, step, _, _ = checkpoint.restore_params(str(copy_run), None, (1, 1, 1), jax.devices()[:1])
    err = capfd.readouterr().err
    assert calls == [4, 6] and step == 6
    assert err.strip() == ("note: checkpoint at step 4 was deleted while it was read (a running train.py keeps only "
                           "its newest); reading step 6, the newest now"), err
    assert tree_digest(copy_run) == rotated  # the reader changed nothing


def test_generate_on_a_run_that_rotates_between_its_reads(copy_run, capfd, monkeypatch):
    """generate reads the head at step 4, then the trunk; the run saves 6 and deletes 4 in
    between (before: exit 2 "no checkpoint at step 4 ... have [2, 6]"). It generates from step
    6 and says so. `--step` of a step that does not exist stays one error line, exit 2."""
    real = checkpoint.Checkpoints.restore_params
    calls = []

    def read(self, step, abstract, *args, **kwargs):
        calls.append((step, tuple(abstract)))
        out = real(self, step, abstract, *args, **kwargs)
        if len(calls) == 1:
            rotate(copy_run, 4, 6)
        return out

    monkeypatch.setattr(checkpoint.Checkpoints, "restore_params", read)
    assert generate.main([f"--workdir={copy_run}", "--max_new_tokens=2", "--prompt=It is"]) == 0
    out, err = capfd.readouterr()
    assert calls == [(4, ("head",)), (6, ("head",)), (6, ("trunk",))]
    assert "note: checkpoint at step 4 was deleted after its head was read" in err and "Traceback" not in err
    assert "step 6]" in out, out

    assert generate.main([f"--workdir={copy_run}", "--step=4"]) == 2
    assert one_error(capfd) == (f"error: no checkpoint at step 4 in {copy_run / 'checkpoints'}; have [2, 6]")


def test_a_step_deleted_between_orbax_listing_it_and_reading_its_metadata(copy_run, capfd, monkeypatch):
    """Orbax lists the step directories, then reads each one's metadata and mtime: a live run's
    rotation deleting step 4 in between raised FileNotFoundError out of the listing itself, a
    traceback from generate (CI's fault battery, generate-on-a-live-run). The reader lists again,
    reads step 2 and changes nothing."""
    from orbax.checkpoint import checkpoint_manager

    real = checkpoint_manager.step_lib.standard_name_format
    deleted = []

    def racing(*args, **kwargs):
        fmt = real(*args, **kwargs)
        find_all = fmt.find_all

        def find_then_delete(base):
            found = list(find_all(base))  # the listing's snapshot holds step 4 ...
            if not deleted:  # ... which the run deletes before its metadata is read
                shutil.rmtree(copy_run / "checkpoints" / "4")
                deleted.append(tree_digest(copy_run))
            return iter(found)

        object.__setattr__(fmt, "find_all", find_then_delete)
        return fmt

    monkeypatch.setattr(checkpoint_manager.step_lib, "standard_name_format", racing)
    assert generate.main([f"--workdir={copy_run}", "--max_new_tokens=2", "--prompt=It is", "--greedy"]) == 0
    out, err = capfd.readouterr()
    assert len(deleted) == 1 and "Traceback" not in err, err
    assert "step 2]" in out, out
    assert tree_digest(copy_run) == deleted[0]  # the reader changed nothing


def test_a_listing_raced_many_times_in_a_row_is_listed_again_until_it_is_not(monkeypatch):
    """On a loaded CI host a run saving every step raced generate's listing five times in a row,
    and the fifth FileNotFoundError came out as a traceback. The reader lists again for
    LISTING_RETRY_S seconds, however many races that takes, and raises only past it."""
    monkeypatch.setattr(checkpoint.time, "sleep", lambda s: None)
    races = []

    def listing(n):
        def list_steps():
            if len(races) < n:
                races.append(1)
                raise FileNotFoundError(2, "No such file or directory", "checkpoints/4")
            return [2, 6]
        return list_steps

    assert checkpoint._listed(listing(20)) == [2, 6] and len(races) == 20
    races.clear()
    clock = iter(range(0, 10_000, 10))  # each look at the clock: 10 s later
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: next(clock))
    with pytest.raises(FileNotFoundError):
        checkpoint._listed(listing(10**6), within_s=30)
    assert len(races) == 4  # tried at 10, 20, 30 s; the fourth failure, at 40 s, is past the deadline
