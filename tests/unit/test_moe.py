"""MoE (SPEC §3): HF Qwen3-MoE parity (block, dropless mode and pooled load-balancing loss),
capacity drops under the (choice, token) priority, grouped ⇄ dense ⇄ sort dispatch,
parameter counts at 142M, scanned ⇄ unscanned, and sharded runs with expert parallelism
(all-to-all, no expert weight gathered across the expert axis). fp32 throughout."""

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
@pytest.mark.parametrize("dispatch", ["grouped", "dense", "sort"])
@pytest.mark.parametrize("dropless", [False, True])
def test_block_matches_hf_qwen3_moe(renormalize, dispatch, dropless):
    # eval capacity 4.0 = E/top_k: C = T, nothing can be dropped (HF never drops); or the
    # dropless mode (capacity_factor 0) of a training config.
    m = _cfg(renormalize=renormalize, dispatch=dispatch)
    m = moe.eval_config(m) if not dropless else _cfg(renormalize=renormalize, dispatch=dispatch, capacity_factor=0)
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


@pytest.mark.parametrize("dispatch", ["grouped", "dense", "sort"])
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


@pytest.mark.parametrize("capacity_factor", [0.5, 1.25, 0])
def test_dispatches_agree_with_gradients(capacity_factor):
    """grouped, dense and sort keep the same assignments: outputs, statistics and gradients
    agree (0: dropless)."""
    outs = {}
    for dispatch in ("grouped", "dense", "sort"):
        m = _cfg(capacity_factor=capacity_factor, dispatch=dispatch)
        graphdef, params = _moe(m)
        x = _x(m, B=3, T=33)
        probe = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), jnp.float32)

        def loss(params, x):
            y, aux = nnx.merge(graphdef, params)(x)
            return jnp.sum(y * probe) + moe.load_balancing_loss(aux, 8, 2), (y, aux)

        (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        outs[dispatch] = (y, aux, grads)
    ys, as_, gs = outs["sort"]
    for other in ("dense", "grouped"):
        yd, ad, gd = outs[other]
        np.testing.assert_allclose(np.asarray(yd), np.asarray(ys), rtol=0, atol=1e-6)
        for k in moe.AUX_KEYS:
            np.testing.assert_array_equal(np.asarray(ad[k]), np.asarray(as_[k]))
        # Gradients sum many terms in a different order (einsum vs gather/scatter-add vs
        # grouped matmuls): agree to fp32 reassociation, 1e-6 absolute plus 1e-5 relative
        # (router grads reach ~10).
        for a, b in zip(jax.tree.leaves(gd), jax.tree.leaves(gs)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    if 0 < capacity_factor < 1:
        assert float(as_["moe_dropped"]) > 0
    if capacity_factor == 0:
        assert float(as_["moe_dropped"]) == 0
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gs)) > 1e-2


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


def test_expert_sharding_rules():
    """Expert weights [E, d, f]: E over the expert axis, d over fsdp, f over tensor; outside
    the experts the expert axis is more FSDP (embed) and more batch."""
    P = jax.sharding.PartitionSpec
    assert sharding.logical_to_mesh(P("layers", "expert", "embed", "mlp")) == P(None, "expert", "fsdp", "tensor")
    assert sharding.logical_to_mesh(P("layers", "expert", "mlp", "embed")) == P(None, "expert", "tensor", "fsdp")
    assert sharding.logical_to_mesh(P("embed", "mlp")) == P(("fsdp", "expert"), "tensor")
    assert sharding.logical_to_mesh(P("batch", "seq")) == P(("data", "fsdp", "expert"), None)


def test_sort_or_dense_under_expert_parallelism_is_an_error():
    cfg = config.load(os.path.join(REPO, "configs/paper.py:moe-tiny-twin"))
    cfg.mesh.expert = 2
    cfg.model.moe.dispatch = "sort"
    with pytest.raises(ValueError, match="only the grouped dispatch sends tokens to experts on other devices"):
        config.validate(cfg)


# (data, fsdp, expert, tensor): expert parallelism 2, 4 and 8 beside data, FSDP and tensor axes
EP_MESHES = [(1, 2, 2, 2), (2, 1, 4, 1), (1, 1, 8, 1), (2, 2, 1, 2)]


@pytest.mark.slow  # suite-time margin (cover for EP: test_families' moe-ep4)
@pytest.mark.parametrize("mesh_shape", EP_MESHES, ids=lambda s: "x".join(map(str, s)))
def test_expert_parallel_loss_and_gradients_equal_one_device_sort(mesh_shape):
    """The tiny MoE model's loss and gradients on an 8-device mesh with expert parallelism
    (grouped dispatch, all-to-all) equal one device's sort dispatch, with capacity drops:
    the same tokens dropped. Tolerance: fp32 reassociation (the grouped matmuls and the
    sharded reductions sum in another order), 1e-5 relative to each array's largest value."""
    data, fsdp, ep, tensor = mesh_shape
    m, _, params = _tiny(scan=True)
    m = m.copy_and_resolve_references()
    m.moe.capacity_factor = 0.5  # drops, so dropping the same assignments is tested
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (8, 24))
    params = _noisy(params, 4, scale=0.05)

    def loss_fn(dispatch):
        m.moe.dispatch = dispatch
        graphdef, state = model.abstract(m)

        def loss(p, t):
            h, _, aux = model.bind(graphdef, p).forward(t)
            return jnp.mean(jnp.square(h)) + moe.load_balancing_loss(aux, 8), aux

        return graphdef, state, jax.value_and_grad(loss, has_aux=True)

    _, _, ref_fn = loss_fn("sort")
    (l1, aux1), g1 = jax.jit(ref_fn)(params, tokens)
    assert float(aux1["moe_dropped"]) > 0
    _, state, fn = loss_fn("grouped")
    mesh = sharding.make_mesh(data, fsdp, tensor, expert=ep)
    shardings = sharding.named_shardings(logical_axes(state), mesh)
    with sharding.activation_rules(mesh):
        (l2, aux2), g2 = jax.jit(fn)(jax.device_put(params, shardings), tokens)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    for k in moe.AUX_KEYS:
        np.testing.assert_allclose(np.asarray(aux2[k]), np.asarray(aux1[k]), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g1)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, np.abs(b).max()), err_msg=str(path))


def test_expert_weights_never_gathered_across_the_expert_axis():
    """The compiled gradient on a (1, 2, 4, 1) mesh moves tokens by all-to-all and gathers
    expert weights only over fsdp: no all-gather's result holds all 8 experts of a weight
    (E=8 beside d=64 or f=96), where replicated experts gathered every one."""
    import re

    m, _, params = _tiny(scan=True)
    m = m.copy_and_resolve_references()
    m.moe.dispatch = "grouped"
    graphdef, state = model.abstract(m)
    mesh = sharding.make_mesh(1, 2, 1, expert=4)
    shardings = sharding.named_shardings(logical_axes(state), mesh)

    def loss(p, t):
        return jnp.mean(jnp.square(model.bind(graphdef, p).forward(t)[0]))

    tokens = jnp.zeros((8, 24), jnp.int32)
    with sharding.activation_rules(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(jax.device_put(params, shardings), tokens).compile().as_text()
    gathers = [ln for ln in hlo.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", ln)]
    whole = [ln for ln in gathers if re.search(r"\[(\d+,)*8,(64|96)[,\]]", ln.split("=")[1].split(" all-gather")[0])]
    assert not whole, whole[:3]
    assert any(" all-to-all(" in ln for ln in hlo.splitlines())


def test_attention_experts_remat_gathers_the_experts_once():
    """`model.remat=attention_experts` keeps the grouped dispatch's FSDP-gathered expert
    weights for the backward pass: on an fsdp-8 mesh the compiled gradient has half the
    all-gathers of whole experts (E=8 beside d=64 or f=96) that `attention` has (forward and
    its recompute), and the same gradient (fp32: 1e-6 of the largest entry, reassociation)."""
    import re

    m, _, params = _tiny(scan=True)
    mesh = sharding.make_mesh(1, 8, 1)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, m.vocab_size, (8, 24)), jnp.int32)
    grads, counts = {}, {}
    for remat in ("attention", "attention_experts"):
        c = m.copy_and_resolve_references()
        c.moe.dispatch, c.remat = "grouped", remat
        graphdef, state = model.abstract(c)
        shardings = sharding.named_shardings(logical_axes(state), mesh)

        def loss(p, t):
            return jnp.mean(jnp.square(model.bind(graphdef, p).forward(t)[0]))

        with sharding.activation_rules(mesh):
            step = jax.jit(jax.grad(loss)).lower(jax.device_put(params, shardings), tokens).compile()
            grads[remat] = step(jax.device_put(params, shardings), tokens)
        experts = re.compile(r"\[(\d+,)*8,(64,96|96,64)\]")
        counts[remat] = sum(1 for ln in step.as_text().splitlines()
                            if re.search(r"= \S+ all-gather(-start)?\(", ln) and experts.search(ln.split("=")[1]))
    assert counts["attention"] > 0 and counts["attention_experts"] * 2 == counts["attention"], counts
    for a, b in zip(jax.tree.leaves(grads["attention_experts"]), jax.tree.leaves(grads["attention"])):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, np.abs(b).max()))
