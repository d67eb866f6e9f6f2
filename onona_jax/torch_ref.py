"""PyTorch reference of onóna: the paper's Figure 2 transcribed literally, on an HF Qwen3 body.

The parity tests hold the JAX model to this. Keep `TwinTables` as the paper wrote it.
Imports torch and transformers: only tests and converters use this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onona_jax import convert


class TwinTables(nn.Module):
    """Figure 2 of the paper."""

    def __init__(self, V, d, std=0.02):
        super().__init__()
        self.A = nn.Parameter(std * torch.randn(V, d))
        self.B = nn.Parameter(std * torch.randn(V, d))
        self.w = nn.Linear(d, 1, bias=False)

    def merged(self):
        return 0.5 * (self.A + self.B)

    def embed(self, ids):
        return F.embedding(ids, self.merged())

    def gate_logit(self, x0):
        return self.w(F.rms_norm(x0, x0.shape[-1:]))

    def log_probs(self, h, x0):
        z = self.gate_logit(x0).float()
        la = (h @ self.A.T).float()
        lb = (h @ self.B.T).float()
        la = F.log_softmax(la, -1)
        lb = F.log_softmax(lb, -1)
        return torch.logaddexp(la + F.logsigmoid(z), lb + F.logsigmoid(-z))


class TwinQwen3(nn.Module):
    """x0 = twin.embed(ids); h = body(x0) (Qwen3Model, final norm included); twin.log_probs."""

    def __init__(self, cfg_model):
        super().__init__()
        from transformers import Qwen3Model

        self.model = Qwen3Model(convert.hf_qwen3_config(cfg_model))
        # The body reads M = (A+B)/2 through `inputs_embeds`; its own table would be dead
        # weight (and is absent from the converter's twin state dict).
        self.model.embed_tokens = None
        self.twin = TwinTables(cfg_model.vocab_size, cfg_model.d_model)

    def forward(self, ids):
        x0 = self.twin.embed(ids)
        h = self.model(inputs_embeds=x0).last_hidden_state
        return self.twin.log_probs(h, x0)

    @torch.no_grad()
    def load_from_jax(self, params, cfg_model):
        sd = convert.to_hf_state_dict(params, cfg_model)
        sd = {k: torch.from_numpy(v) for k, v in sd.items()}
        sd["twin.w.weight"] = sd.pop("twin.gate.weight")  # Figure 2 calls the gate Linear `w`
        self.load_state_dict(sd, strict=True)
        return self
