"""The onóna head's math for the vLLM plugin (`model.py`): torch and the export's own
`modeling_onona` (transformers), no vllm import, so the default test suite checks it in the
repository's environment.

* The input token travels to `compute_logits` in extra columns of the hidden state
  (`carry_ids` / `read_ids`): vLLM hands `compute_logits` the hidden rows alone, and the gate
  is a lookup by the input token. Each column holds one base-256 digit (< 256: exact in bf16,
  fp16 and fp32), read back rounded and clamped, so the random [0, 1) columns of vLLM's dummy
  sampler run still read as valid ids.
* The mixture log p = logsumexp_k(log w[x, k] + log_softmax(score(h T_kᵀ))) is the export's own
  (`modeling_onona.mixture_from_logits`: the same code transformers runs on the export; it
  imports under the vLLM venv's transformers too), from logits the caller projected.
* One-projection sampling: `draw_components` draws k ~ w[x] per row; `one_projection_problems`
  names what a request asks that a draw from one component's softmax cannot give exactly.
"""

from __future__ import annotations

import torch

from onona_jax.serve.hf.modeling_onona import mixture_from_logits, scored_logits

BASE = 256  # one digit per column: integers below 256 are exact in bf16 (8-bit significand)


def id_columns(vocab_size: int) -> int:
    """How many base-256 digit columns carry an id below vocab_size (at least one)."""
    columns, reach = 1, BASE
    while reach < vocab_size:
        columns, reach = columns + 1, reach * BASE
    return columns


def carry_ids(input_ids: torch.Tensor, columns: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, columns] of `dtype`: the ids' base-256 digits, least significant first."""
    ids = input_ids.reshape(-1).long()
    digits = [(ids // BASE**j) % BASE for j in range(columns)]
    return torch.stack(digits, dim=-1).to(dtype)


def read_ids(extra: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N] int64 ids from `carry_ids` columns [N, C]: each digit rounded and clamped to
    [0, 255], the id clamped to [0, vocab_size) (any input, even noise, gives a valid id)."""
    digits = extra.float().round().clamp(0, BASE - 1).long()
    weights = BASE ** torch.arange(digits.shape[-1], device=digits.device, dtype=torch.int64)
    return (digits * weights).sum(-1).clamp(0, vocab_size - 1)


def split_rows(hidden_states: torch.Tensor, hidden_size: int, vocab_size: int):
    """(hidden [N, d], input ids [N]) from forward's rows [N, d + C]."""
    return hidden_states[:, :hidden_size].contiguous(), read_ids(hidden_states[:, hidden_size:], vocab_size)


def mixture_log_probs(logits, log_weights=None, score: str = "") -> torch.Tensor:
    """fp32 [N, V]: log Σ_k w_k softmax(score(z_k)) from the K tables' logits z_k [N, V] and
    the rows' log mixture weights [N, K] (None: one table). score "" or "sigsoftmax"
    (2z − softplus(z) = log(e^z σ(z))). log_softmax in fp32, logaddexp / logsumexp."""
    return mixture_from_logits(list(logits), log_weights, score)


def score_logits(logits: torch.Tensor, score: str = "") -> torch.Tensor:
    """fp32 logits whose softmax is one component's distribution: z, or 2z − softplus(z) for
    sigsoftmax (as `mixture_log_probs` scores each table)."""
    return scored_logits(logits, score)


def mos_log_probs(prior_logits: torch.Tensor, context_logits: torch.Tensor, score: str = "") -> torch.Tensor:
    """fp32 [N, V] of a mixture of softmaxes (head_rule "mos"): prior_logits [N, K] = h W_π,
    context_logits [N, K, V] = tanh(W_k h) Eᵀ; as modeling_onona's head_log_probs."""
    log_prior = torch.log_softmax(prior_logits.float(), dim=-1)
    return torch.logsumexp(log_prior.unsqueeze(-1) + mixture_from_logits([context_logits], None, score), dim=-2)


def draw_components(log_weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[N] int64: k ~ exp(log_weights[n]) per row (inverse CDF in fp64, one uniform per row,
    from `generator`)."""
    w = log_weights.double().exp()
    cdf = torch.cumsum(w / w.sum(-1, keepdim=True), dim=-1)
    u = torch.rand(w.shape[0], 1, generator=generator, dtype=torch.float64, device=w.device)
    return (u >= cdf[:, :-1]).sum(-1)  # the first k with u < cdf_k (the last if rounding left u ≥ all)


def _fix(what: str) -> str:
    return f"serve without one-projection, or drop {what}"


def one_projection_problems(params) -> list[str]:
    """What a request (vLLM `SamplingParams`, or any object with its field names) asks that
    one-projection sampling cannot give exactly; [] for the temperature-1, untruncated,
    unpenalised request without logprobs. Each entry names the setting and the fix.

    One-projection draws k ~ w[x] and then a token from softmax(h T_kᵀ): a sample of the
    mixture itself, nothing else. Temperature ≠ 1 (greedy, i.e. temperature 0, included: the
    argmax of one component is not the mixture's), top-k / top-p / min-p, penalties, masks
    (min_tokens, logit_bias, allowed_token_ids, bad_words, structured output) and watermarks
    act on the mixture's distribution, which this mode never computes; logprobs report it."""
    get = lambda name, default=None: getattr(params, name, default)  # noqa: E731
    problems = []
    if get("temperature", 1.0) != 1.0:
        problems.append(f"temperature={get('temperature')} (one component's logits sample the mixture at 1 only, "
                        "and their argmax is not the mixture's): "
                        + _fix("temperature (or set it to 1)"))
    if get("top_k") not in (None, 0, -1):
        problems.append(f"top_k={get('top_k')}: " + _fix("top_k"))
    if get("top_p") not in (None, 1.0):
        problems.append(f"top_p={get('top_p')}: " + _fix("top_p"))
    if get("min_p") not in (None, 0.0):
        problems.append(f"min_p={get('min_p')}: " + _fix("min_p"))
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if get(name) not in (None, neutral):
            problems.append(f"{name}={get(name)}: " + _fix(name))
    if get("min_tokens") not in (None, 0):
        problems.append(f"min_tokens={get('min_tokens')} (masks the stop tokens): " + _fix("min_tokens"))
    for name in ("logprobs", "prompt_logprobs", "logprob_token_ids", "prompt_logprob_token_ids"):
        if get(name) is not None:
            problems.append(f"{name}={get(name)} (this mode never computes the mixture's log-probs): " + _fix(name))
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "watermarking",
                 "thinking_token_budget"):
        if get(name):
            problems.append(f"{name} is set (it reshapes the distribution): " + _fix(name))
    return problems
