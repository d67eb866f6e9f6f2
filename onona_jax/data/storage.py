"""Prepared data dirs on local disk or in a bucket (`gs://`, `s3://`, ... through `etils.epath`).

Training reads random windows every step; from an object store that would be one small ranged
request per window, far too slow. So a remote data dir is copied once per host, shard by shard,
into a local cache directory, each shard checked against the sha256 that prepare recorded in the
manifest, and then memory-mapped like a local one. Layout of the cache:

    CACHE_DIR/<name>-<hash of the URL>/manifest.json    the remote manifest, byte for byte
    CACHE_DIR/<name>-<hash of the URL>/<split>_NNNNN.bin  each copied (then verified) shard

A shard appears under its final name only after its hash matched (write to `.part-PID`, then
rename), so an interrupted copy resumes with the missing shards and never serves a partial one.
The cached manifest pins the version: if the bucket's manifest changes (data re-prepared), the
cache is stale and loading stops with the command that clears it, instead of mixing versions.

That is `data.bucket_read="copy"`, the default. With "stream" (onona_jax/data/stream.py) nothing
is copied: each host fetches and verifies only the blocks of its own windows.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from onona_jax import paths

_COPY_CHUNK = 8 << 20  # bytes per read from the store: large requests, bounded memory


def default_cache_dir() -> str:
    """Where remote data dirs are cached when `data.cache_dir` is empty."""
    return os.path.join(tempfile.gettempdir(), "onona-data-cache")


def prepare_hint(data_dir) -> str:
    return f"run `python -m onona_jax.data.prepare --input <text files> --output {data_dir}`"


# Shards' token widths by the manifest's "dtype": uint16 when every id of the tokenizer fits
# (n_vocab <= 65,536; all data prepared before other tokenizers), else uint32; little-endian.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(manifest: dict) -> np.dtype:
    """The dtype of a manifest's shards."""
    dtype = manifest.get("dtype")
    if dtype not in DTYPES:
        raise ValueError(f"a manifest.json with dtype={dtype!r} (expected {' or '.join(DTYPES)}) was not written by "
                         "this version's prepare: run `python -m onona_jax.data.prepare` again")
    return DTYPES[dtype]


def shard_bytes(manifest: dict, shard: dict) -> int:
    """The size a shard of `manifest` has: its tokens times the token width."""
    return token_dtype(manifest).itemsize * shard["tokens"]


def num_windows(store, seq_len: int) -> int:
    """Number of non-overlapping windows of seq_len + 1 tokens in a store of either kind
    (source.TokenStore, stream.StreamStore)."""
    n = len(store) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{store.split} split of {store.data_dir} has {len(store)} tokens, fewer than one window "
                         f"of seq_len + 1 = {seq_len + 1}; lower seq_len or prepare more text")
    return n


def parse_manifest(raw: bytes, where: str, data_dir) -> dict:
    """The manifest's JSON, or a ValueError naming the file when it is truncated or not JSON."""
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
            raise ValueError("no 'splits' object")
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where} is truncated or not a prepare manifest ({e}); the data dir is incomplete: "
                         f"{prepare_hint(data_dir)} again") from None
    return manifest


def read_remote_manifest(data_dir: str) -> tuple[bytes, dict]:
    path = paths.path(data_dir) / "manifest.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"no prepared data at {data_dir} (missing {path}); {prepare_hint(data_dir)} "
                         "(prepare locally, then copy the directory to the bucket)") from None
    return raw, parse_manifest(raw, str(path), data_dir)


def cache_path(data_dir: str, cache_dir: str | None) -> Path:
    """The cache directory of one remote data dir: readable name plus a hash of the full URL."""
    url = os.fspath(data_dir).rstrip("/")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", url.split("://", 1)[-1])[-80:]
    return Path(cache_dir or default_cache_dir()) / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _full_error(cache: Path, data_dir: str, need: int, free: int) -> ValueError:
    return ValueError(f"data cache {cache} has {free / 1e9:.2f} GB free but the shards of {data_dir} need "
                      f"{need / 1e9:.2f} GB more; free space there, or set --config.data.cache_dir to a local "
                      "disk with room")


def _copy_verified(src, dst: Path, shard: dict, data_dir: str, cache: Path, want_size: int) -> None:
    """Copy one shard to `dst` through a temp name, checking its size and sha256 against the manifest."""
    part = dst.with_name(f".{dst.name}.part-{os.getpid()}")
    h, size = hashlib.sha256(), 0
    try:
        with src.open("rb") as fin, open(part, "wb") as fout:
            while chunk := fin.read(_COPY_CHUNK):
                h.update(chunk)
                fout.write(chunk)
                size += len(chunk)
    except FileNotFoundError:
        part.unlink(missing_ok=True)
        raise ValueError(f"shard {src} listed in {data_dir}/manifest.json is missing; copy the whole data dir "
                         f"to the bucket, or {prepare_hint(data_dir)} again") from None
    except OSError as e:
        part.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise _full_error(cache, data_dir, want_size, shutil.disk_usage(cache).free) from None
        raise
    if size != want_size or ("sha256" in shard and h.hexdigest() != shard["sha256"]):
        part.unlink()
        raise ValueError(f"shard {src} ({size} bytes, sha256 {h.hexdigest()}) does not match "
                         f"{data_dir}/manifest.json ({want_size} bytes, sha256 {shard.get('sha256', '?')}); the "
                         "bucket copy is corrupt or was rewritten: upload the data dir again (or "
                         f"{prepare_hint(data_dir)} and upload it)")
    os.replace(part, dst)


def local_path(data_dir) -> Path:
    """A local data dir as a Path (a file:// URL's path)."""
    s = os.fspath(data_dir)
    return Path(s[len("file://"):] if s.startswith("file://") else s)


def copy_to_cache(data_dir: str, raw: bytes, manifest: dict, splits, cache_dir: str | None = None) -> Path:
    """The cache directory holding the manifest (`raw`, as read from the bucket) and `splits`'
    shards of the remote data dir `data_dir`: copied (once per host) and verified; an
    up-to-date cache is reused without reading the shards."""
    cache = cache_path(data_dir, cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    cached_manifest = cache / "manifest.json"
    if cached_manifest.is_file() and cached_manifest.read_bytes() != raw:
        raise ValueError(f"data cache {cache} holds another version of {data_dir} (its manifest.json differs from "
                         f"the bucket's: the data was prepared again); delete it (`rm -rf {cache}`) and rerun, or "
                         "set --config.data.cache_dir to an empty directory")
    if not cached_manifest.is_file():  # pins the version before any shard lands here
        tmp = cache / f".manifest.json.part-{os.getpid()}"
        tmp.write_bytes(raw)
        os.replace(tmp, cached_manifest)

    # One process per host copies (the others of this host wait here, then find the shards in place).
    with open(cache / ".fill.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _fill(cache, data_dir, manifest, splits)
    return cache


def _fill(cache: Path, data_dir: str, manifest: dict, splits) -> None:
    shards = [s for split in splits for s in manifest["splits"].get(split, {}).get("shards", []) if s["tokens"] > 0]
    missing = []
    for s in shards:
        dst = cache / s["file"]
        if not dst.is_file():
            missing.append(s)
        elif dst.stat().st_size != shard_bytes(manifest, s):
            raise ValueError(f"cached shard {dst} has {dst.stat().st_size} bytes but {data_dir}/manifest.json says "
                             f"{shard_bytes(manifest, s)}; the cache is stale or damaged: delete it (`rm -rf {cache}`) "
                             "and rerun")
    need = sum(shard_bytes(manifest, s) for s in missing)
    free = shutil.disk_usage(cache).free
    if need > free:
        raise _full_error(cache, data_dir, need, free)
    remote = paths.path(data_dir)
    for s in missing:
        _copy_verified(remote / s["file"], cache / s["file"], s, data_dir, cache, shard_bytes(manifest, s))


def shard_sha256(path) -> str:
    """The sha256 of a local file, read in large blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_COPY_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(data_dir) -> tuple[bytes, dict]:
    """(raw bytes, parsed) manifest.json of a local or remote data dir; ValueError if missing."""
    if paths.is_cloud(data_dir):
        return read_remote_manifest(os.fspath(data_dir).rstrip("/"))
    path = local_path(data_dir) / "manifest.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"no prepared data at {data_dir} (missing {path}); {prepare_hint(data_dir)}") from None
    return raw, parse_manifest(raw, str(path), data_dir)


def manifest_identity(raw: bytes, manifest: dict) -> str:
    """What a prepared data dir holds, wherever it lies: the sha256 of its manifest's shard
    list (each split's shards with their tokens and sha256), so a moved or copied data dir, or
    another cache of it, is the same data and data prepared otherwise is not. Data prepared
    before shards carried hashes is identified by its manifest.json's bytes."""
    shards = {split: [[s.get("file"), s.get("tokens"), s.get("sha256")] for s in v.get("shards", [])]
              for split, v in manifest["splits"].items()}
    if any(sha is None for listed in shards.values() for _, _, sha in listed):
        return "manifest-" + hashlib.sha256(raw).hexdigest()
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()


def data_identity(data_dir) -> str:
    """`manifest_identity` of a local or remote data dir; ValueError if it has no manifest."""
    return manifest_identity(*read_manifest(data_dir))


def _read_record(record_dir) -> dict:
    try:
        record = json.loads(paths.read_text(paths.Workdir(record_dir).data_record))
    except (OSError, ValueError):
        return {}  # none yet (or unreadable: rebuilt by hashing)
    return record if isinstance(record, dict) else {}


def _source_record(whole: dict, name: str) -> dict:
    """The record of one source in the file's contents: the whole file for a run's single data
    dir, else its entry under "sources" (a mixture's named source)."""
    if not name:
        return whole
    sources = whole.get("sources")
    record = sources.get(name) if isinstance(sources, dict) else None
    return record if isinstance(record, dict) else {}


def recorded_identity(record_dir, name: str = "") -> str | None:
    """The data identity recorded by the run's last start (`verify_once`), or None; `name`: a
    mixture source's."""
    return _source_record(_read_record(record_dir), name).get("identity")


def verify_once(data, record_dir, splits=("train", "heldout")) -> bool:
    """Check a LOCAL data dir's shards against the size and sha256 its manifest records,
    hashing each shard once per change. RECORD_DIR/data_verified.json (the run's workdir)
    keeps the data's identity and each verified shard's size, mtime and sha256; at every start
    a shard whose size and mtime are as recorded is not read again, any other is hashed. A
    shard that was replaced or damaged is a ValueError naming it and the fix. A rewrite that
    keeps both size and mtime is not noticed (docs/data.md: the trade). Returns whether it
    hashed. A remote data dir is verified as it is copied (`copy_to_cache`); only its identity
    is recorded. `data`: a data dir, or the run's opened `source.DataSource` (its manifest as
    already read; a mixture's named source keeps its record under its name)."""
    if isinstance(data, (str, os.PathLike)):
        data_dir, name, read = data, "", lambda: read_manifest(data_dir)
    else:
        data_dir, name, read = data.data_dir, data.name, lambda: (data.raw, data.manifest)
    record_path = paths.Workdir(record_dir).data_record
    whole = _read_record(record_dir)
    old = _source_record(whole, name)

    def write(new: dict):
        if new != old:
            others = whole.get("sources") if isinstance(whole.get("sources"), dict) else {}
            paths.write_json(record_path, {"sources": {**others, name: new}} if name else new)

    if paths.is_cloud(data_dir):
        write({"data_dir": os.fspath(data_dir), "identity": manifest_identity(*read())})
        return False
    d = local_path(data_dir).resolve()
    raw, manifest = read()
    # Only a record of this very directory vouches for its files.
    known = old.get("shards", {}) if old.get("data_dir") == str(d) and isinstance(old.get("shards"), dict) else {}
    shards, hashed = {}, False
    for split in splits:
        for shard in manifest["splits"].get(split, {}).get("shards", []):
            if "sha256" not in shard:  # written before shards carried hashes (sizes are checked on load)
                continue
            path = d / shard["file"]
            try:
                st = path.stat()  # before hashing: a write during the hash changes the mtime recorded
            except FileNotFoundError:
                raise ValueError(f"shard {path} listed in {d}/manifest.json is missing; restore it, or "
                                 f"{prepare_hint(data_dir)} again") from None
            seen = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": shard["sha256"]}
            if known.get(shard["file"]) != seen:
                digest, hashed = shard_sha256(path), True
                if st.st_size != shard.get("bytes", st.st_size) or digest != shard["sha256"]:
                    raise ValueError(
                        f"shard {path} ({st.st_size} bytes, sha256 {digest}) does not match {d}/manifest.json "
                        f"({shard.get('bytes', '?')} bytes, sha256 {shard['sha256']}): the data dir was changed "
                        f"or damaged after prepare; restore that shard, or {prepare_hint(data_dir)} again")
            shards[shard["file"]] = seen
    write({"data_dir": str(d), "identity": manifest_identity(raw, manifest), "shards": shards})
    return hashed
