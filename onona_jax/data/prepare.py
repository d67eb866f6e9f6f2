"""Tokenise text corpora into uint16 shards with a document-level held-out split.

    python -m onona_jax.data.prepare --input PATH [PATH ...] --output DIR \
        [--heldout_fraction 0.02] [--shard_tokens 50_000_000] [--seed 0] [--overwrite]

Inputs: `.txt` files (documents separated by blank lines, surrounding whitespace stripped)
and `.jsonl` files (one document per line, in its `text` field), optionally `.xz`/`.gz`/`.bz2`
compressed; a directory means every such file directly inside it, sorted. Every document is
followed by exactly one EOT. Output: `DIR/{train,heldout}_NNNNN.bin` (uint16), `DIR/manifest.json`.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import itertools
import json
import lzma
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from onona_jax.tokenizer import EOT, GPT2_RANKS_SHA256, TOKENIZER_VOCAB, get_tokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "heldout")
_OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
_KINDS = {".txt": "txt", ".jsonl": "jsonl"}
_BATCH_CHARS = 1_000_000  # text per encode_ordinary_batch call: bounds memory, keeps threads busy


def _kind(path: Path) -> tuple[str, str] | None:
    """(format, compression suffix) of a supported file name, else None."""
    suffixes = [s.lower() for s in path.suffixes]
    comp = suffixes.pop() if suffixes and suffixes[-1] in _OPENERS else ""
    base = suffixes[-1] if suffixes else ""
    return (_KINDS[base], comp) if base in _KINDS else None


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Expand directories and validate every input path."""
    supported = ".txt or .jsonl, optionally compressed as .xz, .gz or .bz2"
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise ValueError(f"input path does not exist: {raw}; pass an existing file or directory to --input")
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".") and _kind(f))
            if not found:
                raise ValueError(f"input directory {raw} has no {supported} files; add some or pass the files directly")
            files.extend(found)
        elif _kind(p) is None:
            raise ValueError(f"unknown file extension for input {raw}; supported: {supported}")
        else:
            files.append(p)
    if not files:
        raise ValueError("no input files given; pass --input PATH [PATH ...]")
    return files


def iter_documents(path: Path) -> Iterator[str]:
    """Documents of one file: blank-line-separated paragraphs (.txt) or `text` fields (.jsonl)."""
    kind, comp = _kind(path)
    # Text mode with newline=None turns \r\n and \r into \n, so splitting is platform independent.
    with _OPENERS.get(comp, open)(path, "rt", encoding="utf-8", newline=None) as f:
        try:
            if kind == "txt":
                lines: list[str] = []
                for line in f:
                    if line.strip():
                        lines.append(line)
                    elif lines:
                        yield "".join(lines).strip()
                        lines = []
                if lines:
                    yield "".join(lines).strip()
            else:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: invalid JSON ({e}); each line of a .jsonl file must be "
                                         'one JSON object like {"text": "..."}') from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise ValueError(f'{path}:{lineno}: JSONL line has no string "text" field; each line must be '
                                         'a JSON object like {"text": "..."}')
                    if rec["text"].strip():  # an empty document would only add a lone EOT
                        yield rec["text"]
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not valid UTF-8 ({e}); convert it to UTF-8 first") from None
        except (EOFError, lzma.LZMAError, OSError) as e:
            raise ValueError(f"cannot read {path} ({e}); check the file is not truncated or mislabelled") from None


def _doc_hash(seed: int, index: int) -> float:
    """Uniform [0, 1) value per (seed, document index), stable across runs and Python versions."""
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def heldout_mask(num_docs: int, fraction: float, seed: int) -> np.ndarray:
    """Bool mask of held-out documents: hash(seed, index) < fraction, with both splits non-empty if possible."""
    u = np.array([_doc_hash(seed, i) for i in range(num_docs)])
    mask = u < fraction
    if fraction > 0 and num_docs >= 2:
        if not mask.any():  # tiny corpora: hold out the lowest-hash document rather than nothing
            mask[np.argmin(u)] = True
        if mask.all():  # ... and always keep something to train on
            mask[np.argmax(u)] = False
    return mask


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _ShardWriter:
    """Appends tokens to `{split}_NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._f is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            n = min(tokens.size, self.shard_tokens - self.shards[-1]["tokens"])
            self._f.write(tokens[:n].tobytes())
            self.shards[-1]["tokens"] += n
            tokens = tokens[n:]

    def _open_next(self) -> None:
        if self._f is not None:
            self._f.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._f = open(self.out_dir / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def prepare(
    inputs: list[str],
    output: str,
    heldout_fraction: float = 0.02,
    shard_tokens: int = 50_000_000,
    seed: int = 0,
    overwrite: bool = False,
    num_threads: int | None = None,
) -> dict:
    """Tokenise `inputs` into shards under `output`; returns the manifest (also written as manifest.json)."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"output {out} already exists and is not empty; choose another --output or pass --overwrite")
    files = resolve_inputs(inputs)

    # Pass 1: count documents. This validates every input before the slow part, sizes the
    # progress bar, and fixes the held-out set (whose non-emptiness guarantee needs the count).
    num_docs = sum(1 for f in files for _ in iter_documents(f))
    if num_docs == 0:
        raise ValueError(f"no documents found in {', '.join(map(str, files))} (empty or whitespace-only text); "
                         "check the --input files")
    mask = heldout_mask(num_docs, heldout_fraction, seed)

    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        enc = get_tokenizer()
        threads = num_threads or min(8, os.cpu_count() or 1)
        writers = {s: _ShardWriter(tmp, s, shard_tokens) for s in SPLITS}
        docs_per_split = dict.fromkeys(SPLITS, 0)

        def flush(batch: list[str], first: int) -> None:
            parts: dict[str, list] = {s: [] for s in SPLITS}
            for k, ids in enumerate(enc.encode_ordinary_batch(batch, num_threads=threads)):
                split = SPLITS[int(mask[first + k])]
                parts[split] += (ids, (EOT,))
                docs_per_split[split] += 1
            for split, p in parts.items():
                if p:
                    writers[split].write(np.fromiter(itertools.chain.from_iterable(p), np.uint16))
            bar.update(len(batch))

        # Pass 2: tokenise in batches; document index is global across inputs, in input order.
        with tqdm(total=num_docs, desc="tokenising", unit="doc", dynamic_ncols=True) as bar:
            batch, chars, first, index = [], 0, 0, 0
            for f in files:
                for doc in iter_documents(f):
                    batch.append(doc)
                    chars += len(doc)
                    index += 1
                    if chars >= _BATCH_CHARS:
                        flush(batch, first)
                        batch, chars, first = [], 0, index
            if batch:
                flush(batch, first)
        for w in writers.values():
            w.close()
        if index != num_docs:
            raise ValueError(f"inputs changed while being read ({num_docs} then {index} documents); re-run prepare")

        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenizer": {"name": "gpt2", "ranks_sha256": GPT2_RANKS_SHA256},
            "eot": EOT,
            "vocab": TOKENIZER_VOCAB,
            "dtype": "uint16",
            "splits": {
                s: {
                    "shards": writers[s].shards,
                    "tokens": sum(sh["tokens"] for sh in writers[s].shards),
                    "documents": docs_per_split[s],
                }
                for s in SPLITS
            },
            "sources": [{"path": str(f.resolve()), "sha256": sha256_file(f), "bytes": f.stat().st_size} for f in files],
            "heldout_fraction": heldout_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

        # Swap into place: the output directory either is complete or does not exist.
        old = None
        if out.is_dir() and any(out.iterdir()):
            if not overwrite:  # filled while we worked, e.g. by a concurrent prepare of the same dir
                raise ValueError(f"output {out} was filled by another process during prepare; "
                                 "pass --overwrite to replace it")
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            out.rename(old)
        elif out.is_dir():
            out.rmdir()
        elif out.exists():
            out.unlink()
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onona_jax.data.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl files (optionally .xz/.gz/.bz2) or dirs")
    ap.add_argument("--output", required=True, help="output directory (must not exist or be empty)")
    ap.add_argument("--heldout_fraction", type=float, default=0.02, help="fraction of documents held out")
    ap.add_argument("--shard_tokens", type=lambda s: int(s.replace("_", "")), default=50_000_000)
    ap.add_argument("--seed", type=int, default=0, help="seed of the held-out document split")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output directory")
    args = ap.parse_args(argv)
    try:
        m = prepare(args.input, args.output, args.heldout_fraction, args.shard_tokens, args.seed, args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in SPLITS:
        sp = m["splits"][s]
        print(f"{s}: {sp['documents']:,} documents, {sp['tokens']:,} tokens in {len(sp['shards'])} shard(s)")
    print(f"wrote {args.output}/manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
