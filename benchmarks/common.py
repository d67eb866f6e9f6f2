"""What the benchmark scripts share (benchmarks/ is outside the package; a script imports this
module from beside it): onona-jax's train step on one device at a config of the command line,
the allocator setting of the CPU comparisons, and spawned worker processes stepped in paired
rounds.

Every script here follows the package's command-line convention (onona_jax/cli.py):
`cli.run`, `--config=<file>.py:<arg>` with `--config.<key>=<value>` overrides where it takes
a config, one `error:` line and exit status 2 for bad usage, 1 for an anticipated failure.
"""

from __future__ import annotations

import ast
import os
import sys
import time
from pathlib import Path

from onona_jax import cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "paper.py"


def cpu_only() -> None:
    """JAX on the CPU (not an installed TPU/GPU plugin): for the comparisons with PyTorch on the
    CPU. Call it before jax is imported; spawned workers inherit it."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def log(msg: str) -> None:
    """Progress to stderr, so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the command line


def config_args(fv, argv, default: str) -> tuple[str, dict]:
    """(spec, {dotted key: value}) of a command line's `--config=...` and `--config.<key>=...`
    overrides, as `config.define_flag` parsed them into `fv.config`: for a script that builds
    its configs itself (one per head, or in a worker process)."""
    from onona_jax import config as config_lib

    spec = default
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    return spec, config_lib.overridden(fv.config, argv)


def refuse_set(argv) -> None:
    """`--set=key=value,...`, the scripts' former override syntax, is one error naming the
    package's (a config override has one spelling everywhere)."""
    if any(a == "--set" or a.startswith("--set=") for a in argv):
        raise cli.UsageError("--set is retired: give each override as --config.<key>=<value>, e.g. "
                             "--config.model.d_model=512 --config.train.global_batch=4")


def parse_overrides(text: str, flag: str) -> dict:
    """`key=value,key=value` (a variant of step_ab.py) as a dict, each value parsed as a Python
    literal where it parses, else kept as a string; the keys are checked by `jax_config`."""
    out = {}
    for item in (x for x in text.split(",") if x):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise cli.UsageError(f"--{flag}={text}: {item!r} is not key=value, e.g. --{flag}=model.remat=attention")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


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
    torch's (docs/PERFORMANCE.md). One arena, no mmap and no trimming keep the memory for the
    next step, so a variant's time is its computation, not its allocator's page faults nor the
    order of the rounds. The cost, which is why train.py does not do this: the heap fragments
    and the process keeps its peak (peak RSS 4.44 GiB instead of 2.03 GiB for that step,
    `profile_step.py`)."""
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
    "error": ...}) once ready, then answers each "step" with one reply until "stop" (peer.py,
    code_ab.py and gemm_floor.py run theirs through this class)."""

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
