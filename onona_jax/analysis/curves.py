"""Validation-loss curves of several runs on one figure (the paper's Figure 1(c)).

    python -m onona_jax.analysis.curves DIR [DIR ...] [--output=curves.png] [--metric=val_loss]
        [--title=TEXT] [--json=PATH]

Each DIR is a run's --workdir; its DIR/metrics.jsonl has one JSON object per logged step,
and the rows that carry `--metric` (validation rows carry `val_loss`, and for twin runs
`val_loss_a_only`/`val_loss_b_only` at the end) make its curve. A resumed run appends to the
file and may log a step twice: the last row of a step wins. Each curve is labelled with the
run's config name (DIR/config.json `name`; the directory name when it has none, and both
when two runs share a name). Prints every run's final value (the value at its last step).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

from absl import flags

from onona_jax import cli, paths


def load_curve(workdir: str, metric: str = "val_loss") -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in DIR/metrics.jsonl, sorted by step, one value per step
    (the last row logged for that step). Raises ValueError when there is none."""
    path = paths.Workdir(workdir).metrics
    if not paths.isfile(path):
        raise ValueError(f"{path} does not exist; is {workdir} a training run's --workdir?")
    by_step: dict[int, float] = {}
    for n, line in enumerate(paths.read_text(path).splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write can leave a torn last line; anything else is corruption.
            print(f"warning: {path}:{n} is not JSON; skipped", file=sys.stderr)
            continue
        if metric in row and "step" in row:
            by_step[int(row["step"])] = float(row[metric])
    if not by_step:
        raise ValueError(f"{path} has no rows with {metric!r}; validation rows are written every "
                         "train.eval_every steps and at the end of training")
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_label(workdir: str) -> str:
    """The run's config name (DIR/config.json), else the directory's name."""
    path = paths.Workdir(workdir).config
    try:
        name = json.loads(paths.read_text(path)).get("name") or ""
    except (OSError, json.JSONDecodeError, AttributeError):
        name = ""
    return name or paths.path(workdir).name


def collect(workdirs: list[str], metric: str = "val_loss") -> list[dict]:
    """Per run: label, workdir, steps, values, final_step, final (the value at the last step)."""
    runs = []
    for d in workdirs:
        steps, values = load_curve(d, metric)
        runs.append(dict(label=run_label(d), workdir=d, steps=steps, values=values,
                         final_step=steps[-1], final=values[-1]))
    names = [r["label"] for r in runs]
    for r in runs:  # two seeds of one config: tell them apart by directory
        if names.count(r["label"]) > 1:
            r["label"] = f"{r['label']} ({os.path.normpath(r['workdir'])})"
    return runs


def plot(runs: list[dict], path: str, metric: str = "val_loss", title: str = "") -> bool:
    """One line per run; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the figure (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        finite = [(s, v) for s, v in zip(r["steps"], r["values"]) if math.isfinite(v)]
        if not finite:
            continue
        xs, ys = zip(*finite)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3,
                label=f"{r['label']}: {r['final']:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel(metric.replace("_", " ") + (" (nats)" if "loss" in metric else ""))
    ax.set_title(title or f"{metric} (final value in the legend)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with tempfile.TemporaryDirectory() as tmp:  # matplotlib writes local files
        fig.savefig(os.path.join(tmp, "figure.png"), dpi=120)
        paths.upload(os.path.join(tmp, "figure.png"), path)
    plt.close(fig)
    return True


def table(runs: list[dict], metric: str) -> str:
    width = max(len(r["label"]) for r in runs)
    lines = [f"{'run':<{width}}  {'step':>8}  {metric}"]
    lines += [f"{r['label']:<{width}}  {r['final_step']:>8}  {r['final']:.6f}" for r in runs]
    return "\n".join(lines)


def define(fv, argv):
    flags.DEFINE_string("output", "curves.png", "figure path (PNG)", flag_values=fv)
    flags.DEFINE_string("metric", "val_loss", "metrics.jsonl key to plot", flag_values=fv)
    flags.DEFINE_string("title", "", "figure title", flag_values=fv)
    flags.DEFINE_string("json", None, "also write the curves and final values here", flag_values=fv)


def _main(fv, workdirs):
    if not workdirs:
        raise cli.UsageError("give one or more training run directories: curves DIR [DIR ...]")
    runs = collect(workdirs, fv.metric)
    print(table(runs, fv.metric))
    if plot(runs, fv.output, fv.metric, fv.title):
        print(f"wrote {fv.output}", file=sys.stderr)
    if fv.json:
        paths.write_json(fv.json, {"metric": fv.metric, "runs": runs})


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
