"""Zero-shot multiple-choice tasks, prompted as lm-evaluation-harness's task configs.

Each example becomes a context and choices; choice i is scored as the continuation
" " + choice_i (the harness's target_delimiter " ") after the context, and

- acc            = [argmax_i ll_i == gold]
- acc_norm_bytes = [argmax_i ll_i / len((" " + choice_i).encode("utf-8")) == gold]:
                   the paper's acc_norm, UTF-8 bytes of the continuation INCLUDING its
                   leading space;
- acc_norm_chars = [argmax_i ll_i / len(choice_i) == gold]: the harness's `acc_norm`,
                   characters of the choice WITHOUT the delimiter space,

each averaged over examples (ties go to the first choice, as numpy's argmax in the harness).

Per task (harness task; formats, records in .jsonl / .json / .parquet; context; choices; gold):

- hellaswag (hellaswag): the original `hellaswag_val.jsonl` or the `Rowan/hellaswag` export,
  fields activity_label, ctx_a, ctx_b, endings, label; context
  preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()); choices
  preprocess(ending); gold int(label).
- arc_easy, arc_challenge (arc_easy, arc_challenge): the original `ARC-*-Test.jsonl`
  (question {stem, choices [{text, label}]}, answerKey) or the `allenai/ai2_arc` export
  (question, choices {text, label}, answerKey); context "Question: {question}\nAnswer:";
  choices the choice texts; gold the index of answerKey among the labels.
- piqa (piqa): the `baber/piqa` export (goal, sol1, sol2, label) or the original
  `valid.jsonl` with its `valid-labels.lst` beside it; context "Question: {goal}\nAnswer:";
  choices sol1, sol2; gold label.
- boolq (boolq, SuperGLUE): the original `dev.jsonl` / `google/boolq` (passage, question,
  answer: bool) or the `super_glue` boolq export (label 0/1); context
  "{passage}\nQuestion: {question}?\nAnswer:"; choices "no", "yes"; gold answer.
- sciq (sciq): the original `test.json` (a JSON array) or the `allenai/sciq` export
  (question, support, correct_answer, distractor1-3); context
  "{support.lstrip()}\nQuestion: {question}\nAnswer:"; choices distractor1, distractor2,
  distractor3, correct_answer; gold 3.

hellaswag's `preprocess` is the harness's: strip, " [title]" -> ". ", drop "[...]", "  " -> " ".
The harness's boolq config reports only acc; we report all three for every task.
"""

from __future__ import annotations

import dataclasses
import os
import re

from onona_jax.eval.tasks import data as data_lib


@dataclasses.dataclass
class Example:
    context: str
    choices: list[str]
    gold: int


# ----------------------------------------------------------------------------- per task


def hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def hellaswag(r: dict) -> Example:
    ctx_a = r["ctx_a"] if "ctx_a" in r else r["ctx"]
    ctx_b = r.get("ctx_b", "") if "ctx_a" in r else ""
    ctx = ctx_a + " " + ctx_b.capitalize()
    return Example(hellaswag_preprocess(r["activity_label"] + ": " + ctx),
                   [hellaswag_preprocess(e) for e in r["endings"]], int(r["label"]))


def arc(r: dict) -> Example:
    q = r["question"]
    if isinstance(q, dict):  # original ARC jsonl
        stem, texts = q["stem"], [c["text"] for c in q["choices"]]
        labels = [c["label"] for c in q["choices"]]
    else:  # allenai/ai2_arc
        stem, texts, labels = q, list(r["choices"]["text"]), list(r["choices"]["label"])
    return Example(f"Question: {stem}\nAnswer:", texts, labels.index(r["answerKey"]))


def piqa(r: dict) -> Example:
    return Example(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], int(r["label"]))


def boolq(r: dict) -> Example:
    gold = r["label"] if "label" in r else r["answer"]
    return Example(f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:", ["no", "yes"], int(gold))


def sciq(r: dict) -> Example:
    return Example(f"{r['support'].lstrip()}\nQuestion: {r['question']}\nAnswer:",
                   [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]], 3)


# task name -> (converter, required fields, harness task)
TASKS = {
    "hellaswag": (hellaswag, ["activity_label", "endings", "label"], "hellaswag"),
    "arc_easy": (arc, ["question", "answerKey"], "arc_easy"),
    "arc_challenge": (arc, ["question", "answerKey"], "arc_challenge"),
    "piqa": (piqa, ["goal", "sol1", "sol2", "label"], "piqa"),
    "boolq": (boolq, ["passage", "question"], "boolq"),
    "sciq": (sciq, ["question", "support", "correct_answer", "distractor1", "distractor2", "distractor3"], "sciq"),
}


def _piqa_labels(path: str, records: list[dict]) -> tuple[list[dict], list[str]]:
    """The original PIQA release keeps labels in `<split>-labels.lst` beside `<split>.jsonl`."""
    if all("label" in r for r in records):
        return records, [path]
    stem = re.sub(r"\.(jsonl|json)$", "", path)
    labels_path = stem + "-labels.lst"
    if not os.path.isfile(labels_path):
        raise ValueError(f"piqa: {path} has no 'label' field and no {labels_path} beside it")
    with open(labels_path, encoding="utf-8") as f:
        labels = [line.strip() for line in f if line.strip()]
    if len(labels) != len(records):
        raise ValueError(f"piqa: {labels_path} has {len(labels)} labels for {len(records)} examples")
    return [{**r, "label": int(lab)} for r, lab in zip(records, labels)], [path, labels_path]


def load(task: str, path: str) -> tuple[list[Example], list[str]]:
    """(examples, files read) of a multiple-choice task."""
    convert, required, _ = TASKS[task]
    records = data_lib.read_records(path)
    files = [path]
    if task == "piqa":
        records, files = _piqa_labels(path, records)
    if task == "boolq":
        required = required + ["label" if records and "label" in records[0] else "answer"]
    if task == "hellaswag" and records and "ctx_a" not in records[0]:
        required = required + ["ctx"]
    examples = []
    for i, r in enumerate(records):
        data_lib.require(r, required, path, i)
        examples.append(convert(r))
    return examples, files


# ----------------------------------------------------------------------------- scoring


def _argmax(values) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def score(scorer, examples: list[Example]) -> tuple[list[list[float]], dict]:
    """(per-example choice log-likelihoods, {acc, acc_norm_bytes, acc_norm_chars})."""
    pairs = [(ex.context, " " + c) for ex in examples for c in ex.choices]
    results = scorer.loglikelihood(pairs)
    lls, k = [], 0
    hits = {"acc": 0, "acc_norm_bytes": 0, "acc_norm_chars": 0}
    for ex in examples:
        ll = [x for x, _ in results[k:k + len(ex.choices)]]
        k += len(ex.choices)
        lls.append(ll)
        hits["acc"] += _argmax(ll) == ex.gold
        by_bytes = [x / len((" " + c).encode("utf-8")) for x, c in zip(ll, ex.choices)]
        hits["acc_norm_bytes"] += _argmax(by_bytes) == ex.gold
        hits["acc_norm_chars"] += _argmax([x / len(c) for x, c in zip(ll, ex.choices)]) == ex.gold
    n = max(1, len(examples))
    return lls, {m: h / n for m, h in hits.items()}


def evaluate(scorer, task: str, path: str, limit: int | None = None) -> dict:
    examples, files = load(task, path)
    examples = examples[:limit] if limit else examples
    _, metrics = score(scorer, examples)
    return {
        "task": task,
        "harness_task": TASKS[task][2],
        "metrics": metrics,
        "samples": len(examples),
        "max_length": scorer.max_length,
        "data": data_lib.fingerprint(files if len(files) > 1 else files[0]),
    }
