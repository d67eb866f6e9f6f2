"""MoE (SPEC §3): HF Qwen3-MoE parity (block and pooled load-balancing loss), capacity
drops under the (choice, token) priority, dense ⇄ sort dispatch, parameter counts at 142M,
scanned ⇄ unscanned, and a sharded run. fp32 throughout."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import REPO
from onona_jax import config, sharding, summary
from onona_jax import models as model
from onona_jax.models import dense
from onona_jax.models import moe
from onona_jax.params import abstract_state, init_params, logical_axes


def _cfg(spec="moe-tiny-twin", **moe_overrides):
    cfg = config.load(os.path.join(REPO, f"configs/paper.py:{spec}"))
    cfg.model.dtype = "float32"
    cfg.model.moe.update(moe_overrides)
    return config.validate(cfg).model


def _noisy(params, seed, scale=0.1):
    """N(0, scale²) noise on every leaf, so router logits are O(1) (init's 0.02 routes
    almost uniformly) and norm weights are not all ones."""
    leaves, treedef = jax.tree.flatten(params)
    r = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [x + scale * r.standard_normal(x.shape, np.float32) for x in leaves])


@functools.lru_cache(maxsize=None)
def _tiny(scan: bool):
    """The 3-layer tiny MoE model's config and path-keyed init, shared by the model-level
    tests (initialising a model costs seconds of compilation on this CPU)."""
    m = _cfg()
    # A small vocabulary (below what validate allows for training) keeps init cheap; these
    # tests are about the trunk.
    m.update(n_layers=3, scan_layers=scan, vocab_size=1024)
    graphdef, params = model.init(m, 0)
    return m, graphdef, params


def _moe(m, seed=0):
    graphdef, state = abstract_state(lambda: moe.MoE(m))
    return graphdef, _noisy(init_params(state, seed), seed)


def _x(m, B=2, T=37, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, m.d_model)), jnp.float32)


def _hf_block(params, m):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hc = Qwen3MoeConfig(
        hidden_size=m.d_model, moe_intermediate_size=m.moe.d_expert, num_experts=m.moe.n_experts,
        num_experts_per_tok=m.moe.top_k, norm_topk_prob=m.moe.renormalize,
    )
    block = Qwen3MoeSparseMoeBlock(hc).eval()
    # transformers 5.x: router `gate.weight` [E, d]; experts fused as
    # `experts.gate_up_proj` [E, 2f, d] (gate rows first, `.chunk(2)`), `experts.down_proj` [E, d, f].
    p = jax.tree.map(np.asarray, params)
    sd = {
        "gate.weight": p["router"].T,
        "experts.gate_up_proj": np.concatenate([p["gate"], p["up"]], axis=2).transpose(0, 2, 1),
        "experts.down_proj": p["down"].transpose(0, 2, 1),
    }
    assert {k: tuple(v.shape) for k, v in block.state_dict().items()} == {k: v.shape for k, v in sd.items()}
    block.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()})
    return block


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dispatch", ["dense", "sort"])
def test_block_matches_hf_qwen3_moe(renormalize, dispatch):
    # eval capacity 4.0 = E/top_k: C = T, nothing can be dropped (HF never drops).
    m = moe.eval_config(_cfg(renormalize=renormalize, dispatch=dispatch))
    graphdef, params = _moe(m)
    x = _x(m)
    y, aux = nnx.merge(graphdef, params)(x)
    assert float(aux["moe_dropped"]) == 0.0
    with torch.no_grad():
        theirs = _hf_block(params, m)(torch.from_numpy(np.array(x))).numpy()
    np.testing.assert_allclose(np.asarray(y), theirs, rtol=0, atol=1e-5)
    assert np.abs(theirs).max() > 1e-2  # not vacuous


def test_eval_config_and_capacity():
    m = _cfg()
    e = moe.eval_config(m)
    assert (m.moe.capacity_factor, e.moe.capacity_factor) == (1.25, 4.0)
    assert moe.capacity(37, 8, 2, 1.25) == 12  # ceil(1.25·37·2/8) = ceil(11.5625)
    assert moe.capacity(1024, 8, 2, 1.25) == 320
    assert moe.capacity(1024, 8, 2, 4.0) == 1024 and moe.capacity(1024, 8, 2, 100.0) == 1024


def test_pooled_aux_loss_matches_hf():
    """Router logits of every layer of a 3-layer model, recomputed block by block, fed to
    HF's load_balancing_loss_func; ours from the trunk's layer-summed statistics."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    m, graphdef, params = _tiny(scan=False)
    net = model.bind(graphdef, _noisy(params, 0))
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (2, 29))

    @jax.jit
    def run(tokens):
        _, x0, aux = net.forward(tokens)
        positions = jnp.broadcast_to(jnp.arange(29), tokens.shape)
        x, logits = x0, []
        for block in net.trunk.layers:
            mid = x + block.attn(block.attn_norm(x), positions)
            logits.append(moe.route(block.mlp_norm(mid), block.moe.router[...], 2, False)[0].reshape(-1, 8))
            x, _ = block(x, positions)
        return aux, logits

    aux, logits = run(tokens)
    theirs = load_balancing_loss_func(tuple(torch.from_numpy(np.array(l)) for l in logits), 8, 2).item()
    ours = float(moe.load_balancing_loss(aux, 8, 2))
    assert float(aux["moe_layers"]) == 3 and float(aux["moe_tokens"]) == 3 * 2 * 29
    assert float(jnp.sum(aux["moe_assign"])) == 3 * 2 * 29 * 2
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    assert ours > 2.0  # uniform routing gives exactly top_k; noisy routers are imbalanced


def _expected_drops(experts, E, C):
    """Numpy reference of the priority: first choices before second ones, then token order,
    per sequence; returns kept[b, t, j]."""
    B, T, k = experts.shape
    kept = np.zeros((B, T, k), bool)
    for b in range(B):
        load = np.zeros(E, int)
        for j in range(k):
            for t in range(T):
                e = experts[b, t, j]
                kept[b, t, j] = load[e] < C
                load[e] += 1
    return kept


def _swiglu(p, e, x):
    g, u = x @ p["gate"][e], x @ p["up"][e]
    return (g / (1 + np.exp(-g)) * u) @ p["down"][e]


@pytest.mark.parametrize("dispatch", ["dense", "sort"])
def test_capacity_drops_exactly_the_overflow(dispatch):
    m = _cfg(capacity_factor=0.5, dispatch=dispatch, renormalize=True)
    graphdef, params = _moe(m)
    x = _x(m, B=2, T=40)
    y, aux = nnx.merge(graphdef, params)(x)
    _, _, w, experts = moe.route(x, params["router"], 2, True)
    w, experts, xn = map(np.asarray, (w, experts, x))
    p = jax.tree.map(np.asarray, params)
    C = moe.capacity(40, 8, 2, 0.5)
    assert C == 5  # ceil(0.5·40·2/8)
    kept = _expected_drops(experts, 8, C)
    assert 0 < (~kept).sum() and (~kept.any(-1)).sum() > 0  # some tokens lose both choices
    assert float(aux["moe_dropped"]) == (~kept).sum()
    ref = np.zeros_like(xn)
    for b, t, j in zip(*np.nonzero(kept)):
        ref[b, t] += w[b, t, j] * _swiglu(p, experts[b, t, j], xn[b, t])
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-6)
    gone = ~kept.any(-1)
    assert np.all(np.asarray(y)[gone] == 0.0)  # exactly zero, not just small
    stats = moe.router_stats(aux)
    np.testing.assert_allclose(float(stats["drop_fraction"]), (~kept).mean(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["expert_load"]), np.bincount(experts.ravel(), minlength=8) / experts.size, rtol=1e-6)


def test_dropped_tokens_pass_through_the_block():
    m = _cfg(capacity_factor=0.3)
    graphdef, state = abstract_state(lambda: dense.Block(m, model.MIXERS["attention"], model.FEED_FORWARDS["moe"]))
    block = nnx.merge(graphdef, _noisy(init_params(state, 3), 3))
    x = _x(m, B=2, T=40)
    positions = jnp.broadcast_to(jnp.arange(40), (2, 40))

    @jax.jit
    def run(x):
        mid = x + block.attn(block.attn_norm(x), positions)
        out, _ = block(x, positions)
        return mid, out, moe.route(block.mlp_norm(mid), block.moe.router[...], 2, False)[3]

    mid, out, experts = run(x)
    gone = ~_expected_drops(np.asarray(experts), 8, moe.capacity(40, 8, 2, 0.3)).any(-1)
    assert gone.sum() > 0 and (~gone).sum() > 0
    assert np.array_equal(np.asarray(out)[gone], np.asarray(mid)[gone])  # residual unchanged
    assert np.abs(np.asarray(out - mid)[~gone]).min(axis=-1).max() > 0


@pytest.mark.parametrize("capacity_factor", [0.5, 1.25])
def test_dense_and_sort_dispatch_agree_with_gradients(capacity_factor):
    outs = {}
    for dispatch in ("dense", "sort"):
        m = _cfg(capacity_factor=capacity_factor, dispatch=dispatch)
        graphdef, params = _moe(m)
        x = _x(m, B=3, T=33)
        probe = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), jnp.float32)

        def loss(params, x):
            y, aux = nnx.merge(graphdef, params)(x)
            return jnp.sum(y * probe) + moe.load_balancing_loss(aux, 8, 2), (y, aux)

        (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        outs[dispatch] = (y, aux, grads)
    (yd, ad, gd), (ys, as_, gs) = outs["dense"], outs["sort"]
    np.testing.assert_allclose(np.asarray(yd), np.asarray(ys), rtol=0, atol=1e-6)
    for k in moe.AUX_KEYS:
        np.testing.assert_array_equal(np.asarray(ad[k]), np.asarray(as_[k]))
    if capacity_factor < 1:
        assert float(ad["moe_dropped"]) > 0
    # Gradients sum many terms in a different order (einsum vs gather/scatter-add): agree
    # to fp32 reassociation, 1e-6 absolute plus 1e-5 relative (router grads reach ~10).
    for a, b in zip(jax.tree.leaves(gd), jax.tree.leaves(gs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gd)) > 1e-2


def test_parameter_counts_142m():
    std = summary.param_counts(_cfg("moe-142m-standard"))
    twin = summary.param_counts(_cfg("moe-142m-twin"))
    d, V, L = 768, 50304, 16
    experts = L * 8 * 3 * d * 1024
    assert std["non_embedding"] == 330_427_136
    assert std["active"] == 103_934_720
    assert std["experts"] == experts and std["moe"] == experts + L * d * 8
    assert std["mlp"] == 0
    assert twin["total"] - std["total"] == V * d + d
    # Dense: active = non_embedding; MoE FLOPs = Dense FLOPs + the router (same active FFN).
    dense = summary.param_counts(_cfg("dense-142m-standard"))
    assert dense["active"] == dense["non_embedding"]
    f_moe = summary.flops_per_token(_cfg("moe-142m-standard"), 1024)["forward"]
    f_dense = summary.flops_per_token(_cfg("dense-142m-standard"), 1024)["forward"]
    assert f_moe - f_dense == 2 * L * d * 8


def test_scanned_and_unscanned_agree():
    out = {}
    for scan in (True, False):
        m, graphdef, params = _tiny(scan)
        tokens = np.random.default_rng(0).integers(0, m.vocab_size, (2, 24))
        h, _, aux = jax.jit(lambda p, t: model.bind(graphdef, p).forward(t))(params, tokens)
        out[scan] = (h, aux)
    np.testing.assert_allclose(np.asarray(out[True][0]), np.asarray(out[False][0]), rtol=0, atol=1e-6)
    for k in moe.AUX_KEYS:
        np.testing.assert_allclose(np.asarray(out[True][1][k]), np.asarray(out[False][1][k]), rtol=1e-6)
    assert float(out[True][1]["moe_layers"]) == m.n_layers


def test_expert_sharding_and_sharded_forward():
    """Expert weights shard like the dense MLP (d on fsdp, f on tensor, experts replicated);
    a sharded forward on a (2, 2, 2) mesh equals the single-device one."""
    P = jax.sharding.PartitionSpec
    assert sharding.logical_to_mesh(P("layers", "expert", "embed", "mlp")) == P(None, None, "fsdp", "tensor")
    assert sharding.logical_to_mesh(P("layers", "expert", "mlp", "embed")) == P(None, None, "tensor", "fsdp")
    m, _, params = _tiny(scan=True)
    m = m.copy_and_resolve_references()
    m.moe.update(capacity_factor=0.5, dispatch="sort")  # drops; params do not depend on either
    graphdef, state = model.abstract(m)
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (4, 24))

    def fwd(p, t):
        return model.bind(graphdef, p).forward(t)[::2]

    h1, aux1 = jax.jit(fwd)(params, tokens)
    assert float(aux1["moe_dropped"]) > 0
    mesh = sharding.make_mesh(2, 2, 2)
    shardings = sharding.named_shardings(logical_axes(state), mesh)
    with sharding.activation_rules(mesh):
        h2, aux2 = jax.jit(fwd)(jax.device_put(params, shardings), tokens)  # fresh trace
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h2), rtol=0, atol=1e-5)
    for k in moe.AUX_KEYS:
        np.testing.assert_allclose(np.asarray(aux1[k]), np.asarray(aux2[k]), rtol=1e-6)
