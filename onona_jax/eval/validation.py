"""Validation loss on the fixed held-out windows (SPEC §5) and, for heads that declare them,
the table ablations on the same windows (twin: `a_only`, `b_only`, `a_in`, `b_in`, `a_out`,
`b_out`: `heads.ABLATION_KINDS`), each as `val_loss_<ablation>`.

`validation` adds `val_bits_per_byte` = Σ NLL / Σ bytes / ln 2 over the same scored targets
(every window position but the first), where a target's bytes are those its token stands for
under the run's tokenizer (`Tokenizer.token_bytes`; the special tokens, i.e. the end of a
document, count 0 bytes but their NLL is counted: where a document ends is part of what is
predicted). The bytes are counted exactly from the windows' ids, so bits per byte compares
runs of different tokenizers on the same text; the loss per token does not.

A run of several sources (`data.mixture`) is scored on each source's own fixed windows as well:
`val_loss/<source>`, with `val_loss` over all of them together.

The checkpoint's parameters are restored onto this run's mesh, whatever mesh trained them;
no optimizer state is read. The training loop uses the same `Evaluator`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import heads as heads_lib
from onona_jax import models, packing, paths, sharding
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.checkpoint import restore_params


def make_eval_step(graphdef, mesh, param_shardings, ablation: str | None = None, eot: int | None = None):
    """Sum of NLL and token count over a [b, T+1] batch with per-window weights (padding).
    `eot`: packed documents (`data.packing="documents"`): the targets the training loss counts
    (`packing.kept`), under the same document masks."""
    layout = sharding.loss_layout(mesh)

    def nll_sum(params, tokens, weights):
        model = models.bind(graphdef, params)
        inputs = tokens[:, :-1]
        lp = model.target_log_probs(inputs, tokens[:, 1:], ablation=ablation, layout=layout, eot=eot)
        if eot is None:
            return -jnp.sum(lp * weights[:, None]), jnp.sum(weights) * lp.shape[1]
        w = weights[:, None] * packing.kept(inputs, eot)
        return -jnp.sum(lp * w), jnp.sum(w)

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        sharding.under_rules(nll_sum, mesh),
        in_shardings=(param_shardings, sharding.batch_sharding(mesh), sharding.batch_sharding(mesh, 1)),
        out_shardings=(replicated, replicated),
    )


class Evaluator:
    """Mean NLL over fixed windows (every process holds all of them), per variant (None: the
    model, else a table ablation); one compiled step per variant, built on first use."""

    def __init__(self, graphdef, mesh, param_shardings, eot: int | None = None):
        self.graphdef, self.mesh, self.param_shardings, self.eot = graphdef, mesh, param_shardings, eot
        self.steps: dict = {}

    def __call__(self, params, windows: np.ndarray, tables=(None,), batch: int = 8, groups=None) -> dict:
        """`groups`: {name: rows of `windows`} (a mixture's sources: `pipeline.held_out`), each
        scored apart as well, as `val_loss/<name>` (the full model's); every variant's mean is
        over all the groups' windows together."""
        dp = sharding.data_parallel_size(self.mesh)
        b = max(dp, math.ceil(batch / dp) * dp)
        parts = {name: windows[rows] for name, rows in groups.items()} if groups else {None: windows}
        out = {}
        for table in tables:
            if table not in self.steps:
                self.steps[table] = make_eval_step(self.graphdef, self.mesh, self.param_shardings, table, self.eot)
            sums = {name: self._sums(self.steps[table], params, part, b) for name, part in parts.items()}
            total, count = sum(s for s, _ in sums.values()), sum(c for _, c in sums.values())
            out["val_loss" if table is None else f"val_loss_{table}"] = float(total / count)
            if groups and table is None:
                out.update({f"val_loss/{name}": float(s / c) for name, (s, c) in sums.items()})
        return out

    def _sums(self, fn, params, windows: np.ndarray, b: int):
        """(Σ NLL, Σ scored targets) of `fn` over `windows`, in batches of b (the last padded with
        windows of weight 0)."""
        n = len(windows)
        padded = math.ceil(n / b) * b
        tokens = np.zeros((padded, windows.shape[1]), np.int32)
        tokens[:n] = windows
        weights = np.zeros((padded,), np.float32)
        weights[:n] = 1.0
        rows, w_rows = sharding.batch_sharding(self.mesh), sharding.batch_sharding(self.mesh, 1)
        total, count = 0.0, 0.0
        for i in range(0, padded, b):
            tb = jax.make_array_from_callback((b, tokens.shape[1]), rows, lambda idx: tokens[i:i + b][idx])
            wb = jax.make_array_from_callback((b,), w_rows, lambda idx: weights[i:i + b][idx])
            s, c = fn(params, tb, wb)
            total, count = total + s, count + c
        return total, count


@functools.cache
def token_byte_lengths(tok) -> np.ndarray:
    """[n_vocab] int64: the UTF-8 bytes each token stands for (`Tokenizer.token_bytes`), 0 for
    the special tokens (they end a document; they are not its text). One pass over the
    vocabulary per tokenizer (cached)."""
    lengths = np.array([len(tok.token_bytes(i)) for i in range(tok.n_vocab)], np.int64)
    lengths[[i for _, i in tok.special_tokens if i < tok.n_vocab]] = 0
    return lengths


def bits_per_byte(val_loss: float, windows: np.ndarray, tok, eot: int | None = None) -> dict:
    """{val_bits_per_byte, val_bytes}: the mean NLL (nats) over windows[:, 1:] turned into bits
    per byte of the text those targets stand for (module docstring); with packed documents
    (`eot`) over the targets the loss counts (`packing.kept`)."""
    windows = np.asarray(windows)
    targets = windows[:, 1:]
    if eot is not None:
        targets = targets[np.asarray(packing.kept(windows[:, :-1], eot))]
    if targets.size and int(targets.max()) >= tok.n_vocab:
        raise ValueError(f"the validation windows hold token id {int(targets.max())}, past the "
                         f"{tok.n_vocab:,} entries of data.tokenizer ({tok.describe()}); the data was "
                         "prepared with another tokenizer: prepare it again with the run's")
    nbytes = int(token_byte_lengths(tok)[targets].sum())
    return {"val_bits_per_byte": float(val_loss) * targets.size / nbytes / math.log(2), "val_bytes": nbytes}


def variants(cfg_model) -> tuple:
    """The full model, then the head's table ablations."""
    return (None, *heads_lib.head_class(cfg_model.head).ablations)


def load(workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None):
    """(params, step, cfg, mesh): a checkpoint's parameters on this run's mesh."""
    return restore_params(workdir, step, mesh, devices)


def data_dir(cfg, workdir: str) -> str:
    return paths.Workdir(workdir).data_dir(cfg.data.dir)


def validation(workdir: str, step: int | None = None, mesh=(-1, 1, 1), devices=None, loaded=None) -> dict:
    """`loaded`: a `load` result to evaluate instead of restoring (eval.py restores once for
    the validation loss and the downstream tasks)."""
    from onona_jax.data import mixture, pipeline

    params, step, cfg, grid = loaded or load(workdir, step, mesh, devices)
    sources = pipeline.open_sources(
        mixture.parse(cfg.data.get("mixture", "")) or data_dir(cfg, workdir),
        cache_dir=cfg.data.get("cache_dir") or None, bucket_read=cfg.data.get("bucket_read", "copy"),
        tokenizer=cfg.data, trained=True,  # refuses held-out data of another tokenizer than the run's
    )
    windows, groups = pipeline.held_out(sources, cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed)
    graphdef, _ = models.abstract(cfg.model)
    shardings = jax.tree.map(lambda a: a.sharding, params)
    eot = packing.packed_eot(cfg)
    result = Evaluator(graphdef, grid, shardings, eot)(params, windows, variants(cfg.model), cfg.eval.batch, groups)
    result.update(bits_per_byte(result["val_loss"], windows, tokenizer_lib.from_config(cfg.data), eot))
    return {"config": cfg.name, "step": step, "windows": len(windows), **result}


def write_json(result: dict, path: str):
    """Atomic write (`paths.write_atomic`: a reader never sees half a file), from process 0."""
    if jax.process_index() == 0:
        paths.write_json(path, result)
