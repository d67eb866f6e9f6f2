"""Check the main job's validation loss against the figure the README states for it.

    python train.py && python eval.py --workdir=runs/dense-small-twin    # the main job (README)
    python scripts/check_main_job.py runs/dense-small-twin               # then this

Reads the README's sentence after the main job's command ("Train and eval took ... val_loss
5.794 ...") and the newest evaluation eval.py wrote into the workdir (`DIR/eval/step_<N>.json`,
its `val_loss`); runs nothing itself. Prints both and exits 0 when they agree within the
tolerance, 1 when they do not (or when the workdir holds no evaluation of the main job's final
step), 2 for bad usage.

Tolerance: 0.05 nats. The same command gave val_loss 5.792, 5.794, 5.800 and 5.777 on four hosts
(docs/performance.md, "Figures"): XLA's CPU kernels differ by instruction set (the GEMM library
and its accumulation order follow the CPU's extensions), so the same recipe and data land a few
hundredths apart, 0.023 at most so far. A real regression of the recipe (the model, the head,
the schedule) or of the data (prepare, the windows, the split) moves the figure by more than that.
"""

import argparse
import json
import os
import re
import sys

from onona_jax import paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.05  # nats; the docstring says why
MAIN_CONFIG = "dense-small-twin"  # what `python train.py` trains (train.py's DEFAULT_CONFIG)
# The README's sentence right after the main job's command block.
SENTENCE = re.compile(r"Train and eval took\b.*?\bval_loss\s+(\d+\.\d+)", re.S)


class Failed(Exception):
    """An anticipated failure: one `error:` line, exit 1."""


def readme_val_loss(text: str) -> float:
    """The main job's val_loss the README states ("Train and eval took ... val_loss 5.794")."""
    m = SENTENCE.search(text)
    if not m:
        raise Failed("the README has no sentence \"Train and eval took ... val_loss X\" after the main job's command")
    return float(m.group(1))


def latest_eval(workdir: str) -> tuple[str, dict]:
    """(path, contents) of the newest DIR/eval/step_<N>.json, by N (`paths.Workdir.eval_results`)."""
    run = paths.Workdir(workdir)
    found = run.eval_results() if os.path.isdir(run.eval) else None
    if found is None:
        raise Failed(f"{run.eval} does not exist: run `python eval.py --workdir={workdir}` first")
    if not found:
        raise Failed(f"{run.eval} holds no step_<N>.json: run `python eval.py --workdir={workdir}` first")
    path = found[max(found)]
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result.get("val_loss"), (int, float)):
        raise Failed(f"{path} has no val_loss (was it written by `python eval.py --tasks=val`?)")
    return path, result


def _final_step(workdir: str):
    """train.steps of the run's saved config, or None where it is not fixed there (0: from a budget)."""
    try:
        with open(paths.Workdir(workdir).config) as f:
            steps = json.load(f).get("train", {}).get("steps")
    except (OSError, ValueError):
        return None
    return steps if isinstance(steps, int) and steps > 0 else None


def check(workdir: str, readme: str, tolerance: float = TOLERANCE) -> tuple[bool, str]:
    """(within the tolerance, the lines to print); raises Failed where there is nothing to compare."""
    with open(readme) as f:
        stated = readme_val_loss(f.read())
    path, result = latest_eval(workdir)
    config = result.get("config")
    if config is not None and config != MAIN_CONFIG:
        raise Failed(f"{path} evaluates {config}, not the main job's {MAIN_CONFIG}")
    final = _final_step(workdir)
    if final is not None and result.get("step") != final:
        raise Failed(f"{path} is step {result.get('step')}, not the run's final step {final}: finish the run "
                     "(rerun `python train.py` resumes it) and evaluate again")
    measured = float(result["val_loss"])
    diff = measured - stated
    ok = abs(diff) <= tolerance
    lines = [f"README.md:  val_loss {stated:.3f} (the main job's stated figure)",
             f"measured:   val_loss {measured:.4f} ({path}, step {result.get('step')})",
             f"difference: {diff:+.4f} nats, tolerance ±{tolerance} nats: "
             + ("within" if ok else "OUTSIDE: the recipe or the data changed, or the README's figure is stale")]
    return ok, "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", help="the main job's workdir (runs/dense-small-twin)")
    parser.add_argument("--readme", default=os.path.join(REPO, "README.md"), help="the README to read the figure from")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="nats (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.tolerance >= 0:
        parser.error(f"--tolerance={args.tolerance} must be a non-negative number of nats")
    try:
        ok, report = check(args.workdir, args.readme, args.tolerance)
    except (Failed, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report)
    if not ok:
        print("error: the main job's val_loss is outside the README's figure ± tolerance", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
