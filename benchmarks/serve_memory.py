"""Peak memory of `Server.from_workdir` against the parameters' bytes (issue 11: ≤ 1.2 ×).

    python benchmarks/serve_memory.py --config=configs/paper.py:dense-142m-twin [--workdir=DIR]

Without --workdir it writes a checkpoint of a freshly initialised model (parameters, AdamW
moments and step, as train.py saves them) into a temporary directory. Then, in a fresh
process, it measures the resident memory after jax and Orbax are loaded (the baseline),
restores a server
with `Server.from_workdir` (parameters only, the head folded before the trunk is read), and
reads the process's peak resident memory (VmHWM). On CPU the device memory is this memory.
Reported: peak − baseline, what the server holds afterwards, and both over the parameter
bytes (fp32, as trained).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli
from onona_jax import config as config_lib

PROBE = r"""
import json, sys
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import jax, jax.numpy as jnp
import onona_jax.checkpoint  # code (Orbax, TensorStore) loaded before the baseline
from onona_jax.serve.server import Server
jnp.zeros(8).block_until_ready()
base = rss("VmRSS:")
server = Server.from_workdir(sys.argv[1])
held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(server.tables))
print(json.dumps({"baseline": base, "peak": rss("VmHWM:"), "after": rss("VmRSS:"), "held": held}))
"""


def write_checkpoint(cfg, workdir: str) -> int:
    """A step-1 checkpoint of a fresh model, as train.py writes it; returns parameter bytes."""
    import jax

    from onona_jax import train
    from onona_jax.checkpoint import Checkpoints

    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, 1, 1, 1
    run = train.setup(cfg, jax.devices()[:1])
    state = train.init_state(run, cfg.seed)
    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"))
    ckpts.save(1, state, {}, cfg.to_json())
    ckpts.wait()
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "a run to restore (default: a fresh checkpoint in a temp dir)",
                        flag_values=fv)
    flags.DEFINE_string("output", None, "also write the figures as JSON here", flag_values=fv)
    return config_lib.define_flag(fv, argv, "configs/paper.py:dense-142m-twin")


def _main(fv, args):
    cfg = fv.config
    with tempfile.TemporaryDirectory() as tmp:
        workdir = fv.workdir or tmp
        if fv.workdir is None:
            param_bytes = write_checkpoint(cfg, workdir)
        else:
            from onona_jax import summary

            param_bytes = 4 * summary.param_counts(cfg.model)["total"]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", PROBE, workdir], capture_output=True, text=True, env=env)
        if out.returncode:
            raise cli.Failure(f"the probe failed:\n{out.stderr[-2000:]}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2.0 ** 30
    res = dict(config=cfg.name, param_bytes=param_bytes, **m,
               peak_over_params=(m["peak"] - m["baseline"]) / param_bytes,
               held_over_params=m["held"] / param_bytes, machine=common.record())
    print(f"{cfg.name}: parameters {param_bytes / gib:.3f} GiB (fp32)")
    print(f"  peak − baseline during Server.from_workdir: {(m['peak'] - m['baseline']) / gib:.3f} GiB "
          f"= {res['peak_over_params']:.3f} × the parameters (target ≤ 1.2)")
    print(f"  held by the server afterwards: {m['held'] / gib:.3f} GiB = {res['held_over_params']:.3f} ×")
    if fv.output:
        with open(fv.output, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__))
