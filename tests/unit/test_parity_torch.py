"""The JAX model against PyTorch: HF Qwen3ForCausalLM (standard) and the reference
`torch_ref.TwinQwen3` (twin), both loaded with our weights through the one HF format
(`serve.hf_format`); and its round trip."""

import os

import jax
import numpy as np
import pytest
import torch

from onona_jax import config
from onona_jax.serve import hf_format
from onona_jax import models as model
from onona_jax.config import ffn_width
from reference.torch_ref import TwinQwen3, hf_qwen3_config, state_dict_from_jax

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    return state_dict_from_jax(params, m)


@pytest.mark.parametrize("shape", SHAPES)
def test_standard_matches_hf_qwen3(shape):
    from transformers import Qwen3ForCausalLM

    overrides, T = SHAPES[shape]
    m = _cfg("standard", **overrides)
    graphdef, params = _params(m)
    tokens = _tokens(m, T)
    ours = np.asarray(model.bind(graphdef, params)(tokens))

    hf = Qwen3ForCausalLM(hf_qwen3_config(m)).eval()
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
    sd = hf_format.to_hf(params, m)
    # the body's input table is stored for both (twin: the folded M), never an lm_head
    assert "model.embed_tokens.weight" in sd and "lm_head.weight" not in sd
    assert ("head.log_weights" in sd) == (head == "twin")  # the twin's gate lookup, derived
    _assert_trees_equal(hf_format.from_hf(sd, m), params)
    # torch tensors in, too; and the other layout: layer i of the stack is layer i.
    other = _cfg(head, scan_layers=not scan)
    flipped = hf_format.from_hf({k: torch.from_numpy(v) for k, v in sd.items()}, other)
    back = hf_format.to_hf(flipped, other)
    assert sorted(back) == sorted(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)


def test_converter_names_bad_keys_and_shapes():
    m = _cfg("twin")
    sd = hf_format.to_hf(_params(m)[1], m)
    with pytest.raises(ValueError, match=r"checkpoint lacks 'twin.B', which a dense-twin model needs"):
        hf_format.from_hf({k: v for k, v in sd.items() if k != "twin.B"}, m)
    with pytest.raises(ValueError, match=r"twin.gate.weight: \(64,\) != \(1, 64\)"):
        hf_format.from_hf({**sd, "twin.gate.weight": sd["twin.gate.weight"][0]}, m)


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
    hf = Qwen3ForCausalLM(hf_qwen3_config(m)).eval()
    hf.load_state_dict(_torch_sd(params, m), strict=False)
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
