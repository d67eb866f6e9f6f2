"""Tokenizers: GPT-2's (bundled, the default), any tiktoken rank file, any Hugging Face
`tokenizer.json`, all offline. One spec string names one (`data.tokenizer`):

    gpt2                          the bundled GPT-2 BPE (50,257 entries; <|endoftext|> = 50256)
    path/to/x.tiktoken            a tiktoken rank file; its special tokens in data.special_tokens
                                  ("<|endoftext|>=100257,..."; default: <|endoftext|> after the ranks)
                                  and its split pattern in data.tokenizer_pattern (gpt2, cl100k,
                                  o200k or a regex; known rank files choose their own)
    path/to/tokenizer.json        a Hugging Face fast tokenizer (the `tokenizers` library), or
    path/to/folder                the folder holding one (and its tokenizer_config.json)
    size:N                        a vocabulary of N entries with no text: for planning (summary,
                                  aot) a model at another tokenizer's size; it cannot tokenize

The end-of-document token (`eot`) comes from the tokenizer: GPT-2's and tiktoken's
<|endoftext|>, a HF tokenizer's eos_token (tokenizer_config.json), else its one special token
named like an end of text; `data.eot` names it where that is ambiguous. The model's table has
`padded_vocab(multiple)` rows: the entries rounded up, so the projection tiles evenly.

`identity()` is what a data manifest records and what training and evaluation compare: the
kind, the sha256 of the tokenizer's files (and, for a rank file, of its specials and pattern),
the entries and the eot id.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import json
import os
from collections.abc import Iterable

import numpy as np

# GPT-2's numbers, for the bundled corpus, the default config and runs saved before data.tokenizer.
EOT = 50256  # <|endoftext|>
TOKENIZER_VOCAB = 50257
PADDED_VOCAB = 50304  # TOKENIZER_VOCAB rounded up to a multiple of 128 for the embedding table
DEFAULT = "gpt2"
ENDOFTEXT = "<|endoftext|>"

# tiktoken's split patterns (tiktoken_ext/openai_public.py), by the names data.tokenizer_pattern takes.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PATTERNS = {
    "gpt2": GPT2_PAT_STR,
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
    "o200k": "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
    ]),
}
# sha256 of assets/gpt2.tiktoken (identical to tiktoken's r50k_base file).
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The published rank files tiktoken knows: their pattern and special tokens, chosen by the file's hash.
KNOWN_RANKS = {
    GPT2_RANKS_SHA256: ("gpt2", {ENDOFTEXT: 50256}),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7": (
        "cl100k", {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                   "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d": (
        "o200k", {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}),
}
# Names an end-of-document special token goes by, for a HF tokenizer that does not say.
EOT_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")


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


def _sha256(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """One loaded tokenizer. `encode` reads special-token strings as ordinary text (every kind),
    so a document cannot forge an end of document."""

    spec: str  # as given (data.tokenizer)
    kind: str  # gpt2 | tiktoken | hf | size
    name: str  # for messages and exports
    n_vocab: int  # ids lie in [0, n_vocab)
    eot: int  # the end-of-document id
    eot_text: str
    sha256: str  # of the files (and, for a rank file, its specials and pattern)
    files: tuple[str, ...] = ()  # the files it was read from (export copies or converts them)
    pattern: str = ""  # a rank file's split regex
    special_tokens: tuple[tuple[str, int], ...] = ()
    _impl: object = None  # tiktoken.Encoding | tokenizers.Tokenizer | None
    _added: frozenset = frozenset()  # a HF tokenizer's added-token ids (their text is not byte-level)

    # -------------------------------------------------------------- text
    def _need_text(self):
        if self._impl is None:
            raise ValueError(f"data.tokenizer={self.spec!r} names a vocabulary size only (for planning); it has no "
                             "text: give a tokenizer (gpt2, a tiktoken rank file or a tokenizer.json) to read or write text")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no end-of-document token added)."""
        self._need_text()
        if self.kind == "hf":
            return self._impl.encode(text, add_special_tokens=False).ids
        return self._impl.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self._need_text()
        if self.kind == "hf":
            return [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]
        return self._impl.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (list or numpy array); ids of the table's padding rows (≥ n_vocab) are dropped."""
        self._need_text()
        ids = [i for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist() if 0 <= i < self.n_vocab]
        if self.kind == "hf":
            return self._impl.decode(ids, skip_special_tokens=False)
        return self._impl.decode(ids)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (a byte-level token's raw bytes, which may be part of a
        UTF-8 character); b"" for an id with no text."""
        self._need_text()
        if self.kind == "hf":
            piece = self._impl.id_to_token(int(i))
            if piece is None:
                return b""
            dec = _byte_decoder()
            if all(ch in dec for ch in piece) and int(i) not in self._added:
                return bytes(dec[ch] for ch in piece)
            return self._impl.decode([int(i)], skip_special_tokens=False).encode("utf-8")
        try:
            return self._impl.decode_single_token_bytes(int(i))
        except KeyError:
            return b""

    # -------------------------------------------------------------- shapes and identity
    @property
    def dtype(self) -> np.dtype:
        """The narrowest shard dtype that holds every id."""
        return np.dtype(np.uint16 if self.n_vocab <= 1 << 16 else np.uint32)

    def padded_vocab(self, multiple: int) -> int:
        """The model's table rows: the entries rounded up to `multiple`."""
        return -(-self.n_vocab // multiple) * multiple

    def identity(self) -> dict:
        """What a data manifest records and a run compares (two tokenizers with equal identities
        give equal ids for every text)."""
        return {"kind": self.kind, "name": self.name, "sha256": self.sha256, "vocab": self.n_vocab, "eot": self.eot}

    def describe(self) -> str:
        return f"{self.name} ({self.n_vocab:,} entries, sha256 {self.sha256[:12]}…)"


def same(a: dict, b: dict) -> bool:
    """Whether two identities name the same tokenizer (the name is only a label)."""
    keys = ("kind", "sha256", "vocab", "eot")
    return all(a.get(k) == b.get(k) for k in keys)


def manifest_identity(manifest: dict) -> dict:
    """The tokenizer identity of a data manifest; manifests written before any tokenizer could be
    chosen were all GPT-2's ({"name": "gpt2", "ranks_sha256": ...})."""
    tok = dict(manifest.get("tokenizer") or {})
    if "sha256" not in tok and tok.get("name") == "gpt2":
        return {"kind": "gpt2", "name": "gpt2", "sha256": tok.get("ranks_sha256", GPT2_RANKS_SHA256),
                "vocab": TOKENIZER_VOCAB, "eot": EOT}
    return tok


# ------------------------------------------------------------------ loading


def _parse_specials(text: str) -> dict[str, int]:
    out = {}
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = item.rpartition("=")
        if not sep or not name or not value.strip().isdigit():
            raise ValueError(f"data.special_tokens item {item!r}: expected <token>=<id>, e.g. "
                             "'<|endoftext|>=100257,<|fim_prefix|>=100258'")
        out[name] = int(value)
    return out


def _pick_eot(specials: dict[str, int], eot: str, where: str, preferred: str = "") -> tuple[str, int]:
    if eot:
        if eot not in specials:
            raise ValueError(f"data.eot={eot!r} is not a special token of {where}; its special tokens are "
                             f"{', '.join(sorted(specials)) or 'none'}")
        return eot, specials[eot]
    if preferred and preferred in specials:
        return preferred, specials[preferred]
    named = [t for t in EOT_NAMES if t in specials]
    if len(named) == 1 or (named and named[0] == ENDOFTEXT):
        return named[0], specials[named[0]]
    raise ValueError(f"{where} does not say which token ends a document (special tokens: "
                     f"{', '.join(sorted(specials)[:12]) or 'none'}{'…' if len(specials) > 12 else ''}); "
                     "name it with --config.data.eot=<token>")


def _load_gpt2() -> Tokenizer:
    import tiktoken
    import tiktoken.load

    ranks = tiktoken.load.load_tiktoken_bpe(ranks_path(), expected_hash=GPT2_RANKS_SHA256)
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={ENDOFTEXT: EOT}, explicit_n_vocab=TOKENIZER_VOCAB)
    return Tokenizer(spec=DEFAULT, kind="gpt2", name="gpt2", n_vocab=TOKENIZER_VOCAB, eot=EOT, eot_text=ENDOFTEXT,
                     sha256=GPT2_RANKS_SHA256, files=(ranks_path(),), pattern=GPT2_PAT_STR,
                     special_tokens=((ENDOFTEXT, EOT),), _impl=enc)


def _load_tiktoken(path: str, eot: str, pattern: str, special_tokens: str) -> Tokenizer:
    import tiktoken
    import tiktoken.load

    raw = open(path, "rb").read()
    file_hash = _sha256(raw)
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(path)
    except Exception as err:  # noqa: BLE001 - any parse error of the file
        raise ValueError(f"data.tokenizer={path!r} is not a tiktoken rank file (<base64 token> <rank> per line): "
                         f"{err}") from None
    known_pattern, known_specials = KNOWN_RANKS.get(file_hash, ("", {}))
    specials = _parse_specials(special_tokens) if special_tokens else dict(known_specials) or {ENDOFTEXT: len(ranks)}
    pattern = pattern or known_pattern or "gpt2"
    pat_str = PATTERNS.get(pattern, pattern)
    taken = set(ranks.values())
    clash = sorted(t for t, i in specials.items() if i in taken)
    if clash:
        raise ValueError(f"data.special_tokens: {', '.join(clash)} take ids of ordinary tokens of {path}; "
                         f"give them ids from {len(ranks)} on")
    eot_text, eot_id = _pick_eot(specials, eot, path, ENDOFTEXT)
    n_vocab = max([*ranks.values(), *specials.values()]) + 1
    name = os.path.basename(path)
    try:
        enc = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as err:  # noqa: BLE001 - a bad regex or ranks with holes
        raise ValueError(f"data.tokenizer={path!r}: tiktoken refuses it ({err}); check data.tokenizer_pattern "
                         "and data.special_tokens") from None
    extra = json.dumps({"pattern": pat_str, "special_tokens": specials}, sort_keys=True).encode()
    return Tokenizer(spec=path, kind="tiktoken", name=name, n_vocab=n_vocab, eot=eot_id, eot_text=eot_text,
                     sha256=_sha256(raw, extra), files=(path,), pattern=pat_str,
                     special_tokens=tuple(sorted(specials.items(), key=lambda kv: kv[1])), _impl=enc)


def _load_hf(path: str, eot: str) -> Tokenizer:
    try:
        import tokenizers
    except ImportError:
        raise ValueError(f"data.tokenizer={path!r} is a Hugging Face tokenizer, which needs the `tokenizers` "
                         "package: pip install -e '.[hf-tokenizer]' (or pip install tokenizers)") from None
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"data.tokenizer={path!r}: the folder has no tokenizer.json (a Hugging Face fast "
                         "tokenizer); give the file, a folder holding one, a tiktoken rank file or gpt2")
    raw = open(file, "rb").read()
    try:
        impl = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"data.tokenizer={file!r} is not a tokenizer.json the `tokenizers` library reads: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    # Special-token strings inside a document are text (as tiktoken's encode_ordinary reads them),
    # so a document cannot forge an end of document.
    impl.encode_special_tokens = True
    files = [file]
    config_eos = ""
    config_file = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_file):
        files.append(config_file)
        eos = json.loads(open(config_file, "rb").read()).get("eos_token")
        config_eos = eos.get("content", "") if isinstance(eos, dict) else (eos or "")
    added = impl.get_added_tokens_decoder()  # read once: token_bytes asks per token
    specials = {t.content: i for i, t in added.items() if t.special}
    eot_text, eot_id = _pick_eot(specials, eot, file, config_eos)
    name = os.path.basename(os.path.normpath(folder)) if os.path.basename(file) == "tokenizer.json" else os.path.basename(file)
    return Tokenizer(spec=path, kind="hf", name=name or "tokenizer.json", n_vocab=impl.get_vocab_size(with_added_tokens=True),
                     eot=eot_id, eot_text=eot_text, sha256=_sha256(raw), files=tuple(files),
                     special_tokens=tuple(sorted(specials.items(), key=lambda kv: kv[1])), _impl=impl,
                     _added=frozenset(added))


def _load_size(spec: str) -> Tokenizer:
    n = spec.partition(":")[2]
    if not n.isdigit() or int(n) < 2:
        raise ValueError(f"data.tokenizer={spec!r}: size:<entries>, e.g. size:128256")
    n = int(n)
    return Tokenizer(spec=spec, kind="size", name=spec, n_vocab=n, eot=n - 1, eot_text="", sha256=_sha256(spec.encode()))


@functools.cache
def load(spec: str = DEFAULT, eot: str = "", pattern: str = "", special_tokens: str = "") -> Tokenizer:
    """The tokenizer a spec names (module docstring); a bad spec is one ValueError naming the fix."""
    spec = str(spec or DEFAULT)
    if spec == DEFAULT and not (eot or pattern or special_tokens):
        return _load_gpt2()
    if spec.startswith("size:"):
        return _load_size(spec)
    if spec == DEFAULT:
        raise ValueError("data.eot, data.tokenizer_pattern and data.special_tokens describe a tiktoken rank file or a "
                         "HF tokenizer; gpt2 has its own (leave them empty)")
    if "://" in spec:
        raise ValueError(f"data.tokenizer={spec!r}: a tokenizer is read from local files; copy it to this machine "
                         "(it is small) and give its path")
    if not os.path.exists(spec):
        raise ValueError(f"data.tokenizer={spec!r}: no such file or folder; give gpt2, a tiktoken rank file, a "
                         "tokenizer.json or a folder holding one, or size:<entries> for planning")
    if os.path.isdir(spec) or spec.endswith(".json"):
        if pattern or special_tokens:
            raise ValueError("data.tokenizer_pattern and data.special_tokens describe a tiktoken rank file; a "
                             "tokenizer.json carries its own (leave them empty)")
        return _load_hf(spec, eot)
    return _load_tiktoken(spec, eot, pattern, special_tokens)


def from_config(data) -> Tokenizer:
    """The tokenizer of a config's `data` group (data.tokenizer and its companions)."""
    return load(str(data.get("tokenizer", DEFAULT) or DEFAULT), str(data.get("eot", "") or ""),
                str(data.get("tokenizer_pattern", "") or ""), str(data.get("special_tokens", "") or ""))


# ------------------------------------------------------------------ GPT-2 (the bundled default)


def get_tokenizer():
    """The GPT-2 tiktoken Encoding (the bundled default)."""
    return load()._impl


def encode(text: str) -> list[int]:
    """GPT-2 token ids of `text`; special-token strings are encoded as ordinary text."""
    return load().encode(text)


def decode(ids: Iterable[int]) -> str:
    """Text of GPT-2 token ids (list or numpy array); EOT decodes to '<|endoftext|>'."""
    return load().decode(ids)
