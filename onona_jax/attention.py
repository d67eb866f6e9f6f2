"""Causal grouped-query attention for training and scoring, one function per backend
(`model.attention_impl`):

* `xla`: `jax.nn.dot_product_attention`, plain XLA, its score matrix kept for the backward
  pass. What runs on CPU, where it is computed in blocks of query rows, each against only the
  keys it can see (`CPU_QUERY_BLOCKS`): the masked upper triangle is never computed. On TPU
  and GPU (where `auto` picks a flash kernel instead) it is the whole T × T matrix.
* `splash`: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), the
  TPU flash kernel MaxText uses: scores live in VMEM tiles, fully masked blocks are skipped,
  the backward pass recomputes from the log-sum-exp. On a CPU it runs in Pallas interpret mode
  (slow; for tests and for checking a config before booking a slice).
* `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention
  on NVIDIA GPUs (bf16 or fp16 inputs only).
* `auto` (the default): splash on TPU, cuDNN on GPU when the compute dtype is bf16 (XLA in fp32,
  which cuDNN does not take), XLA on CPU. Decided from the devices of the mesh the step is traced
  under (`sharding.active_mesh`), so an ahead-of-time compile for a TPU slice from a CPU host
  picks what the slice will run.

Every backend takes q [B, T, N, hd] and k, v [B, T, K, hd] (query head n reads KV head
n // (N/K)) and scales by hd^-½. With `segments` (int32 [B, T], the document id of each token of
a packed row: `packing.documents`) query i sees key j iff j <= i and both are of one document;
without them (None) the program is exactly the causal one. The KV-cache decoding path
(`layers.cached_attention`) is plain XLA on every backend: one query row against the cache has
no score matrix to fuse away.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from onona_jax import sharding

IMPLS = ("auto", "xla", "splash", "cudnn")
# The names remat policies save by (layers.REMAT_POLICIES): each layer's attention inputs (q, k, v
# after QK-norm and RoPE) and its output, with splash's residuals (output, log-sum-exp).
QKV, OUTPUT = "qkv", "attention"
# Splash tiles: multiples of the TPU's 128 lanes; the largest of these that divides the padded
# sequence (MaxText's default is 512 for both).
SPLASH_BLOCKS = (512, 256, 128)
# `xla` on CPU: query blocks of at least 64 rows, at most 16 of them (the ops of each block are
# unrolled in the layer). The computed share of the square is (n + 1) / 2n for n blocks, which
# at the d 512 step's shapes makes forward and backward faster than the whole square
# (benchmarks/peer.py --what=parts; figures in docs/performance.md, "Figures").
CPU_QUERY_BLOCK, CPU_QUERY_BLOCKS = 64, 16


def resolve(impl: str | None, dtype) -> str:
    """The backend `impl` names on this platform (`auto` decides; None is `xla`, as configs
    saved before `auto` existed meant). A kernel the platform cannot run is an error."""
    where, low = sharding.platform(), jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    impl = "xla" if impl is None else impl
    if impl == "auto":
        impl = "splash" if where == "tpu" else "cudnn" if where == "gpu" and low else "xla"
    if impl == "cudnn" and (where != "gpu" or not low):
        raise ValueError(
            f"model.attention_impl='cudnn' needs an NVIDIA GPU and model.dtype=bfloat16 (here: {where}, "
            f"{jnp.dtype(dtype).name}); use model.attention_impl=auto or xla")
    precision = jax.config.jax_default_matmul_precision
    if impl == "splash" and where == "tpu" and low and precision not in (None, "default", "bfloat16", "fastest"):
        # Mosaic refuses an fp32 contract precision on bf16 operands (its compile fails deep in
        # the kernel); a bf16 model gains nothing from it.
        raise ValueError(
            f"splash attention on TPU with model.dtype={jnp.dtype(dtype).name} cannot run under "
            f"jax_default_matmul_precision={precision!r}; unset it (bf16 matmuls ignore it) or use "
            "model.attention_impl=xla")
    return impl


def causal_attention(q, k, v, impl: str | None = "auto", segments=None):
    """Causal grouped-query attention by `impl` (see the module docstring) → [B, T, N, hd];
    with `segments` (int32 [B, T]) also within each document only."""
    impl = resolve(impl, q.dtype)
    if segments is not None:
        check_segments(segments, q)
    if impl == "splash":
        # off TPU: Pallas interpret mode
        return splash_attention(q, k, v, interpret=sharding.platform() != "tpu", segments=segments)
    if impl == "xla" and sharding.platform() == "cpu":
        return _query_blocked(q, k, v, segments)
    # With segments, the whole square under a [B, 1, T, T] bool mask. For cuDNN, jax 0.10.2
    # offers two document forms: this mask, which it turns into an additive bias in the compute
    # dtype (bf16 [B, 1, T, T]; is_causal still lets the kernel skip the upper tiles), and the
    # packed layout (`q_offsets`/`kv_offsets` with per-document lengths), which builds no [T, T]
    # array but in 0.10.2 (a) scales the KV offsets by the query heads' stride, silently wrong
    # under GQA (fixed upstream by jax-ml/jax#39521), (b) checks for a live Hopper GPU while
    # tracing, so a deviceless compile for a GPU host cannot trace it, and (c) needs a static
    # bound on documents per row. Hence the mask: compiled deviceless for an H100 host it is
    # cuDNN's `fmhaScaleBiasSoftmax` and its backward (which also writes an unused dbias); jax's
    # own tests run this mask only broadcast over the batch, so confirm [B, 1, T, T] on a GPU.
    return jax.nn.dot_product_attention(q, k, v, mask=_document_mask(segments), is_causal=True,
                                        scale=1.0 / math.sqrt(q.shape[-1]), implementation=impl)


def _document_mask(segments):
    """bool [B, 1, T, T]: query and key of one document (shared by the heads); None without
    segments, which is dot_product_attention's own default (the program is exactly the causal one)."""
    return None if segments is None else segments[:, None, :, None] == segments[:, None, None, :]


def check_segments(segments, q) -> None:
    """Segments must be int32 [B, T] of q's rows: caught here, before a kernel fails obscurely
    (or a wider or float id compares wrongly)."""
    shape, dtype = getattr(segments, "shape", None), getattr(segments, "dtype", None)
    if shape is None or tuple(shape) != tuple(q.shape[:2]) or dtype != jnp.int32:
        raise ValueError(
            f"attention segments must be an int32 array [B, T] = {list(q.shape[:2])} (the document id of each "
            f"token, as onona_jax.packing.documents returns), got "
            f"{getattr(dtype, 'name', type(segments).__name__)} {list(shape) if shape is not None else ''}; "
            "cast with .astype(jnp.int32) or pass segments=None for plain causal attention")


def _query_blocked(q, k, v, segments=None):
    """XLA causal attention by blocks of query rows, block [a, b) against keys [0, b) only;
    with segments each block's mask also keeps only keys of the query's own document."""
    T, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
    block = max(CPU_QUERY_BLOCK, -(-T // CPU_QUERY_BLOCKS))
    if T <= block:
        return jax.nn.dot_product_attention(q, k, v, mask=_document_mask(segments), is_causal=True, scale=scale,
                                            implementation="xla")
    outs = []
    for a in range(0, T, block):
        b = min(a + block, T)
        mask = jnp.arange(a, b)[:, None] >= jnp.arange(b)[None, :]
        if segments is not None:  # [B, 1, b - a, b]: still only the keys [0, b) this block can see
            mask = mask & (segments[:, a:b, None] == segments[:, None, :b])
        # (without segments: the block's causal mask alone, broadcast over B, so the program is the causal one)
        outs.append(jax.nn.dot_product_attention(q[:, a:b], k[:, :b], v[:, :b],
                                                 mask=mask[None, None] if segments is None else mask[:, None],
                                                 scale=scale, implementation="xla"))
    return jnp.concatenate(outs, axis=1)


# ----------------------------------------------------------------------------- splash


def splash_block(T: int) -> tuple[int, int]:
    """(block, padded length) for sequence length T: T rounds up to the 128 lanes, and the
    block is the largest of `SPLASH_BLOCKS` that divides it."""
    padded = -(-T // 128) * 128
    return next(b for b in SPLASH_BLOCKS if padded % b == 0), padded


def _splash_kernel(heads: int, padded: int, block: int, interpret: bool):
    """Built at each trace, not cached: the kernel holds its mask tables as arrays, which a
    cache would leak from one trace into the next."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((padded, padded))] * heads)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    # One device's heads: under a mesh the call below is already inside shard_map.
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
                              residual_checkpoint_name=OUTPUT)


def _splash_local(q, k, v, segments=None, *, interpret: bool):
    """Splash on one device's rows and heads: q [B, T, N, hd], k/v [B, T, K, hd]. The kernel
    takes GQA as is (KV head n // (N/K)), so K/V are never repeated. T pads up to the block
    with keys no real query sees (causal) and queries whose rows are dropped. Segments go to
    the kernel as its `SegmentIds`, compared tile by tile in VMEM (no [T, T] mask anywhere),
    with the causal blocks still skipped."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    B, T, N, H = q.shape
    block, padded = splash_block(T)
    q = q * jnp.asarray(1.0 / math.sqrt(H), q.dtype)  # splash does not scale
    pad = [(0, 0), (0, padded - T), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(a, pad).transpose(0, 2, 1, 3) for a in (q, k, v))  # [B, heads, T', hd]
    kernel = _splash_kernel(N, padded, block, interpret)
    if segments is None:
        out = jax.vmap(kernel)(q, k, v)  # [B, N, T', hd]
    else:
        if padded > T:  # the padded tail is a document of its own: each padded query sees itself, no real one
            tail = jnp.max(segments, axis=1, keepdims=True) + 1
            segments = jnp.concatenate([segments, jnp.broadcast_to(tail, (B, padded - T))], axis=1)
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(q=s, kv=s)))(q, k, v, segments)
    return out.transpose(0, 2, 1, 3)[:, :T]


def splash_attention(q, k, v, interpret: bool = False, segments=None):
    """Splash attention, sharded as the rules table shards the activations: rows over the batch
    axes and heads over the `act_heads` axis, one kernel per device inside `shard_map` (the
    kernel has no partitioning rule of its own). The sequence stays whole on each device;
    `segments` [B, T] are split with the rows."""
    found = sharding.active()
    N, K = q.shape[2], k.shape[2]
    if found is None or found[0].size == 1:
        return _splash_local(q, k, v, segments, interpret=interpret)
    mesh, rules = found
    batch = sharding.logical_to_mesh(P("batch"), rules)[0]
    heads = sharding.logical_to_mesh(P("act_heads"), rules)[0]
    n_heads = math.prod(mesh.shape[a] for a in ((heads,) if isinstance(heads, str) else heads or ()))
    if N % n_heads or K % n_heads:
        raise ValueError(
            f"splash attention shards heads over mesh axis {heads!r} of size {n_heads}, which must divide "
            f"model.n_heads={N} and model.n_kv_heads={K}; choose mesh.tensor accordingly or "
            f"model.attention_impl=xla")
    n_batch = math.prod(mesh.shape[a] for a in ((batch,) if isinstance(batch, str) else batch or ()))
    # The train step's rows always divide the batch axes; a scoring batch that does not (an eval
    # task's last batch) runs whole on each device group rather than fail.
    rows = batch if q.shape[0] % n_batch == 0 else None
    spec = P(rows, None, heads, None)
    local = functools.partial(_splash_local, interpret=interpret)
    if segments is None:
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(rows, None)), out_specs=spec,
                         check_vma=False)(q, k, v, segments)


def check_shape(impl: str | None, head_dim: int) -> list[str]:
    """What a named kernel cannot take, as error lines for `config.validate` (before compile)."""
    problems = []  # splash takes any head_dim (it pads to the 128 lanes; 16-128 compiled for v5e)
    if impl == "cudnn" and (head_dim % 8 or head_dim > 256):
        problems.append(f"model.attention_impl='cudnn' needs model.head_dim a multiple of 8, at most 256 (got {head_dim})")
    return problems
