"""Document masks in attention (`causal_attention(..., segments=)`, issue 40): a packed row of
several documents attends as if each document ran alone.

Each test packs rows of uneven documents (one of length 1, one crossing a query block of the
CPU's blocked XLA path or a splash tile) and compares with each document sliced out and run
through `causal_attention` without segments. Tolerances, fp32: the masked keys contribute exact
zeros and the row maximum is the document's own, so both sides form the same terms; only the
order of the key sums differs (another vector alignment, a longer reduction padded with zeros;
for splash other tiles of its online softmax), a few fp32 ulps of the largest value: 2e-6 of it
(measured: at most 2.1e-7 for XLA, 1.1e-7 for splash, values and gradients). Splash against XLA
(the sharded test) is 1e-5 of the largest, as tests/unit/test_attention.py allows it.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from onona_jax import attention, sharding

# Per row, the document lengths. T = 256 on the CPU's xla path is four query blocks of 64:
# documents cross the boundaries at 64, 128 and 192, and length-1 documents sit at 0 and 100.
LENGTHS_256 = [[1, 90, 37, 128], [100, 1, 155]]
# Splash, T = 200: pads to 256 in two tiles of 128 (the padded tail is a document of its own).
LENGTHS_200 = [[1, 150, 49], [60, 1, 139]]


def _qkvw(B, T, N, K, H, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(s, np.float32)) for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]]


def _segments(lengths):
    # Ids that are not 0..n-1 (the kernel and the masks compare them only for equality).
    return jnp.asarray([np.repeat(np.arange(len(row)) * 3 + 7, row) for row in lengths], jnp.int32)


def _each_alone(q, k, v, lengths, impl):
    """Each document of each row through causal_attention alone (no segments), put back in place."""
    rows = []
    for b, row in enumerate(lengths):
        starts = np.cumsum([0] + row)
        rows.append(jnp.concatenate([attention.causal_attention(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], impl)
                                     for s, e in zip(starts[:-1], starts[1:])], axis=1))
    return jnp.concatenate(rows, axis=0)


def _close(ours, reference, rel):
    reference = np.asarray(reference)
    np.testing.assert_allclose(np.asarray(ours), reference, rtol=0, atol=rel * max(1.0, float(np.abs(reference).max())))


def _packed_vs_alone(impl, lengths, T, rel, grads=True):
    q, k, v, w = _qkvw(len(lengths), T, 4, 2, 16 if impl == "xla" else 64)  # GQA: 4 query heads over 2 KV heads
    segments = _segments(lengths)
    packed = jax.jit(lambda q, k, v, s: attention.causal_attention(q, k, v, impl, s))(q, k, v, segments)
    alone = jax.jit(lambda q, k, v: _each_alone(q, k, v, lengths, impl))(q, k, v)
    _close(packed, alone, rel)
    # Could fail: plain causal attention over the packed row is far from the documents alone.
    assert float(jnp.abs(attention.causal_attention(q, k, v, impl) - alone).max()) > 0.1
    if grads:
        ours = jax.jit(jax.grad(lambda q, k, v: (attention.causal_attention(q, k, v, impl, segments) * w).sum(),
                                (0, 1, 2)))(q, k, v)
        theirs = jax.jit(jax.grad(lambda q, k, v: (_each_alone(q, k, v, lengths, impl) * w).sum(), (0, 1, 2)))(q, k, v)
        for a, b in zip(ours, theirs):
            _close(a, b, rel)


def test_xla_blocked_packed_rows_equal_each_document_alone():
    """The CPU's query-blocked path (T 256: four blocks of 64), values and gradients; and no
    block forms more than the keys it can see (the largest score matrix is the last block's,
    64 × 256): the segment mask joins each block's causal mask, not a whole square."""
    _packed_vs_alone("xla", LENGTHS_256, 256, 2e-6)
    q, k, v, _ = _qkvw(2, 256, 4, 2, 16)
    hlo = jax.jit(lambda q, k, v, s: attention.causal_attention(q, k, v, "xla", s)).lower(
        q, k, v, _segments(LENGTHS_256)).as_text()
    assert "256x256x" not in hlo and "64x256xf32" in hlo


def test_xla_whole_packed_rows_equal_each_document_alone(monkeypatch):
    """The whole-square path: T 64 on the CPU (one block), and T 256 as on a GPU (`xla` there is
    the whole T × T matrix with the [B, 1, T, T] mask; the platform is faked, the program is the
    one a GPU would get bar the compiler)."""
    _packed_vs_alone("xla", [[1, 40, 23], [64]], 64, 2e-6)
    monkeypatch.setattr(sharding, "platform", lambda: "gpu")
    _packed_vs_alone("xla", LENGTHS_256, 256, 2e-6)
    q, k, v, _ = _qkvw(2, 256, 4, 2, 16)
    hlo = jax.jit(lambda q, k, v, s: attention.causal_attention(q, k, v, "xla", s)).lower(
        q, k, v, _segments(LENGTHS_256)).as_text()
    assert "2x1x256x256xi1" in hlo  # one mask shared by the heads


def test_splash_packed_rows_equal_each_document_alone():
    """Splash in Pallas interpret mode, the kernel's own segment ids: T 200 (two tiles of 128,
    a padded tail), GQA, values and gradients (forward, dq and dkv kernels)."""
    _packed_vs_alone("splash", LENGTHS_200, 200, 2e-6)


def test_splash_segments_sharded_with_the_rows():
    """Under a data 2 × fsdp 2 × tensor 2 mesh the segments are split with the rows (each device
    its rows' ids) and heads over tensor: values equal the documents run alone."""
    lengths = [[1, 100, 27], [128], [64, 64], [3, 1, 124]]
    q, k, v, _ = _qkvw(4, 128, 4, 2, 64, seed=1)
    with sharding.activation_rules(sharding.make_mesh(2, 2, 2)):
        packed = jax.jit(lambda q, k, v, s: attention.causal_attention(q, k, v, "splash", s))(q, k, v, _segments(lengths))
    _close(packed, _each_alone(q, k, v, lengths, "xla"), 1e-5)


def test_none_is_plain_causal_attention():
    """segments=None is today's causal attention: on one block bit for bit
    `jax.nn.dot_product_attention(is_causal=True)` (the same call), over several blocks equal to
    it to fp32 summation order; and one document spanning the row gives the same values."""
    q, k, v, _ = _qkvw(2, 256, 4, 2, 16)
    whole = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.25, implementation="xla")  # noqa: E731
    small = [a[:, :64] for a in (q, k, v)]
    np.testing.assert_array_equal(attention.causal_attention(*small, "xla", None), whole(*small))
    _close(attention.causal_attention(q, k, v, "xla", None), whole(q, k, v), 2e-6)
    one = jnp.zeros((2, 256), jnp.int32)
    _close(attention.causal_attention(q, k, v, "xla", one), attention.causal_attention(q, k, v, "xla"), 2e-6)


@pytest.mark.parametrize("segments,found", [
    (np.zeros((2, 64), np.int64), "int64 [2, 64]"),
    (jnp.zeros((2, 64), jnp.float32), "float32 [2, 64]"),
    (jnp.zeros((2, 63), jnp.int32), "int32 [2, 63]"),
    (jnp.zeros((64,), jnp.int32), "int32 [64]"),
])
@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_bad_segments_are_a_clear_error(segments, found, impl):
    q, k, v, _ = _qkvw(2, 64, 4, 2, 16)
    with pytest.raises(ValueError, match=r"segments must be an int32 array \[B, T\] = \[2, 64\].*got " + re.escape(found) + "; cast"):
        attention.causal_attention(q, k, v, impl, segments)
