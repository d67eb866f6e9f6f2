"""The accelerators users train on, one row each: the public figures (SPEC §7) that MFU (the
training loop's `peak_tflops`), the ahead-of-time planner (`aot`: each chip's HBM, the GPU
compile target's memory and bandwidth) and its modelled step times read. The one table of
hardware peaks, so a new chip is one line."""

from __future__ import annotations

import dataclasses

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    kinds: tuple[str, ...]  # substrings of jax's `device_kind` that name this chip
    peak_tflops: float  # dense bf16, per chip
    hbm_bytes: int  # per chip (GPUs: what CUDA reports for the device, the AOT compile target's)
    hbm_gbps: float  # HBM bandwidth, GB/s (GPUs: the AOT compile target's)
    link_gbps: float  # chip-to-chip bandwidth, GB/s: TPU ICI per chip, NVLink per GPU


CHIPS = {
    c.name: c for c in (
        Chip("v4", ("TPU v4",), 275.0, 32 * GiB, 1200.0, 2400 / 8),
        Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197.0, 16 * GiB, 819.0, 1600 / 8),
        Chip("v5p", ("TPU v5p", "TPU v5"), 459.0, 95 * GiB, 2765.0, 4800 / 8),
        Chip("v6e", ("TPU v6 lite", "TPU v6e"), 918.0, 32 * GiB, 1640.0, 3584 / 8),
        Chip("h100", ("H100",), 989.0, 84_929_347_584, 3352.32, 900.0),
        Chip("h200", ("H200", "GH200"), 989.0, 150_754_820_096, 4800.0, 900.0),
        Chip("b200", ("B200",), 2250.0, 180 * GiB, 8000.0, 1800.0),
        Chip("a100", ("A100",), 312.0, 80 * GiB, 2039.0, 600.0),
    )
}


def by_device_kind(kind: str) -> Chip | None:
    """The chip a jax `device_kind` string names ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), or
    None for a CPU or a chip not in the table. Longer names first: "TPU v5p" before "TPU v5"."""
    pairs = sorted(((k, c) for c in CHIPS.values() for k in c.kinds), key=lambda kc: -len(kc[0]))
    return next((c for k, c in pairs if k.lower() in kind.lower()), None)
