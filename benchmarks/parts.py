"""The parts of the d 512 step where onona-jax trailed PyTorch on a Zen 1 host, alone, forward
and backward, against PyTorch's own at the same shapes (issue 30):

    flock /tmp/onona-heavy.lock python benchmarks/parts.py [--tokens=1024] [--d_model=512] \
        [--vocab=50304] [--tiles=256,512,1024] [--batch=4] [--seq=256] [--heads=8] [--kv_heads=4] \
        [--head_dim=64] [--reps=7]

* **head**: the tied softmax's loss and its gradients over `--tokens` hidden states. Ours:
  `loss.head_nll` (the fused loss: gradients in the forward pass) at each `--tiles` token tile;
  PyTorch's: `cross_entropy(h @ Eᵀ)` and `backward()` (eager: three GEMMs on the whole batch
  and one log-softmax, as its compiled step runs them). Then the ∂table product alone per tile
  (ours `einsum("tv,td->vd")`, its `dz.T @ h`): the one GEMM whose speed the tile sets.
* **attention**: causal grouped-query attention forward and backward (q [B, T, N, hd], k, v
  [B, T, K, hd]). Ours: `jax.nn.dot_product_attention` over the whole T × T matrix, and
  `attention.causal_attention(impl="xla")` as it runs on the CPU (blocks of query rows); its:
  `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` (its flash kernel on CPU).
* **optimizer**: one clipped AdamW update of a [`--vocab`, `--d_model`] table, as the step makes
  it. Ours: `optimizer.clip_by_global_norm` + `optax.adamw` + `apply_updates` (jitted, weights and
  state donated), and the same with optax's clip; PyTorch's: `clip_grad_norm_` + the fused C++
  AdamW (`fused=True`, one pass over weight, gradient and moments). Printed with each of ours: the
  passes XLA makes over the table (fusions with its shape in the compiled update) and the
  bandwidth they imply. Checked: our weights and both moments after one update against the
  same update in float64, to 1e-4 (PyTorch's is printed: its norm of a table this size is
  off by 1e-3).

One process, 2 threads each (the cores this process may use), each variant compiled and run
once before `--reps` timed calls; a figure is the median. Values are checked, not only timed:
every variant's gradients (and the ∂table product) against PyTorch's to 1e-4 of the largest,
the optimizer's against float64 (`cli.Failure`, exit 1, otherwise).
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import time

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli


def define(fv, argv):
    flags.DEFINE_integer("tokens", 1024, "head: hidden states (the d 512 step's 4 × 256)", flag_values=fv)
    flags.DEFINE_integer("d_model", 512, "head: d", flag_values=fv)
    flags.DEFINE_integer("vocab", 50304, "head: V", flag_values=fv)
    flags.DEFINE_list("tiles", ["256", "512", "1024"], "head: our loss's token tiles", flag_values=fv)
    flags.DEFINE_integer("batch", 4, "attention: B", flag_values=fv)
    flags.DEFINE_integer("seq", 256, "attention: T", flag_values=fv)
    flags.DEFINE_integer("heads", 8, "attention: query heads N", flag_values=fv)
    flags.DEFINE_integer("kv_heads", 4, "attention: KV heads K", flag_values=fv)
    flags.DEFINE_integer("head_dim", 64, "attention: hd", flag_values=fv)
    flags.DEFINE_integer("reps", 7, "timed calls per variant", flag_values=fv)


def _median_s(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check(name, ours, ref):
    import numpy as np

    for i, (a, b) in enumerate(zip(ours, ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        if err > 1e-4:
            raise cli.Failure(f"{name}: output {i} differs from the reference by {err:.2e} (relative to its largest value)")


def head(fv, log):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from onona_jax import loss

    N, d, V = fv.tokens, fv.d_model, fv.vocab
    rng = np.random.default_rng(0)
    h, T = rng.standard_normal((N, d), np.float32) * 0.5, rng.standard_normal((V, d), np.float32) * 0.02
    y = rng.integers(0, V, N).astype(np.int32)
    th, tT = torch.tensor(h, requires_grad=True), torch.tensor(T, requires_grad=True)
    ty = torch.tensor(y).long()

    def torch_step():
        th.grad = tT.grad = None
        torch.nn.functional.cross_entropy(th @ tT.T, ty).backward()
        return th.grad, tT.grad

    rows = {"torch: cross_entropy(h @ Eᵀ) + backward": _median_s(torch_step, fv.reps)}
    ref = [g.numpy().copy() for g in torch_step()]
    hj, Tj, yj, w = jnp.asarray(h), jnp.asarray(T), jnp.asarray(y), jnp.full((N,), 1.0 / N, jnp.float32)
    for tile in map(int, fv.tiles):
        grad = jax.jit(jax.grad(lambda h, T, t=tile: loss.head_nll(h, (T,), None, yj, w, token_tile=t)[0], (0, 1)))
        out = grad(hj, Tj)
        _check(f"head_nll tile {tile}", out, ref)
        rows[f"ours: head_nll, token tile {tile}"] = _median_s(lambda: jax.block_until_ready(grad(hj, Tj)), fv.reps)
    dT = {}
    for tile in sorted({min(int(t), N) for t in fv.tiles}):
        dz, ht = rng.standard_normal((tile, V), np.float32), h[:tile]
        f = jax.jit(lambda dz, h: jnp.einsum("tv,td->vd", dz, h))
        dzj, hj_t, tdz, tht = jnp.asarray(dz), jnp.asarray(ht), torch.tensor(dz), torch.tensor(ht)
        with torch.no_grad():
            _check(f"∂table, {tile} tokens", [f(dzj, hj_t)], [(tdz.T @ tht).numpy()])
            dT[tile] = (_median_s(lambda: jax.block_until_ready(f(dzj, hj_t)), fv.reps),
                        _median_s(lambda: tdz.T @ tht, fv.reps))
    log(f"head: {N} tokens × d {d} × V {V:,}, fp32, forward and backward (median of {fv.reps})")
    for name, s in rows.items():
        log(f"  {name:<44} {s * 1e3:8.1f} ms")
    log("∂table product alone, ours (einsum tv,td->vd) against torch (dz.T @ h), per tile:")
    for tile, (ours, theirs) in dT.items():
        gflop = 2 * tile * V * d / 1e9
        log(f"  {tile:>5} tokens: ours {ours * 1e3:7.1f} ms ({gflop / ours:5.1f} GFLOP/s), torch {theirs * 1e3:7.1f} ms "
            f"({gflop / theirs:5.1f} GFLOP/s); ours × {math.ceil(N / tile)} tile(s) of {N} tokens: {math.ceil(N / tile) * ours * 1e3:.0f} ms")


def attention_part(fv, log):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from onona_jax import attention

    B, T, N, K, H = fv.batch, fv.seq, fv.heads, fv.kv_heads, fv.head_dim
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(s, np.float32) for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)])
    tq, tk, tv = (torch.tensor(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    tdo = torch.tensor(do).transpose(1, 2)

    def torch_step():
        tq.grad = tk.grad = tv.grad = None
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True).backward(tdo)
        return [x.grad.transpose(1, 2).numpy().copy() for x in (tq, tk, tv)]

    rows = {"torch: scaled_dot_product_attention": _median_s(torch_step, fv.reps)}
    ref = torch_step()
    args = [jnp.asarray(x) for x in (q, k, v, do)]
    whole = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(H),  # noqa: E731
                                                         implementation="xla")
    ours = lambda q, k, v: attention.causal_attention(q, k, v, "xla")  # noqa: E731
    for name, f in (("ours: dot_product_attention, whole T × T", whole), ("ours: causal_attention (xla, query blocks)", ours)):
        g = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
        _check(name, g(*args), ref)
        rows[name] = _median_s(lambda g=g: jax.block_until_ready(g(*args)), fv.reps)
    log(f"attention: B {B}, T {T}, {N} query / {K} KV heads of {H}, fp32, forward and backward (median of {fv.reps})")
    for name, s in rows.items():
        log(f"  {name:<44} {s * 1e3:8.1f} ms")


def optimizer_part(fv, log):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import torch

    from onona_jax.train import optimizer

    V, d = fv.vocab, fv.d_model
    lr, b1, b2, eps, wd, clip = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
    rng = np.random.default_rng(0)
    # a gradient of norm ≈ 5, so the clip to 1 (the step's max norm) acts
    w0 = rng.standard_normal((V, d), np.float32) * 0.02
    g = rng.standard_normal((V, d), np.float32) * (5 / math.sqrt(V * d))

    tw = torch.nn.Parameter(torch.tensor(w0))
    tw.grad = torch.tensor(g)
    opt = torch.optim.AdamW([tw], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)

    def torch_step():  # clip_grad_norm_ scales the gradient in place every call, clipping or not
        torch.nn.utils.clip_grad_norm_([tw], clip)
        opt.step()

    # The reference: one update in float64. (PyTorch's own is not one: its norm of these 25.8M
    # fp32 entries is 1.4e-3 off, which moves its μ by as much; XLA's reduction is within 1e-8.)
    g64 = g.astype(np.float64) * min(1.0, clip / math.sqrt((g.astype(np.float64) ** 2).sum()))
    mu, nu = (1 - b1) * g64, (1 - b2) * g64**2
    ref = [w0 - lr * (mu / (1 - b1) / (np.sqrt(nu / (1 - b2)) + eps) + wd * w0), mu, nu]
    torch_step()
    state = opt.state[tw]
    theirs = [t.detach().numpy() for t in (tw, state["exp_avg"], state["exp_avg_sq"])]
    off = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(theirs, ref))
    rows = {"torch: clip_grad_norm_ + AdamW(fused=True)": (_median_s(torch_step, fv.reps), None)}
    gj = jnp.asarray(g)
    for name, clip_tx in (("ours: clip_by_global_norm + optax.adamw", optimizer.clip_by_global_norm(clip)),
                          ("ours with optax.clip_by_global_norm", optax.clip_by_global_norm(clip))):
        tx = optax.chain(clip_tx, optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd))

        def update(w, s, g, tx=tx):
            u, s = tx.update(g, s, w)
            return optax.apply_updates(w, u), s

        step = jax.jit(update, donate_argnums=(0, 1))
        box = [jnp.asarray(w0), tx.init(jnp.asarray(w0))]
        passes, moved = _table_traffic(step.lower(*box, gj).compile().as_text(), f"f32[{V},{d}]")
        box[:] = step(*box, gj)
        adam = box[1][1][0]
        _check(name, [box[0], adam.mu, adam.nu], ref)

        def run(step=step, box=box):
            box[:] = step(*box, gj)
            jax.block_until_ready(box[0])

        rows[name] = (_median_s(run, fv.reps), (passes, moved))
    table = V * d * 4
    log(f"optimizer: one clipped AdamW update of a [{V:,}, {d}] fp32 table ({table / 1e6:.0f} MB), median of "
        f"{fv.reps}; one pass at least reads weight, gradient, μ, ν and writes weight, μ, ν: 7 tables")
    for name, (s, traffic) in rows.items():
        if traffic is None:  # PyTorch's
            what = f"(off the float64 update by {off:.1e} of its largest)"
        else:
            passes, moved = traffic
            what = (f"{passes} fusions write a table; they and the norm move {moved} tables "
                    f"({moved * table / 1e9 / s:.1f} GB/s)")
        log(f"  {name:<44} {s * 1e3:8.1f} ms   {what}")


def _table_traffic(hlo: str, shape: str) -> tuple[int, int]:
    """(passes, tables moved) of an optimized HLO over a `shape` array: the instructions that write
    one (`aot.hlo.materialised_arrays`), and those writes plus every read of one by a fusion of
    the entry computation."""
    from onona_jax.aot.hlo import materialised_arrays

    writes = sum(s == shape for s, _ in materialised_arrays(hlo))
    entry = hlo.split("ENTRY")[1].splitlines()
    shape_of = r"(\w+\[[\d,]*\])\S*"  # f32[50304,512]{1,0} -> f32[50304,512]; f32[] too
    shapes = {m.group(1): m.group(2) for m in (re.match(rf"\s*(?:ROOT )?(%\S+) = {shape_of} ", ln) for ln in entry) if m}
    reads = 0
    for ln in entry:
        m = re.match(rf"\s*(?:ROOT )?%\S+ = {shape_of} fusion\((.*?)\), kind", ln)
        if m:
            ops = re.sub(r"/\*.*?\*/", "", m.group(2)).split(",")  # drop XLA's /*index=5*/ marks
            reads += sum(shapes.get(op.strip()) == shape for op in ops)
    return writes, writes + reads


def _main(fv, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.reps < 1 or not fv.tiles or any(int(t) < 1 for t in fv.tiles):
        raise cli.UsageError("--reps and every --tiles entry must be ≥ 1")
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    head(fv, print)
    attention_part(fv, print)
    optimizer_part(fv, print)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    common.cpu_only()  # against PyTorch on the CPU
    sys.exit(main())
