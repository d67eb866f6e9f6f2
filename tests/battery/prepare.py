"""Data preparation (`python -m onona_jax.data.prepare`): outputs that overlap the input, an empty
split, SIGTERM and kill -9 with its workers."""

from __future__ import annotations

import lzma
import shutil
import signal
import time
from pathlib import Path

from .harness import Bench, NotHeld, case, digest, expect, ok, one_error, stop, unchanged, wait_for


@case("prepare", "prepare --input D --output D --overwrite", "the output is the input", "exit 2; D unchanged")
def prepare_onto_its_input(b: Bench):
    d = b.path("corpus")
    d.mkdir()
    shutil.copy(b.corpus, d / "a.txt")
    before = digest(d)
    res = b.prepare([d], d, "--overwrite")
    one_error(res, 2)
    unchanged(before, d, "the input")


@case("prepare", "prepare --input D --output D/out", "the output inside the input", "exit 2; nothing written")
def prepare_inside_its_input(b: Bench):
    d = b.path("corpus")
    d.mkdir()
    shutil.copy(b.corpus, d / "a.txt")
    before = digest(d)
    one_error(b.prepare([d], d / "out"), 2)
    unchanged(before, d, "the input")


@case("prepare", "prepare --heldout_fraction=0.5", "a one-document corpus (a split would be empty)",
      "exit 2 naming the empty split; no output")
def prepare_with_an_empty_split(b: Bench):
    one = b.path("one-doc.txt")
    one.write_text("It is a truth universally acknowledged.\n")
    out = b.path("out")
    res = b.run(["-m", "onona_jax.data.prepare", "--input", str(one), "--output", str(out), "--heldout_fraction=0.5"])
    one_error(res, 2, "held-out")
    expect(not out.exists(), "output written")


def big_corpus(b: Bench) -> Path:
    big = b.root / "corpus" / "big.txt"
    if not big.exists():
        from onona_jax.tokenizer import bundled_corpus_path

        with lzma.open(bundled_corpus_path(), "rt") as f:
            text = f.read()
        big.parent.mkdir(parents=True, exist_ok=True)
        big.write_text(text * 12)  # ~2 s of prepare with 2 workers on 2 idle cores: time to be interrupted
    return big


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] not in ("Z", "X"):
                found.add(int(d.name))
    return found


@case("prepare", "prepare --workers 2", "SIGTERM mid-way", "exit status of a signal; no output, no temporaries")
def prepare_sigterm(b: Bench):
    out = b.path("out")
    p = b.popen(["-m", "onona_jax.data.prepare", "--input", str(big_corpus(b)), "--output", str(out), "--workers=2"])
    try:
        wait_for(lambda: any(out.parent.glob(f"{out.name}.tmp-*")), 120, "the partial output", p)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        stop(p)
    expect(p.returncode != 0, "exit 0 after SIGTERM")
    left = [x.name for x in out.parent.glob(f"{out.name}*")]
    expect(not left, f"left behind: {left}")


@case("prepare", "prepare --workers 2", "kill -9 of prepare mid-way", "its workers gone within 5 s; a rerun equals a clean prepare")
def prepare_sigkill(b: Bench):
    out = b.path("out")
    p = b.popen(["-m", "onona_jax.data.prepare", "--input", str(b.corpus), str(big_corpus(b)), "--output", str(out),
                 "--workers=2"])
    try:
        wait_for(lambda: len(_children(p.pid)) >= 2 and any(out.parent.glob(f"{out.name}.tmp-*")), 120,
                 "two workers", p)
        workers = _children(p.pid)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 5
        while any(_state(w) not in ("Z", "X", "gone") for w in workers):
            if time.monotonic() > deadline:
                raise NotHeld(f"workers {sorted(workers)} still alive 5 s after the kill")
            time.sleep(0.1)
    finally:
        stop(p)
    clean = b.path("clean")
    ok(b.prepare([b.corpus, big_corpus(b)], clean, "--workers=2"))
    ok(b.prepare([b.corpus, big_corpus(b)], out, "--workers=2"))
    expect(digest(out) == digest(clean), "the rerun's output differs from a clean prepare's")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
