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

DEFAULT_CONFIG = "configs/paper.py:dense-small-twin"


def exit_on_unknown_override(argv):
    """An override of a config key that does not exist (config_flags raises a bare
    AttributeError/KeyError from deep inside) becomes a one-line error and exit status 2."""
    import difflib

    from ml_collections import ConfigDict

    from onona_jax import config as config_lib

    spec = DEFAULT_CONFIG
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--config="):
            spec = arg[len("--config="):]
        elif arg == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    try:
        cfg = config_lib.load(spec)
    except Exception:  # noqa: BLE001 - not an unknown key after all: let the original error speak
        return
    for arg in argv[1:]:
        if not arg.startswith("--config."):
            continue
        parts = arg[len("--config."):].split("=", 1)[0].split(".")
        node = cfg
        for i, part in enumerate(parts):
            if isinstance(node, ConfigDict) and part in node:
                node = node[part]
                continue
            parent = ".".join(["config", *parts[:i]])
            keys = sorted(node.keys()) if isinstance(node, ConfigDict) else []
            close = difflib.get_close_matches(part, keys, 1)
            hint = (f"did you mean {parent}.{close[0]}?" if close else
                    f"{parent} has keys {', '.join(keys)}" if keys else f"{parent} is a value, not a group")
            print(f"error: unknown config key config.{'.'.join(parts)} in {arg!r}; {hint} "
                  "(every key, with its default, is in onona_jax/config.py)", file=sys.stderr)
            sys.exit(2)


try:  # without --config the default file is loaded (and overridden) right here
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "configs/<file>.py:<arg>", lock_config=True)
except (AttributeError, KeyError):
    exit_on_unknown_override(sys.argv)
    raise
flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)")
FLAGS = flags.FLAGS


def parse_flags(argv):
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError):
        exit_on_unknown_override(argv)
        raise


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
    app.run(main, flags_parser=parse_flags)
