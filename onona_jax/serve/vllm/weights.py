"""Which vLLM parameter each tensor of an export loads into (`weight_plan`): plain Python, no
torch or vllm, so the default suite checks it against real exports.

Body (vLLM's Qwen3Model / Qwen3MoeModel under `model.`): q/k/v_proj -> qkv_proj (shards
"q", "k", "v"), gate/up_proj -> gate_up_proj (shards 0, 1), the fused MoE experts
`mlp.experts.gate_up_proj` [E, 2f, d] (gate rows first: vLLM's w13 layout) and
`mlp.experts.down_proj` [E, d, f] -> FusedMoE's routed_experts.w13_weight / w2_weight;
everything else by its own name. Head (config.json's description, never the head's name): the K tables
`head_outputs` -> `tables.<k>.weight` (a table that is the body's input table is tied to
`model.embed_tokens`), `head_log_weights` -> the buffer `log_weights`; MoS: `mos.proj`,
`mos.prior` -> `mos_proj`, `mos_prior`. Dropped, by name: the head tensors config.json lists
(`head_tensors`) that serving does not read (the parameters a fold derived its tables from,
e.g. the twin gate's raw `twin.gate.weight`). Any other tensor is an error.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

INPUT = "model.embed_tokens.weight"
STACKED = {"self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", "q"),
           "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", "k"),
           "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", "v"),
           "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
           "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1)}
LAYER_OWN = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight")
DENSE_OWN = ("mlp.down_proj.weight",)
MOE = {"mlp.gate.weight": "mlp.gate.weight", "mlp.experts.gate_up_proj": "mlp.experts.routed_experts.w13_weight",
       "mlp.experts.down_proj": "mlp.experts.routed_experts.w2_weight"}
LOG_WEIGHTS = "log_weights"  # a buffer, not a parameter (replicated fp32)


class Target(NamedTuple):
    name: str  # the vLLM parameter (or buffer) it loads into
    shard: str | int | None  # stacked parameters' shard id


class WeightPlan(NamedTuple):
    targets: dict  # export name -> Target
    dropped: tuple  # export names serving does not read (sorted)

    def parameters(self) -> set:
        """The vLLM parameter names the plan fills (the buffer excluded)."""
        return {t.name for t in self.targets.values() if t.name != LOG_WEIGHTS}


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def expected_names(config) -> dict:
    """export name -> Target of every tensor the plugin reads from an export with this config."""
    family = _get(config, "family", "dense")
    out = {INPUT: Target(INPUT, None), "model.norm.weight": Target("model.norm.weight", None)}
    for i in range(int(_get(config, "num_hidden_layers"))):
        p = f"model.layers.{i}."
        out.update({p + k: Target(p + dst, shard) for k, (dst, shard) in STACKED.items()
                    if family == "dense" or k.startswith("self_attn.")})
        own = LAYER_OWN + (DENSE_OWN if family == "dense" else ())
        out.update({p + k: Target(p + k, None) for k in own})
        if family == "moe":
            out.update({p + k: Target(p + dst, None) for k, dst in MOE.items()})
    if _get(config, "head_rule", "mixture") == "mos":
        out["mos.proj"], out["mos.prior"] = Target("mos_proj", None), Target("mos_prior", None)
        return out
    for k, name in enumerate(_get(config, "head_outputs") or ()):
        if name != INPUT:  # the input table itself: tied, loaded once as the embedding
            out[name] = Target(f"tables.{k}.weight", None)
    if _get(config, "head_log_weights"):
        out[_get(config, "head_log_weights")] = Target(LOG_WEIGHTS, None)
    return out


def unused_names(config) -> set:
    """The head tensors config.json lists (`head_tensors`) that serving does not read."""
    return set(_get(config, "head_tensors") or {}) - set(expected_names(config))


def unknown_error(names) -> ValueError:
    names = sorted(names)
    return ValueError(f"the export holds tensors the onóna vLLM plugin neither reads nor lists as unused: "
                      f"{names[:5]} ({len(names)} in all); export the checkpoint again with this onona_jax")


def missing_error(names) -> ValueError:
    names = sorted(names)
    return ValueError(f"the export lacks tensors its config.json needs: {names[:5]} ({len(names)} in all); "
                      "export the checkpoint again (python -m onona_jax.serve.export)")


def weight_plan(names: Iterable[str], config) -> WeightPlan:
    """The plan for an export's tensor `names`; a ValueError names any tensor that is neither
    read nor listed as unused, and any the plugin needs but the export lacks."""
    names = set(names)
    want, unused = expected_names(config), unused_names(config)
    if names - set(want) - unused:
        raise unknown_error(names - set(want) - unused)
    if set(want) - names:
        raise missing_error(set(want) - names)
    return WeightPlan({n: want[n] for n in sorted(want)}, tuple(sorted(names & unused)))
