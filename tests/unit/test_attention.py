"""The attention backends (`onona_jax/attention.py`) against XLA's attention, on this CPU:
splash runs its Pallas TPU kernel in interpret mode, so the kernel's own code (blocks, masks
skipped, online softmax, the dq and dkv backward kernels) is what is checked.

Tolerances: fp32 throughout. Splash sums the key axis block by block with an online softmax
(running max and rescaling) where XLA sums it whole, so values and gradients differ by fp32
rounding of sums over up to T terms: 1e-5 of the array's largest magnitude (values are of order
one; gradients, weighted by N(0, 1) output weights, reach about 10, where one fp32 ulp is 1e-6
and the CPU's vector width changes the summation order).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, run_steps, tiny_config
from onona_jax import attention, config, sharding


def _qkvw(B, T, N, K, H, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(s, np.float32)) for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]]


def _close(ours, reference):
    reference = np.asarray(reference)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5 * max(1.0, float(np.abs(reference).max())))


def _grads(impl, q, k, v, w):
    return jax.jit(jax.grad(lambda q, k, v: (attention.causal_attention(q, k, v, impl) * w).sum(), (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("T", [64, 200, 256, pytest.param(1100, marks=pytest.mark.slow)])  # 1100: suite-time margin
def test_xla_on_cpu_computes_query_blocks_equal_to_the_whole_square(T):
    """`xla` on the CPU: blocks of query rows against only the keys they see. Values and
    gradients equal `jax.nn.dot_product_attention` over the whole T × T matrix to 1e-5 of the
    largest (fp32 sums in another order), for one block (64), a partial last block (200), four
    (256) and more than 16 blocks of 64 (1,100: 16 blocks of 69); and no block computes the
    whole square: the largest score matrix of T = 256 is 64 × 256, the last block's."""
    q, k, v, w = _qkvw(2, T, 4, 2, 16)
    whole = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.25, implementation="xla")  # noqa: E731
    _close(attention.causal_attention(q, k, v, "xla"), whole(q, k, v))
    ref = jax.grad(lambda q, k, v: (whole(q, k, v) * w).sum(), (0, 1, 2))(q, k, v)
    for ours, theirs in zip(_grads("xla", q, k, v, w), ref):
        _close(ours, theirs)
    if T == 256:
        hlo = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, "xla")).lower(q, k, v).as_text()
        assert "256x256xf32" not in hlo and "64x256xf32" in hlo


@pytest.mark.parametrize("T,H", [(300, 64), (128, 128)])
def test_splash_matches_xla_values_and_gradients(T, H):
    """Causal GQA (8 query heads over 2 KV heads). T = 300 pads to 384 in three blocks of 128
    (a partial last block, the masked upper blocks skipped); T = 128 is one block at hd 128."""
    q, k, v, w = _qkvw(2, T, 8, 2, H)
    assert attention.splash_block(T) == ((128, 384) if T == 300 else (128, 128))
    splash = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, "splash"))(q, k, v)
    xla = attention.causal_attention(q, k, v, "xla")
    _close(splash, xla)
    for g_s, g_x in zip(_grads("splash", q, k, v, w), _grads("xla", q, k, v, w)):
        _close(g_s, g_x)


def test_splash_sharded_on_eight_devices_matches_xla():
    """Under a data 2 × fsdp 2 × tensor 2 mesh splash runs per device inside shard_map: rows
    over data and fsdp, heads (4 of 8, KV 1 of 2) over tensor. Same values and gradients."""
    q, k, v, w = _qkvw(4, 160, 8, 2, 64, seed=1)
    mesh = sharding.make_mesh(2, 2, 2)
    with sharding.activation_rules(mesh):
        out = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, "splash"))(q, k, v)
        grads = _grads("splash", q, k, v, w)
        hlo = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, "splash")).lower(q, k, v).as_text()
    assert "shard_map" in hlo or "manual" in hlo.lower()
    _close(out, attention.causal_attention(q, k, v, "xla"))
    for g_s, g_x in zip(grads, _grads("xla", q, k, v, w)):
        _close(g_s, g_x)


def test_auto_picks_the_kernel_of_the_mesh_devices():
    """`auto` is XLA on this CPU; a named kernel the devices cannot run is an error naming the
    fix, raised by trainer.setup before anything compiles."""
    from onona_jax import train as trainer

    assert attention.resolve("auto", jnp.float32) == "xla" and attention.resolve(None, jnp.bfloat16) == "xla"
    assert attention.resolve("splash", jnp.float32) == "splash"  # interpret mode on a CPU
    with pytest.raises(ValueError, match=r"'cudnn' needs an NVIDIA GPU.*here: cpu"):
        attention.resolve("cudnn", jnp.bfloat16)
    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
    cfg.model.attention_impl = "cudnn"
    with pytest.raises(ValueError, match="use model.attention_impl=auto or xla"):
        trainer.setup(cfg, jax.devices()[:1])


@pytest.mark.slow  # suite-time margin (cover: test_splash_matches_xla_values_and_gradients, test_splash_sharded_on_eight_devices_matches_xla)
def test_a_tiny_run_with_splash_trains_as_xla(tiny_data):
    """Three train steps of the tiny twin model (4 heads over 2 KV heads of 64 dims, 32 tokens
    padded to one block of 128) on a 2 × 2 × 2 mesh: the losses of splash (interpret) equal
    XLA's to 1e-5 relative (fp32 rounding through the step, as above)."""
    losses = {}
    for impl in ("xla", "splash"):
        cfg = tiny_config(tiny_data)
        cfg.model.update(n_heads=4, n_kv_heads=2, head_dim=64, attention_impl=impl)
        cfg.mesh.update(data=2, fsdp=2, tensor=2)
        losses[impl], _, _ = run_steps(config.validate(cfg))
    np.testing.assert_allclose(losses["splash"], losses["xla"], rtol=1e-5)
    assert losses["xla"][-1] < losses["xla"][0]


def _saved_shapes(remat):
    """Shapes of the residuals one unscanned tiny dense block keeps for its backward pass."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

    from onona_jax import layers, models

    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
    cfg.model.update(n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, scan_layers=False, n_layers=1, remat=remat)
    graphdef, params = models.init(cfg.model, 0)
    model = models.bind(graphdef, params)
    block = model.trunk.layers[0]
    x = jnp.ones((2, 12, cfg.model.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    fn = layers.checkpointed(lambda x: block(x, pos)[0], remat)
    return [tuple(aval.shape) for aval, _ in saved_residuals(lambda x: fn(x).sum(), x)]


def test_remat_attention_keeps_qkv_and_attention_output_not_the_mlp():
    """`model.remat=attention` keeps q, k, v (after QK-norm and RoPE) and the attention output,
    and none of the MLP's [B, T, d_ff] activations, which `none` keeps."""
    kept = _saved_shapes("attention")
    assert (2, 12, 4, 16) in kept and (2, 12, 2, 16) in kept  # q (and the attention output), k, v
    assert (2, 12, 96) not in kept
    assert (2, 12, 96) in _saved_shapes("none")


@pytest.mark.slow  # suite-time margin (cover: test_remat_attention_keeps_qkv_and_attention_output_not_the_mlp)
def test_remat_policies_train_as_none(tiny_data):
    """Every remat policy computes the same step (recomputation repeats the same fp32 ops):
    three steps' losses equal `none`'s to 1e-6 relative."""
    losses = {}
    for policy in ("none", "attention", "attention_offload", "dots", "full"):
        cfg = tiny_config(tiny_data)
        cfg.model.remat = policy
        losses[policy], _, _ = run_steps(config.validate(cfg), devices=jax.devices()[:1])
    for policy in ("attention", "attention_offload", "dots", "full"):
        np.testing.assert_allclose(losses[policy], losses["none"], rtol=1e-6, err_msg=policy)


def test_blocked_is_retired_but_old_runs_still_load(capsys):
    """`blocked` (query blocks in plain XLA: no faster than XLA on CPU, superseded by splash and
    cuDNN) is refused for a new config with the way forward; a run saved with it loads as `xla`
    (the same attention to fp32 rounding), with a notice."""
    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
    cfg.model.attention_impl = "blocked"
    with pytest.raises(ValueError, match="'blocked' was retired.*use auto"):
        config.validate(cfg)
    loaded = config.from_saved(cfg.to_dict(), "runs/old")
    assert loaded.model.attention_impl == "xla"
    assert "'blocked', which was retired; using 'xla'" in capsys.readouterr().err
