"""Compile time of the training step with and without layer scanning.

    python benchmarks/compile_time.py --config=configs/paper.py:dense-142m-twin

Lowers and compiles the full train step (forward, backward, AdamW) from abstract shapes on
one device of this machine, so nothing is allocated; prints seconds per variant.
"""

import json
import sys
import time

import jax
from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import config
from onona_jax import train as trainer


def compile_seconds(cfg) -> float:
    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.abstract_train_state(run)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), jax.numpy.int32,
                                 sharding=run.batch_sharding)
    step = trainer.make_train_step(run)
    start = time.perf_counter()
    step.lower(state, batch).compile()
    return time.perf_counter() - start


def define(fv, argv):
    flags.DEFINE_integer("micro_batch", 1, "rows per micro-batch (compile only)", flag_values=fv)
    return config.define_flag(fv, argv, "configs/paper.py:dense-142m-twin")


def _main(fv, args):
    out = {}
    for scan in (True, False):
        cfg = fv.config.copy_and_resolve_references()
        cfg.mesh.data = 1
        cfg.model.scan_layers = scan
        cfg.train.global_batch = cfg.train.micro_batch = fv.micro_batch
        out["scan" if scan else "loop"] = round(compile_seconds(config.validate(cfg)), 1)
    out.update(config=fv.config.name, layers=cfg.model.n_layers, backend=jax.default_backend(),
               machine=common.record())
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__, json_stdout=True))
