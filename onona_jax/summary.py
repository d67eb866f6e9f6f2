"""Parameter counts per component and FLOPs per token.

    python -m onona_jax.summary --config=configs/paper.py:dense-142m-twin [--json]

Counts come from the abstractly evaluated parameter tree (no allocation), so they are what
the model really has, not a formula that repeats the config.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from onona_jax import config as config_lib
from onona_jax import model as model_lib
from onona_jax.params import flat_variables, path_str

COMPONENTS = ("tables", "gate", "attention", "gdn", "mlp", "moe", "attnres", "norms")


def component(path: str) -> str:
    if path.startswith("head/"):
        return "gate" if path.endswith("gate") else "tables"
    for part in ("attnres", "gdn", "moe"):  # before "norm": these own norm weights too
        if f"{part}/" in path or path.startswith(part):
            return part
    if "norm" in path:
        return "norms"
    if "/attn/" in path:
        return "attention"
    if "/mlp/" in path:
        return "mlp"
    raise ValueError(f"parameter {path!r} belongs to no component; extend summary.component")


def param_counts(cfg_model) -> dict[str, int]:
    _, state = model_lib.abstract(cfg_model)
    counts = dict.fromkeys(COMPONENTS, 0)
    for path, var in flat_variables(state):
        counts[component(path_str(path))] += int(np.prod(var.shape))
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    counts["non_embedding"] = counts["total"] - counts["tables"]
    return counts


def output_projections(head: str) -> int:
    """Vocabulary projections per position in training."""
    return 2 if head == "twin" else 1


def flops_per_token(cfg_model, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 × forward), counting matmuls only:
    2 FLOPs per weight of every body matmul and output projection, plus attention scores and
    values at 2·2·T·n_heads·head_dim per layer (the full T×T square, as PaLM counts it)."""
    m = cfg_model
    counts = param_counts(m)
    body_matmul = counts["attention"] + counts["mlp"]
    head = output_projections(m.head) * m.vocab_size * m.d_model
    attention = 2 * 2 * seq_len * m.n_heads * m.head_dim * m.n_layers
    forward = 2 * (body_matmul + head) + attention
    return {"forward": float(forward), "train": float(3 * forward)}


def summarize(cfg) -> dict:
    counts = param_counts(cfg.model)
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    return {
        "config": cfg.name,
        **counts,
        "flops_per_token_train": flops["train"],
        "flops_per_token_forward": flops["forward"],
    }


def format_table(s: dict) -> str:
    rows = [(c, s[c]) for c in COMPONENTS] + [("total", s["total"]), ("non_embedding", s["non_embedding"])]
    width = max(len(r[0]) for r in rows)
    lines = [f"{s['config']}", "-" * (width + 18)]
    lines += [f"{name:<{width}}  {n:>15,}" for name, n in rows]
    lines.append(f"{'train FLOPs/token':<{width}}  {s['flops_per_token_train']:>15.4e}")
    return "\n".join(lines)


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="configs/paper.py:<arch>-<size>-<head>")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = config_lib.load(args.config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    s = summarize(cfg)
    print(json.dumps(s, indent=2) if args.json else format_table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
