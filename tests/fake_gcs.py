"""A local, offline stand-in for Google Cloud Storage, for tests of `gs://` workdirs and data dirs.

One HTTP server (the pure-Python `gcp-storage-emulator`, in memory, on a free port of 127.0.0.1)
serves the GCS JSON API to both clients a run uses:

- our own reads and writes (`etils.epath.Path("gs://...")` -> fsspec -> gcsfs), pointed at it by
  STORAGE_EMULATOR_HOST;
- Orbax's array data (TensorStore's own `gcs` kvstore driver, not fsspec), pointed at it by
  TENSORSTORE_GCS_HTTP_URL, with GOOGLE_AUTH_TOKEN_FOR_TESTING so TensorStore never looks for
  credentials (no metadata-server probe).

`env(url)` (below) is everything a process needs; `start()` puts it in os.environ, so subprocesses
(train.py, eval.py) started afterwards reach the same store. Clients read their endpoint once per
process (epath caches its gcsfs filesystem), so one server serves a whole test session and each
test gets its own bucket.

What the fake does NOT model (so a test passing here says nothing about it): preconditions other
than `ifGenerationMatch` on uploads and deletes (see `_storage`; `ifMetagenerationMatch` and
`ifGenerationNotMatch` are ignored), a resumable upload's precondition checked at its end (here at
its start), latency, throttling (429/503) and retries,
resumable-upload failures halfway, IAM/credentials, hierarchical-namespace and zonal buckets
(gcsfs's check for them is switched off here), and eventual consistency (GCS itself is strongly
consistent for object reads, writes and listings; the emulator is too, trivially).
"""

from __future__ import annotations

import http.server
import itertools
import json
import logging
import os
import threading
from dataclasses import dataclass
from functools import partial

_ENV_BASE = {
    # TensorStore: a fixed bearer token instead of credential discovery (no network, no GCE probe).
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
    # gcsfs >= 2025.x asks the Storage Control API (gRPC, real credentials) whether a bucket is
    # zonal or hierarchical before most calls; the emulator has no such API. Must be set before
    # gcsfs is imported.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    # gcsfs: anonymous requests (no search for credentials). Its listing cache is left as the
    # project sets it (`onona_jax.paths.fresh_listings`), so the tests see what users get.
    "FSSPEC_GCS": '{"token": "anon"}',
}


def env(url: str) -> dict[str, str]:
    """The environment variables that point every GCS client of a process at `url`."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, **_ENV_BASE}


def _move_to(request, response, storage, *args, **kwargs):
    """objects.moveTo (gcsfs renames with it; the emulator lacks it): copy, then delete the source,
    under the server's lock, so no reader sees both or neither."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    p = request.params
    try:
        dest = objects._copy(request.base_url, storage, p["bucket_name"], p["object_id"], p["bucket_name"],
                             p["dest_object_id"])
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    objects._delete(storage, p["bucket_name"], p["object_id"])
    response.json(dest)


def _patch_emulator():
    from gcp_storage_emulator import server

    if getattr(server, "_onona_patched", False):
        return
    route = (r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
             {server.POST: _move_to})
    server.HANDLERS = (route, *server.HANDLERS)
    server._onona_patched = True
    # One line per request at INFO, and a "Resource not found" error per probe of a missing
    # object (TensorStore and Orbax probe on purpose): keep the test log for real failures.
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # TensorStore opens many connections at once

    def handle_error(self, request, client_address):
        pass  # a client that hung up early (BrokenPipe): not a test failure


@dataclass
class FakeGCS:
    url: str
    server: _Server
    thread: threading.Thread
    storage: object
    lock: object
    saved: dict | None = None
    _buckets = itertools.count()

    def new_bucket(self, prefix: str = "fake-bucket") -> str:
        """Create an empty bucket with a name no other test of this session uses."""
        from gcp_storage_emulator.handlers import buckets

        name = f"{prefix}-{next(self._buckets)}"
        with self.lock:
            buckets.create_bucket(name, self.storage)
            # No soft delete (the emulator keeps deleted objects 7 days by default, in memory).
            self.storage.buckets[name]["softDeletePolicy"] = {"retentionDurationSeconds": "0"}
        return name

    def empty(self, bucket: str) -> None:
        """Delete every object of `bucket` (frees the memory a test's checkpoints took)."""
        with self.lock:
            for key in list(self.storage.objects.get(bucket, {})):
                self.storage._hard_delete_file(bucket, key)

    def stop(self):
        restore(self.saved)
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class _PreconditionFailed(Exception):
    pass


def _storage():
    """The emulator's in-memory store, plus object generations as TensorStore uses them (the
    emulator has generations but ignores preconditions and sends no generation header):
    an upload or delete with `ifGenerationMatch=G` fails with 412 unless the object's generation
    is G (0: the object must not exist), and a read says the object's generation in
    `x-goog-generation`. TensorStore's OCDBT writes its manifest with these conditions; gcsfs's
    `open(path, "xb")` / `pipe(..., mode="create")` send `ifGenerationMatch=0` and turn the 412
    into FileExistsError (a lock's create-if-absent)."""
    from gcp_storage_emulator.storage import Storage

    class GenerationStorage(Storage):
        if_generation_match = None  # of the request being served (requests run one at a time)
        served = None  # the object the request read, for its generation header

        def _check(self, bucket, name):
            if self.if_generation_match is None:
                return
            obj = self.objects.get(bucket, {}).get(name)
            if self.if_generation_match != (obj["generation"] if obj else "0"):
                raise _PreconditionFailed(f"{bucket}/{name}: generation is not {self.if_generation_match}")

        def get_file_obj(self, bucket_name, file_name):
            self.served = super().get_file_obj(bucket_name, file_name)
            return self.served

        def create_file(self, bucket_name, file_name, content, file_obj, file_id=None):
            self._check(bucket_name, file_name)
            return super().create_file(bucket_name, file_name, content, file_obj, file_id)

        def create_resumable_upload(self, bucket_name, file_name, file_obj):
            self._check(bucket_name, file_name)  # real GCS checks at the last chunk; here at the first
            return super().create_resumable_upload(bucket_name, file_name, file_obj)

        def delete_file(self, bucket_name, file_name):
            self._check(bucket_name, file_name)
            return super().delete_file(bucket_name, file_name)

    return GenerationStorage(use_memory_fs=True)


def start() -> FakeGCS:
    """Start the emulator on a free port of 127.0.0.1 in a daemon thread of this process, and
    point this process (`use`) and the subprocesses it starts afterwards at it."""
    from urllib.parse import parse_qs, urlsplit

    from gcp_storage_emulator import server

    _patch_emulator()
    storage = _storage()
    lock = threading.Lock()  # the in-memory store is not thread-safe: one request at a time

    def locked(method):
        def do(self):
            with lock:
                query = parse_qs(urlsplit(self.path).query)
                storage.if_generation_match = query.get("ifGenerationMatch", [None])[0]
                storage.served = None
                try:
                    server.Router(self).handle(method)
                except _PreconditionFailed as err:
                    body = json.dumps({"error": {"code": 412, "message": f"conditionNotMet: {err}"}}).encode()
                    self.send_response(412)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
        return do

    def send_response(self, code, message=None):
        server.RequestHandler.send_response(self, code, message)
        if storage.served is not None and code in (200, 206):
            self.send_header("x-goog-generation", storage.served["generation"])
            self.send_header("x-goog-metageneration", storage.served["metageneration"])

    methods = {f"do_{m}": locked(m) for m in (server.GET, server.POST, server.PUT, server.DELETE, server.PATCH)}
    # HTTP/1.1 so that a client's "Expect: 100-continue" (curl, under TensorStore, sends it for
    # bodies over 1 MB) is answered at once instead of after curl's 1 s wait; every response of
    # the emulator carries its Content-Length, so connections can be kept alive.
    handler = type("Handler", (server.RequestHandler,),
                   {**methods, "send_response": send_response, "protocol_version": "HTTP/1.1",
                    "disable_nagle_algorithm": True})  # headers and body go in two writes: no 40 ms stall
    httpd = _Server(("127.0.0.1", 0), partial(handler, storage))
    thread = threading.Thread(target=httpd.serve_forever, name="fake-gcs", daemon=True)
    thread.start()
    fake = FakeGCS(f"http://127.0.0.1:{httpd.server_address[1]}", httpd, thread, storage, lock)
    fake.saved = use(fake.url)
    return fake


def use(url: str) -> dict:
    """Point this process's GCS clients at `url`: os.environ (read by TensorStore, gcsfs and
    subprocesses), fsspec's config for gcsfs (fsspec read FSSPEC_GCS when it was imported), the
    plain gcsfs filesystem if gcsfs was imported before, and no cached filesystem in epath or
    fsspec. Returns what to hand `restore` to undo it."""
    saved_env = {k: os.environ.get(k) for k in env(url)}
    os.environ.update(env(url))
    import fsspec
    import fsspec.config
    import gcsfs.core
    from etils.epath import backend

    saved_conf = fsspec.config.conf.get("gcs")
    fsspec.config.conf["gcs"] = {**(saved_conf or {}), **json.loads(_ENV_BASE["FSSPEC_GCS"])}
    for protocol in ("gs", "gcs"):  # not the zonal-bucket subclass, whenever gcsfs was imported
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    fsspec.AbstractFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()
    return {"env": saved_env, "conf": saved_conf}


def restore(saved: dict) -> None:
    import fsspec.config
    from etils.epath import backend

    for k, v in saved["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if saved["conf"] is None:
        fsspec.config.conf.pop("gcs", None)
    else:
        fsspec.config.conf["gcs"] = saved["conf"]
    backend.fsspec_backend._get_filesystem.cache_clear()
