"""The JAX model against PyTorch: HF Qwen3ForCausalLM (standard) and torch_ref.TwinQwen3
(twin), both loaded with our weights through `convert`; and the converter's round trip."""

import os

import jax
import numpy as np
import pytest
import torch

from onona_jax import config
from onona_jax.serve import convert
from onona_jax import models as model
from onona_jax.config import ffn_width
from onona_jax.serve.torch_ref import TwinQwen3

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(REPO, "configs", "paper.py")


def _cfg(head, **overrides):
    cfg = config.load(f"{PAPER}:dense-tiny-{head}")
    cfg.model.dtype = "float32"
    cfg.model.update(overrides)
    return config.validate(cfg).model


# (a) tiny: GQA 2, scanned; (b) GQA 3, 3 layers, unscanned.
SHAPES = {
    "tiny": (dict(), 37),
    "gqa3": (dict(d_model=96, n_heads=6, n_kv_heads=2, head_dim=16, n_layers=3,
                  d_ff=ffn_width(96), scan_layers=False), 50),
}


def _params(m, seed=0):
    """Initialised params plus N(0, 0.1²) noise on every leaf, so norm weights are not all
    ones and the tables give logits of order one: a misplaced weight cannot go unnoticed."""
    graphdef, params = model.init(m, seed)
    leaves, treedef = jax.tree.flatten(params)
    r = np.random.default_rng(seed)
    leaves = [x + 0.1 * r.standard_normal(x.shape, np.float32) for x in leaves]
    return graphdef, jax.tree.unflatten(treedef, leaves)


def _tokens(m, T, seed=0):
    return np.random.default_rng(seed).integers(0, m.vocab_size, (2, T))


def _torch_sd(params, m):
    return {k: torch.from_numpy(v) for k, v in convert.to_hf_state_dict(params, m).items()}


@pytest.mark.parametrize("shape", SHAPES)
def test_standard_matches_hf_qwen3(shape):
    from transformers import Qwen3ForCausalLM

    overrides, T = SHAPES[shape]
    m = _cfg("standard", **overrides)
    graphdef, params = _params(m)
    tokens = _tokens(m, T)
    ours = np.asarray(model.bind(graphdef, params)(tokens))

    hf = Qwen3ForCausalLM(convert.hf_qwen3_config(m)).eval()
    missing, unexpected = hf.load_state_dict(_torch_sd(params, m), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: lm_head is embed_tokens
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_twin_matches_torch_reference():
    m = _cfg("twin")
    graphdef, params = _params(m)
    tokens = _tokens(m, 37)
    ours = np.asarray(model.bind(graphdef, params)(tokens))

    ref = TwinQwen3(m).load_from_jax(params, m).eval()
    with torch.no_grad():
        theirs = ref(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("head", ["standard", "twin"])
@pytest.mark.parametrize("scan", [True, False])
def test_converter_round_trip_is_exact(head, scan):
    m = _cfg(head, scan_layers=scan)
    _, params = _params(m)
    sd = convert.to_hf_state_dict(params, m)
    assert ("model.embed_tokens.weight" in sd) == (head == "standard")
    assert "lm_head.weight" not in sd
    _assert_trees_equal(convert.from_hf_state_dict(sd, m), params)
    # torch tensors in, too; and the other layout: layer i of the stack is layer i.
    other = _cfg(head, scan_layers=not scan)
    flipped = convert.from_hf_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, other)
    _assert_trees_equal(convert.to_hf_state_dict(flipped, other), sd)


def test_converter_names_bad_keys_and_shapes():
    m = _cfg("twin")
    sd = convert.to_hf_state_dict(_params(m)[1], m)
    broken = {k: v for k, v in sd.items() if k != "twin.B"} | {"lm_head.weight": sd["twin.A"]}
    with pytest.raises(ValueError, match=r"missing \['twin.B'\].*unexpected \['lm_head.weight'\]"):
        convert.from_hf_state_dict(broken, m)
    with pytest.raises(ValueError, match=r"twin.gate.weight: \(64,\) != \(1, 64\)"):
        convert.from_hf_state_dict({**sd, "twin.gate.weight": sd["twin.gate.weight"][0]}, m)


def test_splash_attention_model_matches_hf_qwen3():
    """The whole standard model with `model.attention_impl="splash"` (the Pallas TPU kernel in
    interpret mode on this CPU; 50 tokens padded to one block of 128) against HF Qwen3, as the
    XLA path above."""
    from transformers import Qwen3ForCausalLM

    overrides, T = SHAPES["gqa3"]
    m = _cfg("standard", attention_impl="splash", **overrides)
    graphdef, params = _params(m)
    tokens = _tokens(m, T)
    ours = np.asarray(model.bind(graphdef, params)(tokens))
    hf = Qwen3ForCausalLM(convert.hf_qwen3_config(m)).eval()
    hf.load_state_dict(_torch_sd(params, m), strict=False)
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
