"""Downstream tasks during training (`train.tasks`): resolved and read once at the run's start,
before anything compiles or is written (`resolve`), then scored on the live parameters every
`train.tasks_every` steps and at the last step by eval.py's own code (`tasks.Downstream`), so a
logged `task/<name>/<metric>` equals `eval.py --tasks=<name> --max_length=<data.seq_len>
--task_batch=<eval.batch>` on that step's checkpoint. The loop times the scoring as
`task_s`, kept out of tokens/s and MFU as validation is.
"""

from __future__ import annotations

from onona_jax.eval import tasks as tasks_lib


def names(cfg) -> list[str]:
    """train.tasks as a list, in order, without repeats."""
    return list(dict.fromkeys(n.strip() for n in cfg.train.tasks.split(",") if n.strip()))


def resolve(cfg) -> dict:
    """{task: path} of train.tasks ({} when none), each file present and readable in its task's
    format; otherwise a ValueError naming the key and the fix. Every process reads its own copy:
    on a multi-host run every host scores."""
    wanted = names(cfg)
    if not wanted:
        return {}
    if "val" in wanted:
        raise ValueError("train.tasks names val: the validation loss already runs every train.eval_every steps "
                         "and at the end; list downstream tasks only")
    unknown = [n for n in wanted if n not in tasks_lib.TASK_NAMES]
    if unknown:
        raise ValueError(f"train.tasks={cfg.train.tasks!r}: unknown task(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(tasks_lib.TASK_NAMES)} (eval.py --tasks' names)")
    task_data = tasks_lib.parse_task_data([i for i in cfg.train.task_data.split(",") if i.strip()],
                                          key="train.task_data")
    files = tasks_lib.resolve_paths(wanted, task_data, cfg.train.task_data_dir or None,
                                    data_key="train.task_data", dir_key="train.task_data_dir")
    for name, path in files.items():
        try:
            tasks_lib.validate_data(name, path)
        except (ValueError, OSError) as err:
            raise ValueError(f"train.tasks: {name} cannot read {path} ({err}); fix the file or point "
                             f"train.task_data={name}=PATH at another") from None
    return files


class TrainTasks:
    """The run's tasks on its mesh: `due(step, last)`, and `__call__(params)` -> the logged row
    {task/<name>/<metric>: value}. One `tasks.Downstream`, built once, so every scoring reuses the
    executables the first one compiled."""

    def __init__(self, cfg, mesh, files: dict):
        self.every = cfg.train.tasks_every
        self.downstream = tasks_lib.Downstream(
            cfg, mesh, list(files), files, batch=cfg.eval.batch, max_length=cfg.data.seq_len,
            limit=cfg.train.tasks_limit or None) if files else None

    def due(self, step: int, last: int) -> bool:
        """Score after `step`? Every train.tasks_every steps, and the run's last step."""
        return self.downstream is not None and (step == last or bool(self.every and step % self.every == 0))

    def __call__(self, params) -> dict:
        return tasks_lib.metrics_row(self.downstream(params))
