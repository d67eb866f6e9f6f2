"""Two checkouts of onona-jax against each other: paired train-step rounds, one process each.

    git worktree add /tmp/base HEAD        # the code before your change
    flock /tmp/onona-heavy.lock python benchmarks/code_ab.py --base=/tmp/base --rounds=10 \
        --config=configs/paper.py:dense-small-standard --config.model.d_model=512 --config.model.n_layers=8 ...

`benchmarks/step_ab.py` compares config variants of one checkout; this compares code. Each side
is compiled by its own checkout's benchmark library (`benchmarks/common.py`'s `jax_config` and
`jax_side`: one device, the whole batch a step; a checkout from before common.py has them in
`benchmarks/peer.py`) in a spawned process, from the same seed and batch. `--config` (relative
to each checkout: run this from this checkout's root; or absolute) and its `--config.*`
overrides apply to both. The first-step losses must agree to 1e-5 relative. Round r runs one
step of each side, the order alternating (`common.paired_rounds`). Prints the medians and the
median over rounds of this checkout's time / the base's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys

# Nothing of onona_jax (nor benchmarks/common.py) is imported at the top: each spawned worker
# re-imports this file, and must import those from its own checkout.
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "paper.py") + ":dense-small-standard"


def library(root: str) -> str:
    """The module of `root`'s checkout that holds jax_config and jax_side."""
    return "common" if os.path.isfile(os.path.join(root, "benchmarks", "common.py")) else "peer"


def _worker(conn, root, spec, overrides):
    """`common.Worker`'s protocol: ready with the first-step loss, then one step a "step"."""
    try:
        sys.path[:0] = [root, os.path.join(root, "benchmarks")]
        import importlib

        import numpy as np

        lib = importlib.import_module(library(root))  # this checkout's
        path = os.path.join(root, spec)
        if lib.__name__ == "common":
            cfg = lib.jax_config(path, overrides)
        else:  # a checkout from before common.py: peer.jax_config(spec, overrides, head)
            from onona_jax import config as config_lib

            cfg = lib.jax_config(path, overrides, overrides.get("model.head", config_lib.load(path).model.head))
        step = lib.jax_side(cfg)[3]
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                                   (cfg.train.global_batch, cfg.data.seq_len + 1))
        loss = step(tokens)[0]
        for _ in range(3):  # warm-up
            step()
        conn.send({"ok": True, "loss1": loss})
        while conn.recv() == "step":
            conn.send(step()[1])
    except Exception as err:  # noqa: BLE001 - reported to the parent, which fails with it
        conn.send({"ok": False, "error": f"{type(err).__name__}: {err}"})
    finally:
        conn.close()


def define(fv, argv):
    from absl import flags

    import common
    from onona_jax import config as config_lib

    common.refuse_set(argv)
    flags.DEFINE_string("base", None, "root of the other checkout (e.g. a git worktree of HEAD)", flag_values=fv)
    flags.DEFINE_integer("rounds", 10, "paired rounds", flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def _main(fv, rest, argv):
    import common  # this checkout's: Worker, paired_rounds
    from onona_jax import cli

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if not fv.base:
        raise cli.UsageError("--base is required: the root of the other checkout, e.g. made with "
                             "`git worktree add /tmp/base HEAD`")
    if fv.rounds < 1:
        raise cli.UsageError(f"--rounds={fv.rounds}: give at least 1")
    base = os.path.abspath(fv.base)
    if not os.path.isfile(os.path.join(base, "benchmarks", library(base) + ".py")):
        raise cli.UsageError(f"--base={fv.base} is not an onona-jax checkout (no benchmarks/common.py); "
                             "make one with `git worktree add /tmp/base HEAD`")
    spec, overrides = common.config_args(fv, argv, DEFAULT_CONFIG)
    if spec.startswith(HERE + os.sep):  # this checkout's config file: each side reads its own
        spec = os.path.relpath(spec, HERE)
    common.cpu_only()  # the workers inherit it
    ctx = mp.get_context("spawn")
    sides = [common.Worker(ctx, name, _worker, (root, spec, overrides))
             for name, root in (("base", base), ("this", HERE))]
    try:
        first = {}
        for w, root in zip(sides, (base, HERE)):
            first[w.name] = w.ready()["loss1"]
            print(f"{w.name} ({root}): first-step loss {first[w.name]:.7f}", flush=True)
        if abs(first["this"] - first["base"]) > 1e-5 * abs(first["base"]):
            raise cli.Failure(f"first-step losses differ ({first}): the two checkouts do not compute the same step; "
                              "compare a change that keeps the step's values, or fix the one that changed them")
        times = common.paired_rounds(sides, fv.rounds, print)
    finally:
        for w in sides:
            w.stop()
    for name, ts in times.items():
        print(f"{name}: median step {statistics.median(ts):.3f} s")
    print(f"this / base, paired: {statistics.median(b / a for a, b in zip(times['base'], times['this'])):.3f}")


def main(argv=None) -> int:
    import common

    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))  # this checkout's common.py
    sys.exit(main())
