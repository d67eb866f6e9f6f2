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

from onona_jax import paths

_COPY_CHUNK = 8 << 20  # bytes per read from the store: large requests, bounded memory


def default_cache_dir() -> str:
    """Where remote data dirs are cached when `data.cache_dir` is empty."""
    return os.path.join(tempfile.gettempdir(), "onona-data-cache")


def prepare_hint(data_dir) -> str:
    return f"run `python -m onona_jax.data.prepare --input <text files> --output {data_dir}`"


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


def _copy_verified(src, dst: Path, shard: dict, data_dir: str, cache: Path) -> None:
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
            raise _full_error(cache, data_dir, 2 * shard["tokens"], shutil.disk_usage(cache).free) from None
        raise
    want_size = 2 * shard["tokens"]
    if size != want_size or ("sha256" in shard and h.hexdigest() != shard["sha256"]):
        part.unlink()
        raise ValueError(f"shard {src} ({size} bytes, sha256 {h.hexdigest()}) does not match "
                         f"{data_dir}/manifest.json ({want_size} bytes, sha256 {shard.get('sha256', '?')}); the "
                         "bucket copy is corrupt or was rewritten: upload the data dir again (or "
                         f"{prepare_hint(data_dir)} and upload it)")
    os.replace(part, dst)


def local_data_dir(data_dir: str | os.PathLike, splits: tuple[str, ...] | list[str],
                   cache_dir: str | None = None) -> Path:
    """A local directory holding the manifest and `splits`' shards of `data_dir`.

    Local paths are returned as they are. A remote data dir's shards of `splits` are copied (once per
    host) into its cache dir and verified; an up-to-date cache is reused without reading the shards.
    """
    if not paths.is_cloud(data_dir):
        s = os.fspath(data_dir)
        return Path(s[len("file://"):] if s.startswith("file://") else s)
    data_dir = os.fspath(data_dir).rstrip("/")
    raw, manifest = read_remote_manifest(data_dir)
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
        elif dst.stat().st_size != 2 * s["tokens"]:
            raise ValueError(f"cached shard {dst} has {dst.stat().st_size} bytes but {data_dir}/manifest.json says "
                             f"{2 * s['tokens']}; the cache is stale or damaged: delete it (`rm -rf {cache}`) and "
                             "rerun")
    need = sum(2 * s["tokens"] for s in missing)
    free = shutil.disk_usage(cache).free
    if need > free:
        raise _full_error(cache, data_dir, need, free)
    remote = paths.path(data_dir)
    for s in missing:
        _copy_verified(remote / s["file"], cache / s["file"], s, data_dir, cache)


def verify_once(data_dir, record_dir, splits=("train", "heldout")) -> bool:
    """Check every shard of a LOCAL data dir against the size and sha256 its manifest records,
    once per run directory: the result is kept in RECORD_DIR/data_verified.json (keyed by the
    manifest's own hash), so a resume with the same data reads no shard again. A shard that was
    replaced or damaged is a ValueError naming it and the fix. Returns whether it hashed.
    Remote data dirs are verified as they are copied (`local_data_dir`)."""
    if paths.is_cloud(data_dir):
        return False
    d = Path(os.fspath(data_dir))
    raw = (d / "manifest.json").read_bytes()
    manifest = parse_manifest(raw, str(d / "manifest.json"), data_dir)
    key = hashlib.sha256(raw).hexdigest()
    record = paths.join(record_dir, "data_verified.json")  # the run's workdir: local or a bucket
    try:
        if json.loads(paths.read_text(record)).get("manifest_sha256") == key:
            return False
    except (OSError, ValueError):
        pass  # no (readable) record: verify
    for split in splits:
        for shard in manifest["splits"].get(split, {}).get("shards", []):
            path = d / shard["file"]
            if "sha256" not in shard:  # written before shards carried hashes
                continue
            size = path.stat().st_size
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(_COPY_CHUNK), b""):
                    h.update(block)
            if size != shard.get("bytes", size) or h.hexdigest() != shard["sha256"]:
                raise ValueError(
                    f"shard {path} ({size} bytes, sha256 {h.hexdigest()}) does not match {d}/manifest.json "
                    f"({shard.get('bytes', '?')} bytes, sha256 {shard['sha256']}): the data dir was changed "
                    f"or damaged after prepare; {prepare_hint(data_dir)} again")
    paths.write_json(record, {"data_dir": str(d.resolve()), "manifest_sha256": key})
    return True

