"""Ahead-of-time compilation for TPU slices (and 8-GPU H100/H200 hosts) from a CPU host: does
a config fit, and what does one step cost there?

    python -m onona_jax.aot --config=configs/paper.py:dense-142m-twin --topology=v5e-16 \\
        --config.mesh.data=1 --config.mesh.fsdp=-1 [--slices=2] [--compare_head=standard] [--fit] [--json]

With `libtpu` installed (`pip install -e '.[tpu-aot]'`), `jax.experimental.topologies` describes
the devices of any TPU slice without owning one (with the PJRT CUDA plugin, `.[gpu-aot]`, and a
GPU target config, those of GPU hosts). This module builds the run's mesh on those
devices with the trainer's own `setup` (the same `sharding.RULES`), lowers the trainer's own
train and eval steps (`make_train_step`, `make_eval_step`) from abstract shapes that carry the
shardings, compiles them with the TPU compiler and reports, per device:

* HBM from XLA's buffer assignment (`compiled.memory_analysis()`): arguments, temporaries,
  outputs (less what the donated state aliases) and their total, against the chip's HBM;
* FLOPs per step and device: the model's (`summary.flops_per_token` × tokens / devices) and
  XLA's `compiled.cost_analysis()` (`xla_flops`, which counts every while-loop body once: the
  scanned layers, micro-batches and loss chunks, so it is a lower bound);
* collective bytes per step by kind, read from the optimized HLO: each all-gather,
  reduce-scatter, all-reduce, all-to-all and collective-permute counts the larger of its
  input and output on one device, times the trip counts of the loops around it (the layer
  scan, the micro-batch scan). `--slices=N` compiles for N such slices joined by the
  data-center network (mesh.slices: the data axis across slices, the rest within one), and
  the bytes are also split by link (`collective_bytes_by_link`: within a slice over ICI,
  across slices over DCN).

* the attention kernel in the optimized HLO (`attention_kernels`: splash's Mosaic calls on
  TPU, cuDNN's fused attention on GPU, none for plain XLA), the `[..., T, T]` score matrices the
  program materialises, and its largest arrays by shape.

`--fit` weighs plans: for each remat policy (none, attention_experts for MoE, attention, dots,
attention_offload, full) the
largest micro-batch that fits, each with its HBM, collective bytes, recomputed FLOPs and a
MODELLED step time (`modelled_time`: a roofline from the compiled program and the chip's
peaks, `chips.CHIPS`; not a measurement), and picks the fastest. A config that does not fit
exits with status 1, the needed and the available HBM and the overrides that would help.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time

from absl import flags

from onona_jax import chips, cli, paths

GiB = 1024**3

# ----------------------------------------------------------------------------- the slices


# v4 and v5p slice names count TensorCores (2 per chip); their topologies are 3D tori of chips.
_CORES_TO_3D = {
    8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8",
    512: "4x8x8", 1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16",
}
# v5e and v6e slice names count chips (1 TensorCore each); their topologies are 2D.
_CHIPS_TO_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


# GPUs, compiled without a GPU by the PJRT CUDA plugin from a target config (the device
# description XLA would otherwise query from the GPU): `pip install -e '.[gpu-aot]'`.
# device_memory_size is what CUDA reports for the whole device.
GPU_SPECS = {
    "h100": dict(description="NVIDIA H100 80GB HBM3", memory=84_929_347_584, bandwidth=3_352_320_000_000),
    "h200": dict(description="NVIDIA H200", memory=150_754_820_096, bandwidth=4_800_000_000_000),
}
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
        return "gpu" if self.generation in GPU_SPECS else "tpu"

    @property
    def hbm_per_chip(self) -> int:
        if self.platform == "gpu":
            return GPU_SPECS[self.generation]["memory"]
        return int(chips.CHIPS[self.generation].hbm_gib * GiB)

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
    for gen in GPU_SPECS:  # hosts of 8 GPUs
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
        target = _GPU_TARGET.format(**GPU_SPECS[s.generation])
        return list(topologies.get_topology_desc(platform="cuda", topology=s.topology, target_config=target).devices)
    kwargs = {"chips_per_host_bounds": (1, 1, 1)} if s.chips == 1 else {}  # a lone chip is its own host
    if s.slices > 1:  # devices with a slice_index; XLA compiles one slice's program (see collective_bytes)
        kwargs["num_slices"] = s.slices
    return list(topologies.get_topology_desc(platform="tpu", topology_name=s.topology, **kwargs).devices)


# ----------------------------------------------------------------------------- collectives

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_CALLS = re.compile(r"\b(body|condition|to_apply|calls|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CHANNEL = re.compile(r"channel_id=(\d+)")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_ORIGIN = re.compile(r'op_name="([^"]*)"(?:\s*stack_frame_id=(\d+))?')
_CONSTANT = re.compile(r"[su]32\[\]\S* constant\((\d+)\)")
# A multi-slice program is one slice's: its collectives' replica groups stay within the slice,
# and what crosses slices (DCN) is a host-transfer send to libtpu's megascale runtime, tagged
# with the cross-slice collective it is part of.
_MEGASCALE = re.compile(r'\ssend\(.*_xla_megascale_transfer_type="(\w+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')


def _shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(int(n * _DTYPE_BYTES[dtype]))
    return out


def _group_size(line: str, n_devices: int) -> int:
    m = _MESH_GROUPS.search(line)  # mesh['axis_0'=1,'axis_1'=16] {'axis_1'}: the named axes' product
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (a.split("=") for a in m.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
    m = _IOTA_GROUPS.search(line)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS.search(line)
    if m and m.group(1):
        return len(m.group(1).split(","))
    return n_devices


def _trip_count(while_line: str, condition: list[str]) -> int:
    """XLA's `known_trip_count`, else the bound the condition compares the counter with
    (XLA:TPU writes no trip count; jax's scans count from 0 while i < n)."""
    m = _TRIP.search(while_line)
    if m:
        return int(m.group(1))
    bounds = [int(c) for line in condition for c in _CONSTANT.findall(line)]
    if len(bounds) == 1:
        le = any("direction=LE" in line for line in condition)
        return bounds[0] + (1 if le else 0)
    return 1


def _executions(hlo: str):
    """(bodies, times, order): each computation's lines, how many times it runs per execution
    of ENTRY (the trip counts of the while loops around it multiplied in), and the order they
    were reached from ENTRY."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line.strip()) if line and not line.startswith(" ") else None
        if m:
            current = m.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            bodies[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    times: dict[str, int] = {entry: 1}  # executions of each computation per step
    order = [entry]
    for name in order:
        for line in bodies.get(name, ()):
            calls = dict((k, v) for k, v in _CALLS.findall(line))
            trip = 1
            if "body" in calls:
                cond = calls.get("condition", "").strip(" {}%")
                trip = _trip_count(line, bodies.get(cond, []))
            for kind, callees in _CALLS.findall(line):
                for callee in (c.strip(" {}%") for c in callees.split(",")):
                    if callee not in bodies:
                        continue
                    n = times[name] * (trip if kind == "body" else 1)
                    if n > times.get(callee, 0):
                        if callee not in times:
                            order.append(callee)
                        times[callee] = n
    return bodies, times, order


def collective_bytes(hlo: str, n_devices: int = 1, details: list | None = None,
                     by_link: dict | None = None, slices: int = 1) -> dict[str, int]:
    """Bytes per device per execution of the ENTRY computation, by collective kind, from
    optimized HLO text (within and across slices together).

    An all-gather counts its gathered result, a reduce-scatter its full input (result × group
    size), an all-reduce, all-to-all or collective-permute its buffer; each is multiplied by
    the trip counts of the while loops around it (the layer scan, the micro-batch scan, the
    fused loss's vocabulary chunks). XLA:TPU wraps asynchronous collectives in fusions that
    repeat the op (start, continuations, done) and may carry one through a later loop (the
    layer scan) to overlap it with compute: one channel id counts once, as often as the
    least-repeated of its copies runs (where it is issued).

    A multi-slice program (`slices` > 1) is one slice's: its collectives stay within the slice
    (ICI), and each cross-slice (DCN) collective is a send to the megascale runtime whose
    buffer is this device's part (a hierarchical all-reduce sends the shard left by a
    reduce-scatter within the slice); it counts by the same rules (an all-gather's result is
    the sent part × slices). `by_link`, when given, receives {"within_slice": {kind: bytes},
    "cross_slice": {kind: bytes}}."""
    bodies, times, order = _executions(hlo)
    counted: dict[tuple, tuple[str, int, int]] = {}
    for name in order:
        for i, line in enumerate(bodies[name]):
            cross = _MEGASCALE.search(line)
            if cross:
                kind = cross.group(1).lower().replace("_", "-")
                kind = {"one-to-one": "collective-permute"}.get(kind, kind)
                nbytes = _shape_bytes(line[:line.index(" send(")])[0]
                if kind == "all-gather":
                    nbytes *= slices
                rendezvous = _RENDEZVOUS.search(line)
                key = ("dcn", rendezvous.group(1) if rendezvous else f"{name}:{i}")
                if key not in counted or times[name] < counted[key][1]:
                    counted[key] = (kind, times[name], nbytes)
                continue
            m = _OP.search(line)
            if not m:
                continue
            result, kind, start = m.groups()
            sizes = _shape_bytes(result)
            if not sizes:
                continue
            if start and kind == "collective-permute":  # (input, output, contexts)
                nbytes = max(sizes)
            elif start and kind == "all-gather":  # (inputs..., outputs...)
                nbytes = sum(sizes[len(sizes) // 2:])
            else:  # one array, or a combined collective's tuple of outputs
                nbytes = sum(sizes)
            if kind == "reduce-scatter":
                nbytes *= _group_size(line, n_devices)
            channel = _CHANNEL.search(line)
            # shard_map's collectives may all carry channel_id=1 on XLA:TPU: the op's source
            # (op_name, stack frame) and size tell distinct ops apart; an async op's copies share them.
            origin = _ORIGIN.search(line)
            key = (("channel", channel.group(1), kind, nbytes, origin.groups() if origin else None)
                   if channel else (name, i))
            old = counted.get(key)
            if old is None or times[name] < old[1]:
                counted[key] = (kind, times[name], nbytes)
    out = dict.fromkeys(COLLECTIVES, 0)
    links = {"within_slice": dict.fromkeys(COLLECTIVES, 0), "cross_slice": dict.fromkeys(COLLECTIVES, 0)}
    for key, (kind, n, nbytes) in counted.items():
        out[kind] = out.get(kind, 0) + n * nbytes
        link = links["cross_slice" if key[0] == "dcn" else "within_slice"]
        link[kind] = link.get(kind, 0) + n * nbytes
    if by_link is not None:
        by_link.update(links)
    if details is not None:  # the biggest contributors, for reading where traffic comes from
        for key, (kind, n, nbytes) in sorted(counted.items(), key=lambda kv: -kv[1][1] * kv[1][2]):
            details.append({"kind": kind, "id": key[1], "executions": n, "bytes": nbytes,
                            "link": "cross_slice" if key[0] == "dcn" else "within_slice",
                            **({"origin": key[4][0][-120:]} if key[0] == "channel" and key[4] else {})})
    return out


# ----------------------------------------------------------------------------- arrays and kernels

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([\w\-]+)\(")
_FUSION_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_INSTRUCTION_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
# Results that are not a new buffer: aliases, and control flow whose bodies are counted.
_NO_BUFFER = {"bitcast", "get-tuple-element", "parameter", "tuple", "constant", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier"}


def materialised_arrays(hlo: str) -> list[tuple[str, int]]:
    """(shape, bytes) of every instruction result that is a buffer of its own in optimized HLO:
    the instructions of the entry, loop bodies and branches, not those inside a fusion (which
    live in registers or on-chip memory). Tuples count each element; bitcasts and
    get-tuple-elements alias another buffer and are left out."""
    bodies = _executions(hlo)[0]
    fused = set()
    for lines in bodies.values():
        for line in lines:
            if " fusion(" in line or "custom-call(" in line:
                fused.update(_FUSION_CALLS.findall(line))
    out = []
    for name, lines in bodies.items():
        if name in fused:
            continue
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2) in _NO_BUFFER:
                continue
            for dtype, dims in _SHAPE.findall(m.group(1)):
                shape = f"{dtype}[{dims}]"
                out.append((shape, _shape_bytes(shape)[0]))
    return out


def largest_arrays(hlo: str, n: int = 6) -> list[dict]:
    """The `n` largest array shapes materialised in the program, with how many instructions
    produce one (`materialised_arrays`): where the HBM goes, by shape."""
    counts: dict[str, list[int]] = {}
    for shape, nbytes in materialised_arrays(hlo):
        counts.setdefault(shape, [nbytes, 0])[1] += 1
    top = sorted(counts.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"shape": shape, "bytes": nbytes, "count": count} for shape, (nbytes, count) in top]


def score_matrix_arrays(hlo: str, seq_len: int, widths: tuple[int, ...] = ()) -> list[str] | None:
    """Shapes of materialised arrays whose last two dimensions are both the sequence length
    (padded or not): attention score or probability matrices [..., T, T], and XLA's causal
    mask (pred). None (undecidable by shape) when one of the model's `widths` (d_model, d_ff)
    is T too: a [..., T, d] activation would look the same."""
    lo, hi = seq_len, -(-seq_len // 128) * 128
    if any(lo <= w <= hi for w in widths):
        return None
    found = set()
    for shape, _ in materialised_arrays(hlo):
        dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
        if len(dims) >= 2 and lo <= dims[-1] <= hi and lo <= dims[-2] <= hi:
            found.add(shape)
    return sorted(found)


_OPERANDS = re.compile(r"\(([^)]*)\)")


def _update_bytes(line: str, shapes: dict[str, str]) -> int:
    """Bytes a dynamic-update-slice writes: its update operand (the second), not the buffer."""
    m = _OPERANDS.search(line[line.index("dynamic-update-slice("):])
    ops = [o.strip().split()[-1].lstrip("%") for o in m.group(1).split(",")] if m else []
    return sum(_shape_bytes(shapes.get(ops[1], ""))) if len(ops) > 1 else 0


def hbm_bytes(hlo: str) -> float:
    """A MODEL of one step's HBM traffic per device from optimized HLO: every buffer the program
    materialises (an instruction result outside fusions: fusion outputs, kernel outputs, copies)
    is written once and read once, as often as its computation runs (the loops' trip counts). A
    dynamic-update-slice, alone or at the heart of a fusion, writes only its update (a scan
    stacking one layer's residual into the [layers, ...] buffer). Collectives are left to
    `collective_bytes`. It leaves out re-reads (a weight read by several fusions counts once per
    producer) and on-chip reuse."""
    bodies, times, order = _executions(hlo)
    shapes = {}
    for lines in bodies.values():
        for line in lines:
            m, name = _INSTRUCTION.match(line), _INSTRUCTION_NAME.match(line)
            if m and name:
                shapes[name.group(1)] = m.group(1)
    inner, collective, updates = set(), set(), {}
    for name, lines in bodies.items():
        for line in lines:
            if " fusion(" in line or "custom-call(" in line:
                inner.update(_FUSION_CALLS.findall(line))
            if _OP.search(line):
                collective.add(name)
            if "dynamic-update-slice(" in line:
                updates[name] = updates.get(name, 0) + _update_bytes(line, shapes)
    total = 0
    for name in order:
        if name in inner:
            continue
        for line in bodies[name]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2) in _NO_BUFFER or _OP.search(line) or m.group(2).endswith(("-start", "-done")):
                continue
            callee = _FUSION_CALLS.search(line) if m.group(2) == "fusion" else None
            if callee and callee.group(1) in collective:
                continue
            if m.group(2) == "dynamic-update-slice":
                nbytes = _update_bytes(line, shapes)
            elif callee and callee.group(1) in updates:
                nbytes = updates[callee.group(1)]
            else:
                nbytes = sum(_shape_bytes(m.group(1)))
            total += 2 * times[name] * nbytes
    return float(total)


def attention_kernels(hlo: str) -> list[str]:
    """The fused attention kernels in optimized HLO: Mosaic (Pallas TPU) custom calls by kernel
    name (splash's forward and backward), cuDNN's fused attention calls by target. Empty when
    attention is plain XLA."""
    found = set()
    for line in hlo.splitlines():
        target = _CUSTOM_TARGET.search(line)
        if target and target.group(1) == "tpu_custom_call":  # named after the Pallas kernel
            name = _INSTRUCTION_NAME.match(line)
            found.add("mosaic:" + (re.sub(r"[.]\d+$", "", name.group(1)) if name else "unnamed"))
        elif target and "fmha" in target.group(1).lower():
            found.add(f"cudnn:{target.group(1)}")
        elif "__cudnn$fmha" in line or ("kind=kCustom" in line and "cudnn" in line and "fmha" in line.lower()):
            found.add("cudnn:fmha")
    return sorted(found)


# ----------------------------------------------------------------------------- one compile


class DoesNotFit(Exception):
    """The TPU compiler refused the program: more HBM than the chip has."""

    def __init__(self, message: str, needed: int | None, available: int | None):
        super().__init__(message)
        self.needed, self.available = needed, available


_SIZE = r"([0-9.]+)([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _parse_size(num: str, unit: str) -> int:
    return int(float(num) * _UNITS[unit])


def parse_resource_exhausted(message: str) -> tuple[int | None, int | None]:
    """(needed, available) bytes from XLA:TPU's RESOURCE_EXHAUSTED message, e.g. 'Used 40.1G of
    15.75G hbm' or 'HLO temporaries (33.57G) exceeds available HBM (15.75G)'."""
    m = re.search(r"Used " + _SIZE + r" of " + _SIZE + r" hbm", message)
    if m:
        return _parse_size(*m.group(1, 2)), _parse_size(*m.group(3, 4))
    m = re.search(r"\(" + _SIZE + r"\) exceeds (?:the )?available HBM \(" + _SIZE + r"\)", message)
    if m:
        return _parse_size(*m.group(1, 2)), _parse_size(*m.group(3, 4))
    return None, None


def _compile(fn, *args):
    """(compiled, seconds), or DoesNotFit when the compiler runs out of HBM."""
    start = time.perf_counter()
    try:
        compiled = fn.lower(*args).compile()
    except Exception as err:  # noqa: BLE001 - XLA raises JaxRuntimeError; only OOM is ours to explain
        msg = str(err)
        if "RESOURCE_EXHAUSTED" not in msg and "exceeds available HBM" not in msg:
            raise
        needed, available = parse_resource_exhausted(msg)
        raise DoesNotFit(msg.strip().splitlines()[0][:400], needed, available) from None
    return compiled, time.perf_counter() - start


def _analyse(compiled, seconds: float, hbm: int, n_devices: int, cfg) -> dict:
    """The report of one compiled step; `n_devices` counts all slices' devices (a multi-slice
    program is one slice's: its replica groups number that slice's devices)."""
    mem = compiled.memory_analysis()
    args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, temps = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    total = args + out - alias + temps  # donated inputs that become outputs are counted once
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    details: list = []
    slices = cfg.mesh.slices
    by_link: dict = {}
    collectives = collective_bytes(hlo, n_devices // slices, details, by_link, slices)
    return {
        "arguments": int(args), "temporaries": int(temps), "outputs": int(out - alias),
        "generated_code": int(mem.generated_code_size_in_bytes), "total": int(total),
        "hbm": int(hbm), "fits": bool(total <= hbm), "compile_s": round(seconds, 2),
        # XLA's count visits each while-loop body once (one layer of the scan, one micro-batch,
        # one vocabulary chunk): a lower bound, kept for reference; model_flops is the step's.
        "xla_flops": float(cost.get("flops", 0.0)) if cost else 0.0,
        "hbm_bytes": hbm_bytes(hlo),
        "collective_bytes": collectives,
        # per device: over the slice's ICI, and over the data-center network between slices
        "collective_bytes_by_link": by_link,
        "top_collectives": [_describe(d, hlo) for d in details[:8]],
        "attention_kernels": attention_kernels(hlo),
        "score_matrices": score_matrix_arrays(hlo, cfg.data.seq_len, (cfg.model.d_model, cfg.model.d_ff)),
        "largest_arrays": largest_arrays(hlo),
    }


def _describe(d: dict, hlo: str) -> dict:
    """A collective's result shape and the jax op it came from (its metadata op_name)."""
    if d.get("link") == "cross_slice":  # a megascale send: its result's first array is the buffer
        line = next((l for l in hlo.splitlines() if f'_rendezvous="{d["id"]}"' in l and " send(" in l), "")
        m = re.match(r"\s*%?[\w.\-]+\s*=\s*\(([^)]*)\)", line)
        shapes = ["%s[%s]" % x for x in _SHAPE.findall(m.group(1))][:1] if m else []
    else:
        origin = d.get("origin", "")
        line = next((l for l in hlo.splitlines()
                     if f"channel_id={d['id']}," in l and d["kind"] in l and origin in l), "")
        m = _OP.search(line)
        shapes = ["%s[%s]" % x for x in _SHAPE.findall(m.group(1))] if m else []
    op = re.search(r'op_name="([^"]*)"', line)
    largest = max(shapes, key=lambda x: _shape_bytes(x)[0]) if shapes else ""
    shape = shapes[0] if len(shapes) == 1 else f"{len(shapes)} arrays, largest {largest}" if shapes else ""
    return {**d, "shape": shape, "op": op.group(1)[-120:] if op else ""}


def _abstract(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def expected_argument_bytes(run) -> dict:
    """Per-device bytes of the train step's inputs, from the shardings alone: each array's
    shard shape × item size (parameters, optimizer state, step, and the token batch)."""
    import jax
    import numpy as np

    from onona_jax import train as trainer

    def shard_bytes(x):
        return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize

    state = trainer.abstract_train_state(run)
    cfg = run.cfg
    batch = _abstract((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32, run.batch_sharding)
    return {
        "params": sum(shard_bytes(x) for x in jax.tree.leaves(state["params"])),
        "opt_state": sum(shard_bytes(x) for x in jax.tree.leaves(state["opt_state"])),
        "other": shard_bytes(state["step"]) + shard_bytes(batch),
    }


def compile_train(cfg, s: Slice, devices=None, hbm: int | None = None) -> dict:
    """Set up the run on the slice's devices and compile the trainer's train step; the report
    dict (see module docstring). Raises DoesNotFit, or ValueError for a config the mesh rejects."""
    import numpy as np

    from onona_jax import summary
    from onona_jax import train as trainer

    devices = devices or topology_devices(s)
    run = trainer.setup(cfg, devices=devices)
    state = trainer.abstract_train_state(run)
    batch = _abstract((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32, run.batch_sharding)
    compiled, seconds = _compile(trainer.make_train_step(run), state, batch)
    out = _analyse(compiled, seconds, hbm or s.hbm_per_device, len(devices), cfg)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    out["model_flops"] = summary.flops_per_token(cfg.model, cfg.data.seq_len)["train"] * tokens / len(devices)
    out.update(micro_batch=cfg.train.global_batch // (run.accum * run.dp), accum=run.accum,
               remat=cfg.model.remat, mesh={a: int(n) for a, n in run.mesh.shape.items()})
    return out


def compile_eval(cfg, s: Slice, devices=None, hbm: int | None = None) -> dict:
    """The trainer's eval step (the mixture's NLL) on a validation batch as `evaluate` pads it."""
    import jax
    import numpy as np

    from onona_jax import sharding, summary
    from onona_jax import train as trainer
    from onona_jax.eval.validation import make_eval_step

    devices = devices or topology_devices(s)
    run = trainer.setup(cfg, devices=devices)
    dp = run.dp
    b = max(dp, math.ceil(cfg.eval.batch / dp) * dp)
    params = jax.tree.map(lambda x, sh: _abstract(x.shape, x.dtype, sh), run.abstract_params, run.param_shardings)
    tokens = _abstract((b, cfg.data.seq_len + 1), np.int32, run.batch_sharding)
    weights = _abstract((b,), np.float32, sharding.batch_sharding(run.mesh, 1))
    step = make_eval_step(run.graphdef, run.mesh, run.param_shardings)
    compiled, seconds = _compile(step, params, tokens, weights)
    out = _analyse(compiled, seconds, hbm or s.hbm_per_device, len(devices), cfg)
    out["batch"] = b
    out["model_flops"] = summary.flops_per_token(cfg.model, cfg.data.seq_len)["forward"] * b * cfg.data.seq_len / len(devices)
    return out


# ----------------------------------------------------------------------------- --fit


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _with(cfg, **changes):
    import ml_collections

    c = ml_collections.ConfigDict(cfg.to_dict())
    for key, value in changes.items():
        group, _, name = key.rpartition(".")
        node = c
        for part in group.split("."):
            node = node[part]
        node[name] = value
    return c


def _dp(cfg, s: Slice) -> int:
    """slices × data × fsdp × expert, as sharding.make_mesh resolves a -1 axis (within a slice)."""
    sizes = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor]
    known = math.prod(x for x in sizes if x != -1)
    sizes = [s.slice_devices // known if x == -1 else x for x in sizes]
    return s.slices * sizes[0] * sizes[1] * sizes[2]


# The remat policies --fit weighs, cheapest recompute first (layers.REMAT_POLICIES);
# attention_experts (MoE only) recomputes what attention does with one expert gather fewer.
FIT_REMATS = ("none", "attention_experts", "attention", "dots", "attention_offload", "full")


def recomputed_flops_per_token(cfg) -> float:
    """Forward FLOPs per token the backward pass recomputes under `model.remat` (a model from
    `summary.flops_per_token`): `attention` and its offload keep q, k, v and the attention
    output, so they recompute the projections and MLPs (and whole GDN layers) but not the
    attention kernel; `dots` keeps every projection but not the batched attention dots (nor a
    fused kernel, which is no dot); `full` recomputes the layer."""
    f = _flops(cfg)
    body, scores, other = f["body_matmul"], f["attention_scores"], f["extra"]
    return {"none": 0.0, "dots": scores + other, "attention": body + other, "attention_experts": body + other,
            "attention_offload": body + other, "full": body + scores + other}[cfg.model.remat]


def _flops(cfg) -> dict:
    from onona_jax import summary

    return summary.flops_per_token(cfg.model, cfg.data.seq_len)


def modelled_time(report: dict, cfg, s: Slice) -> dict:
    """A MODEL of one step's seconds from the compiled program, not a measurement: the larger
    of compute (model FLOPs plus recomputed FLOPs at the chip's peak) and HBM traffic
    (`hbm_bytes`: the buffers the optimized HLO materialises, written and read once each, at the
    chip's HBM bandwidth), with the collectives' bytes at the chip-to-chip bandwidth either fully
    overlapped with that (`overlapped`) or not at all (`serial`). It leaves out kernel
    efficiency (MXU tiling, fusion boundaries, Mosaic kernels' internal traffic), latency of
    small collectives, host-offload transfers, the input pipeline and the data-center network
    between slices."""
    chip = chips.CHIPS[s.generation]
    per_device = s.devices_per_chip
    tokens = cfg.train.global_batch * cfg.data.seq_len
    recompute = recomputed_flops_per_token(cfg) * tokens / s.devices
    compute_s = (report["model_flops"] + recompute) / (chip.peak_tflops * 1e12 / per_device)
    memory_s = report.get("hbm_bytes", 0.0) / (chip.hbm_gbps * 1e9 / per_device)
    # ICI only: a multi-slice job's cross-slice bytes go over DCN, which this model leaves out
    within = report.get("collective_bytes_by_link", {}).get("within_slice", report["collective_bytes"])
    comm_s = sum(within.values()) / (chip.link_gbps * 1e9)
    bound = max(compute_s, memory_s)
    return {"recomputed_flops": recompute, "compute_s": compute_s, "memory_s": memory_s, "comm_s": comm_s,
            "overlapped_s": max(bound, comm_s), "serial_s": bound + comm_s}


def fit(cfg, s: Slice, devices=None, hbm: int | None = None, log=None) -> dict:
    """For each remat policy (`FIT_REMATS`), the largest micro-batch that fits — a binary search
    over the divisors of the per-replica batch, as HBM grows with the micro-batch — then the
    plan with the lowest modelled step time
    (`modelled_time`, serial bound; overlapped breaks ties). Returns {"overrides", "train" (the
    chosen plan's report), "plans" (every fitting plan, modelled), "tried"}; the overrides are
    empty and "train" None when nothing fits. Once a plan fits without accumulation, policies
    that recompute more are not tried: the same micro-batch with more work cannot model faster."""
    devices = devices or topology_devices(s)
    per_replica = cfg.train.global_batch // _dp(cfg, s)
    sizes = _divisors_desc(per_replica)
    tried, plans = [], []

    def probe(remat, micro):
        if log:
            log(f"  compiling remat={remat} micro_batch={micro} ...")
        c = _with(cfg, **{"train.micro_batch": micro, "model.remat": remat})
        try:
            r = compile_train(c, s, devices, hbm)
        except DoesNotFit as err:
            r = {"fits": False, "total": err.needed, "hbm": err.available or hbm or s.hbm_per_device,
                 "micro_batch": micro, "remat": remat, "error": str(err)}
        tried.append({k: r.get(k) for k in ("remat", "micro_batch", "fits", "total", "compile_s")})
        if log:
            total = f"{r['total'] / GiB:.2f} GiB" if r.get("total") else "?"
            log(f"  remat={remat} micro_batch={micro}: {'fits' if r['fits'] else 'does not fit'} ({total})")
        return r

    for remat in FIT_REMATS:
        if remat == "attention_experts" and cfg.model.arch != "moe":
            continue  # the same program as attention
        if any(p["micro_batch"] == sizes[0] for p in plans):
            break
        lo, hi, best = 0, len(sizes) - 1, None  # sizes[lo] largest; find the first that fits
        while lo <= hi:
            mid = (lo + hi) // 2
            r = probe(remat, sizes[mid])
            if r["fits"]:
                best, hi = r, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            best["model"] = modelled_time(best, _with(cfg, **{"model.remat": remat}), s)
            plans.append(best)
            if log:
                m = best["model"]
                log(f"  plan remat={remat} micro_batch={best['micro_batch']}: modelled {m['overlapped_s']:.3f}-"
                    f"{m['serial_s']:.3f} s/step")
    if not plans:
        return {"overrides": {}, "train": None, "plans": [], "tried": tried}
    best = min(plans, key=lambda r: (r["model"]["serial_s"], r["model"]["overlapped_s"]))
    overrides = {"train.micro_batch": best["micro_batch"], "model.remat": best["remat"]}
    return {"overrides": overrides, "train": best, "plans": plans, "tried": tried}


def _plan_row(r: dict) -> dict:
    keys = ("remat", "micro_batch", "accum", "total", "compile_s")
    return {**{k: r[k] for k in keys}, "collective_bytes": sum(r["collective_bytes"].values()), **r["model"]}


def suggestions(cfg, s: Slice, report: dict, fit_ran: bool = False) -> list[str]:
    """Overrides likely to help a config that does not fit (the first is a linear estimate of
    the micro-batch: temporaries grow with it; `--fit` checks it by compiling)."""
    hints = []
    if cfg.mesh.fsdp == 1 and cfg.mesh.tensor == 1:
        hints.append("--config.mesh.data=1 --config.mesh.fsdp=-1 (shard parameters and optimizer state)")
    micro = report.get("micro_batch") or cfg.train.global_batch // _dp(cfg, s)
    temps, args = report.get("temporaries"), report.get("arguments")
    hbm = report.get("hbm") or s.hbm_per_device
    if temps and args is not None and micro > 1:
        room = hbm - args - report.get("outputs", 0)
        guess = [m for m in _divisors_desc(micro) if m < micro and temps * m / micro <= room]
        if guess:
            hints.append(f"--config.train.micro_batch={guess[0]} (estimated)")
    elif micro > 1:
        hints.append(f"--config.train.micro_batch={_divisors_desc(micro)[1]} or smaller")
    if cfg.model.remat != "full":
        hints.append(f"--config.model.remat={'dots' if cfg.model.remat == 'none' else 'full'}")
    if fit_ran:  # micro-batch 1 with full remat did not fit: more chips or tensor parallelism
        return [h for h in hints if "micro_batch" not in h and "remat" not in h] + [
            "a larger slice", "--config.mesh.tensor=2 or 4 (heads, KV heads, FFN width and vocabulary must divide)"]
    hints.append("--fit (search micro-batch and remat by compiling)")
    return hints


# ----------------------------------------------------------------------------- the report


def _gib(x) -> str:
    return "?" if x is None else f"{x / GiB:.2f}"


def _scores(found) -> str:
    return "not decidable by shape (d_model or d_ff = T)" if found is None else ", ".join(found) or "none"


def format_table(result: dict) -> str:
    s = result["slice"]
    lines = [f"{result['config']} on {s.get('label', s['name'])} ({s['topology']}, {s['devices']} devices, "
             f"{s['hbm_per_device'] / GiB:.2f} GiB HBM per device)"]
    head = (f"{'head':<10} {'step':<5} {'args GiB':>9} {'temps GiB':>9} {'out GiB':>8} {'total GiB':>9} "
            f"{'fits':>4} {'compile s':>9} {'TFLOP/dev':>9} " + " ".join(f"{k[:10]:>10}" for k in COLLECTIVES))
    lines += [head, "-" * len(head)]
    for head_name, r in result["heads"].items():
        for step in ("train", "eval"):
            x = r.get(step)
            if not x:
                continue
            coll = " ".join(f"{x['collective_bytes'][k] / 1e9:>8.3f}GB" for k in COLLECTIVES)
            lines.append(
                f"{head_name:<10} {step:<5} {_gib(x['arguments']):>9} {_gib(x['temporaries']):>9} "
                f"{_gib(x['outputs']):>8} {_gib(x['total']):>9} {'yes' if x['fits'] else 'NO':>4} "
                f"{x['compile_s']:>9.1f} {x['model_flops'] / 1e12:>9.2f} {coll}")
        t = r.get("train")
        if t:
            lines.append(f"{'':<10} train: mesh {t['mesh']}, micro_batch {t['micro_batch']} × "
                         f"{t['accum']} accumulation steps, remat {t['remat']}")
            if s.get("slices", 1) > 1:
                for link in ("within_slice", "cross_slice"):
                    by = t["collective_bytes_by_link"][link]
                    lines.append(f"{'':<10} {link.replace('_', '-')} collectives GB: " + ", ".join(
                        f"{k} {by.get(k, 0) / 1e9:.3f}" for k in COLLECTIVES))
            lines.append(f"{'':<10} attention kernel: {', '.join(t['attention_kernels']) or 'none (plain XLA)'}; "
                         f"[..., T, T] arrays: {_scores(t['score_matrices'])}")
            lines.append(f"{'':<10} largest arrays: " + ", ".join(
                f"{a['shape']} {a['bytes'] / 2**20:.0f} MiB ×{a['count']}" for a in t["largest_arrays"][:4]))
    if result.get("ratio"):
        ratio = result["ratio"]
        lines.append("ratio " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    if result.get("fit"):
        f = result["fit"]
        tried = "; ".join(f"{t['remat']}/{t['micro_batch']}: {'fits' if t['fits'] else 'no'}" for t in f["tried"])
        lines.append(f"--fit tried {tried}")
        for p in f.get("plans", ()):
            lines.append(f"  plan remat={p['remat']} micro_batch={p['micro_batch']}×{p['accum']}: {_gib(p['total'])} GiB, "
                         f"collectives {p['collective_bytes'] / 1e9:.2f} GB, recomputed {p['recomputed_flops'] / 1e12:.2f} "
                         f"TFLOP/dev, modelled {p['overlapped_s']:.3f}-{p['serial_s']:.3f} s/step (a model: compute "
                         f"{p['compute_s']:.3f}, HBM {p['memory_s']:.3f}, collectives {p['comm_s']:.3f})")
        if f["overrides"]:
            lines.append("use: " + " ".join(f"--config.{k}={v}" for k, v in f["overrides"].items()))
    return "\n".join(lines)


def ratios(twin: dict, standard: dict) -> dict:
    """Twin/standard ratios of the train step's per-device HBM, FLOPs and collective bytes."""
    a, b = twin["train"], standard["train"]
    out = {f"hbm_{k}": a[k] / b[k] for k in ("total", "temporaries", "arguments") if b.get(k)}
    if b.get("model_flops"):
        out["model_flops"] = a["model_flops"] / b["model_flops"]
    ca, cb = sum(a["collective_bytes"].values()), sum(b["collective_bytes"].values())
    if cb:
        out["collective_bytes"] = ca / cb
    return out


def analyse(cfg, s: Slice, compare_head: str | None = None, do_fit: bool = False,
            hbm: int | None = None, log=None, eval_step: bool = True) -> dict:
    """Everything the CLI reports, as a dict. With do_fit the micro-batch/remat search runs
    first (for the config's head) and every head is then compiled with its overrides.
    Raises DoesNotFit (with .report) when the config, or --fit's best, does not fit."""
    devices = topology_devices(s)
    if len(devices) != s.devices:
        raise RuntimeError(f"{s.topology} has {len(devices)} devices; the table says {s.devices}")
    hbm = hbm or s.hbm_per_device
    result = {"config": cfg.name, "slice": {**dataclasses.asdict(s), "label": s.label, "devices": s.devices,
                                             "hbm_per_device": hbm}, "heads": {}}
    if do_fit:
        found = fit(cfg, s, devices, hbm, log)
        result["fit"] = {"overrides": found["overrides"], "tried": found["tried"],
                         "plans": [_plan_row(p) for p in found["plans"]]}
        if not found["overrides"]:
            err = DoesNotFit("no micro-batch fits even with remat=full", None, hbm)
            err.result, err.report = result, {}
            raise err
        cfg = _with(cfg, **found["overrides"])
        fitted = found["train"]
    else:
        fitted = None
    heads = [cfg.model.head] + ([compare_head] if compare_head and compare_head != cfg.model.head else [])
    for head in heads:
        c = _with(cfg, **{"model.head": head})
        if head != cfg.model.head and cfg.name:
            c.name = cfg.name.replace(cfg.model.head, head)
        r = {}
        if log and not (fitted and head == cfg.model.head):
            log(f"compiling the train step ({head}) for {s.label} ...")
        try:
            r["train"] = fitted if (fitted and head == cfg.model.head) else compile_train(c, s, devices, hbm)
        except DoesNotFit as err:
            err.result, err.report = result, {"micro_batch": None}
            raise
        if eval_step:
            if log:
                log(f"compiling the eval step ({head}) ...")
            r["eval"] = compile_eval(c, s, devices, hbm)
        result["heads"][head] = r
    if len(heads) == 2:
        result["ratio"] = ratios(result["heads"][heads[0]], result["heads"][heads[1]])
    return result


# ----------------------------------------------------------------------------- CLI


def define(fv, argv):
    flags.DEFINE_string("topology", "v5e-16", "TPU slice or GPU host: " + ", ".join(SLICES), flag_values=fv)
    flags.DEFINE_integer("slices", None, "compile for this many --topology slices joined by the data-center "
                         "network (a multi-slice job; sets mesh.slices; default: the config's mesh.slices)",
                         flag_values=fv)
    flags.DEFINE_string("compare_head", "", "also compile with this head and report ratios (e.g. standard)",
                        flag_values=fv)
    flags.DEFINE_bool("fit", False, "search remat policy × micro-batch and pick the plan that fits with the "
                      "lowest modelled step time", flag_values=fv)
    flags.DEFINE_bool("json", False, "print the report as JSON", flag_values=fv)
    flags.DEFINE_string("json_out", "", "also write the JSON report to this file", flag_values=fv)
    flags.DEFINE_bool("eval_step", True, "also compile the eval step", flag_values=fv)
    flags.DEFINE_float("hbm_gib", 0.0, "HBM per device to plan against (default: the chip's)", flag_values=fv)
    from onona_jax import config as config_lib  # (jax after __main__ has chosen its platform)

    return config_lib.define_flag(fv, argv, default=None)


def _main(FLAGS, rest):
    from onona_jax import config as config_lib

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    cfg = FLAGS.config
    if cfg is None:
        raise cli.UsageError("--config is required, e.g. --config=configs/paper.py:dense-142m-twin")
    s = get_slice(FLAGS.topology)
    if FLAGS.slices is not None:
        if cfg.mesh.slices not in (1, FLAGS.slices):
            raise cli.UsageError(f"--slices={FLAGS.slices} and --config.mesh.slices={cfg.mesh.slices} disagree; "
                                 "give one of them")
        cfg.mesh.slices = FLAGS.slices
    if cfg.mesh.slices != 1:
        if s.platform != "tpu" or cfg.mesh.slices < 1:
            raise cli.UsageError(f"--slices={cfg.mesh.slices}: multi-slice compiles are for TPU slices "
                                 f"(a positive count); {s.name} is {'a GPU host' if s.platform == 'gpu' else 'a TPU slice'}")
        s = dataclasses.replace(s, slices=cfg.mesh.slices)
    config_lib.validate(cfg)
    # No persistent compilation cache (train.compile_cache) here: a compile-only TPU client cannot
    # load an executable back (jax 0.10.2 + libtpu 0.0.42.1: "PjRtCompiler must be constructed with
    # a Client to call DeserializeLoadedExecutable"), so its entries would be written, never used.
    if FLAGS.compare_head:
        config_lib.validate(_with(cfg, **{"model.head": FLAGS.compare_head}))
    missing = compiler_missing(s) or cudnn_missing(cfg, s)
    if missing:
        raise cli.UsageError(missing)
    log = (lambda m: print(m, file=sys.stderr, flush=True))  # noqa: E731
    hbm = int(FLAGS.hbm_gib * GiB) if FLAGS.hbm_gib else None
    try:
        result = analyse(cfg, s, FLAGS.compare_head or None, FLAGS.fit, hbm, log, eval_step=FLAGS.eval_step)
    except DoesNotFit as err:
        report = getattr(err, "report", {})
        needed = f"{err.needed / GiB:.2f} GiB" if err.needed else "more than available"
        avail = (err.available or hbm or s.hbm_per_device) / GiB
        raise cli.Failure(f"{cfg.name or 'config'} does not fit on {s.label}: needs {needed} of HBM per device, "
                          f"{avail:.2f} GiB available ({err}); try "
                          + "; ".join(suggestions(cfg, s, report, FLAGS.fit))) from None
    except ValueError as err:  # the mesh or the batch does not suit the slice
        raise cli.UsageError(f"{err} (on {s.label}: {s.devices} devices)") from None
    if FLAGS.json_out:
        paths.write_json(FLAGS.json_out, result)
    if FLAGS.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    unfit = [(h, r["train"]) for h, r in result["heads"].items() if not r["train"]["fits"]]
    if unfit:
        head, r = unfit[0]
        raise cli.Failure(f"{cfg.name or 'config'} ({head}) does not fit on {s.label}: needs {r['total'] / GiB:.2f} "
                          f"GiB of HBM per device, {r['hbm'] / GiB:.2f} GiB available; try "
                          + "; ".join(suggestions(_with(cfg, **{"model.head": head}), s, r)))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    # Compile-only: JAX itself runs on the CPU; libtpu serves the TPU topology and compiler.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU VM metadata server to ask
    cli.run_module(define, _main, __doc__)
