"""Grouped (ragged_dot), dense (one-hot einsum) and sort (gather) MoE dispatch: one MoE layer's jitted forward and
forward+backward on this machine, fp32, at the tiny/small configs' training shapes and at
142M widths with a short sequence. Prints JSON (milliseconds, min and median of --reps).

    python benchmarks/bench_moe.py [--reps 10] [--shapes tiny,small,142m,142m-T512]
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

import common  # benchmarks/common.py, beside this script
from onona_jax import config
from onona_jax.models import moe
from onona_jax.params import abstract_state, init_params

# name -> (config, batch, seq)
SHAPES = {
    "tiny": ("moe-tiny-twin", 8, 32),
    "small": ("moe-small-twin", 8, 128),
    "142m": ("moe-142m-twin", 2, 128),
    "142m-T512": ("moe-142m-twin", 1, 512),
}


def build(name, dispatch):
    """(forward, forward+backward, params, x) jitted for one shape and dispatch."""
    spec, B, T = SHAPES[name]
    m = config.load(f"configs/paper.py:{spec}").model
    m.moe.dispatch = dispatch
    graphdef, state = abstract_state(lambda: moe.MoE(m))
    params = init_params(state, 0)
    x = jax.random.normal(jax.random.key(1), (B, T, m.d_model), jnp.float32)

    def loss(p, x):
        y, aux = nnx.merge(graphdef, p)(x)
        return jnp.mean(jnp.square(y)) + moe.load_balancing_loss(aux, m.moe.n_experts)

    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    C = moe.capacity(T, m.moe.n_experts, m.moe.top_k, m.moe.capacity_factor)
    shape = dict(B=B, T=T, d=m.d_model, f=m.moe.d_expert, E=m.moe.n_experts, k=m.moe.top_k, C=C)
    return shape, {"forward": fwd, "fwd_bwd": step}, (params, x)


def bench(name, reps):
    """Both dispatches compiled first, then timed in alternation, so load from other
    processes on a shared machine hits both alike; the minimum is the least disturbed run."""
    built = {d: build(name, d) for d in moe.DISPATCH}
    times = {(d, k): [] for d in built for k in ("forward", "fwd_bwd")}
    compile_ms = {}
    for d, (_, fns, args) in built.items():
        t0 = time.perf_counter()
        for fn in fns.values():
            jax.block_until_ready(fn(*args))
        compile_ms[d] = round((time.perf_counter() - t0) * 1e3)
    for _ in range(reps):
        for d, (_, fns, args) in built.items():
            for k, fn in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[(d, k)].append((time.perf_counter() - t0) * 1e3)
    res = {"shape": built["sort"][0]}
    for d in built:
        res[d] = {f"{k}_ms_{stat}": round(float(f(times[(d, k)])), 2)
                  for k in ("forward", "fwd_bwd") for stat, f in (("min", np.min), ("median", np.median))}
        res[d]["compile_ms"] = compile_ms[d]
    res["faster_fwd_bwd"] = min(built, key=lambda d: res[d]["fwd_bwd_ms_min"])
    return res


def define(fv, argv):
    flags.DEFINE_integer("reps", 10, "timed repetitions per dispatch", flag_values=fv)
    flags.DEFINE_list("shapes", list(SHAPES), "shapes to time", flag_values=fv)


def _main(fv, args):
    out = {"backend": jax.default_backend(), "devices": jax.device_count(), "results": {}}
    for name in fv.shapes:
        res = out["results"][name] = bench(name, fv.reps)
        common.log(json.dumps({name: res}))  # progress; stdout holds the one JSON of all
    out["machine"] = common.record()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__, json_stdout=True))
