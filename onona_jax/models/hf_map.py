"""A family's Hugging Face mapping: its parameters and config as a transformers checkpoint.

Each family declares one `HFMap` in its `Family` record (`models.register`);
`serve/hf_format.py` applies it to whole trees (layers unstacked, the head's tensors its own)
and knows no family by name. Every map is a transpose or reshape, so JAX → HF → JAX is
bit-exact. The torch side is `serve/hf/modeling_onona.py`, whose bodies (`HFMap.body`) are
dense, moe, gdn and attnres; a family whose math is none of them needs a body there too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, NamedTuple

import numpy as np


class Entry(NamedTuple):
    """One parameter: its path inside a sub-tree, its HF name, and the two layouts."""

    path: tuple[str, ...]  # inside the sub-tree (e.g. ("q",) of a layer's `attn`)
    name: str  # HF name (after `model.layers.{i}.` for a layer's)
    shape: tuple[int, ...]  # ours, without the stacked layer axis
    hf_shape: tuple[int, ...]
    transpose: bool  # torch Linear: flatten ours to [in, out], then transpose


def to_hf(x: np.ndarray, e: Entry) -> np.ndarray:
    if e.transpose:
        return np.ascontiguousarray(x.reshape(e.hf_shape[::-1]).T)
    return x.reshape(e.hf_shape)


def from_hf(y: np.ndarray, e: Entry) -> np.ndarray:
    return np.ascontiguousarray((y.T if e.transpose else y).reshape(e.shape))


class Part(NamedTuple):
    """One sub-tree of a layer (or of the trunk) as HF tensors, both ways (numpy):
    to_hf(sub-tree, cfg_model) -> {HF name: array}; from_hf(tensors by HF name, cfg_model)
    -> the sub-tree (a missing name is a KeyError, which import reports)."""

    to_hf: Callable
    from_hf: Callable


def _get(tree: Mapping, path: tuple):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def entries(declare: Callable[..., list[Entry]]) -> Part:
    """The `Part` of a sub-tree whose parameters are `declare(cfg_model)`'s entries."""

    def part_to_hf(tree, m):
        return {e.name: to_hf(_get(tree, e.path), e) for e in declare(m)}

    def part_from_hf(sd, m):
        out: dict = {}
        for e in declare(m):
            _set(out, e.path, from_hf(sd[e.name], e))
        return out

    return Part(part_to_hf, part_from_hf)


def prefixed(prefix: str, part: Part) -> Part:
    """`part` with every HF name under `prefix` (a module's state dict inside the layer's)."""
    return Part(lambda tree, m: {prefix + k: v for k, v in part.to_hf(tree, m).items()},
                lambda sd, m: part.from_hf({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, m))


def _no_fields(cfg_model) -> dict:
    return {}


def _reads_nothing(hf: dict, cfg_model) -> None:
    return None


def _no_problems(hf: dict) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class Plain:
    """transformers' own classes for the family with a plain softmax head (tied or untied)."""

    model_type: str  # e.g. qwen3
    config: str  # the transformers config class, e.g. Qwen3Config
    architecture: str  # e.g. Qwen3ForCausalLM
    fields: Callable = _no_fields  # cfg_model -> the config's fields beyond the shared Qwen3 ones
    problems: Callable = _no_problems  # HF config dict -> what import cannot read in such a checkpoint


@dataclasses.dataclass(frozen=True)
class HFMap:
    """What export and import know of a family."""

    body: str  # OnonaConfig.family: the body modeling_onona.py builds (the family's name when its own)
    layer: Mapping[str, Part]  # each sub-tree a layer may hold, by its name in our tree
    trunk: Mapping[str, Part]  # each of the trunk's other sub-trees (its final norm ...), in HF order
    plain: Plain | None = None  # transformers' own classes, for a plain softmax head
    # cfg_model -> the OnonaConfig fields of the family's own config keys (model.<family>.*).
    # Every export writes every family's (the config class's defaults replaced by the run's).
    config_fields: Callable = _no_fields
    config_from_hf: Callable = _reads_nothing  # (HF config dict, cfg_model): set those keys from it
    pattern: bool = False  # config.json carries model.layer_pattern ("" otherwise: the body's own)
