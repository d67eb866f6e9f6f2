"""Train an onóna (or control) model; resumes from the workdir's latest checkpoint.

    python train.py                                   # small twin model on the bundled corpus
    python train.py --config=configs/paper.py:dense-142m-twin --workdir=runs/142m-twin \
        --config.data.dir=/data/climbmix --config.mesh.fsdp=-1 --config.mesh.data=1
"""

from absl import flags

from onona_jax import cli

DEFAULT_CONFIG = "configs/paper.py:dense-small-twin"
# The lock now knows a live holder from a dead one everywhere (onona_jax/train/lock.py), so there
# is nothing left for the flag to break; kept so that old scripts get this answer.
RETIRED_BREAK_LOCK = (
    "--break_lock is retired: a workdir's lock is never taken from a run that is alive, and one left by a "
    "run that died is taken without it (on local disk and NFS at once, the OS having released it; in a "
    "bucket once its lease has gone unrenewed). Rerun without --break_lock; if the workdir is in use, "
    "wait for that run, stop it, or use another --workdir")


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)", flag_values=fv)
    flags.DEFINE_bool("break_lock", False, "retired: a workdir's lock is never taken from a live run, and a "
                      "dead run's is taken without it (docs/reliability.md)", flag_values=fv)
    if cli.help_asked(argv[1:]):
        return cli.define_config_for_help(fv, DEFAULT_CONFIG)
    from onona_jax import config as config_lib  # (here, not at the top: --help stays fast without jax)

    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    if fv.break_lock:
        raise cli.UsageError(RETIRED_BREAK_LOCK)
    from onona_jax import train

    cfg = fv.config
    result = train.train(cfg, fv.workdir or f"runs/{cfg.name or 'default'}")
    if result.get("preempted"):  # its line said which step it saved; Ctrl-C: the shell's 130
        return cli.INTERRUPTED if result.get("interrupted") else None
    line = "  ".join(f"{k}={v:.4f}" for k, v in result.items() if k.startswith("val_loss"))
    print(f"final step {result['step']}: {line}")


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
