"""`--fit`: for each remat policy the largest micro-batch that fits (by compiling), each plan's
MODELLED step time (a roofline from the compiled program and the chip's peaks in
`chips.CHIPS`), and the overrides likely to help a config that does not fit."""

from __future__ import annotations

import math

from onona_jax import chips
from onona_jax.aot.steps import DoesNotFit, compile_train
from onona_jax.aot.topology import GiB, Slice, topology_devices


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def with_overrides(cfg, **changes):
    """A copy of `cfg` with {dotted key: value} changes."""
    import ml_collections

    c = ml_collections.ConfigDict(cfg.to_dict())
    for key, value in changes.items():
        group, _, name = key.rpartition(".")
        node = c
        for part in group.split("."):
            node = node[part]
        node[name] = value
    return c


def data_parallel(cfg, s: Slice) -> int:
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
    per_replica = cfg.train.global_batch // data_parallel(cfg, s)
    sizes = _divisors_desc(per_replica)
    tried, plans = [], []

    def probe(remat, micro):
        if log:
            log(f"  compiling remat={remat} micro_batch={micro} ...")
        c = with_overrides(cfg, **{"train.micro_batch": micro, "model.remat": remat})
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
            best["model"] = modelled_time(best, with_overrides(cfg, **{"model.remat": remat}), s)
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


def plan_row(r: dict) -> dict:
    keys = ("remat", "micro_batch", "accum", "total", "compile_s")
    return {**{k: r[k] for k in keys}, "collective_bytes": sum(r["collective_bytes"].values()), **r["model"]}


def suggestions(cfg, s: Slice, report: dict, fit_ran: bool = False) -> list[str]:
    """Overrides likely to help a config that does not fit (the first is a linear estimate of
    the micro-batch: temporaries grow with it; `--fit` checks it by compiling)."""
    hints = []
    if cfg.mesh.fsdp == 1 and cfg.mesh.tensor == 1:
        hints.append("--config.mesh.data=1 --config.mesh.fsdp=-1 (shard parameters and optimizer state)")
    micro = report.get("micro_batch") or cfg.train.global_batch // data_parallel(cfg, s)
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
