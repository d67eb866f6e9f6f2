"""Loading prepared shards: memory-mapped token stream, fixed windows, grain batch iterator."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import grain
import numpy as np

from onona_jax import paths
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.data import storage
from onona_jax.data.prepare import FORMAT_VERSION, prepare
from onona_jax.tokenizer import bundled_corpus_path

_SCAN_CHUNK = 1 << 26  # tokens per max-id scan step: bounds the temporary on the error path


def _prepare_hint(data_dir: Path) -> str:
    return f"run `python -m onona_jax.data.prepare --input <text files> --output {data_dir}`"


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
    theirs = tokenizer_lib.manifest_identity(manifest)
    if tokenizer_lib.same(theirs, tok.identity()):
        return
    ours = _settings(data)
    recorded = theirs.get("config") or ({"tokenizer": tokenizer_lib.DEFAULT} if theirs.get("kind") == "gpt2" else {})
    use_theirs = (f"set {_flags(recorded, '--config.data.')}" if recorded else
                  "set --config.data.tokenizer to the tokenizer that made it")
    if trained:
        fix = (f"the model was trained with {ours['tokenizer']}: prepare its data.dir again with it, "
               f"`python -m onona_jax.data.prepare {_flags(ours, '--')} --input <text files> --output {data_dir}`")
    elif tok.kind == "size":
        fix = (f"data.tokenizer={tok.spec} names a vocabulary size only (for planning), not a tokenizer data can be "
               f"read with: {use_theirs}")
    else:
        fix = (f"re-run `python -m onona_jax.data.prepare {_flags(ours, '--')} --input <text files> --output <dir>` "
               f"and train on that, or {use_theirs}")
    raise ValueError(f"data dir {data_dir} was prepared with tokenizer {recorded.get('tokenizer', '?')} "
                     f"({_describe(theirs)}); this run's data.tokenizer is {ours['tokenizer']} ({tok.describe()}): "
                     f"{fix}")


def _bound_owner(manifest: dict, bound: int) -> str:
    """Which tokenizer an id bound is: the one the manifest names, or (a smaller bound) the model's table."""
    identity = tokenizer_lib.manifest_identity(manifest)
    if bound >= manifest.get("vocab", 0) and identity.get("sha256"):
        return f"the tokenizer its manifest names ({_describe(identity)})"
    return f"a tokenizer of at most {bound:,} entries (the model's table)"


def id_error(path, token: int, pos: int, bound: int, manifest: dict) -> ValueError:
    """A shard's token id past the bound (`id_bound`): the data and its manifest, or the model, disagree."""
    return ValueError(f"shard {path} has token id {token} at position {pos}, >= vocab size {bound}; it was not made "
                      f"with {_bound_owner(manifest, bound)}: re-run `python -m onona_jax.data.prepare` with the "
                      "right tokenizer (--tokenizer)")


def split_shards(manifest: dict, split: str, manifest_path, d) -> list[dict]:
    """The non-empty shards of `split`, or a ValueError naming what is wrong with the manifest."""
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("dtype") not in storage.DTYPES:
        raise ValueError(f"{manifest_path} has format_version={manifest.get('format_version')}, "
                         f"dtype={manifest.get('dtype')}; expected {FORMAT_VERSION}, "
                         f"{' or '.join(storage.DTYPES)}: {_prepare_hint(d)}")
    if split not in manifest["splits"]:
        raise ValueError(f"{manifest_path} has no split {split!r} (has {sorted(manifest['splits'])})")
    shards = [s for s in manifest["splits"][split]["shards"] if s["tokens"] > 0]
    if not shards:
        raise ValueError(f"split {split!r} of {d} is empty (heldout_fraction={manifest.get('heldout_fraction')}); "
                         f"{_prepare_hint(d)} with enough text (and --heldout_fraction > 0 for held-out data)")
    return shards


def num_windows(store, seq_len: int) -> int:
    """Number of non-overlapping windows of seq_len + 1 tokens in a store of either kind."""
    n = len(store) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{store.split} split of {store.data_dir} has {len(store)} tokens, fewer than one window "
                         f"of seq_len + 1 = {seq_len + 1}; lower seq_len or prepare more text")
    return n


BUCKET_READS = ("copy", "stream")


def open_store(data_dir: str | Path, split: str, vocab_size: int | None = None, cache_dir: str | None = None,
               bucket_read: str = "copy", *, manifest: tuple[bytes, dict] | None = None,
               model_vocab: int | None = None):
    """A split's token stream: memory-mapped shards (a local data dir, or a bucket's copied into
    `cache_dir`), or for a bucket with bucket_read="stream" a StreamStore that fetches and
    verifies only the blocks read (onona_jax/data/stream.py).

    Token ids are checked against `vocab_size` (default: the manifest's vocabulary), and also
    against `model_vocab` when given: the smaller bound holds. `manifest`: the data dir's
    manifest as already read (`store.manifest_file` of another split), not read again."""
    if bucket_read not in BUCKET_READS:
        raise ValueError(f"data.bucket_read={bucket_read!r} must be one of {', '.join(BUCKET_READS)}")
    if bucket_read == "stream" and paths.is_cloud(data_dir):
        from onona_jax.data.stream import StreamStore

        return StreamStore(data_dir, split, vocab_size, manifest=manifest, model_vocab=model_vocab)
    return TokenStore(data_dir, split, vocab_size, cache_dir, manifest=manifest, model_vocab=model_vocab)


def id_bound(vocab_size: int | None, manifest: dict, model_vocab: int | None) -> int:
    """The exclusive bound of a store's token ids (`open_store`)."""
    bound = vocab_size or manifest["vocab"]
    return min(bound, model_vocab) if model_vocab else bound


class TokenStore:
    """One split of a prepared data dir as a single read-only token stream over memory-mapped shards.

    `data_dir` may be a bucket URL (gs://...): the split's shards are then copied once into
    `cache_dir` (default: storage.default_cache_dir()) and verified, see onona_jax/data/storage.py
    (`open_store` streams instead with bucket_read="stream").
    """

    def __init__(self, data_dir: str | Path, split: str, vocab_size: int | None = None,
                 cache_dir: str | None = None, *, manifest: tuple[bytes, dict] | None = None,
                 model_vocab: int | None = None):
        d = storage.local_data_dir(data_dir, (split,), cache_dir, manifest)
        manifest_path = d / "manifest.json"
        if manifest is None:
            if not manifest_path.is_file():
                raise ValueError(f"no prepared data at {d} (missing {manifest_path}); {_prepare_hint(d)}")
            raw = manifest_path.read_bytes()
            manifest = raw, storage.parse_manifest(raw, str(manifest_path), d)
        self.manifest_file = manifest  # (raw bytes, parsed): what the store was opened from
        manifest = manifest[1]
        shards = split_shards(manifest, split, manifest_path, d)
        self.data_dir, self.split, self.manifest = d, split, manifest
        self.dtype = storage.token_dtype(manifest)
        self.vocab_size = id_bound(vocab_size, manifest, model_vocab)
        self.shards: list[np.memmap] = []
        for s in shards:
            path = d / s["file"]
            if not path.is_file():
                raise ValueError(f"shard {path} listed in {manifest_path} is missing; {_prepare_hint(d)} again")
            size, want = path.stat().st_size, storage.shard_bytes(manifest, s)
            if size != want:
                raise ValueError(f"shard {path} has {size} bytes but the manifest says {s['tokens']} "
                                 f"{self.dtype.name} tokens ({want} bytes); the data dir is incomplete or corrupt: "
                                 f"{_prepare_hint(d)} again")
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
                raise id_error(path, int(arr[pos]), pos, self.vocab_size, self.manifest)

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
        return num_windows(self, seq_len)


class WindowSource:
    """grain RandomAccessDataSource: window i = tokens[i*(seq_len+1) : (i+1)*(seq_len+1)] as int32."""

    def __init__(self, store, seq_len: int):
        self.store, self.seq_len = store, seq_len
        self._len = store.num_windows(seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range [0, {self._len})")
        w = self.seq_len + 1
        return self.store.read(index * w, (index + 1) * w).astype(np.int32)

    def windows(self, indices) -> np.ndarray:
        """np.int32 [len(indices), seq_len + 1]: the windows, read in one call (a streaming store
        fetches all their missing blocks at once, concurrently)."""
        w = self.seq_len + 1
        for i in indices:
            if not 0 <= int(i) < self._len:
                raise IndexError(f"window {int(i)} out of range [0, {self._len})")
        rows = self.store.read_many([(int(i) * w, (int(i) + 1) * w) for i in indices])
        return np.stack(rows).astype(np.int32) if rows else np.zeros((0, w), np.int32)

    def __repr__(self) -> str:
        return f"WindowSource({self.store.data_dir}, {self.store.split}, seq_len={self.seq_len}, windows={self._len})"


class TrainIterator(grain.DatasetIterator):
    """Yields this process's share of each global batch; state = global step plus the config it is valid for."""

    def __init__(self, parent: grain.DatasetIterator, config: dict):
        super().__init__(parent)
        self.config = config

    def __next__(self) -> np.ndarray:
        return next(self._parent)

    @property
    def step(self) -> int:
        """Index of the global batch the next call returns."""
        return int(self._parent.get_state()["next_index"])

    def get_state(self) -> dict:
        return {"step": self.step, **self.config}

    def set_state(self, state: dict) -> None:
        # Process index/count are not part of the state: the global batches do not depend on them.
        diff = {k: (state.get(k), v) for k, v in self.config.items() if state.get(k) != v}
        if diff:
            raise ValueError("data iterator state was saved with a different config (saved, now): "
                             + ", ".join(f"{k}={a!r}, {b!r}" for k, (a, b) in diff.items()))
        if not isinstance(state.get("step"), int) or state["step"] < 0:
            raise ValueError(f"data iterator state without a step count: {state!r}")
        self._parent.set_state({"next_index": state["step"]})


def train_batches(
    data_dir,
    seq_len: int,
    global_batch: int,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    start_step: int = 0,
    read_threads: int = 1,
    prefetch: int = 2,
    vocab_size: int | None = None,
    cache_dir: str | None = None,
    bucket_read: str = "copy",
) -> TrainIterator:
    """Endless iterator of np.int32 [global_batch // process_count, seq_len + 1] training batches
    of `data_dir`'s train split (or of `data_dir` itself when it is that split already opened:
    `open_store`, `RunData.train`; the other reading arguments are then not used).

    Slot j of global batch b is window perm[(b * global_batch + j) % num_windows] for one fixed
    permutation `perm` of `seed` (every epoch repeats it); process p gets slots
    [p * G/P, (p + 1) * G/P), so the global batch does not depend on the process count.
    """
    if global_batch < 1 or process_count < 1 or global_batch % process_count:
        raise ValueError(f"global_batch {global_batch} is not divisible by process_count {process_count}; "
                         "choose a global batch that is a multiple of the number of processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    store = (open_store(data_dir, "train", vocab_size, cache_dir, bucket_read)
             if isinstance(data_dir, (str, os.PathLike)) else data_dir)
    source = WindowSource(store, seq_len)
    local = global_batch // process_count
    lo = process_index * local

    def read_share(window_ids: np.ndarray) -> np.ndarray:
        return source.windows(window_ids[lo : lo + local])

    # Shuffle window *ids* (cheap to batch globally), then read only this process's share.
    # reseed_each_epoch=False: grain would otherwise draw a new permutation every epoch.
    ds = (
        grain.MapDataset.range(len(source))
        .shuffle(seed=seed)
        .repeat(reseed_each_epoch=False)
        .batch(global_batch, drop_remainder=True)
        .map(read_share)
    )
    read_options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    config = {"seed": seed, "seq_len": seq_len, "global_batch": global_batch, "num_windows": len(source)}
    it = TrainIterator(iter(ds.to_iter_dataset(read_options)), config)
    if start_step:
        it.set_state({**config, "step": start_step})
    return it


def validation_windows(data_dir: str | Path, seq_len: int, count: int, seed: int = 1234,
                       vocab_size: int | None = None, cache_dir: str | None = None,
                       bucket_read: str = "copy", *, manifest: tuple[bytes, dict] | None = None,
                       model_vocab: int | None = None, tokenizer=None) -> np.ndarray:
    """`count` distinct held-out windows, np.int32 [count, seq_len + 1], in stream order
    (`manifest`, `model_vocab`: see `open_store`). `tokenizer`: the data group (cfg.data) of the
    trained run being evaluated, whose tokenizer must be the data's (`check_tokenizer`), checked
    before any shard is read."""
    if tokenizer is not None:
        manifest = manifest or storage.read_manifest(data_dir)
        check_tokenizer(data_dir, manifest[1], tokenizer, trained=True)
    store = open_store(data_dir, "heldout", vocab_size, cache_dir, bucket_read, manifest=manifest,
                       model_vocab=model_vocab)
    source = WindowSource(store, seq_len)
    if len(source) < count:
        raise ValueError(f"held-out split of {data_dir} has only {len(source)} windows of seq_len + 1 = "
                         f"{seq_len + 1} tokens but {count} were requested; lower the count (or seq_len) or "
                         "re-run prepare with a larger --heldout_fraction")
    ids = np.sort(np.random.default_rng(seed).choice(len(source), count, replace=False))
    return source.windows(ids)


def prepare_bundled(data_dir: str | Path, heldout_fraction: float = 0.02, tokenizer=None) -> str:
    """Prepare the bundled Austen corpus into `data_dir` (local or a bucket) unless it already
    holds prepared data; with `tokenizer` (a config's data group, or a dict of its tokenizer
    keys) tokenised by data.tokenizer, else by GPT-2's."""
    manifest = paths.join(data_dir, "manifest.json")
    if not paths.isfile(manifest):
        try:
            prepare([bundled_corpus_path()], os.fspath(data_dir), heldout_fraction=heldout_fraction,
                    **{k: str(tokenizer.get(k) or "") for k in TOKENIZER_KEYS if tokenizer is not None})
        except (ValueError, OSError):
            if not paths.isfile(manifest):  # else another process prepared it first
                raise
    return os.fspath(data_dir)


def ensure_bundled_data(data_dir: str | Path, seq_len: int, heldout_fraction: float = 0.02,
                        cache_dir: str | None = None, bucket_read: str = "copy", tokenizer=None) -> str:
    """`prepare_bundled`, then its train split checked for a window of `seq_len` (and, with
    `tokenizer`, made by that tokenizer: `check_tokenizer`)."""
    prepare_bundled(data_dir, heldout_fraction, tokenizer)
    manifest = storage.read_manifest(data_dir)
    if tokenizer is not None:
        check_tokenizer(data_dir, manifest[1], tokenizer)
    # fail now, not at the first batch
    open_store(data_dir, "train", None, cache_dir, bucket_read, manifest=manifest).num_windows(seq_len)
    return os.fspath(data_dir)


class RunData(NamedTuple):
    """A training run's data, opened and checked once (`open_for_training`): the train split's
    store (a memory-mapped one has had every token id checked; a streaming one checks each
    block as it reads it), the fixed held-out windows, and the manifest (raw bytes, parsed)
    both were opened from, which names the data (`identity`)."""

    data_dir: str
    train: object  # TokenStore | stream.StreamStore
    val_windows: np.ndarray
    manifest: tuple[bytes, dict]

    @property
    def identity(self) -> str:
        return storage.manifest_identity(*self.manifest)


def open_for_training(data_dir: str | Path, seq_len: int, eval_windows: int, eval_seed: int = 1234,
                      model_vocab: int | None = None, cache_dir: str | None = None,
                      bucket_read: str = "copy", tokenizer=None) -> RunData:
    """Open `data_dir` for a run: its train split (at least one window of `seq_len`: a short
    split fails now, not at the first batch), then `eval_windows` held-out windows, both read
    through one reading of the manifest and with ids below `model_vocab` too (`open_store`).
    `tokenizer`: the run's data group (cfg.data), whose tokenizer must be the data's
    (`check_tokenizer`), checked before any shard is read or copied."""
    manifest = None
    if tokenizer is not None:
        manifest = storage.read_manifest(data_dir)
        check_tokenizer(data_dir, manifest[1], tokenizer)
    train = open_store(data_dir, "train", None, cache_dir, bucket_read, manifest=manifest, model_vocab=model_vocab)
    train.num_windows(seq_len)
    val = validation_windows(data_dir, seq_len, eval_windows, eval_seed, cache_dir=cache_dir, bucket_read=bucket_read,
                             manifest=train.manifest_file, model_vocab=model_vocab)
    return RunData(os.fspath(data_dir), train, val, train.manifest_file)
