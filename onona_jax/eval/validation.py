"""Validation loss on the fixed held-out windows (SPEC §5) and, for heads that declare them,
the table ablations on the same windows (twin: `a_only`, `b_only`, `a_in`, `b_in`, `a_out`,
`b_out`: `heads.ABLATION_KINDS`), each as `val_loss_<ablation>`.

`validation` adds `val_bits_per_byte` = Σ NLL / Σ bytes / ln 2 over the same scored targets
(every window position but the first), where a target's bytes are those its token stands for
under the run's tokenizer (`Tokenizer.token_bytes`; the special tokens, i.e. the end of a
document, count 0 bytes but their NLL is counted: where a document ends is part of what is
predicted). The bytes are counted exactly from the windows' ids, so bits per byte compares
runs of different tokenizers on the same text; the loss per token does not.

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
from onona_jax import models, paths, sharding
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.checkpoint import restore_params


def make_eval_step(graphdef, mesh, param_shardings, ablation: str | None = None):
    """Sum of NLL and token count over a [b, T+1] batch with per-window weights (padding)."""
    layout = sharding.loss_layout(mesh)

    def nll_sum(params, tokens, weights):
        model = models.bind(graphdef, params)
        lp = model.target_log_probs(tokens[:, :-1], tokens[:, 1:], ablation=ablation, layout=layout)
        return -jnp.sum(lp * weights[:, None]), jnp.sum(weights) * lp.shape[1]

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        sharding.under_rules(nll_sum, mesh),
        in_shardings=(param_shardings, sharding.batch_sharding(mesh), sharding.batch_sharding(mesh, 1)),
        out_shardings=(replicated, replicated),
    )


class Evaluator:
    """Mean NLL over fixed windows (every process holds all of them), per variant (None: the
    model, else a table ablation); one compiled step per variant, built on first use."""

    def __init__(self, graphdef, mesh, param_shardings):
        self.graphdef, self.mesh, self.param_shardings = graphdef, mesh, param_shardings
        self.steps: dict = {}

    def __call__(self, params, windows: np.ndarray, tables=(None,), batch: int = 8) -> dict:
        dp = sharding.data_parallel_size(self.mesh)
        b = max(dp, math.ceil(batch / dp) * dp)
        n = len(windows)
        padded = math.ceil(n / b) * b
        tokens = np.zeros((padded, windows.shape[1]), np.int32)
        tokens[:n] = windows
        weights = np.zeros((padded,), np.float32)
        weights[:n] = 1.0
        rows, w_rows = sharding.batch_sharding(self.mesh), sharding.batch_sharding(self.mesh, 1)
        out = {}
        for table in tables:
            if table not in self.steps:
                self.steps[table] = make_eval_step(self.graphdef, self.mesh, self.param_shardings, table)
            fn = self.steps[table]
            total, count = 0.0, 0.0
            for i in range(0, padded, b):
                tb = jax.make_array_from_callback((b, tokens.shape[1]), rows, lambda idx: tokens[i:i + b][idx])
                wb = jax.make_array_from_callback((b,), w_rows, lambda idx: weights[i:i + b][idx])
                s, c = fn(params, tb, wb)
                total, count = total + s, count + c
            out["val_loss" if table is None else f"val_loss_{table}"] = float(total / count)
        return out


@functools.cache
def token_byte_lengths(tok) -> np.ndarray:
    """[n_vocab] int64: the UTF-8 bytes each token stands for (`Tokenizer.token_bytes`), 0 for
    the special tokens (they end a document; they are not its text). One pass over the
    vocabulary per tokenizer (cached)."""
    lengths = np.array([len(tok.token_bytes(i)) for i in range(tok.n_vocab)], np.int64)
    lengths[[i for _, i in tok.special_tokens if i < tok.n_vocab]] = 0
    return lengths


def bits_per_byte(val_loss: float, windows: np.ndarray, tok) -> dict:
    """{val_bits_per_byte, val_bytes}: the mean NLL (nats) over windows[:, 1:] turned into bits
    per byte of the text those targets stand for (module docstring)."""
    targets = np.asarray(windows)[:, 1:]
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
    from onona_jax.data import pipeline

    params, step, cfg, grid = loaded or load(workdir, step, mesh, devices)
    windows = pipeline.validation_windows(
        data_dir(cfg, workdir), cfg.data.seq_len, cfg.eval.windows, cfg.eval.seed,
        cache_dir=cfg.data.get("cache_dir") or None, bucket_read=cfg.data.get("bucket_read", "copy"),
        tokenizer=cfg.data,  # refuses held-out data of another tokenizer than the run's
    )
    graphdef, _ = models.abstract(cfg.model)
    shardings = jax.tree.map(lambda a: a.sharding, params)
    result = Evaluator(graphdef, grid, shardings)(params, windows, variants(cfg.model), cfg.eval.batch)
    result.update(bits_per_byte(result["val_loss"], windows, tokenizer_lib.from_config(cfg.data)))
    return {"config": cfg.name, "step": step, "windows": len(windows), **result}


def write_json(result: dict, path: str):
    """Atomic write (`paths.write_atomic`: a reader never sees half a file), from process 0."""
    if jax.process_index() == 0:
        paths.write_json(path, result)
