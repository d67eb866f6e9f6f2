"""MMLU, k-shot (default 5) from the dev split, as lm-evaluation-harness's `mmlu` group
(tasks/mmlu/default) run with num_fewshot=k.

Formats (a directory):

- the original release (`data/` of hendrycks/test): `dev/<subject>_dev.csv` and
  `test/<subject>_test.csv`, headerless rows question, A, B, C, D, answer letter;
- the `cais/mmlu` export: files whose names start with `dev` and `test` (.jsonl / .json /
  .parquet), anywhere below the directory (only below `all/` when it exists, as in the
  cais/mmlu repository: `all/dev-00000-of-00001.parquet`), records with question, subject,
  choices (4 strings), answer (0-3).

Prompt for a test question of subject s (the harness's template, description and
`first_n` few-shot sampler):

    The following are multiple choice questions (with answers) about {s with _ -> space}.\\n\\n
    {shot 1}\\n\\n ... {shot k}\\n\\n{question}

where a question renders as "{question.strip()}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\nAnswer:"
and a shot appends " {gold letter}". The shots are the first min(k, len(dev)) dev questions
of the subject, in file order. Choices are the continuations " A", " B", " C", " D";
acc = [argmax == gold]. The scorer left-truncates context + continuation to its
max_length (1,024) tokens as the harness's HF model does.

Aggregation (the harness's `weight_by_size: True` at both group levels): acc of the
whole benchmark = Σ correct / Σ questions over all subjects (a micro average), and so
for each category (stem, humanities, social_sciences, other). The unweighted mean over
subjects is given as `acc_macro_subjects` for reference.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

from onona_jax.eval.tasks import data as data_lib
from onona_jax.eval.tasks.multiple_choice import Example, _argmax

HARNESS_TASK = "mmlu"
LETTERS = ("A", "B", "C", "D")

# lm-evaluation-harness tasks/mmlu/default: the subjects of each category group.
CATEGORIES = {
    "stem": "abstract_algebra anatomy astronomy college_biology college_chemistry college_computer_science "
            "college_mathematics college_physics computer_security conceptual_physics electrical_engineering "
            "elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science "
            "high_school_mathematics high_school_physics high_school_statistics machine_learning",
    "other": "business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
             "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology",
    "social_sciences": "econometrics high_school_geography high_school_government_and_politics "
                       "high_school_macroeconomics high_school_microeconomics high_school_psychology "
                       "human_sexuality professional_psychology public_relations security_studies sociology "
                       "us_foreign_policy",
    "humanities": "formal_logic high_school_european_history high_school_us_history high_school_world_history "
                  "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy "
                  "prehistory professional_law world_religions",
}
CATEGORY_OF = {s: c for c, subjects in CATEGORIES.items() for s in subjects.split()}


def _question(q: dict) -> str:
    c = q["choices"]
    return f"{q['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"


def prompt(subject: str, shots: list[dict], q: dict) -> str:
    fewshot = "".join(f"{_question(s)} {LETTERS[s['answer']]}\n\n" for s in shots)
    return description(subject) + fewshot + _question(q)


def _answer(a) -> int:
    if isinstance(a, str) and a.strip() in LETTERS:
        return LETTERS.index(a.strip())
    return int(a)


def _load_csv_dir(path: str):
    splits, files = {}, []
    for split in ("dev", "test"):
        d = os.path.join(path, split)
        by_subject = {}
        for name in sorted(os.listdir(d)):
            m = re.fullmatch(rf"(.+)_{split}\.csv", name)
            if not m:
                continue
            rows = data_lib.read_csv_rows(os.path.join(d, name))
            files.append(os.path.join(d, name))
            by_subject[m.group(1)] = [
                {"question": r[0], "choices": r[1:5], "answer": _answer(r[5])} for r in rows
            ]
        splits[split] = by_subject
    return splits, files


def _record_files(path: str, split: str) -> list[str]:
    """Files named `<split>*.jsonl|.json|.parquet` under path (recursively; only under `all/`
    when there is one, as in the cais/mmlu repository, whose subject folders repeat it)."""
    if os.path.isdir(os.path.join(path, "all")):
        path = os.path.join(path, "all")
    found = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        found += [os.path.join(root, n) for n in sorted(names)
                  if n.startswith(split) and n.lower().endswith((".jsonl", ".json", ".parquet"))]
    return found


def _load_records_dir(path: str):
    splits, files = {}, []
    for split in ("dev", "test"):
        paths = _record_files(path, split)
        if not paths:
            raise ValueError(f"mmlu: {path} has neither {split}/ (original csv) "
                             f"nor {split}*.jsonl/.parquet (cais/mmlu)")
        by_subject = defaultdict(list)
        for p in paths:
            files.append(p)
            for i, r in enumerate(data_lib.read_records(p)):
                data_lib.require(r, ["question", "subject", "choices", "answer"], p, i)
                by_subject[r["subject"]].append(
                    {"question": r["question"], "choices": list(r["choices"]), "answer": _answer(r["answer"])})
        splits[split] = dict(by_subject)
    return splits, files


def load(path: str):
    """({"dev": {subject: [q]}, "test": {subject: [q]}}, files read)."""
    if not os.path.isdir(path):
        raise ValueError(f"mmlu: {path!r} must be a directory (original dev/ and test/ csv, or cais/mmlu files)")
    if os.path.isdir(os.path.join(path, "test")) and os.path.isdir(os.path.join(path, "dev")):
        splits, files = _load_csv_dir(path)
    else:
        splits, files = _load_records_dir(path)
    if not splits["test"]:
        raise ValueError(f"mmlu: no test questions under {path}")
    return splits, files


def examples(splits, shots: int = 5, limit: int | None = None) -> list[tuple[str, Example]]:
    """[(subject, Example)] in subject order; `limit` caps the questions per subject."""
    out = []
    for subject in sorted(splits["test"]):
        dev = splits["dev"].get(subject, [])[:shots]
        qs = splits["test"][subject]
        for q in qs[:limit] if limit else qs:
            out.append((subject, Example(prompt(subject, dev, q), list(LETTERS), q["answer"])))
    return out


def evaluate(scorer, path: str, shots: int = 5, limit: int | None = None) -> dict:
    splits, files = load(path)
    items = examples(splits, shots, limit)
    pairs = [(ex.context, " " + c) for _, ex in items for c in ex.choices]
    results = scorer.loglikelihood(pairs)
    correct, total = defaultdict(int), defaultdict(int)
    for j, (subject, ex) in enumerate(items):
        ll = [x for x, _ in results[4 * j:4 * j + 4]]
        correct[subject] += _argmax(ll) == ex.gold
        total[subject] += 1
    per_subject = {s: correct[s] / total[s] for s in sorted(total)}
    metrics = {"acc": sum(correct.values()) / sum(total.values()),
               "acc_macro_subjects": sum(per_subject.values()) / len(per_subject)}
    for cat in CATEGORIES:
        subs = [s for s in total if CATEGORY_OF.get(s) == cat]
        if subs:
            metrics[f"acc_{cat}"] = sum(correct[s] for s in subs) / sum(total[s] for s in subs)
    return {
        "task": "mmlu",
        "harness_task": HARNESS_TASK,
        "metrics": metrics,
        "per_subject": {s: {"acc": per_subject[s], "samples": total[s],
                            "shots": min(shots, len(splits["dev"].get(s, [])))} for s in per_subject},
        "samples": sum(total.values()),
        "shots": shots,
        "max_length": scorer.max_length,
        "data": data_lib.fingerprint(files, root=path),
    }
