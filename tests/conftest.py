"""Every test process sees 8 CPU devices, so sharding tests run on a real (fake) mesh.
The flag must be set before jax is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import lzma  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A prepared data dir from the first ~300 KB of the bundled corpus (fast to tokenize)."""
    from onona_jax.data.prepare import prepare
    from onona_jax.tokenizer import bundled_corpus_path

    root = tmp_path_factory.mktemp("tiny_data")
    src = root / "austen_head.txt"
    with lzma.open(bundled_corpus_path(), "rt") as f:
        src.write_text(f.read(300_000))
    out = root / "data"
    prepare([str(src)], str(out), heldout_fraction=0.1)
    return str(out)


def tiny_config(data_dir: str, head: str = "twin", **train):
    """A tiny model whose heads (8, KV 4) and widths divide every mesh axis up to 8."""
    from onona_jax import config

    cfg = config.load(os.path.join(REPO, f"configs/paper.py:dense-tiny-{head}"))
    cfg.model.update(n_heads=8, n_kv_heads=4, head_dim=8)
    cfg.train.update(global_batch=8, micro_batch=1, steps=3, log_every=1, eval_every=1000,
                     checkpoint_every=1000, warmup_steps=2)
    cfg.train.update(**train)
    cfg.data.update(dir=data_dir, seq_len=32)
    cfg.eval.update(windows=8, batch=8)
    return config.validate(cfg)


def run_steps(cfg, n_steps=3, devices=None):
    """Losses of the first n train steps (the step `trainer.train` runs, no context needed:
    it carries the mesh's activation rules itself), the final state and the run."""
    import numpy as np

    from onona_jax import trainer
    from onona_jax.data import pipeline

    run = trainer.setup(cfg, devices)
    state = trainer.init_state(run, cfg.seed)
    step = trainer.make_train_step(run)
    batches = pipeline.train_batches(cfg.data.dir, cfg.data.seq_len, cfg.train.global_batch)
    losses = []
    for _ in range(n_steps):
        state, m = step(state, trainer.global_batch(run, next(batches)))
        losses.append(float(m["loss"]))
    return np.array(losses), state, run
