"""WikiText-2 (raw) test perplexity, as lm-evaluation-harness's `wikitext` task.

Formats read:

- `wiki.test.raw` (the original WikiText-2 raw release; any file not ending in
  .jsonl/.json/.parquet is read as raw text; a directory is searched for it), split into
  documents at top-level headings as `EleutherAI/wikitext_document_level` (the harness's
  dataset) was made: a line that, after "= = =" -> "===" and "= =" -> "==", strips to
  "= ... =" starts a new document (62 documents in the test split);
- records with a `page` field (that dataset's jsonl/parquet export): one document each;
- records with a `text` field (the HF `wikitext` / `wikitext-2-raw-v1` test split, one
  line per row with its newline, blank lines as ""): the rows are joined back into the raw
  file, each "" row restored as the raw file's blank line " \\n", then split as above.

Each document is detokenised (the harness's `wikitext_detokenizer`) and scored whole with
rolling windows (`scoring.rolling_windows`, max_length tokens, context_len 1, the run's
tokenizer, its eot as the prefix). Words and bytes are counted on the ORIGINAL page, before
detokenisation, as the harness does: words = len(re.split(r"\\s+", page)), bytes =
len(page.encode("utf-8")). Then word_perplexity = exp(-Σ ll / Σ words), byte_perplexity =
exp(-Σ ll / Σ bytes), bits_per_byte = -Σ ll / Σ bytes / ln 2 (the harness's
weighted_perplexity and bits_per_byte aggregations): the same words and bytes whatever the
tokenizer, so these compare across tokenizers. token_perplexity (ours) is
exp(-Σ ll / Σ scored tokens), which does not (a tokenizer of longer tokens has fewer).
"""

from __future__ import annotations

import math
import os
import re

from onona_jax.eval.tasks import data as data_lib
from onona_jax.eval.tasks.scoring import rolling_windows

HARNESS_TASK = "wikitext"
RAW_NAMES = ("wiki.test.raw", os.path.join("wikitext-2-raw", "wiki.test.raw"))


def split_documents(raw: str) -> list[str]:
    """Documents of a WikiText raw file, split as `EleutherAI/wikitext_document_level`."""
    docs, lines = [], []
    all_lines = raw.split("\n")
    for line in all_lines:
        rline = line.replace("= = =", "===").replace("= =", "==").strip()
        if rline.startswith("= ") and rline.strip().endswith(" ="):
            page = "\n".join(lines)
            if page.strip():
                docs.append(page)
            lines = []
        lines.append(line)
    docs.append("\n".join(lines))
    return docs


def detokenize(string: str) -> str:
    """lm-evaluation-harness's `wikitext_detokenizer` (tasks/wikitext/preprocess_wikitext.py)."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def count_words(page: str) -> int:
    """The harness's word count: len(re.split(r"\\s+", page)) on the original page."""
    return len(re.split(r"\s+", page))


def _find_raw(path: str) -> str:
    for name in RAW_NAMES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(f"wikitext2: no {' or '.join(RAW_NAMES)} under directory {path}")


def load(path: str) -> tuple[list[str], str]:
    """(documents, the file read)."""
    if os.path.isdir(path):
        path = _find_raw(path)
    if not os.path.isfile(path):
        raise ValueError(f"wikitext2: data file {path!r} does not exist")
    if not path.lower().endswith((".jsonl", ".json", ".parquet")):
        with open(path, encoding="utf-8") as f:  # universal newlines, as the HF builder
            return split_documents(f.read()), path
    records = data_lib.read_records(path)
    if records and "page" in records[0]:
        return [r["page"] for r in records], path
    if records and "text" in records[0]:
        raw = "".join(r["text"] if r["text"] else " \n" for r in records)
        return split_documents(raw), path
    raise ValueError(f"wikitext2: {path}: records need a 'page' (document-level) or 'text' (line) field")


def evaluate(scorer, path: str, limit: int | None = None) -> dict:
    docs, file = load(path)
    docs = docs[:limit] if limit else docs
    requests, owner = [], []
    tokens = 0
    for i, page in enumerate(docs):
        ids = scorer.encode(detokenize(page))
        tokens += len(ids)
        for w in rolling_windows(ids, scorer.max_length, scorer.tokenizer.eot):
            requests.append(w)
            owner.append(i)
    ll = [0.0] * len(docs)
    for i, (x, _) in zip(owner, scorer.loglikelihood_tokens(requests)):
        ll[i] += x
    total = sum(ll)
    words = sum(count_words(p) for p in docs)
    nbytes = sum(len(p.encode("utf-8")) for p in docs)
    return {
        "task": "wikitext2",
        "harness_task": HARNESS_TASK,
        "metrics": {
            "word_perplexity": math.exp(-total / words),
            "byte_perplexity": math.exp(-total / nbytes),
            "bits_per_byte": -total / nbytes / math.log(2),
            "token_perplexity": math.exp(-total / tokens) if tokens else float("nan"),
        },
        "samples": len(docs),
        "counts": {"loglikelihood": total, "words": words, "bytes": nbytes, "tokens": tokens,
                   "windows": len(requests)},
        "max_length": scorer.max_length,
        "data": data_lib.fingerprint(file),
    }
