"""JAX ⇄ PyTorch weights, with HF transformers Qwen3 names for the body (numpy in between).

Standard head: exactly a tied `Qwen3ForCausalLM` state dict (`model.embed_tokens.weight`
is both the input table and the LM head, so there is no `lm_head.weight`).

Twin head: the body keeps its Qwen3 names, the tables get their own

    twin.A            [V, d]
    twin.B            [V, d]
    twin.gate.weight  [1, d]   the paper's nn.Linear(d, 1, bias=False)

and there is NO `model.embed_tokens.weight`: the body reads M = (A + B)/2 (pass it as
`inputs_embeds`, see `torch_ref.TwinQwen3`), so storing M would be a redundant copy that
could drift from A and B.

torch Linear weights are [out, in]; ours are [in, ..., out] (q: [d, heads, head_dim],
o: [heads, head_dim, d]); head-major flattening matches HF's `.view(..., heads, head_dim)`.
torch and transformers are imported only inside functions: the package does not need them.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np


class _Entry(NamedTuple):
    path: tuple[str, ...]  # inside our tree (below `trunk/layers/<i>` for layer entries)
    name: str  # HF name (after `model.layers.{i}.` for layer entries)
    shape: tuple[int, ...]  # ours, without the stacked layer axis
    hf_shape: tuple[int, ...]
    transpose: bool  # torch Linear: flatten ours to [in, out], then transpose


def _layer_entries(m) -> list[_Entry]:
    d, n, k, hd, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    return [
        _Entry(("attn_norm", "weight"), "input_layernorm.weight", (d,), (d,), False),
        _Entry(("attn", "q"), "self_attn.q_proj.weight", (d, n, hd), (n * hd, d), True),
        _Entry(("attn", "k"), "self_attn.k_proj.weight", (d, k, hd), (k * hd, d), True),
        _Entry(("attn", "v"), "self_attn.v_proj.weight", (d, k, hd), (k * hd, d), True),
        _Entry(("attn", "o"), "self_attn.o_proj.weight", (n, hd, d), (d, n * hd), True),
        _Entry(("attn", "q_norm", "weight"), "self_attn.q_norm.weight", (hd,), (hd,), False),
        _Entry(("attn", "k_norm", "weight"), "self_attn.k_norm.weight", (hd,), (hd,), False),
        _Entry(("mlp_norm", "weight"), "post_attention_layernorm.weight", (d,), (d,), False),
        _Entry(("mlp", "gate"), "mlp.gate_proj.weight", (d, f), (f, d), True),
        _Entry(("mlp", "up"), "mlp.up_proj.weight", (d, f), (f, d), True),
        _Entry(("mlp", "down"), "mlp.down_proj.weight", (f, d), (d, f), True),
    ]


def _global_entries(m) -> list[_Entry]:
    V, d = m.vocab_size, m.d_model
    out = [_Entry(("trunk", "final_norm", "weight"), "model.norm.weight", (d,), (d,), False)]
    if m.head == "standard":
        name = "model.embed_tokens.weight"
        out.append(_Entry(("head", "embedding"), name, (V, d), (V, d), False))
    elif m.head == "twin":
        out += [
            _Entry(("head", "A"), "twin.A", (V, d), (V, d), False),
            _Entry(("head", "B"), "twin.B", (V, d), (V, d), False),
            _Entry(("head", "gate"), "twin.gate.weight", (d,), (1, d), False),
        ]
    else:
        raise ValueError(f"no HF naming for head {m.head!r}; converter knows 'standard', 'twin'")
    return out


def _to_hf(x: np.ndarray, e: _Entry) -> np.ndarray:
    if e.transpose:
        return np.ascontiguousarray(x.reshape(e.hf_shape[::-1]).T)
    return x.reshape(e.hf_shape)


def _from_hf(y: np.ndarray, e: _Entry) -> np.ndarray:
    return np.ascontiguousarray((y.T if e.transpose else y).reshape(e.shape))


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; .float() also covers bf16, which numpy lacks
        x = x.detach().float().cpu().numpy()
    return np.array(x, dtype=np.float32)  # a writable copy, never a view of a jax buffer


def _get(tree: Mapping, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _items(m):
    """(our path, stacked-layer index or None, HF name, entry) for every parameter."""
    for e in _global_entries(m):
        yield e.path, None, e.name, e
    for i in range(m.n_layers):
        for e in _layer_entries(m):
            if m.scan_layers:
                yield ("trunk", "layers", *e.path), i, f"model.layers.{i}.{e.name}", e
            else:
                yield ("trunk", "layers", i, *e.path), None, f"model.layers.{i}.{e.name}", e


def to_hf_state_dict(params: Mapping, cfg_model) -> dict[str, np.ndarray]:
    """Our parameter tree (scanned or not, as `cfg_model.scan_layers`) -> {HF name: fp32 array}."""
    out = {}
    for path, index, name, e in _items(cfg_model):
        x = _numpy(_get(params, path))
        out[name] = _to_hf(x if index is None else x[index], e)
    return out


def from_hf_state_dict(state_dict: Mapping[str, Any], cfg_model) -> dict:
    """{HF name: torch tensor or array} -> our parameter tree (fp32 jax arrays), stacked on a
    leading layer axis when `cfg_model.scan_layers`. The inverse of `to_hf_state_dict`."""
    import jax.numpy as jnp

    items = list(_items(cfg_model))
    expected = {name for _, _, name, _ in items}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match a {cfg_model.head!r} model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    bad = [
        f"{name}: {tuple(state_dict[name].shape)} != {e.hf_shape}"
        for _, _, name, e in items
        if tuple(state_dict[name].shape) != e.hf_shape
    ]
    if bad:
        raise ValueError("shape mismatch: " + "; ".join(bad))

    flat: dict[tuple, Any] = {}
    for path, index, name, e in items:
        x = _from_hf(_numpy(state_dict[name]), e)
        if index is None:
            flat[path] = x
        else:  # scanned: collect per-layer slices, stacked below
            flat.setdefault(path, [None] * cfg_model.n_layers)[index] = x
    params: dict = {}
    for path, x in flat.items():
        _set(params, path, jnp.asarray(np.stack(x) if isinstance(x, list) else x))
    return params


def hf_qwen3_config(cfg_model, max_position_embeddings: int = 1024):
    """The `transformers.Qwen3Config` of our dense body (tied, bias-free, eager attention).

    transformers 5.x spells RoPE as `rope_parameters={"rope_type", "rope_theta"}`."""
    import transformers

    m = cfg_model
    return transformers.Qwen3Config(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.d_ff,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        hidden_act="silu",
        rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        use_cache=False,
        attn_implementation="eager",
    )


# ----------------------------------------------------------------------------- Gated DeltaNet


def gdn_to_hf(layer_params: Mapping, cfg_model) -> dict[str, np.ndarray]:
    """One of our `gdn.GatedDeltaNet` layers (its unstacked params: q, k, v, gate, a, b,
    A_log, dt_bias, conv_q, conv_k, conv_v, norm, o) -> the state dict of HF transformers'
    `Qwen3NextGatedDeltaNet` (names relative to the module) with
    linear_num_key_heads = linear_num_value_heads = H (ours has no grouped value heads).

    Layout differences, all resolved here:
      * `in_proj_qkvz` [H·(2dk+2dv), d] fuses q, k, v and the output gate z, grouped per key
        head: rows of head h are [q_h | k_h | v_h | z_h] (HF's `fix_query_key_value_ordering`).
      * `in_proj_ba` [2H, d] fuses b and a, per head [b_h | a_h] (b first).
      * `conv1d.weight` [2H·dk + H·dv, 1, K]: one depthwise conv over the concatenated
        channels [q (H·dk) | k (H·dk) | v (H·dv)], each head-major; tap K−1 weighs the
        current step in both (torch conv1d, left padding K−1).
      * `out_proj.weight` [d, H·dv]; `norm.weight` [dv] (Qwen3NextRMSNormGated: a plain
        weight, not 1 + weight); `A_log`, `dt_bias` [H] unchanged.
    Numerics that match without conversion: L2 norm x·rsqrt(Σx²+1e-6) in fp32, q scaled by
    dk^-½, g = −exp(A_log)·softplus(a + dt_bias), β = σ(b), gated norm eps = rms_norm_eps
    (set it to our norm_eps), SiLU on the conv output."""
    G = cfg_model.gdn
    H, dk, dv = G.n_heads, G.head_dim_k, G.head_dim_v
    p = {name: _numpy(x) for name, x in layer_params.items()}
    d = p["q"].shape[0]
    per_head = np.concatenate([p["q"], p["k"], p["v"], p["gate"]], axis=-1)  # [d, H, 2dk+2dv]
    ba = np.stack([p["b"], p["a"]], axis=-1)  # [d, H, 2]
    conv = np.concatenate(
        [p[f"conv_{n}"].reshape(p[f"conv_{n}"].shape[0], -1) for n in ("q", "k", "v")], axis=1
    )  # [K, 2H·dk + H·dv]
    out = {
        "in_proj_qkvz.weight": per_head.reshape(d, H * (2 * dk + 2 * dv)).T,
        "in_proj_ba.weight": ba.reshape(d, 2 * H).T,
        "conv1d.weight": conv.T[:, None, :],
        "dt_bias": p["dt_bias"],
        "A_log": p["A_log"],
        "norm.weight": p["norm"],
        "out_proj.weight": p["o"].reshape(H * dv, d).T,
    }
    return {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in out.items()}


# ----------------------------------------------------------------------------- CLI: import


def main(argv=None) -> int:
    """python -m onona_jax.convert --from_hf=DIR --workdir=OUT [--mesh=-1,1,1]

    A transformers folder (our export, or a Qwen3 / Qwen3-MoE checkpoint with a GPT-2-sized
    vocabulary) -> a workdir checkpoint at step 0 with a fresh optimizer state
    (`serve.hf_format.import_folder`)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from_hf", required=True, help="transformers model folder to import")
    ap.add_argument("--workdir", required=True, help="run directory to write (must hold no checkpoints)")
    ap.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes to place the state on")
    args = ap.parse_args(argv)
    from onona_jax.serve import hf_format

    try:
        mesh = tuple(int(x) for x in args.mesh.split(","))
        summary = hf_format.import_folder(args.from_hf, args.workdir, mesh)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # unreadable folder, full disk: nothing is overwritten
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    from onona_jax import platform

    platform.initialize()
    sys.exit(main())
