"""LAMBADA (OpenAI's detokenised version), as lm-evaluation-harness's `lambada_openai`.

Format: records with a `text` field: OpenAI's `lambada_test.jsonl` (`{"text": ...}` per
line, 5,153 examples) or the `EleutherAI/lambada_openai` jsonl/parquet export.

Each passage is split at its last space (Python's text.split(" ")): context = all but the
last word joined by " ", target = " " + last word. perplexity = exp(-mean over examples of
log p(target | context)) (the harness's `perplexity` aggregation: per-word, since each
example is one word, however many tokens it takes, so it compares across tokenizers); acc =
the fraction of examples whose every target token is the model's argmax (greedy) prediction.
Besides (ours, not the harness's): byte_perplexity = exp(-Σ ll / Σ bytes) and bits_per_byte =
-Σ ll / Σ bytes / ln 2 over the UTF-8 bytes of the targets (" " + last word: exactly the text
scored), and token_perplexity = exp(-Σ ll / Σ target tokens) under the run's tokenizer.
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
    pairs = [split(t) for t in texts]
    requests = [scorer.encode_pair(c, x) for c, x in pairs]
    results = scorer.loglikelihood_tokens(requests)
    lls = [ll for ll, _ in results]
    total = sum(lls)
    nbytes = sum(len(x.encode("utf-8")) for _, x in pairs)
    tokens = sum(len(cont) for _, cont in requests)
    return {
        "task": "lambada",
        "harness_task": HARNESS_TASK,
        "metrics": {
            "perplexity": math.exp(-total / len(lls)),
            "acc": sum(g for _, g in results) / len(results),
            "byte_perplexity": math.exp(-total / nbytes),
            "bits_per_byte": -total / nbytes / math.log(2),
            "token_perplexity": math.exp(-total / tokens),
        },
        "samples": len(texts),
        "counts": {"loglikelihood": total, "words": len(lls), "bytes": nbytes, "tokens": tokens},
        "max_length": scorer.max_length,
        "data": data_lib.fingerprint(path),
    }
