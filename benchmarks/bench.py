"""One device's benchmarks of the model: its train step (memory, FLOPs, time), the data pipeline,
decoding, the four families, MoE dispatch, compile time and its cache, data preparation, and the
fingerprint of the program a slice would run. `--what` picks the mode (default: sections); each
mode has its own flags (`--what=<mode> --help` lists them):

    python benchmarks/bench.py [--what=sections] [--size=142m|small|tiny] [--steps=5] [--output=bench.json]
        [--time_size=small] [--chunks=2048,4096,8192,16384] [--remat=none,full]
        [--sections=memory,flops,time,data,decode,head_memory] [--config.model.attention_impl=cudnn]
    python benchmarks/bench.py --what=families [--size=small] [--steps=10] [--warmup=2] [--nocompile] [--output=FILE]
    python benchmarks/bench.py --what=moe [--reps=10] [--shapes=tiny,small,142m,142m-T512]
    python benchmarks/bench.py --what=compile --config=configs/paper.py:dense-142m-twin [--micro_batch=1]
    python benchmarks/bench.py --what=compile_cache [--config=configs/paper.py:dense-small-twin]
        [--aot_config=configs/paper.py:dense-142m-twin --aot_topology=v5e-16]
    flock /tmp/onona-heavy.lock python benchmarks/bench.py --what=prepare [--copies=4] [--rounds=3]
        [--workers=1,2] [--format=jsonl] [--output=FILE]
    PYTHONPATH=/tmp/base python benchmarks/bench.py --what=program_hash --root=/tmp/base   # before a change
    python benchmarks/bench.py --what=program_hash                                          # after it
        [--slice=v5e-16] [--configs=dense-142m-twin,dense-142m-standard,gdn-142m-twin] [--micro_batch=4]

## --what=sections (the default)

Sections (each a table on stdout and a key of the JSON output):

* memory  -- the compiled train step of `--size` at the paper's micro-batch (16 × 1,024 by
  default, one device, no accumulation): XLA's `memory_analysis()` peak temporary and
  argument bytes, for every `--heads` with the fused loss (token-tiled, gradients in the
  forward pass: loss.py), the vocabulary-tiled fused_vocab loss (loss_vocab.py, at every
  `--chunks` size; heads without a score transform) and the plain loss (`--plain_heads`).
  Lowered from abstract shapes, so nothing of the model is allocated; exact and free of
  timing noise. Ratios head/standard per loss, and fused/fused_vocab per head.
* flops   -- XLA's `cost_analysis()["flops"]` of the step beside `summary.flops_per_token ×
  tokens`. XLA counts a scan body once, so this lowers with `scan_layers=False`, one token
  tile for the fused loss and one vocabulary tile for fused_vocab (the FLOPs depend on
  neither). fused_vocab recomputes the logits in the backward pass: +2·V·d FLOPs per token
  and table over `flops_per_token`, which counts model FLOPs; fused computes its gradients
  in the forward pass from logits computed once: no recompute. The lowered (unoptimised) module
  shows that recompute; in the compiled one XLA may merge the one tile's forward and
  backward logits (common-subexpression elimination), which the real chunked scan cannot.
* time    -- step time at `--time_size` (default small, that size's own batch and sequence
  unless `--time_batch/--time_seq`), every variant compiled first and then stepped
  round-robin (the order rotating each round), so machine noise hits all alike; medians
  over `--steps`. tokens/s, achieved model TFLOP/s and MFU where `trainer.peak_tflops`
  knows the device (not on CPU). The twin/standard step-time ratio against the FLOP ratio,
  as a ratio of medians and "paired" (the median over rounds of the two arms' time ratio in
  the same round, which cancels load that changes between rounds).
* data    -- tokens/s of `data.pipeline.train_batches` over the bundled corpus (prepared
  once into a temporary directory) at the timing shape and at `--size`'s training shape,
  against the fastest measured train step's consumption (target ≥ 10×) and against the
  rate one H200 would consume at 45% MFU.
* decode  -- `serving.Server.generate` tokens/s at `--time_size` (random-init weights, no
  stop token): greedy and temperature-1 sampling of the mixture (two projections) and the
  exact one-projection sampler (twin), and standard greedy/sampling; round-robin, medians.

## --what=families

Train-step time and compile time of the four decoder families (dense, moe, gdn, attnres) under
the standard and twin heads. Every variant (family × head, as `configs/paper.py:<arch>-<size>-<head>`,
its own batch and sequence length) is compiled and warmed up first; then the timed steps run
round-robin, one step of each variant in turn, so that load from other jobs hits all variants
alike and the ratios to Dense hold on a noisy machine. Reported per variant: the median step
time over `--steps` timed steps, its ratio to Dense with the same head, tokens/s (global_batch ×
seq_len / median), and the compile time of the full train step (forward, backward, AdamW)
lowered from abstract shapes with and without `scan_layers` (as --what=compile). Batches are
random tokens: the step's work does not depend on their values (MoE capacity buffers have fixed
shapes). Prints a Markdown table and writes JSON with `--output`.

## --what=moe

Grouped (ragged_dot), dense (one-hot einsum) and sort (gather) MoE dispatch: one MoE layer's
jitted forward and forward+backward, fp32, at the tiny/small configs' training shapes and at 142M
widths with a short sequence; every dispatch compiled first, then timed in alternation. Prints
JSON (milliseconds, min and median of --reps).

## --what=compile

Compile time of the training step with and without layer scanning: the full train step
(forward, backward, AdamW) of `--config` lowered and compiled from abstract shapes on one device
of this machine, so nothing is allocated; prints one JSON line of seconds per variant.

## --what=compile_cache

Compile time of a first and a second start with the persistent compilation cache (issue 27).
Each start is a new process with an empty in-memory cache, sharing one fresh cache directory
(train.compile_cache, default threshold train.compile_cache_min_s = 1 s):

* train: `python train.py` for one step (`--config` and its `--config.*` overrides), twice (a
  fresh workdir each; the second reads the data the first prepared); the figure is the first
  logged step's `compile_s` (the train step's compile, or its load from the cache) and
  `compile_cache_hits`.
* aot (with --aot_config): `python -m onona_jax.aot` twice, deviceless with libtpu, under
  `flock /tmp/onona-heavy.lock` (heavy compiles queue on that lock), the cache turned on through
  JAX_COMPILATION_CACHE_DIR (`onona_jax.aot` leaves it off: README, "Compilation cache"); the
  figure is the report's train-step `compile_s` (lower + compile).

Prints one JSON object with both starts' seconds per part.

## --what=prepare

Throughput of `python -m onona_jax.data.prepare` (tokens/s) against --workers, end to end. The
corpus is the bundled Austen text repeated `--copies` times (about 1M tokens a copy), one
document per paragraph, written as `.jsonl` (or `.txt`/`.parquet`). Each round times one full
prepare per worker count, in turn (paired rounds: load from other jobs on a shared machine hits
every arm alike), including the start of the worker processes and the writing of the shards.
Prints tokens/s per arm (median over rounds), each round's speed-up over the first arm, the CPU
seconds of the main process and of the workers (how the work divides, whatever the load), the
load average before and after, and checks that every arm wrote bit-identical shards (exit 1 if
not). This process runs no jax, so prepare's worker pool forks as it does for a user.

## --what=program_hash

A fingerprint of the train step a slice would run: the sha256 of its lowered program (StableHLO,
deviceless, no compile), per config. Two checkouts that print the same hashes compile the same
program, so its HBM and FLOPs (`python -m onona_jax.aot`) are equal too; a CPU-only change
(loss.resolve_token_tile, attention's query blocks) must leave them unchanged: run it with the
checkout before the change on PYTHONPATH and `--root` (its configs), then in this one. The mesh
is `--slice`'s devices on the fsdp axis, `--micro_batch` sequences per device. A GPU slice
(h100-8, ...) needs the CUDA plugin (`pip install -e '.[gpu-aot]'`).
"""

from __future__ import annotations

import sys

# One module a mode, beside this script. jax (and the onona_jax modules that import it: config,
# loss, summary, train) is imported where it is used: a mode that runs no jax in this process
# (--what=prepare, whose worker pool forks only where no other thread runs; --what=program_hash,
# which picks JAX's platform first, and may run with an older checkout's onona_jax on PYTHONPATH)
# starts none.
import bench_compile
import bench_compile_cache
import bench_families
import bench_moe
import bench_prepare
import bench_program_hash
import bench_sections
import common  # benchmarks/common.py, beside this script

# --what=<mode>: (define, main, whether stdout is one JSON object: the machine's line goes to stderr then)
WHAT = {
    "sections": (bench_sections.define_sections, bench_sections.main_sections, False),
    "families": (bench_families.define_families, bench_families.main_families, False),
    "moe": (bench_moe.define_moe, bench_moe.main_moe, True),
    "compile": (bench_compile.define_compile, bench_compile.main_compile, True),
    "compile_cache": (bench_compile_cache.define_compile_cache, bench_compile_cache.main_compile_cache, True),
    "prepare": (bench_prepare.define_prepare, bench_prepare.main_prepare, False),
    "program_hash": (bench_program_hash.define_program_hash, bench_program_hash.main_program_hash, False),
}


def main(argv=None) -> int:
    return common.run_modes(WHAT, "sections", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
