"""Adding a decoder family without touching the package: a test-only family, written here and
registered through `models.register` (the worked example of docs/extending.md, "Adding a decoder
family").

`parallel`: GPT-J/PaLM-style parallel blocks whose attention and SwiGLU outputs are mixed by a
learned per-token gate,

    h = norm(x);   g = σ(w · h);   x ← x + g · attn(h) + (1 − g) · mlp(h)

with w ∈ R^d per layer, initialised by the family's own initialiser (`parallel_mix`). Its
`Family` record declares what the summary needs: the row of every parameter (`components`)
and the gate's dot as extra FLOPs (`extra_flops`). Forgetting a row is one error at config
validation, before anything is written.

Export (`serve/hf_format.py`) reads the family's Hugging Face mapping from its record
(`Family.hf`, a `models.hf_map.HFMap`): its parameters' HF names and the HF body that runs
them. The bodies are the torch code in `serve/hf/modeling_onona.py` (dense, moe, gdn,
attnres), which every export carries and which imports nothing of onona_jax, so a family
file cannot bring a body of its own: `parallel`'s gated mix is in none of them and its
record declares no mapping (export refuses it, before anything is written). `sequential`,
the second example here, is a plain pre-norm block under its own parameter names,

    x ← x + attn(norm(x));   x ← x + mlp(norm(x))

which is the dense body's math: its record maps its names onto that body's, and the export
loads through transformers with the JAX model's log-probabilities.
"""

import dataclasses
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_steps, tiny_config
from onona_jax import config, summary
from onona_jax import models
from onona_jax import params as params_lib
from onona_jax import train as trainer
from onona_jax.layers import MLP, Attention, RMSNorm
from onona_jax.models import dense, hf_map
from onona_jax.params import ParamGroup, param

MIX_STD = 0.1


class ParallelLayer(nnx.Module):
    def __init__(self, cfg):
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.mix = param((cfg.d_model,), ("norm",), "parallel_mix")

    def __call__(self, x, positions):
        h = self.norm(x)
        g = jax.nn.sigmoid(jnp.einsum("btd,d->bt", h.astype(jnp.float32), self.mix[...]))[..., None]
        return x + (g * self.attn(h, positions) + (1 - g) * self.mlp(h)).astype(x.dtype)


class ParallelTrunk(nnx.Module):
    """trunk(x, positions) -> (final-normed h, statistics): what `models.Model` calls."""

    def __init__(self, cfg):
        self.layers = nnx.List([ParallelLayer(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def __call__(self, x, positions):
        for layer in self.layers:
            x = layer(x, positions)
        return self.final_norm(x), {}


PARALLEL = models.Family(
    trunk=ParallelTrunk,
    # Paths as `params.path_str` writes them (layer indices dropped); each matches exactly one.
    components=(
        ParamGroup("attention", ("trunk/layers/attn/[qkvo]",)),
        ParamGroup("mlp", ("trunk/layers/mlp/*",)),
        ParamGroup("norms", ("*norm/weight",), matmul=False),  # QK-norms, pre-norms, final norm
        ParamGroup("mixing", ("trunk/layers/mix",), matmul=False),  # a dot, counted in extra_flops
    ),
    extra_flops=lambda m, seq_len: {"parallel_mix": 2 * m.d_model * m.n_layers},
    initializers={"parallel_mix": lambda key, shape: MIX_STD * jax.random.normal(key, shape, jnp.float32)},
)


class SequentialLayer(nnx.Module):
    def __init__(self, cfg):
        self.mixer_norm, self.mixer = RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.d_model, cfg.norm_eps), MLP(cfg)

    def __call__(self, x, positions):
        x = x + self.mixer(self.mixer_norm(x), positions)
        return x + self.ffn(self.ffn_norm(x))


class SequentialTrunk(ParallelTrunk):
    def __init__(self, cfg):
        self.layers = nnx.List([SequentialLayer(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)


SEQUENTIAL = models.Family(
    trunk=SequentialTrunk,
    components=(
        ParamGroup("attention", ("trunk/layers/mixer/[qkvo]",)),
        ParamGroup("mlp", ("trunk/layers/ffn/*",)),
        ParamGroup("norms", ("*norm/weight",), matmul=False),
    ),
    # Each of our sub-trees as the dense body's (Qwen3's) tensors: the shared attention, SwiGLU
    # and norm parts (`dense.HF_LAYER`, entries of hf_map.Entry) under this family's names.
    hf=hf_map.HFMap("dense", trunk=dense.HF_TRUNK, layer={
        "mixer_norm": dense.HF_LAYER["attn_norm"], "mixer": dense.HF_LAYER["attn"],
        "ffn_norm": dense.HF_LAYER["mlp_norm"], "ffn": dense.HF_LAYER["mlp"]}),
)


@pytest.fixture(scope="module", autouse=True)
def registered():
    """`parallel`, and variants that misdeclare its rows, registered for this module only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "FAMILIES", dict(models.FAMILIES))
        mp.setattr(params_lib, "INITIALIZERS", dict(params_lib.INITIALIZERS))
        models.register("parallel", PARALLEL)
        models.register("sequential", SEQUENTIAL)
        models.register("parallel_forgot", dataclasses.replace(PARALLEL, components=PARALLEL.components[:-1]))
        models.register("parallel_twice", dataclasses.replace(
            PARALLEL, components=PARALLEL.components + (ParamGroup("gates", ("*/mix",), matmul=False),)))
        yield


def _cfg(data_dir, arch="parallel"):
    """conftest's tiny model (d 64, 2 layers, 8 heads of 8, KV 4, d_ff 192, twin head) as
    `arch`, batch 4 × 32 tokens on one device."""
    cfg = tiny_config(data_dir, global_batch=4, micro_batch=0)
    cfg.name, cfg.model.arch = f"{arch}-tiny-twin", arch
    cfg.mesh.data = 1
    return cfg


def test_parameter_counts_and_flops_come_from_the_declaration(tiny_data):
    m = config.validate(_cfg(tiny_data)).model
    counts = summary.param_counts(m)
    # per layer: attention q 64·8·8 + k, v 64·4·8 each + o 8·8·64 = 12,288; SwiGLU 3·64·192 =
    # 36,864; norms: pre-norm 64 + QK-norms 2·8; mix 64. Then the final norm 64.
    assert summary.components(m) == ("tables", "gate", "head", "attention", "mlp", "norms", "mixing")
    assert counts["attention"] == 2 * 12_288
    assert counts["mlp"] == 2 * 36_864
    assert counts["norms"] == 2 * (64 + 16) + 64
    assert counts["mixing"] == 2 * 64
    assert counts["tables"] == 2 * 50_304 * 64 and counts["gate"] == 64 and counts["head"] == 0
    assert counts["total"] == 6_537_632
    assert counts["non_embedding"] == counts["active"] == 98_720
    f = summary.flops_per_token(m, 32)
    # body 2·(24,576 + 73,728); head 2·(2·50,304·64 + 64); causal scores 4·32·8·8·2 / 2;
    # the gates' dots 2·64·2.
    assert f["body_matmul"] == 196_608 and f["head"] == 12_877_952 and f["attention_scores"] == 8_192
    assert f["extra"] == f["parallel_mix"] == 256
    assert f["forward"] == 196_608 + 12_877_952 + 8_192 + 256 == f["train"] / 3


def _initial_mix(cfg, layer: int):
    """Layer `layer`'s gate as `params.init_value` derives it: the family's initialiser of the
    key fold_in(fold_in(seed key, crc32(path)), layer index)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), zlib.crc32(b"trunk/layers/mix")), layer)
    return MIX_STD * jax.random.normal(key, (cfg.model.d_model,), jnp.float32)


def test_the_family_initialiser_is_used(tiny_data):
    """`params.init_value` (what `models.init` jits over the tree) of each layer's gate."""
    cfg = config.validate(_cfg(tiny_data))
    _, state = models.abstract(cfg.model)
    mixes = [(path, var) for path, var in params_lib.flat_variables(state) if path[-1] == "mix"]
    assert [path for path, _ in mixes] == [("trunk", "layers", i, "mix") for i in range(cfg.model.n_layers)]
    for (path, var), i in zip(mixes, range(cfg.model.n_layers)):
        value = params_lib.init_value(jax.random.key(cfg.seed), path, var)
        np.testing.assert_array_equal(value, _initial_mix(cfg, i))
        assert float(np.std(value)) > 0.05  # not `normal`'s std 0.02


def test_the_family_trains(tiny_data):
    cfg = config.validate(_cfg(tiny_data))
    losses, state, _ = run_steps(cfg, 3, jax.devices()[:1])
    assert losses[0] == pytest.approx(np.log(50304), abs=0.5)
    assert np.all(np.isfinite(losses)) and losses[2] < losses[0], losses
    mix = np.asarray(jax.device_get(state["params"]["trunk"]["layers"][0]["mix"]))
    assert np.abs(mix - _initial_mix(cfg, 0)).max() > 1e-4  # the gate learns


@pytest.mark.parametrize("arch,problem", [
    ("parallel_forgot", "parameter 'trunk/layers/mix' of model.arch='parallel_forgot' is in none of its "
                        "family's components; declare it in the family's components"),
    ("parallel_twice", "parameter 'trunk/layers/mix' of model.arch='parallel_twice' matches 2 of its family's "
                       "components (mixing, gates); narrow their globs"),
], ids=["forgot", "twice"])
def test_an_undeclared_parameter_fails_validation_before_any_write(tiny_data, tmp_path, arch, problem):
    cfg = _cfg(tiny_data, arch)
    with pytest.raises(ValueError, match=re.escape(problem)):
        config.validate(cfg)
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(problem)):
        trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    assert not workdir.exists()


def test_a_family_without_an_hf_body_is_refused_before_any_write(tiny_data, tmp_path):
    from onona_jax.serve import hf_format

    cfg = config.validate(_cfg(tiny_data))
    _, params = models.init(cfg.model, 0)
    with pytest.raises(ValueError, match=re.escape("cannot export a model with arch='parallel', head='twin'; "
                                                   "export supports families dense, moe, gdn, attnres, sequential")):
        hf_format.export(params, cfg, str(tmp_path / "hf"), tokenizer=False)
    assert not os.listdir(tmp_path)


def test_the_family_exports_and_loads_through_transformers(tiny_data, tmp_path):
    """Noisy parameters (logits of order one, so a misplaced weight shows), exported, loaded
    with `AutoModelForCausalLM.from_pretrained(trust_remote_code=True)`: the JAX model's
    log-probabilities to 1e-4 (fp32 on both sides, summation order apart), and read back
    bit-exactly (`hf_format.from_hf`, import's reader)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from onona_jax.serve import hf_format

    cfg = _cfg(tiny_data, "sequential")
    cfg.model.scan_layers = False  # the trunk keeps a list of layers: hf_format reads the layout from this key
    cfg = config.validate(cfg)
    graphdef, params = models.init(cfg.model, 0)
    leaves, treedef = jax.tree.flatten(params)
    r = np.random.default_rng(0)
    params = jax.tree.unflatten(treedef, [x + 0.1 * r.standard_normal(x.shape, np.float32) for x in leaves])
    out = str(tmp_path / "hf")
    kind, _ = hf_format.export(params, cfg, out, tokenizer=False)
    assert kind == "onona" and hf_format.read_config(out)["family"] == "dense"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == "OnonaForCausalLM"

    tokens = np.random.default_rng(1).integers(0, 50257, (2, 21))
    ours = np.asarray(models.bind(graphdef, params)(tokens))
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.from_numpy(tokens)).logits.float(), -1).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)

    back = hf_format.from_hf(hf_format.read_weights(out), cfg.model)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
