#!/usr/bin/env bash
# One prepared accelerator run, at most ~8 minutes on one H200 (see benchmarks/device_check.py):
# 142M Dense standard and twin at 16 x 1,024 tokens, bf16: tokens/s, MFU and peak device memory
# with the fused loss (XLA and cuDNN attention), the vocabulary-tiled fused_vocab loss at two
# chunks and the plain loss; MoE 142M's sort vs grouped dispatch and GDN 142M at model.gdn.precision
# highest vs default (twin); decode tokens/s, two- vs one-projection sampling. Writes
# OUT_DIR/device_check.json and OUT_DIR/device_check.md.
#
#     bash scripts/device_check.sh OUT_DIR [--steps=20] [--budget_s=420]
#     bash scripts/device_check.sh OUT_DIR --dry_run     # tiny shapes on the CPU (tests/integration/test_device_check.py)
#
# Then copy OUT_DIR/device_check.md into docs/performance.md with the date and the device.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "error: usage: bash scripts/device_check.sh OUT_DIR [--dry_run] [--steps=N] [--budget_s=S]" >&2
    exit 2
fi
OUT_DIR=$1
shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the repo, installed or not
PY=${PYTHON:-python3}
# The lent H200 image has jax/flax/optax/orbax/tiktoken but (as of 2026-11) not ml_collections or
# grain: carry their wheels (see /work/.library/device/README.md) and pip-install them first.
"$PY" -c 'import jax, flax, optax, orbax.checkpoint, grain, tiktoken, ml_collections' || {
    echo "error: missing Python packages (above); install them, then rerun" >&2; exit 3; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$PY" benchmarks/device_check.py --out_dir="$OUT_DIR" "$@"
