"""Downstream evaluation tasks (SPEC §5) read from local files, scored as lm-evaluation-harness
scores them (its prompts, request tokenisation, rolling windows and aggregations).

    from onona_jax.eval import tasks
    scorer = tasks.Scorer.from_workdir("runs/142m-twin")           # MoE: capacity 4.0
    result = tasks.evaluate(scorer, ["wikitext2", "lambada"], {"wikitext2": "wiki.test.raw",
                                                                "lambada": "lambada_test.jsonl"})

Each result records the task, the harness task it follows, its metrics, the sample count,
the scorer's max_length, the data's path and sha256 and the run's tokenizer (its identity:
text is tokenised with it, and its eot starts every document). Formats per task: the modules'
docstrings (`wikitext`, `lambada`, `multiple_choice`, `mmlu`) and README.md.
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


def resolve_paths(names, task_data: dict | None = None, data_dir: str | None = None) -> dict:
    """{task: path}: an explicit path wins, else the first DEFAULT_FILES entry under data_dir."""
    task_data = dict(task_data or {})
    unknown = sorted(set(task_data) - set(TASK_NAMES))
    if unknown:
        raise ValueError(f"task data given for unknown task(s) {unknown}; tasks are {', '.join(TASK_NAMES)}")
    out = {}
    for name in names:
        if name not in TASK_NAMES:
            raise ValueError(f"unknown task {name!r}; choose from val, {', '.join(TASK_NAMES)}")
        if name in task_data:
            if not os.path.exists(task_data[name]):
                raise ValueError(f"task data for {name}: {task_data[name]!r} does not exist")
            out[name] = task_data[name]
            continue
        found = [os.path.join(data_dir, f) for f in DEFAULT_FILES[name]] if data_dir else []
        found = [p for p in found if os.path.exists(p)]
        if not found:
            where = f" (looked under {data_dir} for {DEFAULT_FILES[name]})" if data_dir else ""
            raise ValueError(f"no data for task {name}{where}; give --task_data={name}=PATH")
        out[name] = found[0]
    return out


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
