"""onona-jax against the paper's PyTorch code path: training step time, same shapes, same start.

    flock /tmp/onona-heavy.lock python benchmarks/peer.py [--rounds=30] [--output=peer.json] \
        [--config=configs/paper.py:dense-small-twin] [--config.model.d_model=512 ...]

The shape is `--config`'s (its `model.head` is replaced by each of `--heads`); the d 512 row of
docs/PERFORMANCE.md is dense-small with --config.model.d_model=512 --config.model.n_layers=8
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
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
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


def define(fv, argv):
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


def _main(fv, rest, argv):
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
