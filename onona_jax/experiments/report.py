"""Summarise a sweep (`python -m onona_jax.experiments.sweep`): per arm the mean validation loss over
seeds with its 95% confidence interval, and the difference against the arm's baseline paired
by seed, as the paper's tables and Figure 1(b) report them.

    python -m onona_jax.experiments.report DIR

reads DIR/grid.json, DIR/sweep_status.json (if any) and the latest (highest-step)
DIR/<arm>/seed<k>/eval/step_<N>.json of every arm × seed, and writes DIR/report.md,
DIR/report.json (every number, and for every arm × seed the eval file it came from,
relative to DIR) and DIR/report.png (Δ vs baseline per arm with 95% CI bars).

A run without an eval file is *missing*, one the sweep recorded as failed is *failed*, one
whose val_loss is not a finite number is *invalid*; none of them is averaged in: every mean
says how many seeds (n) it uses. Std uses ddof=1; the 95% CI half-width is
t(0.975, n−1)·std/√n from a built-in Student-t table.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile

from onona_jax import cli, paths

# Student t 0.975 quantiles for df = 1..30; beyond, the Cornish–Fisher expansion below
# (within 1e-4 of the exact quantile for df > 30).
T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)
Z975 = 1.959963984540054
# An eval file's table ablations (`heads.ABLATION_KINDS`: only, in, out), e.g. val_loss_a_out. The
# report reads eval files without importing the model code, so the kinds are spelled here too
# (tests/integration/test_sweep.py checks that they agree).
ABLATION_KEY = re.compile(r"^val_loss_(\w+_(?:only|in|out))$")
ABLATION_ORDER = ("only", "in", "out")


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom (two-sided 95%)."""
    if df < 1:
        raise ValueError(f"df={df}: need at least 2 values for a confidence interval")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def summarize(values) -> dict:
    """n, mean, std (ddof=1) and 95% CI half-width; std and CI are None when n < 2."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return dict(n=0, mean=None, std=None, ci95=None)
    mean = sum(values) / n
    if n < 2:
        return dict(n=1, mean=mean, std=None, ci95=None)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return dict(n=n, mean=mean, std=std, ci95=t_quantile(n - 1) * std / math.sqrt(n))


def latest_eval(run_dir: str):
    """(path, step) of run_dir/eval/step_<N>.json with the highest N, or None."""
    found = paths.Workdir(run_dir).eval_results()
    return (found[max(found)], max(found)) if found else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_run(workdir: str, arm: dict, seed: int, status: dict) -> dict:
    """One arm × seed: status ok / missing / failed / invalid, and the eval file's values."""
    entry = status.get(f"{arm['name']}/seed{seed}", {})
    found = latest_eval(paths.Sweepdir(workdir).run(arm["name"], seed).root)
    rec = dict(seed=seed, status="missing", path=None)
    if found:
        rec["path"] = os.fspath(paths.path(found[0]).relative_to(paths.path(workdir)))
    if entry.get("status") == "failed":
        rec.update(status="failed", stage=entry.get("stage"), returncode=entry.get("returncode"),
                   stderr_tail=entry.get("stderr_tail", ""))
        if found:
            rec["note"] = "the sweep recorded a failure; the older eval file is not used"
        return rec
    if not found:
        if entry.get("status") == "running":
            rec["note"] = "the sweep started this run but recorded no result (still running or killed)"
        return rec
    try:
        data = json.loads(paths.read_text(found[0]))
    except (OSError, ValueError) as err:
        rec.update(status="invalid", note=f"unreadable eval file: {err}")
        return rec
    rec["step"] = data.get("step", found[1])
    rec["config"] = data.get("config")
    if not _finite(data.get("val_loss")):
        rec.update(status="invalid", val_loss=data.get("val_loss"), note="val_loss is not a finite number")
        return rec
    rec.update(status="ok", val_loss=float(data["val_loss"]))
    for key, value in data.items():
        if ABLATION_KEY.match(key) and _finite(value):
            rec[key] = float(value)
    if rec["config"] not in (None, arm["spec"]):
        rec["note"] = f"eval file's config {rec['config']!r} differs from the arm's {arm['spec']!r}"
    return rec


def pool_tokens(run_dir: str) -> int | None:
    """Tokens in the training split the run read (its config.json's data.dir, or the bundled corpus
    prepared into the run: the manifest's train tokens); None where either file is not there."""
    try:
        cfg = json.loads(paths.read_text(paths.Workdir(run_dir).config))
        data = paths.Workdir(run_dir).data_dir(cfg.get("data", {}).get("dir", ""))
        return int(json.loads(paths.read_text(paths.join(data, "manifest.json")))["splits"]["train"]["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _ok(runs: dict) -> dict:
    return {s: r for s, r in runs.items() if r["status"] == "ok"}


def _ablation_keys(records) -> list[str]:
    """The ablation keys the records hold: the paper's `_only` first, then `_in`, then `_out`."""
    keys = {k for r in records for k in r if ABLATION_KEY.match(k)}
    return sorted(keys, key=lambda k: (ABLATION_ORDER.index(k.rsplit("_", 1)[1]), k))


def paired(a_runs: dict, b_runs: dict) -> dict:
    """Per-seed differences of val_loss a − b over the seeds where both runs are ok."""
    a, b = _ok(a_runs), _ok(b_runs)
    per_seed = {str(s): a[s]["val_loss"] - b[s]["val_loss"] for s in sorted(set(a) & set(b))}
    return dict(summarize(per_seed.values()), per_seed=per_seed)


def build(workdir: str) -> dict:
    grid_path = paths.Sweepdir(workdir).grid
    if not paths.exists(grid_path):
        raise ValueError(f"{grid_path} not found; run python -m onona_jax.experiments.sweep --workdir={workdir} first")
    grid = json.loads(paths.read_text(grid_path))
    status_path = paths.Sweepdir(workdir).status
    status = json.loads(paths.read_text(status_path)) if paths.exists(status_path) else {}
    seeds = [int(s) for s in grid["seeds"]]
    runs = {a["name"]: {s: read_run(workdir, a, s, status) for s in seeds} for a in grid["arms"]}

    arms = []
    for a in grid["arms"]:
        r = runs[a["name"]]
        ok = _ok(r)
        row = dict(
            name=a["name"], spec=a["spec"], group=a["group"], baseline=a["baseline"],
            overrides=a.get("overrides", {}), is_baseline=a["name"] == a["baseline"],
            **summarize(v["val_loss"] for v in ok.values()),
            seeds_used=sorted(ok), missing=[s for s in seeds if r[s]["status"] == "missing"],
            failed=[s for s in seeds if r[s]["status"] == "failed"],
            invalid=[s for s in seeds if r[s]["status"] == "invalid"],
            runs={str(s): r[s] for s in seeds},
        )
        if not row["is_baseline"] and a["baseline"] in runs:
            row["delta"] = paired(r, runs[a["baseline"]])
            base_ok = _ok(runs[a["baseline"]])
            row["delta_of_means"] = (
                row["mean"] - summarize(v["val_loss"] for v in base_ok.values())["mean"]
                if ok and base_ok else None)
        abl = {}
        for key in _ablation_keys(ok.values()):
            vals = {s: v for s, v in ok.items() if key in v}
            if vals:
                abl[key] = summarize(v[key] for v in vals.values())
                abl[key + "_gap"] = summarize(v[key] - v["val_loss"] for v in vals.values())
        if abl:
            row["ablations"] = abl
        if a.get("budget"):  # the sweep's summary.budget of the arm; passes over each run's training pool
            pools = sorted({p for s in seeds if (p := pool_tokens(paths.Sweepdir(workdir).run(a["name"], s).root))})
            row["budget"] = dict(a["budget"], pool_tokens=pools, passes=[a["budget"]["tokens"] / p for p in pools])
        steps = sorted({v.get("step") for v in ok.values()} - {None})
        if len(steps) > 1:
            row["note"] = f"seeds were evaluated at different steps {steps}"
        arms.append(row)

    report = dict(grid=grid["grid"], doc=grid.get("doc", ""), size=grid.get("size"), seeds=seeds,
                  workdir=paths.absolute(workdir), paths_relative_to="workdir", arms=arms)
    report["comparisons"] = [
        dict(a=x, b=y, **paired(runs[x], runs[y])) for x, y in grid.get("compare") or []
        if x in runs and y in runs
    ]
    inter = grid.get("interaction")
    if inter and all(inter[k] in runs for k in ("baseline", "input", "output", "both")):
        cells = {k: _ok(runs[inter[k]]) for k in ("baseline", "input", "output", "both")}
        common = sorted(set.intersection(*(set(c) for c in cells.values())))
        # (both − std) − (input − std) − (output − std) = both − input − output + std
        per_seed = {str(s): (cells["both"][s]["val_loss"] - cells["input"][s]["val_loss"]
                        - cells["output"][s]["val_loss"] + cells["baseline"][s]["val_loss"])
                    for s in common}
        report["interaction"] = dict(cells=inter, **summarize(per_seed.values()), per_seed=per_seed)
    return report


def _f(x) -> str:
    """A loss (4 decimals)."""
    return "—" if x is None else f"{x:.4f}"


def _d(x) -> str:
    """A difference of losses (signed, 5 decimals)."""
    return "—" if x is None else f"{x:+.5f}"


def _s(x) -> str:
    """The std or CI half-width of a difference (5 decimals)."""
    return "—" if x is None else f"{x:.5f}"


def _seeds(xs) -> str:
    return ",".join(str(s) for s in xs) or "—"


def markdown(report: dict) -> str:
    lines = [f"# Sweep report: grid `{report['grid']}` (size {report['size']})", ""]
    if report.get("doc"):
        lines += [report["doc"], ""]
    lines += [
        f"Seeds requested: {_seeds(report['seeds'])}. Validation loss in nats from each run's latest "
        "eval file (`<arm>/seed<k>/eval/step_<N>.json`, listed below and in report.json). "
        "Mean over the seeds present (n); std with ddof=1; 95% CI = ± t(0.975, n−1)·std/√n. "
        "Δ = arm − its group's baseline, paired by seed over the seeds where both ran. "
        "Missing, failed and invalid runs are listed and never averaged in.",
        "",
        "## Validation loss",
        "",
        "| group | arm | spec | n | val_loss | std | 95% CI ± | Δ vs baseline | Δ n | Δ std | Δ 95% CI ± | missing seeds | failed seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in report["arms"]:
        d = a.get("delta") or {}
        spec = a["spec"] + "".join(f" {k}={v}" for k, v in a["overrides"].items())
        base = "(baseline)" if a["is_baseline"] else _d(d.get("mean"))
        lines.append(
            f"| {a['group']} | {a['name']} | {spec} | {a['n']} | {_f(a['mean'])} | {_f(a['std'])} "
            f"| {_f(a['ci95'])} | {base} | {d.get('n', '—') if d else '—'} | {_s(d.get('std'))} "
            f"| {_s(d.get('ci95'))} | {_seeds(a['missing'] + a['invalid'])} | {_seeds(a['failed'])} |"
        )
    budgeted = [a for a in report["arms"] if a.get("budget")]
    if budgeted:
        lines += ["", "## Budgets", "",
                  "What each arm trains (`summary.budget`, train.budget): its parameters, steps, tokens and training "
                  "FLOPs against its size's reference (Dense Standard); passes = tokens / tokens in the training "
                  "pool (each run's data manifest; one value per distinct pool).", "",
                  "| arm | budget | params | steps | tokens | tokens/param | train FLOPs | FLOPs/reference | passes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for a in budgeted:
            b = a["budget"]
            passes = ", ".join(f"{x:.3f}" for x in b["passes"]) or "—"
            lines.append(f"| {a['name']} | {b['budget']} | {b['params']:,} | {b['steps']:,} | {b['tokens']:,} "
                         f"| {b['tokens_per_param']:.2f} | {b['flops']:.4e} | {b['flops'] / b['reference_flops']:.4f} "
                         f"| {passes} |")
    abl = [a for a in report["arms"] if a.get("ablations")]
    if abl:
        lines += ["", "## Table ablations", "",
                  "Each trained model on the same validation windows with one table in place of its own "
                  "(docs/experiments.md, \"Table ablations\"): `X_only` reads and predicts with X alone, no gate (the paper's, "
                  "SPEC §2); `X_in` feeds X[x] to the body under the model's own output; `X_out` predicts with X "
                  "alone from the model's own input rows. Gap = ablation − the model, paired by seed.",
                  "", "| arm | ablation | n | val_loss | gap | gap 95% CI ± |", "|---|---|---|---|---|---|"]
        for a in abl:
            x = a["ablations"]
            for key in (k for k in x if not k.endswith("_gap")):
                gap = x[key + "_gap"]
                lines.append(f"| {a['name']} | {key[len('val_loss_'):]} | {x[key]['n']} | {_f(x[key]['mean'])} "
                             f"| {_d(gap['mean'])} | {_s(gap['ci95'])} |")
    if report.get("comparisons"):
        lines += ["", "## Comparisons", "", "| a − b | n | mean | std | 95% CI ± |", "|---|---|---|---|---|"]
        for c in report["comparisons"]:
            lines.append(f"| {c['a']} − {c['b']} | {c['n']} | {_d(c['mean'])} | {_s(c['std'])} "
                         f"| {_s(c['ci95'])} |")
    if report.get("interaction"):
        i = report["interaction"]
        c = i["cells"]
        lines += ["", "## Interaction", "",
                  f"({c['both']} − {c['baseline']}) − ({c['input']} − {c['baseline']}) − "
                  f"({c['output']} − {c['baseline']}), per seed where all four cells ran:", "",
                  "| n | seeds | mean | std | 95% CI ± |", "|---|---|---|---|---|",
                  f"| {i['n']} | {_seeds(i['per_seed'])} | {_d(i['mean'])} | {_s(i['std'])} "
                  f"| {_s(i['ci95'])} |"]
    lines += ["", "## Runs", "", "| arm | seed | status | step | val_loss | eval file |", "|---|---|---|---|---|---|"]
    for a in report["arms"]:
        for s, r in a["runs"].items():
            lines.append(f"| {a['name']} | {s} | {r['status']} | {r.get('step', '—')} "
                         f"| {_f(r.get('val_loss')) if _finite(r.get('val_loss')) else r.get('val_loss', '—')} "
                         f"| {r['path'] or '—'} |")
    notes = []
    for a in report["arms"]:
        if a.get("note"):
            notes.append(f"- `{a['name']}`: {a['note']}")
        for s, r in a["runs"].items():
            if r["status"] == "failed":
                tail = (r.get("stderr_tail") or "").strip().splitlines()
                last = tail[-1][:200] if tail else ""
                notes.append(f"- `{a['name']}/seed{s}` failed in {r.get('stage')} with exit code "
                             f"{r.get('returncode')}" + (f": `{last}`" if last else ""))
            if r.get("note"):
                notes.append(f"- `{a['name']}/seed{s}` ({r['status']}): {r['note']}")
    if notes:
        lines += ["", "## Notes", ""] + notes
    return "\n".join(lines) + "\n"


def figure(report: dict, path: str) -> bool:
    """Horizontal bars of Δ vs baseline per arm (95% CI bars when n ≥ 2), dashed line at 0."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the figure (pip install matplotlib)", file=sys.stderr)
        return False
    rows = [a for a in report["arms"] if not a["is_baseline"]]
    groups = list(dict.fromkeys(a["group"] for a in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * max(1, len(rows))))
    labels = []
    for i, a in enumerate(rows):
        d = a.get("delta") or {}
        single = len(groups) == 1 or a["name"].startswith(a["group"])
        label = a["name"] if single else f"{a['group']}: {a['name']}"
        labels.append(f"{label} (n={d.get('n', 0)})")
        if d.get("mean") is None:
            ax.text(0, i, "  no paired runs", va="center", fontsize=8, color="gray")
            continue
        ax.barh(i, d["mean"], color=colors[groups.index(a["group"]) % len(colors)],
                xerr=d["ci95"] if d.get("ci95") is not None else None, capsize=3)
    ax.axvline(0, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("Δ validation loss vs baseline (nats; negative is better)")
    ax.set_title(f"{report['grid']} ({report['size']}): mean paired Δ, 95% CI where n ≥ 2", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(workdir: str) -> dict:
    """DIR/report.{json,md,png}, each written whole (`paths.write_atomic`)."""
    report = build(workdir)
    paths.write_json(paths.Sweepdir(workdir).report("json"), report)
    paths.write_atomic(paths.Sweepdir(workdir).report("md"), markdown(report))
    with tempfile.TemporaryDirectory() as tmp:  # matplotlib writes local files
        png = os.path.join(tmp, "report.png")
        if figure(report, png):
            paths.upload(png, paths.Sweepdir(workdir).report("png"))
    return report


def define(fv, argv):
    pass


def _main(fv, args):
    if len(args) != 1:
        raise cli.UsageError("usage: python -m onona_jax.experiments.report DIR   (DIR: a sweep's --workdir)")
    write(args[0])
    print(paths.read_text(paths.join(args[0], "report.md")))
    print(f"wrote {paths.join(args[0], 'report.md')}, report.json, report.png", file=sys.stderr)


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
