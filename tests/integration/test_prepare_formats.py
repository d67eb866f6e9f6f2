"""prepare at scale: every input format, pre-tokenized inputs, workers, caps, bad inputs, interruption,
and data dirs in a (locally faked) bucket copied into a verified cache."""

import bz2
import fcntl
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from test_data import make_docs, read_split, split_docs

from onona_jax.data import storage, train_batches, validation_windows
from onona_jax.data import prepare as prepare_mod
from onona_jax.data import readers
from onona_jax.data.pipeline import TokenStore
from onona_jax.data.prepare import heldout_mask, main, prepare
from onona_jax.tokenizer import EOT, bundled_corpus_path, encode

REPO = Path(__file__).resolve().parents[2]
DOCS = make_docs(40, seed=4)
FRACTION, SEED = 0.25, 1


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def write_arrow_stream(path, table):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=9)


def saved_dataset(d, table):
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    d.mkdir()
    write_arrow_stream(d / "data-00000-of-00002.arrow", table.slice(0, 17))
    write_arrow_stream(d / "data-00001-of-00002.arrow", table.slice(17))
    (d / "dataset_info.json").write_text("{}")
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                                                               {"filename": "data-00001-of-00002.arrow"}]}))
    return d


def files_of(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """DOCS as a plain .txt prepared the way prepare always has: the stream every format must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    (tmp / "c.txt").write_text("\n\n".join(DOCS))
    m = prepare([str(tmp / "c.txt")], str(tmp / "data"), FRACTION, shard_tokens=150, seed=SEED)
    return tmp / "data", m


# ---------------------------------------------------------------- formats


def test_every_format_gives_the_same_shards(reference, tmp_path):
    ref, ref_m = reference
    # Independent check of the reference: each document's encoding plus one EOT, split by the hash mask.
    mask = heldout_mask(len(DOCS), FRACTION, SEED)
    assert read_split(ref, "train").tolist() == [t for d, h in zip(DOCS, mask) if not h for t in encode(d) + [EOT]]
    assert split_docs(read_split(ref, "heldout")) == [d for d, h in zip(DOCS, mask) if h]
    for split in ("train", "heldout"):  # each shard's recorded hash and size are the file's
        for sh in ref_m["splits"][split]["shards"]:
            data = (ref / sh["file"]).read_bytes()
            assert sh["sha256"] == hashlib.sha256(data).hexdigest() and sh["bytes"] == len(data) == 2 * sh["tokens"]

    # Null and empty rows are skipped like empty jsonl texts; "body" exercises --text_column.
    rows = DOCS[:5] + [None, "", "  \n"] + DOCS[5:]
    table = pa.table({"body": pa.array(rows, pa.string()), "n": pa.array(range(len(rows)))})
    recs = [{"body": d} for d in DOCS]
    inputs = {
        "jsonl.zst": write_jsonl(tmp_path / "a.jsonl.zst", recs, lambda p, m, **kw: zstandard.open(p, m, **kw)),
        "jsonl.gz": write_jsonl(tmp_path / "a.jsonl.gz", recs, gzip.open),
        "txt.bz2": None,
        "parquet": tmp_path / "a.parquet",
        "arrow file": tmp_path / "a.arrow",
        "save_to_disk dir": saved_dataset(tmp_path / "saved", table),
    }
    with bz2.open(tmp_path / "a.txt.bz2", "wt") as f:
        f.write("\n\n".join(DOCS))
    inputs["txt.bz2"] = tmp_path / "a.txt.bz2"
    pq.write_table(table, inputs["parquet"], row_group_size=7)  # several row groups
    with pa.OSFile(str(inputs["arrow file"]), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=11)
    for name, path in inputs.items():
        out = tmp_path / f"out-{name.replace(' ', '_')}"
        m = prepare([str(path)], str(out), FRACTION, shard_tokens=150, seed=SEED, text_column="body")
        assert files_of(out).keys() == files_of(ref).keys(), name
        assert {k: v for k, v in files_of(out).items() if k != "manifest.json"} == \
            {k: v for k, v in files_of(ref).items() if k != "manifest.json"}, name
        assert m["splits"] == ref_m["splits"], name
        assert m.get("text_column") == (None if name == "txt.bz2" else "body")


def test_pretokenized_inputs_are_used_as_they_are(reference, tmp_path, monkeypatch):
    ref, ref_m = reference
    ids = [encode(d) for d in DOCS]
    # Trailing EOTs in every shape: none, one, two; an all-EOT row is an empty document and skipped.
    seqs = [x + [EOT] * (i % 3) for i, x in enumerate(ids)]
    seqs.insert(3, [EOT, EOT])
    jl = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": s, "meta": i} for i, s in enumerate(seqs)])
    pqf = tmp_path / "t.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(seqs, pa.list_(pa.int32()))}), pqf, row_group_size=6)
    monkeypatch.setattr(readers, "_TABLE_ROWS", 4)  # Arrow slices within row groups, shipped to workers
    for path, workers in ((jl, 1), (pqf, 1), (pqf, 2)):
        out = tmp_path / f"out-{path.suffix[1:]}-{workers}"
        m = prepare([str(path)], str(out), FRACTION, shard_tokens=150, seed=SEED, tokens_column="input_ids",
                    workers=workers)
        assert m["splits"] == ref_m["splits"] and m["tokens_column"] == "input_ids"
        for split in ("train", "heldout"):
            assert np.array_equal(read_split(out, split), read_split(ref, split))
    # Ids are not re-tokenised: a sequence the tokenizer would never produce survives unchanged.
    odd = [[31373, 31373, 31373, 50255], [0, EOT, 1]]  # an interior EOT stays: only trailing ones are trimmed
    write_jsonl(tmp_path / "odd.jsonl", [{"ids": s} for s in odd])
    prepare([str(tmp_path / "odd.jsonl")], str(tmp_path / "odd"), 0.0, tokens_column="ids")
    assert read_split(tmp_path / "odd", "train").tolist() == [31373, 31373, 31373, 50255, EOT, 0, EOT, 1, EOT]


def test_workers_and_max_tokens_do_not_change_the_output(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text("\n\n".join(make_docs(120, seed=9)))
    monkeypatch.setattr(readers, "_BLOCK_BYTES", 600)  # ~40 tasks, many paragraphs cut across reads
    lengths = np.array([len(encode(d)) + 1 for d in make_docs(120, seed=9)])
    cap = int(lengths[:77].sum()) + 3  # mid-document: the cap keeps whole documents only
    runs = {}
    for workers in (1, 2):
        for max_tokens in (None, cap):
            out = tmp_path / f"w{workers}-{max_tokens}"
            prepare([str(tmp_path / "c.txt")], str(out), 0.1, shard_tokens=500, workers=workers,
                    max_tokens=max_tokens)
            runs[workers, max_tokens] = files_of(out)
    assert runs[1, None] == runs[2, None] and runs[1, cap] == runs[2, cap]
    # Both ways of starting workers: fork where no other thread runs (the CLI), spawn elsewhere.
    other = "spawn" if prepare_mod._start_method() == "fork" else "fork"
    if other == "spawn" or threading.active_count() == 1:
        monkeypatch.setattr(prepare_mod, "_start_method", lambda: other)
        prepare([str(tmp_path / "c.txt")], str(tmp_path / other), 0.1, shard_tokens=500, workers=2)
        assert files_of(tmp_path / other) == runs[1, None]
    m = json.loads(runs[2, cap]["manifest.json"])
    assert m["splits"]["train"]["tokens"] + m["splits"]["heldout"]["tokens"] == lengths[:77].sum()
    assert m["splits"]["train"]["documents"] + m["splits"]["heldout"]["documents"] == 77 and m["max_tokens"] == cap
    full = json.loads(runs[1, None]["manifest.json"])
    assert full["splits"]["train"]["tokens"] + full["splits"]["heldout"]["tokens"] == lengths.sum()


def test_chunk_cuts_do_not_change_documents_or_line_numbers(tmp_path, monkeypatch):
    """Tiny chunks cut everywhere: documents equal a plain text-mode read (universal newlines)."""
    rng = np.random.default_rng(0)
    pieces = ["word", "two words", "  indented", "\u00a0", " \t ", "", "caf\u00e9 \u4e2d\u6587"]
    newlines = ["\n", "\r\n", "\r"]
    raw = "".join(pieces[i] + newlines[j] for i, j in zip(rng.integers(0, 7, 400), rng.integers(0, 3, 400)))
    (tmp_path / "a.txt").write_bytes(raw.encode())
    # The reference: the line loop prepare used before chunks, over Python's text mode.
    ref, lines = [], []
    with open(tmp_path / "a.txt", encoding="utf-8", newline=None) as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                ref.append("".join(lines).strip())
                lines = []
    ref += ["".join(lines).strip()] if lines else []
    assert len(ref) > 20
    for block in (5, 64, 1 << 20):
        monkeypatch.setattr(readers, "_BLOCK_BYTES", block)
        assert list(readers.iter_documents(tmp_path / "a.txt")) == ref
    # jsonl: the line number of a bad line counts \r\n, \r and \n as text mode does.
    good = '{"text": "x"}'
    (tmp_path / "b.jsonl").write_bytes(f"{good}\r\n{good}\r{good}\n\n{good}\r\n{{bad\n".encode())
    for block in (3, 1 << 20):
        monkeypatch.setattr(readers, "_BLOCK_BYTES", block)
        with pytest.raises(ValueError, match=r"b\.jsonl:6: invalid JSON"):
            list(readers.iter_documents(tmp_path / "b.jsonl"))


# ---------------------------------------------------------------- bad inputs


def _parquet(path, **cols):
    pq.write_table(pa.table(cols), path)
    return str(path)


def _bytes(path, data):
    path.write_bytes(data)
    return str(path)


def _truncated_parquet(path):
    _parquet(path, text=DOCS)
    return [_bytes(path, path.read_bytes()[:-40])]


BAD = [
    (lambda t: [_parquet(t / "a.parquet", body=DOCS)], {}, r"a\.parquet has no column 'text'.*--text_column"),
    (lambda t: [_parquet(t / "a.parquet", text=list(range(3)))], {},
     r"'text' of .*a\.parquet has type int64, not string"),
    (lambda t: [_bytes(t / "a.parquet", b"PAR1 this is not parquet")], {}, r"cannot read .*a\.parquet as parquet"),
    (lambda t: _truncated_parquet(t / "a.parquet"), {}, r"cannot read .*a\.parquet as parquet"),
    (lambda t: [_bytes(t / "a.arrow", b"not arrow at all")], {}, r"cannot read .*a\.arrow as Arrow IPC"),
    (lambda t: [_bytes(t / "a.jsonl.zst", zstandard.compress(b'{"text": "x"}\n' * 50)[:-3])], {},
     r"cannot read .*a\.jsonl\.zst"),
    (lambda t: [_bytes(t / "c.txt", b"some text"), _parquet(t / "a.parquet", ids=[[1, 2]])],
     {"tokens_column": "ids"}, r"c\.txt is a \.txt file.*separate runs"),
    (lambda t: [_parquet(t / "a.parquet", text=DOCS)], {"tokens_column": "text"},
     r"type string, not a list of integers"),
    (lambda t: [_parquet(t / "a.parquet", ids=[[1, 2], [3, 50257]])], {"tokens_column": "ids"},
     r"a\.parquet: row 1: token id 50257 is outside the GPT-2 vocabulary"),
    (lambda t: [str(write_jsonl(t / "a.jsonl", [{"ids": [1, 2]}, {"ids": [-4]}]))], {"tokens_column": "ids"},
     r"a\.jsonl:2: token id -4 is outside"),
    (lambda t: [str(write_jsonl(t / "a.jsonl", [{"ids": [1, 2]}, {"text": "x"}]))], {"tokens_column": "ids"},
     r'a\.jsonl:2: JSONL line has no "ids" list of integer token ids'),
    (lambda t: [_bytes(t / "one.txt", b"a single document")], {},
     r"split would be empty: the inputs hold only 1 document.*at least 2 documents"),
    (lambda t: [_bytes(t / "x.parquet.gz", b"")], {}, "unknown file extension"),
]


@pytest.mark.parametrize("setup, kw, match", BAD, ids=[
    "missing-column", "non-string-column", "corrupt-parquet", "truncated-parquet", "corrupt-arrow", "truncated-zst",
    "mixed-text-and-tokens", "text-as-tokens", "id-out-of-range-parquet", "id-out-of-range-jsonl",
    "tokens-field-missing", "empty-heldout", "compressed-parquet"])
def test_bad_input_one_error_nothing_left(tmp_path, setup, kw, match):
    inputs = setup(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=match):
        prepare(inputs, str(tmp_path / "out"), 0.5, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp dir


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
    src = _parquet(tmp_path / "a.parquet", body=DOCS)
    assert main(["--input", src, "--output", str(tmp_path / "o"), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--text_column" in err[0]
    assert not (tmp_path / "o").exists()


def test_dataset_dict_dir_names_the_split_to_pass(tmp_path):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(ValueError, match=r"DatasetDict.*pass one split's directory, e\.g\. .*dd/train"):
        prepare([str(tmp_path / "dd")], str(tmp_path / "out"))


def _digest(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else "dir" for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", ["equal", "inside", "holds", "holds-file", "via-symlink", "bucket-equal"])
def test_output_overlapping_an_input_is_refused_even_with_overwrite(tmp_path, capsys, case):
    """`--input D --output D --overwrite` deleted the corpus. An output that is an input, lies
    inside an input directory or holds an input is one error line (exit 2), with or without
    --overwrite (which the line does not suggest), and nothing is read, written or removed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(DOCS))
    (tmp_path / "link").symlink_to(corpus)
    stale = tmp_path / "corpus.tmp-999999999"  # a dead prepare's leftover: removed only by a prepare that runs
    stale.mkdir()
    source, output, words = {
        "equal": (corpus, corpus, f"is the input {corpus}"),
        "inside": (corpus, corpus / "prepared", f"is inside the input directory {corpus}"),
        "holds": (corpus, tmp_path, f"holds the input {corpus}"),
        "holds-file": (corpus / "a.txt", corpus, f"holds the input {corpus / 'a.txt'}"),
        "via-symlink": (tmp_path / "link", corpus, f"is the input {tmp_path / 'link'}"),
        "bucket-equal": ("gs://b/corpus/", "gs://b/corpus", "is the input gs://b/corpus/"),
    }[case]
    before = _digest(tmp_path)
    for extra in ([], ["--overwrite"]):
        assert main(["--input", str(source), "--output", str(output), "--workers", "1", *extra]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: --output={output} {words}; give an --output apart"), line
        assert "--overwrite" not in line
        assert _digest(tmp_path) == before


def test_output_beside_its_input_file_is_fine_and_overwrite_is_offered(tmp_path, capsys):
    """The usual layout, data/corpus.txt -> data/prepared, is not an overlap; a non-empty output
    apart from the inputs is refused with --overwrite offered, and replaced with it."""
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(DOCS))
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "old.bin").write_bytes(b"x")
    args = ["--input", str(src), "--output", str(out), "--workers", "1", "--heldout_fraction", "0.25"]
    assert main(args) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: output {out} already exists and is not empty; choose another --output, or pass "
                    "--overwrite to replace it (everything in it is deleted)")
    assert main([*args, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["heldout_00000.bin", "manifest.json", "train_00000.bin"]
    assert src.read_text() == "\n\n".join(DOCS)


# ---------------------------------------------------------------- interruption


def test_stale_partial_output_is_removed_and_a_live_one_kept(reference, tmp_path):
    ref, _ = reference
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(DOCS))
    # A prepare killed with SIGKILL leaves its temp dir; its lock is free since its process is gone.
    dead = tmp_path / "out.tmp-123"
    dead.mkdir()
    (dead / ".lock").touch()
    (dead / "train_00000.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="no prepared data"):  # training never takes a partial output
        TokenStore(tmp_path / "out", "train")
    legacy = tmp_path / "out.tmp-999999999"  # made before locks existed, by a PID that is not running
    legacy.mkdir()
    live = tmp_path / "out.tmp-456"  # a prepare still running: it holds the lock
    live.mkdir()
    fd = os.open(live / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        prepare([str(src)], str(tmp_path / "out"), FRACTION, shard_tokens=150, seed=SEED)
    finally:
        os.close(fd)
    assert not dead.exists() and not legacy.exists() and live.exists()
    new, old = files_of(tmp_path / "out"), files_of(ref)  # the rerun starts clean and makes the same output
    assert json.loads(new.pop("manifest.json"))["splits"] == json.loads(old.pop("manifest.json"))["splits"]
    assert new == old


def test_sigterm_leaves_nothing_and_rerun_completes(tmp_path):
    big = tmp_path / "big.txt"
    import lzma

    text = lzma.open(bundled_corpus_path(), "rt", encoding="utf-8").read()
    big.write_text("\n\n".join([text] * 3))  # ~3M tokens: seconds of work on one core
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "onona_jax.data.prepare", "--input", str(big), "--output", str(out),
           "--workers", "1", "--shard_tokens", "100_000"]
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob("out.tmp-*/train_00001.bin")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        f"error: interrupted; {out} was not written (rerun the same command to start again)"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.txt"]
    r = subprocess.run(cmd + ["--max_tokens", "300_000"], env=env, capture_output=True, text=True)  # capped: quick
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert 299_000 < m["splits"]["train"]["tokens"] + m["splits"]["heldout"]["tokens"] <= 300_000
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.txt", "out"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except OSError:
            continue  # exited meanwhile
    return out


def _running(pid: int) -> bool:
    """A zombie (dead, not yet reaped by whoever adopted it) does not count."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's")
def test_sigkill_takes_the_workers_along_and_a_rerun_starts_clean(tmp_path):
    """kill -9 of a prepare with 2 workers (no handler can run): the workers die with it (they
    held the partial output's lock until they did), and the same command then succeeds with
    the output of an uninterrupted prepare."""
    import lzma

    big = tmp_path / "big.txt"
    text = lzma.open(bundled_corpus_path(), "rt", encoding="utf-8").read()
    big.write_text("\n\n".join([text] * 2))  # ~2M tokens: seconds of work for 2 workers
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "onona_jax.data.prepare", "--input", str(big), "--output", str(out),
           "--workers", "2", "--shard_tokens", "100_000"]
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None and not (
                len(_children(p.pid)) >= 2 and list(tmp_path.glob("out.tmp-*/train_00001.bin"))):
            time.sleep(0.01)
        workers = _children(p.pid)
        assert p.poll() is None and len(workers) >= 2, "prepare ended before it could be killed mid-work"
        p.kill()
        p.wait()
        deadline = time.time() + 5
        while any(map(_running, workers)) and time.time() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _running(w)], "workers outlived their prepare"
    finally:
        p.kill()
        for w in filter(_running, workers):  # (only when the assertion failed)
            os.kill(w, signal.SIGKILL)
    assert [x.name for x in tmp_path.glob("out.tmp-*")] and not out.exists()  # what kill -9 leaves

    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "the partial output of an interrupted prepare" in r.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["big.txt", "out"]
    clean = tmp_path / "clean"
    prepare([str(big)], str(clean), shard_tokens=100_000, workers=1)
    assert files_of(out) == files_of(clean)


# ---------------------------------------------------------------- data dir in a bucket


@pytest.fixture
def bucket(monkeypatch):
    """gs:// served from memory: etils.epath -> fsspec -> this filesystem (gcsfs's network layer is not run)."""
    import fsspec
    from etils.epath import backend
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeGCS(MemoryFileSystem):
        protocol = ("gs", "gcs")
        store, pseudo_dirs = {}, [""]

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path).split("://", 1)[-1].strip("/")
            return "/" + path if path else ""

        def __init__(self, *args, **kwargs):  # epath passes finalize_on_close=True, gcsfs's option
            super().__init__()

    from fsspec.registry import _registry

    saved = {p: _registry.get(p) for p in FakeGCS.protocol}
    for p in FakeGCS.protocol:
        fsspec.register_implementation(p, FakeGCS, clobber=True)
    fsspec.AbstractFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()
    yield FakeGCS
    for p, cls in saved.items():
        _registry.pop(p, None) if cls is None else fsspec.register_implementation(p, cls, clobber=True)
    backend.fsspec_backend._get_filesystem.cache_clear()


def upload(local, url):
    from etils import epath

    dst = epath.Path(url)
    dst.mkdir(parents=True, exist_ok=True)
    for p in Path(local).iterdir():
        (dst / p.name).write_bytes(p.read_bytes())


def test_bucket_data_dir_is_cached_verified_and_read_like_a_local_one(reference, tmp_path, bucket):
    from etils import epath

    ref, m = reference
    url, cache = "gs://bucket/corpus", str(tmp_path / "cache")
    upload(ref, url)
    local = [next(it) for it in [train_batches(ref, 16, 4, seed=3)] for _ in range(6)]
    remote_it = train_batches(url, 16, 4, seed=3, cache_dir=cache)
    assert all(np.array_equal(a, next(remote_it)) for a in local)
    assert np.array_equal(validation_windows(url, 8, 5, cache_dir=cache), validation_windows(ref, 8, 5))
    cdir = storage.cache_path(url, cache)
    cached = files_of(cdir)
    assert cached.pop(".fill.lock") == b""  # serialises the processes of one host that fill the cache
    assert cached == files_of(ref)  # manifest and every shard, byte for byte, nothing else
    # The cache is reused, not refetched: it still serves after the bucket's shards are gone.
    for p in epath.Path(url).iterdir():
        if p.name != "manifest.json":
            p.unlink()
    assert len(TokenStore(url, "train", cache_dir=cache)) == m["splits"]["train"]["tokens"]


def test_bucket_copy_detects_corruption_resumes_and_refuses_stale_or_full_cache(reference, tmp_path, bucket,
                                                                               monkeypatch):
    from etils import epath

    ref, m = reference
    url, cache = "gs://bucket/c2", str(tmp_path / "cache")
    upload(ref, url)
    shard = m["splits"]["train"]["shards"][1]
    good = (ref / shard["file"]).read_bytes()
    flipped = bytearray(good)
    flipped[10] ^= 1  # same size: only the hash can tell
    (epath.Path(url) / shard["file"]).write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=rf"{shard['file']} .*does not match .*manifest\.json .*{shard['sha256']}"):
        TokenStore(url, "train", cache_dir=cache)
    cdir = storage.cache_path(url, cache)
    assert not (cdir / shard["file"]).exists() and not list(cdir.glob(".*part*"))  # never served, no leftovers
    # Fixed bucket: the interrupted fill resumes (shard 0 was already verified and is kept).
    (epath.Path(url) / shard["file"]).write_bytes(good)
    kept = (cdir / m["splits"]["train"]["shards"][0]["file"]).stat().st_ino
    TokenStore(url, "train", cache_dir=cache)
    assert (cdir / m["splits"]["train"]["shards"][0]["file"]).stat().st_ino == kept
    assert all((cdir / s["file"]).read_bytes() == (ref / s["file"]).read_bytes()
               for s in m["splits"]["train"]["shards"])
    # Data re-prepared in the bucket: the cache is stale, and the error says how to clear it.
    manifest = json.loads((ref / "manifest.json").read_text())
    manifest["seed"] = 99
    (epath.Path(url) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"another version of {url}.*rm -rf {cdir}"):
        TokenStore(url, "train", cache_dir=cache)
    # Full disk: refused before copying, naming the config key.
    upload(ref, "gs://bucket/c3")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: types.SimpleNamespace(total=10**12, free=100))
    with pytest.raises(ValueError, match=r"0\.00 GB free .*data\.cache_dir"):
        TokenStore("gs://bucket/c3", "heldout", cache_dir=cache)
    assert not list(storage.cache_path("gs://bucket/c3", cache).glob("*.bin"))


def test_truncated_manifest_is_named(reference, tmp_path):
    ref, _ = reference
    d = tmp_path / "d"
    d.mkdir()
    for p in ref.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    (d / "manifest.json").write_bytes((ref / "manifest.json").read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"{d / 'manifest.json'} is truncated or not a prepare manifest"):
        TokenStore(d, "train")


def test_local_shards_are_verified_once_per_change(tiny_data, tmp_path):
    """A local data dir's shards are hashed against the manifest once, then again only when
    their size or mtime changes (the workdir's record; tests/integration/test_resume_compatibility.py has more), and
    a shard replaced by other ids of the same size is refused by name (issue: it trained
    silently)."""
    import shutil

    from onona_jax.data import storage

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    run = tmp_path / "run"
    run.mkdir()
    assert storage.verify_once(data, run) is True
    assert storage.verify_once(data, run) is False  # recorded: no shard read again
    shard = sorted(data.glob("train_*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[100:104] = bytes(reversed(raw[100:104])) if raw[100:104] != bytes(reversed(raw[100:104])) else b"\x01\x02\x03\x04"
    shard.write_bytes(bytes(raw))  # a new mtime: hashed again at the next start
    with pytest.raises(ValueError, match=f"shard {shard} .* does not match .*manifest.json"):
        storage.verify_once(data, run)


def test_block_hashes_cover_each_shard(reference, tmp_path):
    """Each shard's `block_sha256` is the 16-byte sha256 prefix of each `block_bytes` block (the last
    shorter), for streamed reads (onona_jax/data/stream.py); the block size does not change the shards."""
    ref, ref_m = reference
    m = prepare([str(ref.parent / "c.txt")], str(tmp_path / "d"), FRACTION, shard_tokens=150, seed=SEED,
                block_bytes=64)
    for split in ("train", "heldout"):
        for s, r in zip(m["splits"][split]["shards"], ref_m["splits"][split]["shards"], strict=True):
            data = (tmp_path / "d" / s["file"]).read_bytes()
            assert s["sha256"] == r["sha256"] and s["block_bytes"] == 64 and r["block_bytes"] == 65536
            assert s["block_sha256"] == "".join(hashlib.sha256(data[i:i + 64]).hexdigest()[:32]
                                                 for i in range(0, len(data), 64))
    assert storage.data_identity(tmp_path / "d") == storage.data_identity(ref)  # the same data
    with pytest.raises(ValueError, match="block_bytes must be a positive even number"):
        prepare([str(ref.parent / "c.txt")], str(tmp_path / "e"), block_bytes=63)
