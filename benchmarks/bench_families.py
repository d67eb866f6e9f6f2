"""`python benchmarks/bench.py --what=families`: train-step and compile time of the four decoder
families under the standard and twin heads, stepped round-robin (bench.py's docstring)."""

from __future__ import annotations

import datetime
import json
import statistics
import time

import numpy as np

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli
from bench_sections import HEADS


FAMILIES = ("dense", "moe", "gdn", "attnres")


def compile_seconds(cfg) -> float:
    """Seconds to lower and compile the train step from abstract shapes on one device (nothing
    allocated; the setup before it not counted)."""
    import jax

    from onona_jax import train as trainer

    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.abstract_train_state(run)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32,
                                 sharding=run.batch_sharding)
    step = trainer.make_train_step(run)
    start = time.perf_counter()
    step.lower(state, batch).compile()
    return time.perf_counter() - start


def family_config(arch, size, head, scan=True):
    from onona_jax import config as config_lib

    cfg = config_lib.load(f"{common.CONFIGS}:{arch}-{size}-{head}")
    cfg.mesh.update(data=1, fsdp=1, tensor=1)
    cfg.model.scan_layers = scan
    return cfg


class Variant:
    """One family × head: its compiled step, live state and a fixed random batch."""

    def __init__(self, arch, size, head, seed=0):
        import jax

        from onona_jax import summary
        from onona_jax import train as trainer

        self.arch, self.head = arch, head
        self.label = f"{arch}-{size}-{head}"
        self.cfg = cfg = family_config(arch, size, head)
        self.run = trainer.setup(cfg, jax.devices()[:1])
        self.state = trainer.init_state(self.run, cfg.seed)
        self.step_fn = trainer.make_train_step(self.run)
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, 50257, (cfg.train.global_batch, cfg.data.seq_len + 1), dtype=np.int32)
        self.batch = trainer.global_batch(self.run, tokens)
        self.tokens = cfg.train.global_batch * cfg.data.seq_len
        self.times: list[float] = []
        counts = summary.param_counts(cfg.model)
        self.non_embedding, self.active = counts["non_embedding"], counts["active"]
        self.flops = summary.flops_per_token(cfg.model, cfg.data.seq_len)["train"]

    def step(self) -> float:
        import jax

        start = time.perf_counter()
        self.state, metrics = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        elapsed = time.perf_counter() - start
        self.loss = float(metrics["loss"])
        return elapsed


def bench_families(size, families, heads, steps, warmup, compile_times=True, log=print):
    variants = []
    for arch, head in [(arch, head) for head in heads for arch in families]:
        start = time.perf_counter()
        v = Variant(arch, size, head)
        for _ in range(warmup + 1):  # the first call compiles
            v.step()
        log(f"{v.label}: ready in {time.perf_counter() - start:.1f} s")
        variants.append(v)
    for i in range(steps):  # round-robin: one step of every variant in turn
        for v in variants:
            v.times.append(v.step())
        log(f"round {i + 1}/{steps}")
    rows = []
    for v in variants:
        median = statistics.median(v.times)
        rows.append(dict(
            arch=v.arch, head=v.head, config=v.label,
            non_embedding=v.non_embedding, active=v.active, train_flops_per_token=v.flops,
            global_batch=v.cfg.train.global_batch, seq_len=v.cfg.data.seq_len,
            step_s_median=median, step_s_min=min(v.times), steps=len(v.times),
            tokens_per_s=v.tokens / median, final_loss=v.loss,
        ))
    for r in rows:
        dense = next(d for d in rows if d["arch"] == "dense" and d["head"] == r["head"])
        r["vs_dense"] = r["step_s_median"] / dense["step_s_median"]
    if compile_times:
        for r in rows:
            for scan in (True, False):
                key = "compile_s_scan" if scan else "compile_s_unrolled"
                r[key] = compile_seconds(family_config(r["arch"], size, r["head"], scan))
            log(f"{r['config']}: compile {r['compile_s_scan']:.1f} s scanned, "
                f"{r['compile_s_unrolled']:.1f} s unrolled")
    return rows


def format_families(rows) -> str:
    has_compile = "compile_s_scan" in rows[0]
    head = ("| config | non-embedding | train GFLOP/token | step (median) | × Dense | tokens/s |"
            + (" compile scanned | compile unrolled |" if has_compile else ""))
    sep = "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if has_compile else "")
    lines = [head, sep]
    for r in rows:
        line = (f"| {r['config']} | {r['non_embedding']:,} | {r['train_flops_per_token'] / 1e9:.4f} | "
                f"{r['step_s_median'] * 1e3:.0f} ms | {r['vs_dense']:.2f} | {r['tokens_per_s']:,.0f} |")
        if has_compile:
            line += f" {r['compile_s_scan']:.1f} s | {r['compile_s_unrolled']:.1f} s |"
        lines.append(line)
    return "\n".join(lines)


def define_families(fv, argv):
    flags.DEFINE_string("size", "small", "a configs/paper.py size: small (default) or tiny", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "timed steps per variant", flag_values=fv)
    flags.DEFINE_integer("warmup", 2, "untimed steps per variant after compiling", flag_values=fv)
    flags.DEFINE_list("families", list(FAMILIES), "families to time (dense among them)", flag_values=fv)
    flags.DEFINE_list("heads", list(HEADS), "heads to time", flag_values=fv)
    flags.DEFINE_bool("compile", True, "measure compile times (--nocompile: skip)", flag_values=fv)
    flags.DEFINE_string("output", "", "write the results as JSON here", flag_values=fv)


def main_families(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    families, heads = fv.families, fv.heads
    if "dense" not in families:
        raise cli.UsageError("--families must include dense (the ratios are to it)")
    if set(families) - set(FAMILIES):
        raise cli.UsageError(f"--families={','.join(families)}: choose from {', '.join(FAMILIES)}")
    rows = bench_families(fv.size, families, heads, fv.steps, fv.warmup, fv.compile, common.log)
    table = format_families(rows)
    print(table)
    if fv.output:
        meta = dict(
            date=datetime.date.today().isoformat(), command="python benchmarks/bench.py " + " ".join(argv),
            size=fv.size, steps=fv.steps, warmup=fv.warmup, machine=common.record(),
        )
        with open(fv.output, "w") as f:
            json.dump({**meta, "rows": rows, "markdown": table}, f, indent=2)
