"""The device mesh and the one table that maps logical axis names onto mesh axes.

Parameters carry logical names (`vocab`, `embed`, `heads`, ...; see `params.param`) and
activations are constrained with names too (`batch`, `act_embed`, ...). Which mesh axis each
name lands on is decided here and only here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Outermost first: a tensor-parallel group is the devices closest together, then an
# expert-parallel one (an all-to-all per MoE layer), then FSDP (gathers per layer), then data.
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical name -> mesh axis (or axes, or None = replicated). First match wins.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", ("fsdp", "expert")),  # outside the experts, the expert axis is more FSDP
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    # MoE experts [E, d, f]: E over the expert axis (expert parallelism; tokens reach their
    # experts by all-to-all, moe.py), d and f as the dense MLP's. With mesh.expert = 1 every
    # device holds all experts, sharded like the MLP.
    ("expert", "expert"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    # activations
    ("batch", ("data", "fsdp", "expert")),  # the expert axis splits tokens outside the MoE
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # Gated DeltaNet (gdn.py): value/key heads split like attention heads; conv taps whole
    ("gdn_heads", "tensor"),
    ("conv", None),
)

_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar(
    "onona_mesh_rules", default=None
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None, *, expert: int = 1,
              slices: int = 1) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over all devices; one axis may be -1 (takes the rest).

    `slices` > 1 (mesh.slices) is a multi-slice TPU job: data, fsdp, expert and tensor describe
    ONE slice (their product, with -1 resolved, is a slice's devices), and the mesh's data axis
    is slices × data, slice-major, so only the data axis crosses the data-center network (DCN)
    between slices: parameter gathers (fsdp), expert all-to-alls and tensor collectives stay on
    a slice's ICI, and the gradient reduction over data is the one collective that crosses
    (MaxText's dcn_data_parallelism, with the ICI axes as given). The slices are told apart by
    the devices' `slice_index`, and their number must be the config's: a mismatch, or slices >
    1 on devices without one (CPU, GPU), is an error, as is any shape a slice cannot take."""
    devices = list(jax.devices() if devices is None else devices)
    named = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    sizes = [named[a] for a in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"mesh {named}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh {named}: sizes must be positive or -1")
    groups = _slice_groups(devices, slices)
    per_slice = len(groups[0])
    one = (f" (mesh.data/fsdp/expert/tensor describe one of this run's {slices} slices; the data axis "
           f"is mesh.slices × mesh.data)") if slices > 1 else ""
    has = f"each slice has {per_slice}{one}" if slices > 1 else f"this run has {per_slice}"
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if per_slice % known:
            raise ValueError(
                f"mesh {named}: {per_slice} devices{' per slice' if slices > 1 else ''} are not divisible by "
                f"the fixed axes' product {known}{one}; set --config.mesh.* so they divide"
            )
        sizes[sizes.index(-1)] = per_slice // known
    if math.prod(sizes) != per_slice:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but {has}; set "
            f"--config.mesh.data/fsdp/expert/tensor so their product is {per_slice} (one of them may be -1)"
        )
    # Slice-major along data: what mesh_utils.create_hybrid_device_mesh builds for a DCN mesh
    # shape (slices, 1, 1, 1), with each slice placed by `_place_slice`.
    grid = np.concatenate([_place_slice(sizes, g) for g in groups], axis=0)
    return Mesh(grid, MESH_AXES)


def device_slices(devices=None) -> int:
    """How many slices (distinct slice_index) the devices span; 1 without slice_index. For
    readers (evaluation, export) that take whatever devices they are given: their data axis
    may span slices, as a training job's does."""
    devices = jax.devices() if devices is None else devices
    return max(1, len({getattr(d, "slice_index", None) for d in devices}))


def _slice_groups(devices, slices: int) -> list[list]:
    """The devices grouped by slice (sorted by slice_index); one group when slices == 1."""
    if not isinstance(slices, int) or slices < 1:
        raise ValueError(f"mesh.slices={slices!r} must be a positive integer (TPU slices joined by DCN)")
    found: dict = {}
    for d in devices:
        found.setdefault(getattr(d, "slice_index", None), []).append(d)
    if slices > 1 and None in found:
        d = devices[0]
        raise ValueError(
            f"mesh.slices={slices}: these {len(devices)} {d.platform} devices carry no slice_index, so "
            f"they cannot be told apart into slices; mesh.slices > 1 is for multi-slice TPU jobs (and "
            f"`python -m onona_jax.aot --slices={slices}`); use mesh.slices=1 here"
        )
    if len(found) != slices:
        raise ValueError(
            f"mesh.slices={slices} but these {len(devices)} devices span {len(found)} slice(s) "
            f"(slice_index {sorted(k for k in found if k is not None)}); set --config.mesh.slices={len(found)}"
        )
    groups = [found[k] for k in sorted(found, key=lambda k: -1 if k is None else k)]
    if len({len(g) for g in groups}) > 1:
        raise ValueError(f"mesh.slices={slices}: the slices have unequal device counts "
                         f"{[len(g) for g in groups]}; a multi-slice mesh needs equal slices")
    return groups


def _place_slice(sizes: list[int], devices: list) -> np.ndarray:
    """One slice's devices as an array of `sizes`, placed by the platform's topology.

    TPU: by `mesh_utils.create_device_mesh` (each mesh axis on whole torus axes; when the
    shape needs a torus axis split between two mesh axes, e.g. data=2 × fsdp=8 on a 4×4
    v5e-16, with the split allowed). libtpu describes a compile-only v4 chip as its two
    TensorCores, which mesh_utils does not place (it wants one device per chip): those are
    ordered by chip (x fastest) with a chip's two cores innermost, so tensor or fsdp pairs share
    a chip. Other platforms: mesh_utils' own order (CPU: as given; GPU: by device id)."""
    from jax.experimental import mesh_utils

    if devices[0].platform != "tpu":
        return mesh_utils.create_device_mesh(sizes, devices)
    if any(getattr(d, "core_on_chip", 0) for d in devices):
        ordered = sorted(devices, key=lambda d: (*reversed(d.coords), d.core_on_chip))
        return np.asarray(ordered).reshape(sizes)
    shape = dict(zip(MESH_AXES, sizes))
    coords = np.asarray([d.coords for d in devices])
    box = math.prod(int(n) for n in coords.max(0) - coords.min(0) + 1)
    if box != len(devices):
        raise ValueError(
            f"mesh {shape}: these {len(devices)} TPU devices are not one contiguous block of chips "
            f"(their coordinates span {box} chips), so they have no torus to place the mesh on; "
            f"pass a whole slice's devices (or a contiguous block of it)"
        )
    try:
        return mesh_utils.create_device_mesh(sizes, devices)
    except NotImplementedError:  # no assignment of whole torus axes: split one
        try:
            return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        except (NotImplementedError, ValueError) as err:
            raise ValueError(
                f"mesh {shape} cannot be placed on these {len(devices)} TPU devices (torus "
                f"{'x'.join(str(int(n)) for n in coords.max(0) - coords.min(0) + 1)}): {err}; choose "
                f"--config.mesh.* sizes that are products of the torus's axis lengths"
            ) from None


def logical_to_mesh(spec: P, rules=RULES) -> P:
    table = dict(rules)
    out, used = [], set()
    for name in spec:
        axis = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule in sharding.RULES")
        # a mesh axis may shard only one dimension of an array
        axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def batch_axes(rules=RULES):
    """The mesh axes the batch is split over (the `batch` rule): data, fsdp and expert."""
    return logical_to_mesh(P("batch"), rules)[0]


def data_parallel_size(mesh: Mesh, rules=RULES) -> int:
    """How many ways the batch is split: the product of the batch axes' sizes."""
    axes = batch_axes(rules)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(mesh.shape[a] for a in axes)


def batch_sharding(mesh: Mesh, ndim: int = 2, rules=RULES) -> NamedSharding:
    """Rows split over the batch axes, the other `ndim - 1` dimensions whole."""
    return NamedSharding(mesh, P(batch_axes(rules), *([None] * (ndim - 1))))


def loss_layout(mesh: Mesh, rules=RULES):
    """(mesh, batch axes, vocab axis or None) for the fused losses (`loss.mixture_nll`,
    `loss_vocab.target_log_probs`): each device streams its shard of the vocabulary (the `vocab`
    rule's axis, when it has more than one device) for its rows of the batch. None on a
    one-device mesh: there are no collectives to run."""
    if mesh.size == 1:
        return None
    vocab = logical_to_mesh(P("vocab"), rules)[0]
    vocab_axes = (vocab,) if isinstance(vocab, str) else tuple(vocab or ())
    if math.prod(mesh.shape[a] for a in vocab_axes) <= 1:
        vocab = None
    return mesh, batch_axes(rules), vocab


def check_divisible(logical, abstract, mesh):
    """Every sharded parameter dimension must divide evenly by its mesh axes."""
    for (path, spec), (_, var) in zip(
        _flat_with_paths(logical), _flat_with_paths(abstract)
    ):
        mesh_spec = logical_to_mesh(spec)
        for dim, (size, axes) in enumerate(zip(var.shape, mesh_spec)):
            if axes is None:
                continue
            n = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            if size % n:
                raise ValueError(
                    f"parameter {path} dimension {dim} ({spec[dim]}) has size {size}, not divisible "
                    f"by mesh axis {axes} of size {n}; choose --config.mesh.* so that it divides "
                    f"(e.g. heads, kv_heads, d_ff and vocab_size divisible by mesh.tensor, "
                    f"moe.n_experts by mesh.expert)"
                )


def _flat_with_paths(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
    return [("/".join(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf in leaves]



def named_shardings(logical_tree, mesh: Mesh, rules=RULES):
    """Pytree of PartitionSpec(logical names) -> pytree of NamedSharding on `mesh`."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_mesh(s, rules)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, P),
    )


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules=RULES):
    """Within this context `constrain` pins activations to the mesh; outside it is a no-op,
    so the model runs unchanged on one device and in tests."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def under_rules(fn, mesh: Mesh, rules=RULES):
    """`fn` traced inside `activation_rules(mesh)`. The train, eval and scoring steps are
    wrapped in it before `jax.jit`, so their sharding never depends on the caller's context
    (jit caches one trace per function, whatever context a later call comes from)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with activation_rules(mesh, rules):
            return fn(*args, **kwargs)

    return wrapped


def active() -> tuple[Mesh, tuple] | None:
    """(mesh, rules) of the enclosing `activation_rules`, or None outside one."""
    return _ACTIVE.get()


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing `activation_rules`, or None outside one."""
    found = _ACTIVE.get()
    return None if found is None else found[0]


def platform() -> str:
    """"tpu", "gpu" or "cpu": the devices of the active mesh (what a step compiles for, also a
    deviceless TPU compile on this CPU), else JAX's default backend."""
    mesh = active_mesh()
    name = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def constrain(x, logical: Iterable[str | None]):
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh(P(*logical), rules)))
