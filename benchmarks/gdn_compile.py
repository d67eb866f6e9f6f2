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

--documents=K gives the layer `segments` (packed rows, issue 40): each row holds K documents of
uneven, random lengths, the recurrence and the conv restarting at each. With --time_rounds=N the
layer runs here instead of compiling for --topology: compiled for this machine's first device
(JAX_PLATFORMS picks it; cpu unless set) without segments and with --documents (8 if 0) per
row, then N paired rounds of forward + backward, the order alternating; prints each median and
the median over rounds of packed / plain:

    flock /tmp/onona-heavy.lock python benchmarks/gdn_compile.py --time_rounds=20 --batch=4 \
        --config.model.d_model=512 --config.model.gdn.n_heads=4 --config.model.dtype=float32
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


def packed_segments(batch: int, seq_len: int, documents: int, seed: int = 0):
    """segments [batch, seq_len] int32: each row `documents` documents of random, uneven lengths
    (distinct random cut points, a different layout per row)."""
    import numpy as np

    r = np.random.default_rng(seed)
    starts = np.zeros((batch, seq_len), np.int32)
    for row in starts:
        row[r.choice(np.arange(1, seq_len), min(documents, seq_len) - 1, replace=False)] = 1
    return np.cumsum(starts, axis=1, dtype=np.int32)


def _layer(cfg, device, batch: int, documents: int = 0, concrete: bool = False):
    """(jitted forward + backward of one GDN layer, its arguments): abstract on `device`, or with
    `concrete` initialised parameters and random inputs there; with `documents`, segments too."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from onona_jax import params as params_lib
    from onona_jax.models import gdn

    m = cfg.model
    graphdef, state = params_lib.abstract_state(lambda: gdn.GatedDeltaNet(m))
    sh = jax.sharding.SingleDeviceSharding(device)
    shape = (batch, cfg.data.seq_len)
    if concrete:
        params = jax.device_put(params_lib.init_params(state, 0), sh)
        x = jax.device_put(jax.random.normal(jax.random.key(1), (*shape, m.d_model), jnp.dtype(m.dtype)), sh)
        seg = jax.device_put(packed_segments(*shape, documents), sh) if documents else None
    else:
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)
        x = jax.ShapeDtypeStruct((*shape, m.d_model), jnp.dtype(m.dtype), sharding=sh)
        seg = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)

    def loss(p, x, seg=None):
        y = nnx.merge(graphdef, p)(x) if seg is None else nnx.merge(graphdef, p)(x, None, seg)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x) + ((seg,) if documents else ())


def _time(cfg, fv) -> dict:
    """The layer's forward + backward here, without and with segments, in paired rounds."""
    import statistics

    import jax

    device, documents = jax.devices()[0], fv.documents or 8
    arms, compile_s = {}, {}
    for name, docs in (("plain", 0), ("packed", documents)):
        fn, args = _layer(cfg, device, fv.batch, docs, concrete=True)
        start = time.perf_counter()
        fn = fn.lower(*args).compile()
        compile_s[name] = round(time.perf_counter() - start, 1)
        jax.block_until_ready(fn(*args))  # warm-up
        arms[name] = (fn, args)
    ms = {name: [] for name in arms}
    for r in range(fv.time_rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            fn, args = arms[name]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ms[name].append((time.perf_counter() - start) * 1e3)
    ratios = [p / q for p, q in zip(ms["packed"], ms["plain"])]
    return {"documents": documents, "device": str(device), "compile_s": compile_s, "rounds": fv.time_rounds,
            **{f"{name}_ms_median": round(statistics.median(t), 2) for name, t in ms.items()},
            "packed_over_plain_median": round(statistics.median(ratios), 4),
            "packed_over_plain_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)]
            if len(ratios) > 1 else None}


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
    flags.DEFINE_integer("documents", 0, "the one-layer form with segments: documents per row (0: none)",
                         flag_values=fv)
    flags.DEFINE_integer("time_rounds", 0, "> 0: time the layer here, without and with segments (--documents, "
                         "8 if 0), this many paired rounds; nothing compiled for --topology", flag_values=fv)
    from onona_jax import config

    return config.define_flag(fv, argv, "configs/paper.py:gdn-142m-twin")


def _main(fv, args):
    from onona_jax import cli, config, models
    from onona_jax.aot.topology import get_slice, topology_devices

    cfg = config.validate(fv.config)
    if fv.time_rounds > 0:
        if fv.step:
            raise cli.UsageError("--time_rounds times one layer: drop --step")
        what = f"one GDN layer fwd+bwd here, {fv.batch} rows of {cfg.data.seq_len}"
        print(json.dumps({"config": cfg.name, "what": what, "gdn_precision": cfg.model.gdn.precision,
                          "d_model": cfg.model.d_model, "gdn": cfg.model.gdn.to_dict(), "dtype": cfg.model.dtype,
                          **_time(cfg, fv), "machine": common.record()}))
        return
    s = get_slice(fv.topology)
    devices = topology_devices(s)
    fn, fargs = _step(cfg, devices) if fv.step else _layer(cfg, devices[0], fv.batch, fv.documents)
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    compiled = fn.lower(*fargs).compile()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes)
    print(json.dumps({
        "config": cfg.name, "what": "train step" if fv.step else f"one GDN layer fwd+bwd, {fv.batch} rows"
        + (f", {fv.documents} documents each" if fv.documents else ""),
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
