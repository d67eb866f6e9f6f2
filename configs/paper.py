"""The paper's models and training recipe: `configs/paper.py:<arch>-<size>-<head>`.

    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin
    python train.py --config=configs/paper.py:dense-small-standard --config.train.steps=500

Sizes `142m`, `330m`, `1b` are the paper's (SPEC §3-4); `tiny` is for tests and `small`
for experiments that finish in minutes on a 2-core CPU. `3b` and `8b` go past the paper with
Llama-3.2-3B's and Llama-3-8B's trunk shapes (GQA 8 KV heads of 128; 8b's FFN 14,336 wide):
Dense Standard 3.21B and 7.50B parameters at Llama-3's vocabulary
(`--config.data.tokenizer=size:128256`), 2.97B and 7.19B at GPT-2's (docs/training.md, "Configs and overrides").
The experiment grids over these specs are in onona_jax/experiments/grids.py.
"""

import math

from onona_jax.config import ARCHS, HEADS, base_config, ffn_width, validate

# d_ff 0: config.ffn_width(d_model), 8d/3 rounded up to 64 (SPEC §3).
#            d_model  layers  heads  kv_heads  head_dim  d_ff
SIZES = {
    "tiny": (64, 2, 4, 2, 16, 0),
    "micro": (128, 2, 4, 2, 32, 0),  # the CPU replication (docs/results.md), with a small BPE
    "small": (128, 4, 4, 2, 32, 0),
    "142m": (768, 16, 12, 6, 64, 0),
    "330m": (1024, 24, 16, 8, 64, 0),
    "1b": (2048, 20, 32, 16, 64, 0),
    "3b": (3072, 28, 24, 8, 128, 0),  # Llama-3.2-3B's trunk (its FFN, 8,192, is ffn_width's)
    "8b": (4096, 32, 32, 8, 128, 14_336),  # Llama-3-8B's trunk (ffn_width would give 10,944: 6.2B)
}

# Training per size: tokens a step = global_batch × seq_len. 40 tokens per parameter of the
# Dense Standard model of that size sets the step count (train.steps = 0).
#          global_batch  micro_batch  seq_len  steps  warmup  eval_every  windows  ckpt_every
TRAIN = {
    "tiny": (8, 0, 32, 50, 5, 25, 16, 25),  # micro_batch 0: the whole batch per replica
    "small": (8, 0, 128, 200, 20, 100, 64, 100),
    "micro": (32, 0, 128, 0, 100, 500, 128, 500),  # steps 0: 20 tokens per Dense Standard parameter (TPP)
    "142m": (256, 16, 1024, 0, 1000, 500, 1024, 1000),
    "330m": (256, 16, 1024, 0, 1000, 500, 1024, 1000),
    "1b": (512, 8, 1024, 78_800, 1000, 500, 1024, 1000),  # the paper ran 78,800 steps (≈40.07 TPP)
    # Past the paper: 4,096-token sequences, 2M (3b) and 4M (8b) tokens a step, 40 TPP; micro_batch 0,
    # as `python -m onona_jax.aot --fit` plans it (docs/notes/scaling-log.md "Sizes past the paper").
    "3b": (512, 0, 4096, 0, 2000, 1000, 256, 1000),
    "8b": (1024, 0, 4096, 0, 2000, 1000, 256, 1000),
}
# Peak and final learning rates where the paper's 1e-3 / 1e-4 is too high (Llama-3's 3e-4 at 8B).
LR = {"3b": (3e-4, 3e-5), "8b": (3e-4, 3e-5)}


def long_context(c, seq_len: str | int):
    """`<spec>@<seq_len>` (e.g. dense-142m-twin@4096), or `@<n>x` (n × the size's context: @4x is
    4,096 at the paper's sizes, 512 at small): windows of seq_len tokens with the size's
    batch in tokens kept — global batch, micro batch and validation windows divided by the ratio, so
    steps, tokens and evaluated tokens stay the paper's. RoPE keeps model.rope_theta (10,000; a
    config key: --config.model.rope_theta=500000 for a larger base)."""
    base = c.data.seq_len
    try:
        seq = base * int(seq_len[:-1]) if str(seq_len).endswith("x") else int(seq_len)
    except ValueError:
        raise ValueError(f"context @{seq_len}: a number of tokens or a multiple of the size's, e.g. @4096 or @4x") from None
    t = c.train
    scaled = {"global_batch": t.global_batch * base, "micro_batch": t.micro_batch * base,
              "windows": c.eval.windows * base}
    if seq <= 0 or any(v % seq for v in scaled.values()):
        raise ValueError(f"context @{seq}: the batch of {t.global_batch} × {base} tokens (micro batch {t.micro_batch}, "
                         f"{c.eval.windows} validation windows) does not divide into whole windows of {seq} tokens; "
                         f"choose a divisor of {math.gcd(*scaled.values())}")
    c.data.seq_len = seq
    t.global_batch, t.micro_batch = scaled["global_batch"] // seq, scaled["micro_batch"] // seq
    c.eval.windows = scaled["windows"] // seq


def get_config(arg: str = "dense-small-twin"):
    try:
        arch, size, head = arg.split("-", 2)
    except ValueError:
        raise ValueError(f"config arg {arg!r}: expected <arch>-<size>-<head>[@<seq_len>], e.g. dense-142m-twin")
    head, _, context = head.partition("@")
    if arch not in ARCHS or size not in SIZES or head not in HEADS:
        raise ValueError(
            f"config arg {arg!r}: arch in {ARCHS}, size in {tuple(SIZES)}, head in {HEADS}"
        )
    c = base_config()
    c.name = arg
    d, layers, heads, kv, head_dim, d_ff = SIZES[size]
    c.model.update(
        arch=arch, head=head, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
        head_dim=head_dim, d_ff=d_ff or ffn_width(d),
    )
    gb, mb, seq, steps, warmup, eval_every, windows, ckpt = TRAIN[size]
    c.train.update(
        global_batch=gb, micro_batch=mb, steps=steps, warmup_steps=warmup,
        eval_every=eval_every, checkpoint_every=ckpt,
    )
    c.data.seq_len = seq
    c.eval.windows = windows
    if size in LR:
        c.train.lr, c.train.final_lr = LR[size]
    if context:
        long_context(c, context)
    # Families (SPEC §3). MoE: 8 experts of half the dense FFN width, top-2, so the active
    # FFN matches Dense. GDN: heads of 128 dims covering d_model.
    c.model.moe.d_expert = c.model.d_ff // 2
    c.model.gdn.n_heads = max(1, d // 128)
    c.model.gdn.head_dim_k = c.model.gdn.head_dim_v = min(128, d)
    if arch == "gdn":  # whole 3 GDN : 1 attention groups
        c.model.n_layers = 4 * -(-layers // 4)
    if size == "micro":  # ≥ 20 TPP: 6 runs in ≤ 2 h on 2 CPU cores at a ~1k-entry BPE (docs/results.md)
        c.train.tokens_per_param = 20.0
    if size in ("tiny", "small", "micro"):
        c.model.dtype = "float32"  # CPU: bf16 matmuls are emulated and slower
        c.train.lr = 3e-3
        c.train.final_lr = 3e-4
        c.train.log_every = 5
    # Checked, but returned unresolved: model.vocab_size = 0 follows whatever data.tokenizer the
    # command line sets (validate fills it in).
    validate(c.copy_and_resolve_references())
    return c

