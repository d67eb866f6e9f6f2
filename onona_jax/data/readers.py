"""Corpus readers for `prepare`: every supported format, cut into chunks, read into documents in a fixed order.

`iter_chunks` (main process) cuts an input into `Chunk`s; `chunk_documents` (a worker) turns a
chunk into documents; `encode_chunk` also tokenises them. A document is text (`str`) or, for
pre-tokenized inputs (`tokens_column`), an array of the tokenizer's ids (its `dtype`: uint16, or
uint32 past 65,536 entries) ending in exactly one end-of-document id (its `eot`). The tokenizer
is `data.tokenizer`'s (onona_jax/tokenizer.py), named by its load arguments (`TokArgs`) so that
a worker process loads the same one. Formats, by file name:

* `.txt`   documents separated by blank lines, surrounding whitespace stripped;
* `.jsonl` one JSON object per line, the document in its `text_column` (or `tokens_column`) field;
  both optionally compressed: `.xz`, `.gz`, `.bz2`, `.zst`;
* `.parquet` the `text_column` (string) or `tokens_column` (list of integers) column, row order;
* `.arrow` Arrow IPC (stream or file) with such a column, and directories written by
  `datasets.Dataset.save_to_disk` (their `state.json` lists the `.arrow` files in order).

Empty and whitespace-only text documents (and null rows) are skipped: they would only add a lone EOT.
Every error is a ValueError naming the file (and line or row) and the fix.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import io
import itertools
import json
import lzma
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from onona_jax import tokenizer as tokenizer_lib
from onona_jax.tokenizer import Tokenizer

# tokenizer.load's arguments (spec, eot, pattern, special_tokens): what a worker loads its tokenizer from.
TokArgs = tuple[str, str, str, str]
GPT2: TokArgs = (tokenizer_lib.DEFAULT, "", "", "")

_ZSTD_MAX_WINDOW = 1 << 31  # accept long-distance-matching .zst files (zstd --long=31)


class _ZstdRaw(io.RawIOBase):
    """Decompressed bytes of a .zst file (any number of frames) that raise EOFError when the file ends
    mid-frame: zstandard's own reader returns a truncated file's data without complaint."""

    def __init__(self, path):
        import zstandard  # only needed for .zst inputs

        self._f = open(path, "rb")
        self._new = lambda: zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW).decompressobj()
        self._chunks = self._decompress()
        self._buf = b""

    def _decompress(self):
        d, fed = self._new(), False
        while data := self._f.read(1 << 20):
            while data:
                out = d.decompress(data)
                fed = True
                if out:
                    yield out
                if d.eof:  # next frame (or trailing bytes a new frame will reject)
                    data, d, fed = d.unused_data, self._new(), False
                else:
                    data = b""
        if fed and not d.eof:
            raise EOFError("the file ends in the middle of a zstd frame (truncated)")

    def readable(self):
        return True

    def readinto(self, b):
        while not self._buf:
            self._buf = next(self._chunks, b"")
            if not self._buf:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n

    def close(self):
        self._f.close()
        super().close()


def _zst_open(path, mode="rb"):
    if mode != "rb":
        raise ValueError(f"mode {mode!r}: .zst inputs are read as bytes")
    return io.BufferedReader(_ZstdRaw(path), 1 << 20)


_OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open, ".zst": _zst_open}
_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_STREAM_KINDS = ("txt", "jsonl")  # the only ones that may be compressed as a whole file
SUPPORTED = (".txt or .jsonl (optionally compressed as .xz, .gz, .bz2 or .zst), .parquet, .arrow, "
             "or a directory saved by datasets' save_to_disk")


@dataclasses.dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # txt | jsonl | parquet | arrow
    comp: str = ""  # compression suffix of a txt/jsonl file, "" if none


def _kind(path: Path) -> tuple[str, str] | None:
    """(format, compression suffix) of a supported file name, else None."""
    suffixes = [s.lower() for s in path.suffixes]
    comp = suffixes.pop() if suffixes and suffixes[-1] in _OPENERS else ""
    base = suffixes[-1] if suffixes else ""
    kind = _KINDS.get(base)
    if kind is None or (comp and kind not in _STREAM_KINDS):
        return None
    return kind, comp


def _saved_dataset_files(d: Path) -> list[Path] | None:
    """The .arrow files of a `save_to_disk` directory in dataset order, or None if `d` is not one."""
    state = d / "state.json"
    if (d / "dataset_dict.json").is_file():
        splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{d} is a DatasetDict (splits {splits}); pass one split's directory, e.g. {d / 'train'}")
    if not state.is_file():
        return None
    try:
        files = [d / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{state} is not a datasets state file ({e!r}); re-save the dataset with "
                         "save_to_disk or pass its .arrow files directly") from None
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise ValueError(f"saved dataset {d} lists missing .arrow files {missing or '(none listed)'}; "
                         "copy the directory completely")
    return files


def resolve_inputs(inputs: list[str]) -> list[Source]:
    """Expand directories (sorted; a saved dataset in its own order) and validate every input path."""
    sources: list[Source] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise ValueError(f"input path does not exist: {raw}; pass an existing file or directory to --input")
        if p.is_dir():
            saved = _saved_dataset_files(p)
            if saved is not None:
                sources.extend(Source(f, "arrow") for f in saved)
                continue
            found = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".") and _kind(f))
            if not found:
                raise ValueError(f"input directory {raw} has no {SUPPORTED} files; add some or pass the files directly")
            sources.extend(Source(f, *_kind(f)) for f in found)
        elif _kind(p) is None:
            raise ValueError(f"unknown file extension for input {raw}; supported: {SUPPORTED}")
        else:
            sources.append(Source(p, *_kind(p)))
    if not sources:
        raise ValueError("no input files given; pass --input PATH [PATH ...]")
    return sources


def check_mode(sources: list[Source], tokens_column: str | None) -> None:
    """Text and pre-tokenized inputs do not mix: a .txt file holds no token ids."""
    if tokens_column is not None:
        txt = [str(s.path) for s in sources if s.kind == "txt"]
        if txt:
            raise ValueError(f"--tokens_column={tokens_column} reads pre-tokenized inputs, but {txt[0]} is a .txt "
                             "file (text only); prepare text and token-id inputs in separate runs")


def vocabulary(tok: Tokenizer) -> str:
    """How messages name a tokenizer's vocabulary."""
    return "the GPT-2 vocabulary" if tok.kind == "gpt2" else f"the vocabulary of {tok.name}"


def _check_ids(ids: np.ndarray, where: str, tok: Tokenizer) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tok.n_vocab):
        bad = int(ids[(ids < 0) | (ids >= tok.n_vocab)][0])
        raise ValueError(f"{where}: token id {bad} is outside {vocabulary(tok)} [0, {tok.n_vocab}) "
                         f"(--tokenizer={tok.spec}); --tokens_column must hold ids of the tokenizer that made them: "
                         "give that one with --tokenizer")


def end_with_one_eot(ids: np.ndarray, tok: Tokenizer | None = None) -> np.ndarray:
    """`ids` with trailing end-of-document ids (`tok.eot`; default GPT-2's) removed and exactly one
    appended, as `tok.dtype`; empty if no token remains."""
    tok = tok or tokenizer_lib.load()
    eot, dtype = tok.eot, tok.dtype
    n = len(ids)
    while n and ids[n - 1] == eot:
        n -= 1
    if n == 0:
        return np.zeros(0, dtype)
    out = np.empty(n + 1, dtype)
    out[:n] = ids[:n]
    out[n] = eot
    return out


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A piece of one input in input order: a unit of work that a worker process turns into documents.

    The main process only cuts inputs into chunks (raw bytes ending at a line or paragraph boundary,
    or an Arrow column slice); decoding, JSON parsing and tokenising happen in the workers, so the
    main process is a byte pump that keeps many workers busy. Chunks do not depend on the number of
    workers, hence neither does the output.
    """

    path: str
    kind: str
    first: int  # 1-based line number (txt/jsonl) or 0-based row (parquet/arrow) of the chunk's start
    data: object  # bytes (txt/jsonl) or a pyarrow Array (parquet/arrow)
    column: str  # the jsonl field or table column
    tokens: bool  # pre-tokenized: `column` holds token-id lists


_BLOCK_BYTES = 1 << 20  # raw bytes per txt/jsonl chunk (about 250k tokens of English)
_TABLE_ROWS = 1024  # rows per parquet/Arrow chunk
# A blank line (ASCII whitespace only) ends a paragraph, so a .txt chunk may end right after one.
# (?!\n): the \r of a \r\n is not a newline of its own, else one CRLF would look like a blank line.
_TXT_BREAK = re.compile(rb"(?:\r\n|\r(?!\n)|\n)[ \t\f\v]*(?:\r\n|\r(?!\n)|\n)")


def _newlines(b: bytes) -> int:
    """Lines ended in `b` under universal newlines (\\n, \\r\\n, \\r), as text mode counts them."""
    return b.count(b"\n") + b.count(b"\r") - b.count(b"\r\n")


def _stream_chunks(src: Source, column: str, tokens: bool) -> Iterator[Chunk]:
    import zstandard  # for its error type; .zst inputs are opened by _zst_open

    lineno = 1
    try:
        with _OPENERS.get(src.comp, open)(src.path, "rb") as f:
            pending = b""
            while True:
                data = f.read(_BLOCK_BYTES)
                if not data:
                    if pending:
                        yield Chunk(str(src.path), src.kind, lineno, pending, column, tokens)
                    return
                buf, searched = pending + data, max(0, len(pending) - 8)
                if src.kind == "jsonl":
                    cut = buf.rfind(b"\n", searched) + 1
                else:
                    cut = 0
                    for m in _TXT_BREAK.finditer(buf, searched):
                        cut = m.end()
                if cut == 0:  # no boundary yet: a long line or paragraph continues
                    pending = buf
                    continue
                yield Chunk(str(src.path), src.kind, lineno, buf[:cut], column, tokens)
                lineno += _newlines(buf[:cut])
                pending = buf[cut:]
    except (EOFError, lzma.LZMAError, OSError, zstandard.ZstdError) as e:
        raise ValueError(f"cannot read {src.path} ({e}); check the file is not truncated or mislabelled") from None


def _table_chunks(src: Source, column: str, tokens: bool) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, what = src.path, "parquet" if src.kind == "parquet" else "Arrow IPC"
    try:
        if src.kind == "parquet":
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            batches = pf.iter_batches(batch_size=_TABLE_ROWS, columns=[column]) if column in schema.names else None
        else:
            source = pa.memory_map(str(path))
            try:
                reader = pa.ipc.open_stream(source)  # what datasets writes
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches = (reader if isinstance(reader, pa.ipc.RecordBatchStreamReader)
                       else (reader.get_batch(i) for i in range(reader.num_record_batches)))
        if column not in schema.names:
            flag = "--tokens_column" if tokens else "--text_column"
            raise ValueError(f"{path} has no column {column!r} (columns: {schema.names}); choose one with {flag}")
        typ = schema.field(column).type
        if not tokens and not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
                               or pa.types.is_string_view(typ)):
            raise ValueError(f"column {column!r} of {path} has type {typ}, not string; pass the text column with "
                             "--text_column, or --tokens_column if it holds token ids")
        if tokens and not ((pa.types.is_list(typ) or pa.types.is_large_list(typ))
                           and pa.types.is_integer(typ.value_type)):
            raise ValueError(f"column {column!r} of {path} has type {typ}, not a list of integers; pass the column "
                             "of token-id lists with --tokens_column")
        row = 0
        for batch in batches:
            arr = batch.column(column)
            for lo in range(0, len(arr), _TABLE_ROWS):  # Arrow IPC batches may be large
                part = arr.slice(lo, _TABLE_ROWS)
                yield Chunk(str(path), src.kind, row + lo, part, column, tokens)
            row += len(arr)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"cannot read {path} as {what} ({e}); check the file is complete and really {what}") from None


def iter_chunks(src: Source, text_column: str = "text", tokens_column: str | None = None) -> Iterator[Chunk]:
    """Chunks of one input, in order; schema and container errors are raised here, in the main process."""
    column, tokens = tokens_column or text_column, tokens_column is not None
    if src.kind in _STREAM_KINDS:
        return _stream_chunks(src, column, tokens)
    return _table_chunks(src, column, tokens)


def chunk_documents(chunk: Chunk, tok: Tokenizer | None = None) -> list:
    """The documents of one chunk: `str` texts or, for token inputs, arrays of `tok`'s ids (default
    GPT-2's) ending in one end-of-document id."""
    tok = tok or tokenizer_lib.load()
    if chunk.kind in _STREAM_KINDS:
        return _line_documents(chunk, tok)
    return _table_documents(chunk, tok)


def _line_documents(c: Chunk, tok: Tokenizer) -> list:
    try:
        text = c.data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{c.path} is not valid UTF-8 (near line {c.first}: {e}); convert it to UTF-8 first") from None
    # Universal newlines, as text mode reads them: \r\n and \r become \n.
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    docs: list = []
    if c.kind == "txt":
        para: list[str] = []
        for line in lines:
            if line.strip():
                para.append(line)
            elif para:
                docs.append("\n".join(para).strip())
                para = []
        if para:
            docs.append("\n".join(para).strip())
        return docs
    example = f'{{"{c.column}": [464, 3290, ...]}}' if c.tokens else f'{{"{c.column}": "..."}}'
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{c.path}:{c.first + i}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e}); each line of a .jsonl file must be one JSON object "
                             f"like {example}") from None
        value = rec.get(c.column) if isinstance(rec, dict) else None
        if not c.tokens:
            if not isinstance(value, str):
                raise ValueError(f'{where}: JSONL line has no string "{c.column}" field; each line must be a JSON '
                                 f"object like {example}")
            if value.strip():  # an empty document would only add a lone EOT
                docs.append(value)
            continue
        if not isinstance(value, list) or not all(type(t) is int for t in value):
            raise ValueError(f'{where}: JSONL line has no "{c.column}" list of integer token ids; each line must '
                             f"be a JSON object like {example}")
        ids = np.array(value, np.int64)
        _check_ids(ids, where, tok)
        doc = end_with_one_eot(ids, tok)
        if len(doc):
            docs.append(doc)
    return docs


def _table_documents(c: Chunk, tok: Tokenizer) -> list:
    arr = c.data
    if not c.tokens:
        return [t for t in arr.to_pylist() if t is not None and t.strip()]
    offsets = arr.offsets.to_numpy()  # of a slice: positions in the unsliced `values`
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    lo, hi = offsets[0], offsets[-1]
    if hi > lo and (int(values[lo:hi].min()) < 0 or int(values[lo:hi].max()) >= tok.n_vocab):
        for i in range(len(arr)):  # rare error path: find the row
            _check_ids(values[offsets[i] : offsets[i + 1]], f"{c.path}: row {c.first + i}", tok)
    docs = []
    for i in range(len(arr)):
        doc = end_with_one_eot(values[offsets[i] : offsets[i + 1]], tok)
        if len(doc):
            docs.append(doc)
    return docs


def iter_documents(src: Source | Path, text_column: str = "text", tokens_column: str | None = None,
                   tok: Tokenizer | None = None) -> Iterator[str | np.ndarray]:
    """Documents of one input in order: `str` texts or, in tokens mode, id arrays ending in exactly
    one end-of-document id (ids checked against `tok`'s vocabulary; default GPT-2's)."""
    if isinstance(src, Path):
        src = Source(src, *_kind(src))
    for chunk in iter_chunks(src, text_column, tokens_column):
        yield from chunk_documents(chunk, tok)


def encode_chunk(chunk: Chunk, tok_args: TokArgs = GPT2) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of the chunk's documents, each followed by one end-of-document id, as the tokenizer's
    dtype; tokens per document): one task of a prepare worker, single-threaded so that N workers use
    N cores. The tokenizer is loaded from `tok_args` (once per process: `tokenizer.load` caches)."""
    tok = tokenizer_lib.load(*tok_args)
    docs = chunk_documents(chunk, tok)
    if chunk.tokens:
        lengths = np.fromiter(map(len, docs), np.int64, count=len(docs))
        return (np.concatenate(docs) if docs else np.zeros(0, tok.dtype)), lengths
    ids = [tok.encode(t) for t in docs]  # one by one: a HF tokenizer's batch would use every core
    lengths = np.fromiter((len(d) + 1 for d in ids), np.int64, count=len(ids))
    eot = (tok.eot,)
    flat = np.fromiter(itertools.chain.from_iterable(x for d in ids for x in (d, eot)), tok.dtype,
                       count=int(lengths.sum()))
    return flat, lengths
