"""Issue 29's whole chain with a tokenizer past 65,536 entries, through the real commands:
`python -m onona_jax.data.prepare --tokenizer=<70k BPE>` (uint32 shards) -> `train.py` (a tiny
twin, data.tokenizer set) -> `eval.py` (validation loss and bits per byte) ->
`python -m onona_jax.serve.export` -> transformers loads the model and the tokenizer and
greedy-generates what our server generates from the same checkpoint.

The pieces have fast tests of their own (test_tokenizer_data.py, test_tokenizer_downstream.py);
this one holds them together, so it is slow (four commands, three compiles)."""

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import REPO  # noqa: E402

pytestmark = pytest.mark.slow


def _run(*args, cwd=REPO):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per command
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{args[:2]} exit {p.returncode}: {(p.stdout + p.stderr)[-3000:]}"
    return p


def test_prepare_train_eval_export_generate_with_a_70k_tokenizer(bpe_70k, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onona_jax import tokenizer as tokenizer_lib
    from onona_jax.checkpoint import restore_params, saved_config
    from onona_jax.serve import server as serving

    tok = tokenizer_lib.load(str(bpe_70k))
    assert (tok.n_vocab, tok.dtype, tok.eot) == (70_000, np.uint32, 0)
    text = tmp_path / "austen.txt"
    import lzma

    with lzma.open(tokenizer_lib.bundled_corpus_path(), "rt") as f:
        text.write_text(f.read(400_000))
    data = tmp_path / "data"
    _run("-m", "onona_jax.data.prepare", f"--input={text}", f"--output={data}", f"--tokenizer={bpe_70k}",
         "--heldout_fraction=0.1", "--workers=1")
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["dtype"] == "uint32" and tokenizer_lib.same(tokenizer_lib.manifest_identity(manifest),
                                                                 tok.identity())

    wd = tmp_path / "run"
    _run("train.py", "--config=configs/paper.py:dense-tiny-twin", f"--workdir={wd}", f"--config.data.dir={data}",
         f"--config.data.tokenizer={bpe_70k}", "--config.train.steps=4", "--config.train.checkpoint_every=4",
         "--config.train.eval_every=1000", "--config.eval.windows=8")
    cfg = saved_config(str(wd))
    assert cfg.model.vocab_size == 70_016  # 70,000 entries rounded up to 128
    losses = [json.loads(line)["loss"] for line in (wd / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses and all(abs(x - np.log(70_016)) < 1.0 for x in losses), losses

    _run("eval.py", f"--workdir={wd}", "--mesh=1,1,1")
    res = json.loads((wd / "eval" / "step_4.json").read_text())
    val = res.get("validation", res)
    # bits per byte re-normalises the loss by the targets' bytes: loss / (bits per byte · ln 2) is
    # bytes per token, ≥ 1 (every ordinary token is a byte or more) and ≤ 24 (the BPE's longest)
    bytes_per_token = val["val_loss"] / (val["val_bits_per_byte"] * np.log(2))
    assert 1.0 <= bytes_per_token <= 24.0 and val["val_bytes"] > 0, val

    out = tmp_path / "hf"
    _run("-m", "onona_jax.serve.export", f"--workdir={wd}", f"--output={out}", "--mesh=1,1,1")
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    sample = text.read_text()[1000:1600]
    ids = tok.encode(sample)
    assert max(ids) >= 1 << 16 or any(i >= 1 << 16 for i in tok.encode(text.read_text()[:50_000]))
    assert hf_tok.encode(sample, add_special_tokens=False) == ids

    import jax

    params = restore_params(str(wd), mesh=(1, 1, 1), devices=jax.devices()[:1])[0]
    server = serving.Server(cfg, params)
    prompts = [ids[:6], [tok.eot] + ids[6:9]]
    want = server.generate(prompts, 6, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    for prompt, w in zip(prompts, want):
        x = torch.tensor([prompt])
        with torch.no_grad():
            got = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.eot)
        assert got[0, len(prompt):].tolist() == w
