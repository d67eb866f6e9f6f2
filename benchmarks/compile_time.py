"""Compile time of the training step with and without layer scanning.

    python benchmarks/compile_time.py --config=configs/paper.py:dense-142m-twin

Lowers and compiles the full train step (forward, backward, AdamW) from abstract shapes on
one device of this machine, so nothing is allocated; prints seconds per variant.
"""

import argparse
import json
import time

import jax

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/paper.py:dense-142m-twin")
    ap.add_argument("--micro_batch", type=int, default=1, help="rows per micro-batch (compile only)")
    args = ap.parse_args()
    out = {}
    for scan in (True, False):
        cfg = config.load(args.config)
        cfg.mesh.data = 1
        cfg.model.scan_layers = scan
        cfg.train.global_batch = cfg.train.micro_batch = args.micro_batch
        out["scan" if scan else "loop"] = round(compile_seconds(cfg), 1)
    out.update(config=args.config, layers=cfg.model.n_layers, backend=jax.default_backend())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
