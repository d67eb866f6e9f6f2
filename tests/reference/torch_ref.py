"""PyTorch reference of onóna: the paper's Figure 2 transcribed literally, on an HF Qwen3 body.

The parity tests (and benchmarks/peer.py) hold the JAX model to this. Keep `TwinTables` as
the paper wrote it. Imports torch and transformers; weights come through the package's one HF
format (`onona_jax.serve.hf_format`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onona_jax.serve import hf_format


def hf_qwen3_config(cfg_model, max_position_embeddings: int = 1024):
    """The `transformers.Qwen3Config` of our dense body (tied, bias-free, eager attention).

    transformers 5.x spells RoPE as `rope_parameters={"rope_type", "rope_theta"}`."""
    import transformers

    m = cfg_model
    return transformers.Qwen3Config(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_act="silu",
        rms_norm_eps=m.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, attention_bias=False,
        attention_dropout=0.0, use_sliding_window=False, use_cache=False, attn_implementation="eager",
    )


def state_dict_from_jax(params, cfg_model) -> dict:
    """Our parameter tree as torch tensors under the HF names (`hf_format.to_hf`)."""
    return {k: torch.from_numpy(v) for k, v in hf_format.to_hf(params, cfg_model).items()}


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

        self.model = Qwen3Model(hf_qwen3_config(cfg_model))
        # The body reads M = (A+B)/2 through `inputs_embeds`; its own table would be dead
        # weight (the export's folded M is not loaded).
        self.model.embed_tokens = None
        self.twin = TwinTables(cfg_model.vocab_size, cfg_model.d_model)

    def forward(self, ids):
        x0 = self.twin.embed(ids)
        h = self.model(inputs_embeds=x0).last_hidden_state
        return self.twin.log_probs(h, x0)

    @torch.no_grad()
    def load_from_jax(self, params, cfg_model):
        sd = state_dict_from_jax(params, cfg_model)
        sd["twin.w.weight"] = sd.pop("twin.gate.weight")  # Figure 2 calls the gate Linear `w`
        # the parameters alone: the export's folded tensors (M, the gate lookup) are derived
        sd = {k: v for k, v in sd.items() if k not in (hf_format.INPUT, hf_format.LOG_WEIGHTS)}
        self.load_state_dict(sd, strict=True)
        return self


class TwinServing(nn.Module):
    """The serving form of a twin model, from `python -m onona_jax.serve.export` (SPEC §1, Serving).

    M = (A+B)/2 is folded once and the gate is a lookup over input tokens: g = σ(z) with
    z_v = wᵀ rmsnorm(M_v), exported as its log weights (logσ(z), logσ(−z)) for every v. Scoring (exact) needs both projections:

        x0 = M[ids];  h = Qwen3Model(inputs_embeds=x0)
        log p = logaddexp(log_softmax(hAᵀ) + logσ(z[ids]), log_softmax(hBᵀ) + logσ(−z[ids]))

    (logσ(z) = log g and logσ(−z) = log(1 − g), computed without rounding 1 − g.)
    Sampling at temperature 1 without truncation is exact with one projection
    (`sample_next`)."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers import Qwen3Config, Qwen3Model

        self.config = config
        self.model = Qwen3Model(Qwen3Config(**config["qwen3"]))
        self.model.embed_tokens = None  # the body reads M through inputs_embeds
        V, d = int(config["vocab_size"]), int(config["d_model"])
        for name in ("M", "A", "B"):
            self.register_buffer(name, torch.zeros(V, d))
        self.register_buffer("g", torch.zeros(V))
        self.register_buffer("gate_logit", torch.zeros(V))

    @classmethod
    @torch.no_grad()
    def from_export(cls, path, device="cpu"):
        """Load a dense twin export folder (`python -m onona_jax.serve.export`: config.json with
        model_type "onona" + model.safetensors) into the folded serving form."""
        import json
        import os

        from safetensors.torch import load_file
        from transformers import Qwen3Config

        cfg_path = os.path.join(path, "config.json")
        config = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
        if (config.get("model_type"), config.get("family"), config.get("head")) != ("onona", "dense", "twin"):
            raise ValueError(f"{path} is not a dense twin export (config.json with model_type 'onona', "
                             f"family 'dense', head 'twin'); make one with "
                             f"`python -m onona_jax.serve.export --workdir=<twin run> --output={path}`")
        qwen3 = {k: config[k] for k in Qwen3Config.__dataclass_fields__ if k in config and k != "model_type"}
        qwen3.update(layer_types=None, tie_word_embeddings=False)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        module = cls({"qwen3": qwen3, "vocab_size": config["vocab_size"], "d_model": config["hidden_size"]})
        body = {k[len("model."):]: v for k, v in tensors.items()
                if k.startswith("model.") and k != "model.embed_tokens.weight"}
        module.model.load_state_dict(body, strict=True)
        for name, key in (("M", "model.embed_tokens.weight"), ("A", "twin.A"), ("B", "twin.B")):
            getattr(module, name).copy_(tensors[key])
        lw = tensors["head.log_weights"]  # [V, 2]: logσ(z), logσ(−z)
        module.gate_logit.copy_(lw[:, 0] - lw[:, 1])  # logσ(z) − logσ(−z) = z
        module.g.copy_(lw[:, 0].exp())
        return module.to(device).eval()

    def hidden(self, ids):
        return self.model(inputs_embeds=F.embedding(ids, self.M)).last_hidden_state

    def forward(self, ids):
        """fp32 log-probabilities of the next token, [B, T, V]."""
        h = self.hidden(ids)
        la = F.log_softmax((h @ self.A.T).float(), -1)
        lb = F.log_softmax((h @ self.B.T).float(), -1)
        z = self.gate_logit[ids].float().unsqueeze(-1)
        return torch.logaddexp(la + F.logsigmoid(z), lb + F.logsigmoid(-z))

    @torch.no_grad()
    def score(self, ids):
        """log p(ids[:, t+1] | ids[:, :t+1]) for t < T−1, fp32 [B, T−1]."""
        ids = torch.as_tensor(ids).long()
        lp = self(ids[:, :-1])
        return lp.gather(-1, ids[:, 1:, None])[..., 0]

    @torch.no_grad()
    def score_text(self, text: str, prepend_eot: bool = True) -> dict:
        """Token ids of `text` (GPT-2 BPE), each one's log-probability given the text before it
        (the first conditioned on <|endoftext|>, as at a document start in training), and the sum."""
        from onona_jax.tokenizer import EOT, encode

        ids = ([EOT] if prepend_eot else []) + encode(text)
        if len(ids) < 2:
            raise ValueError("need at least two tokens to score (or prepend_eot=True)")
        lp = self.score(torch.tensor([ids], device=self.M.device))[0]
        scored = ids[1:]
        return {"ids": scored, "log_probs": lp.tolist(), "total": float(lp.sum())}

    @torch.no_grad()
    def sample_next(self, ids, generator=None):
        """One next token per row at temperature 1 with one projection: c ~ Bernoulli(g[x_t]),
        then sample from softmax(Ah_t) if c else softmax(Bh_t). [B, T] -> [B]."""
        ids = torch.as_tensor(ids).long()
        h = self.hidden(ids)[:, -1]
        last = ids[:, -1]
        use_a = torch.rand(last.shape, generator=generator, device=h.device) < self.g[last]
        logits = torch.empty(h.shape[0], self.A.shape[0], device=h.device)
        for mask, table in ((use_a, self.A), (~use_a, self.B)):  # each row: one projection
            if mask.any():
                logits[mask] = (h[mask] @ table.T).float()
        return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)[:, 0]
