"""onona-jax train-step variants against each other: paired rounds in one process.

    flock /tmp/onona-heavy.lock python benchmarks/step_ab.py --rounds=10 \
        --base=configs/paper.py:dense-small-standard [--set=k=v,...] \
        --variant=model.remat=attention [--variant=...]

Each variant is the base config with its comma-separated `key=value` overrides (values are
parsed as Python literals where they parse, else kept as strings); `--set` applies to all. Every
variant is compiled once (`benchmarks/peer.py`'s `jax_side`: one device, the whole batch a
step), checked to give the base's first-step loss to 1e-5 relative, then in each round every
variant runs one step, the order rotating. Prints each variant's median step time and the
median over rounds of its time / the base's time in the same round.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax is imported)

flags.DEFINE_string("base", f"{peer.CONFIGS}:dense-small-standard", "config spec of the base variant")
flags.DEFINE_list("set", [], "key=value overrides applied to every variant")
flags.DEFINE_multi_string("variant", [], "comma-separated key=value overrides of one variant")
flags.DEFINE_integer("rounds", 10, "paired rounds")
FLAGS = flags.FLAGS


def main(argv):
    import numpy as np

    from onona_jax import config as config_lib

    peer.keep_freed_memory()  # as peer.py's workers do

    base_head = config_lib.load(FLAGS.base).model.head
    common = peer.overrides(FLAGS.set)
    specs = [("base", {})] + [(v, peer.overrides(v.split(","))) for v in FLAGS.variant]
    steps, first = {}, None
    for name, extra in specs:
        merged = {**common, **extra}
        head = merged.pop("model.head", base_head)
        cfg = peer.jax_config(FLAGS.base, merged, head)
        if first is None:
            tokens = np.random.default_rng(0).integers(0, 50257, (cfg.train.global_batch, cfg.data.seq_len + 1))
        _, _, _, step = peer.jax_side(cfg)
        loss, _ = step(tokens)
        first = loss if first is None else first
        if abs(loss - first) > 1e-5 * abs(first):
            raise SystemExit(f"error: {name}: first-step loss {loss} differs from the base's {first}")
        step(), step()
        steps[name] = step
        print(f"{name}: first-step loss {loss:.7f}", flush=True)
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(FLAGS.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(steps[n]()[1])
    for n in names:
        paired = statistics.median(a / b for a, b in zip(times[n], times["base"]))
        print(f"{n:50s} median {statistics.median(times[n]):.3f} s   paired / base {paired:.3f}")


if __name__ == "__main__":
    app.run(peer.errors_as_exit(main))
