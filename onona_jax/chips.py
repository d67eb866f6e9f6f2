"""The accelerators users train on, one row each: the public figures (SPEC §7) that MFU, the
ahead-of-time planner (`aot`) and its modelled step times read. One table, so a new chip is
one line."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    kinds: tuple[str, ...]  # substrings of jax's `device_kind` that name this chip
    peak_tflops: float  # dense bf16, per chip
    hbm_gib: float  # per chip (GPUs: what CUDA reports, in aot.GPU_SPECS)
    hbm_gbps: float  # HBM bandwidth, GB/s
    link_gbps: float  # chip-to-chip bandwidth, GB/s: TPU ICI per chip, NVLink per GPU


CHIPS = {
    c.name: c for c in (
        Chip("v4", ("TPU v4",), 275.0, 32.0, 1200.0, 2400 / 8),
        Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197.0, 16.0, 819.0, 1600 / 8),
        Chip("v5p", ("TPU v5p", "TPU v5"), 459.0, 95.0, 2765.0, 4800 / 8),
        Chip("v6e", ("TPU v6 lite", "TPU v6e"), 918.0, 32.0, 1640.0, 3584 / 8),
        Chip("h100", ("H100",), 989.0, 80.0, 3352.0, 900.0),
        Chip("h200", ("H200", "GH200"), 989.0, 141.0, 4800.0, 900.0),
        Chip("b200", ("B200",), 2250.0, 180.0, 8000.0, 1800.0),
        Chip("a100", ("A100",), 312.0, 80.0, 2039.0, 600.0),
    )
}


def by_device_kind(kind: str) -> Chip | None:
    """The chip a jax `device_kind` string names ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), or
    None for a CPU or a chip not in the table. Longer names first: "TPU v5p" before "TPU v5"."""
    pairs = sorted(((k, c) for c in CHIPS.values() for k in c.kinds), key=lambda kc: -len(kc[0]))
    return next((c for k, c in pairs if k.lower() in kind.lower()), None)
