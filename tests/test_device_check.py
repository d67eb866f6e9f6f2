"""scripts/device_check.sh --dry_run on the CPU: the prepared accelerator run cannot fail for a
typo when a GPU is at hand. Every variant appears in the JSON and the Markdown table. With
--dry_run_all (slow) every variant trains the same tiny model on the same batch, so the
losses after 4 steps agree across losses and chunks (the same function: 1e-4 relative;
AdamW turns rounding into small parameter differences)."""

import json
import math
import os
import subprocess

import pytest

from conftest import REPO


def _run(out_dir, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run(["bash", os.path.join(REPO, "scripts", "device_check.sh"), str(out_dir), "--dry_run", *extra],
                          capture_output=True, text=True, env=env, timeout=900)


def test_device_check_dry_run(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "device_check.json").read_text())
    names = ["fused+xla", "fused+cudnn", "fused_vocab@2048", "fused_vocab@8192", "plain"]
    assert list(res["train"]) == [f"{h}/{n}" for h in ("standard", "twin") for n in names]
    stepped = {k: r for k, r in res["train"].items() if r["status"] == "measured"}
    assert sorted(stepped) == ["twin/fused+xla"]
    r = stepped["twin/fused+xla"]
    assert r["tokens_per_s"] > 0 and r["xla_peak_gib"] > 0 and 0 < r["loss"] < 11.5  # ln(50304) = 10.8 at init
    assert res["train"]["twin/fused+cudnn"]["status"].startswith("skipped (cuDNN attention needs a GPU")
    assert res["decode"]["status"] == "measured" and res["decode"]["one/two_projection"] > 0
    md = (tmp_path / "device_check.md").read_text()
    assert sum(line.startswith(("| standard |", "| twin |")) for line in md.splitlines()) == 10
    assert "one/two-projection sampling" in md


def test_device_check_usage_error(tmp_path):
    p = subprocess.run(["bash", os.path.join(REPO, "scripts", "device_check.sh")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: usage")


@pytest.mark.slow
def test_device_check_dry_run_all(tmp_path):
    """Every variant compiled and stepped (run: pytest -m slow tests/test_device_check.py)."""
    p = _run(tmp_path, "--dry_run_all")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "device_check.json").read_text())
    stepped = {k: r for k, r in res["train"].items() if r["status"] == "measured"}
    assert len(stepped) == 8
    for k, r in stepped.items():
        ref = stepped[k.split("/")[0] + "/plain"]["loss"]
        assert math.isfinite(r["loss"]) and abs(r["loss"] / ref - 1) <= 1e-4, (k, r["loss"], ref)
