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

COMPONENTS = ("tables", "gate", "head", "attention", "gdn", "mlp", "moe", "attnres", "norms")
TABLES = ("A", "B", "embedding", "unembedding")


def component(path: str) -> str:
    if path.startswith("head/"):
        name = path.split("/")[-1]
        return "tables" if name in TABLES else "gate" if name == "gate" else "head"
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


def is_expert_weight(path: str) -> bool:
    """An MoE expert matrix (gate/up/down [E, ...]); the router is not one."""
    return "moe/" in path and path.rsplit("/", 1)[-1] in ("gate", "up", "down")


def param_counts(cfg_model) -> dict[str, int]:
    """Per component, `total`, `non_embedding` (total − tables) and `active`: the
    non-embedding parameters one token uses, i.e. MoE expert weights count top_k/E of
    theirs (router included in full); for dense models active = non_embedding."""
    _, state = model_lib.abstract(cfg_model)
    counts = dict.fromkeys(COMPONENTS, 0)
    experts = 0
    for path, var in flat_variables(state):
        name, n = path_str(path), int(np.prod(var.shape))
        counts[component(name)] += n
        experts += n if is_expert_weight(name) else 0
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    counts["non_embedding"] = counts["total"] - counts["tables"]
    counts["experts"] = experts
    inactive = 0
    if experts:
        E, k = cfg_model.moe.n_experts, cfg_model.moe.top_k
        inactive = experts * (E - k) // E  # exact: the expert count is a multiple of E
    counts["active"] = counts["non_embedding"] - inactive
    return counts


def output_projections(head: str) -> int:
    """Vocabulary projections per position in training."""
    return 2 if head == "twin" else 1


def flops_per_token(cfg_model, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 × forward), counting matmuls only:
    2 FLOPs per weight of every body matmul and output projection, plus attention scores and
    values at 2·2·T·n_heads·head_dim per layer (the full T×T square, as PaLM counts it).
    MoE: the router plus the top_k/E active share of the expert weights (no dispatch
    overhead, no capacity padding)."""
    m = cfg_model
    counts = param_counts(m)
    router = counts["moe"] - counts["experts"]
    active_experts = counts["experts"] - (counts["non_embedding"] - counts["active"])
    body_matmul = counts["attention"] + counts["mlp"] + router + active_experts
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
    rows = [(c, s[c]) for c in COMPONENTS] + [
        ("total", s["total"]), ("non_embedding", s["non_embedding"]), ("active", s["active"])]
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
