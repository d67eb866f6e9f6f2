"""Compile time of a first and a second start with the persistent compilation cache (issue 27).

    python benchmarks/compile_cache.py                          # dense-small-twin, train.py on this CPU
    python benchmarks/compile_cache.py --aot_config=configs/paper.py:dense-142m-twin --aot_topology=v5e-16

Each start is a new process with an empty in-memory cache, sharing one fresh cache directory
(train.compile_cache, default threshold train.compile_cache_min_s = 1 s):

* train: `python train.py` for one step, twice (a fresh workdir each; the second reads the
  data the first prepared); the figure is the first logged step's `compile_s` (the train
  step's compile, or its load from the cache) and `compile_cache_hits`.
* aot (with --aot_config): `python -m onona_jax.aot` twice, deviceless with libtpu, under
  `flock /tmp/onona-heavy.lock` (heavy compiles queue on that lock), the cache turned on through
  JAX_COMPILATION_CACHE_DIR (aot.py leaves it off: README, "Compilation cache"); the figure is the
  report's train-step `compile_s` (lower + compile).

Prints one JSON object with both starts' seconds per part.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_string("config", "configs/paper.py:dense-small-twin", "train.py's config")
flags.DEFINE_string("aot_config", "", "also time `python -m onona_jax.aot` of this config (e.g. dense-142m-twin)")
flags.DEFINE_string("aot_topology", "v5e-16", "the AOT compile's slice")
flags.DEFINE_string("aot_remat", "attention", "model.remat of the AOT compile (docs/SCALING.md: --fit's plan for "
                    "dense-142m on v5e-16)")
flags.DEFINE_string("lock", "/tmp/onona-heavy.lock", "flock file the AOT compiles queue on ('' for none)")
FLAGS = flags.FLAGS


def env(**extra):
    out = dict(os.environ, **extra)
    out.pop("ONONA_COMPILE_CACHE", None)  # the cache is given explicitly
    out["PYTHONPATH"] = REPO + os.pathsep + out.get("PYTHONPATH", "")
    return out


def run(cmd, **extra_env) -> tuple[float, str]:
    began = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env(**extra_env), capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - began, p.stdout


def train_start(cache: str, workdir: str, data_dir: str) -> dict:
    wall, _ = run([sys.executable, "train.py", f"--config={FLAGS.config}", f"--workdir={workdir}",
                   f"--config.train.compile_cache={cache}", f"--config.data.dir={data_dir}",
                   "--config.train.steps=1", "--config.train.log_every=1", "--config.eval.windows=8",
                   "--config.mesh.data=1"])
    first = json.loads(open(os.path.join(workdir, "metrics.jsonl")).readline())
    return {"compile_s": round(first["compile_s"], 2), "compile_cache_hits": first["compile_cache_hits"],
            "process_s": round(wall, 1)}


def aot_start(cache: str) -> dict:
    cmd = [sys.executable, "-m", "onona_jax.aot", f"--config={FLAGS.aot_config}", f"--topology={FLAGS.aot_topology}",
           "--config.mesh.data=1", "--config.mesh.fsdp=-1", f"--config.model.remat={FLAGS.aot_remat}",
           "--eval_step=false", "--json"]
    # aot.py leaves the cache off (README: a compile-only client cannot load an entry back); JAX's
    # own variables turn it on for this measurement, as train.compile_cache would.
    wall, out = run((["flock", FLAGS.lock] if FLAGS.lock else []) + cmd, JAX_COMPILATION_CACHE_DIR=cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")
    report = json.loads(out)
    (head, r), = report["heads"].items()
    return {"compile_s": r["train"]["compile_s"], "process_s": round(wall, 1)}


def main(argv):
    del argv
    result = {"date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="onona-compile-cache-") as tmp:
        cache = os.path.join(tmp, "cache")
        first = train_start(cache, os.path.join(tmp, "a"), "")
        data = os.path.join(tmp, "a", "data")  # what the first start prepared
        second = train_start(cache, os.path.join(tmp, "b"), data)
        result["train"] = {"config": FLAGS.config, "first": first, "second": second,
                           "cache_entries": sorted(os.listdir(cache))}
        if FLAGS.aot_config:
            aot_cache = os.path.join(tmp, "aot_cache")
            result["aot"] = {"config": FLAGS.aot_config, "topology": FLAGS.aot_topology,
                             "first": aot_start(aot_cache), "second": aot_start(aot_cache),
                             "cache_entries": sorted(os.listdir(aot_cache))}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app.run(main)
