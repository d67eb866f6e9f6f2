"""Upcycling (SPEC §1, containment): start a two-table model from a tied Standard run.

A = B = E and the body copied; the gate keeps its fresh init, since while A = B every gate
value gives the Standard model. Heads declare whether they take this (`Head.upcycles`).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from onona_jax import heads as heads_lib
from onona_jax.checkpoint import restore_params


def upcycle(run, state, source: str):
    """Start a two-table model from a tied Standard checkpoint (SPEC §1, containment): A = B = E
    and the body copied; the gate keeps its fresh init, since while A = B every gate value
    gives the Standard model. `source` is the Standard run's workdir (its latest checkpoint)."""
    head = run.cfg.model.head
    if not heads_lib.head_class(head).upcycles:
        takes = [n for n in heads_lib.HEADS if heads_lib.head_class(n).upcycles]
        raise ValueError(
            f"init_from={source}: upcycling copies a standard checkpoint's table into A and B; "
            f"head {head!r} has no A and B to fill (heads that upcycle: {', '.join(takes)})"
        )
    src, step, src_cfg, _ = restore_params(source, mesh=run.mesh)
    params = state["params"]
    if src_cfg.model.head != "standard":
        raise ValueError(
            f"init_from={source}: upcycling copies a standard checkpoint's table into A and B; "
            f"got a {src_cfg.model.head!r} checkpoint for a {head!r} model"
        )
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    if shapes(src["trunk"]) != shapes(params["trunk"]):
        raise ValueError(
            f"init_from={source}: its body ({src_cfg.name}) differs from this model's "
            f"({run.cfg.name}) in structure or shapes; use the same arch, size and scan_layers"
        )
    E = src["head"]["embedding"]
    # B is a copy: the step donates its inputs, and one buffer donated twice is freed twice.
    head = {**params["head"], "A": E, "B": jnp.copy(E)}
    new = jax.device_put({"trunk": src["trunk"], "head": head}, run.param_shardings)
    print(f"upcycled from {source} (step {step}): A = B = E, body copied", file=sys.stderr)
    return {**state, "params": new}
