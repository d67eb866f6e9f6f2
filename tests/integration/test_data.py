import gzip
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onona_jax.data import TokenStore, WindowSource, ensure_bundled_data, train_batches, validation_windows
from onona_jax.data.prepare import heldout_mask, main, prepare
from onona_jax.tokenizer import EOT, bundled_corpus_path, decode, encode, get_tokenizer

REPO = Path(__file__).resolve().parents[2]


def make_docs(n, seed=0):
    """n distinct documents (some spanning several lines) of varying length."""
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    docs = []
    for i in range(n):
        body = " ".join(rng.choice(words, rng.integers(3, 40)))
        docs.append(f"Document {i}: {body}." + (f"\nSecond line of {i}." if i % 3 == 0 else ""))
    return docs


def write_txt(path, docs):
    # Blank-line runs of different shapes: 2 newlines, 3 newlines, a whitespace-only line.
    seps = ["\n\n", "\n\n\n", "\n   \n"]
    text = "\n\n" + "".join(d + seps[i % 3] for i, d in enumerate(docs))
    path.write_text(text)
    return path


def read_split(data_dir, split):
    """Concatenated raw token stream of a split, read straight from the shard files."""
    m = json.loads((Path(data_dir) / "manifest.json").read_text())
    parts = [np.fromfile(Path(data_dir) / s["file"], np.uint16) for s in m["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def split_docs(stream):
    """Documents of a token stream, each terminated by exactly one EOT."""
    assert len(stream) == 0 or stream[-1] == EOT
    cuts = np.flatnonzero(stream == EOT)
    return [decode(stream[a + 1 : b]) for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """60 documents, 25% held out, 97-token shards: several shards per split."""
    tmp = tmp_path_factory.mktemp("prep")
    docs = make_docs(60)
    src = write_txt(tmp / "corpus.txt", docs)
    manifest = prepare([str(src)], str(tmp / "data"), heldout_fraction=0.25, shard_tokens=97, seed=3)
    return tmp / "data", docs, manifest


# ---------------------------------------------------------------- prepare


def test_prepare_documents_eot_and_split(prepared):
    data, docs, m = prepared
    train, held = read_split(data, "train"), read_split(data, "heldout")
    assert (train == EOT).sum() == m["splits"]["train"]["documents"]
    assert (held == EOT).sum() == m["splits"]["heldout"]["documents"]
    assert m["splits"]["train"]["documents"] + m["splits"]["heldout"]["documents"] == len(docs)
    train_docs, held_docs = split_docs(train), split_docs(held)
    assert set(train_docs).isdisjoint(held_docs)
    assert sorted(train_docs + held_docs) == sorted(docs)
    # Order within each split follows the input; the split is the deterministic hash mask.
    mask = heldout_mask(len(docs), 0.25, seed=3)
    assert train_docs == [d for d, h in zip(docs, mask) if not h]
    assert held_docs == [d for d, h in zip(docs, mask) if h]
    assert 0 < len(held_docs) < len(docs)
    # Each document is its plain encoding followed by exactly one EOT.
    assert train.tolist() == [t for d in train_docs for t in encode(d) + [EOT]]


def test_manifest_matches_files(prepared):
    data, _, m = prepared
    assert m == json.loads((data / "manifest.json").read_text())
    assert m["tokenizer"]["name"] == "gpt2" and m["eot"] == EOT and m["vocab"] == 50257 and m["dtype"] == "uint16"
    assert (m["heldout_fraction"], m["seed"]) == (0.25, 3)
    for split in ("train", "heldout"):
        shards = m["splits"][split]["shards"]
        assert len(shards) >= 2
        assert [s["file"] for s in shards] == [f"{split}_{i:05d}.bin" for i in range(len(shards))]
        for s in shards:
            assert (data / s["file"]).stat().st_size == 2 * s["tokens"]
        assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
        assert m["splits"][split]["tokens"] == sum(s["tokens"] for s in shards) == len(read_split(data, split))
    (src,) = m["sources"]
    assert src["sha256"] == hashlib.sha256(Path(src["path"]).read_bytes()).hexdigest()
    assert src["bytes"] == Path(src["path"]).stat().st_size
    assert sorted(os.listdir(data.parent)) == ["corpus.txt", "data"]  # no temp dir left behind


def test_prepare_is_deterministic(tmp_path):
    src = write_txt(tmp_path / "c.txt", make_docs(50))
    a = prepare([str(src)], str(tmp_path / "a"), heldout_fraction=0.3, seed=5)
    b = prepare([str(src)], str(tmp_path / "b"), heldout_fraction=0.3, seed=5)
    c = prepare([str(src)], str(tmp_path / "c"), heldout_fraction=0.3, seed=6)
    assert a["splits"] == b["splits"]
    assert np.array_equal(read_split(tmp_path / "a", "heldout"), read_split(tmp_path / "b", "heldout"))
    assert not np.array_equal(read_split(tmp_path / "a", "heldout"), read_split(tmp_path / "c", "heldout"))


def test_jsonl_compressed_and_directory_inputs(tmp_path):
    docs = make_docs(12)
    d = tmp_path / "in"
    d.mkdir()
    with gzip.open(d / "b.jsonl.gz", "wt") as f:  # multi-line text stays one document
        for doc in docs[4:]:
            f.write(json.dumps({"text": doc, "id": 1}) + "\n\n")
    with lzma.open(d / "a.txt.xz", "wt") as f:
        f.write("\n\n".join(docs[:4]))
    (d / "README.md").write_text("ignored: not a corpus file")
    m = prepare([str(d)], str(tmp_path / "out"), heldout_fraction=0.0)
    assert split_docs(read_split(tmp_path / "out", "train")) == docs  # sorted file order: a.txt.xz, b.jsonl.gz
    assert [Path(s["path"]).name for s in m["sources"]] == ["a.txt.xz", "b.jsonl.gz"]
    assert m["splits"]["heldout"] == {"shards": [], "tokens": 0, "documents": 0}


def test_crlf_and_whitespace_only_lines(tmp_path):
    src = tmp_path / "w.txt"
    src.write_bytes(b"one\r\nstill one\r\n\r\ntwo  \r\n \t \r\n\r\nthree\n")
    prepare([str(src)], str(tmp_path / "o"), heldout_fraction=0.0)
    assert split_docs(read_split(tmp_path / "o", "train")) == ["one\nstill one", "two", "three"]


def test_heldout_nonempty_for_tiny_corpus(tmp_path):
    src = write_txt(tmp_path / "two.txt", ["first document", "second document"])
    m = prepare([str(src)], str(tmp_path / "o"), heldout_fraction=0.001)
    assert m["splits"]["train"]["documents"] == 1 and m["splits"]["heldout"]["documents"] == 1
    for seed in range(20):  # both splits stay non-empty even when the hash would send both one way
        mask = heldout_mask(2, 0.9, seed)
        assert mask.sum() == 1


def test_output_dir_protection(tmp_path):
    src = write_txt(tmp_path / "c.txt", make_docs(5))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ValueError, match="not empty.*--overwrite"):
        prepare([str(src)], str(out))
    assert (out / "keep").exists()
    prepare([str(src)], str(out), overwrite=True)
    assert (out / "manifest.json").exists() and not (out / "keep").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "out"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda t: [str(t / "nope.txt")], "does not exist"),
        (lambda t: [_write(t / "empty.txt", "")], "no documents"),
        (lambda t: [_write(t / "blank.txt", "\n\n  \n\t\n")], "no documents"),
        (lambda t: [_write(t / "data.csv", "a,b\n")], "unknown file extension"),
        (lambda t: [_write(t / "x.jsonl", '{"text": "ok"}\n{"body": "no text"}\n')], r'x\.jsonl:2.*"text"'),
        (lambda t: [_write(t / "y.jsonl", '{"text": "ok"}\nnot json\n')], r"y\.jsonl:2.*invalid JSON"),
        (lambda t: [str((t / "emptydir").mkdir() or t / "emptydir")], "no .txt or .jsonl"),
        (lambda t: [_write_bytes(t / "latin1.txt", "café\n".encode("latin-1"))], "not valid UTF-8"),
        (lambda t: [_write_bytes(t / "fake.txt.xz", b"plain text, not xz\n")], "cannot read.*fake.txt.xz"),
    ],
)
def test_prepare_bad_input(tmp_path, setup, match):
    with pytest.raises(ValueError, match=match):
        prepare(setup(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith("out.tmp") for p in tmp_path.iterdir())


def _write(path, text):
    path.write_text(text)
    return str(path)


def _write_bytes(path, data):
    path.write_bytes(data)
    return str(path)


def test_cli_reports_errors_and_succeeds(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    src = write_txt(tmp_path / "c.txt", make_docs(10))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "onona_jax.data.prepare", "--input", str(src), "--output",
                        str(tmp_path / "o"), "--heldout_fraction", "0.2", "--shard_tokens", "1_000"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" not in r.stderr
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["shard_tokens"] == 1000


def test_token_id_out_of_vocab(prepared, tmp_path):
    data, _, m = prepared
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in data.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    shard = m["splits"]["train"]["shards"][1]
    tokens = np.fromfile(bad / shard["file"], np.uint16)
    tokens[17] = 50300  # same size, so only the id scan can catch it
    tokens.tofile(bad / shard["file"])
    with pytest.raises(ValueError, match=rf"{shard['file']}.*50300 at position 17.*tokenizer"):
        TokenStore(bad, "train")
    # A larger explicit vocabulary accepts it.
    assert len(TokenStore(bad, "train", vocab_size=50304)) == m["splits"]["train"]["tokens"]


def test_store_errors(prepared, tmp_path):
    data, _, m = prepared
    with pytest.raises(ValueError, match=r"manifest\.json.*python -m onona_jax\.data\.prepare --input"):
        TokenStore(tmp_path / "nowhere", "train")
    # Truncated shard: sizes must match the manifest.
    short = tmp_path / "short"
    short.mkdir()
    for p in data.iterdir():
        (short / p.name).write_bytes(p.read_bytes())
    first = m["splits"]["train"]["shards"][0]["file"]
    (short / first).write_bytes((short / first).read_bytes()[:-2])
    with pytest.raises(ValueError, match=rf"{first} has \d+ bytes"):
        TokenStore(short, "train")
    # Empty held-out split.
    src = write_txt(tmp_path / "c.txt", make_docs(5))
    prepare([str(src)], str(tmp_path / "nohold"), heldout_fraction=0.0)
    with pytest.raises(ValueError, match="'heldout'.*empty"):
        TokenStore(tmp_path / "nohold", "heldout")
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenStore(data, "heldout").num_windows(10**6)


# ---------------------------------------------------------------- windows


def test_windows_are_exact_slices_across_shards(prepared):
    data, _, _ = prepared
    stream = read_split(data, "train")
    store = TokenStore(data, "train")
    assert len(store) == len(stream) and len(store.shards) >= 3
    seq_len = 40
    src = WindowSource(store, seq_len)
    w = seq_len + 1
    assert len(src) == store.num_windows(seq_len) == len(stream) // w
    crosses = 0
    for i in range(len(src)):
        win = src[i]
        assert win.dtype == np.int32 and win.shape == (w,)
        assert np.array_equal(win, stream[i * w : (i + 1) * w])
        crosses += any(i * w < b < (i + 1) * w for b in store.offsets[1:-1])
    assert crosses > 0
    with pytest.raises(IndexError):
        src[len(src)]
    rng = np.random.default_rng(0)
    for a, b in np.sort(rng.integers(0, len(stream) + 1, (20, 2)), axis=1):
        assert np.array_equal(store.read(a, b), stream[a:b])


# ---------------------------------------------------------------- train batches


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A train split of a few dozen 17-token windows over several shards, plus a held-out split."""
    tmp = tmp_path_factory.mktemp("big")
    src = write_txt(tmp / "c.txt", make_docs(80, seed=1))
    prepare([str(src)], str(tmp / "data"), heldout_fraction=0.1, shard_tokens=300)
    return tmp / "data"


def window_ids(data, seq_len):
    src = WindowSource(TokenStore(data, "train"), seq_len)
    table = {src[i].tobytes(): i for i in range(len(src))}
    assert len(table) == len(src)  # windows are distinct, so a row identifies its window
    return src, table


def take(it, n):
    return [next(it) for _ in range(n)]


def test_epochs_visit_each_window_once_in_a_fixed_order(big):
    seq_len, G = 16, 8
    src, table = window_ids(big, seq_len)
    n = len(src)
    assert n % G != 0  # so epochs straddle batches
    batches = take(train_batches(big, seq_len, G, seed=7), (3 * n) // G + 1)
    assert all(b.shape == (G, seq_len + 1) and b.dtype == np.int32 for b in batches)
    ids = [table[row.tobytes()] for b in batches for row in b]
    assert sorted(ids[:n]) == list(range(n))
    assert ids[:n] != list(range(n))  # shuffled
    assert ids[n : 2 * n] == ids[:n] and ids[2 * n : 3 * n] == ids[:n]  # same permutation every epoch
    other = [table[row.tobytes()] for b in take(train_batches(big, seq_len, G, seed=8), 2) for row in b]
    assert other != ids[: 2 * G]


def test_process_shares_compose_the_global_batch(big):
    seq_len, G = 16, 8
    full = take(train_batches(big, seq_len, G, seed=2), 9)
    for P in (2, 4):
        shares = [take(train_batches(big, seq_len, G, seed=2, process_index=p, process_count=P), 9) for p in range(P)]
        for step in range(9):
            assert all(s[step].shape == (G // P, seq_len + 1) for s in shares)
            assert np.array_equal(np.concatenate([s[step] for s in shares]), full[step])
    with pytest.raises(ValueError, match="global_batch 8 is not divisible by process_count 3"):
        train_batches(big, seq_len, G, process_count=3)


def test_resume_from_state_and_start_step(big):
    seq_len, G = 16, 4
    ref = take(train_batches(big, seq_len, G, seed=1), 40)
    it = train_batches(big, seq_len, G, seed=1)
    take(it, 25)
    state = json.loads(json.dumps(it.get_state()))
    assert state["step"] == 25
    resumed = train_batches(big, seq_len, G, seed=1, read_threads=0, prefetch=0)
    resumed.set_state(state)
    assert all(np.array_equal(a, b) for a, b in zip(take(resumed, 15), ref[25:]))
    started = train_batches(big, seq_len, G, seed=1, start_step=25)
    assert all(np.array_equal(a, b) for a, b in zip(take(started, 15), ref[25:]))
    # A state only resumes the stream it came from; the process layout may change.
    train_batches(big, seq_len, G, seed=1, process_index=1, process_count=2).set_state(state)
    with pytest.raises(ValueError, match="different config.*seed"):
        train_batches(big, seq_len, G, seed=2).set_state(state)


@pytest.mark.parametrize("read_threads,prefetch", [(0, 0), (4, 4), (8, 32)])
def test_read_threads_and_prefetch_keep_the_batches(big, read_threads, prefetch):
    """data.read_threads and data.prefetch change how batches are read, never which (grain
    keeps the order), so they are resumable keys: the same 30 batches as one thread and
    prefetch 2, and a resume from a state saved at another setting continues the stream."""
    seq_len, G = 16, 8
    ref = take(train_batches(big, seq_len, G, seed=3), 30)
    it = train_batches(big, seq_len, G, seed=3, read_threads=read_threads, prefetch=prefetch)
    assert all(np.array_equal(a, b) for a, b in zip(take(it, 20), ref))
    resumed = train_batches(big, seq_len, G, seed=3)
    resumed.set_state(it.get_state())
    assert all(np.array_equal(a, b) for a, b in zip(take(resumed, 10), ref[20:]))


@pytest.mark.parametrize("key,value,message", [
    ("read_threads", -1, "data.read_threads=-1 must be an integer ≥ 0"),
    ("prefetch", -3, "data.prefetch=-3 must be an integer ≥ 0"),
    ("read_threads", 8, "data.prefetch=2 is below data.read_threads=8"),
])
def test_bad_read_options_name_the_key(key, value, message):
    from onona_jax import config

    cfg = config.load(f"{REPO}/configs/paper.py:dense-tiny-twin")
    cfg.data[key] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate(cfg)


# ---------------------------------------------------------------- validation windows


def test_validation_windows(big):
    seq_len = 8
    held = WindowSource(TokenStore(big, "heldout"), seq_len)
    n = len(held)
    count = n // 2
    v = validation_windows(big, seq_len, count)
    assert v.shape == (count, seq_len + 1) and v.dtype == np.int32
    assert np.array_equal(v, validation_windows(big, seq_len, count, seed=1234))
    assert not np.array_equal(v, validation_windows(big, seq_len, count, seed=99))
    assert len({row.tobytes() for row in v}) == count
    ids = np.sort(np.random.default_rng(1234).choice(n, count, replace=False))
    assert np.array_equal(v, np.stack([held[i] for i in ids]))
    heldout_stream = read_split(big, "heldout").tobytes()
    assert all(row.astype(np.uint16).tobytes() in heldout_stream for row in v)
    with pytest.raises(ValueError, match=rf"only {n} windows.*{n + 1} were requested.*heldout_fraction"):
        validation_windows(big, seq_len, n + 1)
    assert validation_windows(big, seq_len, n).shape == (n, seq_len + 1)


# ---------------------------------------------------------------- bundled corpus


def test_bundled_corpus_end_to_end(tmp_path):
    data = tmp_path / "austen"
    assert ensure_bundled_data(data, seq_len=256) == str(data)
    m = json.loads((data / "manifest.json").read_text())
    # Independent reference: paragraphs split at blank-line runs, each encoded + one EOT.
    text = lzma.open(bundled_corpus_path(), "rt", encoding="utf-8").read()
    docs = [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    lengths = [len(ids) + 1 for ids in get_tokenizer().encode_ordinary_batch(docs, num_threads=2)]
    train, held = m["splits"]["train"], m["splits"]["heldout"]
    assert train["documents"] + held["documents"] == len(docs) > 5000
    assert train["tokens"] + held["tokens"] == sum(lengths)
    mask = heldout_mask(len(docs), 0.02, 0)
    assert held["tokens"] == sum(n for n, h in zip(lengths, mask) if h)
    assert 0.01 < held["documents"] / len(docs) < 0.03
    assert 900_000 < train["tokens"] < 1_100_000
    # Second call reuses the prepared data instead of preparing again.
    stamp = (data / "manifest.json").stat().st_mtime_ns
    ensure_bundled_data(data, seq_len=256)
    assert (data / "manifest.json").stat().st_mtime_ns == stamp
    assert next(train_batches(data, 256, 4)).shape == (4, 257)
    assert validation_windows(data, 256, 16).shape == (16, 257)
