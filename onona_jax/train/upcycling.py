"""Upcycling (SPEC §1, containment): start a model from a tied Standard run.

The body is copied and the head's parameters come from its own `Head.upcycle` (twin: A = B
= E, the gate at its initial value, since while A = B every gate value gives the Standard
model). A head that does not upcycle, or leaves a table unfilled, is refused before the
checkpoint is read: the head's method runs abstractly first.
"""

from __future__ import annotations

import sys

import jax

from onona_jax import heads as heads_lib
from onona_jax.checkpoint import restore_params


def upcycle(run, state, source: str):
    """Start a model from a tied Standard checkpoint (`source`, its latest step): the body
    copied, the head from `Head.upcycle(initialised head, E)`."""
    head = run.cfg.model.head
    cls = heads_lib.head_class(head)
    init_shapes = dict(run.abstract_params["head"])
    V, d = int(run.cfg.model.vocab_size), int(run.cfg.model.d_model)
    try:  # the head's own rule, abstractly: refused before anything is read
        jax.eval_shape(cls.upcycle, init_shapes, jax.ShapeDtypeStruct((V, d), jax.numpy.float32))
    except heads_lib.CannotUpcycle as err:
        takes = [n for n, c in heads_lib.HEADS.items() if c.upcycle is not heads_lib.Head.upcycle]
        raise ValueError(
            f"init_from={source}: upcycling fills a head's tables (twin: A and B) from a standard checkpoint's "
            f"table; head {head!r} has no A and B to fill ({err}; heads that upcycle: {', '.join(takes)})"
        ) from None
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
    new_head = cls.upcycle(dict(params["head"]), src["head"]["embedding"])
    new = jax.device_put({"trunk": src["trunk"], "head": new_head}, run.param_shardings)
    filled = [t for t in cls.tables if t in new_head]
    print(f"upcycled from {source} (step {step}): {' = '.join(filled)} = E, body copied", file=sys.stderr)
    return {**state, "params": new}
