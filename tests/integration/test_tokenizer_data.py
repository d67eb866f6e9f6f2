"""Data of any tokenizer (issue 29): prepare with `--tokenizer`, uint16 shards when every id fits
and uint32 past 65,536 entries, the manifest's dtype and tokenizer identity, every reader
(TokenStore, StreamStore, windows) reading the manifest's dtype, a tiny twin trained on uint32
data, and training and evaluation refusing data prepared with another tokenizer than the run's
`data.tokenizer` (one error line naming both), with old GPT-2 manifests still read."""

import json
import lzma
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import train as train_cli
from conftest import REPO, run_steps, tiny_config
from onona_jax import config as config_lib
from onona_jax import summary
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.data import pipeline, storage
from onona_jax.data.prepare import _doc_hash, main as prepare_main, prepare
from onona_jax.data.stream import StreamStore
from test_prepare_formats import bucket, upload  # noqa: F401 - the fixture
from run_fixtures import errors

HELDOUT = 0.1


def corpus_docs(chars: int = 120_000) -> list[str]:
    """The paragraphs of the bundled corpus' first `chars` characters, as prepare reads a .txt."""
    with lzma.open(tokenizer_lib.bundled_corpus_path(), "rt") as f:
        text = f.read(chars)
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def prepared(root: Path, tok_dir, **kwargs) -> tuple[Path, dict, list[str]]:
    docs = corpus_docs()
    (root / "c.txt").write_text("\n\n".join(docs))
    m = prepare([str(root / "c.txt")], str(root / "data"), heldout_fraction=HELDOUT,
                tokenizer=str(tok_dir), **kwargs)
    return root / "data", m, docs


def expected_splits(tok, docs) -> dict[str, list[int]]:
    """Each document's direct encoding plus the tokenizer's eot, in the split its hash sends it to."""
    held = [_doc_hash(0, i) < HELDOUT for i in range(len(docs))]
    assert any(held) and not all(held)
    out = {"train": [], "heldout": []}
    for d, h in zip(docs, held):
        out["heldout" if h else "train"] += tok.encode(d) + [tok.eot]
    return out


def raw_split(d: Path, split: str, dtype) -> np.ndarray:
    m = json.loads((d / "manifest.json").read_text())
    return np.concatenate([np.fromfile(d / s["file"], dtype) for s in m["splits"][split]["shards"]])


@pytest.fixture(scope="module")
def data_4k(bpe_4k, tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("data_4k"), bpe_4k)


@pytest.fixture(scope="module")
def data_70k(bpe_70k, tmp_path_factory):
    # Small shards and blocks (not a multiple of 4 tokens' worth of shard), so that reads cross both.
    return prepared(tmp_path_factory.mktemp("data_70k"), bpe_70k, shard_tokens=3_001, block_bytes=4 * 37, workers=2)


def data_cfg(tok_dir) -> dict:
    return {"tokenizer": str(tok_dir)}


# ----------------------------------------------------------------------------- prepare


def test_prepare_with_a_4k_tokenizer_writes_uint16_and_its_identity(data_4k, bpe_4k):
    d, m, docs = data_4k
    tok = tokenizer_lib.load(str(bpe_4k))
    assert (tok.kind, tok.n_vocab, tok.eot, tok.dtype) == ("hf", 4096, 0, np.uint16)
    assert m == json.loads((d / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and m["vocab"] == 4096 and m["eot"] == 0
    assert m["tokenizer"] == {**tok.identity(), "config": {"tokenizer": str(bpe_4k)}}
    assert tokenizer_lib.same(tokenizer_lib.manifest_identity(m), tok.identity())
    want = expected_splits(tok, docs)
    for split in ("train", "heldout"):
        got = raw_split(d, split, "<u2")
        assert got.tolist() == want[split]
        assert m["splits"][split]["tokens"] == len(got)
        assert m["splits"][split]["shards"][0]["bytes"] == 2 * len(got)


def test_prepare_past_65536_entries_writes_uint32_read_alike_by_every_reader(data_70k, bpe_70k):
    """uint32 shards (4 bytes a token, in the manifest's dtype), ids past 65,535 present, and the
    memory-mapped store, the streaming store (blocks of 37 tokens), the training batches and the
    held-out windows all read the tokens a direct encode of the documents gives; 2 workers
    loaded the tokenizer from its spec and wrote what one process writes."""
    d, m, docs = data_70k
    tok = tokenizer_lib.load(str(bpe_70k))
    assert tok.n_vocab == 70_000 and tok.dtype == np.uint32 and tok.eot == 0
    assert m["dtype"] == "uint32" and m["vocab"] == 70_000 and tokenizer_lib.same(m["tokenizer"], tok.identity())
    want = expected_splits(tok, docs)
    train = raw_split(d, "train", "<u4")
    assert train.tolist() == want["train"] and raw_split(d, "heldout", "<u4").tolist() == want["heldout"]
    assert (train >= 1 << 16).sum() > 100  # ids a uint16 shard could not hold
    shards = m["splits"]["train"]["shards"]
    assert len(shards) >= 4 and all(s["bytes"] == 4 * s["tokens"] == (d / s["file"]).stat().st_size for s in shards)
    assert all(len(s["block_sha256"]) == 32 * -(-s["bytes"] // (4 * 37)) for s in shards)

    store = pipeline.TokenStore(d, "train")
    assert store.dtype == np.uint32 and len(store) == len(train)
    assert store.read(0, len(store)).tolist() == want["train"]
    stream = StreamStore(pipeline.DataSource(str(d)), "train")  # the streaming reader, on a local path: every block verified
    spans = [(0, len(train)), (2_995, 3_010), (36, 38), (len(train) - 3, len(train))]
    assert [r.tolist() for r in stream.read_many(spans)] == [want["train"][a:b] for a, b in spans]
    assert stream.bytes_fetched >= 4 * len(train)

    seq = 63
    batch = next(pipeline.train_batches(str(d), seq, 4, seed=1))
    rows = {tuple(train[i * (seq + 1) : (i + 1) * (seq + 1)]) for i in range(len(train) // (seq + 1))}
    assert batch.dtype == np.int32 and all(tuple(r) in rows for r in batch.tolist())
    held = np.array(want["heldout"])
    windows = pipeline.validation_windows(str(d), seq, 3, tokenizer=data_cfg(bpe_70k))
    assert all(any(np.array_equal(w, held[i * (seq + 1) : (i + 1) * (seq + 1)]) for i in range(len(held) // (seq + 1)))
               for w in windows)

    one = prepare([str(d.parent / "c.txt")], str(d.parent / "one"), heldout_fraction=HELDOUT, tokenizer=str(bpe_70k),
                  shard_tokens=3_001, block_bytes=4 * 37, workers=1)
    assert one["splits"] == m["splits"]  # each shard's sha256 and block hashes: the same bytes
    assert storage.data_identity(d.parent / "one") == storage.data_identity(d)


def test_uint32_bucket_data_copied_or_streamed_reads_as_local(data_70k, bpe_70k, bucket, tmp_path):
    """A bucket copy of the uint32 data: the cache's copy (sizes 4 bytes a token, each shard's
    sha256 checked) and the streamed reads (37-token blocks) give the local tokens."""
    d, m, _ = data_70k
    url = "gs://bucket/data_70k"
    upload(d, url)
    local = pipeline.TokenStore(d, "train")
    data = pipeline.open_for_training(url, 63, 3, cache_dir=str(tmp_path / "cache"), tokenizer=data_cfg(bpe_70k))
    train = data.sources[0].store("train")
    assert train.dtype == np.uint32 and np.array_equal(train.read(0, len(local)), local.read(0, len(local)))
    streamed = pipeline.DataSource(url, bucket_read="stream").store("train")
    assert isinstance(streamed, StreamStore) and np.array_equal(streamed.read(0, len(local)), local.read(0, len(local)))
    assert np.array_equal(data.val_windows, pipeline.validation_windows(d, 63, 3))


def test_block_bytes_must_hold_whole_uint32_tokens(bpe_70k, tmp_path):
    (tmp_path / "c.txt").write_text("One document.\n\nAnother.")
    with pytest.raises(ValueError, match=r"block_bytes must be a positive multiple of 4 \(whole uint32 tokens"):
        prepare([str(tmp_path / "c.txt")], str(tmp_path / "o"), tokenizer=str(bpe_70k), block_bytes=6)
    assert not (tmp_path / "o").exists()


def test_tokens_column_is_checked_against_the_chosen_tokenizer(bpe_4k, bpe_70k, tmp_path, capfd):
    """Pre-tokenized ids are checked against --tokenizer's vocabulary, not GPT-2's: 5000 is a
    GPT-2 id but not one of 4,096 entries (one error line naming the id, the file and line, the
    fix; nothing written); ids past 65,535 of the 70k tokenizer are kept, as uint32, with its
    eot (0) ending each document once."""
    src = tmp_path / "ids.jsonl"
    src.write_text("\n".join(json.dumps({"ids": ids}) for ids in ([5, 6, 7], [8, 5000, 9], [69_999, 0, 0])) + "\n")
    args = ["--input", str(src), "--tokens_column", "ids", "--workers", "1", "--heldout_fraction", "0"]
    assert prepare_main([*args, "--output", str(tmp_path / "a"), "--tokenizer", str(bpe_4k)]) == 2
    [line] = errors(capfd.readouterr().err)
    assert line.startswith(f"error: {src}:2: token id 5000 is outside the vocabulary of {Path(bpe_4k).name} "
                           f"[0, 4096) (--tokenizer={bpe_4k}); "), line
    assert "--tokenizer" in line.split("; ", 1)[1]
    assert not (tmp_path / "a").exists()

    assert prepare_main([*args, "--output", str(tmp_path / "b"), "--tokenizer", str(bpe_70k)]) == 0
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["dtype"] == "uint32" and m["eot"] == 0
    assert raw_split(tmp_path / "b", "train", "<u4").tolist() == [5, 6, 7, 0, 8, 5000, 9, 0, 69_999, 0]
    # GPT-2 (the default) takes 5000 but not 69,999, and ends documents with its own eot.
    assert prepare_main([*args, "--output", str(tmp_path / "c")]) == 2
    [line] = errors(capfd.readouterr().err)
    assert f"{src}:3: token id 69999 is outside the GPT-2 vocabulary [0, 50257)" in line


def test_prepare_refuses_a_size_only_tokenizer_and_a_missing_one(tmp_path, capfd):
    (tmp_path / "c.txt").write_text("One document.\n\nAnother.")
    for spec, words in (("size:128256", "names a vocabulary size only (for planning); prepare needs the tokenizer"),
                        (str(tmp_path / "nope.json"), "no such file or folder")):
        assert prepare_main(["--input", str(tmp_path / "c.txt"), "--output", str(tmp_path / "o"),
                             f"--tokenizer={spec}"]) == 2
        [line] = errors(capfd.readouterr().err)
        assert line.startswith("error: ") and spec in line and words in line, line
        assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- training


def config_for(data_dir, tok_dir=None, head="twin"):
    cfg = tiny_config(str(data_dir), head)
    if tok_dir is not None:
        cfg.data.tokenizer = str(tok_dir)
        cfg.model.vocab_size = 0  # follows the tokenizer
    return config_lib.validate(cfg)


@pytest.mark.slow  # suite-time margin (cover: test_prepare_past_65536_entries_writes_uint32_read_alike_by_every_reader)
def test_tiny_twin_trains_on_uint32_data(data_70k, bpe_70k):
    """A tiny twin with data.tokenizer = the 70k tokenizer: a table of 70,016 rows (70,000 rounded
    up to 128), the run's data opened (and accepted) as training opens it, and 3 steps on uint32
    batches whose loss starts near ln(70,016) = 11.156 (seen: 11.160, 11.162, 11.145) and falls."""
    from onona_jax.train import loop

    d, _, _ = data_70k
    cfg = config_for(d, bpe_70k)
    assert cfg.model.vocab_size == 70_016
    data = loop.open_data(cfg, str(d))
    assert data.sources[0].dtype == np.uint32 and int(data.val_windows.max()) >= 1 << 16
    losses, _, _ = run_steps(cfg, 3, jax.devices()[:1])  # one device: the shortest compile
    assert np.isfinite(losses).all()
    assert abs(losses[0] - math.log(70_016)) < 0.05, losses
    assert losses[-1] < losses[0], losses


def test_bundled_default_is_prepared_with_the_runs_tokenizer(bpe_4k, tmp_path, monkeypatch):
    """With no data.dir the bundled corpus is prepared into the workdir by data.tokenizer (here
    the corpus' head, for time), and opened by it."""
    from onona_jax.train import loop

    head = tmp_path / "austen_head.txt"
    head.write_text("\n\n".join(corpus_docs(60_000)))
    monkeypatch.setattr(pipeline, "bundled_corpus_path", lambda: str(head))
    cfg = config_for("", bpe_4k)
    data = loop.prepare_data(cfg, str(tmp_path / "w"))
    m = json.loads((tmp_path / "w" / "data" / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and tokenizer_lib.same(m["tokenizer"], tokenizer_lib.load(str(bpe_4k)).identity())
    assert data.sources[0].data_dir == str(tmp_path / "w" / "data") and int(data.val_windows.max()) < 4096


# ----------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("case", ["gpt2-data-bpe-run", "bpe-data-gpt2-run"])
def test_train_refuses_data_of_another_tokenizer(case, tiny_data, data_4k, bpe_4k, tmp_path, capfd, monkeypatch):
    """train.py with --config.data.tokenizer: data prepared with another tokenizer is one error
    line naming both tokenizers and both fixes, exit 2, before the workdir exists (the id check
    would otherwise have named only an id)."""
    monkeypatch.chdir(REPO)
    bpe = str(bpe_4k)  # (absolute: as the manifest records it)
    data, overrides = ((tiny_data, [f"--config.data.tokenizer={bpe_4k}"]) if case == "gpt2-data-bpe-run"
                       else (str(data_4k[0]), []))
    theirs, ours = ("gpt2", bpe) if case == "gpt2-data-bpe-run" else (bpe, "gpt2")
    argv = ["--config=configs/paper.py:dense-tiny-twin", f"--config.data.dir={data}", *overrides,
            f"--workdir={tmp_path / 'w'}"]
    assert train_cli.main(argv) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    [line] = errors(err)
    tok_theirs, tok_ours = tokenizer_lib.load(theirs), tokenizer_lib.load(ours)
    assert line == (
        f"error: data dir {data} was prepared with tokenizer {theirs} ({tok_theirs.name}, {tok_theirs.n_vocab:,} "
        f"entries, sha256 {tok_theirs.sha256[:12]}…); this run's data.tokenizer is "
        f"{bpe_4k if ours == bpe else 'gpt2'} ({tok_ours.describe()}): re-run `python -m onona_jax.data.prepare "
        f"--tokenizer={bpe_4k if ours == bpe else 'gpt2'} --input <text files> --output <dir>` and train on that, "
        f"or set --config.data.tokenizer={theirs}"), line
    assert not (tmp_path / "w").exists()


def test_evaluation_refuses_held_out_data_of_another_tokenizer(tiny_data, bpe_4k):
    """eval.py's validation reads the held-out windows through the run's data.tokenizer: the
    run's saved config says bpe_4k, its data dir holds GPT-2 data (re-prepared since, say)."""
    from onona_jax.eval import validation

    cfg = config_for(tiny_data, bpe_4k)
    with pytest.raises(ValueError, match=rf"^data dir {tiny_data} was prepared with tokenizer gpt2 \(gpt2, 50,257 "
                                         rf"entries, .*; this run's data.tokenizer is {bpe_4k} .*: the model was "
                                         rf"trained with {bpe_4k}: prepare its data.dir again with it, `python -m "
                                         rf"onona_jax.data.prepare --tokenizer={bpe_4k} --input <text files> "
                                         rf"--output {tiny_data}`$"):
        validation.validation("unused", loaded=(None, 1, cfg, None))


def test_old_gpt2_manifest_is_read_as_gpt2(tiny_data, bpe_4k, tmp_path):
    """A manifest written before data.tokenizer ({"name": "gpt2", "ranks_sha256": ...}) is GPT-2's
    data: a GPT-2 run opens it, a 4k run is refused naming gpt2, and a size-only tokenizer
    is told to name the real one."""
    old = tmp_path / "old"
    shutil.copytree(tiny_data, old)
    m = json.loads((old / "manifest.json").read_text())
    m["tokenizer"] = {"name": "gpt2", "ranks_sha256": tokenizer_lib.GPT2_RANKS_SHA256}
    (old / "manifest.json").write_text(json.dumps(m))
    data = pipeline.open_for_training(old, 32, 4, tokenizer={"tokenizer": "gpt2"})
    train = data.sources[0].store("train")
    assert train.dtype == np.uint16 and len(train) == m["splits"]["train"]["tokens"]
    assert storage.data_identity(old) == storage.data_identity(tiny_data)  # the same data
    with pytest.raises(ValueError, match=rf"prepared with tokenizer gpt2 .*; this run's data.tokenizer is {bpe_4k} .*"
                                         r"or set --config.data.tokenizer=gpt2$"):
        pipeline.open_for_training(old, 32, 4, tokenizer=data_cfg(bpe_4k))
    with pytest.raises(ValueError, match=r"data.tokenizer=size:50257 names a vocabulary size only \(for planning\), "
                                         r"not a tokenizer data can be read with: set --config.data.tokenizer=gpt2$"):
        pipeline.open_for_training(old, 32, 4, tokenizer={"tokenizer": "size:50257"})


# ----------------------------------------------------------------------------- summary


def test_summary_follows_data_tokenizer(capsys, monkeypatch):
    """`python -m onona_jax.summary --config.data.tokenizer=size:128256`: the table has 128,256
    rows and the parameter counts are those of that table."""
    monkeypatch.chdir(REPO)
    spec = "configs/paper.py:dense-1b-twin"
    assert summary.main([f"--config={spec}", "--config.data.tokenizer=size:128256", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    gpt2 = config_lib.load(spec)
    big = config_lib.load(spec)
    big.model.vocab_size = 128_256
    assert {k: got[k] for k in summary.param_counts(big.model)} == summary.param_counts(big.model)
    extra = got["total"] - summary.param_counts(gpt2.model)["total"]
    assert extra > 0 and extra % ((128_256 - 50_304) * gpt2.model.d_model) == 0
