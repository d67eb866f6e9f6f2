"""`python benchmarks/bench.py --what=moe`: MoE dispatch, sorted against ragged_dot, at a few
shapes (bench.py's docstring)."""

from __future__ import annotations

import json
import time

import numpy as np

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli


# name -> (config, batch, seq)
MOE_SHAPES = {
    "tiny": ("moe-tiny-twin", 8, 32),
    "small": ("moe-small-twin", 8, 128),
    "142m": ("moe-142m-twin", 2, 128),
    "142m-T512": ("moe-142m-twin", 1, 512),
}


def moe_build(name, dispatch):
    """(shape, {"forward", "fwd_bwd"} jitted, (params, x)) of one MoE layer at one shape and dispatch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from onona_jax import config as config_lib
    from onona_jax.models import moe
    from onona_jax.params import abstract_state, init_params

    spec, B, T = MOE_SHAPES[name]
    m = config_lib.load(f"{common.CONFIGS}:{spec}").model
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


def bench_moe(name, reps):
    """Every dispatch compiled first, then timed in alternation, so load from other processes
    on a shared machine hits them alike; the minimum is the least disturbed run."""
    import jax

    from onona_jax.models import moe

    built = {d: moe_build(name, d) for d in moe.DISPATCH}
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


def define_moe(fv, argv):
    flags.DEFINE_integer("reps", 10, "timed repetitions per dispatch", flag_values=fv)
    flags.DEFINE_list("shapes", list(MOE_SHAPES), "shapes to time", flag_values=fv)


def main_moe(fv, rest, argv):
    import jax

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if set(fv.shapes) - set(MOE_SHAPES) or fv.reps < 1:
        raise cli.UsageError(f"--shapes={','.join(fv.shapes)}: choose from {', '.join(MOE_SHAPES)}; --reps ≥ 1")
    out = {"backend": jax.default_backend(), "devices": jax.device_count(), "results": {}}
    for name in fv.shapes:
        res = out["results"][name] = bench_moe(name, fv.reps)
        common.log(json.dumps({name: res}))  # progress; stdout holds the one JSON of all
    out["machine"] = common.record()
    print(json.dumps(out, indent=2))
