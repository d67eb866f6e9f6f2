"""Byte-level BPE tokenizers trained here (the `tokenizers` library) on the bundled corpus, so
tests exercise tokenizers other than GPT-2's offline: 4,096 entries (uint16 shards) and about
70,000 (past 65,536: uint32 shards)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

EOT_TEXT = "<|endoftext|>"


def train_bpe(folder: Path, entries: int, chars: int = 0) -> Path:
    """A HF tokenizer folder (tokenizer.json + tokenizer_config.json naming <|endoftext|> as
    eos) of a byte-level BPE with `entries` entries (at most: the corpus may support fewer),
    <|endoftext|> = id 0. Past ~29,000 entries the corpus' words run out of merges, so merges
    may cross spaces (no regex split; lines as the unit): ~68,700 entries at min_frequency 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from onona_jax.tokenizer import bundled_corpus_path

    with lzma.open(bundled_corpus_path(), "rt") as f:
        text = f.read(chars or None)
    big = entries > 20_000
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not big)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=entries, min_frequency=1 if big else 2, special_tokens=[EOT_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=24)
    tok.train_from_iterator(text.split("\n") if big else text.split("\n\n"), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT_TEXT, "bos_token": EOT_TEXT,
         "unk_token": EOT_TEXT, "model_max_length": 1 << 20}))
    return folder
