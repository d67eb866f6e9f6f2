"""The fault battery (`tests/battery/`, `python -m tests.battery`) in CI, so it cannot rot: every case of its table,
and one kill -9 cycle on local disk and one on the GCS emulator, each checked bit for bit
against an uninterrupted run; the timed cases beside 8 busy processes (`--load=8`), so their
load-scaled bounds are tried where they are tightest. The battery runs its commands as subprocesses (one device each)
and prints one line per case; this test fails naming the cases that did not hold.

The full battery (3 cycles a store, or more) is a manual command: `python -m tests.battery`.
"""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # ~14 minutes on 2 cores: about 130 commands, the timed ones beside 8 busy processes


def test_fault_battery_holds():
    pytest.importorskip("gcp_storage_emulator", reason="the GCS cycles need the emulator (`pip install -e '.[test]'`)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "tests.battery", "--cycles=1",
                        "--stores=local,gcs", "--seed=0", "--load=8"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=3000)
    lines = [ln for ln in p.stdout.splitlines() if re.match(r"\s+(held|FAILED|skipped)\s", ln)]
    failed = [ln.strip() for ln in lines if ln.split()[0] == "FAILED"]
    assert p.returncode == 0 and not failed, "\n".join(failed) or (p.stdout + p.stderr)[-4000:]
    [summary] = [ln for ln in p.stdout.splitlines() if " cases tried, " in ln]
    tried, held = map(int, re.match(r"(\d+) cases tried, (\d+) held", summary).groups())
    assert tried == held and tried >= 80, summary
    # every cycle ran and matched the uninterrupted run
    assert sum(1 for ln in lines if re.search(r"cycles/(local|gcs)/\d", ln) and ln.split()[0] == "held") == 2, p.stdout
