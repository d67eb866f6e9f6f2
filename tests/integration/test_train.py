"""Training: the schedule, the step budget, equal losses across meshes, accumulation,
restoring a checkpoint onto another mesh, and the data opened and checked once at start-up."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, run_steps, tiny_config
from onona_jax import config, summary
from onona_jax.train import optimizer as optim
from onona_jax import train as trainer
from onona_jax.data import pipeline


def test_wsd_schedule_values():
    s = optim.wsd(peak=1e-3, final=1e-4, warmup=1000, total=21_740, decay_fraction=0.2)
    decay_start = 21_740 - round(0.2 * 21_740)
    assert float(s(0)) == pytest.approx(1e-6)  # first step: 1/warmup of the peak
    assert float(s(999)) == pytest.approx(1e-3)  # end of warmup: the peak
    assert float(s(decay_start - 1)) == pytest.approx(1e-3)
    assert float(s(decay_start)) == pytest.approx(1e-3)  # decay starts from the peak
    assert float(s(decay_start + 1)) < 1e-3
    assert float(s(21_739)) == pytest.approx(1e-4)  # last step: the final rate


def test_clip_by_global_norm_is_optax_in_one_pass():
    """Our clip equals optax.clip_by_global_norm (exactly when it does not clip, to 2 ulp when it
    does: a multiply by max/‖g‖ against optax's g/‖g‖·max), has optax's state, and its AdamW
    update touches a [V, d] leaf in three passes (μ, ν, the weight) where optax's makes a fourth
    for the quotient."""
    import optax

    from onona_jax.aot.hlo import materialised_arrays

    rng = np.random.default_rng(0)
    params = {"table": jnp.asarray(rng.standard_normal((512, 64)), jnp.float32), "norm": jnp.ones(64)}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)  # ‖g‖ ≈ 181
    for max_norm in (1.0, 1e4):  # clips; does not
        ours, theirs = optim.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
        assert jax.tree.structure(ours.init(params)) == jax.tree.structure(theirs.init(params))
        a, b = ours.update(grads, ours.init(params))[0], theirs.update(grads, theirs.init(params))[0]
        for k in params:
            if max_norm > 1e3:
                np.testing.assert_array_equal(a[k], grads[k])
            np.testing.assert_allclose(a[k], b[k], rtol=2.4e-7, atol=0)
        assert abs(float(optax.global_norm(a)) - min(max_norm, float(optax.global_norm(grads)))) < 1e-4 * max_norm

    def table_passes(clip):  # the buffers of the table's shape the compiled update writes
        tx = optax.chain(clip, optax.adamw(1e-3, weight_decay=0.1))
        step = jax.jit(lambda p, s, g: tx.update(g, s, p))
        hlo = step.lower(params, tx.init(params), grads).compile().as_text()
        return sum(shape == "f32[512,64]" for shape, _ in materialised_arrays(hlo))

    assert table_passes(optim.clip_by_global_norm(1.0)) == 3 < table_passes(optax.clip_by_global_norm(1.0))


@pytest.mark.parametrize("size,steps", [("142m", 21_740), ("330m", 50_349)])
def test_token_budget_steps(size, steps):
    for head in ("standard", "twin"):  # the twin arm gets the Dense Standard budget too
        cfg = config.load(os.path.join(REPO, f"configs/paper.py:dense-{size}-{head}"))
        assert summary.budget(cfg)["steps"] == steps


# Pure FSDP and 2 × 2 × 2 are slow: suite-time margin (cover for 2 × 2 × 2: test_families).
@pytest.mark.parametrize("meshes", [[(1, 2, 4)], pytest.param([(1, 8, 1), (2, 2, 2)], marks=pytest.mark.slow)],
                         ids=["124", "181-222"])
def test_equal_losses_across_meshes(tiny_data, meshes):
    results = {}
    for mesh in [(8, 1, 1)] + meshes:
        cfg = tiny_config(tiny_data)
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh
        losses, state, run = run_steps(cfg)
        results[mesh] = losses
        if mesh == (1, 2, 4):  # parameters are sharded as the rules say
            p = state["params"]
            fsdp = ("fsdp", "expert")  # the expert axis shards non-expert weights like fsdp
            assert p["head"]["A"].sharding.spec == jax.sharding.PartitionSpec("tensor", fsdp)
            assert p["trunk"]["layers"]["attn"]["q"].sharding.spec == jax.sharding.PartitionSpec(None, fsdp, "tensor", None)
            assert p["trunk"]["layers"]["mlp"]["down"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", fsdp)
            assert p["trunk"]["final_norm"]["weight"].sharding.spec == jax.sharding.PartitionSpec(None)
            shard = p["head"]["A"].addressable_shards[0].data.shape
            assert shard == (50304 // 4, 64 // 2)
    ref = results[(8, 1, 1)]
    assert ref[2] < ref[0]  # it learns
    for mesh, losses in results.items():
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=str(mesh))


@pytest.mark.parametrize("packing", ["windows", "documents"])
def test_accumulation_equals_one_big_batch(tiny_data, packing):
    """4 micro-batches of 2 give the same loss and gradient (the update before AdamW's
    normalisation, which amplifies rounding where |g| ~ eps) as one batch of 8. Packed, the
    micro-batches keep different numbers of targets (eots placed so), and the loss is still
    the global batch's mean over its kept targets, not a mean of micro-batch means."""
    out = {}
    for micro in (8, 2):
        cfg = tiny_config(tiny_data, micro_batch=micro)
        cfg.mesh.data = 1
        cfg.data.packing = packing
        run = trainer.setup(cfg, jax.devices()[:1])
        params = trainer.init_state(run, cfg.seed)["params"]
        batch = next(pipeline.train_batches(cfg.data.dir, cfg.data.seq_len, cfg.train.global_batch))
        if packing == "documents":  # row r holds r eots: micro-batch a (rows a, a+4) keeps 2a+4 fewer
            batch = np.array(batch)
            for r in range(batch.shape[0]):
                batch[r, 3 : 3 + 5 * r : 5] = run.eot
        out[run.accum] = jax.jit(lambda p, b: trainer.accumulated_grads(run, p, b))(params, batch)
    (l1, _, g1), (l4, _, g4) = out[1], out[4]
    np.testing.assert_allclose(l4, l1, rtol=1e-6)  # 1e-6 absolute is below fp32 resolution at 10.8
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g1, g4)
    assert max(jax.tree.leaves(diffs)) < 1e-6
    assert max(jax.tree.leaves(jax.tree.map(lambda g: float(jnp.max(jnp.abs(g))), g1))) > 1e-3


@pytest.mark.slow  # suite-time margin (cover: the scanned-equals-unscanned tests of test_moe, test_gdn, test_attnres)
def test_scan_and_loop_train_identically(tiny_data):
    scan = tiny_config(tiny_data)
    loop = tiny_config(tiny_data)
    loop.model.scan_layers = False
    dev = jax.devices()[:1]
    for c in (scan, loop):
        c.mesh.data = 1
    np.testing.assert_allclose(run_steps(loop, 2, dev)[0], run_steps(scan, 2, dev)[0], rtol=1e-6)


@pytest.mark.slow  # suite-time margin (an 8-device run restored onto one device: test_tasks.py)
def test_checkpoint_restores_on_another_mesh(tiny_data, tmp_path):
    from onona_jax.eval import validation as evaluation

    cfg = tiny_config(tiny_data, steps=4, checkpoint_every=2)
    cfg.mesh.data = 8
    result = trainer.train(cfg, str(tmp_path), progress=False)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    for mesh, devices in [((1, 1, 1), jax.devices()[:1]), ((1, 2, 4), None), ((2, 4, 1), None)]:
        ev = evaluation.validation(str(tmp_path), mesh=mesh, devices=devices)
        assert ev["step"] == 4
        for key in ("val_loss", "val_loss_a_only", "val_loss_b_only"):
            assert ev[key] == pytest.approx(result[key], rel=1e-5), (mesh, key)


def test_metrics_log_causal_and_full_square_mfu_and_time_apart(tiny_data, tmp_path):
    """With a known peak, each logged step carries MFU counted causally (half the T × T square)
    and PaLM's full-square MFU, in exactly the ratio of the two FLOP counts; the interval that
    closes with the first step's compile, a validation or a save logs those seconds apart."""
    import json

    from onona_jax import summary

    cfg = tiny_config(tiny_data, steps=4, eval_every=2, checkpoint_every=2, peak_tflops=1.0)
    cfg.mesh.data = 1
    trainer.train(cfg, str(tmp_path), devices=jax.devices()[:1], progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r and "tokens_per_s" in r]
    f = summary.flops_per_token(cfg.model, cfg.data.seq_len)
    assert f["train"] < f["train_full_square"]
    for r in steps:
        assert r["mfu_full_square"] / r["mfu"] == pytest.approx(f["train_full_square"] / f["train"], rel=1e-12)
    assert steps[0]["step"] == 1 and steps[0]["compile_s"] > 0
    assert any("validation_s" in r for r in steps) and any("checkpoint_s" in r for r in steps)
    assert not any("compile_s" in r for r in steps[1:])


class _StartedUp(Exception):
    """Raised where the first train step would compile: the start-up is over."""


@pytest.mark.parametrize("where", ["local", "bucket-stream"])
def test_training_data_opened_and_checked_once(tiny_data, tmp_path, monkeypatch, request, where):
    """Before step 1, `train` reads the data dir's manifest once, scans each local shard's token
    ids once (the train split's against model.vocab_size too), and reads the held-out windows
    once; a bucket data dir read by streaming (no scan: each block is checked as it is read)
    is asked for its manifest once (the data's identity, recorded in the workdir, comes from it)."""
    from pathlib import Path

    from onona_jax.data import storage
    from onona_jax.data.prepare import prepare
    from onona_jax.train import loop

    cfg = tiny_config(tiny_data, "standard")
    if where == "bucket-stream":
        cfg.data.update(dir=f"{request.getfixturevalue('fake_gcs')}/data", bucket_read="stream")
        prepare([str(Path(tiny_data).parent / "austen_head.txt")], cfg.data.dir, heldout_fraction=0.1, block_bytes=64)
    manifest = storage.read_manifest(cfg.data.dir)[1]
    shards = sorted(s["file"] for split in ("train", "heldout") for s in manifest["splits"][split]["shards"]
                    if s["tokens"])
    scanned, parsed, vocab = [], [], []
    check_ids, parse = pipeline.TokenStore._check_ids, storage.parse_manifest

    def counting_check(self, arr, path):
        scanned.append(Path(path).name)
        vocab.append(self.vocab_size)
        return check_ids(self, arr, path)

    def counting_parse(*args):
        parsed.append(args[1])
        return parse(*args)

    def started(run):
        raise _StartedUp

    monkeypatch.setattr(pipeline.TokenStore, "_check_ids", counting_check)
    monkeypatch.setattr(storage, "parse_manifest", counting_parse)
    monkeypatch.setattr(loop, "make_train_step", started)
    workdir = tmp_path / "run"
    with pytest.raises(_StartedUp):
        loop.train(cfg, str(workdir), progress=False)
    assert len(parsed) == 1, parsed
    assert sorted(scanned) == (shards if where == "local" else []), scanned
    assert set(vocab) <= {min(cfg.model.vocab_size, manifest["vocab"])}
