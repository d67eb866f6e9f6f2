"""The control heads of SPEC §2 (untied, mos, sigsoftmax, moss, input_gate and the factorial
cells twin_input_only / twin_output_only) against direct torch transcriptions of their
formulas: values and gradients, at moderate and extreme logits; target gathers; sigsoftmax's
definition in float64; parameter counts at 142M; the factorial cells' shared initialisation;
input-gate containment."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from onona_jax import config, heads, summary
from onona_jax import models as model
from onona_jax import params as params_lib
from reference import jax_math as ref

V, D, K = 97, 16, 2  # pure-function tests
TABLE_NAMES = ("A", "B", "embedding", "unembedding")
NEW_HEADS = ("untied", "mos", "sigsoftmax", "moss", "input_gate", "twin_input_only", "twin_output_only")
ALL_HEADS = ("standard", "twin") + NEW_HEADS


def _t(a, grad=True):
    return torch.tensor(np.asarray(a), dtype=torch.float32, requires_grad=grad)


def _assert_close(got, want, name, rtol=1e-5, atol=None):
    got, want = np.asarray(got), np.asarray(want)
    atol = _grad_atol(want) if atol is None else atol
    assert np.isfinite(got).all() and np.isfinite(want).all(), name
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


EXTREME = 80.0  # the largest |logit| of the extreme cases
ULP = float(np.spacing(np.float32(EXTREME)))  # 7.6e-6: fp32's resolution at |z| = 80


def _value_atol(extreme, base=1e-5, ulps=10):
    """Absolute tolerance on log-probabilities. log p = z − lse(z) cancels two numbers of
    size |z|, so at |z| ≈ 80 two correct fp32 implementations (different matmul order,
    2z − softplus(z) vs z + logσ(z), ...) differ by a few ulps of 80, above 1e-5; a wrong
    formula is off by orders of magnitude more."""
    return max(base, ulps * ULP) if extreme else base


def _grad_atol(want, base=1e-5):
    """1e-5, relative to the gradient's own scale where that exceeds 1."""
    return base * max(1.0, float(np.abs(want).max()))


# ----------------------------------------------------------------------------- torch formulas
# Literal transcriptions of the table in SPEC §2, written independently of heads.py (e.g.
# sigsoftmax as log(exp(z)σ(z)) = z + logσ(z), not 2z − softplus(z)).


def torch_sigsoftmax(z):
    return torch.log_softmax(z + F.logsigmoid(z), dim=-1)


def torch_mos(h, E, W, Wp, sig=False):
    """log Σ_k π_k softmax(E tanh(W_k h)), π = softmax(W_π h), stably via logsumexp of logs."""
    log_pi = torch.log_softmax(h @ Wp, dim=-1)  # [..., K]
    comps = []
    for k in range(W.shape[0]):
        z = torch.tanh(h @ W[k]) @ E.T  # [..., V]
        comps.append(torch_sigsoftmax(z) if sig else torch.log_softmax(z, dim=-1))
    comps = torch.stack(comps, dim=-2)  # [..., K, V]
    return torch.logsumexp(log_pi[..., None] + comps, dim=-2)


def torch_gate_logit(x0, w):
    return F.rms_norm(x0, (x0.shape[-1],)) @ w  # eps=None: finfo(float32).eps


def torch_input_gate_rows(a, b, w):
    g = torch.sigmoid(torch_gate_logit((a + b) / 2, w))[..., None]
    return g * a + (1 - g) * b


def torch_twin_mixture(h, x0, A, B, w):
    z = torch_gate_logit(x0, w)[..., None]
    return torch.logaddexp(
        torch.log_softmax(h @ A.T, dim=-1) + F.logsigmoid(z),
        torch.log_softmax(h @ B.T, dim=-1) + F.logsigmoid(-z),
    )


def torch_head(name, P, tokens, h):
    """(input rows, log-probs) of head `name` with tables/weights P (torch tensors)."""
    x = torch.as_tensor(np.asarray(tokens))
    if name == "untied":
        return P["embedding"][x], torch.log_softmax(h @ P["unembedding"].T, dim=-1)
    if name == "sigsoftmax":
        E = P["embedding"]
        return E[x], torch_sigsoftmax(h @ E.T)
    if name in ("mos", "moss"):
        E = P["embedding"]
        return E[x], torch_mos(h, E, P["mos_proj"], P["mos_prior"], sig=name == "moss")
    A, B = P["A"], P["B"]
    if name == "input_gate":
        rows = torch_input_gate_rows(A[x], B[x], P["gate"])
        return rows, torch.log_softmax(h @ ((A + B) / 2).T, dim=-1)
    if name == "twin_input_only":
        return (A[x] + B[x]) / 2, torch.log_softmax(h @ A.T, dim=-1)
    if name == "twin_output_only":
        rows = A[x]  # the body and the gate both read A[x]
        return rows, torch_twin_mixture(h, rows, A, B, P["gate"])
    raise ValueError(name)


# ----------------------------------------------------------------------------- 1a. pure functions


def _pure_inputs(seed, extreme):
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)
    a = dict(h=f(2, 5, D), E=f(V, D) / 4, W=f(K, D, D) / 2, W_prior=f(D, K), A=f(V, D) / 4,
             B=f(V, D) / 4, w=f(D))
    if extreme:  # |h Eᵀ| up to 80; a peaked prior; a saturated gate
        a["h"] *= np.float32(EXTREME / np.abs(a["h"] @ a["E"].T).max())
        a["W_prior"] *= np.float32(30)
        a["w"] *= np.float32(20)
    return a


def _mos_tanh_logit_max(a):
    return np.abs(np.tanh(np.einsum("...d,kde->...ke", a["h"], a["W"])) @ a["E"].T).max()


PURE = {
    # name: (input names, jax fn, torch fn)
    "untied": (("h", "E"), ref.standard_log_probs, lambda h, W: torch.log_softmax(h @ W.T, dim=-1)),
    "sigsoftmax": (("h", "E"), ref.sigsoftmax_log_probs, lambda h, E: torch_sigsoftmax(h @ E.T)),
    "mos": (("h", "E", "W", "W_prior"), lambda *a: ref.mos_log_probs(*a, sig=False),
            lambda *a: torch_mos(*a, sig=False)),
    "moss": (("h", "E", "W", "W_prior"), lambda *a: ref.mos_log_probs(*a, sig=True),
             lambda *a: torch_mos(*a, sig=True)),
    "input_gate_rows": (("A", "B", "w"), heads.input_gate_rows, torch_input_gate_rows),
}


@functools.lru_cache(maxsize=None)
def _pure_grad_fn(name):
    names, jax_fn, _ = PURE[name]

    def loss(cot, *xs):
        out = jax_fn(*xs)
        return jnp.sum(out * cot), out

    return jax.jit(jax.grad(loss, argnums=tuple(range(1, len(names) + 1)), has_aux=True))


@pytest.mark.parametrize("extreme", [False, True], ids=["moderate", "extreme"])
@pytest.mark.parametrize("name", list(PURE))
def test_pure_function_matches_torch_values_and_grads(name, extreme):
    names, jax_fn, torch_fn = PURE[name]
    a = _pure_inputs(10, extreme)
    if extreme and name in ("mos", "moss"):  # contexts are tanh-bounded: scale E instead
        a["E"] *= np.float32(EXTREME / _mos_tanh_logit_max(a))
    if extreme and name == "input_gate_rows":
        assert np.abs(np.asarray(heads.gate_logit((a["A"] + a["B"]) / 2, a["w"]))).max() > 50
    args = [a[n] for n in names]
    out_shape = jax.eval_shape(jax_fn, *args).shape
    cot = np.random.default_rng(11).standard_normal(out_shape).astype(np.float32)

    targs = [_t(x) for x in args]
    out_t = torch_fn(*targs)
    (out_t * torch.from_numpy(cot)).sum().backward()

    grads, out_j = _pure_grad_fn(name)(cot, *args)
    if extreme and name != "input_gate_rows":
        assert np.asarray(out_j).min() < -50  # the logits really are extreme
    _assert_close(out_j, out_t.detach().numpy(), f"{name} values", rtol=1e-6, atol=_value_atol(extreme))
    for n, g_j, x_t in zip(names, grads, targs):
        _assert_close(g_j, x_t.grad.numpy(), f"{name} d/d{n}")


# ----------------------------------------------------------------------------- 1b. bound modules


@functools.lru_cache(maxsize=None)
def _init(head, seed=0):
    """model.init of the tiny dense model with `head` (compiles an init program: ~2 s)."""
    return model.init(_tiny(head).model, seed)


def _tiny(head):
    return config.load(os.path.join(REPO, f"configs/paper.py:dense-tiny-{head}"))


@functools.lru_cache(maxsize=None)
def _skeleton(head):
    """(graphdef, zero params) of the tiny model with `head`: the real parameter tree (shapes
    from `model.abstract`), without compiling an init program; tests fill in the head."""
    graphdef, state = model.abstract(_tiny(head).model)
    shapes = jax.eval_shape(lambda: params_lib.init_params(state, 0))
    return graphdef, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _random_head_params(head, seed, extreme=False):
    """(graphdef, params, head params, tokens, h) for the tiny model with `head`: its head
    weights random with logits of order 1 (extreme: |logits| up to 80, saturated gates)."""
    graphdef, params = _skeleton(head)
    r = np.random.default_rng(seed)
    d = params["head"][next(iter(params["head"]))].shape[-1]
    scales = {"gate": 1.0, "mos_proj": 2 / np.sqrt(d), "mos_prior": 1 / np.sqrt(d)}
    hp = {n: (scales.get(n, 1 / np.sqrt(d)) * r.standard_normal(v.shape)).astype(np.float32)
          for n, v in params["head"].items()}
    tokens = r.integers(0, _vocab(hp), (2, 3))
    h = r.standard_normal((2, 3, d)).astype(np.float32)
    if extreme:
        if head in ("mos", "moss"):
            ctx = np.tanh(np.einsum("...d,kde->...ke", h, hp["mos_proj"]))
            hp["embedding"] *= np.float32(EXTREME / np.abs(ctx @ hp["embedding"].T).max())
            hp["mos_prior"] *= np.float32(30)
        else:
            tables = [hp[n] for n in TABLE_NAMES if n in hp]
            if "B" in hp:
                tables.append((hp["A"] + hp["B"]) / 2)
            h *= np.float32(EXTREME / max(np.abs(h @ t.T).max() for t in tables))
        if "gate" in hp:
            hp["gate"] *= np.float32(20)
    return graphdef, params, hp, tokens, h


def _vocab(hp):
    return hp["A" if "A" in hp else "embedding"].shape[0]


def _bound_head(graphdef, params, hp):
    return model.bind(graphdef, {**params, "head": hp}).head


@functools.lru_cache(maxsize=None)
def _module_fn(head):
    """One jitted program per head, shared by the tests below: the bound module's input rows,
    log-probs and target log-probs, and the gradients of sum(rows·c_rows) + sum(lp·c_lp)
    w.r.t. the head's weights and h."""
    graphdef, params = _skeleton(head)

    def loss(hp, h, tokens, targets, cot_rows, cot_lp):
        m = _bound_head(graphdef, params, hp)
        rows = m.embed(tokens)
        lp = m.log_probs(h, rows)  # the model passes the embedded rows as x0
        tlp = m.target_log_probs(h, rows, targets)
        return jnp.sum(rows * cot_rows) + jnp.sum(lp * cot_lp), (rows, lp, tlp)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))

    def run(hp, h, tokens, targets=None, cot_rows=None, cot_lp=None):
        targets = np.zeros(tokens.shape, np.int32) if targets is None else targets
        cot_rows = np.zeros(h.shape, np.float32) if cot_rows is None else cot_rows
        cot_lp = np.zeros(h.shape[:-1] + (_vocab(hp),), np.float32) if cot_lp is None else cot_lp
        (g_hp, g_h), out = grad(hp, h, tokens.astype(np.int32), targets.astype(np.int32), cot_rows, cot_lp)
        return g_hp, g_h, *(np.asarray(o) for o in out)

    return run


@pytest.mark.parametrize("extreme", [False, True], ids=["moderate", "extreme"])
@pytest.mark.parametrize("head", NEW_HEADS)
def test_bound_head_matches_torch_values_and_grads(head, extreme):
    graphdef, params, hp, tokens, h = _random_head_params(head, 20, extreme)
    r = np.random.default_rng(21)
    vocab = _vocab(hp)
    cot_rows = r.standard_normal(h.shape).astype(np.float32)
    # An O(1) random linear functional of the log-probs (a mean over the vocabulary).
    cot_lp = (r.standard_normal(h.shape[:-1] + (vocab,)) / np.sqrt(vocab)).astype(np.float32)
    g_hp, g_h, rows_j, lp_j, _ = _module_fn(head)(hp, h, tokens, cot_rows=cot_rows, cot_lp=cot_lp)

    P = {n: _t(v) for n, v in hp.items()}
    h_t = _t(h)
    rows_t, lp_t = torch_head(head, P, tokens, h_t)
    ((rows_t * torch.from_numpy(cot_rows)).sum() + (lp_t * torch.from_numpy(cot_lp)).sum()).backward()

    if extreme:
        assert np.asarray(lp_j).min() < -50
    _assert_close(rows_j, rows_t.detach().numpy(), f"{head} rows", rtol=1e-6, atol=1e-6)
    _assert_close(lp_j, lp_t.detach().numpy(), f"{head} log-probs", rtol=1e-6, atol=_value_atol(extreme))
    _assert_close(g_h, h_t.grad.numpy(), f"{head} d/dh")
    assert set(g_hp) == set(P)
    for n in P:
        assert P[n].grad is not None, f"{head}: torch formula does not use {n}"
        _assert_close(g_hp[n], P[n].grad.numpy(), f"{head} d/d{n}")


# ----------------------------------------------------------------------------- 2. target gathers


@pytest.mark.parametrize("extreme", [False, True], ids=["moderate", "extreme"])
@pytest.mark.parametrize("head", ALL_HEADS)
def test_target_log_probs_gather_log_probs(head, extreme):
    _, _, hp, tokens, h = _random_head_params(head, 30, extreme)
    targets = np.random.default_rng(31).integers(0, _vocab(hp), tokens.shape)
    _, _, _, lp, _ = _module_fn(head)(hp, h, tokens, targets)
    targets[0, 0] = lp[0, 0].argmax()  # the likeliest and the least likely token too
    targets[0, 1] = lp[0, 1].argmin()
    _, _, _, lp2, got = _module_fn(head)(hp, h, tokens, targets)
    np.testing.assert_array_equal(lp2, lp)
    if extreme:
        assert lp.min() < -50
    want = np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    assert np.isfinite(got).all()
    # Two fp32 paths (z_t − lse vs log_softmax then gather): 1e-6, or 4 ulps of |z| = 80.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=_value_atol(extreme, 1e-6, ulps=4), err_msg=head)


# ----------------------------------------------------------------------------- 3. sigsoftmax definition


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_sigsoftmax_matches_naive_float64_definition(scale):
    r = np.random.default_rng(40)
    h = (scale * r.standard_normal((4, D))).astype(np.float32)
    E = (r.standard_normal((V, D)) / 4).astype(np.float32)
    z = h.astype(np.float64) @ E.astype(np.float64).T
    assert 2 < np.abs(z).max() < 30  # moderate: the naive form is accurate in float64
    unnorm = np.exp(z) * (1.0 / (1.0 + np.exp(-z)))  # exp(z)·σ(z), naively
    p = unnorm / unnorm.sum(-1, keepdims=True)
    got = np.exp(np.asarray(ref.sigsoftmax_log_probs(h, E), np.float64))
    np.testing.assert_allclose(got, p, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=0, atol=1e-6)
    softmax = np.exp(z - z.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    assert np.abs(p - softmax).max() > 1e-3  # sigsoftmax is not softmax here
    targets = np.arange(4) * 7
    np.testing.assert_allclose(
        np.exp(np.asarray(ref.sigsoftmax_target_log_probs(h, E, targets), np.float64)),
        p[np.arange(4), targets], rtol=0, atol=1e-6,
    )


# ----------------------------------------------------------------------------- 4. parameter counts


def test_parameter_counts_142m():
    total = lambda head: summary.param_counts(
        config.load(os.path.join(REPO, f"configs/paper.py:dense-142m-{head}")).model)["total"]
    Vp, d = 50304, 768
    standard = total("standard")
    assert standard == 142_469_888
    expected = {
        "twin": standard + Vp * d + d,
        "untied": standard + Vp * d,
        "mos": standard + 2 * d * d + 2 * d,
        "moss": standard + 2 * d * d + 2 * d,
        "sigsoftmax": standard,
        "input_gate": standard + Vp * d + d,
        "twin_input_only": standard + Vp * d,
        "twin_output_only": standard + Vp * d + d,
    }
    got = {head: total(head) for head in expected}
    assert got == expected
    assert got["moss"] == 143_651_072  # the paper's "143.65M"
    assert got["twin"] == 181_104_128  # the paper's "181.10M"


# ----------------------------------------------------------------------------- 5. factorial init


def test_factorial_cells_share_body_and_tables():
    cells = {h: _init(h)[1] for h in ("standard", "twin_input_only", "twin_output_only", "twin")}
    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v)
                         for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    body = flat(cells["standard"]["trunk"])
    assert len(body) > 5
    A = np.asarray(cells["standard"]["head"]["embedding"])
    for name, p in cells.items():
        other = flat(p["trunk"])
        assert other.keys() == body.keys(), name
        for path in body:
            np.testing.assert_array_equal(other[path], body[path], err_msg=f"{name} trunk{path}")
        if name != "standard":
            np.testing.assert_array_equal(np.asarray(p["head"]["A"]), A, err_msg=f"{name} A")
    B = np.asarray(cells["twin"]["head"]["B"])
    assert not np.array_equal(A, B)  # the tables are drawn independently
    for name in ("twin_input_only", "twin_output_only"):
        np.testing.assert_array_equal(np.asarray(cells[name]["head"]["B"]), B, err_msg=f"{name} B")
    np.testing.assert_array_equal(np.asarray(cells["twin_output_only"]["head"]["gate"]),
                                  np.asarray(cells["twin"]["head"]["gate"]))
    assert "gate" not in cells["twin_input_only"]["head"]
    assert set(cells["standard"]["head"]) == {"embedding"}


# ----------------------------------------------------------------------------- 6. containment


@pytest.mark.parametrize("gate_scale", [0.0, 1.0, 30.0, 1e3, 1e6])
def test_input_gate_with_equal_tables_is_standard(gate_scale):
    _, _, hp, tokens, h = _random_head_params("input_gate", 50)
    hp = {**hp, "B": hp["A"], "gate": hp["gate"] * np.float32(gate_scale)}
    _, _, rows, lp, _ = _module_fn("input_gate")(hp, h, tokens)
    np.testing.assert_allclose(rows, hp["A"][tokens], rtol=1e-6, atol=1e-7)
    _, _, std_rows, std_lp, _ = _module_fn("standard")({"embedding": hp["A"]}, h, tokens)
    np.testing.assert_array_equal(std_rows, hp["A"][tokens])
    np.testing.assert_allclose(lp, std_lp, rtol=0, atol=1e-6)
    # With A ≠ B (and a non-trivial gate) the rows are a proper mix: neither A[x] nor M[x].
    if gate_scale == 1.0:
        _, _, hp2, _, _ = _random_head_params("input_gate", 50)
        _, _, mixed, _, _ = _module_fn("input_gate")(hp2, h, tokens)
        A_rows, M_rows = hp2["A"][tokens], (hp2["A"][tokens] + hp2["B"][tokens]) / 2
        assert np.abs(mixed - A_rows).max() > 1e-3 and np.abs(mixed - M_rows).max() > 1e-3
