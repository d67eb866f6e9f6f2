"""`python benchmarks/bench.py --what=compile`: the train step's compile time, scanned and unrolled
(bench.py's docstring)."""

from __future__ import annotations

import json

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli
from bench_families import compile_seconds


def define_compile(fv, argv):
    from onona_jax import config as config_lib

    flags.DEFINE_integer("micro_batch", 1, "rows per micro-batch (compile only)", flag_values=fv)
    return config_lib.define_flag(fv, argv, f"{common.CONFIGS}:dense-142m-twin")


def main_compile(fv, rest, argv):
    import jax

    from onona_jax import config as config_lib

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    out = {}
    for scan in (True, False):
        cfg = fv.config.copy_and_resolve_references()
        cfg.mesh.data = 1
        cfg.model.scan_layers = scan
        cfg.train.global_batch = cfg.train.micro_batch = fv.micro_batch
        out["scan" if scan else "loop"] = round(compile_seconds(config_lib.validate(cfg)), 1)
    out.update(config=fv.config.name, layers=cfg.model.n_layers, backend=jax.default_backend(),
               machine=common.record())
    print(json.dumps(out))
