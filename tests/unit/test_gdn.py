"""Gated DeltaNet (SPEC §3): the chunked form against the naive recurrence (outputs, final
state, gradients) at both matmul precisions (model.gdn.precision), our layer against HF
transformers' `Qwen3NextGatedDeltaNet` through `gdn.to_hf`, the 142M parameter count,
the hybrid trunk scanned vs unscanned, the full-sequence layer against step-by-step decoding,
and a tiny model's loss at `default` against `highest`. Parameters and activations fp32; the
exact-equality tests pin `highest`.

Tolerances. The reference is the naive recurrence with fp32 matmuls at HIGHEST. At `highest`
the chunked form agrees to fp32 rounding (TOL_HIGHEST, 1e-5 of the largest entry). At
`default` every matmul operand is rounded to bf16, which keeps 8 significant bits: ≤ 2⁻⁹
relative per rounding, so ≤ 2⁻⁸ per product of two rounded operands (the fp32 accumulation
adds ~2⁻²⁴ per term, nothing next to it), relative to the terms' magnitudes. A value of the
chunked form goes through a chain of such products (K Kᵀ, the inverse's rounds, T [βV, βe^γK],
W S₀, the readout; the backward pass through their transposes); allowing 8 products' errors
adding up in the same direction gives TOL_DEFAULT = 8 × 2⁻⁸ = 2⁻⁵ of the largest entry.
Measured worst cases (outputs, state, every gradient, T up to 512): 2.9e-3 to 1.0e-2, i.e.
0.7 to 2.6 × 2⁻⁸."""

import inspect
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO
from onona_jax import config, summary
from onona_jax.models import gdn
from onona_jax import models as model
from onona_jax import params as params_lib

PAPER = os.path.join(REPO, "configs", "paper.py")


def _load(spec, **model_overrides):
    """The paper config's model with overrides. While configs/paper.py gives `gdn-tiny-*`
    2 layers (not a multiple of the hybrid pattern's 4, so it does not validate), that one is
    built as `dense-tiny-*` with arch gdn and the GDN sizes paper.py derives (heads d//128,
    at least 1; head dims min(128, d))."""
    try:
        cfg = config.load(f"{PAPER}:{spec}")
    except ValueError as e:
        arch, size, head = spec.split("-", 2)
        if arch != "gdn" or "n_layers" not in str(e):
            raise
        cfg = config.load(f"{PAPER}:dense-{size}-{head}")
        d = cfg.model.d_model
        cfg.model.arch = arch
        cfg.model.gdn.update(n_heads=max(1, d // 128), head_dim_k=min(128, d), head_dim_v=min(128, d))
    cfg.model.update(model_overrides)
    return config.validate(cfg).model


# ----------------------------------------------------------------------------- the rule


def _rule_inputs(B, T, H, dk, dv, seed):
    """Unit-norm keys, queries scaled by dk^-½ (as the layer feeds them), and per-head decay
    regimes: head 0 mild (g ~ −softplus(N)), head 1 fast (g down to ~ −100: e^g underflows
    within a chunk), head 2 almost none (g ~ −1e-3), head 3 extreme (g = −1e4: cumulative
    decays of −6e5 in a chunk must neither overflow nor give NaN)."""
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    q = gdn.l2_normalize(n(B, T, H, dk)) * dk**-0.5
    k = gdn.l2_normalize(n(B, T, H, dk))
    v = n(B, T, H, dv)
    scale = jnp.asarray([1.0, 30.0, 1e-3, 0.0], jnp.float32)
    g = -jax.nn.softplus(n(B, T, H)) * scale + jnp.asarray([0.0, 0.0, 0.0, -1e4], jnp.float32)
    beta = jax.nn.sigmoid(n(B, T, H))
    s0 = 0.5 * n(B, H, dk, dv)
    return (q, k, v, g, beta), s0


TOL_HIGHEST = 1e-5
TOL_DEFAULT = 2.0**-5


@pytest.mark.parametrize("C", [1, 8, 37, 64])
@pytest.mark.parametrize("precision", gdn.PRECISIONS)
def test_unit_lower_inverse(C, precision):
    """The blocked (I + A)⁻¹ against float64 LAPACK, C a power of two or not (padded). Two
    regimes: random strictly-lower A of order one, and the delta rule's worst case — equal
    unit keys with β = 1 and no decay (A_ij = 1 for j < i), whose inverse is I minus the
    subdiagonal while (−A)ᵏ holds binomials up to C(62, 31) ≈ 5e17: a power-series inverse
    loses every digit here, the blocked one must stay exact to fp32 rounding (at `default`
    too: its entries 0 and ±1 are exact in bf16). At `default` the random case is within
    TOL_DEFAULT (measured 6e-3 at C = 64). The custom gradient (−Tᵀ dT Tᵀ on the strict lower
    triangle) equals autodiff through the blocked rounds."""
    r = np.random.default_rng(C)
    rand = np.tril(0.3 * r.standard_normal((3, C, C)), -1)
    ones = np.tril(np.ones((1, C, C)), -1)
    for name, A in (("random", rand), ("aligned keys", ones)):
        T = np.asarray(jax.jit(gdn.unit_lower_inverse, static_argnums=1)(jnp.asarray(A, jnp.float32), precision))
        ref = np.linalg.inv(np.eye(C) + A)
        err = np.abs(T - ref).max() / max(1.0, np.abs(ref).max())
        tol = 1e-6 * C if precision == "highest" or name == "aligned keys" else TOL_DEFAULT
        assert err <= tol, f"{name}, C={C}: relative error {err:.3g}"
        assert np.all(np.triu(T, 1) == 0), f"{name}, C={C}: not lower-triangular"
    A = jnp.asarray(rand, jnp.float32)
    w = jnp.asarray(r.standard_normal(A.shape), jnp.float32)
    grad = lambda f: jax.jit(jax.grad(lambda a: jnp.sum(f(a) * w)))(A)  # noqa: E731
    ours = grad(lambda a: gdn.unit_lower_inverse(a, precision))
    autodiff = grad(lambda a: gdn._blocked_inverse(precision, a))
    assert np.all(np.triu(np.asarray(ours)) == 0)
    _close(ours, np.tril(np.asarray(autodiff), -1), "d/dA", TOL_HIGHEST if precision == "highest" else TOL_DEFAULT)


@pytest.mark.parametrize("T,precision", [(64, "highest"), (128, "highest"), (100, "highest"), (37, "highest"),
                                         (128, "default"), (37, "default")])
def test_chunked_equals_recurrence(T, precision):
    """Outputs, final state and gradients (q, k, v, g, β, initial state) of the chunked form
    (chunk 64; T = 100 and 37 are padded) at `precision` against the naive recurrence at
    HIGHEST, within TOL_HIGHEST or TOL_DEFAULT. At `default` the switch must show: the
    chunked outputs differ from `highest`'s by more than 1e-4 (fp32 rounding is ~1e-7 here),
    and the naive recurrence and the decoding step (serving) run at `default` too."""
    B, H, dk, dv = 2, 4, 16, 8
    tol = TOL_HIGHEST if precision == "highest" else TOL_DEFAULT
    args, s0 = _rule_inputs(B, T, H, dk, dv, seed=T)
    r = np.random.default_rng(1)
    w_o = jnp.asarray(r.standard_normal((B, T, H, dv)), jnp.float32)
    w_s = jnp.asarray(r.standard_normal((B, H, dk, dv)), jnp.float32)

    def loss(fn, args, s0):
        o, s = fn(*args, initial_state=s0)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

    @jax.jit
    def both(args, s0):
        grad = lambda fn: jax.grad(lambda a, s: loss(fn, a, s), argnums=(0, 1), has_aux=True)  # noqa: E731
        chunked = lambda *a, initial_state: gdn.chunked_gated_delta_rule(  # noqa: E731
            *a, chunk=64, initial_state=initial_state, precision=precision
        )
        naive = lambda *a, initial_state: gdn.recurrent_gated_delta_rule(  # noqa: E731
            *a, initial_state=initial_state, precision="highest"
        )
        return grad(naive)(args, s0), grad(chunked)(args, s0)

    ((ga, gs_a), (o_a, s_a)), ((gb, gs_b), (o_b, s_b)) = both(args, s0)
    assert o_b.shape == (B, T, H, dv) and s_b.shape == (B, H, dk, dv)
    _close(o_b, o_a, "o", tol)
    _close(s_b, s_a, "final state", tol)
    for name, x, y in zip(("q", "k", "v", "g", "beta"), gb, ga):
        _close(x, y, f"d/d{name}", tol)
    _close(gs_b, gs_a, "d/d initial_state", tol)

    if precision == "default":
        o_h, _ = jax.jit(gdn.chunked_gated_delta_rule, static_argnames="precision")(
            *args, initial_state=s0, precision="highest")
        assert np.abs(np.asarray(o_b) - np.asarray(o_h)).max() > 1e-4, "default computes what highest does"

    if T == 37:  # no initial state (zeros); the step form is the recurrence's body
        o0, _ = jax.jit(gdn.chunked_gated_delta_rule, static_argnames="precision")(*args, precision=precision)
        o1, _ = gdn.recurrent_gated_delta_rule(*args, precision="highest")
        _close(o0, o1, "o without initial state", tol)
        o2, _ = gdn.recurrent_gated_delta_rule(*args, precision=precision)
        _close(o2, o1, "naive recurrence", tol)
        S = jnp.zeros((B, H, dk, dv), jnp.float32)
        for t in range(3):
            o_t, S = gdn.gated_delta_step(S, *(a[:, t] for a in args), precision=precision)
            _close(o_t, o1[:, t], f"step {t}", tol)


def _close(x, y, what, tol=TOL_HIGHEST):
    """max |x − y| ≤ tol · max(1, max |y|): absolute for values of order one, relative to the
    largest entry otherwise (gradients here reach ~15, where fp32 rounding of sums over a
    chunk alone is a few 1e-6)."""
    x, y = np.asarray(x), np.asarray(y)
    assert np.all(np.isfinite(x)), f"{what}: not finite"
    err, scale = np.abs(x - y).max(), max(1.0, np.abs(y).max())
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} × {scale:.3g}"


def test_precision_config_and_old_runs(capsys):
    """model.gdn.precision is validated with the valid values named; a config saved before the
    key existed (a GDN run trained at fp32 HIGHEST) restores as `highest` with a notice, one
    saved with it keeps its value; and it may change on resume, like model.remat."""
    cfg = config.load(f"{PAPER}:gdn-142m-twin")
    assert cfg.model.gdn.precision == gdn.DEFAULT_PRECISION
    cfg.model.gdn.precision = "bf16"
    with pytest.raises(ValueError, match="model.gdn.precision 'bf16': one of default, highest"):
        config.validate(cfg)
    cfg.model.gdn.precision = "default"
    old = cfg.to_dict()
    del old["model"]["gdn"]["precision"]
    assert config.from_saved(old, "runs/old").model.gdn.precision == "highest"
    err = capsys.readouterr().err
    assert "predates model.gdn.precision; using 'highest'" in err and "using their defaults" not in err
    assert config.from_saved(cfg.to_dict(), "runs/new").model.gdn.precision == "default"
    from onona_jax.train.resume import resume_conflicts

    assert resume_conflicts(config.from_saved(old), cfg) == []


# ----------------------------------------------------------------------------- the layer vs HF


def _layer(m, seed=0, noise=0.1):
    """A standalone GatedDeltaNet with initialised params plus N(0, noise²) on every leaf
    (norm weight not all ones, conv taps of order 0.1: a misplaced weight shows)."""
    graphdef, state = params_lib.abstract_state(lambda: gdn.GatedDeltaNet(m))
    p = params_lib.init_params(state, seed)
    r = np.random.default_rng(seed)
    p = jax.tree.map(lambda x: x + noise * jnp.asarray(r.standard_normal(x.shape), jnp.float32), p)
    return nnx.merge(graphdef, p), p


def _gdn_model(**gdn_overrides):
    m = _load("gdn-tiny-standard", n_layers=4, dtype="float32")
    m.gdn.update(gdn_overrides)
    return m


def test_layer_matches_hf_qwen3_next(monkeypatch):
    """Ours vs `Qwen3NextGatedDeltaNet` on its pure-torch path, with our weights.

    HF differs from SPEC in layout only (see `gdn.to_hf`): fused `in_proj_qkvz`
    grouped per key head [q_h|k_h|v_h|z_h], fused `in_proj_ba` per head [b_h|a_h], one
    depthwise conv over the concatenated [q|k|v] channels, grouped value heads (here
    num_v_heads = num_k_heads = H), and the gated norm `Qwen3NextRMSNormGated` (plain weight,
    eps = rms_norm_eps, normalise in fp32, times silu(z)). dk ≠ dv here to catch a swap."""
    import torch
    import transformers
    import transformers.models.qwen3_next.modeling_qwen3_next as hf

    def reference(f):
        """The pure-torch function behind HF's kernel wrappers. With transformers ≥ 5.25 and its
        `kernels` dependency each is a torch Module (`Func`) whose forward closes over it."""
        if isinstance(f, torch.nn.Module):
            f = inspect.getclosurevars(type(f).forward).nonlocals["func"]
        return inspect.unwrap(f)

    # Force the reference PyTorch kernels (never fla / causal-conv1d / hub kernels), and check
    # that the chunked one is what runs.
    calls = []
    chunk_ref = reference(hf.torch_chunk_gated_delta_rule)
    conv_ref = reference(hf.causal_conv1d_fn)
    assert "F.conv1d" in inspect.getsource(conv_ref) and "solve_triangular" in inspect.getsource(chunk_ref)

    def chunk_spy(*a, **kw):
        calls.append(1)
        return chunk_ref(*a, **{k: v for k, v in kw.items() if k in inspect.signature(chunk_ref).parameters})

    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", chunk_spy)
    def conv(*a, **kw):
        return conv_ref(*a, **{k: kw[k] for k in ("bias", "activation") if k in kw})

    monkeypatch.setattr(hf, "causal_conv1d_fn", conv)

    m = _gdn_model(n_heads=2, head_dim_k=16, head_dim_v=24, precision="highest")  # HF's torch path is fp32
    layer, p = _layer(m)
    T = 100  # two chunks of 64, the second padded, in both implementations
    x = np.random.default_rng(T).standard_normal((2, T, m.d_model)).astype(np.float32)
    gd, st = nnx.split(layer)
    ours = np.asarray(jax.jit(lambda s, x: nnx.merge(gd, s)(x))(st, jnp.asarray(x)))

    G = m.gdn
    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=m.d_model, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=G.n_heads, linear_num_value_heads=G.n_heads,
        linear_key_head_dim=G.head_dim_k, linear_value_head_dim=G.head_dim_v,
        linear_conv_kernel_dim=G.conv_kernel, rms_norm_eps=m.norm_eps, hidden_act="silu",
    )
    ref = hf.Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in gdn.to_hf(p, m).items()}, strict=True)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(x)).numpy()
    assert calls, "HF did not take its chunked path"
    assert np.abs(ours).max() > 1e-2  # a non-trivial output
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- counts


def test_gdn_142m_parameter_count():
    std = summary.param_counts(_load("gdn-142m-standard"))
    twin = summary.param_counts(_load("gdn-142m-twin"))
    assert std["non_embedding"] == 118_213_520
    d = 768
    # per GDN layer: q, k, v, gate, o (5·d·H·128), a, b, A_log, dt_bias, convs, norm
    assert std["gdn"] == 12 * (5 * d * 768 + 2 * d * 6 + 2 * 6 + 4 * 3 * 768 + 128)
    assert twin["total"] - std["total"] == 50304 * d + d


def test_initialisers_unchanged_since_params_py():
    """A_log and dt_bias come from `gdn.INITIALIZERS` (registered through the GDN family's
    record since they left params.py) and keep their values bit for bit: the functions params.py
    had, written out here, of the same path-derived keys; exp(A_log) ∈ [1e-4, 16] and
    softplus(dt_bias) = dt ∈ [1e-3, 0.1]."""

    def old_dt_bias(key, shape):
        dt = jnp.exp(jax.random.uniform(key, shape) * (np.log(0.1) - np.log(1e-3)) + np.log(1e-3))
        dt = jnp.maximum(dt, 1e-4)
        return dt + jnp.log(-jnp.expm1(-dt))

    old = {"A_log": lambda key, shape: jnp.log(jax.random.uniform(key, shape, minval=1e-4, maxval=16.0)),
           "dt_bias": old_dt_bias}
    m = _load("gdn-tiny-twin", n_layers=4)
    m.gdn.n_heads = 64  # enough values to see the ranges filled
    _, state = params_lib.abstract_state(lambda: gdn.GatedDeltaNet(m))
    p = params_lib.init_params(state, seed=5)
    for name, init in old.items():
        key = jax.random.fold_in(jax.random.key(5), zlib.crc32(name.encode()))  # params.init_value's key
        np.testing.assert_array_equal(p[name], init(key, (64,)))
    a, dt = np.exp(np.asarray(p["A_log"])), np.asarray(jax.nn.softplus(p["dt_bias"]))
    assert 1e-4 <= a.min() < 1 < a.max() <= 16
    assert 1e-3 * (1 - 1e-5) <= dt.min() < 0.01 < dt.max() <= 0.1 * (1 + 1e-5)


# ----------------------------------------------------------------------------- in the model


@pytest.fixture(scope="module")
def hybrid():
    """The 4-layer tiny GDN hybrid (3 GDN + 1 attention), twin head, initialised scanned and
    unscanned, at `highest` (the tests below compare forms that must agree to fp32 rounding).
    `params.init_params` eagerly equals `model.init` (same path keys) and here compiles faster
    than one jit over the whole tree."""
    out = {}
    for scan in (True, False):
        m = _load("gdn-tiny-twin", n_layers=4, dtype="float32", scan_layers=scan)
        m.gdn.precision = "highest"
        graphdef, state = model.abstract(m)
        out[scan] = m, graphdef, params_lib.init_params(state, seed=0)
    return out


def test_hybrid_scanned_equals_unscanned(hybrid):
    tokens = np.random.default_rng(0).integers(0, 50304, (2, 37))
    out = {}
    for scan, (m, graphdef, params) in hybrid.items():
        assert model.layer_pattern(m) == ["gdn", "gdn", "gdn", "attention"]
        out[scan] = np.asarray(jax.jit(lambda p, t: model.bind(graphdef, p)(t))(params, tokens))
    assert np.all(np.isfinite(out[True]))
    np.testing.assert_allclose(out[True], out[False], rtol=0, atol=1e-6)


def test_layer_in_model_equals_step_by_step_decoding(hybrid):
    """Layer 0 of the unscanned hybrid: the chunked full-sequence output equals decoding one
    token at a time with `gated_delta_step` (conv and recurrent state carried in the cache),
    a chunked prefill followed by steps equals both, and so does the naive recurrence."""
    m, graphdef, params = hybrid[False]
    # Non-trivial values on this layer (init has unit norm weight, tiny conv taps).
    r = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x, params)  # a copy: the fixture stays as initialised
    params["trunk"]["layers"][0]["gdn"] = jax.tree.map(
        lambda x: x + 0.1 * jnp.asarray(r.standard_normal(x.shape), jnp.float32),
        params["trunk"]["layers"][0]["gdn"],
    )
    layer = model.bind(graphdef, params).trunk.layers[0].gdn
    assert isinstance(layer, gdn.GatedDeltaNet) and layer.chunk == 64

    B, T, P = 2, 70, 45
    x = jnp.asarray(r.standard_normal((B, T, m.d_model)), jnp.float32)
    gd, st = nnx.split(layer)
    fwd = jax.jit(lambda s, x, recurrent: nnx.merge(gd, s).forward(x, recurrent=recurrent), static_argnums=2)
    step = jax.jit(lambda s, x_t, c: nnx.merge(gd, s).step(x_t, c))
    full, cache_full = fwd(st, x, False)

    cache = layer.init_cache(B)
    ys = []
    for t in range(T):
        y, cache = step(st, x[:, t], cache)
        ys.append(y)
    _close(jnp.stack(ys, 1), full, "step-by-step output")
    _close(cache["state"], cache_full["state"], "step-by-step state")
    for n in ("q", "k", "v"):
        np.testing.assert_array_equal(cache["conv"][n], cache_full["conv"][n])

    y0, cache = fwd(st, x[:, :P], False)
    ys = [y0]
    for t in range(P, T):
        y, cache = step(st, x[:, t], cache)
        ys.append(y[:, None])
    _close(jnp.concatenate(ys, 1), full, "prefill + steps")
    _close(fwd(st, x, True)[0], full, "naive recurrence")


def test_model_loss_at_default_precision(hybrid):
    """The tiny hybrid's loss (mean NLL of the mixture over 2 × 100 tokens: two chunks, the
    second padded) at `default` against `highest`, the same parameters with N(0, 0.1²) added
    to every leaf (at init the logits are near uniform, the loss ≈ ln V whatever the trunk
    computes; with the noise it is 10.95, and the GDN paths matter). Tolerance: |Δloss| ≤
    1e-3 × loss, a quarter of bf16's relative step 2⁻⁸: the bf16 operands may not move the
    loss by as much as one rounding of its own inputs would. Measured: 6.8e-6 × loss here,
    up to 4e-5 with other seeds and noise of 0.1-1.0 (the rounding errors of 200 tokens' GDN
    outputs mostly cancel in the mean). The gradients' agreement is
    test_chunked_equals_recurrence's."""
    m, graphdef, params = hybrid[False]
    r = np.random.default_rng(2)
    params = jax.tree.map(lambda x: x + 0.1 * jnp.asarray(r.standard_normal(x.shape), jnp.float32), params)
    m_default = m.copy_and_resolve_references()
    m_default.gdn.precision = "default"
    tokens = jnp.asarray(r.integers(0, m.vocab_size, (2, 101)), jnp.int32)
    loss = {}
    for name, cfg_m in (("highest", m), ("default", m_default)):
        gd, _ = model.abstract(cfg_m)
        net = lambda p, gd=gd: model.bind(gd, p).target_log_probs(tokens[:, :-1], tokens[:, 1:])  # noqa: E731
        loss[name] = -float(jax.jit(lambda p: jnp.mean(net(p)))(params))
    assert loss["default"] != loss["highest"]  # the setting reached the layers
    assert abs(loss["default"] - loss["highest"]) <= 1e-3 * loss["highest"], loss
