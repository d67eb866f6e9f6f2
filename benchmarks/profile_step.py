"""Where a train step's time goes on this machine: per-XLA-op times from `jax.profiler`.

    flock /tmp/onona-heavy.lock python benchmarks/profile_step.py --config=configs/paper.py:dense-small-standard \
        --config.model.d_model=512 --config.model.n_layers=8 --config.model.n_heads=8 --config.model.n_kv_heads=4 \
        --config.model.head_dim=64 --config.model.d_ff=1408 --config.train.global_batch=4 --config.data.seq_len=256

Compiles the step as `benchmarks/peer.py` does (`common.jax_side`: one device, the whole batch a
step), runs `--untraced` steps (their median time, minor page faults a step and the process's
peak RSS, with or without `common.keep_freed_memory`), traces `--steps` steps and prints the `--top` ops
by time per step, each with its output shape and the JAX operation it came from (from the
compiled step's optimized HLO).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli

DEFAULT_CONFIG = f"{common.CONFIGS}:dense-small-standard"


def define(fv, argv):
    from onona_jax import config as config_lib

    common.refuse_set(argv)
    flags.DEFINE_integer("steps", 3, "traced steps", flag_values=fv)
    flags.DEFINE_integer("top", 40, "ops to print", flag_values=fv)
    flags.DEFINE_integer("untraced", 20, "untraced steps first (their times, page faults and the peak RSS)",
                         flag_values=fv)
    flags.DEFINE_bool("keep_freed_memory", False, "common.keep_freed_memory() first (default: as train.py runs)",
                      flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def _main(FLAGS, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if FLAGS.steps < 1 or FLAGS.untraced < 1 or FLAGS.top < 1:
        raise cli.UsageError("--steps, --untraced and --top must be ≥ 1")
    cfg = common.jax_config(*common.config_args(FLAGS, argv, DEFAULT_CONFIG))  # bad overrides: before XLA starts
    import resource

    import jax
    import numpy as np

    if FLAGS.keep_freed_memory:
        common.keep_freed_memory()
    step = common.jax_side(cfg)[3]
    step(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1)))
    times, faults = [], []
    for _ in range(FLAGS.untraced):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times.append(step()[1])
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"{FLAGS.untraced} untraced steps: median {statistics.median(times):.3f} s; minor page faults a step: "
          f"median {statistics.median(faults):,.0f}, max {max(faults):,}; peak RSS {rss:.2f} GiB "
          f"(keep_freed_memory={FLAGS.keep_freed_memory})")
    trace_dir = tempfile.mkdtemp(prefix="onona-trace-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(FLAGS.steps):
            step()
    events = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            total[e["name"]] += e["dur"] / 1e3 / FLAGS.steps
            count[e["name"]] += 1
    hlo = step.compiled.as_text()  # the optimized HLO names each op's shape and source
    print(f"{'ms/step':>8} {'calls':>5}  op  shape  source")
    shown = 0
    for name, ms in total.most_common():
        m = re.search(r"^\s*(?:ROOT )?%" + re.escape(name) + r" = (\S+) \w+\(.*?op_name=\"([^\"]*)\"", hlo, re.M)
        if not m:  # executor bookkeeping and Python frames, not XLA ops
            continue
        print(f"{ms:8.2f} {count[name] // FLAGS.steps:5d}  {name}  {m.group(1)}  {m.group(2)}")
        shown += 1
        if shown == FLAGS.top:
            break


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__)


if __name__ == "__main__":
    common.cpu_only()  # the step as peer.py times it: on the CPU
    sys.exit(main())
