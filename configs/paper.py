"""The paper's models and training recipe: `configs/paper.py:<arch>-<size>-<head>`.

    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin
    python train.py --config=configs/paper.py:dense-small-standard --config.train.steps=500

Sizes `142m`, `330m`, `1b` are the paper's (SPEC §3-4); `tiny` is for tests and `small`
for experiments that finish in minutes on a 2-core CPU.
"""

from onona_jax.config import ARCHS, HEADS, base_config, ffn_width, validate

#            d_model  layers  heads  kv_heads  head_dim
SIZES = {
    "tiny": (64, 2, 4, 2, 16),
    "small": (128, 4, 4, 2, 32),
    "142m": (768, 16, 12, 6, 64),
    "330m": (1024, 24, 16, 8, 64),
    "1b": (2048, 20, 32, 16, 64),
}

# Training per size: tokens a step = global_batch × seq_len. 40 tokens per parameter of the
# Dense Standard model of that size sets the step count (train.steps = 0).
#          global_batch  micro_batch  seq_len  steps  warmup  eval_every  windows  ckpt_every
TRAIN = {
    "tiny": (8, 8, 32, 50, 5, 25, 16, 25),
    "small": (8, 8, 128, 200, 20, 100, 64, 100),
    "142m": (256, 16, 1024, 0, 1000, 500, 1024, 1000),
    "330m": (256, 16, 1024, 0, 1000, 500, 1024, 1000),
    "1b": (512, 8, 1024, 78_800, 1000, 500, 1024, 1000),  # the paper ran 78,800 steps (≈40.07 TPP)
}


def get_config(arg: str = "dense-small-twin"):
    try:
        arch, size, head = arg.split("-", 2)
    except ValueError:
        raise ValueError(f"config arg {arg!r}: expected <arch>-<size>-<head>, e.g. dense-142m-twin")
    if arch not in ARCHS or size not in SIZES or head not in HEADS:
        raise ValueError(
            f"config arg {arg!r}: arch in {ARCHS}, size in {tuple(SIZES)}, head in {HEADS}"
        )
    c = base_config()
    c.name = arg
    d, layers, heads, kv, head_dim = SIZES[size]
    c.model.update(
        arch=arch, head=head, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
        head_dim=head_dim, d_ff=ffn_width(d),
    )
    gb, mb, seq, steps, warmup, eval_every, windows, ckpt = TRAIN[size]
    c.train.update(
        global_batch=gb, micro_batch=mb, steps=steps, warmup_steps=warmup,
        eval_every=eval_every, checkpoint_every=ckpt,
    )
    c.data.seq_len = seq
    c.eval.windows = windows
    # Families (SPEC §3). MoE: 8 experts of half the dense FFN width, top-2, so the active
    # FFN matches Dense. GDN: heads of 128 dims covering d_model.
    c.model.moe.d_expert = c.model.d_ff // 2
    c.model.gdn.n_heads = max(1, d // 128)
    c.model.gdn.head_dim_k = c.model.gdn.head_dim_v = min(128, d)
    if size in ("tiny", "small"):
        c.model.dtype = "float32"  # CPU: bf16 matmuls are emulated and slower
        c.train.lr = 3e-3
        c.train.final_lr = 3e-4
        c.train.log_every = 5
    return validate(c)
