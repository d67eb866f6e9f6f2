"""What the benchmark scripts share (benchmarks/ is outside the package; a script imports this
module from beside it): the machine a figure was measured on, onona-jax's train step on one
device at a config of the command line, the allocator setting of the CPU comparisons, and
spawned worker processes stepped in paired rounds.

Every script here follows the package's command-line convention (onona_jax/cli.py):
`cli.run`, `--config=<file>.py:<arg>` with `--config.<key>=<value>` overrides where it takes
a config, one `error:` line and exit status 2 for bad usage, 1 for an anticipated failure.

Every script runs through `run` (this module's `cli.run`): it prints the machine's line first
and the load average last, and every JSON a script prints or writes holds `record()` under
"machine" (docs/performance.md: a CPU figure without its machine misleads). A suite script
(bench.py, peer.py, serve_bench.py) runs through `run_modes`: `--what=<mode>` picks one of its
modes, each with its own flags and defaults.

The scripts: bench.py (one device: step memory, FLOPs and time, data pipeline, decode, families,
MoE dispatch, compile time and cache, data preparation, the program's fingerprint; each mode
in a module of its own, bench_<mode>.py, that bench.py dispatches to), peer.py
(against PyTorch on the CPU: the whole step, its parts, a per-op profile), serve_bench.py
(serving engines side by side, the server's restore memory; serve_bench_vllm.py is its child in
the vLLM venv), device_check.py (the prepared accelerator run, scripts/device_check.sh). The fault battery
(tests/battery/) runs through `run` too.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from onona_jax import cli

REPO = Path(__file__).resolve().parents[1]  # the checkout
CONFIGS = REPO / "configs" / "paper.py"


def cpu_only() -> None:
    """JAX on the CPU (not an installed TPU/GPU plugin): for the comparisons with PyTorch on the
    CPU. Call it before jax is imported; spawned workers inherit it."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def log(msg: str) -> None:
    """Progress to stderr, so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the machine

# The x86 extensions a GEMM's speed turns on, in /proc/cpuinfo's spelling: AVX2/FMA (every
# x86 server since 2013), AVX-512 with its bf16 and int8 dot products (Intel since Cooper
# Lake/Ice Lake, AMD since Zen 4), AVX-VNNI (AVX2-width int8 dots) and AMX (Intel's tile
# units, Sapphire Rapids on). The onona-jax vs torch.compile ranking on the CPU flips between
# an AVX2-only Zen 1 and an AVX-512/bf16 Zen 4 (docs/performance.md).
GEMM_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile", "amx_int8")


def parse_cpuinfo(text: str) -> dict:
    """The CPU of /proc/cpuinfo `text` (its first processor): {"cpu": model name, "vendor",
    "family", "model" (numbers: a VM may name its CPU only "AMD EPYC"), "isa": the GEMM_FLAGS
    present, in that order, "virtualized": the "hypervisor" flag}; None where a field is absent
    (an ARM cpuinfo has no model name)."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: all cores are the same CPU here
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    number = lambda key: int(fields[key]) if fields.get(key, "").isdigit() else None  # noqa: E731
    return {"cpu": fields.get("model name"), "vendor": fields.get("vendor_id"), "family": number("cpu family"),
            "model": number("model"), "isa": [f for f in GEMM_FLAGS if f in flags],
            "virtualized": "hypervisor" in flags}


def parse_lscpu_hypervisor(text: str) -> str | None:
    """lscpu's "Hypervisor vendor:" (KVM, Microsoft, Xen, VMware...; read from CPUID, so it
    works inside a container too), None where it names none."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Hypervisor vendor" and value.strip():
            return value.strip()
    return None


def parse_meminfo_gib(text: str) -> float | None:
    """MemTotal of /proc/meminfo `text` in GiB (two decimals)."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 2)  # kB
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:  # not Linux: the fields stay None
        return ""


def _version(dist: str) -> str | None:
    """An installed distribution's version without importing it (torch takes seconds and
    threads; a benchmark that does not run it should not pay them)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _hypervisor(virtualized: bool) -> str | None:
    if not virtualized:
        return None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return parse_lscpu_hypervisor(out) or "unknown"  # a VM whose hypervisor lscpu does not name


def machine() -> dict:
    """The machine this process runs on, now: the CPU (parse_cpuinfo), "cores" usable by this
    process and "cpu_count" of the host, "hypervisor" (None: the CPU reports none), memory,
    "load_before" (the 1/5/15-minute load averages), the versions of jax, jaxlib and torch
    (None: not installed), and, only where jax is already imported (so a script whose parent
    process runs no jax initialises no backend), jax's backend, device kind and device count."""
    m = parse_cpuinfo(_read("/proc/cpuinfo"))
    if m["cpu"] is None:
        m["cpu"] = platform.processor() or platform.machine()
    m.update(
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        cpu_count=os.cpu_count(), hypervisor=_hypervisor(m.pop("virtualized")),
        memory_gib=parse_meminfo_gib(_read("/proc/meminfo")), load_before=list(os.getloadavg()),
        jax=_version("jax"), jaxlib=_version("jaxlib"), torch=_version("torch"),
        python=platform.python_version(), host=platform.platform(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        m.update(backend=jax.default_backend(), device=jax.devices()[0].device_kind, devices=jax.device_count())
    return m


def machine_line(m: dict) -> str:
    """`m` (machine()) on one line: "AMD EPYC (family 23 model 1) · avx2 fma, no avx512 · 2 cores ·
    KVM · 23.54 GiB · load 0.30 · jax 0.10.2 jaxlib 0.10.2 torch 2.13.0+cpu"."""
    cpu = m["cpu"] or "CPU unknown"
    if m.get("family") is not None:
        cpu += f" (family {m['family']} model {m['model']})"
    isa = " ".join(m["isa"]) or "no avx2"
    if m["isa"] and "avx512f" not in m["isa"]:
        isa += ", no avx512"
    cores = f"{m['cores']} cores" if m["cores"] == m["cpu_count"] else f"{m['cores']} of {m['cpu_count']} cores"
    parts = [cpu, isa, cores]
    if m.get("hypervisor"):
        parts.append(m["hypervisor"] if m["hypervisor"] != "unknown" else "VM (hypervisor unknown)")
    if m.get("memory_gib") is not None:
        parts.append(f"{m['memory_gib']:.1f} GiB")
    parts.append(f"load {m['load_before'][0]:.2f}")
    parts.append(" ".join(f"{k} {m[k]}" for k in ("jax", "jaxlib", "torch") if m.get(k)))
    if m.get("backend"):
        parts.append(f"jax backend {m['backend']}" + (f" ({m['device']})" if m["device"] != m["backend"] else ""))
    return " · ".join(parts)


def load_line(before, after) -> str:
    """The load averages (1/5/15 min) before and after a run, on one line."""
    fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
    return f"load average (1/5/15 min) after {fmt(after)} (before {fmt(before)})"


MACHINE: dict = {}  # this process's machine as `run` found it before the script's work


def record() -> dict:
    """The machine for a script's JSON: `run`'s record, with "load_after" now (a JSON is written
    when the measuring is done)."""
    if not MACHINE:
        raise RuntimeError("common.record() outside common.run: run the script's main through common.run, "
                           "which records the machine before the work")
    return {**MACHINE, "load_after": list(os.getloadavg())}


def run(define, main, argv=None, doc: str = "", json_stdout: bool = False) -> int:
    """`cli.run(define, main, argv, doc)` with the machine recorded: once the flags parse, the
    machine's line (machine_line) and, when `main` returns or fails, the load after; to stdout,
    where a script prints its results as text, or to stderr where its stdout is JSON
    (`json_stdout`: the JSON holds record() instead)."""

    def body(fv, rest):
        stream = sys.stderr if json_stdout else sys.stdout
        MACHINE.clear()
        MACHINE.update(machine())
        print(f"machine: {machine_line(MACHINE)}", file=stream, flush=True)
        try:
            return main(fv, rest)
        finally:
            print(load_line(MACHINE["load_before"], os.getloadavg()), file=stream, flush=True)

    return cli.run(define, body, argv, doc)


def run_modes(modes: dict, default: str, argv=None, doc: str = "") -> int:
    """`run` of a suite script: `--what=<mode>` picks one of `modes`, {name: (define(fv, argv),
    main(fv, rest, argv), json_stdout)}, `default` where none is given. Only the chosen mode's
    flags are defined, with its own defaults (so `--what=<mode> --help` lists them, and another
    mode's flag is one `error:` line); `json_stdout` as in `run`."""
    from absl import flags

    argv = sys.argv[1:] if argv is None else list(argv)
    mode = cli.flag_value(argv, "what", default)
    define, main, json_stdout = modes.get(mode, (None, None, False))

    def define_mode(fv, argv):
        flags.DEFINE_enum("what", default, list(modes), "the mode (each has its own flags: --what=<mode> --help)",
                          flag_values=fv)
        if define is None:
            raise cli.UsageError(f"--what={mode}: choose one of {', '.join(modes)}")
        defined = define(fv, argv)
        _list_under_the_script(fv, define.__module__)
        return defined

    return run(define_mode, lambda fv, rest: main(fv, rest, argv), argv, doc, json_stdout)


def _list_under_the_script(fv, module: str) -> None:
    """A mode defined in a module of its own (bench.py's bench_<mode>.py) lists its flags under the
    script's name in --help, as a mode defined in the script does (absl groups flags by module and
    names the script's by sys.argv[0])."""
    by_module = fv.flags_by_module_dict()
    if module != "__main__" and module in by_module:
        for flag in by_module.pop(module):
            fv.register_flag_by_module(sys.argv[0], flag)


# ----------------------------------------------------------------------------- the command line


def config_args(fv, argv, default: str) -> tuple[str, dict]:
    """(spec, {dotted key: value}) of a command line's `--config=...` and `--config.<key>=...`
    overrides, as `config.define_flag` parsed them into `fv.config`: for a script that builds
    its configs itself (one per head, or in a worker process)."""
    from onona_jax import config as config_lib

    return cli.flag_value(argv, "config", default), config_lib.overridden(fv.config, argv)


def refuse_set(argv) -> None:
    """`--set=key=value,...`, the scripts' former override syntax (peer.py --what=profile's, once
    profile_step.py's), is one error naming the package's (a config override has one spelling
    everywhere)."""
    if any(a == "--set" or a.startswith("--set=") for a in argv):
        raise cli.UsageError("--set is retired: give each override as --config.<key>=<value>, e.g. "
                             "--config.model.d_model=512 --config.train.global_batch=4")


# ----------------------------------------------------------------------------- the jax train step


def jax_config(spec: str, overrides: dict, head: str | None = None):
    """`spec` with `overrides` ({dotted key: value}), `head` (None: the config's), one device and
    the whole batch a step."""
    from onona_jax import config as config_lib

    cfg = config_lib.load(spec)
    unknown = sorted(set(overrides) - set(config_lib.flatten(cfg)))
    if unknown:  # update_from_flattened_dict would add them silently
        raise cli.UsageError(f"unknown config keys {', '.join(unknown)}: every key is in onona_jax/config.py")
    if overrides:
        try:
            cfg.update_from_flattened_dict(overrides)
        except TypeError as err:  # a value of the wrong type for its key
            raise cli.UsageError(f"bad config override: {err}") from None
    if head is not None:
        cfg.model.head = head
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, 1, 1, 1
    cfg.train.micro_batch = cfg.train.global_batch
    return config_lib.validate(cfg)


def jax_side(cfg):
    """(params as numpy, {HF name: decays?}, parameter count, step fn) of onona-jax's train
    step at `cfg`, compiled; step(tokens) runs one step and returns (loss, seconds)."""
    import jax
    import numpy as np

    from onona_jax import models, train as trainer
    from onona_jax.params import logical_axes
    from onona_jax.serve import hf_format
    from onona_jax.train import optimizer

    run = trainer.setup(cfg, jax.devices()[:1])
    state = trainer.init_state(run, cfg.seed)
    params = jax.tree.map(np.asarray, state["params"])  # a copy: the step donates the state
    n_params = sum(x.size for x in jax.tree.leaves(params))
    mask = optimizer.decay_mask(logical_axes(models.abstract(cfg.model)[1]))
    if cfg.train.decay_vectors:
        mask = jax.tree.map(lambda _: True, mask)
    decays = hf_format.to_hf(jax.tree.map(lambda p, d: np.full(p.shape, float(d), np.float32), params, mask),
                             cfg.model)
    decays = {name: bool(v.all()) for name, v in decays.items()}
    batch_shape = (cfg.train.global_batch, cfg.data.seq_len + 1)
    abstract_batch = jax.ShapeDtypeStruct(batch_shape, jax.numpy.int32, sharding=run.batch_sharding)
    compiled = trainer.make_train_step(run).lower(trainer.abstract_train_state(run), abstract_batch).compile()
    box = {"state": state, "batch": None}

    def step(tokens=None):
        if tokens is not None:
            box["batch"] = trainer.global_batch(run, np.asarray(tokens, np.int32))
        t0 = time.perf_counter()
        box["state"], metrics = compiled(box["state"], box["batch"])
        jax.block_until_ready((box["state"], metrics))
        dt = time.perf_counter() - t0
        return float(metrics["loss"]), dt

    step.compiled = compiled  # its optimized HLO for peer.py --what=profile
    return params, decays, n_params, step


# ----------------------------------------------------------------------------- the allocator


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
    """Have glibc keep the memory this process frees, for its next allocation; True if set.
    Call it before jax or torch starts its threads.

    Both frameworks allocate a step's large temporaries afresh at every step (XLA:CPU one
    0.9 GB buffer at d 512; torch each [tokens, V] tensor) and free them after. glibc serves an
    allocation that large with a fresh mmap (from a worker thread's arena whatever
    M_MMAP_MAX says) and unmaps it on free, so every step faults its temporaries in again page
    by page (220,796 minor faults a step for our d 512 step), and that costs more right after
    the other framework's process ran: our step took 2.0 s after one of its own and 2.5 s after
    torch's (docs/performance.md). One arena, no mmap and no trimming keep the memory for the
    next step, so a variant's time is its computation, not its allocator's page faults nor the
    order of the rounds. The cost, which is why train.py does not do this: the heap fragments
    and the process keeps its peak (peak RSS 4.44 GiB instead of 2.03 GiB for that step,
    `peer.py --what=profile`)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # -1 as glibc's size_t trim threshold: never trim
    return all([mallopt(_M_ARENA_MAX, 1) == 1, mallopt(_M_MMAP_MAX, 0) == 1, mallopt(_M_TRIM_THRESHOLD, -1) == 1])


# ----------------------------------------------------------------------------- workers


class Worker:
    """A spawned process `target(conn, *args)` that sends {"ok": True, ...} (or {"ok": False,
    "error": ...}) once ready, then answers each "step" with one reply until "stop" (peer.py
    runs its workers through this class)."""

    def __init__(self, ctx, name, target, args):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:  # killed (out of memory?) or crashed outside Python
            raise cli.Failure(f"the {self.name} worker died (exit code {self.proc.exitcode})") from None

    def ready(self) -> dict:
        info = self._recv()
        if not info["ok"]:
            raise cli.Failure(f"{self.name} failed to start: {info['error']}")
        return info

    def step(self):
        self.conn.send("step")
        reply = self._recv()
        if isinstance(reply, dict) and not reply.get("ok", True):
            raise cli.Failure(f"{self.name} failed: {reply['error']}")
        return reply

    def stop(self):
        try:
            self.conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()


def paired_rounds(workers: list, rounds: int, log, seconds=lambda name, reply: reply) -> dict:
    """{worker name: its "step" replies}, one step of each worker a round, the order rotating
    so no worker always runs right after the same one; `seconds(name, reply)` is the time
    logged for a reply (the reply itself where it is one)."""
    times = {w.name: [] for w in workers}
    for r in range(rounds):
        k = r % len(workers)
        for w in workers[k:] + workers[:k]:
            times[w.name].append(w.step())
        log(f"  round {r}: " + ", ".join(f"{n} {seconds(n, t[-1]):.3f}" for n, t in times.items()))
    return times
