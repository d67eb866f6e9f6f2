"""Two checkouts of onona-jax against each other: paired train-step rounds, one process each.

    git worktree add /tmp/base HEAD        # the code before your change
    flock /tmp/onona-heavy.lock python benchmarks/code_ab.py --base=/tmp/base --rounds=10 \
        --head=standard --set=model.d_model=512,model.n_layers=8,...

`benchmarks/step_ab.py` compares config variants of one checkout; this compares code. Each side
is compiled by its own checkout's `benchmarks/peer.py` (`jax_side`: one device, the whole batch
a step) in a spawned process, from the same seed and batch; the first-step losses must agree
to 1e-5 relative. Round r runs one step of each side, the order alternating (`peer.paired_rounds`). Prints the
medians and the median over rounds of this checkout's time / the base's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys

from absl import app, flags

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_string("base", None, "root of the other checkout (e.g. a git worktree of HEAD)", required=True)
flags.DEFINE_string("config", "configs/paper.py:dense-small-standard", "config spec, relative to each checkout")
flags.DEFINE_string("head", "standard", "model.head")
flags.DEFINE_list("set", [], "key=value overrides for both sides")
flags.DEFINE_integer("rounds", 10, "paired rounds")
FLAGS = flags.FLAGS


def _worker(conn, root, spec, overrides, head):
    """`peer.Worker`'s protocol: ready with the first-step loss, then one step a "step"."""
    try:
        sys.path[:0] = [root, os.path.join(root, "benchmarks")]
        import numpy as np
        import peer  # this checkout's

        cfg = peer.jax_config(os.path.join(root, spec), overrides, head)
        step = peer.jax_side(cfg)[3]
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


def main(argv):
    del argv

    base = os.path.abspath(FLAGS.base)
    if not os.path.isfile(os.path.join(base, "benchmarks", "peer.py")):
        raise SystemExit(f"error: --base={FLAGS.base} is not an onona-jax checkout (no benchmarks/peer.py); "
                         "make one with `git worktree add /tmp/base HEAD`")
    extra = peer.overrides(FLAGS.set)
    ctx = mp.get_context("spawn")
    sides = [peer.Worker(ctx, name, _worker, (root, FLAGS.config, extra, FLAGS.head))
             for name, root in (("base", base), ("this", HERE))]
    try:
        first = {}
        for w, root in zip(sides, (base, HERE)):
            first[w.name] = w.ready()["loss1"]
            print(f"{w.name} ({root}): first-step loss {first[w.name]:.7f}", flush=True)
        if abs(first["this"] - first["base"]) > 1e-5 * abs(first["base"]):
            raise SystemExit(f"error: first-step losses differ ({first}): the two checkouts do not compute the "
                             "same step; compare a change that keeps the step's values, or fix the one that changed them")
        times = peer.paired_rounds(sides, FLAGS.rounds, print)
    finally:
        for w in sides:
            w.stop()
    for name, ts in times.items():
        print(f"{name}: median step {statistics.median(ts):.3f} s")
    print(f"this / base, paired: {statistics.median(b / a for a, b in zip(times['base'], times['this'])):.3f}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import peer  # this checkout's: its --set parser, Worker and errors_as_exit

    app.run(peer.errors_as_exit(main))
