"""Train an onóna (or control) model; resumes from the workdir's latest checkpoint.

    python train.py                                   # small twin model on the bundled corpus
    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin \
        --config.data.dir=/data/climbmix --config.mesh.fsdp=-1 --config.mesh.data=1
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from onona_jax import platform

platform.initialize()  # jax.distributed on multi-host launches; must precede device use

config_flags.DEFINE_config_file(
    "config", "configs/paper.py:dense-small-twin", "configs/<file>.py:<arg>", lock_config=True
)
flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    from onona_jax import trainer

    cfg = FLAGS.config
    workdir = FLAGS.workdir or f"runs/{cfg.name or 'default'}"
    try:
        result = trainer.train(cfg, workdir)
    except (ValueError, trainer.NonFiniteLoss) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1 if isinstance(err, trainer.NonFiniteLoss) else 2)
    if result.get("preempted"):
        return
    line = "  ".join(f"{k}={v:.4f}" for k, v in result.items() if k.startswith("val_loss"))
    print(f"final step {result['step']}: {line}")


if __name__ == "__main__":
    app.run(main)
