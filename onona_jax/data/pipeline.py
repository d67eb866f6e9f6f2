"""Reading a run's data: fixed windows of each source's token stream, the grain iterator of
the global batches (one source, or a weighted mixture: mixture.py), the fixed held-out
windows, and `open_for_training`, which opens and checks it all once per start (`RunData`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import grain
import numpy as np

from onona_jax import paths
from onona_jax.data import mixture
from onona_jax.data.prepare import prepare
from onona_jax.data.source import TOKENIZER_KEYS, DataSource, TokenStore, check_tokenizer
from onona_jax.tokenizer import bundled_corpus_path

__all__ = ["DataSource", "RunData", "TokenStore", "TrainIterator", "WindowSource", "check_tokenizer",
           "ensure_bundled_data", "held_out", "open_for_training", "open_sources", "prepare_bundled",
           "train_batches", "validation_windows"]


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


class TrainIterator:
    """Yields this process's share of each global batch (np.int32 [global_batch // processes,
    seq_len + 1]). Its state: the global step and the config it is valid for; for a run of
    named sources (data.mixture) also each source's position and the weights' shares."""

    def __init__(self, names: list[str], weights, config: dict, make, seed: int, start_step: int = 0):
        """`names`, `weights`: the sources'; `make(plan)`: the grain iterator of the batches
        under a `mixture.Plan` (`train_batches`)."""
        self.names, self.weights, self.config, self._make, self._seed = names, weights, config, make, seed
        self.named = bool(names[0])
        self.mixture_change = None  # {"from": shares, "to": shares} when `set_state` met other weights
        self._start(mixture.Plan(weights, config["global_batch"], seed), start_step)

    def _start(self, plan: mixture.Plan, step: int):
        self.plan = plan
        self._it = self._make(plan)
        if step:
            self._it.set_state({"next_index": step})

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        return next(self._it)

    @property
    def step(self) -> int:
        """Index of the global batch the next call returns."""
        return int(self._it.get_state()["next_index"])

    def shares(self) -> dict:
        return {n: float(w) for n, w in zip(self.names, mixture.shares(self.weights))}

    def consumed(self, step: int) -> dict:
        """{source: windows it gave to batches 0..step-1} for named sources, else {}."""
        return dict(zip(self.names, map(int, self.plan.positions(step)))) if self.named else {}

    def get_state(self) -> dict:
        step = self.step
        extra = {"weights": self.shares(), "positions": self.consumed(step)} if self.named else {}
        return {"step": step, **self.config, **extra}

    def set_state(self, state: dict) -> None:
        # Process index/count are not part of the state: the global batches do not depend on them.
        diff = {k: (state.get(k), v) for k, v in self.config.items() if state.get(k) != v}
        if self.named and "num_windows" in diff:
            saved, now = diff.pop("num_windows")
            raise ValueError(f"data iterator state was saved for the sources (windows each) {saved}, now {now}: a "
                             "mixture's sources may not change on resume (its weights may); resume with the run's "
                             "data.mixture sources, or train this mixture in a new --workdir")
        if diff:
            raise ValueError("data iterator state was saved with a different config (saved, now): "
                             + ", ".join(f"{k}={a!r}, {b!r}" for k, (a, b) in diff.items()))
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"data iterator state without a step count: {state!r}")
        if not self.named:
            self._it.set_state({"next_index": step})
            return
        positions = state.get("positions")
        if not isinstance(positions, dict) or sorted(positions) != sorted(self.names):
            raise ValueError(f"data iterator state without each source's position: {state!r}")
        if state.get("weights") != self.shares():
            self.mixture_change = {"from": state.get("weights"), "to": self.shares()}
        # From the saved positions: equal to the step's own unless the weights changed (now or before).
        plan = mixture.Plan(self.weights, self.config["global_batch"], self._seed, origin=step,
                            positions=[positions[n] for n in self.names])
        self._start(plan, step)


def train_batches(
    data,
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
    of `data`: a data dir's train split (opened here with `vocab_size`, `cache_dir`,
    `bucket_read`), or the run's opened data (`RunData`: one source or a mixture's; the other
    reading arguments are then not used).

    Source s's slots of global batch b hold windows perm_s[(p + i) % num_windows_s], i = 0, 1,
    ..., for one fixed permutation perm_s (every epoch repeats it) and p the windows the source
    gave to the batches before b (`mixture.Plan`). With one source that is window
    perm[(b * global_batch + j) % num_windows] in slot j, perm of `seed`. Process p gets slots
    [p * G/P, (p + 1) * G/P), so the global batch does not depend on the process count.
    """
    if global_batch < 1 or process_count < 1 or global_batch % process_count:
        raise ValueError(f"global_batch {global_batch} is not divisible by process_count {process_count}; "
                         "choose a global batch that is a multiple of the number of processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if isinstance(data, RunData):
        sources, weights = data.sources, data.weights
    else:
        sources = (DataSource(data, cache_dir=cache_dir, bucket_read=bucket_read, vocab_size=vocab_size),)
        weights = (1,)
    windows = [WindowSource(s.store("train"), seq_len) for s in sources]
    # Shuffled window ids: grain's index shuffle, one fixed permutation per source.
    perms = [grain.MapDataset.range(len(w)).shuffle(seed=mixture.source_seed(seed, s.name, len(sources)))
             for s, w in zip(sources, windows)]
    local = global_batch // process_count
    lo = process_index * local

    def make(plan: mixture.Plan):
        def read_share(b: int) -> np.ndarray:
            # The plan of the whole global batch (cheap), then only this process's rows are read.
            source, position = (a[lo : lo + local] for a in plan.batch(b))
            out = np.empty((local, seq_len + 1), np.int32)
            for s in np.unique(source):  # each source's rows in one read
                rows = source == s
                out[rows] = windows[s].windows([perms[s][int(p % len(windows[s]))] for p in position[rows]])
            return out

        ds = grain.MapDataset.range(sys.maxsize).map(read_share)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)))

    counts = [len(w) for w in windows]
    config = {"seed": seed, "seq_len": seq_len, "global_batch": global_batch,
              "num_windows": dict(zip((s.name for s in sources), counts)) if sources[0].name else counts[0]}
    return TrainIterator([s.name for s in sources], weights, config, make, seed, start_step)


def validation_windows(data, seq_len: int, count: int, seed: int = 1234, *, cache_dir: str | None = None,
                       bucket_read: str = "copy", tokenizer=None) -> np.ndarray:
    """`count` distinct held-out windows, np.int32 [count, seq_len + 1], in stream order, of
    `data`: a data dir (opened with `cache_dir`, `bucket_read`) or a DataSource. `tokenizer`:
    the data group (cfg.data) of the trained run being evaluated, whose tokenizer must be the
    data's (`check_tokenizer`), checked before any shard is read."""
    source = data if isinstance(data, DataSource) else DataSource(data, cache_dir=cache_dir, bucket_read=bucket_read)
    if tokenizer is not None:
        source.check_tokenizer(tokenizer, trained=True)
    heldout = WindowSource(source.store("heldout"), seq_len)
    if len(heldout) < count:
        raise ValueError(f"held-out split of {source.data_dir} has only {len(heldout)} windows of seq_len + 1 = "
                         f"{seq_len + 1} tokens but {count} were requested; lower the count (or seq_len) or "
                         "re-run prepare with a larger --heldout_fraction")
    ids = np.sort(np.random.default_rng(seed).choice(len(heldout), count, replace=False))
    return heldout.windows(ids)


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
    source = DataSource(data_dir, cache_dir=cache_dir, bucket_read=bucket_read)
    if tokenizer is not None:
        source.check_tokenizer(tokenizer)
    source.store("train").num_windows(seq_len)  # fail now, not at the first batch
    return os.fspath(data_dir)


@contextlib.contextmanager
def _about(name: str):
    """A named source's errors say which source they are about."""
    try:
        yield
    except ValueError as err:
        if not name:
            raise
        raise ValueError(f"data.mixture source {name!r}: {err}") from None


def open_sources(data, cache_dir: str | None = None, bucket_read: str = "copy", model_vocab: int | None = None,
                 tokenizer=None, trained: bool = False) -> tuple[DataSource, ...]:
    """The sources of `data` (a data dir, or a mixture's entries: `mixture.parse`), each
    manifest read once; with `tokenizer` (a run's data group, cfg.data) every source checked
    to be made by its tokenizer (`check_tokenizer`; `trained`: of a trained model), all before
    any shard is read or copied. A source's error names it."""
    entries = [mixture.Entry("", os.fspath(data), 1)] if isinstance(data, (str, os.PathLike)) else list(data)
    sources = []
    for e in entries:
        with _about(e.name):
            sources.append(DataSource(e.data_dir, e.name, cache_dir=cache_dir, bucket_read=bucket_read,
                                      model_vocab=model_vocab))
    if tokenizer is not None:
        for s in sources:
            with _about(s.name):
                s.check_tokenizer(tokenizer, trained)
    return tuple(sources)


def held_out(sources, seq_len: int, count: int, seed: int = 1234) -> tuple[np.ndarray, dict]:
    """(windows, groups): `count` fixed held-out windows of each source (`validation_windows`),
    source after source, and {name: its rows} of named sources ({} for a single data.dir)."""
    parts, groups = [], {}
    for s in sources:
        with _about(s.name):
            parts.append(validation_windows(s, seq_len, count, seed))
        if s.name:
            at = sum(len(p) for p in parts[:-1])
            groups[s.name] = slice(at, at + count)
    return np.concatenate(parts) if len(parts) > 1 else parts[0], groups


@dataclasses.dataclass(frozen=True)
class RunData:
    """A training run's data, opened and checked once per start (`open_for_training`): its
    sources (one for data.dir; data.mixture's named ones) with their weights, each source's
    train store opened (a memory-mapped one has had every token id checked; a streaming one
    checks each block as it reads it), and the fixed held-out windows of every source
    (`held_out`: `val_groups` holds each named source's rows of `val_windows`)."""

    sources: tuple[DataSource, ...]
    weights: tuple
    val_windows: np.ndarray
    val_groups: dict

    def verify(self, record_dir) -> bool:
        """Every local source's shards against their manifest's hashes (`storage.verify_once`),
        recorded in `record_dir`; whether any shard was hashed."""
        return any([s.verify(record_dir) for s in self.sources])


def open_for_training(data, seq_len: int, eval_windows: int, eval_seed: int = 1234,
                      model_vocab: int | None = None, cache_dir: str | None = None,
                      bucket_read: str = "copy", tokenizer=None) -> RunData:
    """Open `data` for a run (a data dir, or a mixture's entries: `mixture.parse`): its sources
    (`open_sources`: each manifest read once, the tokenizer checked), each train split (at
    least one window of `seq_len`: a short split fails now, not at the first batch; ids below
    `model_vocab` too), then `eval_windows` held-out windows of each source (`held_out`)."""
    sources = open_sources(data, cache_dir, bucket_read, model_vocab, tokenizer)
    for s in sources:
        with _about(s.name):
            s.store("train").num_windows(seq_len)
    windows, groups = held_out(sources, seq_len, eval_windows, eval_seed)
    weights = tuple(1 for _ in sources) if isinstance(data, (str, os.PathLike)) else tuple(e.weight for e in data)
    return RunData(sources, weights, windows, groups)
