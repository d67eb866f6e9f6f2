"""Downstream evaluation tasks (SPEC §5) read from local files, scored as lm-evaluation-harness
scores them (its prompts, request tokenisation, rolling windows and aggregations).

    from onona_jax.eval import tasks
    scorer = tasks.Scorer.from_workdir("runs/142m-twin")           # MoE: capacity 4.0
    result = tasks.evaluate(scorer, ["wikitext2", "lambada"], {"wikitext2": "wiki.test.raw",
                                                                "lambada": "lambada_test.jsonl"})

Each result records the task, the harness task it follows, its metrics, the sample count,
the scorer's max_length, the data's path and sha256 and the run's tokenizer (its identity:
text is tokenised with it, and its eot starts every document). Formats per task: the modules'
docstrings (`wikitext`, `lambada`, `multiple_choice`, `mmlu`) and docs/evaluation.md.

`Downstream` scores a set of tasks on any parameters: eval.py and the training loop's
`train.tasks` both go through it.
"""

from __future__ import annotations

import os

from onona_jax.eval.tasks import lambada, mmlu, multiple_choice, wikitext
from onona_jax.eval.tasks.scoring import Scorer, encode_pair, rolling_windows  # noqa: F401

TASK_NAMES = ("wikitext2", "lambada", "hellaswag", "arc_easy", "arc_challenge", "piqa", "boolq", "sciq", "mmlu")

# Where `--task_data_dir=DIR` looks for each task, relative to DIR (the public releases'
# file names); the first that exists is used.
DEFAULT_FILES = {
    "wikitext2": ["wikitext-2-raw/wiki.test.raw", "wiki.test.raw", "wikitext/wiki.test.raw", "wikitext2.jsonl",
                  "wikitext2.parquet"],
    "lambada": ["lambada_test.jsonl", "lambada_openai.jsonl", "lambada.jsonl", "lambada.parquet"],
    "hellaswag": ["hellaswag_val.jsonl", "hellaswag.jsonl", "hellaswag.parquet"],
    "arc_easy": ["ARC-V1-Feb2018-2/ARC-Easy/ARC-Easy-Test.jsonl", "ARC-Easy-Test.jsonl", "arc_easy.jsonl",
                 "arc_easy.parquet"],
    "arc_challenge": ["ARC-V1-Feb2018-2/ARC-Challenge/ARC-Challenge-Test.jsonl", "ARC-Challenge-Test.jsonl",
                      "arc_challenge.jsonl", "arc_challenge.parquet"],
    "piqa": ["piqa/valid.jsonl", "valid.jsonl", "piqa.jsonl", "piqa.parquet"],
    "boolq": ["boolq/dev.jsonl", "boolq.jsonl", "boolq.parquet"],
    "sciq": ["SciQ dataset-2 3/test.json", "sciq/test.json", "sciq.jsonl", "sciq.parquet"],
    "mmlu": ["mmlu/data", "data", "mmlu"],
}


def parse_task_data(items, key: str = "--task_data") -> dict:
    """["name=PATH", ...] -> {name: PATH} (eval.py's --task_data, the training loop's
    train.task_data); `key` names the option in the error."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"{key} entry {item!r}: use name=PATH")
        out[name.strip()] = path.strip()
    return out


def resolve_paths(names, task_data: dict | None = None, data_dir: str | None = None, *,
                  data_key: str = "--task_data", dir_key: str = "--task_data_dir") -> dict:
    """{task: path}: an explicit path wins, else the first DEFAULT_FILES entry under data_dir.
    `data_key`, `dir_key`: the options the errors tell the user to set (eval.py's flags, or
    train.task_data and train.task_data_dir)."""
    task_data = dict(task_data or {})
    unknown = sorted(set(task_data) - set(TASK_NAMES))
    if unknown:
        raise ValueError(f"{data_key} names unknown task(s) {unknown}; tasks are {', '.join(TASK_NAMES)}")
    out = {}
    for name in names:
        if name not in TASK_NAMES:
            raise ValueError(f"unknown task {name!r}; choose from val, {', '.join(TASK_NAMES)}")
        if name in task_data:
            if not os.path.exists(task_data[name]):
                raise ValueError(f"task data for {name}: {task_data[name]!r} does not exist; "
                                 f"fix {data_key}={name}=PATH")
            out[name] = task_data[name]
            continue
        found = [os.path.join(data_dir, f) for f in DEFAULT_FILES[name]] if data_dir else []
        found = [p for p in found if os.path.exists(p)]
        if not found:
            where = f" (looked under {data_dir} for {DEFAULT_FILES[name]})" if data_dir else ""
            raise ValueError(f"no data for task {name}{where}; give {data_key}={name}=PATH "
                             f"(or {dir_key}=DIR holding {DEFAULT_FILES[name][0]})")
        out[name] = found[0]
    return out


def validate_data(name: str, path: str) -> None:
    """Read task `name`'s data at `path` as scoring will (its records, their fields), scoring
    nothing: a bad file is found before a training run starts, not at its first scoring."""
    if name == "wikitext2":
        wikitext.load(path)
    elif name == "lambada":
        lambada.load(path)
    elif name == "mmlu":
        mmlu.load(path)
    elif name in multiple_choice.TASKS:
        multiple_choice.load(name, path)
    else:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}")


def run(scorer, name: str, path: str, *, shots: int = 5, limit: int | None = None) -> dict:
    """One task's result dict."""
    if name == "wikitext2":
        return wikitext.evaluate(scorer, path, limit)
    if name == "lambada":
        return lambada.evaluate(scorer, path, limit)
    if name == "mmlu":
        return mmlu.evaluate(scorer, path, shots, limit)
    if name in multiple_choice.TASKS:
        return multiple_choice.evaluate(scorer, name, path, limit)
    raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}")


def evaluate(scorer, names, paths: dict, *, shots: int = 5, limit: int | None = None) -> dict:
    """{task: result} for each task name, reading paths[task]."""
    out = {}
    for name in names:
        result = run(scorer, name, paths[name], shots=shots, limit=limit)
        if limit:
            result["limit"] = limit
        result["tokenizer"] = scorer.tokenizer.identity()
        out[name] = result
    return out


class Downstream:
    """Tasks scored on any parameters of one model on one mesh. eval.py's "tasks" (a restored
    checkpoint) and the training loop's task/<name>/<metric> (train.tasks, its live parameters)
    are this one code path. The scorer is built once, so its jitted function, and the
    executable jit keeps per padded batch shape, serve every call: a run scoring every N steps
    compiles once."""

    def __init__(self, cfg, mesh, names, paths: dict, *, batch: int = 8, max_length: int = 1024, shots: int = 5,
                 limit: int | None = None, progress: bool = False):
        self.names, self.paths, self.shots, self.limit = list(names), dict(paths), shots, limit or None
        self.scorer = Scorer.from_params(None, cfg, mesh, batch_size=batch, max_length=max_length, progress=progress)

    def __call__(self, params) -> dict:
        """{task: result} (`evaluate`) under `params`, placed on the mesh. Every process of a
        multi-host mesh calls it: the batches are sharded over all of them."""
        self.scorer.params = params
        try:
            return evaluate(self.scorer, self.names, self.paths, shots=self.shots, limit=self.limit)
        finally:
            self.scorer.params = None  # (the training loop's next step donates them)


def metrics_row(results: dict) -> dict:
    """{"task/<name>/<metric>": value} of `evaluate`'s results: the scalars the training loop
    logs (metrics.jsonl, TensorBoard, W&B)."""
    return {f"task/{name}/{key}": float(value) for name, r in results.items() for key, value in r["metrics"].items()}
