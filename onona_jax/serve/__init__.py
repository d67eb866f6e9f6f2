"""Serving and interchange: the folded-table `server` with KV-cache decoding and exact
one-projection sampling, the `generate` CLI, `export` to transformers folders through the one
HF format (`hf_format`), and `hf/`, the standalone transformers model every export carries."""
