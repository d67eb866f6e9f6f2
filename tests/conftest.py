"""Every test process sees 8 CPU devices, so sharding tests run on a real (fake) mesh.
The flag must be set before jax is imported anywhere."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, in a temporary directory, never the user's
# (train.compile_cache's default, onona_jax/compile_cache.py, reads ONONA_COMPILE_CACHE): in-process
# runs and train.py subprocesses that compile a program already compiled load it (on
# test_train, test_families, test_attention and test_tasks: 543 s -> 462 s). The tests of the
# cache give a directory of their own. Subprocesses inherit both variables.
_JAX_CACHE = tempfile.mkdtemp(prefix="onona-tests-jax-cache-")
atexit.register(shutil.rmtree, _JAX_CACHE, True)
os.environ["ONONA_COMPILE_CACHE"] = _JAX_CACHE
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)  # what jax reads at import

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import lzma  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A prepared data dir from the first ~300 KB of the bundled corpus (fast to tokenize)."""
    return str(prepare_bundled_head(tmp_path_factory.mktemp("tiny_data"), 300_000, heldout_fraction=0.1)[0])


def prepare_bundled_head(root, chars: int, **prepare_args):
    """The first `chars` characters of the bundled corpus prepared into root/data:
    (that path, the manifest)."""
    from onona_jax.data.prepare import prepare
    from onona_jax.tokenizer import bundled_corpus_path

    src = root / "austen_head.txt"
    with lzma.open(bundled_corpus_path(), "rt") as f:
        src.write_text(f.read(chars))
    return root / "data", prepare([str(src)], str(root / "data"), **prepare_args)


def tiny_config(data_dir: str, head: str = "twin", arch: str = "dense", **train):
    """A tiny model whose heads (8, KV 4) and widths divide every mesh axis up to 8; for
    GDN also 4 GDN heads of 16 dims (tiny has 1 of 64), so they divide the tensor axis too,
    and chunk 8, so the 32-token windows are four chunks that pass the state on."""
    from onona_jax import config

    cfg = config.load(os.path.join(REPO, f"configs/paper.py:{arch}-tiny-{head}"))
    cfg.model.update(n_heads=8, n_kv_heads=4, head_dim=8)
    if arch == "gdn":
        cfg.model.gdn.update(n_heads=4, head_dim_k=16, head_dim_v=16, chunk=8)
    cfg.train.update(global_batch=8, micro_batch=1, steps=3, log_every=1, eval_every=1000,
                     checkpoint_every=1000, warmup_steps=2)
    cfg.train.update(**train)
    cfg.data.update(dir=data_dir, seq_len=32)
    cfg.eval.update(windows=8, batch=8)
    return config.validate(cfg)


def run_steps(cfg, n_steps=3, devices=None, init=None):
    """Losses of the first n train steps (float64; the step `trainer.train` runs, no context
    needed: it carries the mesh's activation rules itself), the final state and the run.
    `init`: a host copy of a train state to start from, placed on this run's mesh, instead
    of `trainer.init_state`."""
    import numpy as np

    from onona_jax import train as trainer
    from onona_jax.data import pipeline

    run = trainer.setup(cfg, devices)
    if init is None:
        state = trainer.init_state(run, cfg.seed)
    else:
        state = jax.device_put(init, run.state_shardings)
    step = trainer.make_train_step(run)
    batches = pipeline.train_batches(cfg.data.dir, cfg.data.seq_len, cfg.train.global_batch)
    losses = []
    for _ in range(n_steps):
        state, m = step(state, trainer.global_batch(run, next(batches)))
        losses.append(m["loss"])
    return np.array(jax.device_get(losses), np.float64), state, run


@pytest.fixture(scope="session")
def _gcs_emulator():
    """One local GCS emulator per test session (tests/fake_gcs.py): GCS clients read their
    endpoint once per process, so the port must not change between tests."""
    pytest.importorskip("gcp_storage_emulator",
                        reason="the fake GCS needs gcp-storage-emulator (`pip install -e '.[test]'`)")
    pytest.importorskip("gcsfs", reason="gs:// paths need gcsfs (`pip install -e '.[gcs]'`)")
    import fake_gcs

    server = fake_gcs.start()
    yield server
    server.stop()


@pytest.fixture
def fake_gcs(_gcs_emulator, monkeypatch):
    """`gs://<a new empty bucket>` on the local emulator; this process and the subprocesses it
    starts (train.py, eval.py) read and write it through epath/gcsfs and Orbax/TensorStore alike."""
    import fake_gcs as fake

    for key, value in fake.env(_gcs_emulator.url).items():  # (set already; kept for a subprocess env=)
        monkeypatch.setenv(key, value)
    bucket = _gcs_emulator.new_bucket()
    yield f"gs://{bucket}"
    _gcs_emulator.empty(bucket)


@pytest.fixture(scope="session")
def bpe_4k(tmp_path_factory):
    """A HF tokenizer folder: byte-level BPE of 4,096 entries trained on the bundled corpus (~1 s)."""
    from bpe import train_bpe

    return train_bpe(tmp_path_factory.mktemp("bpe_4k"), 4096)


@pytest.fixture(scope="session")
def bpe_70k(tmp_path_factory):
    """A HF tokenizer folder: byte-level BPE past 65,536 entries (uint32 shards; ~12 s)."""
    from bpe import train_bpe

    return train_bpe(tmp_path_factory.mktemp("bpe_70k"), 70_000)
