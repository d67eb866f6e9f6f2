"""Export a trained checkpoint as a HF transformers folder.

    python -m onona_jax.serve.export --workdir=DIR --output=OUT [--step=N] [--notokenizer] [--overwrite] [--mesh=-1,1,1]

Every family (dense, moe, gdn, attnres) with every registered head (`serve/hf_format.py`):

* Dense **standard** / **untied** -> a plain `Qwen3ForCausalLM` folder, MoE **standard** /
  **untied** -> a plain `Qwen3MoeForCausalLM` folder (standard: tied embeddings, the table
  stored once as `model.embed_tokens.weight`);
* everything else (the twin head and the controls, GDN hybrid, AttnRes) -> `OnonaForCausalLM`: `config.json`
  (model_type "onona", `auto_map` to `configuration_onona.py` and `modeling_onona.py`, which
  are copied into OUT and need transformers alone), the body under Qwen3 names, the head's
  parameters and its fold (`Head.fold`; twin: M = (A+B)/2 as `model.embed_tokens.weight`, A,
  B, the gate's w, and its lookup logσ(±z), z = wᵀ rmsnorm(M_v), as `head.log_weights`),
  described in config.json so the modeling file serves any number of tables.

Each folder also has `model.safetensors` (fp32), `generation_config.json` (the run's
end-of-document token as bos/eos/pad: GPT-2's <|endoftext|> = 50256 by default), the run's
tokenizer (data.tokenizer, `hf_format.write_tokenizer`: GPT-2's and a tiktoken rank file
converted to `tokenizer.json` offline, a HF tokenizer's `tokenizer.json` copied as it is; each
matches the run's `Tokenizer.encode` except that it reads special-token text such as
"<|endoftext|>" as the special token) and `onona_train_config.json` (the run's config,
which `python -m onona_jax.train.import_hf --from_hf=OUT` uses to import it back exactly). Load it with

    transformers.AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    transformers.AutoTokenizer.from_pretrained(OUT)

The vocabulary keeps the model's padded size (config.json's vocab_size: the tokenizer's entries
rounded up to model.vocab_multiple, GPT-2's 50,304): the padding ids never occur in the data and
get (small) probabilities like any other row. Needs `transformers` and `safetensors` (pip install -e '.[test]').

OUT is written beside itself (`OUT.tmp-PID`) and moved into place when complete, so a failed
export leaves OUT as it was. A non-empty OUT is refused unless `--overwrite`, which replaces
the files an export writes (`hf_format.EXPORT_FILES`; those of another kind are removed) and
keeps everything else there. Files get the usual 0644 (the umask's) mode.
"""

from __future__ import annotations

import json
import os

from absl import flags

from onona_jax import cli, paths

# hf_format (jax) is imported where used, so that --help starts without jax.


def check_exportable(cfg_model) -> None:
    """What export refuses (`hf_format.check_supported`), before any array is read."""
    from onona_jax.serve import hf_format

    hf_format.check_supported(cfg_model)


def check_output(workdir: str, output: str, overwrite: bool = False) -> None:
    """`hf_format.check_output`, and never the run's own directory (its config.json)."""
    from onona_jax.serve import hf_format

    if not paths.is_cloud(workdir) and os.path.realpath(output) == os.path.realpath(workdir):
        raise ValueError(f"--output={output} is the run's --workdir; give another folder (e.g. {workdir}/hf)")
    hf_format.check_output(output, overwrite)


def export(workdir: str, output: str, step: int | None = None, tokenizer: bool = True,
           mesh=(-1, 1, 1), overwrite: bool = False) -> dict:
    """Export a run's checkpoint (the latest unless `step`); returns a summary dict. A non-empty
    `output` needs `overwrite`, which replaces only the files an export writes."""
    from onona_jax.checkpoint import restore_params, saved_config
    from onona_jax.serve import hf_format

    check_output(workdir, output, overwrite)  # before reading any checkpoint
    saved = saved_config(workdir, step)
    check_exportable(saved.model)  # before restoring any array
    hf_format.check_tokenizer(saved, tokenizer)
    params, step, cfg, _ = restore_params(workdir, step, mesh)
    source = dict(workdir=paths.absolute(workdir), step=int(step), config=cfg.name)

    try:
        model_type, files = hf_format.export(params, cfg, output, tokenizer, overwrite)
    except OSError as err:  # a full disk, a permission lost since the check
        raise cli.Failure(f"cannot write the export to {output} ({err.strerror or err}); a failed export leaves "
                          f"{output} as it was: free space or fix the permission and rerun") from None
    kind = {"qwen3": "hf-qwen3", "qwen3_moe": "hf-qwen3-moe", "onona": "hf-onona"}[model_type]
    return dict(kind=kind, output=os.path.abspath(output), files=sorted(set(files)), **source)


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "run directory with checkpoints/", flag_values=fv, required=True)
    flags.DEFINE_string("output", None, "folder to write", flag_values=fv, required=True)
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=fv)
    flags.DEFINE_bool("tokenizer", True, "write the tokenizer files (--notokenizer: do not)", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace the files an export writes in a non-empty --output (and "
                      "keep the rest)", flag_values=fv)
    cli.define_mesh(fv)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    try:
        summary = export(fv.workdir, fv.output, fv.step, fv.tokenizer, cli.mesh(fv), fv.overwrite)
    except cli.Interrupted:  # (Ctrl-C: the folder being built beside OUT is removed on the way out)
        raise cli.Interrupted(f"{fv.output} was not written (left as it was); rerun the same command to export") from None
    print(json.dumps(summary, indent=2))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
