"""GPT-2 BPE tokenizer, built offline from the bundled rank file."""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Iterable

import numpy as np
import tiktoken
import tiktoken.load

EOT = 50256  # <|endoftext|>
TOKENIZER_VOCAB = 50257
PADDED_VOCAB = 50304  # TOKENIZER_VOCAB rounded up to a multiple of 128 for the embedding table

# tiktoken's r50k_base / gpt2 pre-tokenisation pattern.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# sha256 of assets/gpt2.tiktoken (identical to tiktoken's r50k_base file).
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def _asset(name: str) -> str:
    path = importlib.resources.files("onona_jax") / "assets" / name
    if not path.is_file():
        raise FileNotFoundError(f"bundled asset {name!r} is missing from the onona_jax package ({path})")
    return str(path)


def ranks_path() -> str:
    """Path of the bundled GPT-2 rank file."""
    return _asset("gpt2.tiktoken")


def bundled_corpus_path() -> str:
    """Path of the bundled Jane Austen corpus (xz-compressed plain text)."""
    return _asset("austen.txt.xz")


@functools.cache
def get_tokenizer() -> tiktoken.Encoding:
    """The GPT-2 encoding; needs no network (expected_hash guards against a corrupt rank file)."""
    ranks = tiktoken.load.load_tiktoken_bpe(ranks_path(), expected_hash=GPT2_RANKS_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=TOKENIZER_VOCAB,
    )


def encode(text: str) -> list[int]:
    """Token ids of `text`; special-token strings are encoded as ordinary text."""
    return get_tokenizer().encode_ordinary(text)


def decode(ids: Iterable[int]) -> str:
    """Text of token ids (list or numpy array); EOT decodes to '<|endoftext|>'."""
    return get_tokenizer().decode(np.asarray(ids, dtype=np.int64).reshape(-1).tolist())
