"""The fused mixture loss (`loss.mixture_nll`: gradients in the forward pass, tiled
over tokens) against plain autodiff (`plain_mixture_nll`): values and gradients for every
head's mixture, unsharded and on an 8-device mesh with the vocabulary on 4 devices; every
head module's `nll` fused against plain; the compiled MoS train step holds no
[tokens, V] fp32 buffer, nor the one-table ablation's validation step (model.loss_token_tile).

Tolerances (fp32, `jax_default_matmul_precision=highest`): loss within 1e-5 relative; a
gradient within 1e-5 × its largest entry, elementwise (test_loss_vocab.py's docstring explains
why the bound is relative to scale); log p within 1e-5 absolute. Measured: ≤ 6e-7.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from onona_jax import heads, sharding
from onona_jax import loss as fm
from reference import jax_math as ref
from onona_jax import train as trainer

N, D, V, K = 40, 16, 96, 2  # 40 tokens: token tiles of 16 leave a padded last tile
MESH = (2, 1, 4)  # (data, fsdp, tensor): tokens on 2 devices, vocabulary rows on 4
TOL = 1e-5


def inputs(seed=0, gate_scale=1.0):
    k = jax.random.split(jax.random.key(seed), 8)
    h = jax.random.normal(k[0], (N, D))
    hk = jax.random.normal(k[1], (N, K, D))
    A = 0.3 * jax.random.normal(k[2], (V, D))
    B = 0.3 * jax.random.normal(k[3], (V, D))
    z = gate_scale * jax.random.normal(k[4], (N,))
    gate = jnp.stack([jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)], -1)
    prior = jax.nn.log_softmax(2.0 * jax.random.normal(k[5], (N, K)), -1)
    y = jax.random.randint(k[6], (N,), 0, V)
    w = jax.random.uniform(k[7], (N,)) * (jnp.arange(N) % 5 != 0)  # masked tokens: weight 0
    return dict(h=h, hk=hk, A=A, B=B, z=z, gate=gate, prior=prior, y=y, w=w)


# Every head's mixture: (hs, tables, log_weights, score) from the inputs.
MIXTURES = {
    "standard": lambda x: (x["h"], (x["A"],), None, None),  # also untied / input_gate / factorial cells
    "twin": lambda x: (x["h"], (x["A"], x["B"]), x["gate"], None),
    "mos": lambda x: (x["hk"], (x["A"],), x["prior"], None),
    "moss": lambda x: (x["hk"], (x["A"],), x["prior"], "sigsoftmax"),
    "sigsoftmax": lambda x: (x["h"], (x["A"],), None, "sigsoftmax"),
}


def value_and_grads(fn, hs, tables, lw, y, w):
    argnums = (0, 1) if lw is None else (0, 1, 2)
    (loss, logp), grads = jax.jit(jax.value_and_grad(fn, argnums, has_aux=True))(hs, tables, lw, y, w)
    return loss, logp, jax.tree.leaves(grads)


@functools.cache
def reference(name, seed=0, gate_scale=1.0):
    hs, tables, lw, score = MIXTURES[name](inputs(seed, gate_scale))
    x = inputs(seed, gate_scale)
    return value_and_grads(lambda *a: ref.plain_mixture_nll(*a, score=score), hs, tables, lw, x["y"], x["w"])


def assert_matches(got, ref):
    loss, logp, grads = got
    loss_r, logp_r, grads_r = ref
    assert abs(float(loss) - float(loss_r)) <= TOL * abs(float(loss_r)), (float(loss), float(loss_r))
    np.testing.assert_allclose(logp, logp_r, rtol=0, atol=TOL)
    assert len(grads) == len(grads_r)
    for g, r in zip(grads, grads_r):
        assert g.shape == r.shape and float(jnp.max(jnp.abs(r))) > 0
        err = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
        assert err <= TOL, err


def fused_case(name, layout=None, tile=16, seed=0, gate_scale=1.0):
    x = inputs(seed, gate_scale)
    hs, tables, lw, score = MIXTURES[name](x)
    fn = lambda *a: fm.mixture_nll(*a, score=score, token_tile=tile, layout=layout)  # noqa: E731
    return value_and_grads(fn, hs, tables, lw, x["y"], x["w"])


@pytest.mark.parametrize("name", list(MIXTURES))
def test_mixture_fused_equals_plain(name):
    assert_matches(fused_case(name), reference(name))


def test_twin_saturated_gate():
    """|z| up to ~60: logσ(−z) ≈ −60 for many tokens; posteriors and ∂lw stay exact."""
    x = inputs(1, gate_scale=30.0)
    assert float(jnp.max(jnp.abs(x["z"]))) > 40
    got = fused_case("twin", seed=1, gate_scale=30.0)
    assert all(bool(jnp.isfinite(g).all()) for g in got[2])
    assert_matches(got, reference("twin", 1, 30.0))


@pytest.mark.parametrize("name", ["twin"])  # every head runs on this mesh in test_head_nll_fused_equals_plain
def test_mixture_fused_sharded_vocabulary(name):
    """Mesh (data 2, fsdp 1, tensor 4): each device holds 24 of the 96 rows and 20 tokens
    (tiles of 8: a padded last tile); statistics combine across the vocab axis."""
    mesh = sharding.make_mesh(*MESH)
    layout = (mesh, ("data", "fsdp"), "tensor")
    got = fused_case(name, layout, tile=8)
    assert_matches(got, reference(name))
    table_grad = got[2][1]
    assert table_grad.sharding.spec[0] == "tensor"  # table gradients stay vocabulary-sharded


def test_gradient_through_log_p_falls_back_to_plain():
    """log p is for evaluation; a gradient through it is still correct (plain autodiff)."""
    x = inputs(2)
    args = MIXTURES["twin"](x)[:3]
    f = lambda h: jnp.sum(x["w"] * fm.mixture_nll(h, *args[1:], x["y"], x["w"], token_tile=16)[1])  # noqa: E731
    g = lambda h: jnp.sum(x["w"] * fm.plain_log_probs(h, *args[1:], x["y"]))  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.grad(f))(args[0]), jax.jit(jax.grad(g))(args[0]), rtol=0, atol=1e-6)


def test_mixture_log_probs_gather_to_target():
    """The full-distribution reference agrees with the target path and normalises."""
    x = inputs(3)
    hs, tables, lw, score = MIXTURES["moss"](x)
    full = jax.jit(functools.partial(ref.mixture_log_probs, score=score))(hs, tables, lw)
    np.testing.assert_allclose(jnp.exp(full).sum(-1), 1.0, atol=1e-5)
    nll = jax.jit(functools.partial(fm.mixture_nll, score=score, token_tile=16))
    tgt = nll(hs, tables, lw, x["y"], x["w"])[1]
    np.testing.assert_allclose(full[jnp.arange(N), x["y"]], tgt, rtol=0, atol=1e-5)


def test_mixture_rejects_bad_arguments():
    x = inputs()
    with pytest.raises(ValueError, match="None exactly when K = 1"):
        fm.mixture_nll(x["h"], (x["A"], x["B"]), None, x["y"], x["w"])
    with pytest.raises(ValueError, match="score"):
        fm.mixture_nll(x["h"], (x["A"],), None, x["y"], x["w"], score="sparsemax")


# ----------------------------------------------------------------------------- head modules


HEADS = ("standard", "twin", "untied", "mos", "moss", "sigsoftmax", "input_gate")


def head_module(head, loss):
    cfg = ml_collections.ConfigDict(dict(vocab_size=V, d_model=D, loss=loss, loss_chunk=32,
                                         loss_token_tile=16, mos_components=K, head=head))
    m = heads.make_head(cfg)
    graphdef, state = nnx.split(m)
    rng = np.random.default_rng(len(head))
    params = jax.tree.map(lambda p: jnp.asarray(0.3 * rng.standard_normal(p.shape), jnp.float32), state)
    return graphdef, params


@pytest.mark.parametrize("head", HEADS)
def test_head_nll_fused_equals_plain(head):
    """Each head's `nll` (its mixture through the fused loss) against its plain path: loss,
    per-token log p and gradients w.r.t. every head weight, h and x0; the fused one on the
    (2, 1, 4) mesh's layout (`sharding.loss_layout`), the plain one on one device."""
    x = inputs(4)
    h, x0 = x["h"].reshape(4, 10, D), 0.02 * x["hk"][:, 0].reshape(4, 10, D)
    y, w = x["y"].reshape(4, 10), x["w"].reshape(4, 10)
    out = {}
    for loss in ("plain", "fused"):
        graphdef, params = head_module(head, loss)

        layout = sharding.loss_layout(sharding.make_mesh(*MESH)) if loss == "fused" else None

        def f(params, h, x0):
            return nnx.merge(graphdef, params).nll(h, x0, y, w, layout)

        fn = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))
        if loss == "fused":
            jaxpr = str(jax.make_jaxpr(fn)(params, h, x0))
            (value, logp), grads = fn(params, h, x0)
            assert "shard_map" in jaxpr
        else:
            (value, logp), grads = fn(params, h, x0)
        out[loss] = (value, logp.reshape(-1), jax.tree.leaves(grads))
    # heads without a gate ignore x0: its gradient is exactly zero on both paths
    got, ref = out["fused"], out["plain"]
    gate = head in ("twin", "twin_output_only")
    drop = lambda g: [a for a in g if gate or float(jnp.max(jnp.abs(a))) > 0]  # noqa: E731
    assert len(drop(got[2])) == len(drop(ref[2]))
    assert_matches((got[0], got[1], drop(got[2])), (ref[0], ref[1], drop(ref[2])))


# ----------------------------------------------------------------------------- memory


def mos_step_temp_bytes(data_dir, loss):
    """XLA's temporary bytes of the compiled tiny MoS train step, 16 × 64 tokens, one device."""
    cfg = tiny_config(data_dir, "mos", global_batch=16, micro_batch=0)
    cfg.mesh.data = 1
    cfg.data.seq_len = 64
    cfg.model.update(loss=loss, loss_token_tile=64)
    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.abstract_train_state(run)
    batch = jax.ShapeDtypeStruct((16, 65), jnp.int32, sharding=run.batch_sharding)
    return trainer.make_train_step(run).lower(state, batch).compile().memory_analysis().temp_size_in_bytes


ONE_LOGITS = 16 * 64 * 50304 * 4  # one [1,024 tokens, V] fp32 buffer: 206 MB


def test_mos_train_step_holds_no_token_by_vocab_buffer(tiny_data):
    """The compiled fused MoS train step (tiny model, 16 × 64 = 1,024 tokens, V = 50,304,
    K = 2, token tile 64) needs less temporary memory than half of ONE [tokens, V] fp32
    buffer, so none exists (measured: 81 MB, against 206 MB for one buffer; the plain MoS
    step needs 866 MB, see the slow test below)."""
    temp = mos_step_temp_bytes(tiny_data, "fused")
    assert temp < 0.5 * ONE_LOGITS, temp


@pytest.mark.slow
def test_mos_memory_bound_separates_plain(tiny_data):
    """The bound above can fail: the plain MoS step holds K [tokens, V] logits and their
    gradients. Run: pytest -m slow tests/unit/test_loss.py"""
    temp = {loss: mos_step_temp_bytes(tiny_data, loss) for loss in ("fused", "plain")}
    assert temp["fused"] < 0.5 * ONE_LOGITS < 2 * ONE_LOGITS < temp["plain"], temp


def ablation_eval_step(data_dir, **model):
    """The validation step of the twin head's one-table ablation `a_only` (`validation.make_eval_step`),
    tiny model, one device, 4 windows of 64 tokens, and its run."""
    from onona_jax.eval import validation

    cfg = tiny_config(data_dir, "twin")
    cfg.mesh.data = 1
    cfg.data.seq_len = 64
    cfg.model.update(**model)
    run = trainer.setup(cfg, jax.devices()[:1])
    return validation.make_eval_step(run.graphdef, run.mesh, run.param_shardings, "a_only"), run


ONE_TILE = 256 * 50304 * 4  # one [256 tokens, V] fp32 buffer: the default tile, and all 4 × 64 tokens


def test_ablation_validation_honours_the_loss_token_tile(tiny_data):
    """The one-table ablation's validation tiles its loss by model.loss_token_tile, as the main
    validation does: with 16-token tiles its compiled step over 4 × 64 = 256 tokens needs less
    temporary memory than half of one [256 tokens, V] fp32 buffer, so none exists; with the
    default 256-token tile one tile is such a buffer, and the bound fails (it did for every tile
    while the ablation ignored the key). Its NLL equals the plain (untiled) loss's to fp32
    tolerance. (Measured: 3.3 MB with 16-token tiles, 51.6 MB with 256; the NLLs equal.)"""
    from onona_jax.data import pipeline

    tokens = jnp.asarray(pipeline.validation_windows(tiny_data, 64, 4))
    weights = jnp.ones((4,), jnp.float32)
    temp = {}
    for tile in (16, 256):
        step, run = ablation_eval_step(tiny_data, loss="fused", loss_token_tile=tile)
        params = trainer.abstract_train_state(run)["params"]
        abstract = (params, jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=run.batch_sharding),
                    jax.ShapeDtypeStruct(weights.shape, weights.dtype))
        temp[tile] = step.lower(*abstract).compile().memory_analysis().temp_size_in_bytes
    assert temp[16] < 0.5 * ONE_TILE < ONE_TILE < temp[256], temp

    params = trainer.init_state(run, 0)["params"]
    plain, _ = ablation_eval_step(tiny_data, loss="plain")
    tiled, _ = ablation_eval_step(tiny_data, loss="fused", loss_token_tile=16)
    got, count = tiled(params, tokens, weights)
    want, _ = plain(params, tokens, weights)
    assert float(count) == 256
    np.testing.assert_allclose(float(got), float(want), rtol=TOL)


def test_token_tile_auto_is_the_platform_of_the_mesh_devices():
    """model.loss_token_tile = 0 is 512 tokens where the step compiles for the CPU (GEMM
    efficiency of the ∂T product) and 256 for a TPU slice (HBM), decided by the devices of the
    mesh the step is traced under, so a deviceless TPU compile on this CPU gets the TPU's tile;
    a positive value is kept and a negative one is an error naming the fix."""
    from onona_jax.aot.topology import get_slice, libtpu_missing, topology_devices

    assert fm.resolve_token_tile(0) == fm.CPU_TOKEN_TILE == 512  # outside any mesh: the default backend
    assert fm.resolve_token_tile(48) == 48
    with pytest.raises(ValueError, match="or 0 for the platform's default"):
        fm.resolve_token_tile(-1)
    with sharding.activation_rules(sharding.make_mesh(1, 1, 1, jax.devices()[:1])):
        assert fm.resolve_token_tile(0) == 512
    if libtpu_missing() is not None:
        pytest.skip(f"libtpu missing: {libtpu_missing()}")
    tpu = sharding.make_mesh(1, 4, 1, topology_devices(get_slice("v5e-4")))
    with sharding.activation_rules(tpu):
        assert fm.resolve_token_tile(0) == fm.ACCELERATOR_TOKEN_TILE == 256
        assert fm.resolve_token_tile(512) == 512
