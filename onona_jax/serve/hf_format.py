"""Our parameter trees ⇄ HF transformers checkpoints, for every family and every head (numpy in between; torch and transformers are imported inside functions).

Each family declares its own names and config fields (`Family.hf`, a `models.hf_map.HFMap`,
beside the family's module); this module applies them to whole trees and knows no family by
name. The names (all families share the body's; `model.layers.<i>.` prefixes the per-layer ones):

    model.embed_tokens.weight            [V, d]  the table the body reads (see the head's below)
    model.norm.weight                    [d]
    input_layernorm.weight, post_attention_layernorm.weight            the two pre-norms
    self_attn.{q,k,v,o}_proj.weight, self_attn.{q,k}_norm.weight       attention (Qwen3)
    linear_attn.*                        Gated DeltaNet (Qwen3-Next, `gdn.to_hf`)
    mlp.{gate,up,down}_proj.weight       SwiGLU (Qwen3)
    mlp.gate.weight [E, d], mlp.experts.gate_up_proj [E, 2f, d] (gate rows first),
    mlp.experts.down_proj [E, d, f]      MoE (Qwen3-MoE, fused experts)
    attnres.{attn,mlp}_query [d], attnres.{attn,mlp}_key_norm.weight [d],
    model.final_attnres.query, model.final_attnres.key_norm.weight     Attention Residuals
    the head's parameters             each under `hf_name`: embedding -> model.embed_tokens.weight,
                                      unembedding -> lm_head.weight, A, B -> twin.A, twin.B,
                                      gate [d] -> twin.gate.weight [1, d] (the paper's Linear),
                                      mos_proj, mos_prior -> mos.proj, mos.prior, any other
                                      (a head added later) -> head.<name>
    the head's fold (`Head.fold`)     model.embed_tokens.weight = the input table the body reads
                                      (M = (A+B)/2 for twin); each of the K output tables is a
                                      stored tensor equal to it (head.outputs.<k> if derived);
                                      head.log_weights [V, K] the gate lookup, log mixture
                                      weights by input token (twin: logσ(z), logσ(−z))

The fold's tensors are derived (once at export, as serving folds); importing reads the
parameters, so JAX → HF → JAX is bit-exact. Every map is a transpose or reshape. config.json
describes the head for the standalone modeling file (`head_to_hf`), so it serves a head with
any number of tables without knowing its name.

Which class a folder loads as (`export_kind`): a family with transformers' own classes
(`HFMap.plain`: Dense, MoE) and a plain softmax head whose parameters are `embedding` (tied) or
`embedding` and `unembedding` -> `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`; every other
exported family × registered head -> `OnonaForCausalLM` from `serve/hf/modeling_onona.py`,
copied into the folder (auto_map, trust_remote_code=True).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from onona_jax import cli, heads, models, paths, staging

HEADS = tuple(heads.HEADS)  # the package's own heads (a test grid); export takes any registered head
# The HF names of head parameters (transformers' own where there is one); others: head.<name>.
HEAD_NAMES = {"embedding": "model.embed_tokens.weight", "unembedding": "lm_head.weight", "A": "twin.A",
              "B": "twin.B", "gate": "twin.gate.weight", "mos_proj": "mos.proj", "mos_prior": "mos.prior"}
INPUT = "model.embed_tokens.weight"  # the table the body reads
LOG_WEIGHTS = "head.log_weights"  # the gate lookup [V, K]
HF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
CODE_FILES = ("configuration_onona.py", "modeling_onona.py")
AUTO_MAP = {"AutoConfig": "configuration_onona.OnonaConfig",
            "AutoModelForCausalLM": "modeling_onona.OnonaForCausalLM"}
CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"  # transformers' names (save_pretrained)
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded checkpoints (read, never written)
TRAIN_CONFIG = "onona_train_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # 4.x writes the last too
# Every name an export of any kind writes (tests check each kind against it): what `--overwrite`
# replaces or removes in an existing folder; nothing else there is touched.
EXPORT_FILES = (CONFIG, WEIGHTS, GENERATION_CONFIG, *CODE_FILES, *TOKENIZER_FILES, TRAIN_CONFIG)
AGAIN = "export or download the folder again"  # the fix for a damaged folder


def families() -> dict:
    """The registered families that declare a Hugging Face mapping: {name: HFMap}."""
    return {name: fam.hf for name, fam in models.FAMILIES.items() if fam.hf is not None}


def _supported() -> str:
    plain = {name: hf.plain for name, hf in families().items() if hf.plain is not None}
    return (f"families {', '.join(families())} with any head registered in heads.HEADS ({', '.join(HEADS)}, ...); "
            f"{' and '.join(plain)} with standard or untied as {' / '.join(p.architecture for p in plain.values())}, "
            "the rest as OnonaForCausalLM")


def check_supported(m) -> None:
    if m.arch not in families() or m.head not in heads.HEADS:
        raise ValueError(f"cannot export a model with arch={m.arch!r}, head={m.head!r}; export supports {_supported()}")


def _hf(m):
    return families()[m.arch]


def export_kind(m) -> str:
    check_supported(m)
    cls = heads.head_class(m.head)
    plain = (cls.foldable() and cls.score is None and cls.gate_reads is None
             and set(head_names(m)) in ({"embedding"}, {"embedding", "unembedding"}))
    if plain and _hf(m).plain is not None:
        return _hf(m).plain.model_type
    return "onona"


# ----------------------------------------------------------------------------- per-layer trees


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; .float() also covers bf16, which numpy lacks
        x = x.detach().float().cpu().numpy()
    return np.array(x, dtype=np.float32)  # a writable copy, never a view of a jax buffer


def _layers(params, m) -> list[dict]:
    """Our trunk's layers as a list of L unstacked (numpy) trees, whatever the scan layout."""
    import jax

    trunk, L, P = params["trunk"]["layers"], m.n_layers, len(models.layer_pattern(m))
    np_tree = lambda t: jax.tree.map(_numpy, t)  # noqa: E731
    if not m.scan_layers:
        return [np_tree(trunk[i]) for i in range(L)]
    if P == 1:
        stacked = np_tree(trunk)
        return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(L)]
    groups = [np_tree(trunk[j]) for j in range(P)]
    return [jax.tree.map(lambda x, i=i: x[i // P], groups[i % P]) for i in range(L)]


def _stack_layers(layers: list[dict], m):
    """The inverse of `_layers`: the trunk's `layers` entry in m's scan layout."""
    import jax

    P = len(models.layer_pattern(m))
    if not m.scan_layers:
        return {i: layer for i, layer in enumerate(layers)}
    if P == 1:
        return jax.tree.map(lambda *xs: np.stack(xs), *layers)
    return {j: jax.tree.map(lambda *xs: np.stack(xs), *layers[j::P]) for j in range(P)}


def _layer_like(layers: Mapping, i: int, m) -> Mapping:
    """Layer i's tree (its sub-trees' names) in the trunk's `layers` entry, whatever the scan layout."""
    P = len(models.layer_pattern(m))
    return layers[i] if not m.scan_layers else layers if P == 1 else layers[i % P]


def _flat(tree, prefix=()) -> dict[tuple, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def _layer_to_hf(layer: dict, m) -> dict[str, np.ndarray]:
    """One layer's tensors, names after `model.layers.<i>.`: each sub-tree by its family's part."""
    parts, out = _hf(m).layer, {}
    for name, sub in layer.items():
        if name not in parts:
            raise ValueError(f"model.arch={m.arch!r}: its HF mapping (Family.hf) has no part for the layers' "
                             f"{name!r}; declare one in its `layer` parts")
        out.update(parts[name].to_hf(sub, m))
    return out


def _layer_from_hf(sd: Mapping[str, np.ndarray], like: Mapping, m) -> dict:
    """One layer's tree from its HF tensors (names without `model.layers.<i>.`); `like`: the
    layer's tree in the abstract model (its sub-trees' names)."""
    parts = _hf(m).layer
    tree = {name: parts[name].from_hf(sd, m) for name in like}
    return _float32(tree)


def _float32(tree):
    return {k: _float32(v) if isinstance(v, Mapping) else np.ascontiguousarray(v, dtype=np.float32)
            for k, v in tree.items()}


# ----------------------------------------------------------------------------- whole state dicts


def head_names(m) -> dict[str, tuple[int, ...]]:
    """The head's parameters by name and shape, as the head declares them (abstractly)."""
    from flax import nnx

    from onona_jax import params as params_lib

    _, state = params_lib.abstract_state(lambda: heads.make_head(m))
    return {k: tuple(v.shape) for k, v in nnx.to_pure_dict(state).items()}


def hf_name(param: str, shape) -> str:
    """The HF name of a head parameter (`HEAD_NAMES`, else `head.<name>`)."""
    if param == "gate" and len(shape) != 1:  # twin.gate.weight is the paper's nn.Linear(d, 1)
        return f"head.{param}"
    return HEAD_NAMES.get(param, f"head.{param}")


def _fold(head: dict, m):
    """The head's `Fold` (numpy, fp32 at full matmul precision), or None (not foldable)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from onona_jax import params as params_lib

    cls = heads.head_class(m.head)
    if not cls.foldable():
        return None
    graphdef, _ = params_lib.abstract_state(lambda: heads.make_head(m))
    with jax.default_matmul_precision("highest"):
        f = nnx.merge(graphdef, jax.tree.map(jnp.asarray, head)).fold()
        arrays = jax.tree.map(lambda x: np.asarray(x, np.float32), f._replace(score=None))
        return arrays._replace(score=f.score)


def head_to_hf(head: dict, m) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, description) of our head for `OnonaForCausalLM` (see modeling_onona.py).

    Tensors: every parameter under its `hf_name` (import reads these back), and the head's
    `Fold` as serving reads it: the input table the body reads is `model.embed_tokens.weight`,
    each of the K output tables is a stored tensor equal to it (a parameter, or
    `head.outputs.<k>` when it is derived), the gate lookup `head.log_weights` [V, K].
    Description (config.json): `head_rule` ("mixture", or "mos" for a head without a fold),
    `head_outputs` (the K tensors' names), `head_log_weights` (its name or ""), `head_score`
    (the mixture rule's score transform or "") and `head_tensors` (name -> shape of every
    head tensor beside the input table, which the model builds before loading)."""
    out = {hf_name(k, v.shape): (v[None, :] if hf_name(k, v.shape) == HEAD_NAMES["gate"] else v)
           for k, v in head.items()}
    fold = _fold(head, m)
    desc = dict(head_rule="mixture", head_outputs=[], head_log_weights="",
                head_score=heads.head_class(m.head).score or "")
    if fold is None:
        if set(head) - {"embedding", "mos_proj", "mos_prior"}:
            raise ValueError(f"head {m.head!r} has no fold (`Head.fold`) and is not a mixture of softmaxes; "
                             "export needs one or the other")
        desc["head_rule"] = "mos"
    else:
        if INPUT in out and not np.array_equal(out[INPUT], fold.input):
            raise ValueError(f"head {m.head!r}: its parameter stored as {INPUT} is not the input table its fold gives")
        out[INPUT] = fold.input
        for k, table in enumerate(fold.outputs):
            same = [n for n, x in out.items() if x.shape == table.shape and np.array_equal(x, table)]
            name = same[0] if same else f"head.outputs.{k}"
            out.setdefault(name, table)
            desc["head_outputs"].append(name)
        if fold.log_weights is not None:
            out[LOG_WEIGHTS] = fold.log_weights
            desc["head_log_weights"] = LOG_WEIGHTS
        desc["head_score"] = fold.score or ""
    desc["head_tensors"] = {n: list(x.shape) for n, x in out.items() if n != INPUT}
    return out, desc


def head_from_hf(sd: Mapping[str, np.ndarray], m) -> dict:
    """The inverse of `head_to_hf`: our head's parameters from the stored ones (never the
    folded tensors, which are derived)."""
    out = {}
    for k, shape in head_names(m).items():
        name = hf_name(k, shape)
        x, want = sd[name], ((1, *shape) if name == HEAD_NAMES["gate"] else shape)
        if tuple(x.shape) != want:
            raise ValueError(f"checkpoint does not fit the model config: {name}: {tuple(x.shape)} != {want}")
        out[k] = x.reshape(shape)
    return out


def to_hf_described(params, m) -> tuple[dict[str, np.ndarray], dict]:
    """(`to_hf`, the head's description for config.json: `head_to_hf`)."""
    check_supported(m)
    out = {}
    for i, layer in enumerate(_layers(params, m)):
        out.update({f"model.layers.{i}.{k}": v for k, v in _layer_to_hf(layer, m).items()})
    import jax

    trunk, parts = params["trunk"], _hf(m).trunk
    for name in set(trunk) - set(parts) - {"layers"}:
        raise ValueError(f"model.arch={m.arch!r}: its HF mapping (Family.hf) has no part for the trunk's {name!r}; "
                         "declare one in its `trunk` parts")
    for name, part in parts.items():
        out.update(part.to_hf(jax.tree.map(_numpy, trunk[name]), m))
    head, desc = head_to_hf({k: _numpy(v) for k, v in params["head"].items()}, m)
    out.update(head)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}, desc


def to_hf(params, m) -> dict[str, np.ndarray]:
    """Our parameter tree -> {HF name: fp32 array} (the module docstring's names)."""
    return to_hf_described(params, m)[0]


def from_hf(state_dict: Mapping[str, Any], m) -> dict:
    """{HF name: tensor or array} -> our parameter tree (fp32 jax arrays, m's scan layout).
    The inverse of `to_hf` (M and z are not read: A, B and w are the parameters)."""
    import jax
    import jax.numpy as jnp

    check_supported(m)
    from flax import nnx

    sd = {k: _numpy(v) for k, v in state_dict.items()}
    _, abstract = models.abstract(m)
    abstract = nnx.to_pure_dict(abstract)
    try:
        layers = []
        for i in range(m.n_layers):
            prefix = f"model.layers.{i}."
            sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
            layers.append(_layer_from_hf(sub, _layer_like(abstract["trunk"]["layers"], i, m), m))
        trunk = {"layers": _stack_layers(layers, m)}
        trunk.update({name: part.from_hf(sd, m) for name, part in _hf(m).trunk.items()})
        head = head_from_hf(sd, m)
    except KeyError as err:
        raise ValueError(f"checkpoint lacks {err.args[0]!r}, which a {m.arch}-{m.head} model needs") from None
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), {"trunk": trunk, "head": head})
    # every name and shape against the model's own: a wrong config must not load silently
    want = {p: tuple(v.shape) for p, v in _flat(abstract).items()}
    have = {p: tuple(x.shape) for p, x in _flat(params).items()}
    bad = [f"{'/'.join(map(str, p))}: {have.get(p)} != {want.get(p)}"
           for p in sorted(set(want) | set(have), key=str) if want.get(p) != have.get(p)]
    if bad:
        raise ValueError("checkpoint does not fit the model config: " + "; ".join(bad[:8]))
    return params


# ----------------------------------------------------------------------------- configs


def _common(m, max_positions: int) -> dict:
    return dict(
        vocab_size=int(m.vocab_size), hidden_size=int(m.d_model), intermediate_size=int(m.d_ff),
        num_hidden_layers=int(m.n_layers), num_attention_heads=int(m.n_heads),
        num_key_value_heads=int(m.n_kv_heads), head_dim=int(m.head_dim), hidden_act="silu",
        rms_norm_eps=float(m.norm_eps), max_position_embeddings=int(max_positions),
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        attention_bias=False, attention_dropout=0.0, use_sliding_window=False, use_cache=True,
    )


def hf_config(m, max_positions: int = 1024, head: dict | None = None, *, eot: int):
    """The transformers config object of `export_kind(m)` (eos = bos = pad = `eot`, the run's
    end-of-document token); `head` is the head's description (`head_to_hf`), which an
    OnonaConfig carries. Its vocab_size is the model's (the table's rows, padding included)."""
    import transformers

    kind, mapping = export_kind(m), _hf(m)
    common = dict(_common(m, max_positions), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    if kind != "onona":
        plain = mapping.plain
        cfg = getattr(transformers, plain.config)(**common, **plain.fields(m),
                                                  tie_word_embeddings="unembedding" not in head_names(m))
        cfg.architectures = [plain.architecture]
    else:
        OnonaConfig = _onona_config_class()
        fields = {}  # every family's fields (the class's defaults replaced by the run's config)
        for hf in families().values():
            fields.update(hf.config_fields(m))
        cfg = OnonaConfig(
            **common, **fields, family=mapping.body, head=m.head, tie_word_embeddings=False,
            layer_pattern=",".join(models.layer_pattern(m)) if mapping.pattern else "",
            mos_components=int(m.mos_components), **(head or {}),
        )
        cfg.architectures = ["OnonaForCausalLM"]
        cfg.auto_map = dict(AUTO_MAP)
    cfg.dtype = "float32"
    return cfg


def _onona_config_class():
    """OnonaConfig from the file copied into exports (imported by path: it is standalone)."""
    import importlib.util
    import sys

    name = "onona_hf_configuration"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HF_DIR, CODE_FILES[0]))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    module = sys.modules[name]
    return module.OnonaConfig


def model_config_from_hf(hf: dict, base=None):
    """Our model config (ml_collections) for a HF config dict of model_type qwen3, qwen3_moe or
    onona; `base` (a full config) supplies the keys HF does not carry (dtype, training)."""
    try:
        return _model_config_from_hf(hf, base)
    except (KeyError, TypeError) as err:  # a key missing, or a null where a number belongs
        what = f"lacks {err.args[0]!r}" if isinstance(err, KeyError) else f"has a value of the wrong type ({err})"
        raise ValueError(f"config.json {what}, which a {hf.get('model_type')} config needs; {AGAIN}") from None


def _model_config_from_hf(hf: dict, base=None):
    from onona_jax import config as config_lib

    c = base.copy_and_resolve_references() if base is not None else config_lib.base_config()
    m = c.model
    kind = hf.get("model_type")
    plain = {mapping.plain.model_type: (name, mapping.plain) for name, mapping in families().items()
             if mapping.plain is not None}
    if kind not in (*plain, "onona"):
        raise ValueError(f"model_type {kind!r}: import reads {', '.join(plain)} and onona checkpoints")
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (ours has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r} (ours is silu)")
    rope = hf.get("rope_parameters") or {"rope_type": (hf.get("rope_scaling") or {}).get("rope_type", "default"),
                                         "rope_theta": hf.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (ours is the default RoPE)")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if kind in plain:
        problems += plain[kind][1].problems(hf)
    if problems:
        raise ValueError("cannot import this checkpoint: " + "; ".join(problems))
    d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    m.update(
        arch=plain[kind][0] if kind in plain else hf.get("family"),
        head=hf.get("head") or ("standard" if hf.get("tie_word_embeddings", False) else "untied"), vocab_size=int(hf["vocab_size"]), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=n,
        n_kv_heads=int(hf.get("num_key_value_heads") or n), head_dim=int(hf.get("head_dim") or d // n),
        d_ff=int(hf["intermediate_size"]), norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=float(rope["rope_theta"]),
    )
    mapping = families().get(m.arch)
    if mapping is not None:
        mapping.config_from_hf(hf, m)
        if mapping.pattern:
            pattern = hf.get("layer_pattern") or ""
            m.layer_pattern = "" if pattern == models.FAMILIES[m.arch].layer_pattern else pattern  # "": the arch's own
    if "mos_components" in hf:
        m.mos_components = int(hf.get("mos_components", 2))
    return c  # data.tokenizer and the vocabulary's rounding: train/import_hf.py (the folder's tokenizer)


# ----------------------------------------------------------------------------- export and import


def write_tokenizer(output: str, tok=None, max_length: int = 1024) -> list[str]:
    """The run's tokenizer (`onona_jax.tokenizer.Tokenizer`; GPT-2's when None) as a HF fast
    tokenizer (tokenizer.json + tokenizer_config.json) that `AutoTokenizer.from_pretrained`
    loads and that encodes as ours; returns the files written. Its eot is the bos, eos and pad
    token (what the model was trained to end and start documents with).

    - gpt2: built offline from the bundled rank file (TikTokenConverter);
    - a tiktoken rank file: converted the same way, with the file's split pattern and its
      special tokens at their own ids;
    - a HF tokenizer: its tokenizer.json copied byte for byte (so an import of the folder gets
      the same tokenizer identity back), tokenizer_config.json written anew (below).

    tokenizer_config.json names PreTrainedTokenizerFast (which reads tokenizer.json as it is),
    the eot as bos/eos/pad, model_max_length, and keeps a HF tokenizer's chat_template and
    unk_token. (A tokenizer.json whose post-processor adds special tokens, e.g. a BOS, adds
    them in transformers' default `tok(text)`; training encoded without: pass
    add_special_tokens=False to match.)"""
    from onona_jax import tokenizer as tokenizer_lib

    tok = tok if tok is not None else tokenizer_lib.load()
    tok._need_text()  # size:N has no files
    config = {"backend": "tokenizers", "bos_token": tok.eot_text, "eos_token": tok.eot_text,
              "model_max_length": int(max_length), "pad_token": tok.eot_text,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if tok.kind == "hf":
        tokenizer_json = os.path.join(output, "tokenizer.json")
        shutil.copyfile(tok.files[0], tokenizer_json)
        original = _read_json(tok.files[1], "fix or remove it") if len(tok.files) > 1 else {}
        config.update({k: original[k] for k in ("chat_template", "unk_token") if original.get(k) is not None})
        config_path = os.path.join(output, "tokenizer_config.json")
        with open(config_path, "w") as f:
            json.dump(dict(sorted(config.items())), f, indent=2)
        return [config_path, tokenizer_json]
    return _write_converted(output, tok, config)


def _write_converted(output: str, tok, config: dict) -> list[str]:
    """A tiktoken rank file (GPT-2's included) as a HF fast tokenizer: transformers'
    TikTokenConverter (byte-level BPE, merges from the ranks, the split pattern, the special
    tokens numbered after the ranks). Special tokens that do not follow the ranks in order with
    no gap are placed in the vocabulary at their own ids first (`_converted_with_gaps`)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = dict(tok.special_tokens)  # in id order
    backend = TikTokenConverter(vocab_file=tok.files[0], pattern=tok.pattern,
                                extra_special_tokens=specials).converted()
    if any(backend.token_to_id(t) != i for t, i in specials.items()):
        backend = _converted_with_gaps(tok)
    wrong = [(t, i, backend.token_to_id(t)) for t, i in specials.items() if backend.token_to_id(t) != i]
    if wrong or max(backend.get_vocab().values()) + 1 != tok.n_vocab:
        raise ValueError(f"converting {tok.describe()} to a HF tokenizer misplaced its special tokens "
                         f"(token, id, HF id: {wrong[:3]}) or entries ({max(backend.get_vocab().values()) + 1} "
                         f"ids for {tok.n_vocab})")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=tok.eot_text, eos_token=tok.eot_text,
                                   unk_token=tok.eot_text, pad_token=tok.eot_text,
                                   model_max_length=config["model_max_length"], add_prefix_space=False)
    files = list(fast.save_pretrained(output))
    # transformers 5 records its new class name; the older alias loads in 4.x and 5.x alike.
    config_path = os.path.join(output, "tokenizer_config.json")
    with open(config_path) as f:
        tok_config = json.load(f)
    tok_config["tokenizer_class"] = config["tokenizer_class"]
    with open(config_path, "w") as f:
        json.dump(tok_config, f, indent=2)
    return files


def _converted_with_gaps(tok):
    """TikTokenConverter's tokenizer with the special tokens in the BPE vocabulary at their own
    ids (no merge makes them: only the added-token match does)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab, merges = TikTokenConverter(vocab_file=tok.files[0]).extract_vocab_merges_from_model(tok.files[0])
    vocab.update(dict(tok.special_tokens))
    backend = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    backend.model.ignore_merges = True  # as the converter: a piece that is a token is that token
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, _ in tok.special_tokens])
    return backend


def _save_safetensors(tensors: dict[str, np.ndarray], path: str):
    """safetensors' writer, whose I/O errors (a full disk) come as its own SafetensorError: an
    OSError here, with the OS's errno where its message carries one, as callers expect of a write."""
    import errno
    import re

    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})
    except SafetensorError as err:
        code = re.search(r"(?:code: |os error )(\d+)", str(err))
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number) if code else f"safetensors could not write ({err})", path) from None


def check_tokenizer(cfg, tokenizer: bool = True):
    """The run's tokenizer (`tokenizer.from_config(cfg.data)`), refused for export with its
    files (`tokenizer`) when it has none (size:N, for planning)."""
    from onona_jax import tokenizer as tokenizer_lib

    tok = tokenizer_lib.from_config(cfg.data)
    if tokenizer and tok.kind == "size":
        raise ValueError(f"data.tokenizer={tok.spec!r} names a vocabulary size only, with no tokenizer files to "
                         "export; pass --notokenizer, or set the run's real tokenizer")
    return tok


def check_output(output: str, overwrite: bool = False) -> None:
    """Refuse, before any work, an export folder that cannot be written: a file, a path under a
    file, a place without write permission, or a non-empty folder without `overwrite`."""
    if paths.is_cloud(output):
        raise ValueError(f"--output={output}: export writes a local folder; export here, then copy it "
                         "(e.g. gcloud storage cp -r)")
    out = os.path.abspath(output)
    existing = out
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == out else f"is under {existing}, which is a file"
        raise ValueError(f"--output={output} {where}; give a folder path")
    paths.check_rename_target(out, "--output", "export")
    full = os.path.isdir(out) and bool(os.listdir(out))
    if full and not overwrite:
        raise ValueError(f"--output={output} is not empty; give a new or empty folder, or pass --overwrite to "
                         f"replace the files an export writes ({', '.join(EXPORT_FILES)}) and keep the rest")
    # The folder is written beside it and moved into place (`staging`): its parent (or, not
    # made yet, the nearest directory above) must be writable; a non-empty one's files are
    # replaced inside it. Probed without making any directory.
    above = os.path.dirname(out) if existing == out else existing
    for directory in (above, out) if full else (above,):
        why = cli.unwritable(directory)
        if why:
            raise ValueError(f"--output={output}: cannot write to {directory} ({why}); give a writable place")


def _file_mode() -> int:
    """What open() gives a new file: 0666 less the umask (0644 as a rule)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _write_folder(folder: str, hf, state: dict, cfg, tok, tokenizer: bool) -> None:
    from transformers import GenerationConfig

    hf.save_pretrained(folder)
    if hf.model_type == "onona":
        for name in CODE_FILES:
            shutil.copyfile(os.path.join(HF_DIR, name), os.path.join(folder, name))
    _save_safetensors(state, os.path.join(folder, WEIGHTS))
    GenerationConfig(bos_token_id=tok.eot, eos_token_id=tok.eot, pad_token_id=tok.eot).save_pretrained(folder)
    if tokenizer:
        write_tokenizer(folder, tok, int(cfg.data.seq_len))
    with open(os.path.join(folder, TRAIN_CONFIG), "w") as f:
        f.write(cfg.to_json(indent=2))


def export(params, cfg, output: str, tokenizer: bool = True, overwrite: bool = False) -> tuple[str, list[str]]:
    """Write the HF folder of a trained model (full config `cfg`): (kind, files written).

    The folder is written beside `output` and moved into place when complete (`staging.build`),
    so a failed export leaves `output` as it was. A non-empty `output` needs `overwrite`, which
    replaces only EXPORT_FILES there (those of another kind that this export does not write are
    removed). Files get the umask's mode (safetensors' own writer
    makes model.safetensors 0600: it writes a private temporary file and renames it)."""
    m = cfg.model
    check_supported(m)
    check_output(output, overwrite)
    tok = check_tokenizer(cfg, tokenizer)  # the run's: its files, its eot (bos/eos/pad)
    state, head = to_hf_described(params, m)
    hf = hf_config(m, max(1024, int(cfg.data.seq_len)), head, eot=tok.eot)
    out = Path(os.path.abspath(output))

    def write(tmp: Path) -> list[str]:
        _write_folder(str(tmp), hf, state, cfg, tok, tokenizer)
        files, mode = sorted(n for n in os.listdir(tmp) if n != staging.LOCK), _file_mode()
        for name in files:
            os.chmod(tmp / name, mode)
        return files

    staging.remove_stale(out)
    files = staging.build(out, write, overwrite=overwrite, owned=EXPORT_FILES,
                          filled=f"--output={out} was filled by another process during the export; pass --overwrite "
                                 "to replace its export files")
    return hf.model_type, files


def _read_json(file: str, fix: str) -> dict:
    """A JSON object from `file`; anything else is one ValueError naming the file and `fix`."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def read_config(path: str) -> dict:
    """The HF config dict of a transformers folder."""
    cfg_path = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path} has no config.json; give a transformers model folder (e.g. from "
                         "`python -m onona_jax.serve.export`)")
    return _read_json(cfg_path, AGAIN)


def read_train_config(path: str) -> dict | None:
    """The training config an export of ours carries (`TRAIN_CONFIG`), or None."""
    file = os.path.join(path, TRAIN_CONFIG)
    if not os.path.isfile(file):
        return None
    cfg = _read_json(file, f"{AGAIN} (or delete it to import from config.json alone)")
    if not isinstance(cfg.get("model"), dict):
        raise ValueError(f"{file} has no model section, so it is not an onona training config; {AGAIN} "
                         "(or delete it to import from config.json alone)")
    return cfg


def _load_file(file: str) -> dict[str, np.ndarray]:
    """{name: array} of one weights file; a truncated or damaged one is a ValueError naming it
    (an unreadable one, e.g. no permission, stays an OSError)."""
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open
            from safetensors.numpy import load_file

            try:
                return load_file(file)
            except TypeError:  # bf16, which numpy lacks: through torch
                with safe_open(file, framework="pt") as f:
                    return {k: _numpy(f.get_tensor(k)) for k in f.keys()}
        import torch

        return {k: _numpy(v) for k, v in torch.load(file, map_location="cpu", weights_only=True).items()}
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' and torch's errors for a damaged file
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{file} cannot be read ({type(err).__name__}: {first}): it is truncated or damaged; "
                         f"{AGAIN}") from None


def read_weights(path: str) -> dict[str, np.ndarray]:
    """{name: fp32 array} of a transformers folder, found as transformers finds it:
    model.safetensors, else the shards its index names, else every *.safetensors file, else
    pytorch_model.bin (other weight files there, e.g. an older download's, are not read)."""
    index = os.path.join(path, WEIGHTS_INDEX)
    if os.path.isfile(os.path.join(path, WEIGHTS)):
        files = [WEIGHTS]
    elif os.path.isfile(index):
        weight_map = _read_json(index, AGAIN).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map naming the shards; {AGAIN}")
        files = sorted(set(map(str, weight_map.values())))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"{index} names {len(missing)} shard(s) that {path} lacks ({', '.join(missing[:3])}); "
                             f"copy them in or {AGAIN}")
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files and os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    if not files:
        raise ValueError(f"{path} has no *.safetensors or pytorch_model.bin weights")
    state: dict[str, np.ndarray] = {}
    for name in files:
        state.update(_load_file(os.path.join(path, name)))
    return {k: np.asarray(v, np.float32) for k, v in state.items()}
