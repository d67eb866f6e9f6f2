"""LAMBADA (OpenAI's detokenised version), as lm-evaluation-harness's `lambada_openai`.

Format: records with a `text` field: OpenAI's `lambada_test.jsonl` (`{"text": ...}` per
line, 5,153 examples) or the `EleutherAI/lambada_openai` jsonl/parquet export.

Each passage is split at its last space (Python's text.split(" ")): context = all but the
last word joined by " ", target = " " + last word. perplexity = exp(-mean over examples of
log p(target | context)) (the harness's `perplexity` aggregation: per-word, since each
example is one word, however many tokens it takes); acc = the fraction of examples whose
every target token is the model's argmax (greedy) prediction.
"""

from __future__ import annotations

import math

from onona_jax.eval.tasks import data as data_lib

HARNESS_TASK = "lambada_openai"


def load(path: str) -> list[str]:
    records = data_lib.read_records(path)
    for i, r in enumerate(records):
        data_lib.require(r, ["text"], path, i)
    return [r["text"] for r in records]


def split(text: str) -> tuple[str, str]:
    """(context, target) as the harness's doc_to_text / doc_to_target."""
    words = text.split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def evaluate(scorer, path: str, limit: int | None = None) -> dict:
    texts = load(path)
    texts = texts[:limit] if limit else texts
    results = scorer.loglikelihood([split(t) for t in texts])
    lls = [ll for ll, _ in results]
    return {
        "task": "lambada",
        "harness_task": HARNESS_TASK,
        "metrics": {
            "perplexity": math.exp(-sum(lls) / len(lls)),
            "acc": sum(g for _, g in results) / len(results),
        },
        "samples": len(texts),
        "max_length": scorer.max_length,
        "data": data_lib.fingerprint(path),
    }
