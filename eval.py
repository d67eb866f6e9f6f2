"""Evaluate a trained checkpoint.

    python eval.py --workdir=runs/dense-small-twin [--step=N] [--output=PATH]

Writes JSON (val_loss and, for twin models, val_loss_a_only / val_loss_b_only, the step and
the config name) to PATH, by default DIR/eval/step_<N>.json.
"""

import json
import os
import sys

from absl import app, flags, logging

from onona_jax import platform

platform.initialize()

flags.DEFINE_string("workdir", None, "run directory with checkpoints/", required=True)
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.DEFINE_string("output", None, "result JSON (default: DIR/eval/step_<N>.json)")
flags.DEFINE_list("mesh", ["-1", "1", "1"], "data,fsdp,tensor sizes of this run's mesh")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only manager won't save
    from onona_jax import evaluation

    try:
        mesh = tuple(int(x) for x in FLAGS.mesh)
        result = evaluation.validation(FLAGS.workdir, FLAGS.step, mesh)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    path = FLAGS.output or os.path.join(FLAGS.workdir, "eval", f"step_{result['step']}.json")
    evaluation.write_json(result, path)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
