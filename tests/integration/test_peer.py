"""benchmarks/peer.py's starting point: onona-jax's train step (benchmarks/common.py) and the
paper's PyTorch code path (HF Qwen3 + the tied softmax or Figure 2's TwinTables, torch AdamW) from
the same weights and batch give the same losses; the workers' allocator setting works; the
benchmarks' command line is the package's. The timing itself is the benchmarks', not a test's."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the scripts import common.py from beside them
import common  # noqa: E402
import peer  # noqa: E402

STEPS = 3


# standard is slow for suite-time margin (its head is plain Qwen3: test_parity_torch covers it)
@pytest.mark.parametrize("head", [pytest.param("standard", marks=pytest.mark.slow), "twin"])
def test_first_steps_match_pytorch_peer(head):
    # dense-tiny at batch 4 × 32; warmup 1: the first update is
    # at the peak lr, so the second and third losses check the AdamW mapping (lr, weight decay
    # on exactly our decayed parameters, clip, betas) and not only the forward pass.
    overrides = {"train.warmup_steps": 1, "train.global_batch": 4}
    cfg = common.jax_config(os.path.join(REPO, "configs", "paper.py") + ":dense-tiny-twin", overrides, head)
    tokens = np.random.default_rng(0).integers(0, 50257, (4, cfg.data.seq_len + 1), dtype=np.int32)
    params, decays, n_params, jax_step = common.jax_side(cfg)
    ours = [jax_step(tokens if i == 0 else None)[0] for i in range(STEPS)]

    lrs = peer.schedule_values(cfg, STEPS)
    assert lrs[0] == pytest.approx(cfg.train.lr)  # a real update from the first step on
    n_torch, torch_step = peer.torch_side("torch_eager", head, cfg.model.to_dict(), cfg.train.to_dict(),
                                          params, decays, lrs)
    theirs = [torch_step(tokens if i == 0 else None)[0] for i in range(STEPS)]

    assert n_torch == n_params == sum(x.size for x in jax.tree.leaves(params))
    # Matrices decay, norm weights and the gate do not (optimizer.decay_mask), by HF name.
    assert decays["model.layers.0.mlp.up_proj.weight"] and not decays["model.norm.weight"]
    if head == "twin":
        assert decays["twin.A"] and not decays["twin.gate.weight"]
    # First step: the forward alone, fp32 on both sides (peer.LOSS_RTOL says why 1e-5).
    np.testing.assert_allclose(theirs[0], ours[0], rtol=peer.LOSS_RTOL)
    # Later steps also pass through one or two AdamW updates; measured agreement ~1e-7.
    np.testing.assert_allclose(theirs[1:], ours[1:], rtol=1e-5)
    assert ours[2] < ours[0] - 0.01  # the updates are real: the loss moved


def test_unknown_config_key_is_refused():
    # update_from_flattened_dict would add a misspelt key silently, and the benchmark would
    # measure the config it was not asked for.
    from onona_jax import cli

    with pytest.raises(cli.UsageError, match="unknown config keys model.d_modle"):
        common.jax_config(os.path.join(REPO, "configs", "paper.py") + ":dense-tiny-twin", {"model.d_modle": 64}, "twin")


PROBE = r"""
import ctypes, json, resource, sys
sys.path.insert(0, sys.argv[2])
import common
if sys.argv[1] == "keep":
    assert common.keep_freed_memory()
import jax, jax.numpy as jnp
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = ctypes.c_void_p
# ~0.13 GB of temporaries a run (exp(x) and the product), freed after it
f = jax.jit(lambda x, w: jnp.sin(jnp.exp(x) @ w).sum())
x, w = jnp.full((8192, 2048), 1e-3, jnp.float32), jnp.ones((2048, 2048), jnp.float32)
f(x, w).block_until_ready()
runs = []  # (minor faults, pages the heap grew by) of each run
for _ in range(15):
    faults, brk = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, libc.sbrk(0)
    f(x, w).block_until_ready()
    runs.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, (libc.sbrk(0) - brk) // 4096))
print(json.dumps(runs))
"""


def _runs(mode):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", PROBE, mode, os.path.join(REPO, "benchmarks")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.slow  # suite-time margin: a benchmark option (peer.py --keep_freed_memory)
def test_kept_memory_stops_per_run_page_faults():
    # common.keep_freed_memory, which peer.py's workers call with --keep_freed_memory: XLA:CPU's
    # per-run temporaries stop being mapped afresh (and faulted in page by page) at every run. With it a run
    # faults in only the pages its heap newly grows by: the heap grows in steps of the
    # run's temporaries (128 MiB here) until its free holes fit every run's layout, at a random run
    # (XLA's threads decide the order of allocations), and then stays. That growth is the
    # peak-RSS price the docstring states; the runs whose heap did not grow
    # must fault (next to) nothing.
    slack = 4096  # pages (16 MiB): Python's and XLA's own small allocations, seen up to ~3,600
    default = _runs("default")
    assert all(faults - grew > 20_000 for faults, grew in default), default  # ~32,768: 0.13 GB, 4 KiB pages
    kept = _runs("keep")
    assert all(faults - grew < slack for faults, grew in kept), kept
    settled = [faults for faults, grew in kept if grew == 0]
    assert settled and max(settled) < 1_000, kept
