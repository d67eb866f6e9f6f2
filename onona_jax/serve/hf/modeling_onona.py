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

and the head, which config.json describes (so this file serves a head with any number of
tables without knowing its name; `config.head` only names it):

    head_rule="mixture"  the body reads `model.embed_tokens.weight`; the output mixes the K
              softmaxes of the tables `config.head_outputs` names, with the gate lookup
              `config.head_log_weights` [V, K] (log mixture weights by input token x, "" for
              K = 1): log p = logsumexp_k(log_weights[x, k] + log_softmax(score(h T_kᵀ))).
              twin: tables twin.A, twin.B, log weights logσ(±z), z = wᵀ rmsnorm(M_x)
    head_rule="mos"      the tied E, a mixture of K softmaxes of E tanh(W_k h) with the prior
              softmax(h W_π) (`mos.proj` [K, d, d], `mos.prior` [d, K]) (Yang et al., 2018)

`config.head_score` "sigsoftmax" makes each component p ∝ exp(z)σ(z) (Kanai et al., 2018);
`config.head_tensors` lists every head tensor (name -> shape) the model holds.

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


def mixture_log_probs(h, tables, log_weights=None, score=""):
    """fp32 [..., V]: log Σ_k w_k softmax(score(h T_kᵀ)) in log space, w = exp(log_weights)
    [..., K] (None for one table); exact where a weight would round to 0."""
    return mixture_from_logits([h @ T.T for T in tables], log_weights, score)


def scored_logits(z, score=""):
    """fp32 logits of one component: z, or log(exp(z)·σ(z)) = 2z − softplus(z) for sigsoftmax."""
    z = z.float()
    return 2.0 * z - F.softplus(z) if score == "sigsoftmax" else z


def mixture_from_logits(logits, log_weights=None, score=""):
    """`mixture_log_probs` from the K tables' logits z_k = h T_kᵀ [..., V] (any float dtype),
    for callers that project themselves (the vLLM plugin's vocab-parallel heads)."""
    parts = [F.log_softmax(scored_logits(z, score), dim=-1) for z in logits]
    if log_weights is None:
        return parts[0]
    lw = log_weights.float()
    if len(parts) == 2:  # logaddexp, as the JAX model's two-table form
        return torch.logaddexp(parts[0] + lw[..., 0:1], parts[1] + lw[..., 1:2])
    return torch.logsumexp(torch.stack(parts, dim=-2) + lw.unsqueeze(-1), dim=-2)


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
        if isinstance(module, OnonaHeadTensors):
            for p in module.parameters(recurse=False):
                nn.init.normal_(p, std=std)
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


class OnonaHeadTensors(nn.Module):
    """A node of the head's tensors at their exported names (`config.head_tensors`, e.g.
    `twin.A`): parameters and child nodes made from the dotted names."""


def _add_head_tensor(root: nn.Module, name: str, shape, config) -> None:
    if name == "lm_head.weight":  # a plain output layer, as transformers names it
        root.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        return
    *path, leaf = name.split(".")
    node = root
    for part in path:
        if not hasattr(node, part):
            node.add_module(part, OnonaHeadTensors())
        node = getattr(node, part)
    node.register_parameter(leaf, nn.Parameter(torch.empty(*shape)))


class OnonaForCausalLM(OnonaPreTrainedModel, GenerationMixin):
    def __init__(self, config: OnonaConfig):
        super().__init__(config)
        self.model = OnonaModel(config)
        for name, shape in sorted((config.head_tensors or {}).items()):
            _add_head_tensor(self, name, shape, config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        # the heads read their tables themselves; only lm_head is a plain output layer, never tied
        return getattr(self, "lm_head", None)

    def head_tensor(self, name: str):
        """A head tensor by its exported name (the body's input table included)."""
        if name == "model.embed_tokens.weight":
            return self.model.embed_tokens.weight
        node = self
        for part in name.split("."):
            node = getattr(node, part)
        return node

    def head_log_probs(self, h, input_ids):
        """fp32 log p(next token) [..., V] from final hidden states h and the input tokens."""
        c = self.config
        E = self.model.embed_tokens.weight
        if c.head_rule == "mos":
            log_prior = F.log_softmax((h @ self.mos.prior).float(), dim=-1)  # [..., K]
            contexts = torch.tanh(torch.einsum("...d,kde->...ke", h, self.mos.proj))
            return torch.logsumexp(log_prior.unsqueeze(-1) + mixture_log_probs(contexts, [E], None, c.head_score),
                                   dim=-2)
        tables = [self.head_tensor(n) for n in c.head_outputs]
        lw = self.head_tensor(c.head_log_weights)[input_ids] if c.head_log_weights else None
        return mixture_log_probs(h, tables, lw, c.head_score)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if self.config.head_log_weights and input_ids is None:
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
