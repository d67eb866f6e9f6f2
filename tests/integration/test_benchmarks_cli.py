"""The benchmark scripts that take a config speak the package's command line: `--config.*`
overrides, and bad usage is one `error:` line and exit status 2, found before any compile or
worker process. A suite script's `--what` picks its mode, whose flags are its own. The retired
`--set` (peer.py --what=profile, once profile_step.py) names its replacement."""

import os
import sys

import pytest

from conftest import REPO
from onona_jax import cli

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the scripts import common.py from beside them
import bench  # noqa: E402
import common  # noqa: E402
import peer  # noqa: E402

TINY = f"--config={REPO}/configs/paper.py:dense-tiny-standard"
# (script, its mode's flags) of every mode that takes a config and builds the step itself
CONFIG_MODES = [(peer, []), (peer, ["--what=profile"]), (bench, ["--what=compile_cache"])]


def _id(case):
    script, mode = case
    return script.__name__ + "".join(mode)


def _error(capsys, script, *argv) -> str:
    assert script.main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_retired_set_names_config_overrides(capsys):
    err = _error(capsys, peer, "--what=profile", TINY, "--set=model.d_model=512")
    assert "--set is retired" in err and "--config.model.d_model=512" in err


@pytest.mark.parametrize("case", CONFIG_MODES, ids=_id)
def test_unknown_config_key_is_one_error_line(capsys, case):
    script, mode = case
    err = _error(capsys, script, *mode, TINY, "--config.model.d_modle=64")
    assert "d_modle" in err


def test_modes_are_one_error_line(capsys):
    # an unknown mode names the modes; another mode's flag is unknown to this one
    err = _error(capsys, bench, "--what=gemm")
    assert err == f"error: --what=gemm: choose one of {', '.join(bench.WHAT)}"
    assert "Unknown command line flag 'reps'" in _error(capsys, bench, "--what=families", "--reps=3")
    assert "Unknown command line flag 'rounds'" in _error(capsys, peer, "--what=parts", "--rounds=3")
    assert cli.flag_value(["--what", "moe", "--what=compile"], "what", "sections") == "compile"


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


def test_parts_checks_values_against_pytorch_and_refuses_bad_tiles(capsys):
    """benchmarks/peer.py --what=parts at tiny shapes: every variant's loss gradients (head, at
    two tiles) and attention gradients (whole square and query blocks, T 200 in 4 blocks) agree
    with PyTorch's to 1e-4, and the clipped AdamW update with float64's, before any timing counts (a
    mismatch exits 1); a tile < 1 is one error line."""
    assert peer.main(["--what=parts", "--tokens=96", "--d_model=16", "--vocab=300", "--tiles=32,96", "--batch=1",
                      "--seq=200", "--heads=4", "--kv_heads=2", "--head_dim=8", "--reps=1"]) == 0
    out = capsys.readouterr().out
    assert "ours: head_nll, token tile 32" in out and "ours: causal_attention (xla, query blocks)" in out
    # the optimizer's update matched float64, and XLA makes 3 passes over the table (4 with optax's clip)
    assert "ours: clip_by_global_norm + optax.adamw" in out and "3 fusions write a table" in out
    assert "4 fusions write a table" in out
    assert _error(capsys, peer, "--what=parts", "--tiles=0") == "error: --reps and every --tiles entry must be ≥ 1"


def test_one_projection_refuses_an_ungated_export_before_writing(capsys, tmp_path):
    """serve_bench's one_projection mode on a standard-head export: one error line naming what it
    needs, and its --out_dir never made."""
    import serve_bench

    from conftest import tiny_config
    from onona_jax import config as config_lib
    from onona_jax import models as model_lib
    from onona_jax.serve import hf_format

    cfg = config_lib.validate(tiny_config(str(tmp_path / "no-data"), head="standard", arch="dense"))
    hf_format.export(model_lib.init(cfg.model, 0)[1], cfg, str(tmp_path / "export"), tokenizer=False)
    err = _error(capsys, serve_bench, "--what=one_projection", f"--export={tmp_path / 'export'}",
                 f"--out_dir={tmp_path / 'out'}", f"--vllm_python={sys.executable}")
    assert "has no gated head" in err and "needs a twin (or another gated) export" in err
    assert not (tmp_path / "out").exists()
