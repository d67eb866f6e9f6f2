"""`python benchmarks/bench.py --what=compile_cache`: two starts sharing a fresh compilation cache,
and optionally two AOT compiles (bench.py's docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli


REPO = str(common.REPO)


def define_compile_cache(fv, argv):
    from onona_jax import config as config_lib

    flags.DEFINE_string("aot_config", "", "also time `python -m onona_jax.aot` of this config (e.g. "
                        "configs/paper.py:dense-142m-twin)", flag_values=fv)
    flags.DEFINE_string("aot_topology", "v5e-16", "the AOT compile's slice", flag_values=fv)
    flags.DEFINE_string("aot_remat", "attention", "model.remat of the AOT compile (docs/pods.md: --fit's plan "
                        "for dense-142m on v5e-16)", flag_values=fv)
    flags.DEFINE_string("lock", "/tmp/onona-heavy.lock", "flock file the AOT compiles queue on ('' for none)",
                        flag_values=fv)
    return config_lib.define_flag(fv, argv, f"{common.CONFIGS}:dense-small-twin")


def _start(cmd, **extra_env) -> tuple[float, str]:
    """(wall seconds, stdout) of one new process `cmd` in the checkout's root (this checkout's
    onona_jax first on its path; the compilation cache given explicitly, not ONONA_COMPILE_CACHE)."""
    env = dict(os.environ, **extra_env)
    env.pop("ONONA_COMPILE_CACHE", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    began = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise cli.Failure(f"{' '.join(cmd)} failed with exit status {p.returncode}: {last}")
    return time.perf_counter() - began, p.stdout


def train_start(config_args: list[str], cache: str, workdir: str, data_dir: str) -> dict:
    """One `train.py` start of one step; `config_args`: the `--config=` and `--config.*` arguments."""
    from onona_jax import paths

    wall, _ = _start([sys.executable, "train.py", *config_args, f"--workdir={workdir}",
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
    # onona_jax.aot leaves the cache off (docs/training.md, "Compilation cache": a compile-only client cannot load an entry back); JAX's
    # own variables turn it on for this measurement, as train.compile_cache would.
    wall, out = _start((["flock", fv.lock] if fv.lock else []) + cmd, JAX_COMPILATION_CACHE_DIR=cache,
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")
    report = json.loads(out)
    (head, r), = report["heads"].items()
    return {"compile_s": r["train"]["compile_s"], "process_s": round(wall, 1)}


def main_compile_cache(fv, rest, argv):
    from onona_jax import config as config_lib

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.aot_config:
        config_lib.load(fv.aot_config)  # a bad spec: one error line now, not after the train.py starts
    spec = common.config_args(fv, argv, f"{common.CONFIGS}:dense-small-twin")[0]
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
