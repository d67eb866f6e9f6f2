"""Export a trained checkpoint as a HF transformers folder.

    python -m onona_jax.export --workdir=DIR --output=OUT [--step=N] [--no_tokenizer] [--mesh=-1,1,1]

Every family (dense, moe, gdn, attnres) with every head (`serve/hf_format.py`):

* Dense **standard** / **untied** -> a plain `Qwen3ForCausalLM` folder, MoE **standard** /
  **untied** -> a plain `Qwen3MoeForCausalLM` folder (standard: tied embeddings, the table
  stored once as `model.embed_tokens.weight`);
* everything else (the twin head and the controls, GDN hybrid, AttnRes) -> `OnonaForCausalLM`: `config.json`
  (model_type "onona", `auto_map` to `configuration_onona.py` and `modeling_onona.py`, which
  are copied into OUT and need transformers alone), the body under Qwen3 names, and for the
  twin head the folded tensors (M = (A+B)/2 as `model.embed_tokens.weight`, A, B, the gate's w
  and its lookup z = wᵀ rmsnorm(M_v) as `twin.gate_logit`).

Each folder also has `model.safetensors` (fp32), `generation_config.json`
(<|endoftext|> = 50256 as bos/eos/pad), the GPT-2 tokenizer (`tokenizer.json`, built offline
from the bundled rank file; it matches `onona_jax.tokenizer.encode` except that it reads the
text "<|endoftext|>" as the special token) and `onona_train_config.json` (the run's config,
which `python -m onona_jax.convert --from_hf=OUT` uses to import it back exactly). Load it with

    transformers.AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    transformers.AutoTokenizer.from_pretrained(OUT)

The vocabulary keeps the model's padded size (50,304): ids 50,257.. never occur in the data
and get (small) probabilities like any other row. Needs `transformers` and `safetensors` (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from onona_jax.tokenizer import EOT, TOKENIZER_VOCAB

WEIGHTS = "model.safetensors"


def check_exportable(cfg_model) -> None:
    from onona_jax.serve import hf_format

    hf_format.check_supported(cfg_model)


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


def export(workdir: str, output: str, step: int | None = None, tokenizer: bool = True,
           mesh=(-1, 1, 1)) -> dict:
    """Export a run's checkpoint (the latest unless `step`); returns a summary dict."""
    from onona_jax import evaluation
    from onona_jax.analysis.gate import checkpoint_config
    from onona_jax.serve import hf_format

    check_exportable(checkpoint_config(workdir, step).model)  # before restoring any array
    _, params, step, cfg = evaluation.load_run(workdir, step, mesh)
    source = dict(workdir=os.path.abspath(workdir), step=int(step), config=cfg.name)

    model_type, files = hf_format.export(params, cfg, output, tokenizer)
    kind = {"qwen3": "hf-qwen3", "qwen3_moe": "hf-qwen3-moe", "onona": "hf-onona"}[model_type]
    return dict(kind=kind, output=os.path.abspath(output), files=sorted(set(files)), **source)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="run directory with checkpoints/")
    ap.add_argument("--output", required=True, help="folder to write")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--no_tokenizer", action="store_true", help="do not write the tokenizer files")
    ap.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes to restore onto")
    args = ap.parse_args(argv)
    try:
        mesh = tuple(int(x) for x in args.mesh.split(","))
        summary = export(args.workdir, args.output, args.step, not args.no_tokenizer, mesh)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    from onona_jax import platform

    platform.initialize()
    from absl import logging as _absl_logging

    _absl_logging.set_verbosity(_absl_logging.ERROR)  # Orbax warns that a read-only manager won't save
    sys.exit(main())
