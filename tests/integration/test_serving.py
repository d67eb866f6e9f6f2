"""Serving (SPEC §1): incremental decoding equals the full forward pass for every family,
one-projection sampling is an exact sample of the twin mixture (and the pre-softmax
mixture is not), greedy generation is the argmax of the full-forward mixture, the folded
gate equals the model's. fp32, small vocabularies."""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO
from onona_jax import config
from onona_jax import models as model
from onona_jax.models import moe
from onona_jax.serve import server as serving
from onona_jax import params as params_lib

PAPER = os.path.join(REPO, "configs", "paper.py")
V = 512


def _noisy(params, seed=0, std=0.1):
    """Every leaf + N(0, std²): norm weights off one, AttnRes queries off zero, conv taps and
    gates large enough that every path matters."""
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + std * jnp.asarray(r.standard_normal(x.shape), jnp.float32), params)


def _init(m, seed=0):
    """(graphdef, noisy params); eager path-keyed init compiles nothing (faster than jit here)."""
    graphdef, state = model.abstract(m)
    return graphdef, _noisy(params_lib.init_params(state, 0), seed)


def _model_cfg(arch, scan, block_size=1):
    m = config.load(f"{PAPER}:{arch}-tiny-twin").model
    m.update(scan_layers=scan, vocab_size=V, dtype="float32")
    if arch == "gdn":
        m.update(n_layers=4)  # one 3 GDN + 1 attention group
        m.gdn.chunk = 4  # the prompt spans several chunks
        m.gdn.precision = "highest"  # chunked prefill vs the decoding step to fp32 rounding (1e-5)
    if arch == "moe":
        m = moe.eval_config(m)  # serving capacity: nothing dropped
    m.attnres.block_size = block_size
    return m


# ----------------------------------------------------------------------------- incremental decoding


@pytest.mark.parametrize(
    "arch,scan,block_size",
    [
        ("dense", True, 1), ("dense", False, 1),
        ("moe", True, 1), ("moe", False, 1),
        ("gdn", True, 1), ("gdn", False, 1),
        ("attnres", True, 1), ("attnres", False, 1), ("attnres", True, 3),
    ],
)
def test_incremental_decoding_equals_full_forward(arch, scan, block_size):
    """Prefill 6 slots, then decode one token at a time: the log-probabilities (and hidden
    states) at every position equal the full forward pass's. Row 1 is left-padded by 3 slots
    (`start`), so it must equal the full forward of its own, unpadded sequence."""
    m = _model_cfg(arch, scan, block_size)
    graphdef, params = _init(m)
    B, T, P, pad = 2, 12, 6, 3
    r = np.random.default_rng(1)
    tokens = jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)
    padded = tokens.at[1].set(jnp.concatenate([jnp.full((pad,), 7, jnp.int32), tokens[1, : T - pad]]))
    start = jnp.asarray([0, pad], jnp.int32)

    @jax.jit
    def run(params, tokens, padded):
        net = model.bind(graphdef, params)
        h_full, x0_full = net.hidden(tokens)
        h, x0, cache = net.prefill(padded[:, :P], T + 4, start)  # 4 spare slots

        def step(cache, token):
            h, x0, cache = net.decode_step(token, cache)
            return cache, (h, x0)

        cache, (hs, x0s) = jax.lax.scan(step, cache, padded[:, P:].T)
        h_inc = jnp.concatenate([h, jnp.moveaxis(hs, 0, 1)], 1)
        x0_inc = jnp.concatenate([x0, jnp.moveaxis(x0s, 0, 1)], 1)
        lp = lambda h, x0: net.head.log_probs(h, x0)  # noqa: E731
        return lp(h_full, x0_full), lp(h_inc, x0_inc), h_full, h_inc, cache["length"]

    lp_full, lp_inc, h_full, h_inc, length = jax.device_get(run(params, tokens, padded))
    assert int(length) == T and np.all(np.isfinite(lp_inc))
    np.testing.assert_allclose(lp_inc[0], lp_full[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(lp_inc[1, pad:], lp_full[1, : T - pad], rtol=0, atol=1e-5)
    np.testing.assert_allclose(h_inc[0], h_full[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(h_inc[1, pad:], h_full[1, : T - pad], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- exact one-projection sampling


def _chi2_sf(stat: float, df: int) -> float:
    """P(χ²_df ≥ stat): scipy when importable, else the Wilson–Hilferty normal approximation."""
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, df))
    except ImportError:
        z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
        return 0.5 * math.erfc(z / math.sqrt(2))


def _gof(samples, probs) -> float:
    """Chi-square goodness-of-fit p-value of integer samples against probabilities."""
    counts = np.bincount(np.asarray(samples).reshape(-1), minlength=len(probs)).astype(np.float64)
    expected = counts.sum() * np.asarray(probs, np.float64)
    assert expected.min() >= 5, "every cell needs an expected count of at least 5"
    return _chi2_sf(float(np.sum((counts - expected) ** 2 / expected)), len(probs) - 1)


@functools.lru_cache(maxsize=None)
def _small_problem():
    """V=20, d=8 tables whose softmaxes differ clearly, one hidden state, gate 0.35."""
    r = np.random.default_rng(0)
    Vs, d = 20, 8
    A = jnp.asarray(0.5 * r.standard_normal((Vs, d)), jnp.float32)
    B = jnp.asarray(0.5 * r.standard_normal((Vs, d)), jnp.float32)
    h = jnp.asarray(r.standard_normal(d), jnp.float32)
    g = 0.35
    mixture = g * jax.nn.softmax(A @ h) + (1 - g) * jax.nn.softmax(B @ h)
    return A, B, h, g, np.asarray(mixture, np.float64)


def test_one_projection_sampling_is_exact():
    """200,000 draws of `sample_one_projection` fit g·softmax(Ah) + (1−g)·softmax(Bh)
    (chi-square p > 0.001); the same number of draws from the pre-softmax mixture
    softmax((gA + (1−g)B) h) (= softmax(Mh) at g = ½) is rejected (p < 0.001); the mixture
    sampler of the other modes, `sample_log_probs` on the mixture log-probs, is accepted."""
    A, B, h, g, mixture = _small_problem()
    n_calls, N = 10, 20_000
    hs, gs = jnp.broadcast_to(h, (N, h.shape[0])), jnp.full((N,), g, jnp.float32)
    one = jax.jit(lambda k: serving.sample_one_projection(k, hs, A, B, gs, max_branches=4))
    draws = np.concatenate([np.asarray(one(jax.random.key(i))) for i in range(n_calls)])
    assert draws.shape == (n_calls * N,)
    assert _gof(draws, mixture) > 1e-3

    pre_logits = (g * A + (1 - g) * B) @ h
    pre = jax.random.categorical(jax.random.key(123), jnp.broadcast_to(pre_logits, (n_calls * N, A.shape[0])))
    assert np.abs(np.asarray(jax.nn.softmax(pre_logits)) - mixture).max() > 0.01
    assert _gof(pre, mixture) < 1e-3

    log_mix = jnp.log(jnp.asarray(mixture, jnp.float32))
    post = serving.sample_log_probs(jax.random.key(7), jnp.broadcast_to(log_mix, (n_calls * N, A.shape[0])))
    assert _gof(post, mixture) > 1e-3


def _dots(jaxpr):
    """[(lhs rows, rhs shape)] of every dot_general in a jaxpr, sub-jaxprs included, and the
    cond/switch equations met on the way."""
    dots, conds = [], []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            dots.append((eqn.invars[0].aval.shape[0], tuple(eqn.invars[1].aval.shape)))
        if eqn.primitive.name == "cond":
            conds.append(eqn)
            continue  # branches are counted per branch by the caller
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    d, c = _dots(inner)
                    dots += d
                    conds += c
    return dots, conds


@pytest.mark.parametrize("n", [1, 5])
def test_one_projection_computes_one_projection_per_row(n):
    """Outside the switch there is no projection; every branch projects each of the n rows
    exactly once (batch 1: the two branches are h Aᵀ and h Bᵀ). Values: row r is h_r Aᵀ if
    c_r else h_r Bᵀ."""
    A, B, _, _, _ = _small_problem()
    r = np.random.default_rng(n)
    h = jnp.asarray(r.standard_normal((n, A.shape[1])), jnp.float32)
    c = jnp.asarray(r.random(n) < 0.5) if n > 1 else jnp.asarray([True])
    jaxpr = jax.make_jaxpr(lambda h, c: serving.one_projection_logits(h, A, B, c))(h, c).jaxpr
    outside, conds = _dots(jaxpr)
    assert outside == [] and len(conds) == 1
    branches = conds[0].params["branches"]
    assert len(branches) == n + 1
    for branch in branches:
        dots, _ = _dots(branch.jaxpr)
        assert sum(rows for rows, _ in dots) == n
        assert all(shape == A.shape for _, shape in dots)
    if n == 1:
        assert all(len(_dots(b.jaxpr)[0]) == 1 for b in branches)
    for cc in ([True] * n, [False] * n, list(np.asarray(c))):
        cc = jnp.asarray(cc)
        got = serving.one_projection_logits(h, A, B, cc)
        want = jnp.where(cc[:, None], h @ A.T, h @ B.T)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def twin_server():
    cfg = config.load(f"{PAPER}:dense-tiny-twin")
    cfg.model.update(vocab_size=256, n_layers=2)
    graphdef, params = _init(cfg.model, seed=3)
    return serving.Server(cfg, params), graphdef, params


def test_server_gate_and_scoring(twin_server):
    """Precomputed g = gate_probs of every token (1e-6); log_probs = the model's (1e-5)."""
    server, graphdef, params = twin_server
    net = model.bind(graphdef, params)
    tokens = jnp.arange(server.vocab_size)
    np.testing.assert_allclose(server.gate[:, 0], np.asarray(net.head.gate_probs(tokens)), rtol=0, atol=1e-6)
    seq = np.random.default_rng(0).integers(0, server.vocab_size, (2, 9))
    np.testing.assert_allclose(server.log_probs(seq), np.asarray(net(jnp.asarray(seq))), rtol=0, atol=1e-5)


def test_greedy_generation_is_argmax_of_full_forward(twin_server):
    """Batched greedy decoding (prompts of different lengths, left-padded) picks, at every
    step, the argmax of the full-forward mixture log-probs of the sequence so far; a stop
    token ends a row (and is not returned)."""
    server, _, _ = twin_server
    prompts = [[5, 9, 33, 100, 7, 1, 200], [42, 17]]
    out = server.generate(prompts, 6, greedy=True)
    assert [len(o) for o in out] == [6, 6]
    # Causal: position t of the full forward of prompt + continuation scores step t's choice.
    # One call for both rows, right-padded (padding after a position never changes it).
    seqs = [p + o for p, o in zip(prompts, out)]
    width = max(map(len, seqs))
    log_probs = server.log_probs([s + [0] * (width - len(s)) for s in seqs])
    for b, (prompt, new) in enumerate(zip(prompts, out)):
        for i, token in enumerate(new):
            step = log_probs[b, len(prompt) - 1 + i]
            assert token == int(np.argmax(step))
            assert step[token] > np.partition(step, -2)[-2]  # a strict maximum, no tie
    j = next(j for j in range(1, 6) if out[0][j] not in out[0][:j])
    stop = out[0][j]
    stopped = server.generate(prompts, 6, greedy=True, stop_tokens=(stop,))
    cut = lambda row: row[: row.index(stop)] if stop in row else row  # noqa: E731
    assert stopped == [cut(out[0]), cut(out[1])] and stopped[0] == out[0][:j]


def test_sampling_modes(twin_server):
    """One-projection sampling and mixture sampling run, stay in the vocabulary, repeat with
    the seed; one_projection refuses settings that act on the mixture."""
    server, _, _ = twin_server
    prompts = [[1, 2, 3], [4]]
    a = server.generate(prompts, 5, one_projection=True, seed=1)
    assert a == server.generate(prompts, 5, one_projection=True, seed=1)
    b = server.generate(prompts, 5, temperature=0.8, top_k=10, top_p=0.9, seed=1)
    for rows in (a, b):
        assert [len(r) for r in rows] == [5, 5]
        assert all(0 <= t < server.vocab_size for r in rows for t in r)
    for bad in (dict(temperature=0.7), dict(top_k=5), dict(top_p=0.9), dict(greedy=True)):
        with pytest.raises(ValueError, match="one_projection"):
            server.generate(prompts, 2, one_projection=True, **bad)
    with pytest.raises(ValueError, match="max_len"):
        server.generate([[1] * 30], 8)


def test_top_k_and_top_p_truncate_exactly_the_tail():
    """`sample_log_probs` keeps exactly the k most probable tokens (top-k) and the smallest
    most-probable set reaching p (top-p): 20,000 draws from a known 12-token distribution
    land only in the kept set and hit every token of it; without truncation the tail is hit."""
    p = np.array([0.30, 0.20, 0.12, 0.10, 0.08, 0.06, 0.05, 0.04, 0.02, 0.015, 0.01, 0.005])
    rng = np.random.default_rng(0)
    perm = rng.permutation(p.size)  # the order of the vocabulary must not matter
    log_p = jnp.log(jnp.asarray(p[perm], jnp.float32))
    n = 20_000
    draws = lambda **kw: set(np.asarray(serving.sample_log_probs(  # noqa: E731
        jax.random.key(3), jnp.broadcast_to(log_p, (n, p.size)), **kw)).tolist())
    rank = {int(tok): r for r, tok in enumerate(np.argsort(-p[perm], kind="stable"))}
    top = lambda k: {t for t, r in rank.items() if r < k}  # noqa: E731
    assert draws() == set(range(p.size))  # untruncated: every token, the 0.5% one included
    assert draws(top_k=3) == top(3)
    # top_p = 0.6: 0.30 + 0.20 = 0.50 < 0.6, + 0.12 = 0.62 ≥ 0.6 -> the three most probable
    assert draws(top_p=0.6) == top(3)
    assert draws(top_p=0.45) == top(2)  # 0.30 + 0.20 = 0.50 ≥ 0.45: two tokens
    # top-k first, then top-p on the renormalised top 5 (0.375, 0.25, 0.15, 0.125, 0.1):
    # 0.775 < 0.85 ≤ 0.9 -> four tokens
    assert draws(top_k=5, top_p=0.85) == top(4)
