"""Markdown rows for docs/SCALING.md from `python -m onona_jax.aot --json_out` reports.

    python scripts/aot_table.py docs/aot/*.json
"""

import json
import sys

GiB = 1024**3
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def rows(path):
    r = json.load(open(path))
    s = r["slice"]
    fit = r.get("fit", {}).get("overrides")
    for head, x in r["heads"].items():
        t = x["train"]
        name = r["config"].replace(r["config"].split("-")[-1], head) if head not in r["config"] else r["config"]
        coll = sum(t["collective_bytes"].values()) / 1e9
        big = max(KINDS, key=lambda k: t["collective_bytes"][k])
        chosen = f"{t['micro_batch']} × {t['accum']}, remat {t['remat']}" + (" (--fit)" if fit and head in r["config"] else "")
        yield (f"| {name} | {s['name']} | {'yes' if t['fits'] else 'NO'} | {chosen} | {t['arguments'] / GiB:.2f} | "
               f"{t['temporaries'] / GiB:.2f} | {t['total'] / GiB:.2f} / {t['hbm'] / GiB:.2f} | {coll:.1f} ({big} {t['collective_bytes'][big] / 1e9:.1f}) | "
               f"{t['compile_s']:.0f} s |")
    if r.get("ratio"):
        q = r["ratio"]
        yield (f"| twin / standard | | | | {q.get('hbm_arguments', 0):.3f} | {q.get('hbm_temporaries', 0):.3f} | "
               f"{q.get('hbm_total', 0):.3f} | {q.get('collective_bytes', 0):.2f} | |")


if __name__ == "__main__":
    print("| config | slice | fits | micro-batch × accumulation | args GiB | temps GiB | total / HBM GiB | collectives GB/step (largest) | compile |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for p in sys.argv[1:]:
        for row in rows(p):
            print(row)
