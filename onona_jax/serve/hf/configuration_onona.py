"""`OnonaConfig`: the HF transformers configuration of an onóna model (model_type "onona").

Written verbatim into every export folder that `python -m onona_jax.serve.export` makes for a model
that is not a plain Qwen3 / Qwen3-MoE; it needs transformers alone (no onona_jax import).

It is a Qwen3 configuration (the attention and MLP fields keep their Qwen3 meaning) plus

    family   dense | moe | gdn | attnres   the decoder body
    head     the head's name (as the training config calls it; the model does not read it)
    head_rule, head_outputs, head_log_weights, head_score, head_tensors
             the head as modeling_onona.py serves it: "mixture" of the tables named in
             head_outputs with the gate lookup head_log_weights ("" without a gate), or
             "mos"; head_score "" or "sigsoftmax"; head_tensors {name: shape} of every head
             tensor besides the body's input table
    mos:     mos_components K
    moe:     num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob
             (Qwen3-MoE's names: top-k of a softmax over all experts, optionally renormalised)
    gdn:     linear_num_key_heads = linear_num_value_heads, linear_key_head_dim,
             linear_value_head_dim, linear_conv_kernel_dim (Qwen3-Next's names) and
             layer_pattern, e.g. "gdn,gdn,gdn,attention", repeated over the layers
    attnres: attnres_block_size (sublayers per block; 1 = full Attention Residuals)
    twin:    gate_eps, the eps of the gate's RMS normalisation (finfo(fp32).eps)
"""

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

FAMILIES = ("dense", "moe", "gdn", "attnres")
HEAD_RULES = ("mixture", "mos")


@strict
class OnonaConfig(Qwen3Config):
    model_type = "onona"
    # No valid config without head_outputs: transformers < 5.20 (vLLM's pin) builds `cls()` to
    # diff against in __repr__ / to_diff_dict unless told not to (a plain class attribute, not a field).
    has_no_defaults_at_init = True

    family: str = "dense"
    head: str = "twin"
    head_rule: str = "mixture"
    head_outputs: list[str] | None = None
    head_log_weights: str = ""
    head_score: str = ""
    head_tensors: dict | None = None
    # MoE (Qwen3-MoE's names)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 1024
    norm_topk_prob: bool = False
    # Gated DeltaNet hybrid (Qwen3-Next's names)
    layer_pattern: str = ""
    linear_num_key_heads: int = 6
    linear_num_value_heads: int = 6
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # mos / moss heads
    mos_components: int = 2
    # Attention Residuals
    attnres_block_size: int = 1
    # twin gate: F.rms_norm's default eps in fp32
    gate_eps: float = 1.1920928955078125e-07

    def __post_init__(self, **kwargs):
        if self.family not in FAMILIES or self.head_rule not in HEAD_RULES:
            raise ValueError(
                f"OnonaConfig: family={self.family!r}, head_rule={self.head_rule!r}; supported families "
                f"{FAMILIES} with head rules {HEAD_RULES}"
            )
        if self.head_rule == "mixture" and not self.head_outputs:
            raise ValueError(f"OnonaConfig: head {self.head!r} names no output tables (head_outputs)")
        pattern = (self.layer_pattern or ("gdn,gdn,gdn,attention" if self.family == "gdn" else "attention"))
        pattern = pattern.split(",")
        kinds = {"attention": "full_attention", "gdn": "linear_attention"}
        if not set(pattern) <= set(kinds) or self.num_hidden_layers % len(pattern):
            raise ValueError(f"OnonaConfig: layer_pattern={self.layer_pattern!r} must be a comma list of "
                             f"attention and gdn whose length divides num_hidden_layers")
        self.layer_types = [kinds[pattern[i % len(pattern)]] for i in range(self.num_hidden_layers)]
        super().__post_init__(**kwargs)


__all__ = ["OnonaConfig"]
