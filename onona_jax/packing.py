"""Documents packed in a window (`data.packing="documents"`).

A window of seq_len + 1 tokens is cut across documents (prepare ends each with one end-of-text
token, `eot`). With "documents" packing the model treats each document in it as a sequence of
its own, as MaxText, levanter and torchtitan do with segment ids:

    tokens    a  b  EOT  c  d  e  EOT  f      (the inputs of one row)
    segments  0  0  0    1  1  1  1    2      the eot belongs to the document it ends
    positions 0  1  2    0  1  2  3    0      RoPE restarts with each document
    in loss   1  1  0    1  1  1  0    1      the target after an eot is not predicted

Attention sees only its own document (`attention.causal_attention`), Gated DeltaNet's state
and short convolution restart at each document (`models.gdn`); AttnRes's depth mixing and a
MoE's routing are per token already and need nothing. The target after an eot (the next
document's first token) is left out of the loss, as levanter does: under packing the query at
an eot has seen only the document it ends, so that prediction is noise. The loss is the mean
over the targets kept (`loss_weights`).

Nothing is stored: segments and positions follow from the tokens on the device, so the
batches, the data pipeline and the checkpointed data state are those of "windows".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from onona_jax import tokenizer as tokenizer_lib


def packed_eot(cfg) -> int | None:
    """The id that ends each packed document under data.packing="documents" (the tokenizer's
    eot: data.tokenizer, data.eot), or None for the paper's windows."""
    if cfg.data.get("packing", "windows") != "documents":
        return None
    return tokenizer_lib.from_config(cfg.data).eot


def documents(inputs, eot: int):
    """(positions, segments), int32 [B, T] each, of packed rows of input tokens [B, T]."""
    ends = inputs == eot
    starts = jnp.pad(ends[:, :-1], ((0, 0), (1, 0)))  # the token after an eot starts a document
    segments = jnp.cumsum(starts, axis=-1, dtype=jnp.int32)
    index = jnp.broadcast_to(jnp.arange(inputs.shape[-1], dtype=jnp.int32), inputs.shape)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=inputs.ndim - 1)  # its document's first slot
    return index - first, segments


def kept(inputs, eot: int):
    """bool [B, T]: the targets the loss counts (all but the one after each eot)."""
    return inputs != eot


def loss_weights(inputs, eot: int | None, total=None):
    """fp32 [B, T] per-target weights of the mean loss: 1/N each (N targets), or with packing
    1/N' on the N' targets `kept` and 0 after each eot. The fused loss takes weights, not a
    mean, because it forms its gradients in the forward pass (heads.Head.nll). `total`: the
    N' to divide by when these rows are one micro-batch of several (`train.step`), so that the
    micro-batches' sum is the global batch's mean, not a mean of means."""
    if eot is None:
        return jnp.full(inputs.shape, 1.0 / inputs.size, jnp.float32)
    keep = kept(inputs, eot).astype(jnp.float32)
    total = jnp.maximum(jnp.sum(keep), 1.0) if total is None else total
    return keep / total
