"""The paper's experiment grids (SPEC §6 and its open questions, Appendix E) as data, the arms
they expand to, and the train.py and eval.py commands that run an arm × seed.

    grid("depth")                      # [Arm(name="standard", spec="dense-330m-standard", ...), ...]
    grid_info("matched", "small")      # the grid as JSON-able data: arms, baselines, comparisons
    commands(arm, seed, workdir)       # [("train", argv), ("eval", argv)], run from the repository root

A grid is a `Grid` of `Cell`s: each cell is placed at every arch × size of the grid and becomes
an `Arm`, a config spec (`configs/paper.py:<arch>-<size>-<head>`) and the config keys set on it.
Each arm belongs to a group and is compared with its group's baseline arm (the arm of that group
whose cell is one of the grid's `baselines`). With `size=None` every arm runs at the paper's
size; `size="small"` (or "tiny", "micro") maps every spec to that size, and arms that then
coincide (Table 1's 142m and 330m groups) are kept once.

`python -m onona_jax.experiments.sweep --grid=<name>` trains a grid's arms (or emits their
command lines for a scheduler); `python -m onona_jax.experiments.report` compares them. Any other
engine runs the same `commands` for the arms of `grid_info`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import shlex
import sys

from onona_jax import paths

PAPER_CONFIGS = os.path.join("configs", "paper.py")  # relative to the repository root


def repo_root() -> str:
    """The directory holding train.py, eval.py and configs/paper.py."""
    candidates = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), os.getcwd()]
    for root in candidates:
        if all(os.path.exists(os.path.join(root, f)) for f in ("train.py", "eval.py", PAPER_CONFIGS)):
            return root
    raise ValueError(
        "cannot find train.py, eval.py and configs/paper.py next to the onona_jax package "
        "or in the current directory; run from the onona-jax repository root"
    )


def load_paper_configs(root: str | None = None):
    """configs/paper.py as a module (it is a config file, not part of the package)."""
    path = os.path.join(root or repo_root(), PAPER_CONFIGS)
    spec = importlib.util.spec_from_file_location("_onona_paper_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _paper(root: str | None):
    return load_paper_configs(root)


# ---------------------------------------------------------------------------------- the records


@dataclasses.dataclass(frozen=True)
class Cell:
    """One arm of a grid before it is placed at an arch × size."""

    name: str  # the arm's name; "{n_layers}" becomes the deeper layer count ("standard-{n_layers}l")
    head: str  # the spec's head, with its context if any: "twin", "twin@4x"
    # Config keys the rule derives from the model, on top of `overrides`:
    #   "deeper"   ceil(n_layers/6) more layers (24 -> 28 at 330m, the paper's depth control; 4 -> 5
    #              at small), the budget kept the size's (train.reference);
    #   "matched"  the FFN widened until the total parameters are within 1% of the group's twin
    #              arm's (`param_matched`): the parameter-matched Standard.
    rule: str | None = None
    overrides: dict = dataclasses.field(default_factory=dict)  # config key -> value: budget, init scale, ...
    tag: str = ""  # splits the grid's arms into groups of their own (the context grid: one per length)


@dataclasses.dataclass(frozen=True)
class Grid:
    """An experiment: its cells, placed at every arch × size, and what the report compares."""

    doc: str
    archs: tuple[str, ...]
    sizes: tuple[str, ...]  # the paper's; `size=` replaces them all
    cells: tuple[Cell, ...]
    baselines: tuple[str, ...]  # names of the cells each group is compared with
    per_group: bool = False  # several groups of the same cells: arm names get "<arch>-<size>-"
    compare: tuple[tuple[str, str], ...] = ()  # further pairs of cells the report compares
    interaction: dict | None = None  # a 2×2 factorial: cells named baseline, input, output, both


@dataclasses.dataclass(frozen=True)
class Arm:
    """A cell placed at one arch × size: what one train.py command trains (once a seed)."""

    name: str  # also the arm's directory under the sweep's workdir
    spec: str  # "<arch>-<size>-<head>[@<seq_len>]" for configs/paper.py's get_config
    overrides: dict = dataclasses.field(default_factory=dict)  # config key -> value
    group: str = ""  # arms are compared within their group
    baseline: str = ""  # name of the group's baseline arm (this arm's own name if it is it)

    @property
    def is_baseline(self) -> bool:
        return self.name == self.baseline


# ---------------------------------------------------------------------------------- the grids

SQRT2 = math.sqrt(2.0)
_DOCS = {"data.packing": "documents"}  # the context grid's arms on packed documents (onona_jax/packing.py)


def _heads(*heads: str) -> tuple[Cell, ...]:
    """One plain cell a head, named after it."""
    return tuple(Cell(h, h) for h in heads)


GRIDS = {
    "headline": Grid(
        doc="onóna vs Standard (Dense): the paper's headline pair; at --size=micro with a BPE of the corpus, "
            "the CPU replication (python -m onona_jax.experiments.replicate, docs/results.md)",
        archs=("dense",), sizes=("142m",),
        cells=_heads("standard", "twin"),
        baselines=("standard",),
    ),
    "table1": Grid(
        doc="Table 1 / Figure 1(b): onóna vs Standard for every family at 142M and 330M",
        archs=("dense", "gdn", "moe", "attnres"), sizes=("142m", "330m"),
        cells=_heads("standard", "twin"),
        baselines=("standard",), per_group=True,
    ),
    "output_layer": Grid(
        doc="Output-layer alternatives at 142M (Dense): onóna vs MoS, sigsoftmax, MoSS, untied",
        archs=("dense",), sizes=("142m",),
        cells=_heads("standard", "twin", "mos", "sigsoftmax", "moss", "untied"),
        baselines=("standard",), compare=(("moss", "twin"),),
    ),
    "controls": Grid(
        doc="Table 5, parameter-matched controls at 142M (Dense)",
        archs=("dense",), sizes=("142m",),
        cells=_heads("standard", "twin", "untied", "mos", "input_gate"),
        baselines=("standard",), compare=(("input_gate", "twin"),),
    ),
    "factorial": Grid(
        doc="2×2 factorial at 142M (Dense): input averaging × output mixture",
        archs=("dense",), sizes=("142m",),
        cells=_heads("standard", "twin_input_only", "twin_output_only", "twin"),
        baselines=("standard",),
        interaction=dict(baseline="standard", input="twin_input_only", output="twin_output_only", both="twin"),
    ),
    "depth": Grid(
        doc="Depth control at 330M (Dense): is onóna worth more than extra layers?",
        archs=("dense",), sizes=("330m",),
        cells=(Cell("standard", "standard"), Cell("standard-{n_layers}l", "standard", rule="deeper"),
               Cell("twin", "twin")),
        baselines=("standard",), compare=(("twin", "standard-{n_layers}l"),),
    ),
    # The paper's open questions (Appendix E) as grids.
    "matched": Grid(
        doc="Resource-matched budgets (Dense): the same tokens, the same training FLOPs (twin-flops), tokens "
            "in proportion to parameters (-params), and a Standard as large as twin (standard-matched)",
        archs=("dense",), sizes=("142m", "330m", "1b"),
        cells=(
            Cell("standard", "standard"), Cell("twin", "twin"),
            Cell("twin-flops", "twin", overrides={"train.budget": "flops"}),
            Cell("standard-matched", "standard", rule="matched"),
            Cell("twin-params", "twin", overrides={"train.budget": "params"}),
            Cell("standard-matched-params", "standard", rule="matched", overrides={"train.budget": "params"}),
        ),
        baselines=("standard",), per_group=True,
        compare=(("twin", "standard-matched"), ("twin-params", "standard-matched-params")),
    ),
    "init_scale": Grid(
        doc="Init scale (Dense, 142M): twin's M = (A+B)/2 starts at std 0.0141, Standard's E at 0.02; "
            "each head also at the other's scale",
        archs=("dense",), sizes=("142m",),
        cells=(
            Cell("standard", "standard"),
            Cell("standard-at-m-scale", "standard", overrides={"model.table_init_scale": 1 / SQRT2}),
            Cell("twin", "twin"),
            Cell("twin-at-e-scale", "twin", overrides={"model.table_init_scale": SQRT2}),
        ),
        baselines=("standard",),
        compare=(("twin", "standard-at-m-scale"), ("twin-at-e-scale", "twin")),
    ),
    "context": Grid(
        doc="Longer contexts (Dense, 142M): twin vs Standard at the size's context (1,024 tokens) and 4× it "
            "(4,096), the batch in tokens kept; each both ways, on the paper's windows across documents and "
            "on packed documents (data.packing=documents: at 4,096 tokens most windows hold several)",
        archs=("dense",), sizes=("142m",),
        cells=(
            Cell("standard", "standard", tag="1x"), Cell("twin", "twin", tag="1x"),
            Cell("standard-4x", "standard@4x", tag="4x"), Cell("twin-4x", "twin@4x", tag="4x"),
            Cell("standard-docs", "standard", overrides=_DOCS, tag="1x-docs"),
            Cell("twin-docs", "twin", overrides=_DOCS, tag="1x-docs"),
            Cell("standard-4x-docs", "standard@4x", overrides=_DOCS, tag="4x-docs"),
            Cell("twin-4x-docs", "twin@4x", overrides=_DOCS, tag="4x-docs"),
        ),
        baselines=("standard", "standard-4x", "standard-docs", "standard-4x-docs"),
        # Does twin's gain change with the context? (twin − standard at 4×) − (at 1×), paired by seed.
        interaction=dict(baseline="standard", input="standard-4x", output="twin", both="twin-4x"),
    ),
}


# ---------------------------------------------------------------------------------- the rules


def deeper(layers: int) -> int:
    """The depth control's layer count: ceil(layers/6) more."""
    return layers + math.ceil(layers / 6)


def configure(spec: str, overrides: dict | None = None, root: str | None = None):
    """configs/paper.py's get_config(spec) with `overrides` ({dotted key: value}) set, validated:
    an arm's config as train.py builds it from its command line (the sweep passes one that adds
    its `--` flags)."""
    from onona_jax.config import set_key, validate

    cfg = _paper(root).get_config(spec)
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
    from onona_jax.config import set_key

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


def _rule_overrides(cell: Cell, arch: str, size: str, layers: int, make) -> dict:
    """The config keys `cell.rule` derives for the cell at arch × size (a size of `layers` layers)."""
    if cell.rule == "deeper":  # the budget stays the size's (train.reference)
        return {"model.n_layers": deeper(layers), "train.reference": f"n_layers={layers}"}
    if cell.rule == "matched":
        from onona_jax import summary

        twin = make(f"{arch}-{size}-twin", {k: v for k, v in cell.overrides.items() if k.startswith("model.")})
        standard = make(f"{arch}-{size}-{cell.head}", cell.overrides)
        out = param_matched(standard, summary.param_counts(twin.model)["total"])
        if arch != "moe":  # the budget stays the size's (train.reference); MoE's d_expert is not in it
            out["train.reference"] = f"d_ff={standard.model.d_ff}"
        return out
    return {}


# ---------------------------------------------------------------------------------- grid -> arms


def grid_info(name: str, size: str | None = None, make=None, root: str | None = None) -> dict:
    """The grid as data: arms (dicts of `Arm`'s fields), baselines per group, comparisons,
    interaction. `make(spec, overrides)` builds an arm's validated config (default `configure`;
    the sweep's adds its `--` flags), which the "matched" rule reads. `root`: the repository
    whose configs/paper.py gives the sizes and configs (default: this one)."""
    paper = _paper(root)
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}")
    if size is not None and size not in paper.SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(paper.SIZES)}")
    make = make or functools.partial(configure, root=root)
    g = GRIDS[name]
    arms, compare, interaction = [], [], None
    for arch in g.archs:
        for paper_size in g.sizes:
            sz = size or paper_size
            layers = paper.SIZES[sz][1]  # SIZES' columns: d_model, layers, heads, kv_heads, head_dim, d_ff
            names = {}  # cell name -> arm name, within this arch × size
            for cell in g.cells:
                names[cell.name] = cell.name.format(n_layers=deeper(layers))
                if g.per_group:
                    names[cell.name] = f"{arch}-{sz}-{names[cell.name]}"
            for cell in g.cells:
                overrides = {**cell.overrides, **_rule_overrides(cell, arch, sz, layers, make)}
                group = f"{arch}-{sz}" + (f"-{cell.tag}" if cell.tag else "")
                base = next(names[c.name] for c in g.cells if c.name in g.baselines and c.tag == cell.tag)
                arm = Arm(names[cell.name], f"{arch}-{sz}-{cell.head}", overrides, group, base)
                if all(a.name != arm.name for a in arms):  # 142m and 330m coincide off-paper
                    arms.append(arm)
            for pair in g.compare:
                if [names[x] for x in pair] not in compare:
                    compare.append([names[x] for x in pair])
            if g.interaction:
                interaction = {k: names[v] for k, v in g.interaction.items()}
    return dict(
        grid=name, doc=g.doc, size=size or ",".join(g.sizes), paper_sizes=list(g.sizes),
        arms=[dataclasses.asdict(a) for a in arms],
        baselines={a.group: a.baseline for a in arms},
        compare=compare, interaction=interaction,
    )


def grid(name: str, size: str | None = None, make=None, root: str | None = None) -> list[Arm]:
    """The arms of grid `name` at the paper's sizes (size=None) or all at `size`."""
    return [Arm(**a) for a in grid_info(name, size, make, root)["arms"]]


# ---------------------------------------------------------------------------------- arm -> commands


def flag_value(v) -> str:
    """A config value as a `--config.<key>=` flag spells it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def config_flags(overrides: dict) -> list[str]:
    """An arm's overrides as train.py flags: ["--config.<key>=<value>", ...]."""
    return [f"--config.{k}={flag_value(v)}" for k, v in overrides.items()]


def run_dir(workdir: str, arm: str, seed: int) -> str:
    """Where arm × seed trains: DIR/<arm>/seed<k>."""
    return paths.Sweepdir(workdir).run(arm, seed).root


def commands(arm: Arm | dict, seed: int, workdir: str, extra=(), python: str | None = None) -> list:
    """[("train", argv), ("eval", argv)] for one arm × seed; argv run with cwd = the repository
    root. `arm`: an `Arm` or its fields as a dict (as `grid_info` and grid.json hold it); `extra`:
    flags for every train.py; `python`: the interpreter (default: this one)."""
    if isinstance(arm, Arm):
        arm = dataclasses.asdict(arm)
    python = python or sys.executable
    rd = run_dir(workdir, arm["name"], seed)
    train = [python, "train.py", f"--config={PAPER_CONFIGS}:{arm['spec']}", f"--workdir={rd}",
             f"--config.seed={seed}", *config_flags(arm.get("overrides", {})), *extra]
    return [("train", train), ("eval", [python, "eval.py", f"--workdir={rd}"])]


def command_line(arm: Arm | dict, seed: int, workdir: str, extra=(), root: str | None = None,
                 python: str | None = None) -> str:
    """`cd ROOT && <train> && <eval>` for one arm × seed: one line of a scheduler's job file."""
    parts = [f"cd {shlex.quote(root or repo_root())}"]
    argvs = commands(arm, seed, workdir, extra, python)
    return " && ".join(parts + [shlex.join(argv) for _, argv in argvs])
