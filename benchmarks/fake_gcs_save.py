"""Checkpoint save and restore time on local disk vs the fake GCS of the tests (tests/fake_gcs.py).

    python benchmarks/fake_gcs_save.py [--rounds=5]

The tiny model's train state (random values, sharded over 8 fake CPU devices, mesh 2×2×2) is
saved and restored with `onona_jax.checkpoint.Checkpoints`, alternately to a local directory
and to gs://<bucket> on the emulator (round-robin, so machine load hits both alike); prints the
median seconds of each. Says whether the fake adds stalls of its own (it added 1 s per upload
over 1 MB and 40 ms per request before it spoke HTTP/1.1 with TCP_NODELAY).
"""

import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from absl import flags  # noqa: E402

import fake_gcs  # noqa: E402
from conftest import tiny_config  # noqa: E402
import common  # noqa: E402 - benchmarks/common.py, beside this script
from onona_jax import cli  # noqa: E402
from onona_jax import train as trainer  # noqa: E402
from onona_jax.checkpoint import Checkpoints  # noqa: E402


def define(fv, argv):
    flags.DEFINE_integer("rounds", 5, "timed rounds (after one untimed)", flag_values=fv)


def _main(args, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if args.rounds < 1:
        raise cli.UsageError(f"--rounds={args.rounds}: give at least 1")
    server = fake_gcs.start()
    bucket = server.new_bucket()
    cfg = tiny_config("/nonexistent")  # only the model and mesh are used: no data is read
    cfg.mesh.update(data=2, fsdp=2, tensor=2)
    run = trainer.setup(cfg, jax.devices()[:8])
    abstract = trainer.abstract_train_state(run)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding), abstract)
    local = tempfile.mkdtemp()
    times = {"local": ([], []), "fake gcs": ([], [])}
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        for name, root in (("local", f"{local}/r{r}"), ("fake gcs", f"gs://{bucket}/r{r}")):
            t = time.perf_counter()
            ckpts = Checkpoints(root)
            ckpts.save(1, state, {"round": r}, cfg.to_json())
            ckpts.wait()
            saved = time.perf_counter() - t
            t = time.perf_counter()
            Checkpoints(root, read_only=True).restore(1, abstract)
            restored = time.perf_counter() - t
            if r:
                times[name][0].append(saved)
                times[name][1].append(restored)
    for name, (save, restore) in times.items():
        print(f"{name:9s} save {statistics.median(save):.2f} s  restore {statistics.median(restore):.2f} s  "
              f"(median of {args.rounds})")
    server.stop()


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__))
