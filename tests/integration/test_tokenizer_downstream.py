"""Everything downstream of training follows the run's tokenizer (data.tokenizer), held here
with tokenizers other than GPT-2's: the 4,096-entry byte-level BPE of tests/bpe.py (a HF
tokenizer folder, <|endoftext|> = 0) and a tiktoken rank file made of GPT-2's first 1,000
ranks. A tiny twin model with noisy parameters (no training) is exported, loaded by
transformers, imported back, served, scored and analysed.

- export: `AutoTokenizer.from_pretrained(OUT)` encodes a paragraph of the corpus to our ids,
  bos/eos/pad are the run's eot, and `AutoModelForCausalLM` greedy-generates what our server
  does; the HF tokenizer's tokenizer.json is copied byte for byte;
- import: the folder's tokenizer becomes the run's data.tokenizer (the same identity), and
  model.vocab_multiple is set so the tokenizer's entries round up to the checkpoint's rows;
- eval: WikiText-2 and LAMBADA word and byte perplexity and bits per byte are the
  hand computation from the per-token log-probabilities; the validation bits per byte counts
  the bytes of the targets exactly; the lm-evaluation-harness model and generation use the
  run's tokenizer; the gate analysis reads its bytes and special tokens.
"""

import json
import lzma
import math
import os
import re
import shutil

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import tiny_config  # noqa: E402
from onona_jax import config as config_lib  # noqa: E402
from onona_jax import models as model_lib  # noqa: E402
from onona_jax import tokenizer as tokenizer_lib  # noqa: E402
from onona_jax.analysis import gate  # noqa: E402
from onona_jax.checkpoint import restore_params, saved_config  # noqa: E402
from onona_jax.eval import tasks, validation  # noqa: E402
from onona_jax.eval.tasks import lambada, wikitext  # noqa: E402
from onona_jax.serve import generate, hf_format  # noqa: E402
from onona_jax.serve import server as serving  # noqa: E402
from onona_jax.train import import_hf  # noqa: E402

MULTIPLE = 96  # 4,096 entries -> 4,128 rows: 32 padding rows, so dropping them is exercised
NEW = 8


def _paragraph(i: int = 3) -> str:
    with lzma.open(tokenizer_lib.bundled_corpus_path(), "rt") as f:
        paras = [p for p in f.read(60_000).split("\n\n") if len(p) > 200]
    return paras[i]


def _config(root, spec: str, multiple: int = 128, **data):
    """A tiny dense twin config whose data.tokenizer is `spec` (model.vocab_size follows it)."""
    cfg = tiny_config(str(root / "no-data"), head="twin")
    cfg.data.update(tokenizer=spec, **data)
    cfg.model.update(vocab_size=0, vocab_multiple=multiple)
    cfg.mesh.data = 1
    return config_lib.validate(cfg)


def _noisy_params(m, seed=0):
    """Initialised params plus N(0, 0.1²) noise (logits of order one, as test_hf_export)."""
    _, params = model_lib.init(m, seed)
    leaves, treedef = jax.tree.flatten(params)
    r = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [x + 0.1 * r.standard_normal(x.shape, np.float32) for x in leaves])


@pytest.fixture(scope="module")
def bpe_run(bpe_4k, tmp_path_factory):
    """(cfg, params, tokenizer, export folder) of a tiny twin on bpe_4k, exported once."""
    root = tmp_path_factory.mktemp("bpe_run")
    cfg = _config(root, str(bpe_4k), MULTIPLE)
    tok = tokenizer_lib.from_config(cfg.data)
    assert (tok.kind, tok.n_vocab, tok.eot, cfg.model.vocab_size) == ("hf", 4096, 0, 4128)
    params = _noisy_params(cfg.model)
    out = str(root / "hf")
    hf_format.export(params, cfg, out)
    return cfg, params, tok, out


# ----------------------------------------------------------------------------- export


def test_export_writes_the_run_tokenizer_and_transformers_generates_like_our_server(bpe_run, bpe_4k):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, params, tok, out = bpe_run
    # the HF tokenizer's own tokenizer.json, byte for byte; bos/eos/pad = its eot (0) everywhere
    assert open(os.path.join(out, "tokenizer.json"), "rb").read() == open(bpe_4k / "tokenizer.json", "rb").read()
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    gen_cfg = json.load(open(os.path.join(out, "generation_config.json")))
    assert hf_cfg["vocab_size"] == 4128  # the model's rows, padding included
    for c in (hf_cfg, gen_cfg):
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (0, 0, 0)

    hf_tok = AutoTokenizer.from_pretrained(out)
    text = _paragraph()
    ids = tok.encode(text)
    assert len(ids) > 40 and max(ids) < 4096 and ids != tokenizer_lib.load().encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == ids
    assert hf_tok(text)["input_ids"] == ids  # no post-processor: the default call too
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.pad_token_id) == (0, 0, 0)
    assert hf_tok.model_max_length == cfg.data.seq_len

    # greedy generation: transformers' and our server's, token for token
    server = serving.Server(cfg, params)
    assert tokenizer_lib.same(server.tokenizer.identity(), tok.identity())
    prompts = [ids[:5], [tok.eot] + ids[10:13], ids[20:21]]
    want = server.generate(prompts, NEW, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    for prompt, w in zip(prompts, want):
        x = torch.tensor([prompt])
        with torch.no_grad():
            got = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.eot)
        assert got[0, len(prompt):].tolist() == w
        assert hf_tok.decode(w) == tok.decode(w)
    # padding rows (ids ≥ 4,096) have no text: decode drops them
    assert tok.decode(ids[:3] + [4096, 4127]) == tok.decode(ids[:3])


def _rank_file(path, n: int = 1000) -> str:
    """GPT-2's first n ranks (its 256 bytes and the first merges) as a tiktoken rank file."""
    with open(tokenizer_lib.ranks_path()) as src, open(path, "w") as dst:
        for _ in range(n):
            dst.write(src.readline())
    return str(path)


@pytest.mark.parametrize("specials", ["<|endoftext|>=1000", "<|endoftext|>=1000,<|pad|>=1002"],
                         ids=["contiguous", "gap"])
def test_a_tiktoken_rank_file_exports_and_imports(specials, tmp_path):
    from transformers import AutoTokenizer

    ranks = _rank_file(tmp_path / "small.tiktoken")
    cfg = _config(tmp_path, ranks, special_tokens=specials)
    tok = tokenizer_lib.from_config(cfg.data)
    assert (tok.kind, tok.eot, cfg.model.vocab_size) == ("tiktoken", 1000, 1024)
    out = tmp_path / "hf"
    hf_format.export(_noisy_params(cfg.model), cfg, str(out))
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    text = _paragraph() + " naïve café 東京 — 12,500!"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    for name, i in tok.special_tokens:
        assert hf_tok.convert_tokens_to_ids(name) == i
    assert hf_tok.eos_token_id == 1000
    assert json.load(open(out / "config.json"))["eos_token_id"] == 1000
    # imported back: the rank file (it loads here) stays the run's tokenizer
    workdir = tmp_path / "imported"
    import_hf.import_folder(str(out), str(workdir), mesh=(1, 1, 1), devices=jax.devices()[:1])
    back = saved_config(str(workdir))
    assert tokenizer_lib.same(tokenizer_lib.from_config(back.data).identity(), tok.identity())


def test_gpt2_export_tokenizer_is_unchanged(tmp_path):
    """GPT-2's conversion, as before data.tokenizer: TikTokenConverter with <|endoftext|> after
    the ranks, byte for byte."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    hf_format.write_tokenizer(str(tmp_path / "ours"), tokenizer_lib.load(), 64)
    backend = TikTokenConverter(vocab_file=tokenizer_lib.ranks_path(), pattern=tokenizer_lib.GPT2_PAT_STR,
                                extra_special_tokens={"<|endoftext|>": 50256}).converted()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=64,
                            add_prefix_space=False).save_pretrained(str(tmp_path / "before"))
    for name in ("tokenizer.json",):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()
    assert json.load(open(tmp_path / "ours" / "tokenizer_config.json"))["eos_token"] == "<|endoftext|>"


# ----------------------------------------------------------------------------- import


@pytest.fixture(scope="module")
def imported(bpe_run, tmp_path_factory):
    """bpe_run's export imported with `python -m onona_jax.train.import_hf`."""
    _, _, _, out = bpe_run
    workdir = str(tmp_path_factory.mktemp("imported") / "run")
    assert import_hf.main([f"--from_hf={out}", f"--workdir={workdir}"]) == 0
    return workdir


def test_import_gives_the_run_the_folder_tokenizer(bpe_run, imported, tmp_path):
    cfg, params, tok, out = bpe_run
    back = saved_config(imported)
    # copied into the workdir (self-contained), the same identity as bpe_4k's
    assert back.data.tokenizer == os.path.join(os.path.abspath(imported), "tokenizer")
    assert sorted(os.listdir(back.data.tokenizer)) == ["tokenizer.json", "tokenizer_config.json"]
    assert tokenizer_lib.same(tokenizer_lib.from_config(back.data).identity(), tok.identity())
    assert (back.model.vocab_size, back.model.vocab_multiple) == (4128, MULTIPLE)
    restored, _, _, _ = restore_params(imported, mesh=(1, 1, 1), devices=jax.devices()[:1])
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    # a plain HF folder (no training config of ours): the folder's tokenizer and eot, and a
    # vocab_multiple that rounds 4,096 entries up to its 4,128 rows (128 would give 4,096)
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    os.remove(plain / hf_format.TRAIN_CONFIG)
    workdir = tmp_path / "plain_run"
    summary = import_hf.import_folder(str(plain), str(workdir), mesh=(1, 1, 1), devices=jax.devices()[:1])
    back = saved_config(str(workdir))
    assert tokenizer_lib.same(tokenizer_lib.from_config(back.data).identity(), tok.identity())
    assert (back.model.vocab_size, back.model.vocab_multiple) == (4128, 43) == (
        summary["vocab_size"], summary["vocab_multiple"])
    assert tokenizer_lib.from_config(back.data).padded_vocab(43) == 4128
    assert import_hf.vocab_multiple(4096, 4096, 128) == 128 and import_hf.vocab_multiple(50257, 50304, 128) == 128
    with pytest.raises(ValueError, match="vocab_size=4,000 is below its tokenizer's 4,096 entries"):
        import_hf.vocab_multiple(4096, 4000, 128)


def test_generate_cli_encodes_and_decodes_with_the_run_tokenizer(bpe_run, imported, capsys):
    cfg, params, tok, _ = bpe_run
    prompt = "It is a truth universally acknowledged"
    assert generate.main([f"--workdir={imported}", f"--prompt={prompt}", "--greedy",
                          f"--max_new_tokens={NEW}", "--nostop_at_eot"]) == 0
    out = capsys.readouterr().out
    printed = out[:out.rindex("\n[greedy")]  # the text, then the line of timings
    [want] = serving.Server(cfg, params).generate([tok.encode(prompt)], NEW, greedy=True)
    assert printed == tok.decode(want)


# ----------------------------------------------------------------------------- evaluation


@pytest.fixture(scope="module")
def scorer(bpe_run):
    from onona_jax import train as trainer

    cfg, params, _, _ = bpe_run
    mesh = trainer.setup(cfg, jax.devices()[:1]).mesh
    return tasks.Scorer.from_params(params, cfg, mesh, batch_size=4, max_length=64)


def _hand_log_probs(bpe_run, ids, prefix=True):
    """log p of each token of ids under the model, read after [eot] + ids[:-1] (one window),
    or without the prefix, of ids[1:] after ids[:-1]."""
    cfg, params, tok, _ = bpe_run
    graphdef, _ = model_lib.abstract(cfg.model)
    seq = np.asarray([[tok.eot] * prefix + list(ids)], np.int32)
    lp = np.asarray(model_lib.bind(graphdef, params)(seq[:, :-1]))[0]
    return lp[np.arange(seq.shape[1] - 1), seq[0, 1:]].astype(np.float64)


def test_word_and_byte_perplexity_are_the_hand_computation(bpe_run, scorer, tmp_path):
    _, _, tok, _ = bpe_run
    docs = [" = Emma = \n \n Emma Woodhouse , handsome , clever , and rich . \n",
            " = Mr. Knightley = \n \n A sensible man @-@ about seven or eight @-@ and @-@ thirty . \n"]
    path = tmp_path / "wiki.test.raw"
    path.write_text("".join(docs))
    pages = wikitext.load(str(path))[0]
    assert len(pages) == 2
    r = tasks.evaluate(scorer, ["wikitext2"], {"wikitext2": str(path)})["wikitext2"]
    ids = [tok.encode(wikitext.detokenize(p)) for p in pages]
    assert all(len(i) < 64 for i in ids)  # one window per page: the hand computation below
    ll = sum(float(_hand_log_probs(bpe_run, i).sum()) for i in ids)
    words = sum(len(re.split(r"\s+", p)) for p in pages)
    nbytes = sum(len(p.encode("utf-8")) for p in pages)
    c = r["counts"]
    assert (c["words"], c["bytes"], c["tokens"]) == (words, nbytes, sum(map(len, ids)))
    assert c["loglikelihood"] == pytest.approx(ll, rel=1e-5)
    m = r["metrics"]  # exactly the harness's normalisation of the scored log-likelihood
    assert m["word_perplexity"] == math.exp(-c["loglikelihood"] / words)
    assert m["byte_perplexity"] == math.exp(-c["loglikelihood"] / nbytes)
    assert m["bits_per_byte"] == -c["loglikelihood"] / nbytes / math.log(2)
    assert m["token_perplexity"] == math.exp(-c["loglikelihood"] / c["tokens"])
    assert m["bits_per_byte"] == pytest.approx(-ll / nbytes / math.log(2), rel=1e-5)
    assert tokenizer_lib.same(r["tokenizer"], tok.identity())

    # LAMBADA: per word (one per passage), per byte of the " word" targets, per target token
    texts = ["Emma Woodhouse was handsome and clever and rich", "she had lived nearly twenty-one years"]
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    r = tasks.evaluate(scorer, ["lambada"], {"lambada": str(lam)})["lambada"]
    lls, nbytes, ntok = [], 0, 0
    for t in texts:
        ctx, target = lambada.split(t)
        c_ids, whole = tok.encode(ctx), tok.encode(ctx + target)
        assert whole[:len(c_ids)] == c_ids
        lls.append(float(_hand_log_probs(bpe_run, whole, prefix=False)[len(c_ids) - 1:].sum()))
        nbytes += len(target.encode("utf-8"))
        ntok += len(whole) - len(c_ids)
    c, m = r["counts"], r["metrics"]
    assert (c["words"], c["bytes"], c["tokens"]) == (2, nbytes, ntok)
    assert c["loglikelihood"] == pytest.approx(sum(lls), rel=1e-5)
    assert m["perplexity"] == math.exp(-c["loglikelihood"] / 2)
    assert m["byte_perplexity"] == math.exp(-c["loglikelihood"] / nbytes)
    assert m["bits_per_byte"] == -c["loglikelihood"] / nbytes / math.log(2)
    assert m["token_perplexity"] == math.exp(-c["loglikelihood"] / ntok)


def test_validation_bits_per_byte_counts_the_bytes_of_the_targets(bpe_run):
    """The bytes of a window's targets are the text they encode (byte-level BPE), the eot
    counting none: bits per byte = mean NLL × targets / bytes / ln 2."""
    _, _, tok, _ = bpe_run
    a, b = _paragraph(3), _paragraph(4)
    ids = [tok.eot] + tok.encode(a) + [tok.eot] + tok.encode(b)
    windows = np.asarray([ids[:33], ids[33:66]], np.int64)
    out = validation.bits_per_byte(2.5, windows, tok)
    text_bytes = len(tok.decode(windows[:, 1:].ravel()).replace(tok.eot_text, "").encode("utf-8"))
    assert out["val_bytes"] == text_bytes == sum(len(tok.token_bytes(i)) for i in windows[:, 1:].ravel()
                                                 if i != tok.eot)
    assert out["val_bits_per_byte"] == 2.5 * 64 / text_bytes / math.log(2)
    whole = np.asarray([[tok.eot] + tok.encode(a)])  # one document: exactly its UTF-8 bytes
    assert validation.bits_per_byte(1.0, whole, tok)["val_bytes"] == len(a.encode("utf-8"))
    with pytest.raises(ValueError, match="prepared with another tokenizer"):
        validation.bits_per_byte(1.0, np.asarray([[0, 50000]]), tok)


def test_lm_eval_model_uses_the_run_tokenizer(bpe_run, scorer):
    pytest.importorskip("lm_eval")
    from onona_jax.eval.lm_eval_model import OnonaLM

    _, _, tok, _ = bpe_run
    lm = OnonaLM(scorer=scorer)
    text = _paragraph()
    assert (lm.eot_token_id, lm.prefix_token_id, lm.tokenizer_name) == (0, 0, tok.name)
    assert lm.tok_encode(text) == tok.encode(text) and lm.tok_decode(tok.encode(text)) == text
    assert lm._encode_pair("Emma was", " handsome") == scorer.encode_pair("Emma was", " handsome")
    [rolling] = lm.loglikelihood_rolling([type("R", (), {"args": ("Emma was handsome.",)})()])
    assert rolling == pytest.approx(float(_hand_log_probs(bpe_run, tok.encode("Emma was handsome.")).sum()),
                                    rel=1e-5)


def test_gate_analysis_reads_the_run_tokenizer(bpe_run):
    _, _, tok, _ = bpe_run
    raw = gate.token_bytes(None, tok)
    assert len(raw) == 4096 and raw[0] == b"<|endoftext|>"
    ids = tok.encode(_paragraph())
    assert b"".join(raw[i] for i in ids) == _paragraph().encode("utf-8")
    g = np.linspace(0, 1, 4096)
    report = gate.analyze_arrays(g, None, raw, top=3, specials=frozenset({tok.eot}))
    assert report["classes"]["special"]["n_tokens"] == 1
    assert gate.classify(0, raw[0], frozenset({tok.eot})) == "special"
    assert gate.classify(0, raw[0]) != "special"  # GPT-2's specials (50256) by default
