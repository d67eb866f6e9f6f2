#!/usr/bin/env bash
# Tokens/s and model FLOPs utilisation of the 142M Dense twin and standard train steps on ONE
# GPU (target: twin >= 45% MFU on one H200), at the paper's micro-batch 16 x 1,024, bf16.
#
#     bash scripts/gpu_mfu.sh                 # ~50 timed steps per variant, writes gpu_mfu.json
#     STEPS=100 ATTN=cudnn bash scripts/gpu_mfu.sh
#
# Data: the bundled corpus (prepared once into a temp dir; one batch reused for every step).
# Variants: standard and twin, plain and fused loss, stepped round-robin after compiling, so
# the twin/standard ratio is robust to noise; MFU = model FLOPs (summary.flops_per_token,
# no recompute) / step time / peak (trainer.PEAK_TFLOPS: H100/H200 989 TFLOP/s dense bf16;
# set PEAK=<TFLOP/s> to override). Also: XLA's memory_analysis of the same steps on the GPU
# (the peak-temporary-memory target, on the real backend), the data pipeline's tokens/s
# against the step's consumption, and decode tokens/s (greedy, one- and two-projection
# sampling). Budget: ~4 compiles for memory + 4 for timing + 4 x STEPS steps + decode,
# a few minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the repo, installed or not
PY=${PYTHON:-python3}
# The lent H200 image has jax/flax/optax/orbax/tiktoken but (as of 2026-11) not ml_collections or
# grain: carry their wheels (see /work/.library/device/README.md) and pip-install them first.
"$PY" -c 'import jax, flax, optax, orbax.checkpoint, grain, tiktoken, ml_collections' || {
    echo "missing Python packages (above); install them, then rerun" >&2; exit 3; }

SIZE=${SIZE:-142m}               # SIZE=tiny BATCH=8 SEQ=32 STEPS=2: a CPU smoke test of this script
BATCH=${BATCH:-16}
SEQ=${SEQ:-1024}
STEPS=${STEPS:-50}
OUT=${OUT:-gpu_mfu.json}
CHUNKS=${CHUNKS:-}              # e.g. CHUNKS=4096,8192 to time fused-loss tiles too
SECTIONS=${SECTIONS:-time,memory,data,decode}
args=()
[[ -n "${ATTN:-}" ]] && args+=(--override "model.attention_impl=${ATTN}")   # cudnn: flash attention
[[ -n "${PEAK:-}" ]] && args+=(--override "train.peak_tflops=${PEAK}")
[[ -n "${REMAT:-}" ]] && args+=(--override "model.remat=${REMAT}")

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

"$PY" benchmarks/bench.py \
    --sections="${SECTIONS}" \
    --size="${SIZE}" --micro_batch="${BATCH}" --seq_len="${SEQ}" \
    --time_size="${SIZE}" --time_batch="${BATCH}" --time_seq="${SEQ}" \
    --steps="${STEPS}" --chunks="${CHUNKS}" \
    "${args[@]}" --output="${OUT}"

"$PY" - "${OUT}" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for name in ("twin/fused", "standard/fused", "twin/plain", "standard/plain"):
    row = r["time"]["rows"][name]
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    print(f"{name:<16} {row['tokens_per_s']:>12,.0f} tokens/s   MFU {mfu}   median step {row['median_s'] * 1e3:.1f} ms")
t = r["time"]["rows"]["twin/fused"]
print(f"TARGET >= 45% MFU, {r['time']['size']} twin on one {r['machine']['device']}:",
      "not measured (no peak for this device)" if t["mfu"] is None else ("met" if t["mfu"] >= 0.45 else "not met"))
EOF
