"""Markdown rows for docs/pods.md and docs/notes/scaling-log.md from `python -m onona_jax.aot --json_out` reports.

    python scripts/aot_table.py docs/aot/*.json           # one row per head and report
    python scripts/aot_table.py --plans docs/aot/*.json   # --fit's plans, with modelled step times
    python scripts/aot_table.py --links docs/aot/*.json   # collectives by kind, within / across slices
    python scripts/aot_table.py --ratios docs/aot/*.json  # one row per report: twin against standard
"""

import json
import sys

GiB = 1024**3
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _kernel(t):
    names = t.get("attention_kernels", [])
    kind = "splash" if any(n.startswith("mosaic:splash") for n in names) else \
        "cuDNN" if any(n.startswith("cudnn:") for n in names) else "XLA"
    found = t.get("score_matrices")
    return f"{kind}, " + ("[T,T] n/a (d = T)" if found is None else "[T,T]" if found else "no [T,T]")


def rows(path):
    r = json.load(open(path))
    s = r["slice"]
    fit = r.get("fit", {}).get("overrides")
    ratio = r.get("ratio", {})
    for i, (head, x) in enumerate(r["heads"].items()):
        t = x["train"]
        name = r["config"].replace(r["config"].split("-")[-1], head) if head not in r["config"] else r["config"]
        coll = sum(t["collective_bytes"].values()) / 1e9
        big = max(KINDS, key=lambda k: t["collective_bytes"][k])
        chosen = f"{t['micro_batch']} × {t['accum']}, {t['remat']}" + (" (--fit)" if fit and i == 0 else "")
        hbm_ratio = f"**{ratio['hbm_total']:.3f}**" if ratio and i == 0 else ""
        yield (f"| {name} | {s.get('label', s['name'])} | {'yes' if t['fits'] else 'NO'} | {chosen} | {t['arguments'] / GiB:.2f} | "
               f"{t['temporaries'] / GiB:.2f} | {t['total'] / GiB:.2f} / {t['hbm'] / GiB:.2f} | {hbm_ratio} | "
               f"{coll:.2f} ({big} {t['collective_bytes'][big] / 1e9:.2f}) | {_kernel(t)} | "
               f"{t['model_flops'] / 1e12:.1f} | {t['compile_s']:.0f} s |")


def links(path):
    """GB per chip and step by kind, within a slice (ICI) / across slices (DCN)."""
    r = json.load(open(path))
    for head, x in r["heads"].items():
        t = x["train"]
        by = t.get("collective_bytes_by_link") or {"within_slice": t["collective_bytes"], "cross_slice": {}}
        cells = [f"{by['within_slice'].get(k, 0) / 1e9:.3f} / {by['cross_slice'].get(k, 0) / 1e9:.3f}" for k in KINDS]
        name = r["config"].replace(r["config"].split("-")[-1], head) if head not in r["config"] else r["config"]
        yield f"| {name} | {r['slice'].get('label', r['slice']['name'])} | " + " | ".join(cells) + " |"


def plans(path):
    r = json.load(open(path))
    for p in r.get("fit", {}).get("plans", []):
        yield (f"| {r['config']} | {r['slice']['name']} | {p['remat']} | {p['micro_batch']} × {p['accum']} | "
               f"{p['total'] / GiB:.2f} | {p['collective_bytes'] / 1e9:.2f} | {p['recomputed_flops'] / 1e12:.2f} | "
               f"{p['compute_s']:.3f} | {p['memory_s']:.3f} | {p['comm_s']:.3f} | "
               f"{p['overlapped_s']:.3f}–{p['serial_s']:.3f} |")


def ratios(path):
    """One row per --compare_head report: the plan, each head's HBM per chip, twin/standard HBM
    and model FLOPs, compile seconds. Reports from before `vocab_size` was recorded were all
    at GPT-2's vocabulary (the only tokenizer then)."""
    r = json.load(open(path))
    s, (twin, std) = r["slice"], (r["heads"][h]["train"] for h in ("twin", "standard"))
    mesh = ", ".join(f"{k} {v}" for k, v in twin["mesh"].items() if v != 1) or "1 device"
    plan = f"{mesh}; {twin['micro_batch']} × {twin['accum']}, remat {twin['remat']}" + (" (--fit)" if r.get("fit") else "")
    return (f"| {r['config'].rsplit('-', 1)[0]} | {r.get('vocab_size', 50304):,} | {s.get('label', s['name'])} | {plan} | "
            f"{twin['total'] / GiB:.2f} | {std['total'] / GiB:.2f} / {twin['hbm'] / GiB:.2f} | **{r['ratio']['hbm_total']:.3f}** | "
            f"{r['ratio']['model_flops']:.3f} | {twin['model_flops'] / 1e12:.1f} | {twin['compile_s']:.0f} s, {std['compile_s']:.0f} s |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--links":
        print("| config | slice | " + " | ".join(f"{k} GB within / across" for k in KINDS) + " |")
        print("|---|---|" + "---:|" * len(KINDS))
        for p in args[1:]:
            for row in links(p):
                print(row)
    elif args and args[0] == "--ratios":
        print("| model | V | slice | plan: mesh; micro-batch × accum, remat | twin GiB/chip | standard GiB/chip / HBM | "
              "twin/std HBM | twin/std model FLOPs | twin model TFLOP/chip | compile twin, std |")
        print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
        for p in args[1:]:
            print(ratios(p))
    elif args and args[0] == "--plans":
        print("| config | slice | remat | micro-batch × accum | total GiB | collectives GB | recomputed TFLOP/chip | "
              "compute s | HBM s | collectives s | modelled s/step (overlapped–serial) |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for p in args[1:]:
            for row in plans(p):
                print(row)
    else:
        print("| config | slice | fits | micro-batch × accum, remat | args GiB | temps GiB | total / HBM GiB | "
              "twin/std HBM | collectives GB/step (largest) | attention | model TFLOP/chip | compile |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
        for p in args:
            for row in rows(p):
                print(row)
