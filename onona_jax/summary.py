"""Parameter counts per component and FLOPs per token.

    python -m onona_jax.summary --config=configs/paper.py:dense-142m-twin [--json]

Counts come from the abstractly evaluated parameter tree (no allocation), so they are what
the model really has, not a formula that repeats the config. Nothing here knows a family:
each parameter's row, whether it is a matmul weight and the share of tokens that use it come
from the head's tables and the family's `components` (`models.accounting`), the FLOPs beyond
the weights' and the attention scores from the family's `extra_flops`.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

from absl import flags

from onona_jax import cli

# config, heads and models (jax) are imported where used, so that --help starts without jax.

HEAD_ROWS = ("tables", "gate", "head")  # the head's rows (`models.accounting`), then the family's


def components(cfg_model) -> tuple[str, ...]:
    """The rows of the parameter table: the head's, then the family's components in the order
    its `Family.components` declares them."""
    from onona_jax import models as model_lib

    declared = dict.fromkeys(g.component for g in model_lib.family(cfg_model).components)
    return HEAD_ROWS + tuple(c for c in declared if c not in HEAD_ROWS)


def param_counts(cfg_model) -> dict[str, int]:
    """Per component (`components`), `total`, `non_embedding` (total − tables), `experts`
    (the parameters each token uses only a fraction of: MoE experts) and `active`: the
    non-embedding parameters one token uses, i.e. MoE expert weights count top_k/E of theirs
    (router included in full); for dense models active = non_embedding."""
    from onona_jax import models as model_lib

    rows = components(cfg_model)
    counts = dict.fromkeys(rows, 0)
    experts, inactive = 0, Fraction(0)
    for p in model_lib.accounting(cfg_model):
        counts[p.component] += p.size
        if p.used != 1:
            experts += p.size
            inactive += p.size * (1 - p.used)
    counts["total"] = sum(counts[c] for c in rows)
    counts["non_embedding"] = counts["total"] - counts["tables"]
    counts["experts"] = experts
    counts["active"] = counts["non_embedding"] - math.floor(inactive)  # exact for MoE: E divides the count
    return counts


def output_projections(cfg_model) -> int:
    """Vocabulary projections per position in training, as the head declares them: 2 for
    the heads with two output softmaxes (twin, twin_output_only), K = mos_components for
    mos / moss (one per component, through the tied table), 1 for the others."""
    from onona_jax import heads as heads_lib

    return heads_lib.head_class(cfg_model.head).output_projections(cfg_model)


def matmul_weights(cfg_model) -> dict[str, float]:
    """Per component with matmul weights (the family's `ParamGroup(matmul=True)` and the head's
    own weights beside its tables and gate: `head`), the weights each token multiplies once in
    the forward pass (2 FLOPs per weight), each group's counted for the fraction of tokens that
    use it: attention q/k/v/o, SwiGLU gate/up/down, the MoE router in full and top_k/E of the
    expert weights, GDN q/k/v/gate/a/b/o and the depthwise conv taps (2·K per channel, which is
    2 FLOPs per tap weight too), the mos/moss context and prior projections. Norm weights,
    A_log, dt_bias, AttnRes queries, the tables and the gate are not matmul weights."""
    from onona_jax import models as model_lib

    out = {"head": 0.0} | {g.component: 0.0 for g in model_lib.family(cfg_model).components if g.matmul}
    for p in model_lib.accounting(cfg_model):
        if p.matmul:
            out[p.component] += float(p.size * p.used)
    return out


def flops_per_token(cfg_model, seq_len: int, causal: bool = True) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3 × forward), counting matmuls (and
    dot products) only; `forward` and `train` are the totals, the other keys split the
    forward count. Causal attention counts half the T × T square (`causal`, MaxText's
    convention and what a flash kernel computes); `causal=False` counts the whole square, as
    PaLM's MFU does and XLA's `dot_product_attention` computes. `train_full_square` is the
    training total counted the PaLM way, for comparison with papers that use it:

    * `body_matmul`: 2 FLOPs per weight of `matmul_weights` outside the head (attention and
      GDN projections, SwiGLU, the MoE router and the ACTIVE experts — top_k/E of them: the
      model's work, not the E·C capacity slots the sort and dense dispatches compute, which is
      capacity_factor × the active expert FLOPs when every slot is filled (the grouped dispatch
      computes the kept assignments only, at most the active FLOPs) — GDN's depthwise conv as
      2·K per channel).
    * `head`: 2·V·d per output projection — 2 for twin / twin_output_only, K for mos / moss
      (each component through the tied table), 1 otherwise — plus 2·d for a gate's dot and
      2 per weight of the head's own matmuls (the mos/moss context projections K·d² and prior d·K).
    * `attention_scores`: 4·T·n_heads·head_dim per ATTENTION layer of the layer pattern for QKᵀ
      and PV over the full T×T square, half that when `causal`; GDN layers have none.
    * `extra`: the family's `extra_flops`, each term also under its own key: `gdn_recurrence`
      (per GDN layer, `models.gdn.recurrence_flops`: intra-chunk, the blocked triangular
      inverse and its product, the state terms ≈ 6·H·dk·dv per token), `attnres` (2·d per
      source per AttnRes mixing, `models.attnres.extra_flops`).
    """
    from onona_jax import models as model_lib

    m = cfg_model
    weights = matmul_weights(m)
    counts = param_counts(m)
    body = 2 * sum(w for c, w in weights.items() if c != "head")
    projections = output_projections(m)
    head = 2 * (projections * m.vocab_size * m.d_model + weights["head"] + counts["gate"])
    pattern = model_lib.layer_pattern(m)
    attention_layers = m.n_layers // len(pattern) * pattern.count("attention")
    full_scores = 4 * seq_len * m.n_heads * m.head_dim * attention_layers
    scores = full_scores / 2 if causal else full_scores
    terms = model_lib.family(m).extra_flops(m, seq_len)
    extra = sum(terms.values())
    forward = body + head + scores + extra
    return {
        "forward": float(forward),
        "train": float(3 * forward),
        "train_full_square": float(3 * (forward - scores + full_scores)),
        "body_matmul": float(body),
        "head": float(head),
        "attention_scores": float(scores),
        "extra": float(extra),
        **{term: float(v) for term, v in terms.items()},
    }


def reference_model(cfg_model, reference: str = ""):
    """The Dense Standard model of the same size, what every arm's budget is measured against: this
    model's shape with `train.reference`'s keys set (a deeper or wider control's own size)."""
    import ml_collections

    from onona_jax import config as config_lib

    m = ml_collections.ConfigDict(cfg_model.to_dict())
    m.arch, m.head, m.table_init_scale = "dense", "standard", 1.0
    for key, value in config_lib.parse_reference(reference, m).items():
        config_lib.set_key(m, key, value)
    return m


def budget(cfg) -> dict:
    """The run's step count and what it spends, under `train.budget` (config.py):

    * the reference: Dense Standard of this size (`reference_model`, `train.reference`), trained `train.steps`, or
      ⌈tokens_per_param × its parameters / tokens per step⌉ when train.steps = 0 (the paper's 40);
    * `tokens`: the reference's steps;
    * `flops`: round(reference steps × reference FLOPs per token / this model's), the nearest whole
      step to the reference's training FLOPs (`flops_per_token`'s `train`, at data.seq_len);
    * `params`: ⌈tokens_per_param × this model's parameters / tokens per step⌉ (train.steps = 0), or
      ⌈reference steps × this model's parameters / the reference's⌉.

    Returns steps, tokens, flops (training FLOPs in all), params (total) and tokens_per_param, with
    the reference's steps, params and flops (`reference_*`)."""
    from onona_jax import config as config_lib

    t = cfg.train
    tokens_per_step = t.global_batch * cfg.data.seq_len
    ref_model = reference_model(cfg.model, t.get("reference", ""))
    ref_params, params = param_counts(ref_model)["total"], param_counts(cfg.model)["total"]
    ref_flops = flops_per_token(ref_model, cfg.data.seq_len)["train"]
    flops = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    if t.steps > 0:
        ref_steps = int(t.steps)
    else:  # exact: a float product could round a whole number of steps up by one
        ref_steps = math.ceil(Fraction(str(t.tokens_per_param)) * ref_params / tokens_per_step)
    kind = cfg.train.get("budget", "tokens")
    if kind == "tokens":
        steps = ref_steps
    elif kind == "flops":
        steps = round(ref_steps * ref_flops / flops)
    elif kind == "params":
        steps = (math.ceil(Fraction(ref_steps * params, ref_params)) if t.steps > 0 else
                 math.ceil(Fraction(str(t.tokens_per_param)) * params / tokens_per_step))
    else:
        raise ValueError(f"train.budget={kind!r}: one of {', '.join(config_lib.BUDGETS)}")
    tokens = steps * tokens_per_step
    return {
        "budget": kind, "steps": steps, "tokens": tokens, "flops": tokens * flops, "params": params,
        "tokens_per_param": tokens / params, "reference_steps": ref_steps, "reference_params": ref_params,
        "reference_flops": ref_steps * tokens_per_step * ref_flops,
    }


def summarize(cfg) -> dict:
    counts = param_counts(cfg.model)
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    return {
        "config": cfg.name,
        "components": list(components(cfg.model)),
        **counts,
        "flops_per_token_train": flops["train"],
        "flops_per_token_forward": flops["forward"],
        "training": budget(cfg),
    }


def format_table(s: dict) -> str:
    rows = [(c, s[c]) for c in s["components"]] + [
        ("total", s["total"]), ("non_embedding", s["non_embedding"]), ("active", s["active"])]
    width = max(len(r[0]) for r in rows)
    lines = [f"{s['config']}", "-" * (width + 18)]
    lines += [f"{name:<{width}}  {n:>15,}" for name, n in rows]
    lines.append(f"{'train FLOPs/token':<{width}}  {s['flops_per_token_train']:>15.4e}")
    b = s["training"]
    lines.append(f"budget ({b['budget']}): {b['steps']:,} steps, {b['tokens']:,} tokens "
                 f"({b['tokens_per_param']:.2f} per parameter), {b['flops']:.4e} training FLOPs "
                 f"(reference Dense Standard: {b['reference_steps']:,} steps, {b['reference_flops']:.4e})")
    return "\n".join(lines)


def define(fv, argv):
    flags.DEFINE_bool("json", False, "print JSON instead of a table", flag_values=fv)
    if cli.help_asked(argv[1:]):
        return cli.define_config_for_help(fv, None)
    from onona_jax import config as config_lib

    return config_lib.define_flag(fv, argv, default=None)


def _main(fv, args):
    if fv.config is None:
        raise cli.UsageError("give --config=configs/paper.py:<arch>-<size>-<head>")
    from onona_jax import config as config_lib

    s = summarize(config_lib.validate(fv.config))
    print(json.dumps(s, indent=2) if fv.json else format_table(s))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
