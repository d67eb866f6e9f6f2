"""A train step's matrix multiplies alone, XLA:CPU against PyTorch's, at the same shapes: how
much of the peer gap (docs/PERFORMANCE.md) is the GEMM library rather than our code.

    flock /tmp/onona-heavy.lock python benchmarks/gemm_floor.py --config=configs/paper.py:dense-small-standard \
        --config.model.d_model=512 --config.model.n_layers=8 --config.model.n_heads=8 --config.model.n_kv_heads=4 \
        --config.model.head_dim=64 --config.model.d_ff=1408 --config.train.global_batch=4 --config.data.seq_len=256

Lists the GEMMs of one train step of the dense model: per layer, the forward, ∂x and ∂W of
the seven projections; per vocabulary table, the logits, ∂h and ∂table, over the fused loss's
token tiles for onona-jax (`model.loss_token_tile`) and over the whole batch for PyTorch (its
cross-entropy computes them so). Each framework runs in its own process (both keep freed
memory, `common.keep_freed_memory`) and times each GEMM alone, in its own layout (ours: weights
[in, out], tables [V, d], `jnp.einsum` under `jit`; PyTorch's: `Linear` weights [out, in],
`x @ W.T`, `dy @ W`, `dy.T @ x`), one call per GEMM a round, the two processes taking turns
for `--rounds` rounds; a GEMM's time is its median over rounds. The attention core (Q·Kᵀ,
P·V and their gradients: 4% of the FLOPs at d 512) is left out.

With `--step_rounds` > 0 it then runs `peer.measure` (onona-jax and torch.compile, paired
rounds, freed memory kept as for the GEMMs) and prints each side's step time less its GEMMs:
the time outside matrix multiplies.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import sys
import time

from absl import flags

import common  # benchmarks/common.py, beside this script
import peer  # its measure: the whole step against torch.compile
from onona_jax import cli

common.cpu_only()  # the PyTorch side runs on the CPU
DEFAULT_CONFIG = f"{common.CONFIGS}:dense-small-standard"
OPS = ("forward", "∂x", "∂W")


def gemms(cfg, head: str) -> list[dict]:
    """Every GEMM of one train step: {name, tokens t, in i, out o, op, count, layout per side}."""
    from onona_jax import loss as loss_lib

    m = cfg.model
    n = cfg.train.global_batch * cfg.data.seq_len
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    out = []
    for name, i, o, per_layer in (("q", m.d_model, q, 1), ("k, v", m.d_model, kv, 2), ("o", q, m.d_model, 1),
                                  ("gate, up", m.d_model, m.d_ff, 2), ("down", m.d_ff, m.d_model, 1)):
        for op in OPS:
            out.append(dict(name=f"{name} {op}", i=i, o=o, op=op, jax=(n, per_layer * m.n_layers, "io"),
                            torch=(n, per_layer * m.n_layers)))
    tables = 2 if head == "twin" else 1
    tile = min(loss_lib.resolve_token_tile(m.loss_token_tile), n) if m.loss == "fused" else n  # this CPU's tile
    for op, label in zip(OPS, ("logits", "∂h", "∂table")):
        out.append(dict(name=f"head {label}", i=m.d_model, o=m.vocab_size, op=op,
                        jax=(tile, tables * math.ceil(n / tile), "oi"), torch=(n, tables)))
    return out


def _operands(g, t, layout):
    """(einsum equation, a's shape, b's shape) of GEMM `g` over t tokens, weights in `layout`:
    "io" ([in, out]) or "oi" ([out, in]); the letters are the equation's."""
    i, o = g["i"], g["o"]
    w = (i, o) if layout == "io" else (o, i)
    if g["op"] == "forward":
        return f"ti,{layout}->to", (t, i), w
    if g["op"] == "∂x":
        return f"to,{layout}->ti", (t, o), w
    return ("ti,to->io", (t, i), (t, o)) if layout == "io" else ("to,ti->oi", (t, o), (t, i))


def _jax_fns(specs):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    fns = []
    for g in specs:
        eq, sa, sb = _operands(g, g["jax"][0], g["jax"][2])
        a, b = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in (sa, sb))
        f = jax.jit(lambda a, b, eq=eq: jnp.einsum(eq, a, b))
        fns.append(lambda f=f, a=a, b=b: f(a, b).block_until_ready())
    return fns


def _torch_fns(specs):
    import torch

    torch.manual_seed(0)
    fns = []
    for g in specs:  # what autograd runs for a Linear (and the tied table, [V, d])
        t = g["torch"][0]
        W, x, dy = torch.randn(g["o"], g["i"]), torch.randn(t, g["i"]), torch.randn(t, g["o"])
        fns.append({"forward": lambda x=x, W=W: x @ W.T, "∂x": lambda dy=dy, W=W: dy @ W,
                    "∂W": lambda dy=dy, x=x: dy.T @ x}[g["op"]])
    return fns


def _worker(conn, side, specs, threads):
    """`common.Worker`'s protocol: ready, then each "step" times every GEMM once."""
    try:
        common.keep_freed_memory()  # no GEMM pays page faults for its output
        if side == "torch":
            import torch

            torch.set_num_threads(threads)
        fns = _jax_fns(specs) if side == "jax" else _torch_fns(specs)
        for f in fns:  # compile / warm up
            f()
        conn.send({"ok": True})
        while conn.recv() == "step":
            times = []
            for f in fns:
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            conn.send(times)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which fails with it
        conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})
    finally:
        conn.close()


def together(cfg, head, rounds, calls, log) -> dict:
    """The other harness (issue 30's): both frameworks in THIS process, sharing its threads and
    its heap (glibc's defaults: no kept memory), each GEMM timed as `calls` back-to-back calls
    per framework per round, the frameworks alternating within a round; per GEMM, the median
    over rounds of the per-call time and of the round's JAX/torch ratio."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    specs = gemms(cfg, head)
    fns = {"jax": _jax_fns(specs), "torch": _torch_fns(specs)}
    for side in fns:
        for f in fns[side]:
            f()
    rows = []
    for k, g in enumerate(specs):
        per = {"jax": [], "torch": []}
        for r in range(rounds):
            for side in (("jax", "torch") if r % 2 == 0 else ("torch", "jax")):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fns[side][k]()
                per[side].append((time.perf_counter() - t0) / calls)
        row = dict(g)
        for side in per:
            row[f"{side}_s"] = statistics.median(per[side])
            row[f"{side}_total_s"] = row[f"{side}_s"] * g[side][1]
            row[f"{side}_gflops"] = 2 * g[side][0] * g["i"] * g["o"] / row[f"{side}_s"] / 1e9
        row["paired_ratio"] = statistics.median(j / t for j, t in zip(per["jax"], per["torch"]))
        rows.append(row)
        log(f"  {g['name']}: jax {row['jax_s'] * 1e3:.2f} ms, torch {row['torch_s'] * 1e3:.2f} ms, "
            f"paired {row['paired_ratio']:.2f}")
    return {"rows": rows, "jax_total_s": sum(r["jax_total_s"] for r in rows),
            "torch_total_s": sum(r["torch_total_s"] for r in rows), "threads": len(os.sched_getaffinity(0))}


def measure(cfg, head, rounds, log) -> dict:
    specs = gemms(cfg, head)
    threads = len(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    workers = [common.Worker(ctx, side, _worker, (side, specs, threads)) for side in ("jax", "torch")]
    try:
        for w in workers:
            w.ready()
        times = common.paired_rounds(workers, rounds, log,  # logs each side's GEMMs of one step
                                   lambda side, ts: sum(s * g[side][1] for s, g in zip(ts, specs)))
    finally:
        for w in workers:
            w.stop()
    rows = []
    for k, g in enumerate(specs):
        row = dict(g)
        for side in ("jax", "torch"):
            t, count = g[side][:2]
            med = statistics.median(ts[k] for ts in times[side])
            row[f"{side}_s"], row[f"{side}_total_s"] = med, med * count
            row[f"{side}_gflops"] = 2 * t * g["i"] * g["o"] / med / 1e9
        rows.append(row)
    return {"rows": rows, "jax_total_s": sum(r["jax_total_s"] for r in rows),
            "torch_total_s": sum(r["torch_total_s"] for r in rows), "threads": threads}


def format_result(res) -> str:
    lines = [f"  {'GEMM':<18}{'ours t×i×o':>20}{'×':>4}{'ms':>8}{'GFLOP/s':>9}   "
             f"{'torch t×i×o':>20}{'×':>4}{'ms':>8}{'GFLOP/s':>9}"]
    for r in res["rows"]:
        (jt, jc, _), (tt, tc) = r["jax"], r["torch"]
        ours, theirs = f"{jt}×{r['i']}×{r['o']}", f"{tt}×{r['i']}×{r['o']}"
        lines.append(f"  {r['name']:<18}{ours:>20}{jc:>4}{r['jax_s'] * 1e3:>8.1f}{r['jax_gflops']:>9.0f}   "
                     f"{theirs:>20}{tc:>4}{r['torch_s'] * 1e3:>8.1f}{r['torch_gflops']:>9.0f}")
    lines.append(f"  GEMMs of one step: onona-jax (XLA:CPU) {res['jax_total_s']:.3f} s, PyTorch "
                 f"{res['torch_total_s']:.3f} s: {res['jax_total_s'] / res['torch_total_s']:.3f} ×")
    return "\n".join(lines)


def define(fv, argv):
    from onona_jax import config as config_lib

    common.refuse_set(argv)
    flags.DEFINE_integer("rounds", 9, "rounds of every GEMM on each side", flag_values=fv)
    flags.DEFINE_enum("harness", "apart", ["apart", "together", "both"],
                      "apart: each framework in its own process keeping freed memory, one call per GEMM a round "
                      "(the default); together: both in this process, --calls calls per GEMM a round, alternating; "
                      "both: the two, one after the other", flag_values=fv)
    flags.DEFINE_integer("calls", 5, "calls per GEMM per round of --harness=together", flag_values=fv)
    flags.DEFINE_integer("step_rounds", 0, "also time the whole step (peer.measure) over this many paired rounds",
                         flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def _main(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.rounds < 1 or fv.step_rounds < 0:
        raise cli.UsageError("--rounds must be ≥ 1 and --step_rounds ≥ 0")
    spec, overrides = common.config_args(fv, argv, DEFAULT_CONFIG)
    cfg = common.jax_config(spec, overrides)
    head = cfg.model.head
    if cfg.model.arch != "dense" or head not in peer.HEADS:
        raise cli.UsageError(f"model.arch={cfg.model.arch!r}, model.head={head!r}: the GEMM list is the dense "
                             f"Qwen3 body's under the {' or '.join(peer.HEADS)} head")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # the workers inherit it: idle torch threads sleep
    if fv.harness in ("apart", "both"):
        res = measure(cfg, head, fv.rounds, common.log)
        print(f"GEMMs of a {head} train step, apart (a process each, freed memory kept), median of {fv.rounds} "
              f"rounds, {res['threads']} threads")
        print(format_result(res))
    if fv.harness in ("together", "both"):
        res2 = together(cfg, head, fv.rounds, fv.calls, common.log)
        print(f"GEMMs of a {head} train step, together (one process, {fv.calls} calls a round, alternating), "
              f"median of {fv.rounds} rounds, {res2['threads']} threads")
        print(format_result(res2))
        print("  paired JAX/torch time per GEMM: " + ", ".join(f"{r['name']} {r['paired_ratio']:.2f}"
                                                          for r in res2["rows"]))
        res = res if fv.harness == "both" else res2
    if fv.step_rounds > 0:
        step = peer.measure(spec, overrides, [head], ["jax", "torch_compile"],
                            fv.step_rounds, 3, "fused", common.log, keep_memory=True)  # as the GEMMs ran
        j, t = (step["rows"][peer.variant(k, head)]["median_s"] for k in ("jax", "torch_compile"))
        print(f"Train step, median of {fv.step_rounds} paired rounds: onona-jax {j:.3f} s = GEMMs "
              f"{res['jax_total_s']:.3f} + other {j - res['jax_total_s']:.3f}; torch.compile {t:.3f} s = GEMMs "
              f"{res['torch_total_s']:.3f} + other {t - res['torch_total_s']:.3f}")
        print(f"  with XLA:CPU's GEMMs, matching torch.compile's step leaves {t - res['jax_total_s']:.3f} s "
              f"for everything else (torch.compile itself: {t - res['torch_total_s']:.3f} s)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
