"""onona-jax against the paper's PyTorch code path on the CPU: the whole training step (same
shapes, same start), the parts of it where onona-jax trailed, and where our step's time goes.
`--what` picks the mode (default: step); each has its own flags (`--what=<mode> --help`):

    flock /tmp/onona-heavy.lock python benchmarks/peer.py [--what=step] [--rounds=30] [--output=peer.json] \
        [--config=configs/paper.py:dense-small-twin] [--config.model.d_model=512 ...]
    flock /tmp/onona-heavy.lock python benchmarks/peer.py --what=parts [--tokens=1024] [--d_model=512] \
        [--vocab=50304] [--tiles=256,512,1024] [--batch=4] [--seq=256] [--heads=8] [--kv_heads=4] \
        [--head_dim=64] [--reps=7]
    flock /tmp/onona-heavy.lock python benchmarks/peer.py --what=profile \
        [--config=configs/paper.py:dense-small-standard] [--config.model.d_model=512 ...] \
        [--steps=3] [--top=40] [--untraced=20] [--keep_freed_memory]

## --what=step (the default)

The shape is `--config`'s (its `model.head` is replaced by each of `--heads`); the d 512 row of
docs/performance.md is dense-small with --config.model.d_model=512 --config.model.n_layers=8
--config.model.n_heads=8 --config.model.n_kv_heads=4 --config.model.head_dim=64
--config.model.d_ff=1408 --config.train.global_batch=4 --config.data.seq_len=256.

Variants, per head (standard: the tied softmax; twin: the Figure 2 `TwinTables`):

* jax            -- onona-jax's jitted train step (`train.make_train_step`, `model.loss` as
  configured: "fused" by default), one device, no accumulation.
* torch_eager    -- a transformers `Qwen3ForCausalLM` (standard, tied) or
  `tests/reference/torch_ref.TwinQwen3` (a `Qwen3Model` body + `TwinTables`), SDPA attention (transformers'
  default), fp32 cross-entropy / NLL of the log-probabilities, `clip_grad_norm_` and
  `torch.optim.AdamW` with our hyperparameters: the same lr schedule (optimizer.wsd, set per
  step), betas, eps, weight decay on exactly the parameters our mask decays, grad clip.
* torch_compile  -- the same with the forward and loss under `torch.compile` (AOTAutograd
  compiles the backward too). Both torch variants use `--adamw` (default: fused=True, the C++
  kernel for CPU tensors).

Every variant runs in its own process (built once, compiled, warmed up), which serves "one
step, report its time" requests over a pipe; `OMP_WAIT_POLICY=PASSIVE`, torch threads =
the cores this process may use; with `--keep_freed_memory`, glibc keeps what each worker
frees (`common.keep_freed_memory` says why; off by default, as users run both frameworks). The jax
worker initialises the parameters (`train.init_state`, `cfg.seed`) and hands them to the
torch workers, which load them through `serve.hf_format.to_hf`
(`TwinQwen3.load_from_jax`). Before any timing, every
variant's first-step loss (the same batch, the same weights) must equal jax's to
`LOSS_RTOL`, the parameter counts must be equal, and the second-step loss (after one
optimizer update) must agree to `STEP2_RTOL`; otherwise the run fails (exit 1).

Rounds are paired: in each round every variant does one step, the order rotating across rounds,
so load from other jobs on a shared machine hits every variant alike. Reported per variant: the
median step time; per head, jax's speed against each torch variant (torch time / jax time; > 1:
onona-jax faster) as a ratio of medians and paired (the median over rounds of the same round's
ratio); and jax's twin/standard step-time ratio against the model FLOP ratio
(`summary.flops_per_token`, matmul FLOPs counted analytically).

## --what=parts

The parts of the d 512 step where onona-jax trailed PyTorch on a Zen 1 host, alone, forward and
backward, against PyTorch's own at the same shapes (issue 30):

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

## --what=profile

Where our train step's time goes on this machine: per-XLA-op times from `jax.profiler`. Compiles
the step as --what=step does (`common.jax_side`: one device, the whole batch a step), runs
`--untraced` steps (their median time, minor page faults a step and the process's peak RSS, with
or without `common.keep_freed_memory`), traces `--steps` steps and prints the `--top` ops by time
per step, each with its output shape and the JAX operation it came from (from the compiled
step's optimized HLO).
"""

from __future__ import annotations

import collections
import datetime
import glob
import gzip
import json
import math
import multiprocessing as mp
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli, paths

# The torch peer runs on the CPU, so jax does too; set before jax is imported here or in a
# worker (which imports this module first).
common.cpu_only()
DEFAULT_CONFIG = f"{common.CONFIGS}:dense-small-twin"
KINDS = ("jax", "torch_eager", "torch_compile")
HEADS = ("standard", "twin")
# fp32 on both sides: the loss is a mean of ~10^3 log-probabilities of size ~ln V ≈ 11 from
# matmuls summed in a different order (XLA vs oneDNN/Inductor) and a different log-softmax;
# fp32 rounding of each log-probability is ~1e-6 relative, and averaging does not grow it.
LOSS_RTOL = 1e-5
# After one AdamW step: Adam's first update is ≈ lr·sign(g) per weight, so a weight whose
# gradient is within rounding of zero may move by ±lr in one framework and not in the other;
# the loss difference stays well inside this.
STEP2_RTOL = 1e-3


def variant(kind: str, head: str) -> str:
    return f"{kind}/{head}"


# ----------------------------------------------------------------------------- the learning rate


def schedule_values(cfg, n: int) -> list[float]:
    """The learning rate of steps 0..n-1, as our step computes it (optimizer.wsd)."""
    from onona_jax import summary
    from onona_jax.train import optimizer

    t = cfg.train
    total = summary.budget(cfg)["steps"]
    sched = optimizer.wsd(t.lr, t.final_lr, t.warmup_steps, total, t.decay_fraction)
    import jax.numpy as jnp

    return [float(x) for x in sched(jnp.arange(n))]  # elementwise: one call for every step


# ----------------------------------------------------------------------------- the torch side


def torch_model(head: str, model_cfg: dict, params):
    """The paper's PyTorch model of `head` holding our `params` (numpy tree), and its loss
    fn(inputs, targets): the mean next-token NLL in fp32."""
    import ml_collections
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the PyTorch reference
    from reference.torch_ref import hf_qwen3_config, state_dict_from_jax

    m = ml_collections.ConfigDict(model_cfg)
    V = m.vocab_size
    if head == "twin":
        from reference.torch_ref import TwinQwen3

        model = TwinQwen3(m).load_from_jax(params, m)
        body = model.model

        def loss_fn(model, x, y):  # Figure 2's log-probabilities, then the NLL
            return F.nll_loss(model(x).reshape(-1, V), y.reshape(-1))
    elif head == "standard":
        from transformers import Qwen3ForCausalLM

        model = Qwen3ForCausalLM(hf_qwen3_config(m))
        sd = state_dict_from_jax(params, m)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing != ["lm_head.weight"] or unexpected:  # tied: lm_head is embed_tokens
            raise cli.Failure(f"standard torch model: missing {missing}, unexpected {unexpected}")
        body = model.model

        def loss_fn(model, x, y):
            logits = model(input_ids=x).logits.float()
            return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    else:
        raise ValueError(f"no PyTorch peer for head {head!r}; choose standard or twin")
    # the reference config asks for eager attention (exact parity tests); a user trains with
    # transformers' default, SDPA, which is faster on CPU too.
    body.set_attn_implementation("sdpa")
    return model.train(), loss_fn


def torch_side(kind: str, head: str, model_cfg: dict, train_cfg: dict, params, decays: dict,
               lrs: list[float], adamw: str = "fused"):
    """(parameter count, step fn) of the PyTorch peer; step(tokens) runs one step (forward,
    backward, clip, AdamW) and returns (loss, seconds)."""
    import torch

    model, loss_fn = torch_model(head, model_cfg, params)
    # Figure 2 names the gate Linear `w`; the converter (HF export) names it `gate`.
    alias = {"twin.w.weight": "twin.gate.weight"}
    named = list(model.named_parameters())  # tied tables once
    unknown = [n for n, _ in named if alias.get(n, n) not in decays]
    if unknown:
        raise cli.Failure(f"torch parameters with no counterpart in ours: {unknown}")
    decay = [p for n, p in named if decays[alias.get(n, n)]]
    no_decay = [p for n, p in named if not decays[alias.get(n, n)]]
    t = train_cfg
    opt_kw = {"fused": dict(fused=True), "foreach": dict(foreach=True), "default": {}}[adamw]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lrs[0], betas=(t["b1"], t["b2"]), eps=t["eps"], **opt_kw)
    params_list = [p for _, p in named]
    fwd = torch.compile(loss_fn) if kind == "torch_compile" else loss_fn
    box = {"i": 0, "x": None, "y": None}

    def step(tokens=None):
        if tokens is not None:
            tok = torch.as_tensor(tokens, dtype=torch.long)
            box["x"], box["y"] = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        t0 = time.perf_counter()
        lr = lrs[min(box["i"], len(lrs) - 1)]
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = fwd(model, box["x"], box["y"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params_list, t["grad_clip"])
        opt.step()
        value = float(loss.detach())
        dt = time.perf_counter() - t0
        box["i"] += 1
        return value, dt

    return sum(p.numel() for _, p in named), step


# ----------------------------------------------------------------------------- workers


def _worker(conn, kind, head, job):
    """A variant in its own process: build, first two steps (their losses), `warmup` more,
    then serve "step" requests with the step's seconds until "stop"."""
    try:
        if kind == "jax" and job["xla_flags"]:  # before jax is imported in this process
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + job["xla_flags"]).strip()
        if kind != "jax":
            import torch

            torch.set_num_threads(job["threads"])
        if job["keep_freed_memory"]:
            common.keep_freed_memory()
        t0 = time.perf_counter()
        if kind == "jax":
            cfg = common.jax_config(job["spec"], job["overrides"], head)
            params, decays, n_params, step = common.jax_side(cfg)
            with open(job["params_path"], "wb") as f:
                pickle.dump({"params": params, "decays": decays}, f)
        else:
            with open(job["params_path"], "rb") as f:
                saved = pickle.load(f)
            n_params, step = torch_side(kind, head, job["model"], job["train"], saved["params"], saved["decays"],
                                        job["lrs"], job["adamw"])
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        loss1, _ = step(job["tokens"])  # torch.compile compiles here
        loss2, _ = step()
        first_s = time.perf_counter() - t0
        for _ in range(job["warmup"]):
            step()
        conn.send({"ok": True, "n_params": int(n_params), "loss1": loss1, "loss2": loss2,
                   "build_s": build_s, "first_steps_s": first_s})
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            conn.send(step()[1])
    except Exception as err:  # noqa: BLE001 - reported to the parent, which fails with it
        conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})
    finally:
        conn.close()


# ----------------------------------------------------------------------------- the run


def check_start(infos: dict, heads) -> dict:
    """Every torch variant against jax, per head: parameter counts equal, first-step loss to
    LOSS_RTOL, second-step loss to STEP2_RTOL; raises cli.Failure naming what differs."""
    out, bad = {}, []
    for head in heads:
        ref = infos[variant("jax", head)]
        for name, info in infos.items():
            if not name.endswith("/" + head) or name.startswith("jax/"):
                continue
            r1 = abs(info["loss1"] - ref["loss1"]) / abs(ref["loss1"])
            r2 = abs(info["loss2"] - ref["loss2"]) / abs(ref["loss2"])
            out[name] = {"loss1_rel_diff": r1, "loss2_rel_diff": r2}
            if info["n_params"] != ref["n_params"]:
                bad.append(f"{name} has {info['n_params']:,} parameters, jax/{head} {ref['n_params']:,}")
            if not r1 <= LOSS_RTOL:
                bad.append(f"{name} first-step loss {info['loss1']:.8f} vs jax {ref['loss1']:.8f} "
                           f"(relative {r1:.2e} > {LOSS_RTOL:g})")
            if not r2 <= STEP2_RTOL:
                bad.append(f"{name} second-step loss {info['loss2']:.8f} vs jax {ref['loss2']:.8f} "
                           f"(relative {r2:.2e} > {STEP2_RTOL:g})")
    if bad:
        raise cli.Failure("the frameworks do not start from the same model: " + "; ".join(bad))
    return out


def measure(spec, overrides, heads, kinds, rounds, warmup, adamw, log, xla_flags="", keep_memory=False) -> dict:
    import numpy as np

    from onona_jax import summary

    cfgs = {h: common.jax_config(spec, overrides, h) for h in heads}
    cfg0 = cfgs[heads[0]]
    B, T = cfg0.train.global_batch, cfg0.data.seq_len
    tokens = np.random.default_rng(cfg0.seed).integers(0, 50257, (B, T + 1), dtype=np.int32)
    lrs = schedule_values(cfg0, warmup + rounds + 2)
    threads = len(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    infos, workers = {}, []
    tmp = tempfile.TemporaryDirectory(prefix="onona-peer-")
    try:
        for head in heads:
            cfg = cfgs[head]
            job = {"spec": spec, "overrides": overrides, "threads": threads, "tokens": tokens,
                   "warmup": warmup, "params_path": os.path.join(tmp.name, f"{head}.pkl"),
                   "model": cfg.model.to_dict(), "train": cfg.train.to_dict(), "lrs": lrs, "adamw": adamw,
                   "xla_flags": xla_flags, "keep_freed_memory": keep_memory}
            for kind in ("jax",) + tuple(k for k in kinds if k != "jax"):  # jax writes the weights first
                w = common.Worker(ctx, variant(kind, head), _worker, (kind, head, job))
                workers.append(w)
                infos[w.name] = w.ready()
                log(f"  {w.name}: built in {infos[w.name]['build_s']:.1f} s, first two steps "
                    f"{infos[w.name]['first_steps_s']:.1f} s, loss {infos[w.name]['loss1']:.7f} "
                    f"then {infos[w.name]['loss2']:.7f}, {infos[w.name]['n_params']:,} parameters")
        start = check_start(infos, heads)
        timed = [w for w in workers if "jax" in kinds or not w.name.startswith("jax/")]  # jax always writes the weights
        times = common.paired_rounds(timed, rounds, log)
    finally:
        for w in workers:
            w.stop()
        tmp.cleanup()

    rows = {n: {"median_s": statistics.median(t), "min_s": min(t), "times_s": t,
                "tokens_per_s": B * T / statistics.median(t), "n_params": infos[n]["n_params"],
                "loss1": infos[n]["loss1"], "loss2": infos[n]["loss2"], "build_s": infos[n]["build_s"],
                "first_steps_s": infos[n]["first_steps_s"]} for n, t in times.items()}
    speed = {}
    for head in heads:
        j = variant("jax", head)
        for kind in kinds:
            o = variant(kind, head)
            if kind == "jax" or j not in times or o not in times:
                continue
            speed[f"{j} vs {o}"] = {
                "median_ratio": rows[o]["median_s"] / rows[j]["median_s"],
                "paired_ratio": statistics.median(b / a for a, b in zip(times[j], times[o])),
                "met": rows[o]["median_s"] / rows[j]["median_s"] >= 1.0 if kind == "torch_compile" else None}
    twin = None
    if {"jax/standard", "jax/twin"} <= set(times):
        flop = (summary.flops_per_token(cfgs["twin"].model, T)["train"]
                / summary.flops_per_token(cfgs["standard"].model, T)["train"])
        t_ratio = rows["jax/twin"]["median_s"] / rows["jax/standard"]["median_s"]
        p_ratio = statistics.median(a / b for a, b in zip(times["jax/twin"], times["jax/standard"]))
        twin = {"step_time_ratio": t_ratio, "paired_step_time_ratio": p_ratio, "flop_ratio": flop,
                "time/flop": t_ratio / flop, "paired_time/flop": p_ratio / flop, "met": t_ratio <= 1.03 * flop}
    m = cfg0.model
    return {"shape": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                      "head_dim": m.head_dim, "d_ff": m.d_ff, "vocab_size": m.vocab_size, "batch": B, "seq_len": T,
                      "dtype": m.dtype, "loss": m.loss, "remat": m.remat},
            "rounds": rounds, "warmup": warmup, "threads": threads, "adamw": adamw, "xla_flags": xla_flags,
            "keep_freed_memory": keep_memory,
            "start_check": start, "rows": rows, "speed": speed, "twin/standard": twin}


def format_result(res) -> str:
    s = res["shape"]
    lines = [f"Train step, d {s['d_model']}, {s['n_layers']} layers, {s['n_heads']} heads / {s['n_kv_heads']} KV, "
             f"d_ff {s['d_ff']}, V {s['vocab_size']}, {s['batch']} × {s['seq_len']} tokens, {s['dtype']}; "
             f"median of {res['rounds']} paired rounds, {res['threads']} threads",
             f"  {'variant':<24}{'median s':>10}{'min s':>10}{'tokens/s':>11}{'params':>13}{'first loss':>13}"]
    for n, r in res["rows"].items():
        lines.append(f"  {n:<24}{r['median_s']:>10.4f}{r['min_s']:>10.4f}{r['tokens_per_s']:>11,.0f}"
                     f"{r['n_params']:>13,}{r['loss1']:>13.7f}")
    for n, c in res["start_check"].items():
        lines.append(f"    {n}: first-step loss relative difference {c['loss1_rel_diff']:.1e}, "
                     f"second-step {c['loss2_rel_diff']:.1e}")
    for k, v in res["speed"].items():
        met = "" if v["met"] is None else f" (target ≥ 1.0: {'met' if v['met'] else 'not met'})"
        lines.append(f"    {k}: onona-jax {v['median_ratio']:.2f}× (paired {v['paired_ratio']:.2f}×){met}")
    t = res["twin/standard"]
    if t:
        lines.append(f"    jax twin/standard step time {t['step_time_ratio']:.3f} (paired {t['paired_step_time_ratio']:.3f}) "
                     f"vs FLOP ratio {t['flop_ratio']:.3f} -> {t['time/flop']:.3f} × (paired {t['paired_time/flop']:.3f}; "
                     f"target ≤ 1.03: {'met' if t['met'] else 'not met'})")
    return "\n".join(lines)


def define_step(fv, argv):
    from onona_jax import config as config_lib

    flags.DEFINE_integer("rounds", 30, "paired rounds (one step of every variant each)", flag_values=fv)
    flags.DEFINE_integer("warmup", 3, "untimed steps of each variant after its first two", flag_values=fv)
    flags.DEFINE_list("heads", list(HEADS), "heads to compare: standard, twin", flag_values=fv)
    flags.DEFINE_list("kinds", list(KINDS), f"variants: {', '.join(KINDS)}", flag_values=fv)
    flags.DEFINE_enum("adamw", "fused", ["fused", "foreach", "default"],
                      "torch AdamW implementation (fused: the C++ kernel; foreach; default: torch's choice)", flag_values=fv)
    flags.DEFINE_string("xla_flags", "", "appended to XLA_FLAGS in the jax workers (investigation; the "
                        "figures in the docs use none)", flag_values=fv)
    flags.DEFINE_bool("keep_freed_memory", False, "every worker keeps the memory it frees (`keep_freed_memory`: "
                      "no page faults for a step's temporaries; the figures in the docs say which)", flag_values=fv)
    flags.DEFINE_string("output", "", "also write the figures as JSON here", flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def main_step(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    heads, kinds = list(dict.fromkeys(fv.heads)), list(dict.fromkeys(fv.kinds))
    if set(heads) - set(HEADS) or not heads:
        raise cli.UsageError(f"--heads={','.join(fv.heads)}: choose from {', '.join(HEADS)}")
    if set(kinds) - set(KINDS) or not kinds:
        raise cli.UsageError(f"--kinds={','.join(fv.kinds)}: choose from {', '.join(KINDS)}")
    if fv.rounds < 1 or fv.warmup < 0:
        raise cli.UsageError("--rounds must be ≥ 1 and --warmup ≥ 0")
    if fv.config.model.arch != "dense":
        raise cli.UsageError(f"model.arch={fv.config.model.arch!r}: the PyTorch peer is the dense Qwen3 body")
    spec, overrides = common.config_args(fv, argv, DEFAULT_CONFIG)
    for h in heads:
        common.jax_config(spec, overrides, h)  # bad overrides fail here, before any process starts
    cli.check_output_file(fv.output, "peer.json")  # found now, not after minutes of compiling
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # the workers inherit it: idle torch threads sleep
    log = common.log
    res = measure(spec, overrides, heads, kinds, fv.rounds, fv.warmup, fv.adamw, log, fv.xla_flags, fv.keep_freed_memory)
    import jax
    import torch
    import transformers

    res.update(date=datetime.date.today().isoformat(), command="python benchmarks/peer.py " + " ".join(argv),
               machine=common.record(),
               versions={"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__})
    print(format_result(res))
    if fv.output:
        paths.write_json(fv.output, res)
        log(f"wrote {fv.output}")


# ----------------------------------------------------------------------------- --what=parts


def define_parts(fv, argv):
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


def head_part(fv, log):
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


def main_parts(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.reps < 1 or not fv.tiles or any(int(t) < 1 for t in fv.tiles):
        raise cli.UsageError("--reps and every --tiles entry must be ≥ 1")
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    head_part(fv, print)
    attention_part(fv, print)
    optimizer_part(fv, print)


# ----------------------------------------------------------------------------- --what=profile


PROFILE_CONFIG = f"{common.CONFIGS}:dense-small-standard"


def define_profile(fv, argv):
    from onona_jax import config as config_lib

    common.refuse_set(argv)
    flags.DEFINE_integer("steps", 3, "traced steps", flag_values=fv)
    flags.DEFINE_integer("top", 40, "ops to print", flag_values=fv)
    flags.DEFINE_integer("untraced", 20, "untraced steps first (their times, page faults and the peak RSS)",
                         flag_values=fv)
    flags.DEFINE_bool("keep_freed_memory", False, "common.keep_freed_memory() first (default: as train.py runs)",
                      flag_values=fv)
    return config_lib.define_flag(fv, argv, PROFILE_CONFIG)


def main_profile(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.steps < 1 or fv.untraced < 1 or fv.top < 1:
        raise cli.UsageError("--steps, --untraced and --top must be ≥ 1")
    cfg = common.jax_config(*common.config_args(fv, argv, PROFILE_CONFIG))  # bad overrides: before XLA starts
    import resource

    import jax
    import numpy as np

    if fv.keep_freed_memory:
        common.keep_freed_memory()
    step = common.jax_side(cfg)[3]
    step(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1)))
    times, faults = [], []
    for _ in range(fv.untraced):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times.append(step()[1])
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"{fv.untraced} untraced steps: median {statistics.median(times):.3f} s; minor page faults a step: "
          f"median {statistics.median(faults):,.0f}, max {max(faults):,}; peak RSS {rss:.2f} GiB "
          f"(keep_freed_memory={fv.keep_freed_memory})")
    trace_dir = tempfile.mkdtemp(prefix="onona-trace-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(fv.steps):
            step()
    events = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            total[e["name"]] += e["dur"] / 1e3 / fv.steps
            count[e["name"]] += 1
    hlo = step.compiled.as_text()  # the optimized HLO names each op's shape and source
    print(f"{'ms/step':>8} {'calls':>5}  op  shape  source")
    shown = 0
    for name, ms in total.most_common():
        m = re.search(r"^\s*(?:ROOT )?%" + re.escape(name) + r" = (\S+) \w+\(.*?op_name=\"([^\"]*)\"", hlo, re.M)
        if not m:  # executor bookkeeping and Python frames, not XLA ops
            continue
        print(f"{ms:8.2f} {count[name] // fv.steps:5d}  {name}  {m.group(1)}  {m.group(2)}")
        shown += 1
        if shown == fv.top:
            break


# ----------------------------------------------------------------------------- main


# --what=<mode>: (define, main, whether stdout is one JSON object)
WHAT = {
    "step": (define_step, main_step, False),
    "parts": (define_parts, main_parts, False),
    "profile": (define_profile, main_profile, False),
}


def main(argv=None) -> int:
    return common.run_modes(WHAT, "step", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
