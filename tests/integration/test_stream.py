"""Streaming reads of a bucket data dir (`data.bucket_read="stream"`, onona_jax/data/stream.py)
on the local GCS emulator (tests/fake_gcs.py): the batches equal a local data dir's exactly for
one process and for two, each of two processes fetches about half of the training bytes of an
epoch (its own rows, rounded out to blocks) and nothing is copied; a corrupt block, a missing
shard and a manifest without block hashes are errors that name the fix."""

import json

import numpy as np
import pytest

from conftest import prepare_bundled_head
from onona_jax import config as configlib
from onona_jax.data import pipeline, storage
from onona_jax.data.stream import StreamStore

SEQ = 4095  # windows of 8,192 bytes ...
BLOCK = 128  # ... read in blocks of 128: a window rounded out to blocks is at most 1.6% more
SHARD = 20_011  # tokens per shard, so that windows and blocks straddle shard ends


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """~240K training tokens of the bundled corpus, prepared locally with small blocks."""
    return prepare_bundled_head(tmp_path_factory.mktemp("stream"), 1_000_000, heldout_fraction=0.05,
                                shard_tokens=SHARD, block_bytes=BLOCK)


def upload(local_dir, url):
    from onona_jax import paths

    for p in sorted(local_dir.iterdir()):
        paths.write_atomic(f"{url}/{p.name}", p.read_bytes())


@pytest.fixture
def counted(monkeypatch):
    """Bytes fetched by every StreamStore made from now on, per store (in creation order)."""
    stores = []
    init = StreamStore.__init__

    def tracking(self, *args, **kwargs):
        init(self, *args, **kwargs)
        stores.append(self)

    monkeypatch.setattr(StreamStore, "__init__", tracking)
    return stores


def test_streamed_batches_equal_local_ones_and_each_process_reads_its_share(local, fake_gcs, tmp_path, counted):
    ref, m = local
    url = f"{fake_gcs}/data"
    upload(ref, url)
    gb = 8
    windows = pipeline.TokenStore(ref, "train").num_windows(SEQ)
    steps = windows // gb  # one epoch: every window at most once
    assert steps >= 6 and len(m["splits"]["train"]["shards"]) >= 10
    want = [next(it) for it in [pipeline.train_batches(ref, SEQ, gb, seed=5)] for _ in range(steps + 2)]

    cache = tmp_path / "cache"
    one = pipeline.train_batches(url, SEQ, gb, seed=5, cache_dir=str(cache), bucket_read="stream")
    assert all(np.array_equal(w, next(one)) for w in want)  # P=1, into the second epoch
    halves = [pipeline.train_batches(url, SEQ, gb, seed=5, process_index=p, process_count=2, read_threads=0,
                                     cache_dir=str(cache), bucket_read="stream") for p in (0, 1)]
    for w in want[:steps]:
        assert np.array_equal(w, np.concatenate([next(halves[0]), next(halves[1])]))
    assert not cache.exists()  # nothing copied

    # One epoch of each process: its own rows (half of the epoch's windows), rounded out to blocks.
    epoch_bytes = steps * gb * 2 * (SEQ + 1)
    for store in counted[1:3]:
        assert 0.5 * epoch_bytes <= store.bytes_fetched <= (0.5 + 0.05) * epoch_bytes, (store.bytes_fetched,
                                                                                       epoch_bytes)
        assert store.requests <= steps * gb  # a window's blocks are one request, or none (cached)

    # Four read threads share one store (and its cache): the same batches.
    four = pipeline.train_batches(url, SEQ, gb, seed=5, read_threads=4, prefetch=4, bucket_read="stream")
    assert all(np.array_equal(w, next(four)) for w in want)
    # Validation windows (sorted, neighbours share blocks) equal too.
    assert np.array_equal(pipeline.validation_windows(url, 64, 20, bucket_read="stream"),
                          pipeline.validation_windows(ref, 64, 20))
    # The identity of the data, as verify_once records it, is the manifest's: the same either way.
    assert storage.data_identity(url) == storage.data_identity(ref)


def test_corrupt_block_missing_shard_and_old_manifest_are_errors_with_the_fix(local, fake_gcs):
    import fsspec

    ref, m = local
    url = f"{fake_gcs}/bad"
    upload(ref, url)
    shard = m["splits"]["train"]["shards"][2]
    fs, key = fsspec.core.url_to_fs(f"{url}/{shard['file']}")
    data = bytearray(fs.cat_file(key))
    data[5 * BLOCK + 7] ^= 1  # one bit in block 5: same size, only the block's hash can tell
    fs.pipe_file(key, bytes(data))

    store = StreamStore(pipeline.DataSource(url), "train")
    first = 2 * SHARD  # shard 2's first token in the stream
    assert np.array_equal(store.read(first, first + 5 * BLOCK // 2),  # blocks 0-4 are sound
                          pipeline.TokenStore(ref, "train").read(first, first + 5 * BLOCK // 2))
    with pytest.raises(ValueError, match=rf"block 5 \(bytes {5 * BLOCK}\.\.{6 * BLOCK - 1}\) of shard "
                                         rf"{url}/{shard['file']} does not match .*upload the data dir again"):
        store.read(first, first + 10 * BLOCK)
    # A truncated shard is the same error (fewer bytes than the block holds), a missing one names it.
    fs.pipe_file(key, bytes(data[: 3 * BLOCK + 10]))
    with pytest.raises(ValueError, match=r"block 3 .*10 bytes read, 128 expected"):
        StreamStore(pipeline.DataSource(url), "train").read(first, first + 4 * BLOCK // 2)
    fs.rm(key)
    with pytest.raises(ValueError, match=rf"shard {url}/{shard['file']} listed in .* is missing"):
        StreamStore(pipeline.DataSource(url), "train").read(first, first + 1)

    # Data prepared before block hashes: refused, naming both fixes; copy mode (asked for) still reads it.
    old = f"{fake_gcs}/old"
    upload(ref, old)
    manifest = json.loads((ref / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for s in split["shards"]:
            del s["block_bytes"], s["block_sha256"]
    fs.pipe_file(fsspec.core.url_to_fs(f"{old}/manifest.json")[1], json.dumps(manifest).encode())
    with pytest.raises(ValueError, match=r"no block hashes for shard train_00000\.bin .*prepare .*again .*"
                                         r"data\.bucket_read=copy"):
        pipeline.train_batches(old, SEQ, 8, bucket_read="stream")
    assert len(pipeline.DataSource(old, bucket_read="copy", cache_dir=str(ref.parent / "cache")).store("train")) == len(
        pipeline.TokenStore(ref, "train"))


def test_bucket_read_is_checked_and_resumable():
    cfg = configlib.base_config()
    cfg.data.bucket_read = "stream"
    configlib.validate(cfg)
    cfg.data.bucket_read = "mmap"
    with pytest.raises(ValueError, match=r"data\.bucket_read='mmap' must be \"copy\" .* or \"stream\""):
        configlib.validate(cfg)
    assert "data.bucket_read" in configlib.RESUMABLE_KEYS
    with pytest.raises(ValueError, match=r"data\.bucket_read='mmap' must be one of copy, stream"):
        pipeline.DataSource("gs://b/d", bucket_read="mmap")
