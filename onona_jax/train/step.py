"""The jitted train step: forward, loss (with the family's auxiliary loss), gradients
accumulated over micro-batches, AdamW, all with explicit shardings on the run's mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import models, packing, sharding
from onona_jax.train.state import Run


def loss_and_aux(graphdef, params, tokens, cfg_model, layout=None, eot: int | None = None, kept=None):
    """(objective, aux) of a [b, T+1] batch: the mean next-token NLL (`aux["lm_loss"]`) plus
    the family's auxiliary loss (MoE: aux_coef × load balancing, pooled over layers); aux also
    carries the head's gate statistics (`Head.gate_stats`) and the family's metrics (MoE
    routing). `layout` (`sharding.loss_layout`) shards the fused loss over the mesh; `eot`:
    the rows are packed documents (`data.packing="documents"`, onona_jax/packing.py), and
    `kept` the count of targets the mean divides by (default: this batch's)."""
    model = models.bind(graphdef, params)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h, x0, stats = model.forward(inputs, eot=eot)
    weights = packing.loss_weights(inputs, eot, kept)  # the mean as per-target weights (the fused loss's form)
    loss, _ = model.head.nll(h, x0, targets, weights, layout)
    aux = {"lm_loss": loss}
    aux.update(model.head.gate_stats(inputs))  # the head's gate moments (none without a gate)
    extra, metrics = models.family(cfg_model).aux_loss(stats, cfg_model)
    aux.update(metrics)
    return loss + extra, aux


def accumulated_grads(run: Run, params, batch):
    """(loss, aux, grads) of a global [G, T+1] batch, averaged over `run.accum` micro-batches
    scanned in sequence (one compiled body)."""
    A = run.accum
    layout = sharding.loss_layout(run.mesh)
    G, T1 = batch.shape
    # Packed rows keep a varying number of targets per micro-batch: each divides by the global
    # count / A, so the A micro-batches average to the global batch's mean (as MaxText sums
    # weights across micro-batches), not to a mean of micro-batch means.
    kept = None if run.eot is None else (
        jnp.maximum(jnp.sum(packing.kept(batch[:, :-1], run.eot), dtype=jnp.float32), 1.0) / A)
    grad_fn = jax.value_and_grad(
        lambda p, b: loss_and_aux(run.graphdef, p, b, run.cfg.model, layout, run.eot, kept), has_aux=True)
    # Micro-batch a takes rows a, a+A, a+2A, ...: each device keeps its own rows, and the
    # grouping does not depend on the mesh.
    micro = batch.reshape(G // A, A, T1).swapaxes(0, 1)
    micro = sharding.constrain(micro, (None, "batch", None))
    if A == 1:
        (loss, aux), grads = grad_fn(params, micro[0])
        return loss, aux, grads

    def body(carry, mb):
        (loss, aux), grads = grad_fn(params, mb)
        return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

    shapes = jax.eval_shape(grad_fn, params, micro[0])
    (loss, aux), grads = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    grads = jax.lax.with_sharding_constraint(grads, run.param_shardings)
    (loss, aux, grads), _ = jax.lax.scan(body, (loss, aux, grads), micro)
    return jax.tree.map(lambda x: x / A, (loss, aux, grads))


def make_train_step(run: Run):
    tx, schedule = run.tx, run.schedule

    def train_step(state, batch):  # (its name names the compiled program: jit_train_step)
        params = state["params"]
        loss, aux, grads = accumulated_grads(run, params, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        aux = dict(aux)
        metrics = {"loss": aux.pop("lm_loss"), "grad_norm": optax.global_norm(grads),
                   "lr": schedule(state["step"])}
        if "gate_mean" in aux:
            gate_sq = aux.pop("gate_sq")
            metrics["gate_std"] = jnp.sqrt(jnp.maximum(gate_sq - aux["gate_mean"] ** 2, 0.0))
        metrics.update(aux)
        for key in [k for k, v in metrics.items() if v.ndim == 1]:  # a vector: one scalar per entry
            vec = metrics.pop(key)  # (MoE: moe_load_<expert>; a K-way gate: gate_mean_<k>), for the log
            metrics.update({f"{key}_{e}": vec[e] for e in range(vec.shape[0])})
        return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    replicated = NamedSharding(run.mesh, P())
    return jax.jit(
        sharding.under_rules(train_step, run.mesh),
        in_shardings=(run.state_shardings, run.batch_sharding),
        out_shardings=(run.state_shardings, replicated),
        donate_argnums=0,
    )


def global_batch(run: Run, local: np.ndarray) -> jax.Array:
    """This process's rows of the global batch -> one global array, its rows split over the batch
    axes (`sharding.batch_axes`: data, fsdp and expert)."""
    return jax.make_array_from_process_local_data(run.batch_sharding, local)
