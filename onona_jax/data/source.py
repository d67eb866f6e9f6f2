"""One prepared data dir of a run, opened once per start: `DataSource`.

A source owns what every reader of the data dir needs: its manifest (read once, wherever the
data dir lies), the data's identity, the shards' dtype, the bound its token ids must lie
below, the check that the run's tokenizer made it, and its splits' token stores: a local data
dir's shards memory-mapped (`TokenStore`), a bucket's copied into the cache and memory-mapped
(storage.py) or streamed block by block (`stream.StreamStore`). A run of one `data.dir` has one
source; a mixture (`data.mixture`, mixture.py) one per named data dir.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from onona_jax import paths
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.data import storage
from onona_jax.data.prepare import FORMAT_VERSION
from onona_jax.data.stream import StreamStore

_SCAN_CHUNK = 1 << 26  # tokens per max-id scan step: bounds the temporary on the error path
BUCKET_READS = ("copy", "stream")
TOKENIZER_KEYS = ("tokenizer", "eot", "tokenizer_pattern", "special_tokens")  # of the config's data group


def _settings(data) -> dict:
    """The non-empty tokenizer settings of a config's data group (or a manifest's record of them)."""
    return {k: str(data.get(k) or "") for k in TOKENIZER_KEYS if data.get(k)} or {"tokenizer": tokenizer_lib.DEFAULT}


def _flags(settings: dict, prefix: str) -> str:
    return " ".join(f"{prefix}{k}={v}" for k, v in settings.items())


def _describe(identity: dict) -> str:
    if not identity.get("sha256"):
        return "its manifest names no tokenizer"
    return f"{identity.get('name')}, {identity.get('vocab', 0):,} entries, sha256 {str(identity['sha256'])[:12]}…"


def check_tokenizer(data_dir, manifest: dict, data, trained: bool = False) -> None:
    """Refuse a data dir prepared with another tokenizer than `data.tokenizer` (with data.eot,
    data.tokenizer_pattern, data.special_tokens: `data` is a config's data group or a dict of
    those keys): one ValueError naming both and the fixes (for a `trained` model, evaluated, only
    data of its own tokenizer will do). Before any shard is read."""
    tok = tokenizer_lib.from_config(data)
    data_identity = tokenizer_lib.manifest_identity(manifest)
    if tokenizer_lib.same(data_identity, tok.identity()):
        return
    run_settings = _settings(data)
    recorded = data_identity.get("config") or (
        {"tokenizer": tokenizer_lib.DEFAULT} if data_identity.get("kind") == "gpt2" else {})
    use_data_tokenizer = (f"set {_flags(recorded, '--config.data.')}" if recorded else
                          "set --config.data.tokenizer to the tokenizer that made it")
    if trained:
        fix = (f"the model was trained with {run_settings['tokenizer']}: prepare its data.dir again with it, "
               f"`python -m onona_jax.data.prepare {_flags(run_settings, '--')} --input <text files> "
               f"--output {data_dir}`")
    elif tok.kind == "size":
        fix = (f"data.tokenizer={tok.spec} names a vocabulary size only (for planning), not a tokenizer data can be "
               f"read with: {use_data_tokenizer}")
    else:
        fix = (f"re-run `python -m onona_jax.data.prepare {_flags(run_settings, '--')} --input <text files> "
               f"--output <dir>` and train on that, or {use_data_tokenizer}")
    raise ValueError(f"data dir {data_dir} was prepared with tokenizer {recorded.get('tokenizer', '?')} "
                     f"({_describe(data_identity)}); this run's data.tokenizer is {run_settings['tokenizer']} "
                     f"({tok.describe()}): {fix}")


class DataSource:
    """One prepared data dir (local, or a bucket's: `bucket_read` "copy" into `cache_dir`, or
    "stream"), its manifest read once here. `name`: a mixture source's ("" for a run's single
    data.dir). Token ids are checked against `vocab_size` (default: the manifest's vocabulary)
    and also against `model_vocab` when given: the smaller bound holds (`id_bound`)."""

    def __init__(self, data_dir, name: str = "", *, cache_dir: str | None = None, bucket_read: str = "copy",
                 vocab_size: int | None = None, model_vocab: int | None = None):
        if bucket_read not in BUCKET_READS:
            raise ValueError(f"data.bucket_read={bucket_read!r} must be one of {', '.join(BUCKET_READS)}")
        self.remote = paths.is_cloud(data_dir)
        self.data_dir = os.fspath(data_dir).rstrip("/") if self.remote else os.fspath(data_dir)
        self.name, self.cache_dir, self.bucket_read = name, cache_dir, bucket_read
        self.raw, self.manifest = storage.read_manifest(self.data_dir)
        self._vocab_size, self._model_vocab = vocab_size, model_vocab
        self._stores: dict = {}

    def __repr__(self) -> str:
        return f"DataSource({self.name + ': ' if self.name else ''}{self.data_dir})"

    @property
    def identity(self) -> str:
        """What the data dir holds, wherever it lies (`storage.manifest_identity`)."""
        return storage.manifest_identity(self.raw, self.manifest)

    @property
    def dtype(self) -> np.dtype:
        return storage.token_dtype(self.manifest)

    @property
    def id_bound(self) -> int:
        """The exclusive bound of the token ids."""
        bound = self._vocab_size or self.manifest["vocab"]
        return min(bound, self._model_vocab) if self._model_vocab else bound

    def check_tokenizer(self, data, trained: bool = False) -> None:
        """`check_tokenizer` of this data dir against the run's data group `data`."""
        check_tokenizer(self.data_dir, self.manifest, data, trained)

    def shards(self, split: str) -> list[dict]:
        """The non-empty shards of `split`, or a ValueError naming what is wrong with the manifest."""
        m, d = self.manifest, self.data_dir
        where = f"{d}/manifest.json"
        if m.get("format_version") != FORMAT_VERSION or m.get("dtype") not in storage.DTYPES:
            raise ValueError(f"{where} has format_version={m.get('format_version')}, dtype={m.get('dtype')}; "
                             f"expected {FORMAT_VERSION}, {' or '.join(storage.DTYPES)}: {storage.prepare_hint(d)}")
        if split not in m["splits"]:
            raise ValueError(f"{where} has no split {split!r} (has {sorted(m['splits'])})")
        shards = [s for s in m["splits"][split]["shards"] if s["tokens"] > 0]
        if not shards:
            raise ValueError(f"split {split!r} of {d} is empty (heldout_fraction={m.get('heldout_fraction')}); "
                             f"{storage.prepare_hint(d)} with enough text (and --heldout_fraction > 0 for held-out "
                             "data)")
        return shards

    def id_error(self, path, token: int, pos: int) -> ValueError:
        """A shard's token id past `id_bound`: the data and its manifest, or the model, disagree."""
        bound, identity = self.id_bound, tokenizer_lib.manifest_identity(self.manifest)
        if bound >= self.manifest.get("vocab", 0) and identity.get("sha256"):
            owner = f"the tokenizer its manifest names ({_describe(identity)})"
        else:
            owner = f"a tokenizer of at most {bound:,} entries (the model's table)"
        return ValueError(f"shard {path} has token id {token} at position {pos}, >= vocab size {bound}; it was not "
                          f"made with {owner}: re-run `python -m onona_jax.data.prepare` with the right tokenizer "
                          "(--tokenizer)")

    def local_dir(self, splits) -> Path:
        """A local directory holding the manifest and `splits`' shards: the data dir itself, or
        for a bucket its verified copy in the cache."""
        if not self.remote:
            return storage.local_path(self.data_dir)
        return storage.copy_to_cache(self.data_dir, self.raw, self.manifest, splits, self.cache_dir)

    def store(self, split: str):
        """`split`'s token stream, opened once: a StreamStore for a bucket read with
        bucket_read="stream", else a TokenStore (memory-mapped, every token id checked)."""
        if split not in self._stores:
            streamed = self.remote and self.bucket_read == "stream"
            self._stores[split] = StreamStore(self, split) if streamed else TokenStore(self, split)
        return self._stores[split]

    def verify(self, record_dir) -> bool:
        """`storage.verify_once` of this source, recorded in `record_dir` (the run's workdir)."""
        return storage.verify_once(self, record_dir)


class TokenStore:
    """One split of a prepared data dir as a single read-only token stream over memory-mapped shards.

    `source`: a DataSource, or a data dir (opened here with `vocab_size` and `cache_dir`). A
    bucket data dir's shards of the split are copied once into its cache dir (default:
    storage.default_cache_dir()) and verified, see onona_jax/data/storage.py.
    """

    def __init__(self, source, split: str, vocab_size: int | None = None, cache_dir: str | None = None):
        if not isinstance(source, DataSource):
            source = DataSource(source, cache_dir=cache_dir, vocab_size=vocab_size)
        shards = source.shards(split)
        d = source.local_dir((split,))
        manifest_path = d / "manifest.json"
        self.source, self.data_dir, self.split, self.manifest = source, d, split, source.manifest
        self.dtype = source.dtype
        self.vocab_size = source.id_bound
        self.shards: list[np.memmap] = []
        for s in shards:
            path = d / s["file"]
            if not path.is_file():
                raise ValueError(f"shard {path} listed in {manifest_path} is missing; {storage.prepare_hint(d)} "
                                 "again")
            size, want = path.stat().st_size, storage.shard_bytes(self.manifest, s)
            if size != want:
                raise ValueError(f"shard {path} has {size} bytes but the manifest says {s['tokens']} "
                                 f"{self.dtype.name} tokens ({want} bytes); the data dir is incomplete or corrupt: "
                                 f"{storage.prepare_hint(d)} again")
            arr = np.memmap(path, dtype=self.dtype, mode="r")
            self._check_ids(arr, path)
            self.shards.append(arr)
        self.offsets = np.cumsum([0] + [len(a) for a in self.shards])  # stream position of each shard start

    def _check_ids(self, arr: np.ndarray, path: Path) -> None:
        # A wrong tokenizer or dtype would otherwise surface as an out-of-range embedding gather.
        for start in range(0, len(arr), _SCAN_CHUNK):
            chunk = arr[start : start + _SCAN_CHUNK]
            if int(chunk.max()) >= self.vocab_size:
                pos = start + int(np.argmax(chunk >= self.vocab_size))
                raise self.source.id_error(path, int(arr[pos]), pos)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Copy of tokens[start:stop] of the concatenated stream (may span shards)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside stream of {len(self)} tokens")
        out = np.empty(stop - start, self.dtype)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            base, end = int(self.offsets[i]), int(self.offsets[i + 1])
            n = min(stop, end) - pos
            out[pos - start : pos - start + n] = self.shards[i][pos - base : pos - base + n]
            pos += n
            i += 1
        return out

    def read_many(self, ranges) -> list[np.ndarray]:
        return [self.read(a, b) for a, b in ranges]

    def num_windows(self, seq_len: int) -> int:
        """Number of non-overlapping windows of seq_len + 1 tokens."""
        return storage.num_windows(self, seq_len)
