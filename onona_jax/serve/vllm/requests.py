"""`OneProjectionRequests`: the admission check of one-projection mode, as a vLLM (V1) logits
processor. It changes no logits; its `validate_params` refuses, when a request arrives
(HTTP 400 from `vllm serve`, an error from `LLM.generate`), every request that mode cannot
sample exactly (`head.one_projection_problems`). Register it only for an engine that serves
an export in one-projection mode: it refuses those requests whatever the model."""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from onona_jax.serve.vllm.head import one_projection_problems

FQCN = "onona_jax.serve.vllm:OneProjectionRequests"


class OneProjectionRequests(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        problems = one_projection_problems(sampling_params)
        if problems:
            raise ValueError("this model serves in one-projection mode, an exact sample of the mixture at "
                             "temperature 1 with no truncation, penalty or logprobs; the request has "
                             + "; ".join(problems))

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        pass  # no per-request state: admission is the whole job

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True  # (so vLLM may skip it for greedy rows; there are none in this mode)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
