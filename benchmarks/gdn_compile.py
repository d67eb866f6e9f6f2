"""What the GDN recurrence's matmul precision costs the TPU compiler: one Gated DeltaNet layer's
forward + backward (or, with --step, the whole train step as `python -m onona_jax.aot` builds
it), compiled deviceless for a TPU topology with libtpu (pip install -e '.[tpu-aot]').

    python benchmarks/gdn_compile.py --config=configs/paper.py:gdn-142m-twin \
        --config.model.gdn.precision=highest [--step --config.train.micro_batch=16 \
        --config.model.remat=attention --config.mesh.data=1 --config.mesh.fsdp=-1]

Prints one JSON line: compile seconds (wall, and the process's CPU seconds), XLA's buffer assignment (temporaries, total) per device,
and the dots of the optimized HLO: how many, and how many at HIGHEST (`operand_precision=
{highest,...}`: multi-pass fp32 emulation on the matrix unit). The layer form compiles on one
device of the topology with --batch rows of data.seq_len tokens (the rows a chip holds at
micro-batch 16 under FSDP); compile with `flock /tmp/onona-heavy.lock` on a shared host.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from absl import flags

import common  # benchmarks/common.py, beside this script

_DOT = re.compile(r"=\s*\S+\s+(dot|convolution)\(")


def dot_precisions(hlo: str) -> dict:
    """{"dots": n, "highest": m}: dot and convolution instructions of an HLO text, and those
    whose operands run at HIGHEST."""
    lines = [line for line in hlo.splitlines() if _DOT.search(line)]
    return {"dots": len(lines), "highest": sum("operand_precision={highest" in line for line in lines)}


def _layer(cfg, device, batch: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from onona_jax import params as params_lib
    from onona_jax.models import gdn

    m = cfg.model
    graphdef, state = params_lib.abstract_state(lambda: gdn.GatedDeltaNet(m))
    sh = jax.sharding.SingleDeviceSharding(device)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)
    x = jax.ShapeDtypeStruct((batch, cfg.data.seq_len, m.d_model), jnp.dtype(m.dtype), sharding=sh)

    def loss(p, x):
        y = nnx.merge(graphdef, p)(x)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def _step(cfg, devices):
    import jax
    import numpy as np

    from onona_jax import train as trainer

    run = trainer.setup(cfg, devices=devices)
    state = trainer.abstract_train_state(run)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32,
                                 sharding=run.batch_sharding)
    return trainer.make_train_step(run), (state, batch)


def define(fv, argv):
    flags.DEFINE_string("topology", "v5e-16", "TPU slice (onona_jax.aot's names)", flag_values=fv)
    flags.DEFINE_bool("step", False, "compile the whole train step, not one layer", flag_values=fv)
    flags.DEFINE_integer("batch", 16, "rows of the one-layer compile", flag_values=fv)
    from onona_jax import config

    return config.define_flag(fv, argv, "configs/paper.py:gdn-142m-twin")


def _main(fv, args):
    from onona_jax import config, models
    from onona_jax.aot.topology import get_slice, topology_devices

    cfg = config.validate(fv.config)
    s = get_slice(fv.topology)
    devices = topology_devices(s)
    fn, fargs = _step(cfg, devices) if fv.step else _layer(cfg, devices[0], fv.batch)
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    compiled = fn.lower(*fargs).compile()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes)
    print(json.dumps({
        "config": cfg.name, "what": "train step" if fv.step else f"one GDN layer fwd+bwd, {fv.batch} rows",
        "topology": s.name, "gdn_precision": cfg.model.gdn.precision if "gdn" in models.layer_pattern(cfg.model) else None, "compile_s": round(seconds, 1),
        # CPU seconds of this process (all compiler threads): less swayed than wall seconds by
        # other jobs on a shared host; the 1-minute load average before and after
        "compile_cpu_s": round(cpu, 1), "load": [round(load, 2), round(os.getloadavg()[0], 2)],
        "temporaries_mib": round(mem.temp_size_in_bytes / 2**20, 1), "total_mib": round(total / 2**20, 1),
        **dot_precisions(compiled.as_text()), "machine": common.record(),
    }))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: libtpu serves the topology
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    sys.exit(common.run(define, _main, None, __doc__, json_stdout=True))
