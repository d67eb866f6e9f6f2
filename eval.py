"""Evaluate a trained checkpoint.

    python eval.py --workdir=runs/dense-small-twin [--step=N] [--output=PATH]
    python eval.py --workdir=DIR --tasks=val,wikitext2,lambada,hellaswag,mmlu \\
        --task_data_dir=/data/eval [--task_data=lambada=/data/lambada_test.jsonl,...]

`--tasks` (default `val`): `val` is the validation loss on the held-out windows (and, for
twin models, val_loss_a_only / val_loss_b_only); the others are the downstream tasks of
`onona_jax.eval.tasks` (wikitext2, lambada, hellaswag, arc_easy, arc_challenge, piqa, boolq, sciq,
mmlu), each read from a local file: `--task_data=name=PATH` or, failing that, the public
release's file name under `--task_data_dir` (see `onona_jax.eval.tasks.DEFAULT_FILES`).

Writes JSON to PATH, by default DIR/eval/step_<N>.json: the config name and step, the
validation keys at the top level as before, and under "tasks" one entry per task (its
metrics, sample count, and the data file's path and sha256).

The training loop scores the same tasks during training (`train.tasks`) through the same code,
`onona_jax.eval.tasks.Downstream`.
"""

import json
import sys

from absl import flags

from onona_jax import cli, paths


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory with checkpoints/", flag_values=fv, required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)
    flags.DEFINE_string("output", None, "result JSON (default: DIR/eval/step_<N>.json)", flag_values=fv)
    cli.define_mesh(fv)
    flags.DEFINE_list("tasks", ["val"], "val and/or downstream tasks: wikitext2, lambada, hellaswag, "
                      "arc_easy, arc_challenge, piqa, boolq, sciq, mmlu", flag_values=fv)
    flags.DEFINE_list("task_data", [], "name=PATH,... local data file (or directory, for mmlu) per task",
                      flag_values=fv)
    flags.DEFINE_string("task_data_dir", None, "directory holding the tasks' public files under their release "
                        "names", flag_values=fv)
    flags.DEFINE_integer("task_batch", 8, "rows per scoring batch (rounded up to the data-parallel size)",
                         flag_values=fv)
    flags.DEFINE_integer("max_length", 1024, "tokens of context per scored request / rolling window", flag_values=fv)
    flags.DEFINE_integer("mmlu_shots", 5, "MMLU few-shot examples from the dev split (up to this many)",
                         flag_values=fv)
    flags.DEFINE_integer("limit", None, "score only the first N examples of each task (quick checks)", flag_values=fv)
    flags.DEFINE_string("compile_cache", None, "JAX's persistent compilation cache: a directory or bucket URL, "
                        "'' for none (default: train.compile_cache's default, docs/training.md)", flag_values=fv)


def parse_task_data(items) -> dict:
    from onona_jax.eval import tasks  # (here, not at the top: --help stays fast without jax)

    return tasks.parse_task_data(items)


def evaluate(workdir: str, step=None, mesh=(-1, 1, 1), names=("val",), task_data=None, data_dir=None,
             batch: int = 8, max_length: int = 1024, shots: int = 5, limit=None) -> dict:
    """The combined result dict (what main writes)."""
    from onona_jax.eval import validation as evaluation
    from onona_jax.eval.tasks.scoring import mesh_devices

    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    downstream = [n for n in names if n != "val"]
    if not names:
        raise ValueError("--tasks is empty; give val and/or downstream task names")
    devices = mesh_devices(mesh)
    result = {}
    task_files = {}
    if downstream:
        from onona_jax.eval import tasks

        task_files = tasks.resolve_paths(downstream, task_data, data_dir)  # fail before any restore
    loaded = evaluation.load(workdir, step, mesh, devices)  # one restore serves every task
    params, step, cfg, grid = loaded
    if "val" in names:
        result = evaluation.validation(workdir, mesh=mesh, devices=devices, loaded=loaded)
    if downstream:
        result.setdefault("config", cfg.name)
        result.setdefault("step", step)
        # The training loop's train.tasks scores through the same `Downstream` (one code path).
        result["tasks"] = tasks.Downstream(cfg, grid, downstream, task_files, batch=batch, max_length=max_length,
                                           shots=shots, limit=limit, progress=True)(params)
    return result


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    cli.check_output_file(fv.output, "eval.json")  # before the evaluation, not after it
    if not fv.output:  # the default, DIR/eval/, likewise (a read-only workdir: say so now)
        cli.check_output_dir(paths.Workdir(fv.workdir).eval, "--output=PATH on a writable disk")
    from onona_jax import compile_cache

    cache = compile_cache.default_dir() if fv.compile_cache is None else fv.compile_cache
    compile_cache.use(cache, key="--compile_cache")  # before the evaluation compiles
    result = evaluate(fv.workdir, fv.step, cli.mesh(fv), fv.tasks, parse_task_data(fv.task_data),
                      fv.task_data_dir, fv.task_batch, fv.max_length, fv.mmlu_shots, fv.limit)
    from onona_jax.eval import validation

    path = fv.output or paths.Workdir(fv.workdir).eval_result(result["step"])
    validation.write_json(result, path)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
