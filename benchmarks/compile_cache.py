"""Compile time of a first and a second start with the persistent compilation cache (issue 27).

    python benchmarks/compile_cache.py                          # dense-small-twin, train.py on this CPU
    python benchmarks/compile_cache.py --config=configs/paper.py:dense-tiny-twin --config.data.seq_len=64
    python benchmarks/compile_cache.py --aot_config=configs/paper.py:dense-142m-twin --aot_topology=v5e-16

Each start is a new process with an empty in-memory cache, sharing one fresh cache directory
(train.compile_cache, default threshold train.compile_cache_min_s = 1 s):

* train: `python train.py` for one step (`--config` and its `--config.*` overrides), twice (a
  fresh workdir each; the second reads the data the first prepared); the figure is the first
  logged step's `compile_s` (the train step's compile, or its load from the cache) and
  `compile_cache_hits`.
* aot (with --aot_config): `python -m onona_jax.aot` twice, deviceless with libtpu, under
  `flock /tmp/onona-heavy.lock` (heavy compiles queue on that lock), the cache turned on through
  JAX_COMPILATION_CACHE_DIR (`onona_jax.aot` leaves it off: README, "Compilation cache"); the
  figure is the report's train-step `compile_s` (lower + compile).

Prints one JSON object with both starts' seconds per part.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli, paths

DEFAULT_CONFIG = "configs/paper.py:dense-small-twin"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define(fv, argv):
    from onona_jax import config as config_lib

    flags.DEFINE_string("aot_config", "", "also time `python -m onona_jax.aot` of this config (e.g. "
                        "configs/paper.py:dense-142m-twin)", flag_values=fv)
    flags.DEFINE_string("aot_topology", "v5e-16", "the AOT compile's slice", flag_values=fv)
    flags.DEFINE_string("aot_remat", "attention", "model.remat of the AOT compile (docs/SCALING.md: --fit's plan "
                        "for dense-142m on v5e-16)", flag_values=fv)
    flags.DEFINE_string("lock", "/tmp/onona-heavy.lock", "flock file the AOT compiles queue on ('' for none)",
                        flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def env(**extra):
    out = dict(os.environ, **extra)
    out.pop("ONONA_COMPILE_CACHE", None)  # the cache is given explicitly
    out["PYTHONPATH"] = REPO + os.pathsep + out.get("PYTHONPATH", "")
    return out


def run(cmd, **extra_env) -> tuple[float, str]:
    began = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env(**extra_env), capture_output=True, text=True)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise cli.Failure(f"{' '.join(cmd)} failed with exit status {p.returncode}: {last}")
    return time.perf_counter() - began, p.stdout


def train_start(config_args: list[str], cache: str, workdir: str, data_dir: str) -> dict:
    """One `train.py` start of one step; `config_args`: the `--config=` and `--config.*` arguments."""
    wall, _ = run([sys.executable, "train.py", *config_args, f"--workdir={workdir}",
                   f"--config.train.compile_cache={cache}", f"--config.data.dir={data_dir}",
                   "--config.train.steps=1", "--config.train.log_every=1", "--config.eval.windows=8",
                   "--config.mesh.data=1"])
    first = json.loads(open(paths.Workdir(workdir).metrics).readline())
    return {"compile_s": round(first["compile_s"], 2), "compile_cache_hits": first["compile_cache_hits"],
            "process_s": round(wall, 1)}


def aot_start(fv, cache: str) -> dict:
    cmd = [sys.executable, "-m", "onona_jax.aot", f"--config={fv.aot_config}", f"--topology={fv.aot_topology}",
           "--config.mesh.data=1", "--config.mesh.fsdp=-1", f"--config.model.remat={fv.aot_remat}",
           "--eval_step=false", "--json"]
    # onona_jax.aot leaves the cache off (README: a compile-only client cannot load an entry back); JAX's
    # own variables turn it on for this measurement, as train.compile_cache would.
    wall, out = run((["flock", fv.lock] if fv.lock else []) + cmd, JAX_COMPILATION_CACHE_DIR=cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")
    report = json.loads(out)
    (head, r), = report["heads"].items()
    return {"compile_s": r["train"]["compile_s"], "process_s": round(wall, 1)}


def _main(fv, rest, argv):
    from onona_jax import config as config_lib

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.aot_config:
        config_lib.load(fv.aot_config)  # a bad spec: one error line now, not after the train.py starts
    spec = common.config_args(fv, argv, DEFAULT_CONFIG)[0]
    config_args = [f"--config={spec}", *(a for a in argv if a.startswith("--config."))]  # as train.py parses them
    result = {"date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="onona-compile-cache-") as tmp:
        cache = os.path.join(tmp, "cache")
        first = train_start(config_args, cache, os.path.join(tmp, "a"), "")
        data = os.path.join(tmp, "a", "data")  # what the first start prepared
        second = train_start(config_args, cache, os.path.join(tmp, "b"), data)
        result["train"] = {"config": spec, "overrides": config_args[1:], "first": first,
                           "second": second, "cache_entries": sorted(os.listdir(cache))}
        if fv.aot_config:
            aot_cache = os.path.join(tmp, "aot_cache")
            result["aot"] = {"config": fv.aot_config, "topology": fv.aot_topology,
                             "first": aot_start(fv, aot_cache), "second": aot_start(fv, aot_cache),
                             "cache_entries": sorted(os.listdir(aot_cache))}
    result["machine"] = common.record()
    print(json.dumps(result, indent=2))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return common.run(define, lambda fv, rest: _main(fv, rest, argv), argv, __doc__, json_stdout=True)


if __name__ == "__main__":
    sys.exit(main())
