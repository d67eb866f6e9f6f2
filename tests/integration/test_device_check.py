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
                          capture_output=True, text=True, env=env, timeout=3600)


@pytest.mark.slow  # suite-time margin: the script runs one step of each arm on CPU
def test_device_check_dry_run(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "device_check.json").read_text())
    fused = [f"{h}/{n}" for h in ("standard", "twin") for n in ("fused+xla", "fused+cudnn")]
    families = ["twin/moe:sort", "twin/moe:grouped", "twin/gdn:highest", "twin/gdn:default"]
    families += ["twin/documents+cudnn", "twin/documents+xla"]
    rest = [f"{h}/{n}" for h in ("standard", "twin") for n in ("fused_vocab@2048", "fused_vocab@8192", "plain")]
    assert list(res["train"]) == fused + families + rest
    stepped = {k: r for k, r in res["train"].items() if r["status"] == "measured"}
    assert sorted(stepped) == ["twin/fused+xla"]
    r = stepped["twin/fused+xla"]
    assert r["tokens_per_s"] > 0 and r["xla_peak_gib"] > 0 and 0 < r["loss"] < 11.5  # ln(50304) = 10.8 at init
    assert res["train"]["twin/fused+cudnn"]["status"].startswith("skipped (cuDNN attention needs a GPU")
    assert res["decode"]["status"] == "measured" and res["decode"]["one/two_projection"] > 0
    md = (tmp_path / "device_check.md").read_text()
    assert sum(line.startswith(("| standard |", "| twin |")) for line in md.splitlines()) == 16
    assert "one/two-projection sampling" in md


def test_device_check_usage_error(tmp_path):
    p = subprocess.run(["bash", os.path.join(REPO, "scripts", "device_check.sh")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("error: usage")


@pytest.mark.slow
def test_device_check_dry_run_all(tmp_path):
    """Every variant compiled and stepped (run: pytest -m slow tests/integration/test_device_check.py)."""
    p = _run(tmp_path, "--dry_run_all", "--budget_s=3000")  # all 13, however loaded the host
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "device_check.json").read_text())
    stepped = {k: r for k, r in res["train"].items() if r["status"] == "measured"}
    assert len(stepped) == 13
    # One model computed two ways: MoE's dispatches keep the same assignments (fp32 rounding);
    # GDN's recurrence at default precision rounds its matmul inputs to bf16 (1e-3).
    # The families' first variants are other models than Dense: only near ln(50304) = 10.8 after
    # 4 steps of a tiny model, the reference of their second variant.
    refs = {"twin/moe:grouped": ("twin/moe:sort", 1e-4), "twin/gdn:default": ("twin/gdn:highest", 1e-3)}
    # Packed documents leave the targets after each end of text out of the loss: another number
    # than the windows' on the same batch (the bundled corpus's documents are paragraphs).
    firsts = ("twin/moe:sort", "twin/gdn:highest", "twin/documents+xla")
    for k in firsts:
        assert 9.5 < stepped[k]["loss"] < 11.5, (k, stepped[k]["loss"])
    assert res["batch_eots"] > 0
    assert stepped["twin/documents+xla"]["loss"] != stepped["twin/fused+xla"]["loss"]
    for k, r in stepped.items():
        if k in firsts:
            continue
        ref, tol = refs.get(k, (k.split("/")[0] + "/plain", 1e-4))
        assert math.isfinite(r["loss"]) and abs(r["loss"] / stepped[ref]["loss"] - 1) <= tol, (k, r["loss"], ref)
