"""Batched log-likelihood scoring of token requests, with lm-evaluation-harness semantics.

A request is (context tokens, continuation tokens). As the harness's HF model does
(`HFLM._loglikelihood_tokens`), the model reads

    inputs = (context + continuation)[-(max_length + 1):][:-1]

(left-truncated to `max_length` tokens) and the request's score is the sum of
log p(continuation token | everything before it) over the continuation, plus whether every
continuation token is the argmax (greedy) prediction. Texts are split into tokens as the
harness's `TemplateLM` does (`encode_pair`), and long documents are scored in the harness's
rolling windows (`rolling_windows`).

Batching: requests are sorted by input length (longest first), cut into batches of
`batch_size` rows (rounded up to a multiple of the data-parallel size) and right-padded to a
bucket length (a power of two from 16, capped at `max_length`); short batches get dummy rows.
One jitted scoring function is compiled per padded (rows, length) shape. Padding only ever
sits to the right of real tokens, and every decoder family here is causal, so it does not
change a real token's log-probability. (An MoE whose capacity could drop assignments would
let padding compete for expert slots; evaluation builds the model with the evaluation
capacity factor, 4.0, which drops nothing for 8 experts, top-2; see `moe.py`.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import models as model_lib
from onona_jax import sharding
from onona_jax import tokenizer as tokenizer_lib

MIN_BUCKET = 16

# ----------------------------------------------------------------------------- text -> tokens


def encode_pair(context: str, continuation: str, tok, prefix_token: int):
    """(context tokens, continuation tokens) as lm-evaluation-harness's `TemplateLM` makes them.

    Trailing whitespace of the context moves to the continuation; the pair is encoded whole
    and the continuation is what follows the separately encoded context (so a merge across
    the boundary stays in the context). An empty context becomes the prefix token (the
    tokenizer's eot). `tok`: text -> ids (`Tokenizer.encode`)."""
    if context == "":
        cont = tok(continuation)
        if cont and cont[0] == prefix_token:
            return cont[:1], cont[1:]
        return [prefix_token], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok(context + continuation)
    ctx = tok(context)
    return ctx, whole[len(ctx):]


def rolling_windows(tokens: Sequence[int], max_length: int, prefix_token: int, context_len: int = 1):
    """Disjoint scoring windows over a token list: lm-evaluation-harness's
    `make_disjoint_window(get_rolling_token_windows(tokens, prefix_token, max_length, context_len))`.

    `prefix_token` is the tokenizer's end-of-document id (`Tokenizer.eot`).
    Returns [(context, continuation)]; the continuations partition `tokens` in order, so
    every token is scored exactly once. With the harness's context_len=1:

    - window 1 scores tokens[0:m], m = min(max_length, n), reading [prefix] + tokens[0:m-1]
      (the prefix token conditions the first token);
    - each further window scores the next max_length - context_len + 1 tokens (or the rest)
      and reads the max_length tokens that end just before its last scored token, i.e. its
      context is the tokens right before it: one token for a full window, and for the final,
      shorter window as many as fill the max_length-token input.

    Windows never condition on more than max_length tokens, and full windows after the first
    do not overlap: a token early in a window sees only the window's own past."""
    assert 1 <= context_len <= max_length
    tokens = list(tokens)
    n = len(tokens)
    if not n:
        return []
    pred_len = max_length - context_len + 1
    first = min(max_length, n)
    windows = [([prefix_token] + tokens[: first - 1], tokens[:first])]
    done = first
    while done < n:
        k = min(n - done, pred_len)
        end = done + k
        windows.append((tokens[end - max_length - 1 : end - 1], tokens[end - k : end]))
        done = end
    # make_disjoint_window: drop the inputs that are themselves scored in this window
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in windows]


# ----------------------------------------------------------------------------- the scorer


def mesh_devices(mesh):
    """The devices for a (data, fsdp, tensor) mesh: with no -1 axis and fewer devices than
    this (single) process has, the first ones (e.g. mesh (1, 1, 1) on a multi-device host);
    otherwise None, i.e. all devices."""
    if -1 in tuple(mesh) or jax.process_count() > 1 or math.prod(mesh) >= jax.device_count():
        return None
    return jax.devices()[: math.prod(mesh)]


def bucket_length(n: int, max_length: int) -> int:
    """Padded length for an input of n tokens: the next power of two from 16, capped."""
    return min(max_length, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))


def _score_fn(graphdef, chunk: int, params, tokens, targets):
    """(log p(target) [B, T] fp32, target == argmax [B, T]) at every position.

    The head runs over sequence chunks of `chunk` positions (lax.map) so that at most
    B × chunk × V log-probabilities exist at once."""
    model = model_lib.bind(graphdef, params)
    h, x0 = model.hidden(tokens)
    B, T = tokens.shape
    c = max(d for d in range(1, min(chunk, T) + 1) if T % d == 0)  # the largest divisor of T ≤ chunk
    n = T // c

    def split(x):  # [B, T, ...] -> [n, B, c, ...]
        return x.reshape(B, n, c, *x.shape[2:]).swapaxes(0, 1)

    def body(args):
        hc, xc, tc = args
        lp = model.head.log_probs(hc, xc).astype(jnp.float32)
        tlp = jnp.take_along_axis(lp, tc[..., None], axis=-1)[..., 0]
        return tlp, jnp.argmax(lp, axis=-1) == tc

    tlp, greedy = jax.lax.map(body, (split(h), split(x0), split(targets)))
    join = lambda x: x.swapaxes(0, 1).reshape(B, T)  # noqa: E731
    return join(tlp), join(greedy)


_JITTED: dict = {}


def _jitted(graphdef, chunk: int, mesh):
    """One jitted scoring function per (model structure, chunk, mesh); jit's own cache then
    holds one executable per padded shape. Shared by every Scorer of the same model."""
    key = (graphdef, chunk, mesh)
    if key not in _JITTED:
        replicated = NamedSharding(mesh, P())
        _JITTED[key] = jax.jit(
            sharding.under_rules(functools.partial(_score_fn, graphdef, chunk), mesh),
            out_shardings=(replicated, replicated),
        )
    return _JITTED[key]


class Scorer:
    """Log-likelihoods of (context, continuation) token requests under a model.

    `Scorer.from_workdir(DIR)` restores a checkpoint (the MoE with its evaluation capacity);
    `Scorer(graphdef, params, mesh, tokenizer=tok)` wraps parameters already on a mesh. Text
    is tokenised with the run's tokenizer (`from_params`: `tokenizer.from_config(cfg.data)`),
    whose eot is the prefix token."""

    def __init__(self, graphdef, params, mesh, *, batch_size: int = 8, max_length: int = 1024,
                 chunk: int = 256, progress: bool = False, tokenizer: tokenizer_lib.Tokenizer):
        if max_length < 1:
            raise ValueError(f"max_length={max_length} must be positive")
        self.graphdef, self.params, self.mesh = graphdef, params, mesh
        dp = sharding.data_parallel_size(mesh)
        self.batch_size = max(dp, math.ceil(max(1, int(batch_size)) / dp) * dp)
        self.max_length, self.chunk, self.progress = int(max_length), int(chunk), progress
        self.batch_sharding = sharding.batch_sharding(mesh)
        self.cfg = None
        self.step = None
        self.tokenizer = tokenizer

    @classmethod
    def from_params(cls, params, cfg, mesh, **kw) -> "Scorer":
        """A scorer over restored parameters (`checkpoint.restore_params`) on `mesh`; the
        graphdef is built from the family's evaluation config (MoE: capacity factor 4.0)."""
        graphdef, _ = model_lib.abstract(model_lib.eval_config(cfg.model))
        kw.setdefault("tokenizer", tokenizer_lib.from_config(cfg.data))
        scorer = cls(graphdef, params, mesh, **kw)
        scorer.cfg = cfg
        return scorer

    @classmethod
    def from_workdir(cls, workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None, **kw) -> "Scorer":
        from onona_jax.checkpoint import restore_params

        mesh = tuple(int(m) for m in mesh)
        devices = devices if devices is not None else mesh_devices(mesh)
        params, step, cfg, grid = restore_params(workdir, step, mesh, devices)
        scorer = cls.from_params(params, cfg, grid, **kw)
        scorer.step = step
        return scorer

    # ------------------------------------------------------------------ token requests

    def loglikelihood_tokens(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """[(sum of log p over the continuation, all continuation tokens greedy)] per request."""
        L = self.max_length
        rows = []  # (request index, input tokens, number of scored positions)
        for i, (ctx, cont) in enumerate(requests):
            ctx, cont = list(ctx), list(cont)
            if not ctx or not cont:
                raise ValueError(f"request {i}: context and continuation must both be non-empty "
                                 f"(an empty context is the prefix token; see encode_pair)")
            if len(cont) > L:
                raise ValueError(f"request {i}: continuation of {len(cont)} tokens exceeds max_length={L}")
            whole = (ctx + cont)[-(L + 1):]
            rows.append((i, whole, len(cont)))
        rows.sort(key=lambda r: (-len(r[1]), r[0]))  # longest first, as the harness does
        out: list = [None] * len(requests)
        b = self.batch_size
        batches = range(0, len(rows), b)
        if self.progress and jax.process_index() == 0:
            from tqdm import tqdm

            batches = tqdm(batches, desc="scoring", dynamic_ncols=True)
        for start in batches:
            chunk = rows[start:start + b]
            T = bucket_length(max(len(w) - 1 for _, w, _ in chunk), L)
            inputs = np.zeros((b, T), np.int32)
            targets = np.zeros((b, T), np.int32)
            for r, (_, whole, _) in enumerate(chunk):
                inputs[r, : len(whole) - 1] = whole[:-1]
                targets[r, : len(whole) - 1] = whole[1:]
            lp, greedy = self._run(inputs, targets)
            for r, (i, whole, k) in enumerate(chunk):
                n = len(whole) - 1
                out[i] = (float(np.sum(lp[r, n - k:n], dtype=np.float64)), bool(np.all(greedy[r, n - k:n])))
        return out

    def _run(self, inputs: np.ndarray, targets: np.ndarray):
        fn = _jitted(self.graphdef, self.chunk, self.mesh)
        shape = inputs.shape
        tok = jax.make_array_from_callback(shape, self.batch_sharding, lambda idx: inputs[idx])
        tgt = jax.make_array_from_callback(shape, self.batch_sharding, lambda idx: targets[idx])
        lp, greedy = fn(self.params, tok, tgt)
        return np.asarray(lp), np.asarray(greedy)

    # ------------------------------------------------------------------ text requests

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` under the run's tokenizer."""
        return self.tokenizer.encode(text)

    def encode_pair(self, context: str, continuation: str):
        """`encode_pair` with the run's tokenizer and its eot as the prefix token."""
        return encode_pair(context, continuation, self.tokenizer.encode, self.tokenizer.eot)

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """Harness `loglikelihood` on (context, continuation) strings."""
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in pairs])

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """Harness `loglikelihood_rolling`: the log-likelihood of each whole text, scored in
        disjoint windows of `max_length` tokens (`rolling_windows`, context_len=1)."""
        requests, owner = [], []
        for i, text in enumerate(texts):
            for w in rolling_windows(self.encode(text), self.max_length, self.tokenizer.eot):
                requests.append(w)
                owner.append(i)
        total = [0.0] * len(texts)
        for i, (ll, _) in zip(owner, self.loglikelihood_tokens(requests)):
            total[i] += ll
        return total
