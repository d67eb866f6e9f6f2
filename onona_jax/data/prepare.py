"""Tokenise corpora into token shards with a document-level held-out split.

    python -m onona_jax.data.prepare --input PATH [PATH ...] --output DIR [--tokenizer gpt2] \
        [--heldout_fraction 0.02] [--shard_tokens 50_000_000] [--seed 0] [--overwrite] \
        [--text_column text] [--tokens_column COL] [--workers N] [--max_tokens N] [--block_bytes 65536] \
        [--eot TOKEN] [--special_tokens T=ID,...] [--tokenizer_pattern NAME|REGEX] [--train_tokenizer N]

`--tokenizer` (and its companions) takes what the config's `data.tokenizer` (`data.eot`, ...) takes
(onona_jax/tokenizer.py): gpt2 (the default), a tiktoken rank file, a Hugging Face tokenizer.json
or a folder holding one; a run refuses data prepared with another tokenizer than its own.

`--train_tokenizer N` (needs `tokenizers`: pip install -e '.[hf-tokenizer]') first trains a GPT-2-style
byte-level BPE of exactly N entries (id 0 <|endoftext|>, the 256 bytes, N - 257 merges of pairs seen
at least twice; 258 <= N <= 262,144, uint16 shards up to 65,536) on the training split's documents
only (the held-out ones never reach it; all of them, also past `--max_tokens`, which counts its
tokens), deterministically, writes it as DIR/tokenizer.json (a bucket's: uploaded beside the shards)
and tokenises with it exactly as `--tokenizer=DIR/tokenizer.json` would; the manifest records it so,
plus how it was trained (`tokenizer.trained`). It excludes --tokenizer and --tokens_column. Train on
it with --config.data.dir=DIR --config.data.tokenizer=DIR/tokenizer.json (docs/data.md):

    python -m onona_jax.data.prepare --input onona_jax/assets/austen.txt.xz --output /tmp/bpe2k --train_tokenizer=2048

Inputs (see onona_jax/data/readers.py): `.txt` files (documents separated by blank lines),
`.jsonl` files (one document per line, in its `--text_column` field), both optionally
`.xz`/`.gz`/`.bz2`/`.zst` compressed; `.parquet` and `.arrow` files (the `--text_column` column)
and directories saved by `datasets`; a directory means every such file directly inside it, sorted.
With `--tokens_column` the inputs hold token-id lists of the `--tokenizer` (jsonl field or
parquet/Arrow column) that are used as they are (ids checked against its vocabulary). Every
document is followed by exactly one end-of-document token (the tokenizer's eot). `--workers N`
tokenises in N processes; the output does not depend on N. Output: `DIR/{train,heldout}_NNNNN.bin`
(little-endian uint16 when every id fits, n_vocab <= 65,536; else uint32) and `DIR/manifest.json`
(the dtype, the tokenizer's identity, each shard's sha256, and a hash of each `--block_bytes`
block of it for streaming reads from a bucket: onona_jax/data/stream.py), moved into place only
when complete.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import gc
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from absl import flags
from tqdm import tqdm

from onona_jax import cli, paths, staging
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.data.readers import (Chunk, Source, TokArgs, check_mode, encode_chunk, iter_chunks, iter_documents,
                                    resolve_inputs)

__all__ = ["FORMAT_VERSION", "SPLITS", "heldout_mask", "iter_documents", "main", "prepare", "resolve_inputs",
           "sha256_file"]

# Shards may carry "sha256"/"bytes" and "block_bytes"/"block_sha256" (older manifests lack them); readers of
# version 1 ignore them.
FORMAT_VERSION = 1
# Streaming reads (data.bucket_read="stream") fetch and verify whole blocks, so a block should be
# small next to a training window's 2 * (seq_len + 1) bytes for a host to read little beyond its own
# rows; each block costs BLOCK_HASH_HEX characters of manifest (64 KiB: 0.05% of the data).
BLOCK_BYTES = 1 << 16
BLOCK_HASH_HEX = 32  # per block: the first 16 bytes of its sha256, in hex


def block_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:BLOCK_HASH_HEX]


SPLITS = ("train", "heldout")


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
    """Appends tokens to `{split}_NNNNN.bin` files of at most `shard_tokens` tokens each, hashing as it goes."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, block_bytes: int = BLOCK_BYTES,
                 dtype: np.dtype = np.dtype(np.uint16)):
        self.out_dir, self.split, self.shard_tokens, self.block_bytes = out_dir, split, shard_tokens, block_bytes
        self.dtype = np.dtype(dtype).newbyteorder("<")  # shards are little-endian on every host
        self.shards: list[dict] = []
        self._f = self._hash = None
        self._blocks: list[str] = []  # hashes of the current shard's finished blocks
        self._block = bytearray()  # its unfinished block

    @property
    def tokens(self) -> int:
        return sum(sh["tokens"] for sh in self.shards)

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._f is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            n = min(tokens.size, self.shard_tokens - self.shards[-1]["tokens"])
            data = tokens[:n].astype(self.dtype, copy=False).tobytes()
            self._f.write(data)
            self._hash.update(data)
            self._hash_blocks(data)
            self.shards[-1]["tokens"] += n
            tokens = tokens[n:]

    def _hash_blocks(self, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes:
            n = min(view.nbytes, self.block_bytes - len(self._block))
            self._block += view[:n]
            view = view[n:]
            if len(self._block) == self.block_bytes:
                self._blocks.append(block_hash(self._block))
                self._block.clear()

    def _finish(self) -> None:
        if self._f is not None:
            self._f.close()
            if self._block:  # the shard's last, shorter block
                self._blocks.append(block_hash(self._block))
                self._block.clear()
            # The hash lets a copy (a bucket, a host's cache) be checked against what prepare wrote;
            # the block hashes let a streaming reader check each range it reads.
            self.shards[-1].update(bytes=self.dtype.itemsize * self.shards[-1]["tokens"], sha256=self._hash.hexdigest(),
                                   block_bytes=self.block_bytes, block_sha256="".join(self._blocks))
            self._f, self._blocks = None, []

    def _open_next(self) -> None:
        self._finish()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._f, self._hash = open(self.out_dir / name, "wb"), hashlib.sha256()
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        self._finish()


class _Interrupted(BaseException):
    """SIGTERM, raised in the main thread so that the partial output is removed on the way out."""


def _on_sigterm(signum, frame):
    raise _Interrupted()


def _chunks(sources: list[Source], text_column: str, tokens_column: str | None) -> Iterator[Chunk]:
    for src in sources:
        yield from iter_chunks(src, text_column, tokens_column)


def _worker_init(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and stops the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, inherited through fork
    _die_with_parent(parent)


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when `parent` dies (Linux's parent-death signal).

    A parent killed by SIGKILL runs no handler and cannot stop its pool; the workers would wait
    for tasks forever, holding the partial output's lock (inherited through fork), so that a
    rerun could not remove it. The signal does not depend on who kills the parent or how,
    which a process group would (only a kill of the whole group reaches the workers). If the
    parent died before the signal was armed, this worker already has another parent: exit."""
    if not sys.platform.startswith("linux"):
        return  # no such signal elsewhere (macOS): there a SIGKILLed prepare leaves its workers waiting
    import ctypes

    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def _start_method() -> str:
    # fork is nearly free (workers inherit the imported modules and the loaded tokenizer) but unsafe
    # in a process running other threads (jax, grain, a caller's): there, spawn, whose workers import
    # and load the tokenizer themselves (about a second each).
    # tqdm's monitor thread (left by an earlier progress bar in this process) touches nothing a
    # worker uses, so it does not count.
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and type(t).__name__ != "TMonitor"]
    return "fork" if sys.platform == "linux" and not others else "spawn"


def _start_pool(workers: int, tok_args: TokArgs) -> ProcessPoolExecutor | None:
    if workers == 1:
        return None
    tokenizer_lib.load(*tok_args)  # loaded once, before a fork (a spawned worker loads it from tok_args)
    method = _start_method()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_worker_init,
                               initargs=(os.getpid(),))
    if method == "fork":  # fork them all now, before tqdm starts its monitor thread
        gc.freeze()  # the children's collector then leaves the inherited objects (and their pages) alone
        try:
            for f in [pool.submit(int) for _ in range(workers)]:
                f.result()
        finally:
            gc.unfreeze()
    return pool


def _encoded(sources, text_column, tokens_column, pool, workers, tok_args: TokArgs
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, tokens per document) of each chunk in input order, decoded and tokenised in `pool`'s
    worker processes, or in this one if `pool` is None."""
    chunks = _chunks(sources, text_column, tokens_column)
    if pool is None:
        yield from (encode_chunk(c, tok_args) for c in chunks)
        return
    # Results are taken in submission order, so the output does not depend on the number of workers;
    # at most 2 tasks per worker are in flight, which bounds memory and keeps every worker busy.
    pending: collections.deque = collections.deque()
    for chunk in chunks:
        pending.append(pool.submit(encode_chunk, chunk, tok_args))
        if len(pending) >= 2 * workers:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _write_splits(tmp: Path, sources, is_heldout: Callable[[int, int], np.ndarray], shard_tokens, text_column,
                  tokens_column, workers, max_tokens, block_bytes, tok_args: TokArgs) -> tuple[dict, dict, int]:
    """Tokenise into `tmp`; returns (writers, documents per split, documents written).

    `is_heldout(a, b)`: bool array, whether each of the documents a..b-1 (global index) is held out.
    """
    dtype = tokenizer_lib.load(*tok_args).dtype
    writers = {s: _ShardWriter(tmp, s, shard_tokens, block_bytes, dtype) for s in SPLITS}
    docs_per_split = dict.fromkeys(SPLITS, 0)
    index = total = 0
    pool = _start_pool(workers, tok_args)
    try:
        with tqdm(desc="tokenising", unit="tok", unit_scale=True, dynamic_ncols=True) as bar:
            for flat, lengths in _encoded(sources, text_column, tokens_column, pool, workers, tok_args):
                ends = np.cumsum(lengths)
                if max_tokens is not None:  # whole documents only, in input order: the same cut for any `workers`
                    keep = int(np.searchsorted(ends, max_tokens - total, side="right"))
                    capped = keep < len(lengths)
                    lengths, ends = lengths[:keep], ends[:keep]
                n = int(ends[-1]) if len(ends) else 0  # tokens kept from this chunk
                heldout = is_heldout(index, index + len(lengths))  # per document, then per token (vectorised)
                docs_per_split["heldout"] += int(heldout.sum())
                docs_per_split["train"] += len(lengths) - int(heldout.sum())
                per_token = np.repeat(heldout, lengths)
                writers["train"].write(flat[:n][~per_token])
                writers["heldout"].write(flat[:n][per_token])
                index += len(lengths)
                total += n
                bar.update(n)
                if max_tokens is not None and capped:
                    break
    finally:
        if pool is not None:  # also on errors and SIGTERM: running tasks finish, queued ones are dropped
            pool.shutdown(wait=True, cancel_futures=True)
    for w in writers.values():
        w.close()
    return writers, docs_per_split, index


def _where(p: str) -> str:
    return p.rstrip("/") if paths.is_cloud(p) else os.path.realpath(p)


def _inside(a: str, b: str) -> bool:
    """Whether path or URL `a` lies strictly inside `b` (both from `_where`)."""
    return a != b and a.startswith(b.rstrip("/") + "/")


def check_output_outside_inputs(inputs: list[str], output: str) -> None:
    """Refuse an output that is an input, lies inside an input directory or holds an input
    (symlinks resolved), with or without --overwrite: writing it, or replacing it, would change
    or delete the corpus. Nothing is read or removed before this."""
    out = _where(output)
    for raw in inputs:
        src = _where(raw)
        if out == src:
            problem = f"is the input {raw}"
        elif _inside(out, src) and (paths.is_cloud(src) or os.path.isdir(src)):
            problem = f"is inside the input directory {raw}"
        elif _inside(src, out):
            problem = f"holds the input {raw}"
        else:
            continue
        raise ValueError(f"--output={output} {problem}; give an --output apart from every input (prepare "
                         "replaces its output directory as a whole)")


def load_tokenizer(tok_args: TokArgs) -> tokenizer_lib.Tokenizer:
    """The tokenizer prepare writes with (a ValueError naming the fix if it cannot tokenise)."""
    tok = tokenizer_lib.load(*tok_args)
    if tok.kind == "size":
        raise ValueError(f"--tokenizer={tok.spec} names a vocabulary size only (for planning); prepare needs the "
                         "tokenizer itself: gpt2, a tiktoken rank file, a tokenizer.json or a folder holding one")
    return tok


def tokenizer_record(tok: tokenizer_lib.Tokenizer, tok_args: TokArgs) -> dict:
    """What a manifest records of its tokenizer: the identity a run compares with its own
    (`tokenizer.same`), and under "config" the data.* settings that load it again (a path made
    absolute), for the message that names the fix."""
    spec, eot, pattern, specials = tok_args
    config = {"tokenizer": spec if tok.kind == "gpt2" else os.path.abspath(spec)}
    config.update({k: v for k, v in (("eot", eot), ("tokenizer_pattern", pattern), ("special_tokens", specials)) if v})
    return {**tok.identity(), "config": config}


# --train_tokenizer: a byte-level BPE of N entries, <|endoftext|> (id 0) and the 256 bytes first, so
# at least one merge; the top only catches a typo (the largest published vocabularies have ~200k).
# Up to 65,536 entries the shards are uint16, past that uint32.
TRAINED_ENTRIES = (258, 1 << 18)
# A pair seen once in the whole training split is a name or a typo, not worth an entry (GPT-2's recipe).
TRAINED_MIN_FREQUENCY = 2
TRAINED_FILE = "tokenizer.json"


def check_train_tokenizer(entries: int, tok_args: TokArgs, tokens_column: str | None) -> None:
    """--train_tokenizer's usage errors, before anything is read or written."""
    lo, hi = TRAINED_ENTRIES
    if not lo <= entries <= hi:
        raise ValueError(f"--train_tokenizer={entries}: give the entries of the BPE to train, {lo} to {hi:,} "
                         "(<|endoftext|> and the 256 bytes count; up to 65,536 fit uint16 shards), or 0 for none")
    if tok_args[0] != tokenizer_lib.DEFAULT:
        raise ValueError(f"--train_tokenizer={entries} and --tokenizer={tok_args[0]} both name the tokenizer to "
                         "write with; give one")
    given = [f"--{k}={v}" for k, v in zip(("eot", "tokenizer_pattern", "special_tokens"), tok_args[1:]) if v]
    if given:
        raise ValueError(f"{', '.join(given)}: settings of a given tokenizer; the one --train_tokenizer trains has "
                         f"its own, {tokenizer_lib.ENDOFTEXT} ending each document (leave them out)")
    if tokens_column is not None:
        raise ValueError(f"--train_tokenizer={entries} trains on text, but --tokens_column={tokens_column} reads "
                         "token ids of an existing tokenizer; give one")
    _bpe_library()


def _bpe_library():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("--train_tokenizer needs the `tokenizers` package (an optional dependency): "
                         "pip install -e '.[hf-tokenizer]'") from None
    return tokenizers


def _split_texts(sources, text_column: str, is_heldout: Callable[[int], bool], seen: dict) -> Iterator[str]:
    """The texts of the documents `is_heldout(index)` does not hold out, in input order; counts into `seen`
    every document ("total"), the training ones ("documents") and their UTF-8 "bytes"."""
    for src in sources:
        for text in iter_documents(src, text_column):
            i = seen["total"]
            seen["total"] += 1
            if not is_heldout(i):
                seen["documents"] += 1
                seen["bytes"] += len(text.encode("utf-8"))
                yield text


def _train_bpe(entries: int, texts: Iterator[str]) -> tuple[str, int]:
    """(tokenizer.json text, entries learned) of GPT-2's recipe: its regex split and byte alphabet.
    The library's result depends on the pair counts only (ties broken by the pair), not on its
    threads or the order of `texts`: the same documents give the same bytes."""
    tokenizers = _bpe_library()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=entries, min_frequency=TRAINED_MIN_FREQUENCY,
                                  special_tokens=[tokenizer_lib.ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str(pretty=True), tok.get_vocab_size(with_added_tokens=True)


def train_tokenizer_on(sources, text_column: str, entries: int, heldout_fraction: float, seed: int
                       ) -> tuple[str, dict, np.ndarray | None]:
    """A BPE of `entries` entries trained on the documents `_write_splits` will send to the train
    split: (its tokenizer.json text, the manifest's record of the training, the held-out mask the
    writes must use, or None for the hash split). On a tiny corpus whose hashes send every document
    one way, the count-aware mask over all the inputs' documents decides instead (trained again)."""
    seen = dict(total=0, documents=0, bytes=0)
    text, learned = _train_bpe(entries, _split_texts(sources, text_column,
                                                     lambda i: _doc_hash(seed, i) < heldout_fraction, seen))
    total, mask = seen["total"], None
    if total == 0:
        raise _no_documents(sources)
    if heldout_fraction > 0 and total >= 2 and seen["documents"] in (0, total):
        mask = heldout_mask(total, heldout_fraction, seed)
        seen = dict(total=0, documents=0, bytes=0)
        text, learned = _train_bpe(entries, _split_texts(sources, text_column, lambda i: bool(mask[i]), seen))
    if seen["documents"] == 0:
        raise _empty_split("train", total, None)
    if learned != entries:
        fix = (f"choose --train_tokenizer={learned} or fewer" if learned >= TRAINED_ENTRIES[0]
               else "give more text")
        raise ValueError(f"--train_tokenizer={entries}: the training split ({seen['documents']:,} documents, "
                         f"{seen['bytes']:,} bytes) has pairs seen at least {TRAINED_MIN_FREQUENCY} times for only "
                         f"{learned:,} entries; {fix}")
    tokenizers = _bpe_library()
    record = {"entries": entries, "documents": seen["documents"], "bytes": seen["bytes"],
              "min_frequency": TRAINED_MIN_FREQUENCY, "library": f"tokenizers {tokenizers.__version__}"}
    return text, record, mask


def _write_trained(tmp: Path, text: str) -> TokArgs:
    """Write the trained tokenizer into the staging dir; returns the tokenizer.load arguments the
    workers load it from. The file is named by its content until the end: `load` caches by path, and
    an earlier prepare of the same output in this process had the same staging dir."""
    path = tmp / f"tokenizer-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    path.write_text(text, encoding="utf-8")
    return (str(path), "", "", "")


def _trained_record(tok: tokenizer_lib.Tokenizer, out: Path, trained: dict) -> dict:
    """The manifest's record of the trained tokenizer, once moved to `out/tokenizer.json`: what loading
    that file gives (its path and name there, not the staging dir's), and how it was trained."""
    final = os.path.join(os.path.abspath(out), TRAINED_FILE)
    named = dataclasses.replace(tok, spec=final, name=os.path.basename(os.path.abspath(out)))
    return {**tokenizer_record(named, (final, "", "", "")), "trained": trained}


def _no_documents(sources) -> ValueError:
    return ValueError(f"no documents found in {', '.join(str(s.path) for s in sources)} (empty or "
                      "whitespace-only text); check the --input files")


def _empty_split(empty: str, num_docs: int, max_tokens: int | None) -> ValueError:
    return ValueError(f"the {empty} split would be empty: the inputs hold only {num_docs} document(s)"
                      f"{' within --max_tokens' if max_tokens else ''}; give at least 2 documents, "
                      "or --heldout_fraction 0 for no held-out split")


def prepare(
    inputs: list[str],
    output: str,
    heldout_fraction: float = 0.02,
    shard_tokens: int = 50_000_000,
    seed: int = 0,
    overwrite: bool = False,
    *,
    text_column: str = "text",
    tokens_column: str | None = None,
    workers: int = 1,
    max_tokens: int | None = None,
    block_bytes: int = BLOCK_BYTES,
    tokenizer: str = tokenizer_lib.DEFAULT,
    eot: str = "",
    tokenizer_pattern: str = "",
    special_tokens: str = "",
    train_tokenizer: int = 0,
) -> dict:
    """Tokenise `inputs` into shards under `output`; returns the manifest (also written as manifest.json).
    `output` may be a bucket URL (gs://...): see `_prepare_to_bucket`. `tokenizer` and its companions:
    what data.tokenizer, data.eot, data.tokenizer_pattern and data.special_tokens take; or
    `train_tokenizer`: the entries of a BPE to train on the train split and write with (module docstring)."""
    tok_args: TokArgs = (tokenizer or tokenizer_lib.DEFAULT, eot or "", tokenizer_pattern or "", special_tokens or "")
    if train_tokenizer:
        check_train_tokenizer(train_tokenizer, tok_args, tokens_column)
    check_output_outside_inputs(inputs, output)
    # A trained tokenizer exists only later: until then, its shard dtype stands for it.
    tok = None if train_tokenizer else load_tokenizer(tok_args)
    if paths.is_cloud(output):
        return _prepare_to_bucket(inputs, output, heldout_fraction, shard_tokens, seed, overwrite=overwrite,
                                  text_column=text_column, tokens_column=tokens_column, workers=workers,
                                  max_tokens=max_tokens, block_bytes=block_bytes, tokenizer=tok_args[0],
                                  eot=tok_args[1], tokenizer_pattern=tok_args[2], special_tokens=tok_args[3],
                                  train_tokenizer=train_tokenizer)
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    dtype = tok.dtype if tok else np.dtype(np.uint16 if train_tokenizer <= 1 << 16 else np.uint32)
    width = dtype.itemsize
    if block_bytes < width or block_bytes % width:
        raise ValueError(f"block_bytes must be a positive {'even number' if width == 2 else f'multiple of {width}'} "
                         f"(whole {dtype.name} tokens of {tok.name if tok else 'the trained tokenizer'}), "
                         f"got {block_bytes}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if not text_column or tokens_column == "":
        raise ValueError("--text_column and --tokens_column must name a field or column")
    out = Path(output)
    paths.check_rename_target(out, "--output", "data")
    for d in staging.remove_stale(out):
        print(f"removed {d}, the partial output of an interrupted prepare", file=sys.stderr)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ValueError(f"output {out} already exists and is not empty; choose another --output, or pass "
                         "--overwrite to replace it (everything in it is deleted)")
    sources = resolve_inputs(inputs)
    check_mode(sources, tokens_column)
    # Read the first document of every input before writing anything: a missing or mistyped column,
    # a corrupt parquet footer or a wrong format fails here. (A fault deep inside a file fails later,
    # and the partial output is removed.)
    for src in sources:
        next(iter_documents(src, text_column, tokens_column, tok), None)
    if train_tokenizer:  # in memory, before anything is written: a corpus too small for it writes nothing
        trained_json, trained, trained_mask = train_tokenizer_on(sources, text_column, train_tokenizer,
                                                                 heldout_fraction, seed)

    def write(tmp: Path) -> dict:
        nonlocal tok, tok_args
        if train_tokenizer:
            tok_args = _write_trained(tmp, trained_json)
            tok = load_tokenizer(tok_args)
        args = (shard_tokens, text_column, tokens_column, workers, max_tokens, block_bytes, tok_args)
        def hashed(a: int, b: int) -> np.ndarray:
            return np.fromiter((_doc_hash(seed, i) for i in range(a, b)), np.float64, b - a) < heldout_fraction

        # A trained tokenizer's split is the one it was trained on, decided over all the inputs' documents
        # (before --max_tokens, which counts its tokens), so the redo below must not move a document.
        split = hashed if not train_tokenizer or trained_mask is None else lambda a, b: trained_mask[a:b]
        writers, docs_per_split, num_docs = _write_splits(tmp, sources, split, *args)
        if num_docs == 0:
            raise _no_documents(sources)
        if not train_tokenizer and heldout_fraction > 0 and num_docs >= 2 and 0 in docs_per_split.values():
            # A tiny corpus whose hashes sent every document one way: redo it with the count-aware mask,
            # which keeps both splits non-empty (the same output prepare has always made).
            for f in tmp.glob("*.bin"):
                f.unlink()
            mask = heldout_mask(num_docs, heldout_fraction, seed)
            writers, docs_per_split, num_docs = _write_splits(tmp, sources, lambda a, b: mask[a:b], *args)
        if heldout_fraction > 0 and 0 in docs_per_split.values():
            raise _empty_split("held-out" if docs_per_split["heldout"] == 0 else "train", num_docs, max_tokens)
        if train_tokenizer:
            Path(tok_args[0]).rename(tmp / TRAINED_FILE)
            record = _trained_record(tok, out, trained)
        else:
            record = tokenizer_record(tok, tok_args)

        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenizer": record,
            "eot": tok.eot,
            "vocab": tok.n_vocab,
            "dtype": tok.dtype.name,
            "splits": {
                s: {"shards": writers[s].shards, "tokens": writers[s].tokens, "documents": docs_per_split[s]}
                for s in SPLITS
            },
            "sources": [{"path": str(s.path.resolve()), "sha256": sha256_file(s.path), "bytes": s.path.stat().st_size}
                        for s in sources],
            "heldout_fraction": heldout_fraction,
            "seed": seed,
            "shard_tokens": shard_tokens,
        }
        # Recorded only when used: a plain-text input's manifest carries neither key, so its bytes (which
        # identify the data) do not depend on these options.
        if tokens_column is not None:
            manifest["tokens_column"] = tokens_column
        elif text_column != "text" and any(s.kind != "txt" for s in sources):
            manifest["text_column"] = text_column
        if max_tokens is not None:
            manifest["max_tokens"] = max_tokens
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest

    # Swapped into place: the output directory either is complete or does not exist.
    return staging.build(out, write, overwrite=overwrite,
                         filled=f"output {out} was filled by another process during prepare; "
                                "pass --overwrite to replace it")


def _prepare_to_bucket(inputs, output: str, *args, overwrite: bool, **kwargs) -> dict:
    """Prepare into a local temporary directory, then upload the shards and, last, manifest.json.
    Readers (train.py, the data cache) accept a data dir only through its manifest, so an upload
    cut short is never taken for a dataset; a rerun uploads again. With --overwrite the old
    manifest is deleted first, so that no reader mixes old and new shards meanwhile. A trained
    tokenizer is uploaded beside the shards, and the manifest records it at its URL (a run reads
    it from a local copy: `gcloud storage cp URL .`)."""
    manifest_url = paths.join(output, "manifest.json")
    if paths.exists(manifest_url) and not overwrite:
        raise ValueError(f"output {output} already holds prepared data; choose another --output or pass --overwrite")
    local = Path(tempfile.mkdtemp(prefix="onona-prepare-")) / "data"
    try:
        manifest = prepare(inputs, str(local), *args, overwrite=False, **kwargs)
        trained = (local / TRAINED_FILE).is_file()
        if trained:  # named where it will be, not in the local temp dir
            manifest["tokenizer"]["config"]["tokenizer"] = paths.join(output, TRAINED_FILE)
            manifest["tokenizer"]["name"] = output.rstrip("/").rsplit("/", 1)[-1]
            (local / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        paths.remove(manifest_url)
        for f in sorted(local.glob("*.bin")) + ([local / TRAINED_FILE] if trained else []):
            paths.upload(f, paths.join(output, f.name))
        paths.upload(local / "manifest.json", manifest_url)
    finally:
        shutil.rmtree(local.parent, ignore_errors=True)
    return manifest


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _count(text: str) -> int:
    return int(str(text).replace("_", ""))


def define(fv, argv):
    flags.DEFINE_multi_string("input", [], ".txt/.jsonl (optionally .xz/.gz/.bz2/.zst), .parquet, .arrow files, "
                              "or dirs; repeat the flag, or list more paths after the flags", flag_values=fv)
    flags.DEFINE_string("output", None, "output directory (must not exist or be empty)", flag_values=fv,
                        required=True)
    flags.DEFINE_float("heldout_fraction", 0.02, "fraction of documents held out", flag_values=fv)
    flags.DEFINE_string("shard_tokens", "50_000_000", "tokens per shard", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "seed of the held-out document split", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace an existing non-empty output directory", flag_values=fv)
    flags.DEFINE_string("text_column", "text", "jsonl field / parquet or Arrow column of the text", flag_values=fv)
    flags.DEFINE_string("tokens_column", None, "field/column of token-id lists of --tokenizer: inputs are "
                        "pre-tokenized and used as they are", flag_values=fv)
    flags.DEFINE_string("tokenizer", tokenizer_lib.DEFAULT, "gpt2, a tiktoken rank file, a HF tokenizer.json or a "
                        "folder holding one (what data.tokenizer takes)", flag_values=fv)
    flags.DEFINE_string("eot", "", "the end-of-document special token where the tokenizer does not say (data.eot)",
                        flag_values=fv)
    flags.DEFINE_string("special_tokens", "", "a rank file's special tokens, <token>=<id>,... (data.special_tokens)",
                        flag_values=fv)
    flags.DEFINE_string("tokenizer_pattern", "", "a rank file's split pattern: gpt2, cl100k, o200k or a regex "
                        "(data.tokenizer_pattern)", flag_values=fv)
    flags.DEFINE_integer("workers", _cpus(), "tokenising processes (default: CPUs available)", flag_values=fv)
    flags.DEFINE_string("max_tokens", None, "stop after this many tokens (whole documents, in input order)",
                        flag_values=fv)
    flags.DEFINE_string("train_tokenizer", "0", "train a byte-level BPE of this many entries (258 to 262,144, "
                        "<|endoftext|> and the 256 bytes included; uint16 shards up to 65,536, else uint32) on the "
                        "train split, write it as OUTPUT/tokenizer.json and tokenise with it; 0: off. Needs "
                        "`tokenizers` (pip install -e '.[hf-tokenizer]')", flag_values=fv)
    flags.DEFINE_string("block_bytes", str(BLOCK_BYTES), "bytes per hashed block, what a streaming reader of a "
                        "bucket fetches and verifies at once (whole tokens; small next to a window's bytes)",
                        flag_values=fv)


def _main(fv, paths):
    inputs = [*fv.input, *paths]
    if not inputs:
        raise cli.UsageError("give the inputs: --input PATH (repeatable) or paths after the flags")
    try:
        shard_tokens = _count(fv.shard_tokens)
        max_tokens = None if fv.max_tokens is None else _count(fv.max_tokens)
        block_bytes = _count(fv.block_bytes)
    except ValueError:
        raise cli.UsageError(f"--shard_tokens={fv.shard_tokens} / --max_tokens={fv.max_tokens} / --block_bytes="
                             f"{fv.block_bytes}: integers (underscores allowed)") from None
    try:
        train_tokenizer = _count(fv.train_tokenizer)
    except ValueError:
        raise cli.UsageError(f"--train_tokenizer={fv.train_tokenizer}: the entries of the BPE to train, an integer "
                             "(underscores allowed), e.g. 2048; 0 for none") from None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        m = prepare(inputs, fv.output, fv.heldout_fraction, shard_tokens, fv.seed, fv.overwrite,
                    text_column=fv.text_column, tokens_column=fv.tokens_column, workers=fv.workers,
                    max_tokens=max_tokens, block_bytes=block_bytes, tokenizer=fv.tokenizer, eot=fv.eot,
                    tokenizer_pattern=fv.tokenizer_pattern, special_tokens=fv.special_tokens,
                    train_tokenizer=train_tokenizer)
    except OSError as e:
        hint = "free space or choose another --output" if e.errno == errno.ENOSPC else "check the --output path"
        raise cli.Failure(f"cannot write {fv.output} ({e}); {hint}; nothing was written") from None
    except _Interrupted:  # SIGTERM: exit 1 (a cli.Failure)
        raise cli.Failure(f"interrupted; {fv.output} was not written (rerun the same command to start again)") from None
    except (cli.Interrupted, KeyboardInterrupt):  # SIGINT (`cli.run`): exit 130, the partial output removed
        raise cli.Interrupted(f"{fv.output} was not written (rerun the same command to start again)") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    for s in SPLITS:
        sp = m["splits"][s]
        print(f"{s}: {sp['documents']:,} documents, {sp['tokens']:,} tokens in {len(sp['shards'])} shard(s)")
    if "trained" in m["tokenizer"]:
        t, where = m["tokenizer"]["trained"], m["tokenizer"]["config"]["tokenizer"]
        local = f"<a local copy of {where}>" if "://" in where else where  # a tokenizer is read from local files
        print(f"trained {where}: {t['entries']:,} entries on {t['documents']:,} train documents ({t['bytes']:,} "
              f"bytes); train with --config.data.dir={fv.output} --config.data.tokenizer={local}")
    print(f"wrote {fv.output}/manifest.json ({m['dtype']} tokens of {m['tokenizer']['name']})")


def main(argv: list[str] | None = None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.exit_process(main())
