"""prepare --train_tokenizer=N: a byte-level BPE of exactly N entries trained on the documents of
the train split only, deterministically, written as DIR/tokenizer.json and tokenised with exactly
as --tokenizer=DIR/tokenizer.json would, the manifest recording that file (not the staging dir)
and how it was trained; a run with data.tokenizer=DIR/tokenizer.json opens the data; and each
bad use is one error line before anything is written."""

import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, tiny_config
from onona_jax import config as config_lib
from onona_jax import tokenizer as tokenizer_lib
from onona_jax.data import pipeline
from onona_jax.data.prepare import _doc_hash, main as prepare_main, prepare
from test_prepare_formats import bucket  # noqa: F401 - the fixture
from run_fixtures import errors

HELDOUT = 0.1
ENTRIES = 500  # not a multiple of 128: the model's table rounds it up to 512
# Two made-up words of letter pairs English lacks, each repeated in one document: one document the
# hash split sends to training, one it holds out. Equally frequent, so the first's merges are learned
# and the second's would be too, had the tokenizer seen it.
TRAIN_WORD, HELD_WORD = "Wjkzw", "Qzvjb"
REPEATS = 2_000


def pairs(word: str) -> list[str]:
    return [word[i:i + 2] for i in range(len(word) - 1)]


def paragraphs(chars: int) -> list[str]:
    """The paragraphs of the bundled corpus' first `chars` characters, as prepare reads a .txt."""
    with lzma.open(tokenizer_lib.bundled_corpus_path(), "rt") as f:
        return [p.strip() for p in f.read(chars).split("\n\n") if p.strip()]


def corpus_docs(chars: int = 300_000) -> list[str]:
    """`paragraphs`, with the two words' documents in place of the first train and the first
    held-out document."""
    docs = paragraphs(chars)
    assert not any(p in d for d in docs for p in pairs(TRAIN_WORD) + pairs(HELD_WORD))
    held = [_doc_hash(0, i) < HELDOUT for i in range(len(docs))]
    docs[held.index(False)] = " ".join([TRAIN_WORD] * REPEATS)
    docs[held.index(True)] = " ".join([HELD_WORD] * REPEATS)
    return docs


def split_of(docs: list[str], split: str) -> list[str]:
    return [d for i, d in enumerate(docs) if (_doc_hash(0, i) < HELDOUT) == (split == "heldout")]


def read_ids(d: Path, split: str) -> list[int]:
    m = json.loads((d / "manifest.json").read_text())
    return [int(x) for s in m["splits"][split]["shards"] for x in np.fromfile(d / s["file"], "<u2")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    docs = corpus_docs()
    (root / "c.txt").write_text("\n\n".join(docs))
    m = prepare([str(root / "c.txt")], str(root / "data"), heldout_fraction=HELDOUT, train_tokenizer=ENTRIES,
                workers=1)
    return root, m, docs


def test_the_trained_tokenizer_has_n_entries_and_the_data_is_exactly_its(trained):
    """Exactly N entries (<|endoftext|> = 0 its eot); the manifest's identity is loading
    DIR/tokenizer.json's (name and path included: the final dir, not the staging one); the splits are
    each document's encoding plus the eot; decode(encode(text)) == text for every document; and
    --tokenizer=DIR/tokenizer.json writes the same manifest (less `trained`), shards included."""
    root, m, docs = trained
    d = root / "data"
    assert sorted(p.name for p in d.iterdir()) == ["heldout_00000.bin", "manifest.json", "tokenizer.json",
                                                   "train_00000.bin"]
    tok = tokenizer_lib.load(str(d / "tokenizer.json"))
    assert (tok.n_vocab, tok.eot, tok.eot_text) == (ENTRIES, 0, "<|endoftext|>")
    assert tok._impl.get_vocab_size(with_added_tokens=True) == ENTRIES
    record = dict(m["tokenizer"])
    assert record.pop("config") == {"tokenizer": os.path.abspath(d / "tokenizer.json")}
    train_docs = split_of(docs, "train")
    assert record.pop("trained") == {"entries": ENTRIES, "documents": len(train_docs),
                                     "bytes": sum(len(t.encode()) for t in train_docs), "min_frequency": 2,
                                     "library": f"tokenizers {__import__('tokenizers').__version__}"}
    assert record == tok.identity() and tokenizer_lib.same(tokenizer_lib.manifest_identity(m), tok.identity())
    assert ".tmp-" not in (d / "manifest.json").read_text()
    assert (m["vocab"], m["eot"], m["dtype"]) == (ENTRIES, 0, "uint16")
    for split in ("train", "heldout"):
        expected = [i for t in split_of(docs, split) for i in (*tok.encode(t), tok.eot)]
        assert read_ids(d, split) == expected, split
        assert m["splits"][split]["documents"] == len(split_of(docs, split))
    assert all(tok.decode(tok.encode(t)) == t for t in docs)
    given = prepare([str(root / "c.txt")], str(root / "given"), heldout_fraction=HELDOUT,
                    tokenizer=str(d / "tokenizer.json"), workers=1)
    assert given == {**m, "tokenizer": {k: v for k, v in m["tokenizer"].items() if k != "trained"}}


def test_held_out_documents_never_reach_the_tokenizer(trained):
    """The training document's word is one entry; of the held-out one's, not a single pair was merged."""
    root, _, _ = trained
    vocab = tokenizer_lib.load(str(root / "data" / "tokenizer.json"))._impl.get_vocab()
    assert "Ġ" + TRAIN_WORD in vocab
    assert not [t for t in vocab if any(p in t for p in pairs(HELD_WORD))]


@pytest.mark.parametrize("fraction, held", [(0.02, [4]), (0.95, [1, 2])])
def test_a_tiny_corpus_split_by_count_keeps_its_held_out_documents_from_the_tokenizer(fraction, held, tmp_path):
    """Where the hashes send every document one way, the count-aware split holds out the lowest hash
    (or keeps the highest for training); the tokenizer is trained on that split, not the hashes'.
    The held-out words are the most frequent: seen, their pairs would be the first merges."""
    words = ["abcde", "fghij", "klmno", "pqrst", "uvwxy"][:5 if fraction < 0.5 else 3]
    assert [i for i in range(len(words)) if _doc_hash(0, i) < fraction] == ([] if fraction < 0.5 else [0, 1, 2])
    docs = [" ".join([w] * (300 if i in held else 100)) for i, w in enumerate(words)]
    (tmp_path / "c.txt").write_text("\n\n".join(docs))
    m = prepare([str(tmp_path / "c.txt")], str(tmp_path / "d"), heldout_fraction=fraction, train_tokenizer=260)
    assert m["splits"]["heldout"]["documents"] == len(held)
    assert m["tokenizer"]["trained"]["documents"] == len(words) - len(held)
    vocab = tokenizer_lib.load(str(tmp_path / "d" / "tokenizer.json"))._impl.get_vocab()
    assert not [t for t in vocab if any(p in t for i in held for p in pairs(words[i]))]
    assert [t for t in vocab if len(t) > 1 and t != "<|endoftext|>"]  # it learned the others' pairs


def test_a_run_with_data_tokenizer_opens_the_data(trained):
    """--config.data.dir=DIR --config.data.tokenizer=DIR/tokenizer.json: the table has N rounded up
    to 128 rows, and the training loop's data check (its tokenizer against the manifest's) passes."""
    from onona_jax.train import loop

    root, m, _ = trained
    d = root / "data"
    cfg = tiny_config(str(d))
    cfg.data.tokenizer, cfg.model.vocab_size = str(d / "tokenizer.json"), 0
    cfg = config_lib.validate(cfg)
    assert cfg.model.vocab_size == 512
    pipeline.check_tokenizer(d, m, cfg.data)
    data = loop.open_data(cfg, str(d))
    assert len(data.sources[0].store("train")) == m["splits"]["train"]["tokens"] and int(data.val_windows.max()) < ENTRIES
    with pytest.raises(ValueError, match="was prepared with tokenizer .*tokenizer.json"):
        pipeline.check_tokenizer(d, m, {"tokenizer": "gpt2"})


def test_training_is_deterministic_across_threads_and_workers_and_ignores_max_tokens(trained):
    """The command line in a fresh process with one thread for the library, 2 workers and a
    --max_tokens cut trains a byte-identical tokenizer.json (from all the training documents) and
    writes a prefix of each split."""
    root, m, _ = trained
    cut = root / "cut"
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "onona_jax.data.prepare", "--input", str(root / "c.txt"), "--output",
                    str(cut), f"--heldout_fraction={HELDOUT}", f"--train_tokenizer={ENTRIES}", "--workers=2",
                    "--max_tokens=20_000"], check=True, cwd=REPO, env=env, capture_output=True)
    assert (cut / "tokenizer.json").read_bytes() == (root / "data" / "tokenizer.json").read_bytes()
    c = json.loads((cut / "manifest.json").read_text())
    assert c["tokenizer"]["sha256"] == m["tokenizer"]["sha256"]
    assert c["tokenizer"]["trained"] == m["tokenizer"]["trained"]
    assert c["splits"]["train"]["tokens"] + c["splits"]["heldout"]["tokens"] <= 20_000
    for split in ("train", "heldout"):
        ids = read_ids(cut, split)
        assert ids and ids == read_ids(root / "data", split)[:len(ids)], split


def test_bucket_output_uploads_the_tokenizer_and_records_its_url(trained, bucket, tmp_path):  # noqa: F811
    from etils import epath

    root, _, _ = trained
    small = tmp_path / "s.txt"
    small.write_text((root / "c.txt").read_text()[:60_000])
    m = prepare([str(small)], "gs://b/bpe", heldout_fraction=HELDOUT, train_tokenizer=300, workers=1)
    local = prepare([str(small)], str(tmp_path / "local"), heldout_fraction=HELDOUT, train_tokenizer=300, workers=1)
    assert m["tokenizer"]["config"] == {"tokenizer": "gs://b/bpe/tokenizer.json"} and m["tokenizer"]["name"] == "bpe"
    assert {k: v for k, v in m["tokenizer"].items() if k not in ("config", "name")} == \
        {k: v for k, v in local["tokenizer"].items() if k not in ("config", "name")}
    remote = epath.Path("gs://b/bpe")
    assert (remote / "tokenizer.json").read_bytes() == (tmp_path / "local" / "tokenizer.json").read_bytes()
    assert json.loads((remote / "manifest.json").read_text()) == m


# ----------------------------------------------------------------------------- refusals


@pytest.fixture
def small(tmp_path) -> Path:
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(20_000)))
    return src


@pytest.mark.parametrize("extra, words", [
    (["--train_tokenizer=257"], "--train_tokenizer=257: give the entries of the BPE to train, 258 to 262,144"),
    (["--train_tokenizer=262145"], "--train_tokenizer=262145: give the entries of the BPE to train, 258 to"),
    (["--train_tokenizer=2k"], "--train_tokenizer=2k: the entries of the BPE to train, an integer"),
    (["--train_tokenizer=512", "--tokenizer=/models/x/tokenizer.json"],
     "--train_tokenizer=512 and --tokenizer=/models/x/tokenizer.json both name the tokenizer to write with; give one"),
    (["--train_tokenizer=512", "--eot=</s>"], "--eot=</s>: settings of a given tokenizer; the one --train_tokenizer"),
    (["--train_tokenizer=512", "--tokens_column=ids"],
     "--train_tokenizer=512 trains on text, but --tokens_column=ids reads token ids"),
    (["--train_tokenizer=5000"], "--train_tokenizer=5000: the training split ("),
])
def test_bad_use_is_one_line_and_writes_nothing(extra, words, small, capfd):
    out = small.parent / "out"
    assert prepare_main(["--input", str(small), "--output", str(out), "--workers=1", *extra]) == 2
    err = capfd.readouterr().err
    [line] = errors(err)
    assert "Traceback" not in err and line.startswith(f"error: {words}"), line
    assert not out.exists() and not list(small.parent.glob("out.tmp-*"))


def test_too_small_a_corpus_names_the_entries_it_supports(small, capfd):
    """The count the error names is one a rerun can have, exactly."""
    out = small.parent / "out"
    assert prepare_main(["--input", str(small), "--output", str(out), "--train_tokenizer=5000"]) == 2
    [line] = errors(capfd.readouterr().err)
    supported = int(line.split("choose --train_tokenizer=")[1].split()[0])
    assert 258 <= supported < 5000 and not out.exists()
    assert prepare_main(["--input", str(small), "--output", str(out), f"--train_tokenizer={supported}"]) == 0
    assert tokenizer_lib.load(str(out / "tokenizer.json")).n_vocab == supported


def test_missing_tokenizers_library_names_the_install(small, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    out = small.parent / "out"
    assert prepare_main(["--input", str(small), "--output", str(out), "--train_tokenizer=512"]) == 2
    [line] = errors(capfd.readouterr().err)
    assert line == ("error: --train_tokenizer needs the `tokenizers` package (an optional dependency): "
                    "pip install -e '.[hf-tokenizer]'"), line
    assert not out.exists()
