"""Bad input fails fast with a message that names the problem and the fix, and writes nothing:
the workdir is not created (or, if it existed, is left exactly as it was)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, tiny_config
from onona_jax import train as trainer
from onona_jax.data.prepare import FORMAT_VERSION

V_MODEL = 50304  # tiny configs' model.vocab_size


def snapshot(path: Path) -> dict | None:
    """Every file and directory under `path` with its size and mtime (None: path absent)."""
    if not path.exists():
        return None
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(root, name)
            st = p.stat()
            out[str(p.relative_to(path))] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def assert_rejected(cfg, tmp_path: Path, *words: str) -> str:
    """`trainer.train` raises ValueError naming every word, and neither creates a fresh
    workdir nor touches an existing one."""
    fresh = tmp_path / "fresh_workdir"
    with pytest.raises(ValueError) as err:
        trainer.train(cfg, str(fresh), progress=False)
    msg = str(err.value)
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in message: {msg}"
    assert not fresh.exists(), f"workdir created before the input was rejected: {sorted(os.listdir(fresh))}"

    existing = tmp_path / "existing_workdir"  # e.g. an earlier run's files
    existing.mkdir()
    (existing / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n')
    (existing / "config.json").write_text("{}\n")
    before = snapshot(existing)
    with pytest.raises(ValueError):
        trainer.train(cfg, str(existing), progress=False)
    assert snapshot(existing) == before, "existing workdir changed by a rejected run"
    return msg


def write_data(d: Path, train_tokens, heldout_tokens, vocab=50257):
    """A data dir written by hand in prepare's format (one shard per split)."""
    d.mkdir(parents=True)
    splits = {}
    for split, toks in (("train", train_tokens), ("heldout", heldout_tokens)):
        toks = np.asarray(toks, np.uint16)
        name = f"{split}_00000.bin"
        toks.tofile(d / name)
        splits[split] = {"shards": [{"file": name, "tokens": int(toks.size)}], "tokens": int(toks.size),
                         "documents": 1}
    manifest = {"format_version": FORMAT_VERSION, "tokenizer": {"name": "gpt2"}, "eot": 50256, "vocab": vocab,
                "dtype": "uint16", "splits": splits, "heldout_fraction": 0.1, "seed": 0}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return str(d)


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 50257, n)


# ----------------------------------------------------------------------------- data


def test_missing_data_dir(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.data.dir = str(tmp_path / "no_such_data")
    assert_rejected(cfg, tmp_path, "no prepared data", "no_such_data", "manifest.json",
                    "python -m onona_jax.data.prepare")


def test_empty_train_split(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.data.dir = write_data(tmp_path / "data", [], tokens(2000))
    assert_rejected(cfg, tmp_path, "split 'train'", "is empty", "python -m onona_jax.data.prepare")


def test_train_split_shorter_than_one_window(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")  # seq_len 32: a window is 33 tokens
    cfg.data.dir = write_data(tmp_path / "data", tokens(20), tokens(2000))
    assert_rejected(cfg, tmp_path, "train split", "20 tokens", "fewer than one window", "lower seq_len",
                    "prepare more text")


def test_heldout_too_small_for_eval_windows(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")  # eval.windows = 8 windows of 33 tokens
    cfg.data.dir = write_data(tmp_path / "data", tokens(2000), tokens(5 * 33))
    assert_rejected(cfg, tmp_path, "held-out split", "only 5 windows", "8 were requested", "lower the count",
                    "--heldout_fraction")


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_token_id_out_of_vocab(tiny_data, tmp_path, split):
    bad = tokens(2000)
    bad[123] = 60000  # a uint16 id that no GPT-2 vocabulary has
    train, heldout = (bad, tokens(2000, 1)) if split == "train" else (tokens(2000, 1), bad)
    cfg = tiny_config(tiny_data, "standard")
    cfg.data.dir = write_data(tmp_path / "data", train, heldout)
    assert_rejected(cfg, tmp_path, f"{split}_00000.bin", "token id 60000", "position 123", ">= vocab size",
                    "python -m onona_jax.data.prepare", "tokenizer")


def test_shard_shorter_than_manifest(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.data.dir = write_data(tmp_path / "data", tokens(2000), tokens(2000))
    with open(Path(cfg.data.dir) / "train_00000.bin", "r+b") as f:  # an interrupted copy
        f.truncate(1000)
    assert_rejected(cfg, tmp_path, "train_00000.bin", "1000 bytes", "2000 uint16 tokens", "incomplete or corrupt",
                    "python -m onona_jax.data.prepare")


# ----------------------------------------------------------------------------- mesh and shapes


def test_mesh_size_does_not_match_devices(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.mesh.update(data=3, fsdp=1, tensor=1)
    assert_rejected(cfg, tmp_path, "has 3 devices", "this run has 8", "--config.mesh.data/fsdp/expert/tensor",
                    "product is 8", "-1")


def test_mesh_fixed_axes_do_not_divide_devices(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.mesh.update(data=-1, fsdp=1, tensor=3)
    assert_rejected(cfg, tmp_path, "8 devices are not divisible", "product 3", "--config.mesh")


def test_kv_heads_not_divisible_by_tensor_axis(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")  # 8 heads, 4 KV heads
    cfg.mesh.update(data=1, fsdp=1, tensor=8)
    assert_rejected(cfg, tmp_path, "kv_heads", "has size 4", "not divisible", "tensor", "size 8",
                    "--config.mesh")


def test_vocab_not_divisible_by_tensor_axis(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.model.update(vocab_size=0, vocab_multiple=1)  # GPT-2's 50,257 rows unpadded: valid but odd
    cfg.mesh.update(data=4, fsdp=1, tensor=2)
    assert_rejected(cfg, tmp_path, "(vocab)", "50257", "not divisible", "tensor", "size 2", "vocab_size divisible")


@pytest.mark.parametrize("global_batch,micro_batch,data", [(12, 1, 8), (8, 2, 8), (8, 3, 1)])
def test_global_batch_not_divisible(tiny_data, tmp_path, global_batch, micro_batch, data):
    cfg = tiny_config(tiny_data, "standard", global_batch=global_batch, micro_batch=micro_batch)
    cfg.mesh.update(data=data, fsdp=8 // data, tensor=1)
    assert_rejected(cfg, tmp_path, f"train.global_batch={global_batch}", "not divisible",
                    f"train.micro_batch={micro_batch}", "data-parallel size 8",
                    f"multiple of {micro_batch * 8}")


def test_config_value_checked_before_write(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard")
    cfg.model.n_kv_heads = 3  # 8 query heads cannot be grouped over 3 KV heads
    assert_rejected(cfg, tmp_path, "model.n_heads=8", "model.n_kv_heads=3", "not divisible")


# ----------------------------------------------------------------------------- the command line


def cli_env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("override,hint", [
    ("train.nonexistent", "config.train has keys"),
    ("train.setps", "did you mean config.train.steps?"),
])
@pytest.mark.parametrize("config_arg", [["--config=configs/paper.py:dense-tiny-standard"], []])
def test_cli_unknown_config_key(tmp_path, override, hint, config_arg):
    """With or without --config (the default file is loaded at flag definition), an unknown key is
    a one-line error naming the key and where the keys are, not a traceback."""
    workdir = tmp_path / "wd"
    p = run_cli(*config_arg, f"--config.{override}=1", f"--workdir={workdir}")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert f"unknown config key config.{override}" in errors[0] and hint in errors[0], errors[0]
    assert "onona_jax/config.py" in errors[0]
    assert not workdir.exists()


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    """A ValueError reaches the user as `error: ...` and exit status 2, not a traceback."""
    workdir = tmp_path / "wd"
    p = run_cli("--config=configs/paper.py:dense-tiny-standard", f"--config.data.dir={tmp_path / 'nodata'}",
                "--config.mesh.data=1", f"--workdir={workdir}")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no prepared data" in errors[0] and "onona_jax.data.prepare" in errors[0], p.stderr
    assert not workdir.exists()
