"""Parameter declaration and initialisation keyed by path and seed.

Modules declare parameters with `param(shape, axes, init)`: a placeholder value plus two
pieces of metadata, the logical axis names (mapped onto mesh axes by one rules table in
`sharding.py`) and the name of an initialiser. Values are filled in afterwards by
`init_params`, where each parameter's random key is derived from the seed and the
parameter's *path*, not from the order of construction. Hence

* the body of a twin and a standard model start identical for the same seed (and twin's A
  equals standard's E: they share the init name `tables/A`), whatever else exists;
* a scanned model (layers stacked on a leading `layers` axis) and an unscanned one start
  from the same values: layer i's key is fold_in(key(path), i) in both.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

INIT_STD = 0.02


class Stack(NamedTuple):
    """A parameter stacked over layers for scanning: entry r is layer offset + stride·r
    (stride > 1 when a scanned group holds several layers, e.g. 3 GDN + 1 attention)."""

    count: int
    stride: int = 1
    offset: int = 0


def param(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    init: str = "normal",
    *,
    stack: Stack | None = None,
    init_name: str | None = None,
    scale: float = 1.0,
) -> nnx.Param:
    """Declare a parameter. `stack` prepends a `layers` axis (scan over layers); `scale`
    multiplies the initialiser's values (the vocabulary tables' `model.table_init_scale`), the
    key staying the path's, so a scaled table is `scale` × the unscaled one (to fp32 rounding)."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
    if init not in INITIALIZERS:
        raise ValueError(f"unknown initialiser {init!r}; choose one of {sorted(INITIALIZERS)}")
    meta = {}
    if stack is not None:
        shape, axes = (stack.count, *shape), ("layers", *axes)
        meta = {"layer_stride": stack.stride, "layer_offset": stack.offset}
    if scale != 1.0:
        meta["init_scale"] = float(scale)
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=tuple(axes), init=init, init_name=init_name, **meta)


# The initialisers every module may name. A family adds its own through its `Family` record
# (`models.register` calls `register_initializers`): GDN's `a_log` and `dt_bias` live in
# `models/gdn.py`. The name only picks the function; the key comes from the path (`init_value`).
INITIALIZERS: dict[str, Callable[[jax.Array, tuple[int, ...]], jax.Array]] = {
    "normal": lambda key, shape: INIT_STD * jax.random.normal(key, shape, jnp.float32),
    "ones": lambda key, shape: jnp.ones(shape, jnp.float32),
    "zeros": lambda key, shape: jnp.zeros(shape, jnp.float32),
}


def register_initializers(initializers: dict[str, Callable]) -> None:
    """Make `initializers` (name -> fn(key, shape)) available to `param(..., init=name)`. A name
    already taken by another function is an error: two families must not disagree on it."""
    for name, fn in initializers.items():
        if INITIALIZERS.get(name, fn) is not fn:
            raise ValueError(f"initialiser name {name!r} is taken by another function; give the new "
                             "initialiser a name of its own")
    INITIALIZERS.update(initializers)


class ParamGroup(NamedTuple):
    """How parameters count in the summary (`summary.param_counts`, `flops_per_token`): those
    whose path (`path_str`: layer indices dropped, e.g. 'trunk/layers/attn/q') matches one of
    the shell-style globs `paths` (`fnmatch`: `*` crosses '/') are rows of `component`;
    `matmul`: each weight is multiplied once per token that uses it (2 FLOPs per weight), not a
    norm weight, a decay or a query that the family counts in its extra FLOPs; `used`: None
    (every token uses them) or cfg_model -> Fraction of tokens that do (MoE experts: top_k/E),
    which scales their FLOPs and the active parameter count. A family declares a tuple of
    these (`models.Family.components`); every trunk parameter must match exactly one."""

    component: str
    paths: tuple[str, ...]
    matmul: bool = True
    used: Callable | None = None


def path_str(path: tuple[Any, ...]) -> str:
    """'trunk/layers/attn/q' — integer (layer or group position) components dropped."""
    return "/".join(str(p) for p in path if not isinstance(p, int))


def _layer_index(path: tuple[Any, ...]) -> int | None:
    ints = [p for p in path if isinstance(p, int)]
    return ints[0] if ints else None


def abstract_state(model_fn: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and the abstract (shape-only) state of a model, no allocation."""
    return nnx.split(nnx.eval_shape(model_fn))


def flat_variables(state: nnx.State):
    """[(path tuple, Variable)] in a deterministic order."""
    return list(nnx.to_flat_state(state))


def init_value(seed_key: jax.Array, path: tuple[Any, ...], var: nnx.Variable) -> jax.Array:
    meta = var.get_metadata()
    base, scale = INITIALIZERS[meta["init"]], meta.get("init_scale", 1.0)
    init = base if scale == 1.0 else (lambda k, shape: base(k, shape) * scale)
    name = meta.get("init_name") or path_str(path)
    key = jax.random.fold_in(seed_key, zlib.crc32(name.encode()))
    shape = tuple(var.shape)
    if meta["axes"][:1] == ("layers",):  # stacked: layer i gets fold_in(key, i)
        layers = meta["layer_offset"] + meta["layer_stride"] * jnp.arange(shape[0])
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(layers)
        return jax.vmap(lambda k: init(k, shape[1:]))(keys)
    index = _layer_index(path)
    if index is not None:
        key = jax.random.fold_in(key, index)
    return init(key, shape)


def init_params(state: nnx.State, seed: int) -> dict:
    """Pure dict of fp32 arrays for an abstract state. Jit it with out_shardings to create
    the parameters directly sharded on a mesh."""
    seed_key = jax.random.key(seed)
    flat = {path: init_value(seed_key, path, var) for path, var in flat_variables(state)}
    return _unflatten(flat)


def logical_axes(state: nnx.State) -> dict:
    """Pure dict of logical-axis tuples (wrapped in PartitionSpec so they stay pytree leaves)."""
    flat = {p: jax.sharding.PartitionSpec(*v.get_metadata()["axes"]) for p, v in flat_variables(state)}
    return _unflatten(flat)


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return out


def count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
