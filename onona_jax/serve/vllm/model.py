"""`OnonaForCausalLM` for vLLM: an onóna export served by vLLM's own Qwen3 / Qwen3-MoE body and
the head that config.json describes (`head_rule`, `head_outputs`, `head_log_weights`,
`head_score`; never the head's name).

The gate is a lookup by the input token x, and vLLM hands `compute_logits` only the hidden
rows it samples from (no request or token data), so a gated head's `forward` returns
[T, d + C]: the hidden state, then x as C base-256 digit columns (`head.carry_ids`; exact in
bf16, fp16 and fp32); `compute_logits` splits them again. vLLM keeps the extra columns in the
rows it samples, and in its prompt-logprob rows, each row with its own input token.

Exact mixture (default): `compute_logits` returns the mixture's fp32 log-probabilities
log p = logsumexp_k(log w[x, k] + log_softmax(score(h T_kᵀ))) [N, V]. log_softmax of them is
themselves, so greedy (the mixture's argmax), temperature, top-k, top-p, min-p and logprobs
act on the model's distribution. vLLM's repetition penalty divides positive logits and
multiplies the others: here every logit is a log-probability ≤ 0, so a seen token's log p is
multiplied by the penalty (p^penalty, renormalised), the rule transformers'
RepetitionPenaltyLogitsProcessor applies to the export's log-prob logits; presence and
frequency penalties subtract from log p.

One-projection mode (`one_projection: true` in the served config: `hf_overrides`): each row
draws k ~ w[x] from the model's own torch.Generator (seeded with the engine's `seed`) and
gets only table k's logits score(h T_kᵀ), one matmul per table over the rows that drew it,
so a row costs one V×d projection instead of K. vLLM's temperature-1 sample of
softmax(h T_kᵀ) after k ~ w[x] is an exact sample of the mixture. What the per-request
`seed` covers: the token drawn given the component (vLLM's per-request generator); the
component comes from the model's generator, which every sampled row of every step advances,
so a seeded request repeats its tokens only in an engine started with the same `seed` that
receives the same requests in the same order and batches (docs/serving.md). The requests
this mode cannot serve exactly are refused at admission by `OneProjectionRequests`, which the
engine must load (`--logits-processors onona_jax.serve.vllm:OneProjectionRequests`).

Vocabulary tensor parallelism: each table is a `ParallelLMHead` (sharded by vocabulary rows
as vLLM shards its LM head; `LogitsProcessor` gathers the logits); the gate lookup [V, K] is
a replicated fp32 buffer. Served: families dense and moe, head rules mixture and mos.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from onona_jax.serve.vllm import head as head_lib
from onona_jax.serve.vllm import weights as weights_lib
from onona_jax.serve.vllm.requests import FQCN, OneProjectionRequests

SERVED_FAMILIES = ("dense", "moe")


def _check_config(config) -> None:
    family = getattr(config, "family", "dense")
    if family not in SERVED_FAMILIES:
        what = {"gdn": "a Gated DeltaNet hybrid", "attnres": "Attention Residuals"}.get(family, "a body")
        raise ValueError(f"the onóna vLLM plugin serves the dense and moe families; this export is family {family!r} "
                         f"({what}, which vLLM's Qwen3 layers do not build): serve it with onona_jax's Server "
                         "(python -m onona_jax.serve.generate) or with transformers "
                         "(AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True))")
    if config.head_rule not in ("mixture", "mos"):
        raise ValueError(f"config.json head_rule={config.head_rule!r}: the onóna vLLM plugin serves 'mixture' and "
                         "'mos'; export the checkpoint again with this onona_jax")
    if config.head_rule == "mixture" and len(config.head_outputs or ()) > 1 and not config.head_log_weights:
        raise ValueError(f"config.json names {len(config.head_outputs)} output tables (head_outputs) but no gate "
                         "lookup (head_log_weights) to mix them; export the checkpoint again with this onona_jax")


def _loads_our_check(entries) -> bool:
    """Whether the engine's logits processors (classes or 'module:Class' names) include
    OneProjectionRequests."""
    for entry in entries or ():
        if isinstance(entry, str):
            module, _, qualname = entry.partition(":")
            try:
                entry = getattr(importlib.import_module(module), qualname)
            except (ImportError, AttributeError):
                continue  # vLLM itself reports a name it cannot load
        if entry is OneProjectionRequests:
            return True
    return False


class OnonaForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        _check_config(config)
        self.config = config
        self.vocab_size, self.hidden_size = int(config.vocab_size), int(config.hidden_size)
        self.mos = config.head_rule == "mos"
        self.score = config.head_score or ""
        outputs = [] if self.mos else list(config.head_outputs or ())
        gated = bool(config.head_log_weights) and not self.mos
        self.one_projection = bool(getattr(config, "one_projection", False))
        if vllm_config.speculative_config is not None:
            raise ValueError("the onóna vLLM plugin does not serve with speculative decoding (its hidden rows carry "
                             "the input token's columns, which drafters do not expect): drop the speculative config")
        if gated and vllm_config.model_config.enable_prompt_embeds:
            raise ValueError(f"the {config.head} head's gate reads the input token ids, which vLLM does not pass "
                             "with prompt embeddings: serve without enable_prompt_embeds")
        if self.one_projection:
            self._check_one_projection(vllm_config, outputs, gated)

        if config.family == "moe":
            from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel as Body

            # every layer sparse (what onóna's MoE trains); OnonaConfig lacks Qwen3-MoE's keys for it
            for key, value in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
                if not hasattr(config, key):
                    setattr(config, key, value)
        else:
            from vllm.model_executor.models.qwen3 import Qwen3Model as Body
        self.model = Body(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))

        quant = vllm_config.quant_config
        V, d = self.vocab_size, self.hidden_size
        tables = []
        for k, name in enumerate(outputs or [weights_lib.INPUT]):  # MoS reads the tied input table
            table = ParallelLMHead(V, d, quant_config=quant, prefix=maybe_prefix(prefix, f"tables.{k}"))
            if name == weights_lib.INPUT:
                table = table.tie_weights(self.model.embed_tokens)
            tables.append(table)
        self.tables = nn.ModuleList(tables)
        if self.mos:
            K = int(config.mos_components)
            self.mos_proj = nn.Parameter(torch.empty(K, d, d), requires_grad=False)
            self.mos_prior = nn.Parameter(torch.empty(d, K), requires_grad=False)
        # the gate lookup [V, K], read by input token: replicated, fp32 whatever the model dtype
        self.register_buffer("log_weights", torch.zeros(V, len(outputs), dtype=torch.float32) if gated else None,
                             persistent=False)
        self.columns = head_lib.id_columns(V) if gated else 0
        self.logits_processor = LogitsProcessor(V)
        self.seed = int(vllm_config.model_config.seed or 0)
        self._generator = None
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    @staticmethod
    def _check_one_projection(vllm_config, outputs, gated) -> None:
        if not gated or len(outputs) < 2:
            raise ValueError("one_projection needs a head whose output tables a gate over the input token mixes "
                             f"(twin: K = 2); this export's head has {len(outputs)} table(s) "
                             f"{'with' if gated else 'and no'} gate: serve it without one_projection")
        if not _loads_our_check(vllm_config.model_config.logits_processors):
            raise ValueError("one_projection needs its request check, which refuses what the mode cannot sample "
                             f"exactly: add --logits-processors {FQCN} (LLM(..., logits_processors=['{FQCN}']))")
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() and vllm_config.use_v2_model_runner:
            raise ValueError("one_projection's request check is a V1-interface logits processor, which vLLM's "
                             "model runner V2 refuses: set VLLM_USE_V2_MODEL_RUNNER=0")

    # -- forward

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor | IntermediateTensors:
        if self.columns and input_ids is None:
            raise ValueError(f"the {self.config.head} head's gate reads the input token ids, which vLLM passes as "
                             "None with prompt embeddings or multimodal inputs: send token ids")
        h = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if isinstance(h, IntermediateTensors) or not self.columns:
            return h
        return torch.cat([h, head_lib.carry_ids(input_ids, self.columns, h.dtype).to(h.device)], dim=-1)

    def _split(self, hidden_states: torch.Tensor):
        """(hidden [N, d], the rows' log mixture weights [N, K] or None)."""
        if not self.columns:
            return hidden_states, None
        h, ids = head_lib.split_rows(hidden_states, self.hidden_size, self.vocab_size)
        return h, self.log_weights[ids.to(self.log_weights.device)]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        h, log_weights = self._split(hidden_states)
        if self.one_projection:
            return self._one_projection_logits(h, log_weights)
        if self.mos:
            return self._mos_log_probs(h)
        logits = [self.logits_processor(table, h) for table in self.tables]
        if any(z is None for z in logits):  # a rank that the gather leaves without logits
            return None
        return head_lib.mixture_log_probs(logits, log_weights, self.score)

    def _mos_log_probs(self, h: torch.Tensor) -> torch.Tensor | None:
        contexts = torch.tanh(torch.einsum("nd,kde->nke", h, self.mos_proj.to(h.dtype)))  # as modeling_onona
        N, K, d = contexts.shape
        z = self.logits_processor(self.tables[0], contexts.reshape(N * K, d))
        if z is None:
            return None
        return head_lib.mos_log_probs(h @ self.mos_prior.to(h.dtype), z.reshape(N, K, -1), self.score)

    def _one_projection_logits(self, h: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor | None:
        if self._generator is None:
            self._generator = torch.Generator(device=h.device)
            self._generator.manual_seed(self.seed)
        component = head_lib.draw_components(log_weights, self._generator)
        out = torch.empty(h.shape[0], self.vocab_size, dtype=torch.float32, device=h.device)
        for k, table in enumerate(self.tables):  # every rank draws the same components: same calls
            rows = torch.nonzero(component == k).squeeze(1)
            if rows.numel():
                z = self.logits_processor(table, h.index_select(0, rows))
                if z is None:
                    return None
                out[rows] = head_lib.score_logits(z, self.score)
        return out

    # -- weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load an export's tensors (`weights.expected_names`): the body through vLLM's own
        Qwen3 loader (q/k/v and gate/up stacking, fused MoE experts), the head here; the head
        tensors config.json lists and serving does not read are skipped by name; anything
        else, and any tensor missing, is an error."""
        want, unused = weights_lib.expected_names(self.config), weights_lib.unused_names(self.config)
        seen, unknown, head_loaded = set(), set(), set()

        def body():
            for name, tensor in weights:
                target = want.get(name)
                if target is None:
                    (unknown if name not in unused else seen).add(name)
                    continue
                seen.add(name)
                if target.name.startswith("model."):
                    yield name[len("model."):], tensor
                else:
                    self._load_head(target.name, tensor)
                    head_loaded.add(target.name)

        loaded = {f"model.{n}" for n in self.model.load_weights(body())} | (head_loaded - {weights_lib.LOG_WEIGHTS})
        if unknown:
            raise weights_lib.unknown_error(unknown)
        if set(want) - seen:
            raise weights_lib.missing_error(set(want) - seen)
        params = {n for n, _ in self.named_parameters()}
        plan = weights_lib.WeightPlan(want, ()).parameters()
        if params - loaded or plan != params:  # the plan (tested without vLLM) must be what vLLM built
            raise RuntimeError(f"onóna vLLM plugin bug: parameters not loaded {sorted(params - loaded)[:5]}, "
                               f"planned but absent {sorted(plan - params)[:5]}, present but not planned "
                               f"{sorted(params - plan)[:5]}")
        return loaded

    def _load_head(self, target: str, tensor: torch.Tensor) -> None:
        if target == weights_lib.LOG_WEIGHTS:
            if tuple(tensor.shape) != tuple(self.log_weights.shape):
                raise ValueError(f"{self.config.head_log_weights}: shape {tuple(tensor.shape)}, config.json says "
                                 f"{tuple(self.log_weights.shape)}; export the checkpoint again")
            self.log_weights.copy_(tensor.to(torch.float32))
            return
        param = self.get_parameter(target)
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
