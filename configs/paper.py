"""The paper's models and training recipe: `configs/paper.py:<arch>-<size>-<head>`.

    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin
    python train.py --config=configs/paper.py:dense-small-standard --config.train.steps=500

Sizes `142m`, `330m`, `1b` are the paper's (SPEC §3-4); `tiny` is for tests and `small`
for experiments that finish in minutes on a 2-core CPU. `3b` and `8b` go past the paper with
Llama-3.2-3B's and Llama-3-8B's trunk shapes (GQA 8 KV heads of 128; 8b's FFN 14,336 wide):
Dense Standard 3.21B and 7.50B parameters at Llama-3's vocabulary
(`--config.data.tokenizer=size:128256`), 2.97B and 7.19B at GPT-2's (README "Models and configs").
"""

from onona_jax.config import ARCHS, HEADS, base_config, ffn_width, validate

# d_ff 0: config.ffn_width(d_model), 8d/3 rounded up to 64 (SPEC §3).
#            d_model  layers  heads  kv_heads  head_dim  d_ff
SIZES = {
    "tiny": (64, 2, 4, 2, 16, 0),
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
    "142m": (256, 16, 1024, 0, 1000, 500, 1024, 1000),
    "330m": (256, 16, 1024, 0, 1000, 500, 1024, 1000),
    "1b": (512, 8, 1024, 78_800, 1000, 500, 1024, 1000),  # the paper ran 78,800 steps (≈40.07 TPP)
    # Past the paper: 4,096-token sequences, 2M (3b) and 4M (8b) tokens a step, 40 TPP; micro_batch 0,
    # as `python -m onona_jax.aot --fit` plans it (docs/SCALING.md "Sizes past the paper").
    "3b": (512, 0, 4096, 0, 2000, 1000, 256, 1000),
    "8b": (1024, 0, 4096, 0, 2000, 1000, 256, 1000),
}
# Peak and final learning rates where the paper's 1e-3 / 1e-4 is too high (Llama-3's 3e-4 at 8B).
LR = {"3b": (3e-4, 3e-5), "8b": (3e-4, 3e-5)}


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
    # Families (SPEC §3). MoE: 8 experts of half the dense FFN width, top-2, so the active
    # FFN matches Dense. GDN: heads of 128 dims covering d_model.
    c.model.moe.d_expert = c.model.d_ff // 2
    c.model.gdn.n_heads = max(1, d // 128)
    c.model.gdn.head_dim_k = c.model.gdn.head_dim_v = min(128, d)
    if arch == "gdn":  # whole 3 GDN : 1 attention groups
        c.model.n_layers = 4 * -(-layers // 4)
    if size in ("tiny", "small"):
        c.model.dtype = "float32"  # CPU: bf16 matmuls are emulated and slower
        c.train.lr = 3e-3
        c.train.final_lr = 3e-4
        c.train.log_every = 5
    # Checked, but returned unresolved: model.vocab_size = 0 follows whatever data.tokenizer the
    # command line sets (validate fills it in).
    validate(c.copy_and_resolve_references())
    return c


# ---------------------------------------------------------------------------------------
# Experiment grids (SPEC §6): `grid(name, size=None)` lists the arms that
# `python -m onona_jax.experiments.sweep --grid=<name>` trains and `python -m onona_jax.experiments.report` compares.
# Each arm belongs to a group and is compared with its group's baseline arm (the arm of that
# group whose cell is the grid's `baseline`). With `size=None` every arm runs at the paper's
# size; `size="small"` (or "tiny") maps every spec to that size; arms that then coincide
# (Table 1's 142m and 330m groups) are kept once.
# Cells: (arm name, head, overrides rule); the rule "deeper" adds ceil(n_layers/6) layers
# (24 -> 28 at 330m, as the paper's depth control; 4 -> 5 at small), and "{n_layers}" in the
# name becomes the deeper layer count ("standard-28l").
import dataclasses as _dataclasses
import math as _math


@_dataclasses.dataclass
class Arm:
    name: str  # also the arm's directory under the sweep's workdir
    spec: str  # "<arch>-<size>-<head>" for get_config
    overrides: dict = _dataclasses.field(default_factory=dict)  # config key -> value
    group: str = ""  # arms are compared within their group
    baseline: str = ""  # name of the group's baseline arm (this arm's own name if it is it)

    @property
    def is_baseline(self) -> bool:
        return self.name == self.baseline


GRIDS = {
    "table1": dict(
        doc="Table 1 / Figure 1(b): onóna vs Standard for every family at 142M and 330M",
        archs=("dense", "gdn", "moe", "attnres"), sizes=("142m", "330m"),
        cells=(("standard", "standard", None), ("twin", "twin", None)),
        baseline="standard", per_group=True,
    ),
    "output_layer": dict(
        doc="Output-layer alternatives at 142M (Dense): onóna vs MoS, sigsoftmax, MoSS, untied",
        archs=("dense",), sizes=("142m",),
        cells=tuple((h, h, None) for h in ("standard", "twin", "mos", "sigsoftmax", "moss", "untied")),
        baseline="standard", compare=(("moss", "twin"),),
    ),
    "controls": dict(
        doc="Table 5, parameter-matched controls at 142M (Dense)",
        archs=("dense",), sizes=("142m",),
        cells=tuple((h, h, None) for h in ("standard", "twin", "untied", "mos", "input_gate")),
        baseline="standard", compare=(("input_gate", "twin"),),
    ),
    "factorial": dict(
        doc="2×2 factorial at 142M (Dense): input averaging × output mixture",
        archs=("dense",), sizes=("142m",),
        cells=tuple((h, h, None) for h in ("standard", "twin_input_only", "twin_output_only", "twin")),
        baseline="standard",
        interaction=dict(baseline="standard", input="twin_input_only", output="twin_output_only", both="twin"),
    ),
    "depth": dict(
        doc="Depth control at 330M (Dense): is onóna worth more than extra layers?",
        archs=("dense",), sizes=("330m",),
        cells=(("standard", "standard", None), ("standard-{n_layers}l", "standard", "deeper"),
               ("twin", "twin", None)),
        baseline="standard", compare=(("twin", "standard-{n_layers}l"),),
    ),
}


def _deeper(layers: int) -> int:
    return layers + _math.ceil(layers / 6)


def grid_info(name: str, size: str | None = None) -> dict:
    """The grid as data: arms (dicts), baselines per group, comparisons, interaction."""
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}")
    if size is not None and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    g = GRIDS[name]
    arms, names = [], {}
    for arch in g["archs"]:
        for paper_size in g["sizes"]:
            sz = size or paper_size
            deeper = _deeper(SIZES[sz][1])
            group = f"{arch}-{sz}"
            for cell, head, rule in g["cells"]:
                arm_name = cell.format(n_layers=deeper)
                names[cell] = arm_name
                if g.get("per_group"):
                    arm_name = f"{arch}-{sz}-{arm_name}"
                overrides = {"model.n_layers": deeper} if rule == "deeper" else {}
                base = f"{arch}-{sz}-{g['baseline']}" if g.get("per_group") else g["baseline"]
                arm = Arm(arm_name, f"{arch}-{sz}-{head}", overrides, group, base)
                if all(a.name != arm.name for a in arms):  # 142m and 330m coincide off-paper
                    arms.append(arm)
    return dict(
        grid=name, doc=g["doc"], size=size or ",".join(g["sizes"]), paper_sizes=list(g["sizes"]),
        arms=[_dataclasses.asdict(a) for a in arms],
        baselines={a.group: a.baseline for a in arms},
        compare=[[names.get(x, x) for x in pair] for pair in g.get("compare", ())],
        interaction={k: names.get(v, v) for k, v in g.get("interaction", {}).items()} or None,
    )


def grid(name: str, size: str | None = None) -> list[Arm]:
    """The arms of grid `name` at the paper's sizes (size=None) or all at `size`."""
    return [Arm(**a) for a in grid_info(name, size)["arms"]]
