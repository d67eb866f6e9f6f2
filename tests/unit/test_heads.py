"""The heads' pure math against the paper: Figure 2 in torch, containment, Appendix A."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from onona_jax import heads
from reference import jax_math as ref
from reference.torch_ref import TwinTables

V, D = 97, 16


def _inputs(seed, gate_scale=1.0):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    return dict(h=f(2, 5, D), x0=f(2, 5, D), A=f(V, D), B=f(V, D), w=gate_scale * f(D))


def _torch_twin(arrays, weights):
    """Figure 2's log-probs and the gradients of sum(log_probs * weights)."""
    t = TwinTables(V, D)
    with torch.no_grad():
        t.A.copy_(torch.from_numpy(arrays["A"]))
        t.B.copy_(torch.from_numpy(arrays["B"]))
        t.w.weight.copy_(torch.from_numpy(arrays["w"])[None])
    h = torch.tensor(arrays["h"], requires_grad=True)
    x0 = torch.tensor(arrays["x0"], requires_grad=True)
    lp = t.log_probs(h, x0)
    (lp * torch.from_numpy(weights)).sum().backward()
    grads = dict(h=h.grad, x0=x0.grad, A=t.A.grad, B=t.B.grad, w=t.w.weight.grad[0])
    return lp.detach().numpy(), {k: g.numpy() for k, g in grads.items()}


def _jax_twin(arrays, weights):
    names = ("h", "x0", "A", "B", "w")

    def loss(*args):
        lp = ref.twin_log_probs(*args)
        return jnp.sum(lp * weights), lp

    grads, lp = jax.grad(loss, argnums=range(5), has_aux=True)(*(arrays[n] for n in names))
    return np.asarray(lp), {n: np.asarray(g) for n, g in zip(names, grads)}


def _saturated(seed):
    """x0 = ±w plus a little noise, |w| = 30: z = ±~120, where fp32 σ(−|z|) underflows."""
    a = _inputs(seed)
    w = a["w"] * 30 / np.linalg.norm(a["w"])
    sign = np.where(np.arange(10).reshape(2, 5, 1) % 2 == 0, 1.0, -1.0).astype(np.float32)
    a["w"], a["x0"] = w, (sign * w + 0.01 * a["x0"]).astype(np.float32)
    return a


@pytest.mark.parametrize("case", ["random", "saturated"])
def test_twin_matches_figure2_values_and_grads(case):
    arrays = _inputs(0) if case == "random" else _saturated(0)
    weights = np.random.default_rng(1).standard_normal((2, 5, V)).astype(np.float32)
    lp_t, g_t = _torch_twin(arrays, weights)
    lp_j, g_j = _jax_twin(arrays, weights)

    z = np.asarray(heads.gate_logit(arrays["x0"], arrays["w"]))
    if case == "saturated":
        assert np.abs(z).min() > 100
        # The paper's first version: log(σ(z)) underflows to -inf; logsigmoid does not.
        assert jnp.isinf(jnp.log(jax.nn.sigmoid(-jnp.abs(z)))).all()
    assert np.isfinite(lp_j).all() and all(np.isfinite(g).all() for g in g_j.values())
    np.testing.assert_allclose(lp_j, lp_t, rtol=0, atol=1e-5)
    for name in g_t:
        np.testing.assert_allclose(g_j[name], g_t[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-5])
def test_gate_logit_matches_torch_rms_norm_eps(scale):
    # At small |x0| the eps term dominates the mean square: a different eps would show.
    a = _inputs(2)
    x0 = a["x0"] * np.float32(scale)
    z_t = torch.nn.functional.rms_norm(torch.from_numpy(x0), (D,)) @ torch.from_numpy(a["w"])
    np.testing.assert_allclose(heads.gate_logit(x0, a["w"]), z_t.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate_scale", [0.0, 0.1, 1.0, 10.0, 1e3, 1e6])
def test_containment_twin_with_equal_tables_is_standard(gate_scale):
    a = _inputs(3, gate_scale)
    twin = ref.twin_log_probs(a["h"], a["x0"], a["A"], a["A"], a["w"])
    np.testing.assert_allclose(twin, ref.standard_log_probs(a["h"], a["A"]), rtol=0, atol=1e-6)


def test_target_log_probs_gather_full_log_probs():
    a = _inputs(4)
    targets = np.random.default_rng(5).integers(0, V, (2, 5))
    gather = lambda lp: np.take_along_axis(np.asarray(lp), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        ref.standard_target_log_probs(a["h"], a["A"], targets),
        gather(ref.standard_log_probs(a["h"], a["A"])),
        rtol=0, atol=1e-5,
    )
    np.testing.assert_allclose(
        ref.twin_target_log_probs(a["h"], a["x0"], a["A"], a["B"], a["w"], targets),
        gather(ref.twin_log_probs(a["h"], a["x0"], a["A"], a["B"], a["w"])),
        rtol=0, atol=1e-5,
    )


def test_appendix_a_rank_construction():
    # d=1, V=C=3: A=(0,1,2)ᵀ, B=0, H=(log2, 0, −log2)ᵀ, w=0 so g = σ(0) = ½.
    A = np.array([[0.0], [1.0], [2.0]], np.float32)
    B = np.zeros((3, 1), np.float32)
    H = np.array([[np.log(2)], [0.0], [-np.log(2)]], np.float32)
    x0, w = np.ones((3, 1), np.float32), np.zeros((1,), np.float32)
    assert np.all(np.asarray(heads.gate_logit(x0, w)) == 0)

    L = np.asarray(ref.twin_log_probs(H, x0, A, B, w), np.float64)
    P_paper = np.array([[10, 13, 19], [14, 14, 14], [19, 13, 10]]) / 42
    np.testing.assert_allclose(np.exp(L), P_paper, rtol=0, atol=1e-6)

    tol = 1e-4  # far above fp32 noise, far below L's smallest singular value
    assert np.linalg.svd(L, compute_uv=False).min() > 100 * tol
    assert np.linalg.matrix_rank(L, tol=tol) == 3
    for table in (A, B):  # one softmax: rank ≤ d + 1 = 2
        assert np.linalg.matrix_rank(np.asarray(ref.standard_log_probs(H, table)), tol=tol) <= 2
