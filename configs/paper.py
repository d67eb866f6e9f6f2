"""The paper's models and training recipe: `configs/paper.py:<arch>-<size>-<head>`.

    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin
    python train.py --config=configs/paper.py:dense-small-standard --config.train.steps=500

Sizes `142m`, `330m`, `1b` are the paper's (SPEC §3-4); `tiny` is for tests and `small`
for experiments that finish in minutes on a 2-core CPU. `3b` and `8b` go past the paper with
Llama-3.2-3B's and Llama-3-8B's trunk shapes (GQA 8 KV heads of 128; 8b's FFN 14,336 wide):
Dense Standard 3.21B and 7.50B parameters at Llama-3's vocabulary
(`--config.data.tokenizer=size:128256`), 2.97B and 7.19B at GPT-2's (docs/training.md, "Configs and overrides").
"""

import math

from onona_jax.config import ARCHS, HEADS, base_config, ffn_width, set_key, validate

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


# ---------------------------------------------------------------------------------------
# Experiment grids (SPEC §6 and the paper's open questions, Appendix E): `grid(name, size=None)`
# lists the arms that `python -m onona_jax.experiments.sweep --grid=<name>` trains and
# `python -m onona_jax.experiments.report` compares.
# Each arm belongs to a group and is compared with its group's baseline arm (the arm of that
# group whose cell is one of the grid's `baseline`s). With `size=None` every arm runs at the
# paper's size; `size="small"` (or "tiny", "micro") maps every spec to that size; arms that then
# coincide (Table 1's 142m and 330m groups) are kept once.
# A cell is (arm name, head, rule, overrides, group tag): overrides are config keys set for the arm
# (its budget, its init scale, its context); the rule derives more of them from the model:
#   "deeper"   ceil(n_layers/6) more layers (24 -> 28 at 330m, the paper's depth control; 4 -> 5 at
#              small); "{n_layers}" in the name becomes the deeper layer count ("standard-28l");
#   "matched"  the FFN widened until the total parameters are within 1% of the group's twin arm's
#              (`param_matched`): the parameter-matched Standard.
# The group tag splits a grid's arms into groups of their own (the context grid: one per length).
import dataclasses as _dataclasses

SQRT2 = math.sqrt(2.0)


@_dataclasses.dataclass
class Arm:
    name: str  # also the arm's directory under the sweep's workdir
    spec: str  # "<arch>-<size>-<head>[@<seq_len>]" for get_config
    overrides: dict = _dataclasses.field(default_factory=dict)  # config key -> value
    group: str = ""  # arms are compared within their group
    baseline: str = ""  # name of the group's baseline arm (this arm's own name if it is it)

    @property
    def is_baseline(self) -> bool:
        return self.name == self.baseline


def _cells(*cells):
    """Cells as (name, head, rule, overrides, group tag), a missing tail taken from (None, {}, "")."""
    return tuple((*c, *(None, {}, "")[len(c) - 2:]) for c in cells)


_DOCS = {"data.packing": "documents"}  # the context grid's arms on packed documents (onona_jax/packing.py)

GRIDS = {
    "headline": dict(
        doc="onóna vs Standard (Dense): the paper's headline pair; at --size=micro with a BPE of the corpus, "
            "the CPU replication (python -m onona_jax.experiments.replicate, docs/results.md)",
        archs=("dense",), sizes=("142m",),
        cells=_cells(("standard", "standard"), ("twin", "twin")),
        baseline=("standard",),
    ),
    "table1": dict(
        doc="Table 1 / Figure 1(b): onóna vs Standard for every family at 142M and 330M",
        archs=("dense", "gdn", "moe", "attnres"), sizes=("142m", "330m"),
        cells=_cells(("standard", "standard"), ("twin", "twin")),
        baseline=("standard",), per_group=True,
    ),
    "output_layer": dict(
        doc="Output-layer alternatives at 142M (Dense): onóna vs MoS, sigsoftmax, MoSS, untied",
        archs=("dense",), sizes=("142m",),
        cells=_cells(*((h, h) for h in ("standard", "twin", "mos", "sigsoftmax", "moss", "untied"))),
        baseline=("standard",), compare=(("moss", "twin"),),
    ),
    "controls": dict(
        doc="Table 5, parameter-matched controls at 142M (Dense)",
        archs=("dense",), sizes=("142m",),
        cells=_cells(*((h, h) for h in ("standard", "twin", "untied", "mos", "input_gate"))),
        baseline=("standard",), compare=(("input_gate", "twin"),),
    ),
    "factorial": dict(
        doc="2×2 factorial at 142M (Dense): input averaging × output mixture",
        archs=("dense",), sizes=("142m",),
        cells=_cells(*((h, h) for h in ("standard", "twin_input_only", "twin_output_only", "twin"))),
        baseline=("standard",),
        interaction=dict(baseline="standard", input="twin_input_only", output="twin_output_only", both="twin"),
    ),
    "depth": dict(
        doc="Depth control at 330M (Dense): is onóna worth more than extra layers?",
        archs=("dense",), sizes=("330m",),
        cells=_cells(("standard", "standard"), ("standard-{n_layers}l", "standard", "deeper"), ("twin", "twin")),
        baseline=("standard",), compare=(("twin", "standard-{n_layers}l"),),
    ),
    # The paper's open questions (Appendix E) as grids.
    "matched": dict(
        doc="Resource-matched budgets (Dense): the same tokens, the same training FLOPs (twin-flops), tokens "
            "in proportion to parameters (-params), and a Standard as large as twin (standard-matched)",
        archs=("dense",), sizes=("142m", "330m", "1b"),
        cells=_cells(
            ("standard", "standard"), ("twin", "twin"),
            ("twin-flops", "twin", None, {"train.budget": "flops"}),
            ("standard-matched", "standard", "matched"),
            ("twin-params", "twin", None, {"train.budget": "params"}),
            ("standard-matched-params", "standard", "matched", {"train.budget": "params"}),
        ),
        baseline=("standard",), per_group=True,
        compare=(("twin", "standard-matched"), ("twin-params", "standard-matched-params")),
    ),
    "init_scale": dict(
        doc="Init scale (Dense, 142M): twin's M = (A+B)/2 starts at std 0.0141, Standard's E at 0.02; "
            "each head also at the other's scale",
        archs=("dense",), sizes=("142m",),
        cells=_cells(
            ("standard", "standard"),
            ("standard-at-m-scale", "standard", None, {"model.table_init_scale": 1 / SQRT2}),
            ("twin", "twin"),
            ("twin-at-e-scale", "twin", None, {"model.table_init_scale": SQRT2}),
        ),
        baseline=("standard",),
        compare=(("twin", "standard-at-m-scale"), ("twin-at-e-scale", "twin")),
    ),
    "context": dict(
        doc="Longer contexts (Dense, 142M): twin vs Standard at the size's context (1,024 tokens) and 4× it "
            "(4,096), the batch in tokens kept; each both ways, on the paper's windows across documents and "
            "on packed documents (data.packing=documents: at 4,096 tokens most windows hold several)",
        archs=("dense",), sizes=("142m",),
        cells=_cells(
            ("standard", "standard", None, {}, "1x"), ("twin", "twin", None, {}, "1x"),
            ("standard-4x", "standard@4x", None, {}, "4x"), ("twin-4x", "twin@4x", None, {}, "4x"),
            ("standard-docs", "standard", None, _DOCS, "1x-docs"), ("twin-docs", "twin", None, _DOCS, "1x-docs"),
            ("standard-4x-docs", "standard@4x", None, _DOCS, "4x-docs"),
            ("twin-4x-docs", "twin@4x", None, _DOCS, "4x-docs"),
        ),
        baseline=("standard", "standard-4x", "standard-docs", "standard-4x-docs"),
        # Does twin's gain change with the context? (twin − standard at 4×) − (at 1×), paired by seed.
        interaction=dict(baseline="standard", input="standard-4x", output="twin", both="twin-4x"),
    ),
}


def _deeper(layers: int) -> int:
    return layers + math.ceil(layers / 6)


def configure(spec: str, overrides: dict | None = None):
    """get_config(spec) with `overrides` ({dotted key: value}) set, validated: an arm's config as
    train.py builds it from its command line (the sweep passes one that adds its `--` flags)."""
    from onona_jax.config import validate

    cfg = get_config(spec)
    for key, value in (overrides or {}).items():
        set_key(cfg, key, value)
    return validate(cfg.copy_and_resolve_references())


def param_matched(standard, total: int, tolerance: float = 0.01) -> dict:
    """The overrides that make the Standard config `standard` a parameter-matched control for a
    model of `total` parameters: the FFN widened (model.d_ff; MoE: model.moe.d_expert) to the
    multiple of 64 (ffn_width's granularity) nearest to `total`, or of 8 where no multiple of 64
    lands within `tolerance` (small models), so that the totals agree within it.

    Wider, not deeper: one layer is too coarse a step (at 330M, 4 more layers leave Standard 1.3%
    short of twin and 5 put it 1.7% over), width gets within 1% at every size with the same rule,
    and it keeps depth and attention as they are; the paper's deeper control is the depth grid."""
    from onona_jax import summary

    m = standard.model
    key = "moe.d_expert" if m.arch == "moe" else "d_ff"

    def total_at(width):
        c = m.copy_and_resolve_references()
        set_key(c, key, int(width))
        return summary.param_counts(c)["total"]

    width = (m.moe.d_expert if m.arch == "moe" else m.d_ff)
    per_unit = (total_at(width + 64) - total_at(width)) / 64  # the total is affine in the width
    ideal = width + (total - total_at(width)) / per_unit
    for step in (64, 8):
        w = max(step, step * round(ideal / step))
        got = total_at(w)
        if abs(got - total) <= tolerance * total:
            return {f"model.{key}": w}
    raise ValueError(f"no FFN width puts {standard.name} within {tolerance:.0%} of {total:,} parameters "
                     f"(nearest: model.{key}={w}, {got:,}); the vocabulary tables outweigh the whole body")


def grid_info(name: str, size: str | None = None, make=None) -> dict:
    """The grid as data: arms (dicts), baselines per group, comparisons, interaction. `make(spec,
    overrides)` builds an arm's validated config (default `configure`; the sweep's adds its `--`
    flags), which the "matched" rule reads."""
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}")
    if size is not None and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    make = make or configure
    g = GRIDS[name]
    arms, compare, interaction = [], [], None
    for arch in g["archs"]:
        for paper_size in g["sizes"]:
            sz = size or paper_size
            deeper = _deeper(SIZES[sz][1])
            names = {}  # cell name -> arm name, within this arch × size
            for cell, head, rule, fixed, tag in g["cells"]:
                names[cell] = cell.format(n_layers=deeper)
                if g.get("per_group"):
                    names[cell] = f"{arch}-{sz}-{names[cell]}"
            for cell, head, rule, fixed, tag in g["cells"]:
                overrides = dict(fixed)
                if rule == "deeper":  # the budget stays the size's (train.reference)
                    overrides.update({"model.n_layers": deeper, "train.reference": f"n_layers={SIZES[sz][1]}"})
                elif rule == "matched":
                    from onona_jax import summary

                    twin = make(f"{arch}-{sz}-twin", {k: v for k, v in fixed.items() if k.startswith("model.")})
                    standard = make(f"{arch}-{sz}-{head}", fixed)
                    overrides.update(param_matched(standard, summary.param_counts(twin.model)["total"]))
                    if arch != "moe":  # the budget stays the size's (train.reference); MoE's d_expert is not in it
                        overrides["train.reference"] = f"d_ff={standard.model.d_ff}"
                group = f"{arch}-{sz}" + (f"-{tag}" if tag else "")
                base = next(names[c] for c, *_, t in g["cells"] if c in g["baseline"] and t == tag)
                arm = Arm(names[cell], f"{arch}-{sz}-{head}", overrides, group, base)
                if all(a.name != arm.name for a in arms):  # 142m and 330m coincide off-paper
                    arms.append(arm)
            for pair in g.get("compare", ()):
                if [names[x] for x in pair] not in compare:
                    compare.append([names[x] for x in pair])
            if g.get("interaction"):
                interaction = {k: names[v] for k, v in g["interaction"].items()}
    return dict(
        grid=name, doc=g["doc"], size=size or ",".join(g["sizes"]), paper_sizes=list(g["sizes"]),
        arms=[_dataclasses.asdict(a) for a in arms],
        baselines={a.group: a.baseline for a in arms},
        compare=compare, interaction=interaction,
    )


def grid(name: str, size: str | None = None, make=None) -> list[Arm]:
    """The arms of grid `name` at the paper's sizes (size=None) or all at `size`."""
    return [Arm(**a) for a in grid_info(name, size, make)["arms"]]
