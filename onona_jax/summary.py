"""Parameter counts per component and FLOPs per token.

    python -m onona_jax.summary --config=configs/paper.py:dense-142m-twin [--json]

Counts come from the abstractly evaluated parameter tree (no allocation), so they are what
the model really has, not a formula that repeats the config.
"""

from __future__ import annotations

import json

import numpy as np
from absl import flags

from onona_jax import cli
from onona_jax import config as config_lib
from onona_jax import heads as heads_lib
from onona_jax import models as model_lib
from onona_jax.models import attnres, gdn
from onona_jax.params import flat_variables, path_str

COMPONENTS = ("tables", "gate", "head", "attention", "gdn", "mlp", "moe", "attnres", "norms")


def tables() -> set[str]:
    """Every registered head's vocabulary tables, as the heads declare them."""
    return {t for cls in heads_lib.HEADS.values() for t in cls.tables}


def component(path: str) -> str:
    if path.startswith("head/"):
        name = path.split("/")[-1]
        return "tables" if name in tables() else "gate" if name == "gate" else "head"
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


def output_projections(cfg_model) -> int:
    """Vocabulary projections per position in training, as the head declares them: 2 for
    the heads with two output softmaxes (twin, twin_output_only), K = mos_components for
    mos / moss (one per component, through the tied table), 1 for the others."""
    return heads_lib.head_class(cfg_model.head).output_projections(cfg_model)


# Per-component parameters that are NOT matmul weights (2 FLOPs per weight per token):
# norm weights, GDN's per-head decay parameters; AttnRes's pseudo-queries are counted per
# source (see flops_per_token), tables and gate by the head term.
NON_MATMUL = ("A_log", "dt_bias")


def matmul_weights(cfg_model) -> dict[str, float]:
    """Per component, the weights each token multiplies once in the forward pass (2 FLOPs per
    weight): attention q/k/v/o, SwiGLU gate/up/down, the MoE router in full and top_k/E of
    the expert weights, GDN q/k/v/gate/a/b/o and the depthwise conv taps (2·K per channel,
    which is 2 FLOPs per tap weight too), the mos/moss context and prior projections. Norm
    weights, A_log, dt_bias, AttnRes queries, the tables and the gate are excluded."""
    _, state = model_lib.abstract(cfg_model)
    out = dict.fromkeys(("attention", "mlp", "moe", "gdn", "head"), 0.0)
    E, k = (cfg_model.moe.n_experts, cfg_model.moe.top_k) if cfg_model.arch == "moe" else (1, 1)
    for path, var in flat_variables(state):
        name, n = path_str(path), float(np.prod(var.shape))
        comp, leaf = component(name), name.rsplit("/", 1)[-1]
        if comp not in out or leaf in NON_MATMUL or (comp == "gdn" and leaf == "norm"):
            continue
        out[comp] += n * k / E if is_expert_weight(name) else n
    return out


def _pattern_counts(cfg_model) -> dict[str, int]:
    pattern = model_lib.layer_pattern(cfg_model)
    repeats = cfg_model.n_layers // len(pattern)
    return {kind: repeats * pattern.count(kind) for kind in ("attention", "gdn")}


def flops_per_token(cfg_model, seq_len: int, causal: bool = True) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 × forward), counting matmuls (and
    dot products) only; `forward` and `train` are the totals, the other keys split the
    forward count. Causal attention counts half the T × T square (`causal`, MaxText's
    convention and what a flash kernel computes); `causal=False` counts the whole square, as
    PaLM's MFU does and XLA's `dot_product_attention` computes. `train_full_square` is the
    training total counted the PaLM way, for comparison with papers that use it:

    * `body_matmul`: 2 FLOPs per weight of `matmul_weights` (attention and GDN projections,
      SwiGLU, the MoE router and the ACTIVE experts — top_k/E of them: the model's work, not
      the E·C capacity slots the sort and dense dispatches compute, which is capacity_factor ×
      the active expert FLOPs when every slot is filled (the grouped dispatch computes the kept
      assignments only, at most the active FLOPs) — GDN's depthwise conv as 2·K per
      channel, the mos/moss context projections K·d² and prior d·K).
    * `head`: 2·V·d per output projection — 2 for twin / twin_output_only, K for mos / moss
      (each component through the tied table), 1 otherwise — plus 2·d for a gate's dot.
    * `attention_scores`: 4·T·n_heads·head_dim per ATTENTION layer for QKᵀ and PV over the
      full T×T square, half that when `causal`; GDN layers have none.
    * `gdn_recurrence`: per GDN layer, `models.gdn.recurrence_flops` (intra-chunk, the blocked
      triangular inverse and its product, the state terms ≈ 6·H·dk·dv per token).
    * `attnres`: 2·d per source per AttnRes mixing (the pseudo-query dot with each normed
      source), summed over every sublayer and the final mixing (`models.attnres.sources_per_token`).
    """
    m = cfg_model
    weights = matmul_weights(m)
    counts = param_counts(m)
    body = 2 * sum(weights[c] for c in ("attention", "mlp", "moe", "gdn"))
    projections = output_projections(m)
    head = 2 * (projections * m.vocab_size * m.d_model + weights["head"] + counts["gate"])
    layers = _pattern_counts(m)
    full_scores = 4 * seq_len * m.n_heads * m.head_dim * layers["attention"]
    scores = full_scores / 2 if causal else full_scores
    gdn_cost = 0.0
    if layers["gdn"]:
        gdn_parts = gdn.recurrence_flops(m, seq_len)
        gdn_cost = layers["gdn"] * sum(gdn_parts.values())
    attnres_cost = 2 * m.d_model * attnres.sources_per_token(m) if m.arch == "attnres" else 0
    forward = body + head + scores + gdn_cost + attnres_cost
    out = {
        "forward": float(forward),
        "train": float(3 * forward),
        "train_full_square": float(3 * (forward - scores + full_scores)),
        "body_matmul": float(body),
        "head": float(head),
        "attention_scores": float(scores),
        "gdn_recurrence": float(gdn_cost),
        "attnres": float(attnres_cost),
    }
    if layers["gdn"]:
        out["gdn_solve"] = float(layers["gdn"] * gdn_parts["solve"])
    return out


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


def define(fv, argv):
    flags.DEFINE_bool("json", False, "print JSON instead of a table", flag_values=fv)
    return config_lib.define_flag(fv, argv, default=None)


def _main(fv, args):
    if fv.config is None:
        raise cli.UsageError("give --config=configs/paper.py:<arch>-<size>-<head>")
    s = summarize(config_lib.validate(fv.config))
    print(json.dumps(s, indent=2) if fv.json else format_table(s))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
