import hashlib
import os

import numpy as np
import pytest
import tiktoken

from onona_jax import tokenizer as tok

TRICKY = "Hello world!  It's 2024\t— naïve café, 東京 🚀\n\n   indented\r\nx<|endoftext|>y 12345678 don't  "


def test_hello_world():
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"


def test_roundtrip_and_numpy_ids():
    ids = tok.encode(TRICKY)
    assert tok.decode(ids) == TRICKY
    assert tok.decode(np.array(ids, np.uint16)) == TRICKY
    assert max(ids) < tok.EOT


def test_eot_and_vocab_constants():
    enc = tok.get_tokenizer()
    assert tok.EOT == enc.eot_token == 50256
    assert tok.TOKENIZER_VOCAB == enc.n_vocab == 50257
    assert tok.PADDED_VOCAB == 50304 and tok.PADDED_VOCAB % 128 == 0
    assert enc.encode("<|endoftext|>", allowed_special="all") == [tok.EOT]
    assert tok.EOT not in tok.encode("<|endoftext|>")  # ordinary encode never emits the special token
    assert tok.decode([tok.EOT]) == "<|endoftext|>"
    assert tok.get_tokenizer() is enc  # cached


def test_rank_file():
    path = tok.ranks_path()
    with open(path, "rb") as f:
        data = f.read()
    assert hashlib.sha256(data).hexdigest() == tok.GPT2_RANKS_SHA256
    lines = data.splitlines()
    assert len(lines) == 50256
    assert sorted(int(line.split()[1]) for line in lines) == list(range(50256))
    assert len(tok.get_tokenizer()._mergeable_ranks) == 50256


def test_matches_tiktoken_builtin_pattern():
    # tiktoken's current r50k pattern is a rewrite of ours; both must tokenise identically.
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    enc = tok.get_tokenizer()
    ref = tiktoken.Encoding(name="ref", pat_str=openai_public.r50k_pat_str,
                            mergeable_ranks=enc._mergeable_ranks, special_tokens={"<|endoftext|>": tok.EOT})
    text = TRICKY * 3 + " " * 500 + "end\n\n\n"
    assert tok.encode(text) == ref.encode_ordinary(text)


def test_bundled_corpus_path():
    path = tok.bundled_corpus_path()
    assert path.endswith("austen.txt.xz") and os.path.getsize(path) > 1_000_000
