"""Export a trained checkpoint for PyTorch serving.

    python -m onona_jax.serve.export --workdir=DIR --output=OUT [--step=N] [--notokenizer] [--mesh=-1,1,1]

* Dense **standard** model -> a HF transformers Qwen3ForCausalLM folder:
  `config.json` (`convert.hf_qwen3_config`, tied embeddings), `model.safetensors` (fp32, the
  tied table stored once as `model.embed_tokens.weight`), `generation_config.json`
  (<|endoftext|> = 50256 as bos/eos/pad) and the GPT-2 tokenizer (`tokenizer.json`, built
  offline from the bundled rank file; it matches `onona_jax.tokenizer.encode` except that
  it reads the text "<|endoftext|>" as the special token). Load it with

      transformers.AutoModelForCausalLM.from_pretrained(OUT)
      transformers.AutoTokenizer.from_pretrained(OUT)

  The vocabulary keeps the model's padded size (50,304): ids 50,257.. never occur in the
  data and get (small) probabilities like any other row.

* Dense **twin** (onóna) model -> the folded serving form (SPEC §1), loaded by
  `onona_jax.serve.torch_ref.TwinServing.from_export(OUT)`:
  `model.safetensors` with the body under HF Qwen3 body names (`model.layers.<i>...`,
  `model.norm.weight`) and

      twin.M            [V, d]  (A + B)/2, the input table
      twin.A, twin.B    [V, d]  the two output tables
      twin.g            [V]     the gate σ(wᵀ rmsnorm(M_v)) of every input token
      twin.gate_logit   [V]     z_v with g = σ(z): scoring mixes in log space with
                                logsigmoid(±z), exact where 1 − g would round to 0
      twin.gate.weight  [1, d]  w (provenance; serving needs only the lookups)

  `twin_config.json` (format, the Qwen3 body config, sizes, the source run) and the
  tokenizer files. There is deliberately no `config.json`: a twin export is not a
  Qwen3ForCausalLM, and `AutoModelForCausalLM` must not load it as one.

Other families (moe, gdn, attnres) and other heads have no export: a ValueError says what
is supported. Needs `transformers` and `safetensors` (pip install -e '.[test]').
"""

from __future__ import annotations

import json
import os

import numpy as np

from absl import flags

from onona_jax import cli
from onona_jax.serve import convert
from onona_jax.tokenizer import EOT, TOKENIZER_VOCAB

TWIN_FORMAT = "onona-twin-serving"
TWIN_FORMAT_VERSION = 1
TWIN_CONFIG = "twin_config.json"
WEIGHTS = "model.safetensors"
SUPPORTED = ("dense models with head 'standard' (exported as a HF transformers Qwen3ForCausalLM "
             "folder) or head 'twin' (exported as safetensors serving tensors for "
             "onona_jax.serve.torch_ref.TwinServing)")


def check_exportable(cfg_model) -> None:
    if cfg_model.arch != "dense" or cfg_model.head not in ("standard", "twin"):
        raise ValueError(
            f"cannot export a model with arch={cfg_model.arch!r}, head={cfg_model.head!r}; "
            f"export supports {SUPPORTED}"
        )


def _max_positions(cfg) -> int:
    return max(1024, int(cfg.data.seq_len))


def _save_safetensors(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
    from safetensors.numpy import save_file

    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt", **(metadata or {})})


def write_tokenizer(output: str, max_length: int = 1024) -> list[str]:
    """The GPT-2 BPE as a HF fast tokenizer (tokenizer.json + tokenizer_config.json), built
    offline from the bundled rank file; returns the files written."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from onona_jax import tokenizer

    backend = TikTokenConverter(
        vocab_file=tokenizer.ranks_path(), pattern=tokenizer.GPT2_PAT_STR,
        extra_special_tokens={"<|endoftext|>": EOT},
    ).converted()
    if backend.get_vocab_size() != TOKENIZER_VOCAB:
        raise ValueError(f"converted tokenizer has {backend.get_vocab_size()} entries, expected {TOKENIZER_VOCAB}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=max_length,
        add_prefix_space=False,
    )
    files = list(fast.save_pretrained(output))
    # transformers 5 records its new class name; the older alias loads in 4.x and 5.x alike.
    config_path = os.path.join(output, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(tok_config, f, indent=2)
    return files


def export_standard(params, cfg, output: str, tokenizer: bool = True) -> list[str]:
    """A tied Qwen3ForCausalLM folder at `output`; returns the files written."""
    from transformers import GenerationConfig

    m = cfg.model
    hf = convert.hf_qwen3_config(m, max_position_embeddings=_max_positions(cfg))
    hf.architectures = ["Qwen3ForCausalLM"]
    hf.bos_token_id = hf.eos_token_id = hf.pad_token_id = EOT
    hf.use_cache = True  # generation; logits do not depend on it
    hf.dtype = "float32"
    os.makedirs(output, exist_ok=True)
    hf.save_pretrained(output)
    state = convert.to_hf_state_dict(params, m)
    assert "lm_head.weight" not in state  # tied: the head is model.embed_tokens.weight
    _save_safetensors(state, os.path.join(output, WEIGHTS))
    GenerationConfig(bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT).save_pretrained(output)
    files = ["config.json", WEIGHTS, "generation_config.json"]
    if tokenizer:
        files += [os.path.basename(f) for f in write_tokenizer(output, int(cfg.data.seq_len))]
    return files


def twin_serving_tensors(params, cfg_model) -> dict[str, np.ndarray]:
    """{name: fp32 array}: the body under HF names and the folded twin tensors (see module doc)."""
    import jax
    import jax.numpy as jnp

    from onona_jax import heads

    state = convert.to_hf_state_dict(params, cfg_model)
    A, B = state.pop("twin.A"), state.pop("twin.B")
    w = state.pop("twin.gate.weight")
    M = (A + B) * np.float32(0.5)  # bitwise TwinHead.merged(): fp32 add, exact halving
    with jax.default_matmul_precision("highest"):
        z = np.asarray(heads.gate_logit(jnp.asarray(M), jnp.asarray(w[0])), np.float32)
        g = np.asarray(jax.nn.sigmoid(jnp.asarray(z)), np.float32)
    return {**state, "twin.M": M, "twin.A": A, "twin.B": B, "twin.g": g, "twin.gate_logit": z,
            "twin.gate.weight": w}


def export_twin(params, cfg, output: str, tokenizer: bool = True, source: dict | None = None) -> list[str]:
    """The twin serving folder at `output`; returns the files written."""
    m = cfg.model
    hf = convert.hf_qwen3_config(m, max_position_embeddings=_max_positions(cfg))
    hf.bos_token_id = hf.eos_token_id = hf.pad_token_id = EOT
    os.makedirs(output, exist_ok=True)
    _save_safetensors(twin_serving_tensors(params, m), os.path.join(output, WEIGHTS),
                      metadata={"onona_format": TWIN_FORMAT})
    meta = dict(
        format=TWIN_FORMAT, format_version=TWIN_FORMAT_VERSION,
        vocab_size=int(m.vocab_size), tokenizer_vocab=TOKENIZER_VOCAB, eot_token_id=EOT,
        d_model=int(m.d_model), n_layers=int(m.n_layers),
        qwen3=hf.to_dict(),  # the body: transformers.Qwen3Config(**qwen3)
        tensors={
            "model.*": "the decoder body, HF transformers Qwen3Model names (its embed_tokens is unused: "
                       "the body reads twin.M through inputs_embeds)",
            "twin.M": "[V, d] (A + B)/2, the input table",
            "twin.A": "[V, d] output table A",
            "twin.B": "[V, d] output table B",
            "twin.g": "[V] gate of each input token, sigma(w . rmsnorm(M_v)); g weighs softmax(A h)",
            "twin.gate_logit": "[V] z_v, g = sigmoid(z); log p = logaddexp(log_softmax(A h) + logsigmoid(z), "
                               "log_softmax(B h) + logsigmoid(-z))",
            "twin.gate.weight": "[1, d] the gate's w (nn.Linear(d, 1, bias=False))",
        },
        source=source or {},
    )
    with open(os.path.join(output, TWIN_CONFIG), "w") as f:
        json.dump(meta, f, indent=2)
    files = [WEIGHTS, TWIN_CONFIG]
    if tokenizer:
        files += [os.path.basename(f) for f in write_tokenizer(output, int(cfg.data.seq_len))]
    return files


def export(workdir: str, output: str, step: int | None = None, tokenizer: bool = True,
           mesh=(-1, 1, 1)) -> dict:
    """Export a run's checkpoint (the latest unless `step`); returns a summary dict."""
    from onona_jax.checkpoint import restore_params, saved_config

    check_exportable(saved_config(workdir, step).model)  # before restoring any array
    params, step, cfg, _ = restore_params(workdir, step, mesh)
    source = dict(workdir=os.path.abspath(workdir), step=int(step), config=cfg.name)
    if cfg.model.head == "standard":
        files = export_standard(params, cfg, output, tokenizer)
        kind = "hf-qwen3"
    else:
        files = export_twin(params, cfg, output, tokenizer, source)
        kind = TWIN_FORMAT
    with open(os.path.join(output, "onona_train_config.json"), "w") as f:
        f.write(cfg.to_json(indent=2))
    files.append("onona_train_config.json")
    return dict(kind=kind, output=os.path.abspath(output), files=sorted(set(files)), **source)


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory with checkpoints/", flag_values=fv, required=True)
    flags.DEFINE_string("output", None, "folder to write", flag_values=fv, required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)
    flags.DEFINE_bool("tokenizer", True, "write the tokenizer files (--notokenizer: do not)", flag_values=fv)
    cli.define_mesh(fv)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    print(json.dumps(export(fv.workdir, fv.output, fv.step, fv.tokenizer, cli.mesh(fv)), indent=2))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
