"""`python benchmarks/bench.py [--what=sections]`: the train step's memory, FLOPs and time, the data
pipeline, decode and the output layer's memory, a section each (bench.py's docstring says what each
measures), and the one-device configs they build, which device_check.py reuses."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli

GIB = 2.0 ** 30
HEADS = ("standard", "twin")
ALL_HEADS = ("standard", "twin", "untied", "sigsoftmax", "mos", "moss", "input_gate", "twin_input_only", "twin_output_only")
LOSSES = ("plain", "fused")
# fused: gradients in the forward pass, tiled over tokens (loss.py); fused_vocab: the
# earlier loss, tiled over the vocabulary with a recomputing backward (loss_vocab.py; standard/twin-like
# heads only, it has no score transform or per-component hidden states).
MEMORY_LOSSES = ("plain", "fused", "fused_vocab")
SECTIONS = ("memory", "flops", "time", "data", "decode", "head_memory")
H200_TARGET_MFU = 0.45
PAPER_142M_TWIN_TOKENS_PER_S = 422_000  # 2×H100 (SPEC §6)


# ----------------------------------------------------------------------------- configs


OVERRIDES: dict = {}  # --config.<key>=value overrides, applied to every config (e.g. model.attention_impl)


def make_config(size, head, loss="fused", chunk=None, batch=None, seq=None, scan=True, remat=None, token_tile=None,
                arch="dense"):
    """The paper's config of `arch` (Dense by default) on one device, one micro-batch of
    `batch` × `seq` a step."""
    from onona_jax import config as config_lib

    cfg = config_lib.load(f"{common.CONFIGS}:{arch}-{size}-{head}")
    if OVERRIDES:
        cfg.update_from_flattened_dict(OVERRIDES)
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, 1, 1, 1
    cfg.model.loss = loss
    if chunk:
        cfg.model.loss_chunk = int(chunk)
    if token_tile:
        cfg.model.loss_token_tile = int(token_tile)
    cfg.model.scan_layers = scan
    if remat:
        cfg.model.remat = remat
    if seq:
        cfg.data.seq_len = int(seq)
    batch = int(batch or cfg.train.global_batch)
    cfg.train.global_batch = cfg.train.micro_batch = batch
    return config_lib.validate(cfg)


def variant_name(head, loss, chunk=None, default_chunk=None):
    if loss in ("fused", "fused_vocab") and chunk and chunk != default_chunk:
        return f"{head}/{loss}@{chunk}"
    return f"{head}/{loss}"


def vocab_tiled_ok(head):
    """Heads the vocabulary-tiled loss_vocab.py serves (one or two tables, no score transform)."""
    return head not in ("sigsoftmax", "mos", "moss")


def lower_step(cfg):
    """(run, Lowered train step) from abstract shapes: nothing of the model is allocated."""
    import jax
    import jax.numpy as jnp

    from onona_jax import train as trainer

    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.abstract_train_state(run)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), jnp.int32,
                                 sharding=run.batch_sharding)
    return run, trainer.make_train_step(run).lower(state, batch)


def memory_stats(compiled) -> dict:
    ma = compiled.memory_analysis()
    return {
        "temp_gib": ma.temp_size_in_bytes / GIB,
        "argument_gib": ma.argument_size_in_bytes / GIB,
        "output_gib": ma.output_size_in_bytes / GIB,
        "alias_gib": ma.alias_size_in_bytes / GIB,
    }


def model_flops_per_token(cfg) -> float:
    from onona_jax import summary

    return summary.flops_per_token(cfg.model, cfg.data.seq_len)["train"]


def default_chunk() -> int:
    from onona_jax import config as config_lib

    return int(config_lib.base_config().model.loss_chunk)


# ----------------------------------------------------------------------------- memory


def bench_memory(size, batch, seq, chunks, remats, log, heads=HEADS, losses=LOSSES, plain_heads=HEADS):
    """Peak temporary / argument memory of the compiled step per head × loss (× chunk of the
    vocabulary-tiled loss). The plain loss only for `plain_heads` (MoS's plain step at 142M
    holds K [tokens, V] logits: slow to compile, and the point is made by standard/twin)."""
    from onona_jax import loss as loss_lib

    dc = default_chunk()
    heads = tuple(dict.fromkeys(("standard", "twin") + tuple(heads)))
    out = {"size": size, "batch": batch, "seq_len": seq, "default_chunk": dc, "by_remat": {}}
    for remat in remats:
        rows = {}
        specs = [(h, "plain", None) for h in heads if "plain" in losses and h in plain_heads]
        specs += [(h, "fused", None) for h in heads if "fused" in losses]
        specs += [(h, "fused_vocab", c) for c in [dc] + [c for c in chunks if c != dc] for h in heads
                  if "fused_vocab" in losses and vocab_tiled_ok(h)]
        for head, loss, chunk in specs:
            # An accelerator's step, compiled by XLA:CPU: the token tile TPU and GPU run
            # (model.loss_token_tile = 0 would give this CPU's, loss.resolve_token_tile).
            cfg = make_config(size, head, loss, chunk, batch, seq, remat=remat,
                              token_tile=loss_lib.ACCELERATOR_TOKEN_TILE)
            t0 = time.perf_counter()
            _, lowered = lower_step(cfg)
            compiled = lowered.compile()
            name = variant_name(head, loss, chunk, dc)
            rows[name] = {**memory_stats(compiled), "head": head, "loss": loss,
                          "chunk": chunk if loss == "fused_vocab" else None,
                          "token_tile": cfg.model.loss_token_tile if loss == "fused" else None,
                          "compile_s": time.perf_counter() - t0}
            log(f"  memory {size} remat={remat} {name}: temp {rows[name]['temp_gib']:.3f} GiB "
                f"({rows[name]['compile_s']:.0f} s to compile)")
        ratios = {}
        temp = lambda name: rows[name]["temp_gib"] if name in rows else float("nan")  # noqa: E731
        for name, r in rows.items():  # every head against standard, same loss (and chunk)
            if r["head"] != "standard":
                std = name.replace(r["head"] + "/", "standard/", 1)
                ratios[f"{r['loss']}_{r['head']}/{r['loss']}_standard" + (f"@{r['chunk']}" if r["chunk"] and r["chunk"] != dc else "")] = temp(name) / temp(std)
        ratios["fused_twin/plain_standard"] = temp("twin/fused") / temp("standard/plain")
        for h in heads:  # the new fused loss against the vocabulary-tiled one
            if f"{h}/fused_vocab" in rows and f"{h}/fused" in rows:
                ratios[f"fused_{h}/fused_vocab_{h}"] = temp(f"{h}/fused") / temp(f"{h}/fused_vocab")
        deltas = {loss: temp(f"twin/{loss}") - temp(f"standard/{loss}") for loss in MEMORY_LOSSES}
        out["by_remat"][remat] = {"rows": rows, "temp_ratios": ratios, "twin_minus_standard_temp_gib": deltas}
    return out


def format_memory(mem) -> str:
    lines = [f"Memory: compiled train step, {mem['size']} Dense, micro-batch {mem['batch']} × "
             f"{mem['seq_len']}, one device (XLA memory_analysis, GiB)"]
    for remat, r in mem["by_remat"].items():
        lines.append(f"  remat={remat}")
        lines.append(f"  {'variant':<22}{'peak temp':>12}{'arguments':>12}{'temp / std (same loss)':>25}")
        for name, row in r["rows"].items():
            std = r["rows"].get(name.replace(row["head"] + "/", "standard/", 1), row)["temp_gib"]
            lines.append(f"  {name:<22}{row['temp_gib']:>12.3f}{row['argument_gib']:>12.3f}{row['temp_gib'] / std:>25.3f}")
        for k, v in r["temp_ratios"].items():
            lines.append(f"    {k:<34} {v:.3f}")
        d = r["twin_minus_standard_temp_gib"]
        lines.append("    twin − standard peak temp: " + ", ".join(f"{k} {v:+.3f} GiB" for k, v in d.items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- head memory


def bench_head_memory(size, batch, seq, heads, losses, log, token_tile=None, chunk=None):
    """The output layer alone at `size`'s shapes: XLA's temporary bytes of the compiled
    value-and-gradient of `head.nll` (mean over batch × seq tokens) w.r.t. the head's
    weights, h (bf16 as in training) and x0, per head × loss. Seconds to compile, where the
    whole step takes minutes on CPU; it isolates what the loss itself allocates."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from onona_jax import heads as heads_lib
    from onona_jax import loss as loss_lib

    rows = {}
    for head in heads:
        for loss in losses:
            if loss == "fused_vocab" and not vocab_tiled_ok(head):
                continue
            cfg = make_config(size, head, loss, chunk, batch, seq,  # the accelerator's tile, as bench_memory
                              token_tile=token_tile or loss_lib.ACCELERATOR_TOKEN_TILE)
            m = cfg.model
            graphdef, state = nnx.split(nnx.eval_shape(lambda: heads_lib.make_head(m)))
            params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), state)
            dt = jnp.bfloat16 if m.dtype == "bfloat16" else jnp.float32
            h = jax.ShapeDtypeStruct((batch, seq, m.d_model), dt)
            x0 = jax.ShapeDtypeStruct((batch, seq, m.d_model), jnp.float32)
            y = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

            def f(params, h, x0, y):
                w = jnp.full(y.shape, 1.0 / y.size, jnp.float32)
                return nnx.merge(graphdef, params).nll(h, x0, y, w)[0]

            t0 = time.perf_counter()
            compiled = jax.jit(jax.value_and_grad(f, (0, 1, 2))).lower(params, h, x0, y).compile()
            name = f"{head}/{loss}"
            rows[name] = {**memory_stats(compiled), "head": head, "loss": loss,
                          "flops": float(compiled.cost_analysis().get("flops", float("nan"))),
                          "compile_s": time.perf_counter() - t0}
            log(f"  head memory {size} {name}: temp {rows[name]['temp_gib']:.3f} GiB")
    return {"size": size, "batch": batch, "seq_len": seq, "rows": rows}


def format_head_memory(hm) -> str:
    lines = [f"Output layer alone: value and gradient of head.nll, {hm['size']} shapes, {hm['batch']} × {hm['seq_len']} "
             "tokens (XLA memory_analysis temp, GiB; cost_analysis FLOPs of the compiled module)",
             f"  {'variant':<26}{'temp GiB':>10}{'/ standard':>12}{'GFLOPs':>12}"]
    for name, r in hm["rows"].items():
        std = hm["rows"].get(f"standard/{r['loss']}", r)["temp_gib"]
        lines.append(f"  {name:<26}{r['temp_gib']:>10.3f}{r['temp_gib'] / std:>12.3f}{r['flops'] / 1e9:>12.1f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- flops


def bench_flops(size, batch, seq, log, compiled=True, heads=HEADS, losses=LOSSES):
    """XLA's FLOP count of the unscanned step (one vocabulary tile for fused_vocab, one token
    tile for fused: XLA counts a scan body once): of the lowered module (what the program
    asks for) and, with `compiled`, of the optimised one."""
    rows = {}
    heads = tuple(dict.fromkeys(("standard", "twin") + tuple(heads)))
    for head in heads:
        for loss in losses:
            if loss == "fused_vocab" and not vocab_tiled_ok(head):
                continue
            base = make_config(size, head, loss, None, batch, seq)
            V = base.model.vocab_size
            cfg = make_config(size, head, loss, V if loss == "fused_vocab" else None, batch, seq, scan=False,
                              token_tile=batch * seq if loss == "fused" else None)
            t0 = time.perf_counter()
            _, lowered = lower_step(cfg)
            xla = float(lowered.cost_analysis()["flops"])
            xla_c = float(lowered.compile().cost_analysis()["flops"]) if compiled else None
            tokens = batch * seq
            ours = model_flops_per_token(cfg) * tokens
            d = cfg.model.d_model
            n_tables = 2 if head in ("twin", "twin_output_only") else 1
            recompute = n_tables * 2 * V * d * tokens if loss == "fused_vocab" else 0.0
            name = f"{head}/{loss}"
            rows[name] = {"xla_flops": xla, "xla_compiled_flops": xla_c, "model_flops": ours,
                          "xla/model": xla / ours, "fused_recompute_flops": recompute,
                          "xla/(model+recompute)": xla / (ours + recompute),
                          "compile_s": time.perf_counter() - t0}
            log(f"  flops {size} {name}: XLA {xla:.4e} (compiled {xla_c or float('nan'):.4e}), ours {ours:.4e} "
                f"({time.perf_counter() - t0:.0f} s)")
    ratios = {
        "model_twin/standard": rows["twin/plain"]["model_flops"] / rows["standard/plain"]["model_flops"],
        **{f"xla_{loss}_twin/standard": rows[f"twin/{loss}"]["xla_flops"] / rows[f"standard/{loss}"]["xla_flops"]
           for loss in losses if f"twin/{loss}" in rows and f"standard/{loss}" in rows},
        **{f"xla_{h}_{loss}/plain": rows[f"{h}/{loss}"]["xla_flops"] / rows[f"{h}/plain"]["xla_flops"]
           for h in heads for loss in losses if loss != "plain" and f"{h}/{loss}" in rows and f"{h}/plain" in rows},
    }
    return {"size": size, "batch": batch, "seq_len": seq, "rows": rows, "ratios": ratios}


def format_flops(fl) -> str:
    lines = [f"FLOPs per train step, {fl['size']} Dense, {fl['batch']} × {fl['seq_len']} tokens: XLA cost_analysis "
             "of the unscanned step (lowered; compiled) vs summary.flops_per_token × tokens (model FLOPs);",
             "  rc = the fused_vocab loss's backward recompute of the logits, 2·V·d per token and table",
             f"  {'variant':<24}{'XLA lowered':>13}{'XLA compiled':>14}{'ours':>12}{'XLA/ours':>10}"
             f"{'rc':>11}{'XLA/(ours+rc)':>15}"]
    for name, r in fl["rows"].items():
        comp = f"{r['xla_compiled_flops']:>14.4e}" if r["xla_compiled_flops"] else f"{'-':>14}"
        lines.append(f"  {name:<24}{r['xla_flops']:>13.4e}{comp}{r['model_flops']:>12.4e}{r['xla/model']:>10.4f}"
                     f"{r['fused_recompute_flops']:>11.3e}{r['xla/(model+recompute)']:>15.4f}")
    lines += [f"    {k:<28} {v:.4f}" for k, v in fl["ratios"].items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- time


def round_robin(fns: dict, steps: int, warmup: int = 1) -> dict:
    """Call every fn once per round (order rotating), `warmup` untimed rounds first;
    returns the per-call seconds of each."""
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(warmup + steps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n]()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
    return times


_DATA: dict = {}  # the bundled corpus, prepared once per process into a temporary directory


def prepared_data(seq_len):
    from onona_jax.data import pipeline

    cache = _DATA
    if "dir" not in cache:
        cache["tmp"] = tempfile.TemporaryDirectory(prefix="onona-bench-")
        cache["dir"] = os.path.join(cache["tmp"].name, "data")
        t0 = time.perf_counter()
        pipeline.ensure_bundled_data(cache["dir"], seq_len)
        cache["prepare_s"] = time.perf_counter() - t0
    pipeline.TokenStore(cache["dir"], "train").num_windows(seq_len)
    return cache["dir"]


def bench_time(size, batch, seq, chunks, steps, log):
    """Step time of every head × loss (× chunk) at one size, stepped round-robin."""
    import jax

    from onona_jax import train as trainer
    from onona_jax.data import pipeline

    dc = default_chunk()
    specs = [(h, "plain", None) for h in HEADS] + [(h, "fused", None) for h in HEADS]
    specs += [(h, "fused_vocab", c) for c in [dc] + [c for c in chunks if c != dc] for h in HEADS]
    probe = make_config(size, "twin", batch=batch, seq=seq)
    batch, seq = probe.train.global_batch, probe.data.seq_len
    data_dir = prepared_data(seq)
    tokens = np.asarray(next(pipeline.train_batches(data_dir, seq, batch)))
    fns, rows, states = {}, {}, {}
    for head, loss, chunk in specs:
        name = variant_name(head, loss, chunk, dc)
        cfg = make_config(size, head, loss, chunk, batch, seq)
        t0 = time.perf_counter()
        run, lowered = lower_step(cfg)
        compiled = lowered.compile()
        states[name] = trainer.init_state(run, cfg.seed)
        b = trainer.global_batch(run, tokens)
        peak = trainer.peak_tflops(cfg)

        def step(name=name, compiled=compiled, b=b):
            states[name], m = compiled(states[name], b)
            jax.block_until_ready((states[name], m))

        fns[name] = step
        rows[name] = {"head": head, "loss": loss, "chunk": chunk if loss == "fused_vocab" else None,
                      "compile_s": time.perf_counter() - t0, **memory_stats(compiled),
                      "flops_per_step": model_flops_per_token(cfg) * batch * seq,
                      "peak_tflops": peak}
        log(f"  time {size} {name}: compiled in {rows[name]['compile_s']:.1f} s")
    times = round_robin(fns, steps)
    for name, ts in times.items():
        r = rows[name]
        med = statistics.median(ts)
        r.update(times_s=ts, median_s=med, min_s=min(ts), tokens_per_s=batch * seq / med,
                 model_tflops_per_s=r["flops_per_step"] / med / 1e12)
        r["mfu"] = r["model_tflops_per_s"] / r["peak_tflops"] if r["peak_tflops"] else None
    def paired(a, b):
        """Median over rounds of a's time / b's time in the same round (shared noise)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    ratios = {}
    flop_ratio = rows["twin/plain"]["flops_per_step"] / rows["standard/plain"]["flops_per_step"]
    for loss in LOSSES:
        t = rows[f"twin/{loss}"]["median_s"] / rows[f"standard/{loss}"]["median_s"]
        p = paired(f"twin/{loss}", f"standard/{loss}")
        ratios[loss] = {"step_time_ratio": t, "paired_step_time_ratio": p, "flop_ratio": flop_ratio,
                        "time/flop": t / flop_ratio, "paired_time/flop": p / flop_ratio,
                        "met": t <= 1.03 * flop_ratio}
    fused_vs_plain = {h: rows[f"{h}/fused"]["median_s"] / rows[f"{h}/plain"]["median_s"] for h in HEADS}
    paired_vs = {f"{a} vs {b}": paired(a, b) for a in rows for b in (f"{rows[a]['head']}/plain", f"{rows[a]['head']}/fused")
                 if a != b and not (a.endswith("/plain") and b.endswith("/fused"))}
    paired_vs.update({f"{h}/fused vs {h}/fused_vocab": paired(f"{h}/fused", f"{h}/fused_vocab") for h in HEADS})
    best = {h: min((r["median_s"], r["chunk"]) for r in rows.values() if r["head"] == h and r["loss"] == "fused_vocab")[1]
            for h in HEADS}
    fused_vs_plain.update({f"{h} fused_vocab": rows[f"{h}/fused_vocab"]["median_s"] / rows[f"{h}/plain"]["median_s"] for h in HEADS})
    return {"size": size, "batch": batch, "seq_len": seq, "steps": steps, "device": jax.devices()[0].device_kind,
            "rows": rows, "twin/standard": ratios, "fused/plain_time": fused_vs_plain, "paired": paired_vs,
            "best_chunk": best}


def format_time(tm) -> str:
    lines = [f"Step time, {tm['size']} Dense, {tm['batch']} × {tm['seq_len']} tokens, {tm['device']}, "
             f"median of {tm['steps']} round-robin steps",
             f"  {'variant':<22}{'median s':>10}{'min s':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'temp GiB':>10}"]
    for name, r in tm["rows"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"  {name:<22}{r['median_s']:>10.4f}{r['min_s']:>10.4f}{r['tokens_per_s']:>12,.0f}"
                     f"{r['model_tflops_per_s']:>10.4f}{mfu:>8}{r['temp_gib']:>10.3f}")
    for loss, r in tm["twin/standard"].items():
        lines.append(f"    twin/standard ({loss}): step time {r['step_time_ratio']:.3f} (paired {r['paired_step_time_ratio']:.3f})"
                     f" vs FLOPs {r['flop_ratio']:.3f} -> {r['time/flop']:.3f} × (paired {r['paired_time/flop']:.3f};"
                     f" target ≤ 1.03: {'met' if r['met'] else 'not met'})")
    lines.append("    paired step-time ratios (median over rounds of time a / time b): "
                 + ", ".join(f"{k} {v:.3f}" for k, v in tm["paired"].items()))
    lines.append("    fused/plain step time: " + ", ".join(f"{h} {v:.3f}" for h, v in tm["fused/plain_time"].items()))
    lines.append("    fastest fused_vocab chunk: " + ", ".join(f"{h} {c}" for h, c in tm["best_chunk"].items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- data


def bench_data(shapes, consumption, flops_142m_twin, log, batches=20, threads=(1,)):
    """tokens/s of the training batch iterator at each (label, seq_len, global_batch) and each
    data.read_threads (prefetch = max(2, threads), the least the config accepts above 2)."""
    from onona_jax import chips
    from onona_jax.data import pipeline

    out = {"rows": {}}
    for label, seq, gb in shapes:
        data_dir = prepared_data(seq)
        for n in threads:
            it = pipeline.train_batches(data_dir, seq, gb, read_threads=n, prefetch=max(2, n))
            next(it)  # start-up and the first prefetch
            t0 = time.perf_counter()
            for _ in range(batches):
                b = next(it)
            dt = time.perf_counter() - t0
            assert b.shape == (gb, seq + 1)
            row = f"{label}, {n} read threads"
            out["rows"][row] = {"seq_len": seq, "global_batch": gb, "read_threads": n, "prefetch": max(2, n),
                                "batches": batches, "batches_per_s": batches / dt,
                                "tokens_per_s": batches * gb * seq / dt}
            log(f"  data {row}: {out['rows'][row]['tokens_per_s']:,.0f} tokens/s")
    h200 = H200_TARGET_MFU * chips.CHIPS["h200"].peak_tflops * 1e12 / flops_142m_twin
    out["needs"] = {"fastest_measured_step": consumption,
                    "paper_142m_twin_2xH100": PAPER_142M_TWIN_TOKENS_PER_S,
                    "one_H200_142m_twin_at_45%_MFU": h200}
    out["ratios"] = {f"{label}/{need}": r["tokens_per_s"] / v
                     for label, r in out["rows"].items() for need, v in out["needs"].items() if v}
    first = next(iter(out["rows"].values()))["tokens_per_s"]
    out["ratio_vs_step"] = first / consumption if consumption else None
    out["prepare_s"] = _DATA.get("prepare_s")
    return out


def format_data(dt) -> str:
    lines = ["Data pipeline (train_batches over the bundled corpus; prefetch = max(2, read threads))"]
    for label, r in dt["rows"].items():
        lines.append(f"  {label:<40} {r['global_batch']:>4} × {r['seq_len']:<5} {r['batches_per_s']:>10,.1f} "
                     f"batches/s {r['tokens_per_s']:>14,.0f} tokens/s")
    for need, v in dt["needs"].items():
        lines.append(f"    consumption {need:<34} {v:>12,.0f} tokens/s" if v else f"    consumption {need}: n/a")
    for k, v in dt["ratios"].items():
        lines.append(f"    {k:<76} {v:>10.1f} ×")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- decode


def bench_decode(size, steps, log, batch=8, prompt_len=16, new_tokens=64, only=None):
    """Decode tokens/s through `serving.Server.generate` (the serving path's own timing of
    its on-device decode loop, compile excluded), round-robin over modes, medians."""
    from onona_jax import models as model_lib
    from onona_jax.serve.server import Server

    modes = {
        "twin/greedy": ("twin", dict(greedy=True)),
        "twin/sample_two_projection": ("twin", dict(temperature=1.0)),
        "twin/sample_one_projection": ("twin", dict(one_projection=True)),
        "standard/greedy": ("standard", dict(greedy=True)),
        "standard/sample": ("standard", dict(temperature=1.0)),
    }
    if only:  # a subset of the modes (the device check's dry run)
        modes = {m: v for m, v in modes.items() if m in only}
    servers = {}
    for head in sorted({h for h, _ in modes.values()}):
        cfg = make_config(size, head)
        _, params = model_lib.init(cfg.model, cfg.seed)
        servers[head] = Server(cfg, params, max_len=max(cfg.data.seq_len, prompt_len + new_tokens))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 50257, (batch, prompt_len)).tolist()
    stats = {m: [] for m in modes}

    def call(mode):
        head, kw = modes[mode]
        s = servers[head]
        s.generate(prompts, new_tokens, seed=len(stats[mode]), **kw)
        stats[mode].append(dict(s.last_stats))

    fns = {m: (lambda m=m: call(m)) for m in modes}
    times = round_robin(fns, steps)  # a failing decode is an error of the bench, never "not measured"
    rows = {}
    for m in modes:
        st = stats[m][1:]  # the first call compiled
        rows[m] = {"decode_tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in st),
                   "tokens_per_s": statistics.median(s["tokens_per_s"] for s in st),
                   "call_s": statistics.median(times[m])}
        log(f"  decode {m}: {rows[m]['decode_tokens_per_s']:,.0f} tokens/s")
    one, two = rows["twin/sample_one_projection"], rows["twin/sample_two_projection"]
    ratio = one["decode_tokens_per_s"] / two["decode_tokens_per_s"]
    return {"status": "measured", "size": size, "batch": batch, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "rows": rows, "one/two_projection": ratio, "met": ratio >= 1.3}


def format_decode(dc) -> str:
    if dc.get("status") != "measured":
        return f"Decode: {dc.get('status')}"
    lines = [f"Decode, {dc['size']} Dense (random init), batch {dc['batch']}, prompt {dc['prompt_len']}, "
             f"{dc['new_tokens']} new tokens, medians",
             f"  {'mode':<30}{'decode tokens/s':>16}{'incl. prefill':>15}"]
    for m, r in dc["rows"].items():
        lines.append(f"  {m:<30}{r['decode_tokens_per_s']:>16,.0f}{r['tokens_per_s']:>15,.0f}")
    lines.append(f"    one-projection / two-projection sampling: {dc['one/two_projection']:.3f} × "
                 f"(target ≥ 1.3: {'met' if dc['met'] else 'not met'})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def targets(res) -> dict:
    """The issue's targets, each met / not met / not measured, with the number behind it."""
    import jax

    out = {}
    mem = res.get("memory")
    if mem:
        r = mem["by_remat"][next(iter(mem["by_remat"]))]["temp_ratios"]
        at = "" if mem["size"] == "142m" else f" (at {mem['size']}, not 142m)"
        out["fused twin peak temp ≤ 1.05 × standard (142M shapes)"] = {
            "value": r["fused_twin/fused_standard"], "plain_twin_ratio": r.get("plain_twin/plain_standard"),
            "status": ("met" if r["fused_twin/fused_standard"] <= 1.05 else "not met") + at}
        heads_r = {k: v for k, v in r.items()
                   if k.startswith("fused_") and not k.startswith("fused_vocab") and k.endswith("/fused_standard")}
        worst = max(heads_r.values())
        out["every head's fused peak temp ≤ 1.10 × standard's (142M shapes)"] = {
            "value": worst, "by_head": heads_r, "status": ("met" if worst <= 1.10 else "not met") + at}
        new_old = {k: v for k, v in r.items() if "/fused_vocab_" in k and not k.startswith("fused_vocab")}
        if new_old:
            w = max(new_old.values())
            out["fused (token-tiled) peak temp ≤ 1.05 × fused_vocab's (142M shapes)"] = {
                "value": w, "by_head": new_old, "status": ("met" if w <= 1.05 else "not met") + at}
    tm = res.get("time")
    if tm:
        r = tm["twin/standard"]["fused"]
        out["twin/standard step time ≤ 1.03 × FLOP ratio"] = {
            "value": r["time/flop"], "status": ("met" if r["met"] else "not met") + f" ({tm['device']}, {tm['size']})"}
    dt = res.get("data")
    if dt and dt.get("ratio_vs_step"):
        out["data pipeline ≥ 10 × consumption"] = {
            "value": dt["ratio_vs_step"], "status": "met" if dt["ratio_vs_step"] >= 10 else "not met"}
    dc = res.get("decode")
    if dc:
        out["one-projection sampling ≥ 1.3 × two-projection tokens/s"] = (
            {"value": dc["one/two_projection"], "status": "met" if dc["met"] else "not met"}
            if dc.get("status") == "measured" else {"value": None, "status": dc.get("status")})
    key = "≥ 45% MFU on one H200, 142M twin"
    mfu = tm["rows"]["twin/fused"]["mfu"] if tm else None
    if "H200" not in jax.devices()[0].device_kind:
        out[key] = {"value": mfu, "status": f"not measured (no H200 here: {jax.devices()[0].device_kind}; "
                                            "run scripts/device_check.sh on one)"}
    elif not tm or tm["size"] != "142m" or mfu is None:
        out[key] = {"value": mfu, "status": "not measured (time the 142m size: scripts/device_check.sh)"}
    else:
        out[key] = {"value": mfu, "status": "met" if mfu >= H200_TARGET_MFU else "not met"}
    return out


def define_sections(fv, argv):
    from onona_jax import config as config_lib

    sizes = ("142m", "small", "tiny", "330m", "1b")
    flags.DEFINE_enum("size", "142m", sizes, "memory and FLOP shapes", flag_values=fv)
    flags.DEFINE_integer("micro_batch", 16, "rows per step for memory/FLOPs", flag_values=fv)
    flags.DEFINE_integer("seq_len", 1024, "sequence length for memory/FLOPs", flag_values=fv)
    flags.DEFINE_enum("time_size", "small", sizes, "the size the time section steps", flag_values=fv)
    flags.DEFINE_integer("time_batch", 0, "0: the time size's own global batch", flag_values=fv)
    flags.DEFINE_integer("time_seq", 0, "0: the time size's own seq_len", flag_values=fv)
    flags.DEFINE_integer("steps", 5, "timed round-robin rounds", flag_values=fv)
    flags.DEFINE_string("chunks", "2048,4096,8192,16384", "fused_vocab-loss chunks to compare ('' = default only)",
                        flag_values=fv)
    flags.DEFINE_string("heads", "standard,twin", f"heads for memory/FLOPs (all: {','.join(ALL_HEADS)})",
                        flag_values=fv)
    flags.DEFINE_string("losses", ",".join(MEMORY_LOSSES), "losses for memory/FLOPs", flag_values=fv)
    flags.DEFINE_string("plain_heads", "standard,twin", "heads whose plain loss the memory section compiles",
                        flag_values=fv)
    flags.DEFINE_string("remat", "none", "comma list of model.remat for the memory table", flag_values=fv)
    flags.DEFINE_string("sections", ",".join(SECTIONS), "sections to run", flag_values=fv)
    flags.DEFINE_string("data_threads", "0,1,4", "data section: the data.read_threads to time", flag_values=fv)
    flags.DEFINE_bool("compiled_flops", True, "FLOPs of the compiled module too (--nocompiled_flops: the "
                      "lowered one only)", flag_values=fv)
    flags.DEFINE_string("output", "bench.json", "JSON of every figure", flag_values=fv)
    # --config.<key>=<value> (e.g. --config.model.attention_impl=cudnn) applies to every variant
    return config_lib.define_flag(fv, argv, f"{common.CONFIGS}:dense-142m-twin")


def main_sections(fv, rest, argv):
    from onona_jax import config as config_lib

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    args = fv
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        raise cli.UsageError(f"--sections: choose from {SECTIONS}")
    chunks = [int(c) for c in args.chunks.split(",") if c]
    heads = [h for h in args.heads.split(",") if h]
    losses = [x for x in args.losses.split(",") if x]
    plain_heads = [h for h in args.plain_heads.split(",") if h]
    if set(heads) - set(ALL_HEADS) or set(losses) - set(MEMORY_LOSSES):
        raise cli.UsageError(f"--heads: choose from {ALL_HEADS}; --losses: from {MEMORY_LOSSES}")
    OVERRIDES.update(config_lib.overridden(fv.config, argv))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/bench.py " + " ".join(argv),
        "machine": common.record(),  # again when written: the load after
        "default_chunk": default_chunk(),
        "overrides": OVERRIDES,
    }
    tables = []
    if "memory" in sections:
        res["memory"] = bench_memory(args.size, args.micro_batch, args.seq_len, chunks,
                                     args.remat.split(","), log, heads, losses, plain_heads)
        tables.append(format_memory(res["memory"]))
    if "flops" in sections:
        res["flops"] = bench_flops(args.size, args.micro_batch, args.seq_len, log, args.compiled_flops,
                                   heads, losses)
        tables.append(format_flops(res["flops"]))
    if "head_memory" in sections:
        res["head_memory"] = bench_head_memory(args.size, args.micro_batch, args.seq_len, heads, losses, log)
        tables.append(format_head_memory(res["head_memory"]))
    if "time" in sections:
        res["time"] = bench_time(args.time_size, args.time_batch or None, args.time_seq or None,
                                 chunks, args.steps, log)
        tables.append(format_time(res["time"]))
    if "data" in sections:
        consumption = max(r["tokens_per_s"] for r in res["time"]["rows"].values()) if "time" in res else None
        t = res.get("time") or {}
        probe = make_config(args.time_size, "twin", batch=args.time_batch or None, seq=args.time_seq or None)
        big = make_config(args.size, "twin")
        shapes = [(f"{args.time_size} step shape", t.get("seq_len", probe.data.seq_len),
                   t.get("batch", probe.train.global_batch)),
                  (f"{args.size} global batch", big.data.seq_len, big.train.global_batch)]
        flops_142m = model_flops_per_token(make_config("142m", "twin"))
        threads = [int(n) for n in args.data_threads.split(",") if n]
        res["data"] = bench_data(shapes, consumption, flops_142m, log, threads=threads)
        tables.append(format_data(res["data"]))
    if "decode" in sections:
        res["decode"] = bench_decode(args.time_size, min(max(args.steps, 3), 10), log)
        tables.append(format_decode(res["decode"]))
    res["targets"] = targets(res)
    tables.append("Targets\n" + "\n".join(
        f"  {k}: {v['status']}" + (f" ({v['value']:.3f})" if isinstance(v.get("value"), float) else "")
        for k, v in res["targets"].items()))
    print("\n\n".join(tables))
    if args.output:
        res["machine"] = common.record()
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2, default=str)
        log(f"wrote {args.output}")
