"""A fingerprint of the train step a slice would run: the sha256 of its lowered program (StableHLO,
deviceless, no compile), per config. Two checkouts that print the same hashes compile the same
program, so its HBM and FLOPs (`python -m onona_jax.aot`) are equal too; a CPU-only change
(loss.resolve_token_tile, attention's query blocks) must leave them unchanged:

    PYTHONPATH=/tmp/base python benchmarks/program_hash.py --root=/tmp/base   # before
    python benchmarks/program_hash.py                                          # after
    [--slice=v5e-16] [--configs=dense-142m-twin,dense-142m-standard,gdn-142m-twin] [--micro_batch=4]

The mesh is `--slice`'s devices on the fsdp axis, `--micro_batch` sequences per device. A GPU slice
(h100-8, ...) needs the CUDA plugin (`pip install -e '.[gpu-aot]'`).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define(fv, argv):
    flags.DEFINE_string("root", ROOT, "the checkout whose configs/paper.py to read", flag_values=fv)
    flags.DEFINE_string("slice", "v5e-16", "the slice (python -m onona_jax.aot's names)", flag_values=fv)
    flags.DEFINE_list("configs", ["dense-142m-twin", "dense-142m-standard", "gdn-142m-twin"], "configs/paper.py names",
                      flag_values=fv)
    flags.DEFINE_integer("micro_batch", 4, "sequences per device", flag_values=fv)


def _main(fv, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    import jax

    from onona_jax import config as config_lib, train as trainer
    from onona_jax.aot.topology import compiler_missing, get_slice, topology_devices

    s = get_slice(fv.slice)
    missing = compiler_missing(s)
    if missing:
        raise cli.Failure(missing)
    devices = topology_devices(s)
    for name in fv.configs:
        cfg = config_lib.load(os.path.join(fv.root, f"configs/paper.py:{name}"))
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, len(devices), 1, 1
        cfg.train.micro_batch = fv.micro_batch
        run = trainer.setup(cfg, devices)
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), jax.numpy.int32,
                                     sharding=run.batch_sharding)
        text = trainer.make_train_step(run).lower(trainer.abstract_train_state(run), batch).as_text()
        # jax's custom partitioning (cuDNN attention) names its Python callback by object id,
        # which differs per process: not part of the program.
        text = re.sub(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"', r'\1"id"', text)
        print(f"{name} on {fv.slice}: sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(text):,} characters)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    common.cpu_only()  # the host compiles for the slice; no device is used
    sys.exit(main())
