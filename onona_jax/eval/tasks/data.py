"""Reading the tasks' public file formats from local paths, and fingerprinting them.

Records come from JSON Lines (`.jsonl`), a JSON array or `{"data": [...]}` object (`.json`),
Parquet (`.parquet`, the Hugging Face Hub's dataset exports; needs pyarrow) or headerless
CSV (`.csv`, MMLU's original files). Nothing is ever downloaded.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os

from onona_jax.data.prepare import sha256_file


def fingerprint(paths: list[str] | str, root: str | None = None) -> dict:
    """{"path", "sha256"} of the file(s) a task read.

    One file: its sha256. Several (a directory, or a file and its labels): the sha256 of the
    manifest `"<sha256>  <path relative to root>\\n"` lines sorted by path (what
    `sha256sum` prints), and the per-file hashes under "files"."""
    if isinstance(paths, str):
        paths = [paths]
    paths = sorted(os.path.abspath(p) for p in paths)
    if len(paths) == 1 and root is None:
        return {"path": paths[0], "sha256": sha256_file(paths[0])}
    root = os.path.abspath(root or os.path.commonpath([os.path.dirname(p) for p in paths]))
    files = {os.path.relpath(p, root): sha256_file(p) for p in paths}
    manifest = "".join(f"{h}  {rel}\n" for rel, h in sorted(files.items()))
    return {"path": root, "sha256": hashlib.sha256(manifest.encode()).hexdigest(), "files": files}


def read_records(path: str) -> list[dict]:
    """The records of a .jsonl / .json / .parquet file, in file order."""
    if not os.path.isfile(path):
        raise ValueError(f"task data file {path!r} does not exist")
    lower = path.lower()
    if lower.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if lower.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON array of records")
        return data
    if lower.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:  # pragma: no cover - pyarrow comes with lm-eval/datasets
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from err
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unknown record format; use .jsonl, .json or .parquet")


def read_csv_rows(path: str) -> list[list[str]]:
    """Rows of a headerless CSV file (MMLU's original format)."""
    with open(path, encoding="utf-8", newline="") as f:
        return [row for row in csv.reader(f) if row]


def require(record: dict, keys, path: str, index: int):
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{path}: record {index} lacks field(s) {missing}; has {sorted(record)}")
