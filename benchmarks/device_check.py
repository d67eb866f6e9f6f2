"""One prepared accelerator run (scripts/device_check.sh): 142M Dense standard and twin train
steps at the paper's micro-batch (16 × 1,024, bf16, one device) with

* the fused loss (token-tiled, gradients in the forward pass: loss.py), XLA and
  cuDNN attention side by side (`model.attention_impl` xla and cudnn; `auto` picks cuDNN on a
  GPU in bf16),
* the vocabulary-tiled fused_vocab loss (loss_vocab.py) at two vocabulary chunks,
* the plain loss,
* the other families' switches (twin, fused loss): MoE 142M with the sort and the grouped
  (ragged_dot) dispatch, Gated DeltaNet 142M at model.gdn.precision highest and default,

each: tokens/s, model TFLOP/s and MFU (summary.flops_per_token: causal attention at half the
T × T square, no recompute; PaLM's full-square MFU beside it; against
chips.CHIPS), XLA's memory_analysis of the compiled step (temp + arguments + outputs
− aliased: the step's peak device memory as XLA plans it) and the device allocator's peak
(`memory_stats`, where the backend has one); then decode tokens/s (two- vs one-projection
sampling, greedy) through serving.Server. Writes device_check.json and device_check.md into
--out_dir after every variant, so a run cut short keeps what it measured. Variants run one
after another (compile, warm-up, timed steps); once --budget_s has passed the rest are
recorded as skipped, so the run fits its slot.

    python benchmarks/device_check.py --out_dir=DIR [--steps=20] [--budget_s=420] [--dry_run]

--dry_run: tiny shapes (2 × 32 tokens, 2 steps) on whatever backend is here (CPU in the test
suite): every variant's config is built and validated, one variant (twin/fused+xla) is compiled
and stepped through the same code as every other, and decoding runs 4 tokens; with
--dry_run_all every variant the backend can run is compiled and stepped. So the script cannot fail for a typo when a GPU is finally at hand.
cuDNN attention needs a GPU: elsewhere it is recorded as skipped.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from absl import flags

import bench_sections  # benchmarks/bench_sections.py (bench.py --what=sections), beside this script
import common  # benchmarks/common.py, beside this script
from onona_jax import cli, summary
from onona_jax import train as trainer

GIB = 2.0 ** 30
HEADS = ("standard", "twin")
CHUNKS = (2048, 8192)  # fused_vocab's vocabulary rows per tile: the default and a larger one


def variants():
    """(name, loss, chunk, attention) per head, in run order (the issue's list)."""
    out = [("fused+xla", "fused", None, "xla"), ("fused+cudnn", "fused", None, "cudnn")]
    out += [(f"fused_vocab@{c}", "fused_vocab", c, None) for c in CHUNKS]
    out += [("plain", "plain", None, None)]
    return out


# The other families' step-time switches (issue 26), twin head, fused loss, XLA attention:
# (name, arch, config overrides). Pairs of one model computed two ways.
FAMILY_VARIANTS = (
    ("moe:sort", "moe", {"model.moe.dispatch": "sort"}),
    ("moe:grouped", "moe", {"model.moe.dispatch": "grouped"}),
    ("gdn:highest", "gdn", {"model.gdn.precision": "highest"}),
    ("gdn:default", "gdn", {"model.gdn.precision": "default"}),
)


# Packed documents (data.packing=documents, issue 40): twin, fused loss, its document masks in
# cuDNN's kernel and in XLA's, against fused+cudnn and fused+xla on the same batch (windows).
PACKED_VARIANTS = (("documents+cudnn", "cudnn"), ("documents+xla", "xla"))
EOT = 50256  # GPT-2's end of text, the bundled corpus's document end


def plan():
    """(key, head, variant kwargs) in run order: the fused losses first (both heads), then the
    families and packed documents, then the vocabulary-tiled and plain losses, so a budget cut
    loses the least asked."""
    dense = [(f"{h}/{name}", h, dict(loss=loss, chunk=chunk, attention=attention))
             for h in HEADS for name, loss, chunk, attention in variants()]
    first = [d for d in dense if d[2]["loss"] == "fused"]
    families = [(f"twin/{name}", "twin", dict(loss="fused", chunk=None, attention="xla", arch=arch, overrides=o))
                for name, arch, o in FAMILY_VARIANTS]
    packed = [(f"twin/{name}", "twin", dict(loss="fused", chunk=None, attention=attention,
                                             overrides={"data.packing": "documents"}))
              for name, attention in PACKED_VARIANTS]
    return first + families + packed + [d for d in dense if d[2]["loss"] != "fused"]


def peak_allocated():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


DRY_RUN_STEPPED = ("twin/fused+xla",)


def run_variant(size, head, loss, chunk, attention, batch, seq, steps, tokens, config_only=False, arch="dense",
                overrides=None):
    bench_sections.OVERRIDES.clear()
    bench_sections.OVERRIDES.update({"model.attention_impl": attention} if attention else {})
    bench_sections.OVERRIDES.update(overrides or {})
    cfg = bench_sections.make_config(size, head, loss, chunk, batch, seq, arch=arch)
    if attention == "cudnn" and jax.default_backend() != "gpu":
        return {"status": f"skipped (cuDNN attention needs a GPU; backend {jax.default_backend()})"}
    if config_only:
        return {"status": "dry run: config validated, not compiled"}
    t0 = time.perf_counter()
    run, lowered = bench_sections.lower_step(cfg)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    mem = bench_sections.memory_stats(compiled)
    state = trainer.init_state(run, cfg.seed)
    b = trainer.global_batch(run, tokens)
    for _ in range(2):  # warm-up: first-call allocation and autotuning
        state, m = compiled(state, b)
    jax.block_until_ready((state, m))
    times = []
    for _ in range(steps):
        t1 = time.perf_counter()
        state, m = compiled(state, b)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t1)
    med = statistics.median(times)
    flops = bench_sections.model_flops_per_token(cfg) * batch * seq
    full = summary.flops_per_token(cfg.model, seq)["train_full_square"] * batch * seq
    peak = trainer.peak_tflops(cfg)
    tflops = flops / med / 1e12
    del state
    return {"status": "measured", "compile_s": compile_s, "median_s": med, "min_s": min(times),
            "tokens_per_s": batch * seq / med, "model_tflops_per_s": tflops,
            "mfu": tflops / peak if peak else None,
            "mfu_full_square": full / med / 1e12 / peak if peak else None, "loss": float(m["loss"]),
            "xla_peak_gib": (mem["temp_gib"] + mem["argument_gib"] + mem["output_gib"] - mem["alias_gib"]),
            "xla_temp_gib": mem["temp_gib"], "allocator_peak_gib": (peak_allocated() or 0) / GIB or None}


def markdown(res) -> str:
    m = res["machine"]
    lines = [f"# device check, {res['date']}", "",
             f"{m['device']} ({m['backend']}), jax {m['jax']}; {res['size']} Dense (and MoE, GDN rows), micro-batch "
             f"{res['batch']} × {res['seq_len']}, {res['steps']} timed steps after 2 warm-up, "
             f"{res.get('batch_eots', '?')} ends of text in the batch (the documents rows' boundaries)"
             + (" — DRY RUN (tiny shapes)" if res["dry_run"] else ""), "",
             f"Machine: {common.machine_line(m)}; load after {m['load_after'][0]:.2f}", "",
             "| head | variant | tokens/s | MFU (causal) | MFU (full square) | median step ms | XLA peak GiB | XLA temp GiB | allocator peak GiB | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["train"].items():
        head, variant = name.split("/", 1)
        if r["status"] != "measured":
            lines.append(f"| {head} | {variant} | {r['status']} | | | | | | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mfu_full = "n/a" if r.get("mfu_full_square") is None else f"{100 * r['mfu_full_square']:.1f}%"
        alloc = "n/a" if not r["allocator_peak_gib"] else f"{r['allocator_peak_gib']:.2f}"
        lines.append(f"| {head} | {variant} | {r['tokens_per_s']:,.0f} | {mfu} | {mfu_full} | {1e3 * r['median_s']:.1f} | "
                     f"{r['xla_peak_gib']:.2f} | {r['xla_temp_gib']:.2f} | {alloc} | {r['compile_s']:.0f} |")
    dc = res.get("decode") or {}
    lines += ["", "| decode mode | decode tokens/s | incl. prefill |", "|---|---|---|"]
    if dc.get("status") == "measured":
        for mode, r in dc["rows"].items():
            lines.append(f"| {mode} | {r['decode_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} |")
        lines.append(f"| one/two-projection sampling | {dc['one/two_projection']:.3f} × | |")
    else:
        lines.append(f"| {dc.get('status', 'not run')} | | |")
    return "\n".join(lines) + "\n"


def write(res, out_dir):
    res["machine"] = common.record()  # the load after: a written file may be the run's last
    with open(os.path.join(out_dir, "device_check.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    with open(os.path.join(out_dir, "device_check.md"), "w") as f:
        f.write(markdown(res))


def define(fv, argv):
    flags.DEFINE_string("out_dir", None, "where device_check.json and device_check.md go", flag_values=fv,
                        required=True)
    flags.DEFINE_integer("steps", 20, "timed steps per variant", flag_values=fv)
    flags.DEFINE_float("budget_s", 420.0, "no new variant starts after this", flag_values=fv)
    flags.DEFINE_integer("decode_rounds", 5, "decode rounds", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "tiny shapes, 2 steps (CPU test of this script)", flag_values=fv)
    flags.DEFINE_bool("dry_run_all", False, "with --dry_run: compile and step every variant", flag_values=fv)


def _main(args, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if args.steps < 1 or args.budget_s <= 0:
        raise cli.UsageError("--steps must be ≥ 1 and --budget_s positive")
    os.makedirs(args.out_dir, exist_ok=True)
    size, batch, seq, steps = ("tiny", 2, 32, 2) if args.dry_run else ("142m", 16, 1024, args.steps)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/device_check.py " + " ".join(argv),
           "dry_run": args.dry_run, "size": size, "batch": batch, "seq_len": seq, "steps": steps,
           "machine": common.record(), "train": {}, "decode": None}
    from onona_jax.data import pipeline

    # The first batch that holds an end of text, so the documents rows mask something (at the
    # full shape the first does: 171 in 16 × 1,025 tokens; a dry run's 2 × 33 mostly none).
    batches = pipeline.train_batches(bench_sections.prepared_data(seq), seq, batch)
    tokens = np.asarray(next(batches))
    for _ in range(1000):
        if (tokens == EOT).any():
            break
        tokens = np.asarray(next(batches))
    res["batch_eots"] = int((tokens == EOT).sum())
    for key, head, kwargs in plan():
        if time.perf_counter() - t_start > args.budget_s:
            res["train"][key] = {"status": f"skipped (time budget {args.budget_s:.0f} s spent)"}
        else:
            config_only = args.dry_run and not args.dry_run_all and key not in DRY_RUN_STEPPED
            res["train"][key] = run_variant(size, head, batch=batch, seq=seq, steps=steps, tokens=tokens,
                                            config_only=config_only, **kwargs)
        r = res["train"][key]
        log(f"  {key}: " + (f"{r['tokens_per_s']:,.0f} tokens/s" if r["status"] == "measured" else r["status"]))
        write(res, args.out_dir)
    bench_sections.OVERRIDES.clear()
    if time.perf_counter() - t_start > args.budget_s:
        res["decode"] = {"status": f"skipped (time budget {args.budget_s:.0f} s spent)"}
    else:
        res["decode"] = (bench_sections.bench_decode(size, 1, log, batch=2, prompt_len=4, new_tokens=4,
                                                     only=("twin/sample_two_projection", "twin/sample_one_projection")) if args.dry_run
                         else bench_sections.bench_decode(size, max(args.decode_rounds, 3), log))
    res["elapsed_s"] = time.perf_counter() - t_start
    write(res, args.out_dir)
    print(markdown(res))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
