"""onona-jax train-step variants against each other: paired rounds in one process.

    flock /tmp/onona-heavy.lock python benchmarks/step_ab.py --rounds=10 \
        --config=configs/paper.py:dense-small-standard [--config.<key>=<value> ...] \
        --variant=model.remat=attention [--variant=...]

The base is `--config` with its `--config.*` overrides; each variant is the base with its
comma-separated `key=value` overrides (values are parsed as Python literals where they parse,
else kept as strings). Every variant is compiled once (`common.jax_side`: one device, the
whole batch a step), checked to give the first-step loss of the first variant with its
`data.packing` (the base, mostly) to 1e-5 relative, then in each round every variant runs one
step, the order rotating. Prints each variant's median step time and the median over rounds of
its time / the base's time in the same round.

The batch is random token ids; `--doc_len=N` ends a document after each token with probability
1/N (GPT-2's end-of-text id), so packed documents (`--variant=data.packing=documents`) have
masks to apply: the paper's corpus averages ~1,000 tokens a document (SPEC §7).
"""

from __future__ import annotations

import statistics
import sys

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli

DEFAULT_CONFIG = f"{common.CONFIGS}:dense-small-standard"


def define(fv, argv):
    from onona_jax import config as config_lib

    common.refuse_set(argv)
    flags.DEFINE_multi_string("variant", [], "comma-separated key=value overrides of one variant (of the base: "
                              "--config and its --config.* overrides)", flag_values=fv)
    flags.DEFINE_integer("rounds", 10, "paired rounds", flag_values=fv)
    flags.DEFINE_integer("doc_len", 0, "mean document length of the batch (0: no end-of-text tokens)", flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def _main(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.rounds < 1:
        raise cli.UsageError(f"--rounds={fv.rounds}: give at least 1")
    spec, base = common.config_args(fv, argv, DEFAULT_CONFIG)
    variants = [("base", base)] + [(v, {**base, **common.parse_overrides(v, "variant")}) for v in fv.variant]
    cfgs = {name: common.jax_config(spec, overrides) for name, overrides in variants}  # bad keys: before compiling
    import numpy as np

    common.keep_freed_memory()  # as peer.py's workers may: no step pays page faults for its temporaries
    from onona_jax import packing

    steps, firsts, tokens = {}, {}, None
    for name, cfg in cfgs.items():
        if tokens is None:
            rng = np.random.default_rng(0)
            tokens = rng.integers(0, 50256, (cfg.train.global_batch, cfg.data.seq_len + 1))
            if fv.doc_len:
                tokens[rng.random(tokens.shape) < 1 / fv.doc_len] = 50256  # GPT-2's end of text
        _, _, _, step = common.jax_side(cfg)
        loss, _ = step(tokens)
        first = firsts.setdefault(packing.packed_eot(cfg), (name, loss))  # packed documents score other targets
        if abs(loss - first[1]) > 1e-5 * abs(first[1]):
            raise cli.Failure(f"{name}: first-step loss {loss} differs from {first[0]}'s {first[1]}; compare "
                              "variants that compute the same step")
        step(), step()
        steps[name] = step
        print(f"{name}: first-step loss {loss:.7f}", flush=True)
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(fv.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(steps[n]()[1])
    for n in names:
        paired = statistics.median(a / b for a, b in zip(times[n], times["base"]))
        print(f"{n:50s} median {statistics.median(times[n]):.3f} s   paired / base {paired:.3f}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__)


if __name__ == "__main__":
    common.cpu_only()  # the CPU step, as peer.py times it
    sys.exit(main())
