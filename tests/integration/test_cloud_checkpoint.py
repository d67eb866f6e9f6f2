"""Checkpoints in a bucket: `onona_jax.checkpoint` on `gs://` against the local fake GCS
(tests/fake_gcs.py), which serves both our epath/gcsfs reads and writes and Orbax's array data
(TensorStore's own GCS driver). Saves, restores bit for bit, reads the parameters alone, and sets
an unreadable step aside whole; plus the store behaviours the workdir code relies on."""

import hashlib
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from etils import epath

from conftest import tiny_config
from onona_jax import checkpoint, paths
from onona_jax import train as trainer
from onona_jax.checkpoint import Checkpoints
from onona_jax.data import storage


def bucket_digest(url: str) -> dict:
    """Every object (sha256) under `url`, keyed by its path below it."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return {key[len(root) + 1:]: hashlib.sha256(fs.cat_file(key)).hexdigest() for key in sorted(fs.find(root))}


def test_fake_gcs_store_semantics(fake_gcs, tiny_data):
    """What our workdir code relies on, through epath as our code calls it: whole-object write and
    read, glob, rename, create-if-absent refused when the object exists (the lock's primitive,
    gcsfs `open(..., "xb")`), a listing that sees another process's write, and the record of
    verified data kept in a gs:// run dir (hashed once, then read back from the bucket)."""
    run = epath.Path(fake_gcs) / "run"
    assert storage.verify_once(tiny_data, str(run)) is True
    assert storage.verify_once(tiny_data, str(run)) is False
    (run / "data_verified.json").unlink()
    paths.write_atomic(run / "config.json", '{"a": 1}')
    paths.write_atomic(run / "config.json", '{"a": 2}')  # replaced whole
    assert json.loads((run / "config.json").read_text()) == {"a": 2}
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert sorted(p.name for p in run.glob("*.json*")) == ["config.json", "metrics.jsonl"]
    (run / "metrics.jsonl").rename(run / "old.jsonl")
    assert not (run / "metrics.jsonl").exists() and (run / "old.jsonl").read_text() == '{"step": 1}\n'

    import fsspec

    fs, lock = fsspec.core.url_to_fs(f"{fake_gcs}/run/lock")
    with fs.open(lock, "xb") as f:
        f.write(b"host-a")
    with pytest.raises(FileExistsError):
        with fs.open(lock, "xb") as f:
            f.write(b"host-b")
    assert fs.cat_file(lock) == b"host-a"

    assert sorted(p.name for p in run.iterdir()) == ["config.json", "lock", "old.jsonl"]  # listed once here
    write = f"from etils import epath; epath.Path('{fake_gcs}/run/other').write_text('x')"
    subprocess.run([sys.executable, "-c", write], check=True, timeout=60)
    assert (run / "other").exists() and "other" in {p.name for p in run.iterdir()}


@pytest.fixture(scope="module")
def states(tiny_data):
    """Two different train states of the tiny model, sharded over 8 devices (data, fsdp and
    tensor 2 each), for steps 1 and 2: random values placed straight from the host (nothing
    compiled), with the structure, dtypes and shardings train.py saves."""
    cfg = tiny_config(tiny_data)
    cfg.mesh.update(data=2, fsdp=2, tensor=2)
    run = trainer.setup(cfg, jax.devices()[:8])
    rng = np.random.default_rng(0)

    def state():
        return jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding),
                            trainer.abstract_train_state(run))

    return cfg, run, (state(), state())


def test_checkpoints_in_a_bucket_save_and_restore_exactly(fake_gcs, states):
    """Two steps saved to gs://: listed, the newest restored bit for bit with its shardings, the
    data state and config as saved; `restore_params` / `saved_config` of the gs:// workdir read
    the parameters alone and the config."""
    cfg, run, (first, second) = states
    workdir = f"{fake_gcs}/run"
    ckpts = Checkpoints(f"{workdir}/checkpoints")
    for step, state in ((1, first), (2, second)):
        ckpts.save(step, state, {"position": step}, cfg.to_json())
    ckpts.wait()
    assert ckpts.steps() == [1, 2] and ckpts.latest() == 2
    names = {p.name for p in (epath.Path(workdir) / "checkpoints" / "2").iterdir()}
    assert {"commit_success.txt", "state", "data", "config"} <= names  # Orbax's object-store commit

    reader = Checkpoints(f"{workdir}/checkpoints", read_only=True)  # a fresh process's view
    step, state, data, saved = reader.restore_latest(trainer.abstract_train_state(run))
    assert step == 2 and data == {"position": 2} and saved == json.loads(cfg.to_json())
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(second), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    params, used, saved_cfg, mesh = checkpoint.restore_params(workdir, mesh=(2, 2, 2))
    assert used == 2 and saved_cfg.to_json() == cfg.to_json()
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(second["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert checkpoint.saved_config(workdir, step=1).to_json() == cfg.to_json()


def test_unreadable_newest_step_in_a_bucket_is_set_aside_whole(fake_gcs, states, capfd):
    """Step 2's biggest array object truncated: a read-only reader falls back to step 1 and
    leaves the bucket as it was; the writer falls back too and moves every object of step 2,
    unchanged, to checkpoints/corrupt/2-*, after which Orbax lists step 1 only."""
    import fsspec

    cfg, run, (first, second) = states
    root = f"{fake_gcs}/run/checkpoints"
    ckpts = Checkpoints(root)
    for step, state in ((1, first), (2, second)):
        ckpts.save(step, state, {"position": step}, cfg.to_json())
    ckpts.wait()
    fs, key = fsspec.core.url_to_fs(f"{root}/2/state")
    arrays = sorted((k for k in fs.find(key) if "/d/" in k), key=lambda k: fs.size(k))
    fs.pipe_file(arrays[-1], fs.cat_file(arrays[-1])[: fs.size(arrays[-1]) // 2])
    damaged, before = bucket_digest(f"{root}/2"), bucket_digest(root)
    abstract = trainer.abstract_train_state(run)

    reader = Checkpoints(root, read_only=True)
    assert reader.restore_latest(abstract)[0] == 1
    assert bucket_digest(root) == before

    capfd.readouterr()
    writer = Checkpoints(root)
    step, state, data, _ = writer.restore_latest(abstract)
    assert step == 1 and data == {"position": 1}
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(first), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    err = capfd.readouterr().err
    [aside] = [p for p in (epath.Path(root) / "corrupt").iterdir()]
    assert aside.name.startswith("2-") and f"moved to {aside}" in err
    assert bucket_digest(str(aside)) == damaged  # every object kept, as it was
    assert not fs.exists(f"{key.rsplit('/', 2)[0]}/2")
    assert writer.steps() == [1] and Checkpoints(root, read_only=True).steps() == [1]


def test_bucket_append_composes_only_the_new_bytes(fake_gcs, monkeypatch):
    """metrics.jsonl in a bucket (paths.Appender): each append uploads just its own bytes and
    composes the object with them, instead of rewriting the file; reopening continues it, a torn
    tail is cut, no temporary object is left, and a failed compose leaves the file as it was."""
    import fsspec

    url = f"{fake_gcs}/run/metrics.jsonl"
    log = paths.Appender(url)
    assert log.compose and log.size() == 0
    uploaded = []
    pipe = log.fs.pipe_file  # (an instance attribute: fsspec makes the sync methods per instance)
    monkeypatch.setattr(log.fs, "pipe_file", lambda key, data, **kw: (uploaded.append(len(data)),
                                                                     pipe(key, data, **kw))[1])
    lines = [(json.dumps({"step": s, "loss": 1.0 / s}) + "\n").encode() for s in range(1, 41)]
    for line in lines:
        log.append(line)
    assert uploaded == [len(line) for line in lines]  # never the whole file again
    assert paths.read_bytes(url) == b"".join(lines) and log.size() == len(b"".join(lines))
    fs, root = fsspec.core.url_to_fs(f"{fake_gcs}/run")
    assert [k.rsplit("/", 1)[-1] for k in fs.find(root)] == ["metrics.jsonl"]  # no part left behind

    again = paths.Appender(url)  # a resumed run
    assert again.size() == log.size() and again.tail(len(lines[-1])) == lines[-1]
    again.append(b'{"step": 41, "tor')
    again.truncate(log.size())
    again.append(lines[0])
    assert paths.read_bytes(url) == b"".join(lines + lines[:1])

    def refuse(path, paths_, **kw):
        raise RuntimeError("compose refused")

    monkeypatch.setattr(again.fs, "merge", refuse)
    with pytest.raises(OSError, match="compose refused"):
        again.append(b"lost\n")
    assert paths.read_bytes(url) == b"".join(lines + lines[:1]) and again.size() == len(b"".join(lines + lines[:1]))
