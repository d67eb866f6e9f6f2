"""Weights & Biases as a second logger beside TensorBoard (train.wandb_project; the `[wandb]`
extra): the same scalars at the same steps, and the run's config. Process 0 only, made by
`metrics.MetricsLog`, which fans every logged step out to it.

The W&B run's id is kept in `<workdir>/wandb_id` (written atomically before the run starts),
so a rerun on the workdir (after a pre-emption) logs on into the same W&B run. Every scalar is
plotted against the training step (the `step` scalar, W&B's `define_metric`), not W&B's own
counter of calls: a resumed run logs again the steps after its checkpoint, which W&B's
counter would refuse as going backwards.
"""

from __future__ import annotations

import secrets

from onona_jax import cli, paths


def local_dir(workdir: str) -> str | None:
    """Where W&B keeps its files (it syncs them itself): `<workdir>/wandb` for a local workdir;
    for a bucket workdir, W&B's default (./wandb, or $WANDB_DIR), since it writes local files."""
    return None if paths.is_cloud(workdir) else paths.absolute(workdir)


class WandbLog:
    def __init__(self, cfg, workdir: str):
        import wandb  # (config.validate has checked it is installed)

        id_path = paths.Workdir(workdir).wandb_id
        try:
            run_id = paths.read_text(id_path).strip() if paths.exists(id_path) else ""
            if not run_id:
                run_id = secrets.token_hex(4)  # (W&B's own is 8 characters of [a-z0-9] too)
                paths.write_atomic(id_path, run_id + "\n")
        except OSError as err:
            raise cli.Failure(f"cannot read or write {id_path} ({cli.reason(err)}); make the workdir "
                              "writable (or free space), then rerun the same command") from None
        self.id = run_id
        try:
            # console="off": W&B would otherwise wrap sys.stdout and sys.stderr to upload them; the
            # run's output stays the process's own.
            self.run = wandb.init(project=cfg.train.wandb_project, id=run_id, resume="allow",
                                  name=cfg.name or None, dir=local_dir(workdir),
                                  settings=wandb.Settings(console="off"))
        except Exception as err:  # noqa: BLE001 - W&B's own errors: no login, no network, a bad project
            first = (str(err).strip().splitlines() or [""])[0][:300]
            raise cli.Failure(
                f"could not start Weights & Biases run {run_id} in project {cfg.train.wandb_project!r} "
                f"({type(err).__name__}: {first}); log in (`wandb login`) or set WANDB_MODE=offline (sync later "
                "with `wandb sync`), or set train.wandb_project='' to log to TensorBoard only") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        # A resumed run may have changed the keys config.RESUMABLE_KEYS allows: the latest wins.
        self.run.config.update(cfg.to_dict(), allow_val_change=True)

    def write(self, step: int, metrics: dict):
        self.run.log({"step": step, **metrics})

    def close(self):
        """Never raises (as MetricsLog.close): every logged step is already with W&B's process."""
        try:
            self.run.finish()
        except Exception:  # noqa: BLE001
            pass
