"""Train an onóna (or control) model; resumes from the workdir's latest checkpoint.

    python train.py                                   # small twin model on the bundled corpus
    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin \
        --config.data.dir=/data/climbmix --config.mesh.fsdp=-1 --config.mesh.data=1
"""

from absl import flags

from onona_jax import cli
from onona_jax import config as config_lib

DEFAULT_CONFIG = "configs/paper.py:dense-small-twin"


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)", flag_values=fv)
    flags.DEFINE_bool("break_lock", False, "take the workdir's lock from a train.py on another host that is "
                      "gone (a dead process on this host is detected by itself)", flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    from onona_jax import train

    cfg = fv.config
    result = train.train(cfg, fv.workdir or f"runs/{cfg.name or 'default'}", break_lock=fv.break_lock)
    if result.get("preempted"):
        return
    line = "  ".join(f"{k}={v:.4f}" for k, v in result.items() if k.startswith("val_loss"))
    print(f"final step {result['step']}: {line}")


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
