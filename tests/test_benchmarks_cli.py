"""The benchmark scripts that take a config speak the package's command line: `--config.*`
overrides, and bad usage is one `error:` line and exit status 2, found before any compile or
worker process. The retired `--set` (step_ab.py, code_ab.py, gemm_floor.py, profile_step.py)
names its replacement."""

import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the scripts import common.py from beside them
import code_ab  # noqa: E402
import common  # noqa: E402
import compile_cache  # noqa: E402
import gemm_floor  # noqa: E402
import peer  # noqa: E402
import profile_step  # noqa: E402
import step_ab  # noqa: E402

SCRIPTS = [step_ab, code_ab, gemm_floor, profile_step]
TINY = f"--config={REPO}/configs/paper.py:dense-tiny-standard"


def _error(capsys, script, *argv) -> str:
    assert script.main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_retired_set_names_config_overrides(capsys, script):
    err = _error(capsys, script, TINY, "--set=model.d_model=512")
    assert "--set is retired" in err and "--config.model.d_model=512" in err


@pytest.mark.parametrize("script", SCRIPTS + [peer, compile_cache], ids=lambda m: m.__name__)
def test_unknown_config_key_is_one_error_line(capsys, script):
    err = _error(capsys, script, TINY, "--config.model.d_modle=64")
    assert "d_modle" in err


def test_step_ab_variant_keys_are_checked_before_compiling(capsys):
    err = _error(capsys, step_ab, TINY, "--variant=model.remat")
    assert "'model.remat' is not key=value" in err
    err = _error(capsys, step_ab, TINY, "--variant=model.d_modle=64")
    assert err == "error: unknown config keys model.d_modle: every key is in onona_jax/config.py"


def test_config_overrides_reach_the_step_config():
    # `--config=... --config.<key>=...` as one (spec, overrides) pair, the values typed as the
    # config flag parsed them, and the one-device step config built from it.
    from absl import flags

    from onona_jax import config as config_lib

    argv = [TINY, "--config.model.remat=full", "--config.train.global_batch=6"]
    fv = flags.FlagValues()
    config_lib.define_flag(fv, argv, None)
    fv(["prog", *argv])
    spec, overrides = common.config_args(fv, argv, "unused")
    assert spec == TINY.split("=", 1)[1]
    assert overrides == {"model.remat": "full", "train.global_batch": 6}
    cfg = common.jax_config(spec, overrides)
    assert (cfg.model.head, cfg.model.remat, cfg.train.global_batch, cfg.train.micro_batch) == ("standard", "full", 6, 6)
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 1, 1)
    assert common.parse_overrides("model.remat=dots,train.lr=0.5", "variant") == {"model.remat": "dots", "train.lr": 0.5}


def test_code_ab_needs_a_checkout_as_base(capsys, tmp_path):
    err = _error(capsys, code_ab, TINY, f"--base={tmp_path}")
    assert f"--base={tmp_path} is not an onona-jax checkout" in err


def test_parts_checks_values_against_pytorch_and_refuses_bad_tiles(capsys):
    """benchmarks/parts.py at tiny shapes: every variant's loss gradients (head, at two tiles)
    and attention gradients (whole square and query blocks, T 200 in 4 blocks) agree with
    PyTorch's to 1e-4, and the clipped AdamW update with float64's, before any timing counts (a
    mismatch exits 1); a tile < 1 is one error line."""
    import parts

    assert parts.main(["--tokens=96", "--d_model=16", "--vocab=300", "--tiles=32,96", "--batch=1", "--seq=200",
                       "--heads=4", "--kv_heads=2", "--head_dim=8", "--reps=1"]) == 0
    out = capsys.readouterr().out
    assert "ours: head_nll, token tile 32" in out and "ours: causal_attention (xla, query blocks)" in out
    # the optimizer's update matched float64, and XLA makes 3 passes over the table (4 with optax's clip)
    assert "ours: clip_by_global_norm + optax.adamw" in out and "3 fusions write a table" in out
    assert "4 fusions write a table" in out
    assert _error(capsys, parts, "--tiles=0") == "error: --reps and every --tiles entry must be ≥ 1"
