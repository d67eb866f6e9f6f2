"""Everything `python -m onona_jax.aot` reports, as a dict (`analyse`: the config's head and
`--compare_head`, after `--fit` when asked), and its table."""

from __future__ import annotations

import dataclasses

from onona_jax.aot.fit import fit, plan_row, with_overrides
from onona_jax.aot.hlo import COLLECTIVES
from onona_jax.aot.steps import DoesNotFit, compile_eval, compile_train
from onona_jax.aot.topology import GiB, Slice, topology_devices


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
    result = {"config": cfg.name, "tokenizer": cfg.data.tokenizer, "vocab_size": cfg.model.vocab_size,
              "slice": {**dataclasses.asdict(s), "label": s.label, "devices": s.devices,
                        "hbm_per_device": hbm}, "heads": {}}
    if do_fit:
        found = fit(cfg, s, devices, hbm, log)
        result["fit"] = {"overrides": found["overrides"], "tried": found["tried"],
                         "plans": [plan_row(p) for p in found["plans"]]}
        if not found["overrides"]:
            err = DoesNotFit("no micro-batch fits even with remat=full", None, hbm)
            err.result, err.report = result, {}
            raise err
        cfg = with_overrides(cfg, **found["overrides"])
        fitted = found["train"]
    else:
        fitted = None
    heads = [cfg.model.head] + ([compare_head] if compare_head and compare_head != cfg.model.head else [])
    for head in heads:
        c = with_overrides(cfg, **{"model.head": head})
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
