"""Serving and interchange: the folded-table `server` with KV-cache decoding and exact
one-projection sampling, the `generate` CLI, `export` to transformers folders through the one
HF format (`hf_format`), `hf/`, the standalone transformers model every export carries, and
`vllm/`, the vLLM plugin that serves exports (torch and vllm only; its own venv)."""
