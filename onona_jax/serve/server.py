"""Serving a trained model (SPEC §1): scoring and batched generation with a K/V cache.

    server = Server.from_workdir("runs/dense-small-twin")      # or Server(cfg, params)
    server.log_probs(tokens)                                     # [B, T, V] fp32, full forward
    tok = server.tokenizer                                       # the run's (data.tokenizer)
    server.generate([tok.encode("It is"), [tok.eot]], 32, greedy=True, stop_tokens=(tok.eot,))
    server.generate(prompts, 32, one_projection=True, seed=1)    # exact sampling, one V×d projection

Folding (`Head.fold`, done once): the input table the trunk reads (twin: M = (A+B)/2), the
K output tables cast to the compute dtype, and the gate as a lookup by input token: log
mixture weights [V, K] (twin: logσ(z), logσ(−z) with z = wᵀ rmsnorm(M)), kept in log space.

Which projections a decoding step computes:

* scoring, greedy, temperature ≠ 1, top-k, top-p: the mixture
  log p = logsumexp_k(log w_k[x] + log_softmax(h T_kᵀ)) (twin: logaddexp of the two), every
  projection; greedy is argmax of it, and temperature / top-k / top-p act on it (temperature
  divides the mixture log-probs, then top-k, then top-p keep the most probable tokens).
* `one_projection=True` (temperature 1, no truncation; a head with K ≥ 2 tables and a gate):
  a component k ~ w[x_t] (twin: c ~ Bernoulli(g[x_t]), g = σ(z)), then a sample of
  softmax(h T_kᵀ), which is exactly a sample of the mixture because the weights depend on the
  input token alone. Each row computes only its own table's projection
  (`one_projection_logits` for two tables, `component_logits` for any K).

Batching: prompts of different lengths are LEFT-padded to a common length (rounded up to a
power of two so few shapes compile); row b's pads occupy cache slots [0, start_b), are invisible
to attention, feed zeros to Gated DeltaNet layers and take no positions (row b's real tokens
have positions 0, 1, ...), so every row decodes exactly as it would alone (`Model.extend`).
All rows then advance together, one token per step. Two executables per shape: the prefill
(prompt → cache and first token) and the decode loop (a lax.while_loop of `decode_step` and
sampling, run on device until `max_new_tokens` or until every row has emitted a stop token).
They compile once per (batch, padded prompt length, cache length, sampling mode); the cache
length is the power of two ≥ prompt + max_new_tokens, capped at `max_len`.

MoE models are served from `moe.eval_config` (capacity factor 4.0, nothing dropped; a
single decoding token never overflows).
"""

from __future__ import annotations

import gc
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from onona_jax import heads as heads_lib
from onona_jax import models as model_lib
from onona_jax import params as params_lib

DEFAULT_MAX_LEN = 1024
MAX_BRANCHES = 64


# ----------------------------------------------------------------------------- pure functions


def sample_log_probs(key, log_probs, temperature=1.0, top_k: int = 0, top_p=None):
    """One token per row from log-probabilities [..., V]: divided by `temperature`, restricted
    to the `top_k` most probable (0: all) and then to the smallest most-probable set whose
    probability reaches `top_p` (None or 1: all; tokens tied at the threshold are all kept)."""
    z = log_probs.astype(jnp.float32) / temperature
    if top_k and top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if top_p is not None:
        desc = -jnp.sort(-z, axis=-1)
        p = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass of the more probable tokens
        keep = before < top_p  # always keeps the most probable token
        threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z < threshold, -jnp.inf, z)
    return jax.random.categorical(key, z, axis=-1)


def _split_points(n: int, max_branches: int) -> list[int]:
    k = max(1, min(n, max_branches))
    return sorted({(j * n) // k for j in range(k + 1)})


def one_projection_logits(h, A, B, c, max_branches: int = MAX_BRANCHES):
    """Logits [N, V] (h's dtype) whose row r is h_r Aᵀ if c_r else h_r Bᵀ, computing for each
    row only its own table's projection.

    Rows are stably sorted so that the n_A rows with c = 1 come first; then one branch of a
    `lax.switch` (only the taken branch runs) computes hs[:n_A] Aᵀ and hs[n_A:] Bᵀ with static
    shapes, one branch per possible split point. N = 1 has two branches, h Aᵀ and h Bᵀ: one
    projection. For N > max_branches the split points are every ⌈N/max_branches⌉-th row and
    a split falling between two points computes both projections for that one slab of rows,
    so at most ⌈N/max_branches⌉ rows are projected twice. The unused table is never read
    when all rows agree. (A per-row table gather [N, V, d], or both projections and a
    select, would defeat the purpose; `lax.ragged_dot` lowers to a masked dense product on
    CPU and GPU.)"""
    n = h.shape[0]
    c = c.astype(bool)
    order = jnp.argsort(jnp.logical_not(c).astype(jnp.int32), stable=True)  # c = 1 rows first
    hs = h[order]
    n_a = jnp.sum(c.astype(jnp.int32))
    proj = heads_lib.logits

    def exact(p):
        def branch(hs, n_a):
            parts = ([proj(hs[:p], A)] if p > 0 else []) + ([proj(hs[p:], B)] if p < n else [])
            return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

        return branch

    def slab(p, q):
        def branch(hs, n_a):
            mid = hs[p:q]
            in_a = (p + jnp.arange(q - p)) < n_a
            both = jnp.where(in_a[:, None], proj(mid, A), proj(mid, B))
            parts = ([proj(hs[:p], A)] if p > 0 else []) + [both] + ([proj(hs[q:], B)] if q < n else [])
            return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

        return branch

    points = _split_points(n, max_branches)
    branches = [exact(p) for p in points]
    interval_branch = []
    for p, q in zip(points, points[1:]):
        if q - p > 1:
            branches.append(slab(p, q))
            interval_branch.append(len(branches) - 1)
        else:
            interval_branch.append(0)  # no integer strictly between p and q: never taken
    pts = jnp.asarray(points, jnp.int32)
    i = jnp.searchsorted(pts, n_a)  # first point ≥ n_a
    on_point = pts[jnp.minimum(i, len(points) - 1)] == n_a
    index = jnp.where(on_point, i, jnp.asarray(interval_branch, jnp.int32)[jnp.maximum(i - 1, 0)])
    out = jax.lax.switch(index, branches, hs, n_a)
    return jnp.zeros_like(out).at[order].set(out)


def sample_one_projection(key, h, A, B, g, max_branches: int = MAX_BRANCHES):
    """An exact sample of the mixture g·softmax(hAᵀ) + (1−g)·softmax(hBᵀ) per row (h [N, d],
    g [N] the gate probabilities of the rows' input tokens) with one projection per row:
    c ~ Bernoulli(g), then a token from softmax(hAᵀ) if c else softmax(hBᵀ). Temperature 1,
    no truncation (anything else acts on the mixture and needs both projections)."""
    key_c, key_t = jax.random.split(key)
    c = jax.random.uniform(key_c, g.shape, jnp.float32) < g
    z = one_projection_logits(h, A, B, c, max_branches).astype(jnp.float32)
    return jax.random.categorical(key_t, z, axis=-1)


def component_logits(h, tables, c, max_branches: int = MAX_BRANCHES):
    """Logits [N, V] (h's dtype) whose row r is h_r T_{c_r}ᵀ for K tables, computing for most
    rows only their own table's projection (the K-table form of `one_projection_logits`).

    Rows are stably sorted by c and cut into slabs of S = ⌈N/max_branches⌉ rows; a slab
    projects once with each component present in it (a `lax.switch` on k, so only table k is
    read), and the sorted order makes all but at most K − 1 slabs hold one component: at most
    (K − 1)·S rows are projected more than once. N = 1: one projection."""
    n, d = h.shape
    K = len(tables)
    c = c.astype(jnp.int32)
    order = jnp.argsort(c, stable=True)
    hs, cs = h[order], c[order]
    S = -(-n // max(1, min(n, max_branches)))
    slabs = -(-n // S)
    pad = slabs * S - n  # padding rows repeat the last component: no extra projection
    hs = jnp.concatenate([hs, jnp.zeros((pad, d), hs.dtype)]).reshape(slabs, S, d)
    cs = jnp.concatenate([cs, jnp.full((pad,), cs[-1], jnp.int32)]).reshape(slabs, S)
    branches = [lambda x, T=T: heads_lib.logits(x, T) for T in tables]
    V = tables[0].shape[0]

    def slab(args):
        x, ks = args

        def body(st):
            k, out = st
            out = jnp.where((ks == k)[:, None], jax.lax.switch(k, branches, x), out)
            return jnp.min(jnp.where(ks > k, ks, K)), out  # the next component present, or K

        out = jnp.zeros((S, V), jnp.result_type(h.dtype, tables[0].dtype))
        return jax.lax.while_loop(lambda st: st[0] < K, body, (ks[0], out))[1]

    out = jax.lax.map(slab, (hs, cs)).reshape(slabs * S, V)[:n]
    return jnp.zeros_like(out).at[order].set(out)


def sample_mixture(key, h, tables, log_weights, max_branches: int = MAX_BRANCHES):
    """An exact sample of the mixture Σ_k w_k softmax(h T_kᵀ) per row (h [N, d], log_weights
    [N, K] the gate's log weights of the rows' input tokens) with one projection per row:
    k ~ w, then a token from softmax(h T_kᵀ). Two tables: `sample_one_projection`. Temperature
    1, no truncation (anything else acts on the mixture and needs every projection)."""
    if len(tables) == 2:
        return sample_one_projection(key, h, *tables, jnp.exp(log_weights[..., 0]), max_branches)
    key_c, key_t = jax.random.split(key)
    c = jax.random.categorical(key_c, log_weights.astype(jnp.float32), axis=-1)
    z = component_logits(h, tables, c, max_branches).astype(jnp.float32)
    return jax.random.categorical(key_t, z, axis=-1)


def _bucket(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


# ----------------------------------------------------------------------------- the server


def foldable(cfg_model) -> bool:
    """Whether the head has a serving fold (`Head.fold`)."""
    return heads_lib.head_class(cfg_model.head).foldable()


def fold(cfg_model, head_params, max_rows: int = 8192) -> dict:
    """The head's serving tensors from its parameters (`Head.fold`): the input table (in the
    compute dtype, which is all the trunk reads of it), the K output tables (compute dtype),
    and for a gated head the lookup `log_weights` [V, K] (fp32).

    `Head.fold` is row-wise in the vocabulary, so it runs on blocks of at most `max_rows`
    rows (a divisor of V) in a loop: its fp32 temporaries (M, rmsnorm(M)) exist for one
    block at a time, and the outputs are the blocks laid end to end (a free reshape)."""
    dtype = model_lib.DTYPES[cfg_model.dtype]
    graphdef, _ = params_lib.abstract_state(lambda: heads_lib.make_head(cfg_model))
    V = int(cfg_model.vocab_size)
    n = next((k for k in range(1, V + 1) if V % k == 0 and V // k <= max_rows), 1)
    is_table = lambda x: x.ndim == 2 and x.shape[0] == V  # noqa: E731

    def one(p):
        f = nnx.merge(graphdef, p).fold()
        out = {"input": f.input.astype(dtype), "outputs": tuple(t.astype(dtype) for t in f.outputs)}
        if f.log_weights is not None:
            out["log_weights"] = f.log_weights.astype(jnp.float32)
        return out

    def impl(p):
        blocks = {k: v.reshape(n, V // n, *v.shape[1:]) for k, v in p.items() if is_table(v)}
        shared = {k: v for k, v in p.items() if not is_table(v)}
        out = jax.lax.map(lambda b: one({**shared, **b}), blocks)
        return jax.tree.map(lambda x: x.reshape(V, *x.shape[2:]), out)

    return jax.jit(impl)(head_params)


class Server:
    """A model ready to serve: folded tables, precomputed gate, jitted scoring and decoding.

    `cfg` is a full config (with `.model`) or a model config; `params` the pure parameter
    dict (fp32, as trained), or for a foldable head (`foldable`) {"trunk": ...} with the
    head's `fold(cfg, head params)` as `folded`: then the unfolded tables are never held
    (`from_workdir` restores the head, folds it, lets it go, then restores the trunk).
    `max_len` bounds prompt + generated tokens (default: the config's `data.seq_len`, else
    1024). `tokenizer` is the run's (`tokenizer.from_config(cfg.data)`): a full config has one."""

    def __init__(self, cfg, params, *, max_len: int | None = None, folded: dict | None = None):
        full = cfg if "model" in cfg else None
        m = model_lib.eval_config(full.model if full is not None else cfg)
        self.cfg = m
        self.data = full.data if full is not None and "data" in full else None
        if max_len is None:
            max_len = full.data.seq_len if full is not None and "data" in full else DEFAULT_MAX_LEN
        self.max_len = int(max_len)
        self.vocab_size = int(m.vocab_size)
        self.dtype = model_lib.DTYPES[m.dtype]
        self.step = None
        self.last_stats: dict = {}
        self.score = heads_lib.head_class(m.head).score
        # The head's serving form (`Head.fold`), computed once; heads whose output needs more
        # than a lookup and one projection per table (MoS) keep their parameters and are
        # served by `log_probs`.
        self.folded = foldable(m)
        if self.folded:
            if folded is None:
                folded = fold(m, params["head"])
            params = {"trunk": params["trunk"], "head": {}}
            self.graphdef, _ = model_lib.abstract(m, head=heads_lib.NoHead)
        else:
            self.graphdef, _ = model_lib.abstract(m)
        # K ≥ 2 output tables and a gate over the input token: one-projection sampling is exact
        self.gated = self.folded and "log_weights" in folded
        self.tables = {"params": params, **(folded or {})}
        self._log_probs = jax.jit(self._log_probs_impl)
        self._compiled: dict = {}

    @classmethod
    def from_workdir(cls, workdir: str, step: int | None = None, *, max_len: int | None = None, device=None):
        """The latest (or `step`'s) checkpoint of a training run, on one device. On a run that
        is training, a step its rotation deletes between the head's read and the trunk's is
        read again from the newest step, once."""
        from onona_jax import paths
        from onona_jax.checkpoint import StepGone, restore_params, rotated_twice, saved_config

        devices = [device if device is not None else jax.devices()[0]]
        where = dict(mesh=(1, 1, 1), devices=devices, via_host=True)
        if not foldable(saved_config(workdir, step).model):
            params, used, cfg, _ = restore_params(workdir, step, **where)
            server = cls(cfg, params, max_len=max_len)
            server.step = used
            return server
        gone = None
        while True:  # one part at a time: the head, folded and let go; then the trunk
            head, used, cfg, _ = restore_params(workdir, step, parts=("head",), **where)
            folded = jax.block_until_ready(fold(model_lib.eval_config(cfg.model), head["head"]))
            del head  # (after the fold has run: dispatch is asynchronous)
            gc.collect()  # the restore leaves reference cycles: free the tables before the trunk
            try:
                trunk, used, cfg, _ = restore_params(workdir, used, parts=("trunk",), **where)
                break
            except StepGone:
                if step is not None:
                    raise
                if gone is not None:
                    raise rotated_twice(paths.Workdir(workdir).checkpoints, gone, used) from None
                gone = used
                print(f"note: checkpoint at step {used} was deleted after its head was read (a running train.py "
                      "keeps only its newest); reading the newest step again", file=sys.stderr)
        server = cls(cfg, trunk, max_len=max_len, folded=folded)
        server.step = used
        return server

    @property
    def tokenizer(self):
        """The run's tokenizer (`onona_jax.tokenizer.Tokenizer`): its text, its eot (the stop
        token of a document) and `decode`, which drops the table's padding rows."""
        from onona_jax import tokenizer as tokenizer_lib

        if self.data is None:
            raise ValueError("this Server was built from a model config alone, which names no tokenizer; build it "
                             "from the full config (Server(cfg, params) with cfg.data) or Server.from_workdir")
        return tokenizer_lib.from_config(self.data)

    # -- pieces shared by scoring and decoding (traced)

    @property
    def gate(self) -> np.ndarray:
        """[V, K]: the gate's weight of each output table for each input token (twin: g, 1 − g)."""
        if not self.gated:
            raise ValueError(f"head {self.cfg.head!r} has no gate over its output tables")
        return np.exp(np.asarray(self.tables["log_weights"]))

    def _model(self, sp):
        return model_lib.bind(self.graphdef, sp["params"])

    def _embed(self, sp, model, tokens):
        if self.folded:
            return jnp.take(sp["input"], tokens, axis=0)
        return model.head.embed(tokens)

    def _head_log_probs(self, sp, model, h, tokens):
        """Mixture (or the head's) log-probs of the next token given h and the input tokens."""
        if self.folded:
            lw = sp.get("log_weights")
            lw = None if lw is None else jnp.take(lw, tokens, axis=0)
            return heads_lib.mixture_log_probs(heads_lib.Mixture(h, sp["outputs"], lw, self.score))
        return model.head.log_probs(h, model.head.embed(tokens))

    def _log_probs_impl(self, sp, tokens):
        model = self._model(sp)
        h, _ = model.hidden(tokens, x0=self._embed(sp, model, tokens))
        return self._head_log_probs(sp, model, h, tokens)

    def _next(self, sp, model, h, tokens, key, temperature, top_p, mode):
        greedy, one_projection, top_k, use_top_p = mode
        if one_projection:
            lw = jnp.take(sp["log_weights"], tokens, axis=0)
            return sample_mixture(key, h, sp["outputs"], lw).astype(jnp.int32)
        log_probs = self._head_log_probs(sp, model, h, tokens)
        if greedy:
            return jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
        return sample_log_probs(key, log_probs, temperature, top_k, top_p if use_top_p else None).astype(jnp.int32)

    def _prefill_impl(self, sp, tokens, start, key, temperature, top_p, *, max_len, mode):
        model = self._model(sp)
        h, _, cache = model.prefill(tokens, max_len, start, x0=self._embed(sp, model, tokens))
        first = self._next(sp, model, h[:, -1], tokens[:, -1], jax.random.fold_in(key, 0), temperature, top_p, mode)
        return first, cache

    def _decode_impl(self, sp, first, cache, n_new, key, temperature, top_p, stops, *, mode, out_len):
        model = self._model(sp)
        out = jnp.zeros((first.shape[0], out_len), jnp.int32).at[:, 0].set(first)
        done = jnp.isin(first, stops)

        def cond(st):
            i, _, _, _, done = st
            return (i < n_new) & ~jnp.all(done)

        def body(st):
            i, token, cache, out, done = st
            h, _, cache = model.decode_step(token, cache, x0=self._embed(sp, model, token))
            new = self._next(sp, model, h, token, jax.random.fold_in(key, i), temperature, top_p, mode)
            out = jax.lax.dynamic_update_slice_in_dim(out, new[:, None], i, axis=1)
            return i + 1, new, cache, out, done | jnp.isin(new, stops)

        i, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), first, cache, out, done))
        return out, i

    def _executable(self, name, fn, args, statics, donate=()):
        key = (name, tuple(sorted(statics.items())),
               tuple((a.shape, a.dtype) for a in jax.tree.leaves(args[1:])))
        if key not in self._compiled:
            t0 = time.perf_counter()
            jitted = jax.jit(lambda *a: fn(*a, **statics),
                             donate_argnums=donate if jax.default_backend() != "cpu" else ())
            self._compiled[key] = jitted.lower(*args).compile()
            self.last_stats["compile_s"] = self.last_stats.get("compile_s", 0.0) + time.perf_counter() - t0
        return self._compiled[key]

    # -- public API

    def log_probs(self, tokens) -> np.ndarray:
        """Full-forward log-probabilities [B, T, V] (fp32) of equal-length rows `tokens`
        ([B, T] or [T]): log p(next token | tokens[:, :t+1]), the mixture for a twin head."""
        tokens = np.asarray(tokens, np.int32)
        squeeze = tokens.ndim == 1
        tokens = self._check_tokens(tokens[None] if squeeze else tokens)
        out = np.asarray(self._log_probs(self.tables, jnp.asarray(tokens)))
        return out[0] if squeeze else out

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        greedy: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        one_projection: bool = False,
        seed: int = 0,
        stop_tokens=(),
    ) -> list[list[int]]:
        """Continue each prompt (a non-empty list of token ids) by up to `max_new_tokens`.

        greedy: argmax of the mixture. Otherwise sample from the mixture after `temperature`,
        `top_k` (0: off) and `top_p` (1.0: off). `one_projection`: exact sampling at
        temperature 1 without truncation, one V×d projection per row (gated heads: twin).
        A row stops after emitting one of `stop_tokens`; the stop token is NOT included in
        its returned continuation. Returns one list of new token ids per prompt.
        Timings of the call are left in `self.last_stats`."""
        mode, temperature, top_p = self._mode(greedy, temperature, top_k, top_p, one_projection)
        max_new_tokens = int(max_new_tokens)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: a non-empty list of token-id lists")
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if any(r.size == 0 for r in rows):
            raise ValueError("every prompt needs at least one token (e.g. [server.tokenizer.eot] to start a document)")
        lengths = [r.size for r in rows]
        self.last_stats = {"batch": len(rows), "prompt_tokens": int(sum(lengths))}
        if max_new_tokens <= 0:
            return [[] for _ in rows]
        longest = max(lengths)
        if longest + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds max_len="
                f"{self.max_len}; left-truncate the prompt or build Server(..., max_len=...)"
            )
        T = min(_bucket(longest, 16), self.max_len - max_new_tokens)
        S = min(_bucket(T + max_new_tokens, 64), self.max_len)
        tokens = np.zeros((len(rows), T), np.int32)
        start = np.zeros((len(rows),), np.int32)
        for b, r in enumerate(rows):
            tokens[b, T - r.size:] = r
            start[b] = T - r.size
        tokens = self._check_tokens(tokens)
        stops = np.full((_bucket(len(stop_tokens), 4),), -1, np.int32)
        stops[: len(stop_tokens)] = np.asarray(list(stop_tokens), np.int32)

        key = jax.random.key(int(seed))
        temp, tp = jnp.float32(temperature), jnp.float32(top_p)
        args = (self.tables, jnp.asarray(tokens), jnp.asarray(start), key, temp, tp)
        prefill = self._executable("prefill", self._prefill_impl, args, {"max_len": S, "mode": mode})
        t0 = time.perf_counter()
        first, cache = prefill(*args)
        first = jax.block_until_ready(first)
        t1 = time.perf_counter()
        args = (self.tables, first, cache, jnp.int32(max_new_tokens), key, temp, tp, jnp.asarray(stops))
        decode = self._executable("decode", self._decode_impl, args, {"mode": mode, "out_len": S - T}, donate=(2,))
        t2 = time.perf_counter()
        out, steps = decode(*args)
        out, steps = jax.device_get((out, steps))
        t3 = time.perf_counter()

        stop_set = set(int(s) for s in stop_tokens)
        result = []
        for row in out[:, : int(steps)].tolist():
            cut = next((j for j, t in enumerate(row) if t in stop_set), len(row))
            result.append(row[:cut])
        n = int(steps)
        self.last_stats.update(
            new_tokens=n * len(rows), steps=n, padded_prompt=T, cache_slots=S,
            prefill_s=t1 - t0, decode_s=t3 - t2,
            decode_tokens_per_s=(n - 1) * len(rows) / (t3 - t2) if n > 1 else float("nan"),
            tokens_per_s=n * len(rows) / ((t1 - t0) + (t3 - t2)),
        )
        return result

    # -- checks

    def _mode(self, greedy, temperature, top_k, top_p, one_projection):
        temperature, top_p, top_k = float(temperature), float(top_p), int(top_k)
        if one_projection:
            if not self.gated:
                raise ValueError(f"one_projection needs a head whose output tables a gate over the input token "
                                 f"mixes (twin); this model's head is {self.cfg.head!r}")
            if greedy or temperature != 1.0 or top_k != 0 or top_p != 1.0:
                raise ValueError(
                    "one_projection samples exactly only at temperature=1.0 without truncation "
                    f"(got greedy={greedy}, temperature={temperature}, top_k={top_k}, top_p={top_p}); "
                    "greedy, other temperatures, top-k and top-p act on the mixture: drop one_projection"
                )
            return (False, True, 0, False), 1.0, 1.0
        if greedy:
            return (True, False, 0, False), 1.0, 1.0
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be > 0 (use greedy=True for argmax)")
        if top_k < 0:
            raise ValueError(f"top_k={top_k} must be ≥ 0 (0: off)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1] (1: off)")
        return (False, False, min(top_k, self.vocab_size), top_p < 1.0), temperature, top_p

    def _check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        if tokens.ndim != 2:
            raise ValueError(f"tokens of shape {tokens.shape}: expected [batch, time] or [time]")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {tokens.min()}..{tokens.max()}")
        return tokens.astype(np.int32)

