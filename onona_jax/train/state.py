"""A training run's fixed parts, derived from the config and checked against the devices
before anything is compiled or written: the mesh, the parameter and optimizer-state
shardings, the optimizer and schedule, the step budget and the accumulation count; and the
train state (parameters, optimizer state, step) created directly sharded on the mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from onona_jax import config as config_lib
from onona_jax import attention, layers, models, packing, sharding, summary
from onona_jax.params import init_params, logical_axes
from onona_jax.train import optimizer


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass
class Run:
    cfg: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    graphdef: object
    abstract_params: object
    param_shardings: object
    state_shardings: dict
    batch_sharding: NamedSharding
    tx: optax.GradientTransformation
    schedule: object
    steps: int
    accum: int
    eot: int | None = None  # the end-of-text id with data.packing="documents" (packing.py), else None

    @property
    def dp(self) -> int:
        return sharding.data_parallel_size(self.mesh)


MAX_STEPS = 2**31 - 1


def setup(cfg, devices=None) -> Run:
    """Validate `cfg` against this run's devices and derive the mesh, shardings and optimizer.
    Raises ValueError before anything is compiled or written."""
    config_lib.validate(cfg)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices, expert=cfg.mesh.expert,
                              slices=cfg.mesh.slices)
    graphdef, state = models.abstract(cfg.model)
    logical = logical_axes(state)
    abstract_params = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state)
    )
    sharding.check_divisible(logical, abstract_params, mesh)
    with sharding.activation_rules(mesh):  # a kernel these devices cannot run: named before any compile
        attention.resolve(cfg.model.attention_impl, layers.DTYPES[cfg.model.dtype])

    t = cfg.train
    dp = sharding.data_parallel_size(mesh)
    micro = t.micro_batch or max(1, t.global_batch // dp)
    if t.global_batch % (micro * dp):
        raise ValueError(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
            f"{micro} × data-parallel size {dp} (mesh.slices × mesh.data × mesh.fsdp × mesh.expert); choose a global "
            f"batch that is a multiple of {micro * dp}"
        )
    if t.global_batch % jax.process_count():
        raise ValueError(
            f"train.global_batch={t.global_batch} is not divisible by {jax.process_count()} processes"
        )
    accum = t.global_batch // (micro * dp)

    steps = summary.budget(cfg)["steps"]
    if steps <= 0:
        raise ValueError(f"train.steps resolves to {steps}; it must be positive")
    if steps > MAX_STEPS:  # the step counter (optax's count, the schedule's step) is an int32
        raise ValueError(f"train.steps resolves to {steps:,}, more than the {MAX_STEPS:,} steps a run's int32 step "
                         "counter holds; give fewer steps (or a larger train.global_batch)")
    tx, schedule = optimizer.make_optimizer(cfg, steps, logical)

    param_shardings = sharding.named_shardings(logical, mesh)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, param_shardings,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    batch_sharding = sharding.batch_sharding(mesh)
    return Run(cfg, mesh, graphdef, abstract_params, param_shardings, state_shardings,
               batch_sharding, tx, schedule, steps, accum, packing.packed_eot(cfg))


def abstract_train_state(run: Run):
    """ShapeDtypeStructs with shardings: what Orbax restores into."""
    shapes = jax.eval_shape(lambda p: new_state(run, p), run.abstract_params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, run.state_shardings
    )


def new_state(run: Run, params):
    """A train state around `params`: fresh optimizer state, step 0."""
    return {"params": params, "opt_state": run.tx.init(params), "step": jnp.zeros((), jnp.int32)}


def init_state(run: Run, seed: int):
    """Parameters and optimizer state created directly sharded on the mesh."""
    _, abstract = models.abstract(run.cfg.model)

    def make():
        return new_state(run, init_params(abstract, seed))

    return jax.jit(make, out_shardings=run.state_shardings)()
