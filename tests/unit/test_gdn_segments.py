"""Gated DeltaNet with document resets (packed rows, issue 40): the chunked form with `resets`,
its gradients, and the whole `GatedDeltaNet` layer (conv included) with `segments`, each
against the same computation run on every document ALONE, without segments.

"Alone" is built as a batch: each document of the packed rows becomes its own row, padded at
the end to the longest document (padding comes after every real step, so it changes no output
of the document, and with q = k = v = 0, g = 0, β = 0 no state either), and the naive
recurrence (or the layer) runs once over that batch. Gathers map the packed inputs to that
batch and its outputs back, so the gradients of the reference are w.r.t. the packed inputs too.

Tolerance: TOL_HIGHEST of tests/unit/test_gdn.py (1e-5 of max(1, largest entry)), the tolerance of
its chunked-vs-naive test at `highest`. Everything here is fp32 at `highest`, and the packed
chunked form is that same comparison: a packed document is a chunked computation whose chunks
start at other offsets than the document's own, with masks that are exact (products with 0, exp
of −inf), so its error must stay at fp32 rounding of the chunked form. Measured: outputs, states and
gradients ≤ 4e-7 of max(1, their largest entry) (gradients up to 17): 25× below the tolerance.

The layouts: chunk 16 (the chunk is a parameter; small chunks give many boundaries in a short
row), rows of 150 (10 chunks, the last padded by 10). Row 0 has documents of 16 (ending at a
chunk boundary, the next starting at one), 29 (mid-chunk end), 1 (a single token mid-chunk),
57 (spanning five chunks), 3, 11 and 33 (into the padded chunk). Row 1: 15, 1 (a one-token
document at a chunk's last position), 32 (two whole chunks, aligned), 9, 1, 1 (two single
tokens in a row), 91. Decays per head: mild, fast (g to ~ −100), almost none (−1e-3), extreme
(−1e4), and one alternating by document between extreme (−1e4·softplus) and almost none. That
head is the numerics check: a running cumulative sum over the chunk (a reset made of a huge
negative g, or masks over the plain cumsum) puts an almost-none document's g of ~1e-3 onto a γ
of ~ −1e5, whose fp32 ulp is 0.016, and loses them; a per-document sum keeps them. (Masks over
the plain cumsum were measured to miss by 1.8e-4 here, 18× the tolerance.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from onona_jax.models import gdn
from test_gdn import _close, _gdn_model, _layer

C = 16
LENGTHS = ([16, 29, 1, 57, 3, 11, 33], [15, 1, 32, 9, 1, 1, 91])
T = sum(LENGTHS[0])
B, H, DK, DV = 2, 5, 16, 8


def _segments():
    """segments [B, T] (row 1's ids start at 7: any non-decreasing ids) and the documents as
    (row, start, length)."""
    assert all(sum(lens) == T for lens in LENGTHS)
    seg = np.stack([np.repeat(np.arange(len(lens)) + 7 * b, lens) for b, lens in enumerate(LENGTHS)])
    docs = [(b, int(np.sum(lens[:i])), n) for b, lens in enumerate(LENGTHS) for i, n in enumerate(lens)]
    return jnp.asarray(seg, jnp.int32), docs


def _alone(docs):
    """Index arrays between the packed rows and the batch of documents alone: (rows [D, L],
    times [D, L], valid [D, L]) gather a document's tokens from [B, T, ...]; (doc [B, T], offset
    [B, T]) gather a packed token's result from [D, L, ...]."""
    L = max(n for _, _, n in docs)
    rows = np.array([[b] * L for b, _, _ in docs])
    times = np.array([[min(s + t, s + n - 1) for t in range(L)] for _, s, n in docs])
    valid = np.array([[t < n for t in range(L)] for _, _, n in docs])
    doc, offset = np.zeros((B, T), int), np.zeros((B, T), int)
    for d, (b, s, n) in enumerate(docs):
        doc[b, s : s + n], offset[b, s : s + n] = d, np.arange(n)
    return (rows, times, valid), (doc, offset)


def _gather_docs(a, index):
    rows, times, valid = index
    x = a[rows, times]
    return jnp.where(jnp.asarray(valid).reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0)


def _inputs(seg, seed=0):
    """Unit-norm keys, queries scaled by dk^-½ (as the layer feeds them); g per head as the
    module docstring says (the alternating head by `seg`'s parity); initial states of order
    one (they enter each row's first document, the tail of one begun in an earlier window)."""
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    q = gdn.l2_normalize(n(B, T, H, DK)) * DK**-0.5
    k = gdn.l2_normalize(n(B, T, H, DK))
    v = n(B, T, H, DV)
    alternate = jnp.where(np.asarray(seg) % 2 == 0, 1e4, 1e-3)[..., None]  # [B, T, 1]
    fixed = jnp.broadcast_to(jnp.asarray([1.0, 30.0, 1e-3, 0.0]), (B, T, 4))
    scale = jnp.concatenate([fixed, alternate], -1)
    g = -jax.nn.softplus(n(B, T, H)) * scale + jnp.asarray([0.0, 0.0, 0.0, -1e4, 0.0])
    beta = jax.nn.sigmoid(n(B, T, H))
    return (q, k, v, g, beta), 0.5 * n(B, H, DK, DV)


def test_document_starts():
    seg, docs = _segments()
    starts = np.asarray(gdn.document_starts(seg))
    expected = np.zeros((B, T), bool)
    for b, s, _ in docs:
        expected[b, s] = s > 0  # a row's first token starts nothing: it takes the initial state
    np.testing.assert_array_equal(starts, expected)


def test_chunked_with_resets_equals_documents_alone():
    """Outputs, final states (the last document's) and the gradients w.r.t. q, k, v, g, β and
    the initial state of the chunked form with resets, against the naive recurrence on each
    document alone (the first document of a row starting from that row's initial state, the
    others from zeros), within TOL_HIGHEST. The naive recurrence with resets equals it too
    (within TOL_HIGHEST: its steps are the alone runs' steps, with zeros where they start)."""
    seg, docs = _segments()
    to_docs, to_packed = _alone(docs)
    args, s0 = _inputs(seg)
    resets = gdn.document_starts(seg)
    first = np.array([s == 0 for _, s, _ in docs])
    last = [max(d for d, (b2, _, _) in enumerate(docs) if b2 == b) for b in range(B)]
    r = np.random.default_rng(1)
    w_o = jnp.asarray(r.standard_normal((B, T, H, DV)), jnp.float32)
    w_s = jnp.asarray(r.standard_normal((B, H, DK, DV)), jnp.float32)

    def alone(args, s0):
        init = jnp.where(first[:, None, None, None], s0[to_docs[0][:, 0]], 0.0)
        o, s = gdn.recurrent_gated_delta_rule(*(_gather_docs(a, to_docs) for a in args), initial_state=init,
                                              precision="highest")
        return o[to_packed], s[np.array(last)]

    packed = lambda args, s0: gdn.chunked_gated_delta_rule(  # noqa: E731
        *args, chunk=C, initial_state=s0, precision="highest", resets=resets)
    naive = lambda args, s0: gdn.recurrent_gated_delta_rule(  # noqa: E731
        *args, initial_state=s0, precision="highest", resets=resets)

    def loss(fn, args, s0):
        o, s = fn(args, s0)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

    @jax.jit
    def run(args, s0):
        grad = lambda fn: jax.grad(lambda a, s: loss(fn, a, s), argnums=(0, 1), has_aux=True)(args, s0)  # noqa: E731
        return grad(alone), grad(packed), naive(args, s0)

    ((ga, gs_a), (o_a, s_a)), ((gb, gs_b), (o_b, s_b)), (o_n, s_n) = run(args, s0)
    assert np.abs(np.asarray(o_a)).max() > 0.1 and np.abs(np.asarray(s_a)).max() > 0.1  # non-trivial
    _close(o_b, o_a, "o")
    _close(s_b, s_a, "final state")
    for name, x, y in zip(("q", "k", "v", "g", "beta"), gb, ga):
        _close(x, y, f"d/d{name}")
    _close(gs_b, gs_a, "d/d initial_state")
    _close(o_n, o_a, "naive with resets")
    _close(s_n, s_a, "naive with resets, final state")
    # The resets matter: the same row without them differs far beyond the tolerance.
    o_plain, _ = jax.jit(lambda a, s: gdn.chunked_gated_delta_rule(*a, chunk=C, initial_state=s,
                                                                   precision="highest"))(args, s0)
    assert np.abs(np.asarray(o_plain) - np.asarray(o_a)).max() > 1e-2


def test_no_resets_equals_plain():
    """resets all False (segments all one id) is the plain computation: the same outputs and
    state as resets=None, at both precisions, within TOL_HIGHEST. Not bit for bit: the
    per-document cumulative sum is an associative scan, which adds the same g in another order
    than cumsum; where a chunk's γ reaches −1500 (the fast and alternating heads) its fp32 ulp
    is 1e-4, and the two orders' roundings differ by that. Measured: 2.4e-6 at `highest`
    (the alternating head), 0 at `default` (the bf16 operands absorb it)."""
    seg, _ = _segments()
    args, s0 = _inputs(jnp.zeros_like(seg), seed=2)  # one document: its alternating head is fast throughout
    none = jnp.zeros((B, T), bool)
    for precision in gdn.PRECISIONS:
        f = jax.jit(lambda a, s, r, p=precision: gdn.chunked_gated_delta_rule(*a, chunk=C, initial_state=s,
                                                                               precision=p, resets=r))
        (o0, s_0), (o1, s_1) = f(args, s0, None), f(args, s0, none)
        _close(o1, o0, f"o, {precision}")
        _close(s_1, s_0, f"state, {precision}")


@pytest.fixture(scope="module")
def layer():
    m = _gdn_model(n_heads=2, head_dim_k=16, head_dim_v=24, precision="highest", chunk=C)
    assert m.gdn.conv_kernel > 2  # the conv reaches back across document starts
    return _layer(m)[0], m


def test_layer_with_segments_equals_documents_alone(layer):
    """The whole GatedDeltaNet (projections, the causal conv, the chunked rule, gated norm)
    on packed rows with `segments` against the layer on each document alone (a batch of
    documents, no segments), within TOL_HIGHEST; so is the cache it returns (the last
    document's conv inputs and state), and the naive recurrence's form (recurrent=True)."""
    layer, m = layer
    seg, docs = _segments()
    to_docs, to_packed = _alone(docs)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, m.d_model)), jnp.float32)
    gd, st = nnx.split(layer)

    @jax.jit
    def run(st, x):
        net = nnx.merge(gd, st)
        alone, _ = net.forward(_gather_docs(x, to_docs))
        # The cache alone: each row's last document exactly (a padded one would be decayed by
        # its pad steps: a zero input still has g ≠ 0 in the layer).
        caches = [net.forward(x[b : b + 1, s : s + n])[1] for b, s, n in (docs[6], docs[13])]
        packed, cache = net.forward(x, segments=seg)
        naive, _ = net.forward(x, recurrent=True, segments=seg)
        plain = net(x, None, None)
        return alone[to_packed], jax.tree.map(lambda *a: jnp.concatenate(a), *caches), packed, cache, naive, plain

    assert [d[0] for d in docs] == [0] * 7 + [1] * 7
    alone, cache_alone, packed, cache, naive, plain = run(st, x)
    assert np.abs(np.asarray(alone)).max() > 0.1
    _close(packed, alone, "layer output")
    _close(naive, alone, "layer output, naive recurrence")
    _close(cache["state"], cache_alone["state"], "cache state")
    for name in ("q", "k", "v"):  # the last document's last K − 1 conv inputs (a short one: test_causal_conv_resets)
        _close(cache["conv"][name], cache_alone["conv"][name], f"cache conv {name}")
    assert np.abs(np.asarray(plain) - np.asarray(alone)).max() > 1e-2  # segments matter
    # __call__ (the mixer interface a block uses) takes them too.
    called = jax.jit(lambda st, x: nnx.merge(gd, st)(x, None, seg))(st, x)
    np.testing.assert_array_equal(called, packed)


def test_layer_all_zero_segments_equals_none(layer):
    """segments of one id everywhere compute what segments=None does, within TOL_HIGHEST
    (the per-document cumulative sum's order: test_no_resets_equals_plain)."""
    layer, m = layer
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, m.d_model)), jnp.float32)
    gd, st = nnx.split(layer)
    f = jax.jit(lambda st, x, seg: nnx.merge(gd, st)(x, None, seg))
    _close(f(st, x, jnp.zeros((B, T), jnp.int32)), f(st, x, None), "zero segments")


def test_causal_conv_resets():
    """The conv on packed rows equals the conv on each document alone, exactly (each output is
    the same few products, the others' taps now multiply exact zeros), with a carried state
    read only by the first document; the new state holds only the last document's inputs,
    zeros before it (here a last document of 2 tokens, kernel 4)."""
    r = np.random.default_rng(5)
    K, lens = 4, [3, 1, 6, 2]
    Tc = sum(lens)
    x = jnp.asarray(r.standard_normal((1, Tc, 2, 3)), jnp.float32)
    w = jnp.asarray(r.standard_normal((K, 2, 3)), jnp.float32)
    state = jnp.asarray(r.standard_normal((1, K - 1, 2, 3)), jnp.float32)
    resets = gdn.document_starts(jnp.asarray(np.repeat(np.arange(4), lens))[None])
    out, new = gdn.causal_conv(x, w, state, resets)
    s = 0
    for i, n in enumerate(lens):
        o, st = gdn.causal_conv(x[:, s : s + n], w, state if i == 0 else None)
        np.testing.assert_array_equal(out[:, s : s + n], o)
        s += n
    np.testing.assert_array_equal(new, st)
    assert np.all(np.asarray(new[:, 0]) == 0) and np.all(np.asarray(new[:, 1:]) != 0)
