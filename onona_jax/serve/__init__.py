"""Serving and interchange: the folded-table `server` with KV-cache decoding and exact
one-projection sampling, the `generate` CLI, `export` to transformers folders, `convert`
between our parameter tree and HF names, and the paper's PyTorch reference (`torch_ref`)."""
