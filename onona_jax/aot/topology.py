"""The slices `onona_jax.aot` compiles for: TPU slices by name (v5e-16, v5p-64, and several joined
by the data-center network) and 8-GPU hosts, their compile-only devices (no TPU or GPU needed),
and the compiler each needs. A chip's peaks and HBM are its row of `chips.CHIPS`."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from onona_jax import chips

GiB = 1024**3

# v4 and v5p slice names count TensorCores (2 per chip); their topologies are 3D tori of chips.
_CORES_TO_3D = {
    8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8",
    512: "4x8x8", 1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16",
}
# v5e and v6e slice names count chips (1 TensorCore each); their topologies are 2D.
_CHIPS_TO_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


# GPUs, compiled without a GPU by the PJRT CUDA plugin from a target config (the device
# description XLA would otherwise query from the GPU): `pip install -e '.[gpu-aot]'`. The
# device's memory and bandwidth in it are the chip's row of `chips.CHIPS`.
GPU_DESCRIPTIONS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}
GPUS_PER_HOST = 8
_GPU_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 8
}}
device_description_str: "{description}"
"""


def gpu_target(generation: str) -> str:
    """The PJRT CUDA plugin's target config of a GPU: its description, with the memory and HBM
    bandwidth of its row in `chips.CHIPS`."""
    chip = chips.CHIPS[generation]
    return _GPU_TARGET.format(description=GPU_DESCRIPTIONS[generation], memory=chip.hbm_bytes,
                              bandwidth=round(chip.hbm_gbps * 1e9))


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # what users call it: v5e-16, v5p-64, h100-16
    generation: str  # v4 | v5e | v5p | v6e | h100 | h200
    topology: str  # libtpu's topology string (v5e:4x4, v5p:2x4x4) or PJRT GPU's (1x2x8)
    chips: int  # per slice
    slices: int = 1  # TPU slices joined by the data-center network (DCN): --slices

    @property
    def label(self) -> str:
        """v5e-16, or 2 × v5e-16 for two slices."""
        return self.name if self.slices == 1 else f"{self.slices} × {self.name}"

    @property
    def platform(self) -> str:
        return "gpu" if self.generation in GPU_DESCRIPTIONS else "tpu"

    @property
    def hbm_per_chip(self) -> int:
        return chips.CHIPS[self.generation].hbm_bytes

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip in libtpu's topology description: v5p and the single-core
        v5e/v6e chips are one device each (v5p runs its two cores as one, megacore); libtpu
        0.0.42 describes a v4 chip as its two TensorCores, so a v4 device has half the chip's HBM."""
        return 2 if self.generation == "v4" else 1

    @property
    def slice_devices(self) -> int:
        return self.chips * self.devices_per_chip

    @property
    def devices(self) -> int:
        """All slices' devices."""
        return self.slice_devices * self.slices

    @property
    def hbm_per_device(self) -> int:
        return self.hbm_per_chip // self.devices_per_chip


def _slice_table() -> dict[str, Slice]:
    table = {}
    for gen, largest in (("v4", 4096), ("v5p", 1024)):
        for cores, shape in _CORES_TO_3D.items():
            if cores <= largest:
                table[f"{gen}-{cores}"] = Slice(f"{gen}-{cores}", gen, f"{gen}:{shape}", cores // 2)
    for gen in ("v5e", "v6e"):
        for chips, shape in _CHIPS_TO_2D.items():
            table[f"{gen}-{chips}"] = Slice(f"{gen}-{chips}", gen, f"{gen}:{shape}", chips)
    for gen in GPU_DESCRIPTIONS:  # hosts of 8 GPUs
        for hosts in (1, 2, 4, 8, 16, 32):
            n = hosts * GPUS_PER_HOST
            table[f"{gen}-{n}"] = Slice(f"{gen}-{n}", gen, f"1x{hosts}x{GPUS_PER_HOST}", n)
    return table


SLICES = _slice_table()


def get_slice(name: str) -> Slice:
    """A user's slice name (v5e-16, h100-16) or a libtpu topology string (v5e:4x4) -> Slice."""
    if name in SLICES:
        return SLICES[name]
    for s in SLICES.values():
        if s.topology == name and s.platform == "tpu":
            return s
    raise ValueError(
        f"unknown --topology={name!r}; choose a slice name: " + ", ".join(SLICES)
    )


def libtpu_missing() -> str | None:
    if importlib.util.find_spec("libtpu") is None:
        return ("libtpu is not installed, and it compiles for TPUs; install it with "
                "pip install -e '.[tpu-aot]' (or pip install 'libtpu==0.0.42.*', the build for jax 0.10.2)")
    return None


def compiler_missing(s: Slice) -> str | None:
    if s.platform == "tpu":
        return libtpu_missing()
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return ("the PJRT CUDA plugin is not installed, and it compiles for GPUs; install it with "
                "pip install -e '.[gpu-aot]' (the plugin and cuDNN's wheel, for cuDNN attention; no GPU or driver needed)")
    return None


def cudnn_missing(cfg, s: Slice) -> str | None:
    """On a GPU host, cuDNN's fused attention (what `auto` picks in bf16) is lowered with the
    cuDNN library's version at hand: its wheel must be installed, though no GPU is."""
    if s.platform != "gpu" or cfg.model.attention_impl not in ("auto", "cudnn") or cfg.model.dtype == "float32":
        return None
    try:
        from jax_cuda12_plugin import _versions

        _versions.cudnn_get_version()
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError("cuDNN not found.")
        return ("cuDNN attention (model.attention_impl=auto on a GPU, bf16) needs cuDNN's library to compile: "
                "pip install -e '.[gpu-aot]' (nvidia-cudnn-cu12), or plan with --config.model.attention_impl=xla")
    return None


def topology_devices(s: Slice):
    """The slice's compile-only devices (no TPU or GPU needed)."""
    # libtpu takes a machine-wide lock on load (a TPU VM runs one TPU job); compiling only, we
    # can share it with another planning process.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU VM metadata server to ask
    from jax.experimental import topologies

    if s.platform == "gpu":
        target = gpu_target(s.generation)
        return list(topologies.get_topology_desc(platform="cuda", topology=s.topology, target_config=target).devices)
    kwargs = {"chips_per_host_bounds": (1, 1, 1)} if s.chips == 1 else {}  # a lone chip is its own host
    if s.slices > 1:  # devices with a slice_index; XLA compiles one slice's program (see collective_bytes)
        kwargs["num_slices"] = s.slices
    return list(topologies.get_topology_desc(platform="tpu", topology_name=s.topology, **kwargs).devices)
