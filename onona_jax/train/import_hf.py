"""Import a transformers folder (our export, or a Qwen3 / Qwen3-MoE checkpoint with a
GPT-2-sized vocabulary) as a workdir checkpoint at step 0 with a fresh optimizer state.

    python -m onona_jax.train.import_hf --from_hf=DIR --workdir=OUT [--mesh=-1,1,1]

It lives with training because what it writes is a run's starting state (parameters, AdamW
moments, step); the tensor mapping is `serve.hf_format`'s. eval.py, serving, export and
`train.py --config.init_from=OUT` (upcycling) read the result.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
from absl import flags

from onona_jax import cli, paths
from onona_jax import config as config_lib
from onona_jax.checkpoint import Checkpoints
from onona_jax.serve import hf_format
from onona_jax.train.lock import WorkdirLock
from onona_jax.train.state import new_state, setup


def import_folder(path: str, workdir: str, mesh=(-1, 1, 1), devices=None) -> dict:
    """A transformers folder -> a workdir checkpoint at step 0 (`workdir/checkpoints/0`): the
    parameters, a FRESH optimizer state, step 0 and the config (the export's own training
    config when the folder has `onona_train_config.json`). eval.py, serving, export and
    `train.py --config.init_from` read it. Refuses a workdir that already has checkpoints, or
    whose lock (lock.json, as train.py takes it) another writer holds, before writing anything."""
    hf = hf_format.read_config(path)
    train_config = hf_format.read_train_config(path)
    base = None if train_config is None else ml_collections.ConfigDict(train_config)
    cfg = hf_format.model_config_from_hf(hf, base)
    if base is None:
        cfg.name = f"hf-{os.path.basename(os.path.normpath(path))}"
        cfg.model.dtype = "float32"
    cfg.init_from = ""
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh
    config_lib.validate(cfg)
    hf_format.check_supported(cfg.model)
    ckpt_dir = paths.Workdir(workdir).checkpoints

    def refuse_a_used_workdir():
        if paths.isdir(ckpt_dir) and any(paths.path(ckpt_dir).iterdir()):
            raise ValueError(f"{ckpt_dir} already holds checkpoints; import into an empty workdir")

    refuse_a_used_workdir()
    params = hf_format.from_hf(hf_format.read_weights(path), cfg.model)  # every name and shape checked before any write
    run = setup(cfg, devices)
    with WorkdirLock(workdir):  # a writer like train.py: refused (exit 2, nothing written) while one runs
        refuse_a_used_workdir()  # again, now that no other writer can start meanwhile
        params = jax.device_put(params, run.param_shardings)
        train_state = jax.jit(lambda p: new_state(run, p), out_shardings=run.state_shardings)(params)
        paths.write_atomic(paths.Workdir(workdir).config, cfg.to_json(indent=2))
        ckpts = Checkpoints(ckpt_dir, keep=cfg.train.keep_checkpoints)
        # No data iterator to record: training on this workdir directly is refused by the
        # iterator's state check; start a new run with --config.init_from=<this workdir> instead.
        ckpts.save(0, train_state, {"step": 0, "imported_from": os.path.abspath(path)}, cfg.to_json())
        ckpts.wait()
    return dict(workdir=paths.absolute(workdir), step=0, source=os.path.abspath(path),
                model_type=hf.get("model_type"), config=cfg.name, arch=cfg.model.arch, head=cfg.model.head)


def define(fv, argv):
    flags.DEFINE_string("from_hf", None, "transformers model folder to import", flag_values=fv, required=True)
    flags.DEFINE_string("workdir", None, "run directory to write (must hold no checkpoints)", flag_values=fv,
                        required=True)
    cli.define_mesh(fv)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    try:
        summary = import_folder(fv.from_hf, fv.workdir, cli.mesh(fv))
    except OSError as err:  # unreadable folder, full disk: nothing is overwritten
        raise cli.Failure(str(err)) from None
    print(json.dumps(summary, indent=2))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
