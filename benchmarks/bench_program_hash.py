"""`python benchmarks/bench.py --what=program_hash`: the sha256 of the lowered train step a slice
would run, per config (bench.py's docstring)."""

from __future__ import annotations

import os

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli


def define_program_hash(fv, argv):
    common.cpu_only()  # the host compiles for the slice; no device is used (jax is not imported yet)
    flags.DEFINE_string("root", str(common.REPO), "the checkout whose configs/paper.py to read", flag_values=fv)
    flags.DEFINE_string("slice", "v5e-16", "the slice (python -m onona_jax.aot's names)", flag_values=fv)
    flags.DEFINE_list("configs", ["dense-142m-twin", "dense-142m-standard", "gdn-142m-twin"], "configs/paper.py names",
                      flag_values=fv)
    flags.DEFINE_integer("micro_batch", 4, "sequences per device", flag_values=fv)


def main_program_hash(fv, rest, argv):
    import hashlib
    import re

    import jax

    from onona_jax import config as config_lib
    from onona_jax import train as trainer
    from onona_jax.aot.topology import compiler_missing, get_slice, topology_devices

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
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
