"""sharding.make_mesh: shapes the devices cannot take are errors, TPU placement by topology
(libtpu's compile-only devices, no TPU needed), and multi-slice meshes (mesh.slices) whose
data axis alone spans the slices."""

import dataclasses

import pytest

from onona_jax import sharding
from onona_jax.aot.topology import get_slice, libtpu_missing, topology_devices

needs_libtpu = pytest.mark.skipif(libtpu_missing() is not None, reason="libtpu missing: pip install -e '.[tpu-aot]'")


def _tpu(topology, slices=1):
    return topology_devices(dataclasses.replace(get_slice(topology), slices=slices))


def test_cpu_mesh_keeps_device_order_and_rejects_slices():
    import jax

    mesh = sharding.make_mesh(2, 2, 2, expert=1)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
    with pytest.raises(ValueError, match=r"mesh.slices=2: these 8 cpu devices carry no slice_index.*mesh.slices=1"):
        sharding.make_mesh(1, -1, 1, slices=2)
    with pytest.raises(ValueError, match=r"has 3 devices but this run has 8.*product is 8"):
        sharding.make_mesh(3, 1, 1)
    with pytest.raises(ValueError, match="mesh.slices=0 must be a positive integer"):
        sharding.make_mesh(1, -1, 1, slices=0)


@needs_libtpu
def test_two_slices_put_only_the_data_axis_across_slices():
    devices = _tpu("v5e-16", slices=2)
    # docs/pods.md's FSDP recipe plus mesh.slices=2: fsdp over each slice's 16 chips, data = 2 slices
    mesh = sharding.make_mesh(1, -1, 1, devices, slices=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 16, "expert": 1, "tensor": 1}
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
    # each slice placed like a single slice: the same chips in the same order
    single = sharding.make_mesh(1, -1, 1, _tpu("v5e-16"))
    assert [tuple(d.coords) for d in mesh.devices[1].flat] == [tuple(d.coords) for d in single.devices.flat]
    # mesh.data counts replicas within a slice: data = slices × data
    mesh = sharding.make_mesh(2, -1, 1, devices, slices=2)
    assert dict(mesh.shape)["data"] == 4 and dict(mesh.shape)["fsdp"] == 8
    for fsdp_group in mesh.devices.reshape(4, 8):
        assert len({d.slice_index for d in fsdp_group}) == 1
    # a reader (evaluation, export) takes the slices its devices span
    assert sharding.device_slices(devices) == 2 and sharding.device_slices() == 1
    with pytest.raises(ValueError, match=r"mesh.slices=1 but these 32 devices span 2 slice\(s\).*mesh.slices=2"):
        sharding.make_mesh(1, -1, 1, devices)
    with pytest.raises(ValueError, match=r"has 32 devices but each slice has 16.*product is 16"):
        sharding.make_mesh(1, 32, 1, devices, slices=2)


@needs_libtpu
def test_tpu_placement_without_a_silent_fallback():
    devices = _tpu("v5e-16")
    # data=2 × fsdp=8 on a 4×4 torus needs a torus axis split between them: placed by topology,
    # each fsdp group two rows of 4 neighbouring chips
    mesh = sharding.make_mesh(2, 8, 1, devices)
    for group in mesh.devices.reshape(2, 8):
        ys = sorted({d.coords[1] for d in group})
        assert len(ys) == 2 and len({d.coords[0] for d in group}) == 4
    # not a contiguous block of chips: no torus to place on, an error naming the devices
    holes = [d for d in devices if tuple(d.coords[:2]) in {(0, 0), (1, 0), (0, 1)}]
    with pytest.raises(ValueError, match="these 3 TPU devices are not one contiguous block"):
        sharding.make_mesh(1, 3, 1, holes)
    # libtpu describes a v4 chip as its 2 TensorCores: a chip's two cores are neighbours in the mesh
    v4 = sharding.make_mesh(1, -1, 1, _tpu("v4-16"))
    flat = list(v4.devices.flat)
    assert all(a.coords == b.coords and (a.core_on_chip, b.core_on_chip) == (0, 1)
               for a, b in zip(flat[::2], flat[1::2]))
