"""Streaming reads of a bucket data dir (`data.bucket_read="stream"`): each host fetches only the
blocks that hold its own windows, by ranged reads, instead of copying every shard (storage.py).

prepare records, per shard, `block_bytes` and `block_sha256`: the first 16 bytes (32 hex
characters) of the sha256 of each `block_bytes` block of the shard, the last block shorter. A
read fetches the whole blocks that cover the requested tokens, checks each against its hash and
its token ids against the vocabulary, and only then serves it: a corrupt or rewritten block is a
ValueError naming the shard, the block and the fix, never data. Read-ahead: `read_many` (one
call per batch share, and grain's prefetch runs it batches ahead) gathers every missing block of
the call, merges neighbouring blocks into one range, and fetches all ranges concurrently
(fsspec's `cat_ranges`: gcsfs issues them together); verified blocks stay in a small LRU cache,
so windows that share a block, or sequential windows, do not fetch it again.

What a host reads: its windows rounded out to whole blocks, so about its share of the data times
(1 + block_bytes / (width * (seq_len + 1))), width the token's bytes (2 for uint16 shards, 4 for
uint32: the manifest's dtype): blocks should be small next to a window (prepare's --block_bytes).
A manifest without block hashes (prepared before they existed) is refused with the fix; it is
never read unverified.
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np

from onona_jax import paths
from onona_jax.data import storage
from onona_jax.data.prepare import BLOCK_HASH_HEX

CACHE_BYTES = 64 << 20  # verified blocks kept per store (the training store and the held-out one)


def _no_block_hashes(data_dir: str, shard: dict) -> ValueError:
    return ValueError(
        f"{data_dir}/manifest.json has no block hashes for shard {shard['file']} (prepared before streaming "
        f"reads existed), so streamed reads could not be verified; {storage.prepare_hint(data_dir)} again (it "
        "writes them), or copy the shards to each host instead: --config.data.bucket_read=copy")


class StreamStore:
    """One split of a bucket data dir (`source`, a `source.DataSource`: its manifest, dtype and
    token-id bound) as a token stream read by ranged, verified block fetches. Same reading
    interface as source.TokenStore (`len`, `read`, `read_many`, `num_windows`)."""

    def __init__(self, source, split: str, cache_bytes: int = CACHE_BYTES):
        data_dir, manifest = source.data_dir, source.manifest
        manifest_path = f"{data_dir}/manifest.json"
        shards = source.shards(split)
        self.source, self.dtype = source, source.dtype
        width = self.dtype.itemsize
        for s in shards:
            if "block_sha256" not in s or "block_bytes" not in s:
                raise _no_block_hashes(data_dir, s)
            size = storage.shard_bytes(manifest, s)
            nblocks = -(-size // s["block_bytes"])
            whole = s["block_bytes"] >= width and s["block_bytes"] % width == 0
            if not whole or len(s["block_sha256"]) != nblocks * BLOCK_HASH_HEX:
                raise ValueError(f"{manifest_path} lists {len(s['block_sha256']) // BLOCK_HASH_HEX} block hashes of "
                                 f"{s['block_bytes']} bytes for shard {s['file']} of {size} bytes; the "
                                 f"manifest is damaged: {storage.prepare_hint(data_dir)} again")
        self.data_dir, self.split, self.manifest, self.shard_info = data_dir, split, manifest, shards
        self.vocab_size = source.id_bound
        self.fs, root = paths._fs(data_dir)
        self.keys = [f"{root.rstrip('/')}/{s['file']}" for s in shards]
        self.offsets = np.cumsum([0] + [s["tokens"] for s in shards])  # stream position of each shard start
        self.cache_blocks = max(1, cache_bytes // max(s["block_bytes"] for s in shards))
        self._cache: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes_fetched = self.requests = 0  # what this store read from the bucket (tests, benchmarks)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def num_windows(self, seq_len: int) -> int:
        return storage.num_windows(self, seq_len)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Copy of tokens[start:stop] of the concatenated stream (may span shards)."""
        return self.read_many([(start, stop)])[0]

    def _pieces(self, start: int, stop: int):
        """(shard, first token, stop token) of each shard's part of [start, stop)."""
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            base, end = int(self.offsets[i]), int(self.offsets[i + 1])
            n = min(stop, end) - pos
            yield i, pos - base, pos - base + n
            pos += n
            i += 1

    def read_many(self, ranges) -> list[np.ndarray]:
        """Copies of tokens[a:b] for each (a, b), all missing blocks fetched in one concurrent call."""
        for a, b in ranges:
            if not 0 <= a <= b <= len(self):
                raise IndexError(f"token range [{a}, {b}) outside stream of {len(self)} tokens")
        wanted = {}  # (shard, block) -> None, in first-use order
        for a, b in ranges:
            for i, lo, hi in self._pieces(a, b):
                bb = self.shard_info[i]["block_bytes"] // self.dtype.itemsize  # tokens per block
                for k in range(lo // bb, (hi - 1) // bb + 1):
                    wanted[(i, k)] = None
        have = {}
        with self._lock:
            for key in wanted:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    have[key] = self._cache[key]
        have.update(self._fetch([key for key in wanted if key not in have]))
        out = []
        for a, b in ranges:
            row = np.empty(b - a, self.dtype)
            at = 0
            for i, lo, hi in self._pieces(a, b):
                bb = self.shard_info[i]["block_bytes"] // self.dtype.itemsize
                for k in range(lo // bb, (hi - 1) // bb + 1):
                    s, e = max(lo, k * bb), min(hi, (k + 1) * bb)
                    row[at : at + e - s] = have[(i, k)][s - k * bb : e - k * bb]
                    at += e - s
            out.append(row)
        return out

    def _fetch(self, keys: list[tuple[int, int]]) -> dict:
        """Fetch, verify and cache the blocks `keys`: runs of neighbouring blocks of one shard are
        one ranged request, and all requests go out together."""
        if not keys:
            return {}
        runs = []  # [shard, first block, last block]
        for i, k in sorted(keys):
            if runs and runs[-1][0] == i and runs[-1][2] == k - 1:
                runs[-1][2] = k
            else:
                runs.append([i, k, k])
        starts, ends = [], []
        for i, k0, k1 in runs:
            b, size = self.shard_info[i]["block_bytes"], storage.shard_bytes(self.manifest, self.shard_info[i])
            starts.append(k0 * b)
            ends.append(min((k1 + 1) * b, size))
        datas = self.fs.cat_ranges([self.keys[i] for i, _, _ in runs], starts, ends, on_error="return")
        got = {}
        for (i, k0, k1), start, end, data in zip(runs, starts, ends, datas):
            if isinstance(data, FileNotFoundError):
                raise ValueError(f"shard {self.data_dir}/{self.shard_info[i]['file']} listed in "
                                 f"{self.data_dir}/manifest.json is missing; copy the whole data dir to the bucket, "
                                 f"or {storage.prepare_hint(self.data_dir)} again") from None
            if isinstance(data, BaseException):
                raise data
            with self._lock:
                self.bytes_fetched += len(data)
                self.requests += 1
            b = self.shard_info[i]["block_bytes"]
            for k in range(k0, k1 + 1):
                got[(i, k)] = self._verified(i, k, data[(k - k0) * b : (k - k0 + 1) * b], min(b, end - k * b))
        with self._lock:
            for key, arr in got.items():
                self._cache[key] = arr
            while len(self._cache) > self.cache_blocks:
                self._cache.popitem(last=False)
        return got

    def _verified(self, i: int, k: int, data: bytes, want: int) -> np.ndarray:
        shard = self.shard_info[i]
        b = shard["block_bytes"]
        expect = shard["block_sha256"][k * BLOCK_HASH_HEX : (k + 1) * BLOCK_HASH_HEX]
        digest = hashlib.sha256(data).hexdigest()[:BLOCK_HASH_HEX]
        if len(data) != want or digest != expect:
            raise ValueError(
                f"block {k} (bytes {k * b}..{k * b + want - 1}) of shard {self.data_dir}/{shard['file']} does not "
                f"match {self.data_dir}/manifest.json ({len(data)} bytes read, {want} expected; hash {digest}, "
                f"expected {expect}): the bucket copy is corrupt or was rewritten; upload the data dir again (or "
                f"{storage.prepare_hint(self.data_dir)} and upload it)")
        arr = np.frombuffer(data, dtype=self.dtype)
        if arr.size and int(arr.max()) >= self.vocab_size:  # as TokenStore checks a whole shard at load
            at = int(np.argmax(arr >= self.vocab_size))
            raise self.source.id_error(f"{self.data_dir}/{shard['file']}", int(arr[at]),
                                       k * b // self.dtype.itemsize + at)
        return arr
