"""Packed documents (`data.packing="documents"`, onona_jax/packing.py): each document of a
window is scored as if it were alone, on every family and head, and a packed training step
equals one on the same documents laid out one per row.

Tolerance: fp32 (conftest sets matmul precision "highest"; `model_of` sets GDN's too). A document alone and the same
document packed form the same sums over the same keys, but not in the same order: attention's
masked keys add exact zeros, while Gated DeltaNet's chunks fall at other offsets (a document
starting mid-chunk is split differently), so its recurrence sums in another order. Log-probs of
magnitude ~11 (ln 50k) then agree to ~1e-6 relative; ATOL = 5e-5 leaves room for that and for
the blocked CPU attention's query blocks, and is far below any masking error (a query reading
one key of another document moves its log-probs by ~1e-2 at this init scale: see
`test_a_leak_across_documents_is_far_above_the_tolerance`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from onona_jax import heads as heads_lib
from onona_jax import models, packing
from onona_jax.train import step as step_lib

ATOL = 5e-5
EOT = 50256
# Document lengths of the packed row, each ended by an eot, then a tail without one (a
# document the next window goes on with). Starts at 0, 7, 8, 21, 41: mid-chunk and on a chunk
# boundary of GDN's tiny chunk (8); a document of one token (an eot alone); one spanning chunks.
LENGTHS = (7, 1, 13, 20)
T = 48


def packed_row(seed: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """tokens [1, T + 1] of documents after one another, and each document's [start, stop)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 5000, T + 1).astype(np.int32)
    spans, at = [], 0
    for n in LENGTHS:
        tokens[at + n - 1] = EOT
        spans.append((at, at + n))
        at += n
    spans.append((at, T))
    tokens[at:] = rng.integers(0, 5000, T + 1 - at)  # the tail: no eot in it
    return tokens[None], spans


def alone(tokens: np.ndarray, spans) -> tuple[np.ndarray, np.ndarray]:
    """Each document as a row of its own, from its first token (inputs and targets [n, T]): what
    follows a document in its row comes after it, so causality keeps it out of its scores."""
    inputs = np.zeros((len(spans), T), np.int32)
    targets = np.zeros((len(spans), T), np.int32)
    for i, (a, b) in enumerate(spans):
        inputs[i, : T - a] = tokens[0, a:T]
        targets[i, : T - a] = tokens[0, a + 1 : T + 1]
    return inputs, targets


def model_of(arch: str, head: str):
    cfg = tiny_config("unused", head=head, arch=arch)
    # GDN's recurrence at fp32 operands: at "default" its matmul operands (the state among them)
    # are rounded to bf16, and a document whose chunks fall at other offsets is rounded at other
    # points (~5e-4 on these log-probs); that rounding is test_gdn.py's to bound, not a mask's.
    cfg.model.gdn.precision = "highest"
    cfg_model = models.eval_config(cfg.model)  # MoE: nothing dropped, so routing is per token alone
    graphdef, params = models.init(cfg_model, 0)
    return models.bind(graphdef, params), cfg


def test_documents_layout():
    row = np.array([[1, 2, EOT, 3, 4, 5, EOT, 6], [EOT, EOT, 1, 2, 3, EOT, 4, 4]], np.int32)
    positions, segments = packing.documents(jnp.asarray(row), EOT)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 0, 1, 2, 3, 0, 1]]
    assert segments.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2, 3, 3]]
    assert np.asarray(packing.kept(row, EOT)).sum() == 11  # every target but those after the 5 eots
    w = np.asarray(packing.loss_weights(jnp.asarray(row), EOT))
    assert w.sum() == pytest.approx(1.0) and (w[row == EOT] == 0).all() and np.allclose(w[row != EOT], 1 / 11)


def check_alone(model, tokens, spans):
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    packed = np.asarray(jax.jit(lambda i, t: model.target_log_probs(i, t, eot=EOT))(inputs, targets))
    ins, outs = alone(tokens, spans)
    single = np.asarray(jax.jit(model.target_log_probs)(jnp.asarray(ins), jnp.asarray(outs)))
    worst = 0.0
    for i, (a, b) in enumerate(spans):
        np.testing.assert_allclose(packed[0, a:b], single[i, : b - a], atol=ATOL, rtol=0,
                                   err_msg=f"document {i} [{a}, {b})")
        worst = max(worst, float(np.abs(packed[0, a:b] - single[i, : b - a]).max()))
    return worst


FAMILIES = tuple(models.FAMILIES)
HEADS = tuple(heads_lib.HEADS)


# GDN's arm is slow: suite-time margin (cover: test_gdn_segments, its resets against the recurrence per document)
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "gdn" else a for a in FAMILIES])
def test_each_family_scores_a_packed_document_as_if_alone(arch):
    model, _ = model_of(arch, "twin")
    check_alone(model, *packed_row())


@pytest.mark.parametrize("head", [h for h in HEADS if h != "twin"])
def test_each_head_scores_a_packed_document_as_if_alone(head):
    model, _ = model_of("dense", head)
    check_alone(model, *packed_row(1))


@pytest.mark.slow
@pytest.mark.parametrize("head", [h for h in HEADS if h != "twin"])
@pytest.mark.parametrize("arch", [a for a in FAMILIES if a != "dense"])
def test_every_family_and_head_scores_a_packed_document_as_if_alone(arch, head):
    model, _ = model_of(arch, head)
    check_alone(model, *packed_row(2))


def test_a_leak_across_documents_is_far_above_the_tolerance():
    """The packed scores are not merely close to the unpacked ones by accident: without the
    masks (windows), the same row's documents after the first differ by far more than ATOL."""
    model, _ = model_of("dense", "twin")
    tokens, spans = packed_row()
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    packed = np.asarray(model.target_log_probs(inputs, targets, eot=EOT))
    windows = np.asarray(model.target_log_probs(inputs, targets))
    a, b = spans[2]
    assert np.abs(packed[0, a:b] - windows[0, a:b]).max() > 100 * ATOL


# GDN's arm is slow: suite-time margin (cover: the dense arm; GDN's resets: test_gdn_segments)
@pytest.mark.parametrize("arch", ["dense", pytest.param("gdn", marks=pytest.mark.slow)])
def test_a_packed_step_equals_one_on_the_documents_laid_out_unpacked(arch):
    """The training loss and its gradients of one packed row (`step.loss_and_aux` with the eot)
    equal those of its documents one per row, each weighted on its own targets but the one
    after its eot, under the same mean (1 / the targets kept)."""
    model, cfg = model_of(arch, "twin")
    graphdef, params = models.init(models.eval_config(cfg.model), 0)
    tokens, spans = packed_row(3)

    def packed_loss(p):
        return step_lib.loss_and_aux(graphdef, p, jnp.asarray(tokens), cfg.model, eot=EOT)[0]

    ins, outs = alone(tokens, spans)
    weights = np.zeros(ins.shape, np.float32)
    for i, (a, b) in enumerate(spans):
        weights[i, : b - a] = ins[i, : b - a] != EOT
    weights /= weights.sum()

    def unpacked_loss(p):
        m = models.bind(graphdef, p)
        h, x0, _ = m.forward(jnp.asarray(ins))
        return m.head.nll(h, x0, jnp.asarray(outs), jnp.asarray(weights), None)[0]

    (lp, gp), (lu, gu) = (jax.jit(jax.value_and_grad(f))(params) for f in (packed_loss, unpacked_loss))
    assert float(lp) == pytest.approx(float(lu), abs=1e-6)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp), jax.tree.leaves(gu)):
        scale = float(np.abs(np.asarray(b)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4 * scale, rtol=0,
                                   err_msg=jax.tree_util.keystr(path[0]))
