"""`python -m onona_jax.aot`: the command line of the ahead-of-time compile (see the package's
docstring, `python -m onona_jax.aot --help`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import flags

from onona_jax import aot, cli, paths
from onona_jax.aot.fit import suggestions, with_overrides
from onona_jax.aot.report import analyse, format_table
from onona_jax.aot.steps import DoesNotFit
from onona_jax.aot.topology import SLICES, GiB, compiler_missing, cudnn_missing, get_slice


def define(fv, argv):
    flags.DEFINE_string("topology", "v5e-16", "TPU slice or GPU host: " + ", ".join(SLICES), flag_values=fv)
    flags.DEFINE_integer("slices", None, "compile for this many --topology slices joined by the data-center "
                         "network (a multi-slice job; sets mesh.slices; default: the config's mesh.slices)",
                         flag_values=fv)
    flags.DEFINE_string("compare_head", "", "also compile with this head and report ratios (e.g. standard)",
                        flag_values=fv)
    flags.DEFINE_bool("fit", False, "search remat policy × micro-batch and pick the plan that fits with the "
                      "lowest modelled step time", flag_values=fv)
    flags.DEFINE_bool("json", False, "print the report as JSON", flag_values=fv)
    flags.DEFINE_string("json_out", "", "also write the JSON report to this file", flag_values=fv)
    flags.DEFINE_bool("eval_step", True, "also compile the eval step", flag_values=fv)
    flags.DEFINE_float("hbm_gib", 0.0, "HBM per device to plan against (default: the chip's)", flag_values=fv)
    if cli.help_asked(argv[1:]):
        return cli.define_config_for_help(fv, None)
    from onona_jax import config as config_lib  # (jax after __main__ has chosen its platform)

    return config_lib.define_flag(fv, argv, default=None)


def _main(FLAGS, rest):
    from onona_jax import config as config_lib

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    cfg = FLAGS.config
    if cfg is None:
        raise cli.UsageError("--config is required, e.g. --config=configs/paper.py:dense-142m-twin")
    s = get_slice(FLAGS.topology)
    if FLAGS.slices is not None:
        if cfg.mesh.slices not in (1, FLAGS.slices):
            raise cli.UsageError(f"--slices={FLAGS.slices} and --config.mesh.slices={cfg.mesh.slices} disagree; "
                                 "give one of them")
        cfg.mesh.slices = FLAGS.slices
    if cfg.mesh.slices != 1:
        if s.platform != "tpu" or cfg.mesh.slices < 1:
            raise cli.UsageError(f"--slices={cfg.mesh.slices}: multi-slice compiles are for TPU slices "
                                 f"(a positive count); {s.name} is {'a GPU host' if s.platform == 'gpu' else 'a TPU slice'}")
        s = dataclasses.replace(s, slices=cfg.mesh.slices)
    config_lib.validate(cfg)
    # No persistent compilation cache (train.compile_cache) here: a compile-only TPU client cannot
    # load an executable back (jax 0.10.2 + libtpu 0.0.42.1: "PjRtCompiler must be constructed with
    # a Client to call DeserializeLoadedExecutable"), so its entries would be written, never used.
    if FLAGS.compare_head:
        config_lib.validate(with_overrides(cfg, **{"model.head": FLAGS.compare_head}))
    missing = compiler_missing(s) or cudnn_missing(cfg, s)
    if missing:
        raise cli.UsageError(missing)
    log = (lambda m: print(m, file=sys.stderr, flush=True))  # noqa: E731
    hbm = int(FLAGS.hbm_gib * GiB) if FLAGS.hbm_gib else None
    try:
        result = analyse(cfg, s, FLAGS.compare_head or None, FLAGS.fit, hbm, log, eval_step=FLAGS.eval_step)
    except DoesNotFit as err:
        report = getattr(err, "report", {})
        needed = f"{err.needed / GiB:.2f} GiB" if err.needed else "more than available"
        avail = (err.available or hbm or s.hbm_per_device) / GiB
        raise cli.Failure(f"{cfg.name or 'config'} does not fit on {s.label}: needs {needed} of HBM per device, "
                          f"{avail:.2f} GiB available ({err}); try "
                          + "; ".join(suggestions(cfg, s, report, FLAGS.fit))) from None
    except ValueError as err:  # the mesh or the batch does not suit the slice
        raise cli.UsageError(f"{err} (on {s.label}: {s.devices} devices)") from None
    if FLAGS.json_out:
        paths.write_json(FLAGS.json_out, result)
    if FLAGS.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    unfit = [(h, r["train"]) for h, r in result["heads"].items() if not r["train"]["fits"]]
    if unfit:
        head, r = unfit[0]
        raise cli.Failure(f"{cfg.name or 'config'} ({head}) does not fit on {s.label}: needs {r['total'] / GiB:.2f} "
                          f"GiB of HBM per device, {r['hbm'] / GiB:.2f} GiB available; try "
                          + "; ".join(suggestions(with_overrides(cfg, **{"model.head": head}), s, r)))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, aot.__doc__)


if __name__ == "__main__":
    # Compile-only: JAX itself runs on the CPU; libtpu serves the TPU topology and compiler.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU VM metadata server to ask
    cli.run_module(define, _main, aot.__doc__)
