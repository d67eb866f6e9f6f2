"""`OnonaForCausalLM`: onóna (twin embeddings with tied unembeddings) as a HF transformers model.

Written verbatim into an export folder by `python -m onona_jax.serve.export`; it needs transformers
alone (no onona_jax import), so

    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(OUT)
    model.generate(**tokenizer("It is a truth", return_tensors="pt"), max_new_tokens=20)

works wherever transformers does. The body is built from transformers' own Qwen3 modules
(attention with QK-norm and RoPE, SwiGLU, RMSNorm), Qwen3-MoE's sparse block and Qwen3-Next's
Gated DeltaNet, so that the numerics are theirs; `config.family` picks

    dense    pre-norm residual blocks, attention + SwiGLU
    moe      every SwiGLU replaced by Qwen3-MoE's top-k block (nothing is dropped: the JAX
             model's evaluation capacity, 4.0 for 8 experts top-2, drops nothing either)
    gdn      Gated DeltaNet layers and attention layers after `config.layer_pattern`
             (3 GDN : 1 attention), every layer with a SwiGLU
    attnres  Attention Residuals: no residual sum, each sublayer reads a softmax mixture
             over depth of the embedding and the earlier (block-summed) sublayer outputs

and `config.head`

    twin      the body reads M = (A+B)/2 (`model.embed_tokens.weight`); the output mixes
              two softmaxes with a gate that depends only on the input token x:
              log p = logaddexp(log_softmax(hAᵀ) + logσ(z[x]), log_softmax(hBᵀ) + logσ(−z[x])),
              z = `twin.gate_logit`, precomputed for every input token as wᵀ rmsnorm(M_x)
    standard  the tied table E reads and writes: log p = log_softmax(hEᵀ)
    untied    E reads, `lm_head.weight` W writes: log p = log_softmax(hWᵀ)
    sigsoftmax  the tied E, p ∝ exp(z)σ(z) with z = hEᵀ (Kanai et al., 2018)
    mos, moss   the tied E, a mixture of K softmaxes (sigsoftmaxes) of E tanh(W_k h) with the
              prior softmax(h W_π) (`mos.proj` [K, d, d], `mos.prior` [d, K])
    input_gate  the body reads g·A[x] + (1−g)·B[x] (folded per token into
              `model.embed_tokens.weight`), the output is softmax(hMᵀ) (`lm_head.weight` = M)
    twin_input_only   the body reads M[x], the output is softmax(hAᵀ) (`lm_head.weight` = A)
    twin_output_only  the body reads A[x], the twin mixture with the gate reading A[x]

`logits` are the model's fp32 log-probabilities (a softmax of them is the model's
distribution, so greedy search, sampling and beam search act on the mixture). The KV cache
(and GDN's recurrent state) is transformers' `DynamicCache`, so `generate()` works as for
any causal LM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .configuration_onona import OnonaConfig


# ----------------------------------------------------------------------------- pure math


def twin_log_probs(h, A, B, z):
    """fp32 [..., V]: log(σ(z)·softmax(hAᵀ) + σ(−z)·softmax(hBᵀ)) in log space (exact where
    1 − σ(z) would round to 0). h [..., d], z [...] the gate logits of the input tokens."""
    la = F.log_softmax((h @ A.T).float(), dim=-1)
    lb = F.log_softmax((h @ B.T).float(), dim=-1)
    z = z.float().unsqueeze(-1)
    return torch.logaddexp(la + F.logsigmoid(z), lb + F.logsigmoid(-z))


def attnres_mix(sources, query, norm_weight, eps):
    """Σ_i softmax_i(queryᵀ rmsnorm(v_i; norm_weight)) · v_i over a list of [B, T, d] sources,
    in fp32 (no 1/√d scale), returned in the sources' dtype (Attention Residuals' depth mixing)."""
    v = torch.stack([s.float() for s in sources])
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    p = torch.softmax((keys * query.float()).sum(-1), dim=0)
    return (p.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


# ----------------------------------------------------------------------------- layers


class OnonaDecoderLayer(nn.Module):
    """Pre-norm residual block; the mixer is attention (`self_attn`) or Gated DeltaNet
    (`linear_attn`), the feed-forward a SwiGLU or Qwen3-MoE's sparse block (`mlp`)."""

    def __init__(self, config: OnonaConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.layer_type == "linear_attention":
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

            self.linear_attn = Qwen3NextGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3Attention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.family == "moe":
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

            self.mlp = Qwen3MoeSparseMoeBlock(config)
        else:
            self.mlp = Qwen3MLP(config)

    def mix(self, x, masks, position_embeddings, cache, **kwargs):
        if self.layer_type == "linear_attention":
            return self.linear_attn(x, cache=cache, attention_mask=masks["linear_attention"])
        y, _ = self.self_attn(x, position_embeddings=position_embeddings,
                              attention_mask=masks["full_attention"], cache=cache, **kwargs)
        return y

    def forward(self, x, masks, position_embeddings, cache, **kwargs):
        x = x + self.mix(self.input_layernorm(x), masks, position_embeddings, cache, **kwargs)
        return x + self.mlp(self.post_attention_layernorm(x))


class OnonaAttnResLayer(OnonaDecoderLayer):
    """Attention and SwiGLU sublayers with their pre-norms and no residual adds; each reads
    an AttnRes mixture (`attnres.{attn,mlp}_query`, `attnres.{attn,mlp}_key_norm`)."""

    def __init__(self, config: OnonaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d = config.hidden_size
        self.attnres = nn.Module()
        self.attnres.attn_query = nn.Parameter(torch.zeros(d))
        self.attnres.attn_key_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.attnres.mlp_query = nn.Parameter(torch.zeros(d))
        self.attnres.mlp_key_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)


# ----------------------------------------------------------------------------- model


class OnonaPreTrainedModel(PreTrainedModel):
    config_class = OnonaConfig
    base_model_prefix = "model"
    _no_split_modules = ["OnonaDecoderLayer", "OnonaAttnResLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        # Weights come from the checkpoint; this only covers modules made from scratch.
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, OnonaTwinTables):
            nn.init.normal_(module.A, std=std)
            nn.init.normal_(module.B, std=std)
        elif isinstance(module, OnonaMoS):
            nn.init.normal_(module.proj, std=std)
            nn.init.normal_(module.prior, std=std)
        elif hasattr(module, "gate_up_proj") and module.gate_up_proj.dim() == 3:  # Qwen3-MoE experts
            nn.init.normal_(module.gate_up_proj, std=std)
            nn.init.normal_(module.down_proj, std=std)


class OnonaModel(OnonaPreTrainedModel):
    """The decoder body: input table, layers, final norm. `forward(inputs_embeds=...)`."""

    def __init__(self, config: OnonaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer = OnonaAttnResLayer if config.family == "attnres" else OnonaDecoderLayer
        self.layers = nn.ModuleList([layer(config, i) for i in range(config.num_hidden_layers)])
        if config.family == "attnres":
            self.final_attnres = nn.Module()
            self.final_attnres.query = nn.Parameter(torch.zeros(config.hidden_size))
            self.final_attnres.key_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past)[None]
        if isinstance(attention_mask, dict):
            masks = attention_mask
        else:
            mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               cache=cache, position_ids=position_ids)
            masks = {"full_attention": create_causal_mask(**mask_kwargs)}
            if "linear_attention" in self.config.layer_types:
                masks["linear_attention"] = create_recurrent_attention_mask(**mask_kwargs)
        x = inputs_embeds
        rope = self.rotary_emb(x, position_ids)
        if self.config.family == "attnres":
            x = self._attnres(x, masks, rope, cache, **kwargs)
        else:
            for layer in self.layers:
                x = layer(x, masks, rope, cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache if use_cache else None)

    def _attnres(self, x, masks, rope, cache, **kwargs):
        """Block AttnRes (block_size k sublayers): b_0 = the embedding, a source of its own;
        block n's source is the sum of its sublayers' outputs (its partial sum while it fills);
        sublayer s reads [b_0, ..., completed blocks, partial sum]; a final mixing reads all."""
        k, eps = self.config.attnres_block_size, self.config.rms_norm_eps
        blocks, partial = [x], None
        for i, layer in enumerate(self.layers):
            q = layer.attnres
            for j, (query, key_norm) in enumerate(((q.attn_query, q.attn_key_norm), (q.mlp_query, q.mlp_key_norm))):
                h = attnres_mix(blocks + ([partial] if partial is not None else []), query, key_norm.weight, eps)
                if j == 0:
                    y = layer.mix(layer.input_layernorm(h), masks, rope, cache, **kwargs)
                else:
                    y = layer.mlp(layer.post_attention_layernorm(h))
                partial = y if partial is None else partial + y
                if (2 * i + j + 1) % k == 0:
                    blocks, partial = blocks + [partial], None
        f = self.final_attnres
        return attnres_mix(blocks + ([partial] if partial is not None else []), f.query, f.key_norm.weight, eps)


class OnonaTwinTables(nn.Module):
    """The two-table heads' A, B [V, d]; where there is a gate, its w (`gate.weight` [1, d],
    kept for re-import) and its lookup z_v = wᵀ rmsnorm(r_v) for every input token v
    (`gate_logit` [V]; r = M, or A for twin_output_only)."""

    def __init__(self, config: OnonaConfig, gate: bool):
        super().__init__()
        V, d = config.vocab_size, config.hidden_size
        self.A = nn.Parameter(torch.empty(V, d))
        self.B = nn.Parameter(torch.empty(V, d))
        if gate:
            self.gate = nn.Linear(d, 1, bias=False)
            self.register_buffer("gate_logit", torch.zeros(V))


class OnonaMoS(nn.Module):
    """Mixture of softmaxes: `proj` [K, d, d] (contexts tanh(h W_k)), `prior` [d, K]."""

    def __init__(self, config: OnonaConfig):
        super().__init__()
        K, d = config.mos_components, config.hidden_size
        self.proj = nn.Parameter(torch.empty(K, d, d))
        self.prior = nn.Parameter(torch.empty(d, K))


GATED = ("twin", "twin_output_only", "input_gate")
TWO_TABLES = (*GATED, "twin_input_only")
SINGLE_OUTPUT = ("untied", "input_gate", "twin_input_only")  # softmax(h lm_headᵀ)


class OnonaForCausalLM(OnonaPreTrainedModel, GenerationMixin):
    def __init__(self, config: OnonaConfig):
        super().__init__(config)
        self.model = OnonaModel(config)
        head = config.head
        if head in TWO_TABLES:
            self.twin = OnonaTwinTables(config, gate=head in GATED)
        if head in SINGLE_OUTPUT:  # its own output table (input_gate: M, twin_input_only: A)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if head in ("mos", "moss"):
            self.mos = OnonaMoS(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        # the heads read their tables themselves; only lm_head is a plain output layer, never tied
        return getattr(self, "lm_head", None)

    def head_log_probs(self, h, input_ids):
        """fp32 log p(next token) [..., V] from final hidden states h and the input tokens."""
        head = self.config.head
        if head in ("twin", "twin_output_only"):
            return twin_log_probs(h, self.twin.A, self.twin.B, self.twin.gate_logit[input_ids])
        if head in SINGLE_OUTPUT:
            return F.log_softmax(self.lm_head(h).float(), dim=-1)
        E = self.model.embed_tokens.weight
        if head in ("mos", "moss"):
            log_prior = F.log_softmax((h @ self.mos.prior).float(), dim=-1)  # [..., K]
            contexts = torch.tanh(torch.einsum("...d,kde->...ke", h, self.mos.proj))
            z = (contexts @ E.T).float()  # [..., K, V]
            if head == "moss":
                z = 2.0 * z - F.softplus(z)
            return torch.logsumexp(log_prior.unsqueeze(-1) + F.log_softmax(z, dim=-1), dim=-2)
        z = (h @ E.T).float()
        if head == "sigsoftmax":
            z = 2.0 * z - F.softplus(z)  # log(exp(z)·σ(z))
        return F.log_softmax(z, dim=-1)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if self.config.head in GATED and input_ids is None:
            raise ValueError(f"the {self.config.head} head's gate reads the input tokens: pass input_ids, "
                             "not inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        log_probs = self.head_log_probs(out.last_hidden_state[:, keep],
                                        None if input_ids is None else input_ids[:, keep])
        loss = None
        if labels is not None:
            loss = F.nll_loss(log_probs[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(log_probs.device),
                              ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=log_probs, cache=out.cache)


__all__ = ["OnonaForCausalLM", "OnonaModel", "OnonaPreTrainedModel"]
