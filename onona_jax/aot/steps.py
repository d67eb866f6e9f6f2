"""Compile the trainer's own train and eval steps for a slice from abstract shapes that carry
the shardings, and report one compiled program per device: HBM from XLA's buffer assignment,
FLOPs, and what its optimized HLO says (`hlo`)."""

from __future__ import annotations

import math
import re
import time

from onona_jax.aot.hlo import (attention_kernels, collective_bytes, describe_collective, hbm_bytes, largest_arrays,
                               score_matrix_arrays)
from onona_jax.aot.topology import Slice, topology_devices


class DoesNotFit(Exception):
    """The TPU compiler refused the program: more HBM than the chip has."""

    def __init__(self, message: str, needed: int | None, available: int | None):
        super().__init__(message)
        self.needed, self.available = needed, available


_SIZE = r"([0-9.]+)([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _parse_size(num: str, unit: str) -> int:
    return int(float(num) * _UNITS[unit])


def parse_resource_exhausted(message: str) -> tuple[int | None, int | None]:
    """(needed, available) bytes from XLA:TPU's RESOURCE_EXHAUSTED message, e.g. 'Used 40.1G of
    15.75G hbm' or 'HLO temporaries (33.57G) exceeds available HBM (15.75G)'."""
    m = re.search(r"Used " + _SIZE + r" of " + _SIZE + r" hbm", message)
    if m:
        return _parse_size(*m.group(1, 2)), _parse_size(*m.group(3, 4))
    m = re.search(r"\(" + _SIZE + r"\) exceeds (?:the )?available HBM \(" + _SIZE + r"\)", message)
    if m:
        return _parse_size(*m.group(1, 2)), _parse_size(*m.group(3, 4))
    return None, None


def _compile(fn, *args):
    """(compiled, seconds), or DoesNotFit when the compiler runs out of HBM."""
    start = time.perf_counter()
    try:
        compiled = fn.lower(*args).compile()
    except Exception as err:  # noqa: BLE001 - XLA raises JaxRuntimeError; only OOM is ours to explain
        msg = str(err)
        if "RESOURCE_EXHAUSTED" not in msg and "exceeds available HBM" not in msg:
            raise
        needed, available = parse_resource_exhausted(msg)
        raise DoesNotFit(msg.strip().splitlines()[0][:400], needed, available) from None
    return compiled, time.perf_counter() - start


def _analyse(compiled, seconds: float, hbm: int, n_devices: int, cfg) -> dict:
    """The report of one compiled step; `n_devices` counts all slices' devices (a multi-slice
    program is one slice's: its replica groups number that slice's devices)."""
    mem = compiled.memory_analysis()
    args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, temps = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    total = args + out - alias + temps  # donated inputs that become outputs are counted once
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    details: list = []
    slices = cfg.mesh.slices
    by_link: dict = {}
    collectives = collective_bytes(hlo, n_devices // slices, details, by_link, slices)
    return {
        "arguments": int(args), "temporaries": int(temps), "outputs": int(out - alias),
        "generated_code": int(mem.generated_code_size_in_bytes), "total": int(total),
        "hbm": int(hbm), "fits": bool(total <= hbm), "compile_s": round(seconds, 2),
        # XLA's count visits each while-loop body once (one layer of the scan, one micro-batch,
        # one vocabulary chunk): a lower bound, kept for reference; model_flops is the step's.
        "xla_flops": float(cost.get("flops", 0.0)) if cost else 0.0,
        "hbm_bytes": hbm_bytes(hlo),
        "collective_bytes": collectives,
        # per device: over the slice's ICI, and over the data-center network between slices
        "collective_bytes_by_link": by_link,
        "top_collectives": [describe_collective(d, hlo) for d in details[:8]],
        "attention_kernels": attention_kernels(hlo),
        "score_matrices": score_matrix_arrays(hlo, cfg.data.seq_len, (cfg.model.d_model, cfg.model.d_ff)),
        "largest_arrays": largest_arrays(hlo),
    }


def _abstract(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def expected_argument_bytes(run) -> dict:
    """Per-device bytes of the train step's inputs, from the shardings alone: each array's
    shard shape × item size (parameters, optimizer state, step, and the token batch)."""
    import jax
    import numpy as np

    from onona_jax import train as trainer

    def shard_bytes(x):
        return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize

    state = trainer.abstract_train_state(run)
    cfg = run.cfg
    batch = _abstract((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32, run.batch_sharding)
    return {
        "params": sum(shard_bytes(x) for x in jax.tree.leaves(state["params"])),
        "opt_state": sum(shard_bytes(x) for x in jax.tree.leaves(state["opt_state"])),
        "other": shard_bytes(state["step"]) + shard_bytes(batch),
    }


def compile_train(cfg, s: Slice, devices=None, hbm: int | None = None) -> dict:
    """Set up the run on the slice's devices and compile the trainer's train step; the report
    dict (see module docstring). Raises DoesNotFit, or ValueError for a config the mesh rejects."""
    import numpy as np

    from onona_jax import summary
    from onona_jax import train as trainer

    devices = devices or topology_devices(s)
    run = trainer.setup(cfg, devices=devices)
    state = trainer.abstract_train_state(run)
    batch = _abstract((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32, run.batch_sharding)
    compiled, seconds = _compile(trainer.make_train_step(run), state, batch)
    out = _analyse(compiled, seconds, hbm or s.hbm_per_device, len(devices), cfg)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    out["model_flops"] = summary.flops_per_token(cfg.model, cfg.data.seq_len)["train"] * tokens / len(devices)
    out.update(micro_batch=cfg.train.global_batch // (run.accum * run.dp), accum=run.accum,
               remat=cfg.model.remat, mesh={a: int(n) for a, n in run.mesh.shape.items()})
    return out


def compile_eval(cfg, s: Slice, devices=None, hbm: int | None = None) -> dict:
    """The trainer's eval step (the mixture's NLL) on a validation batch as `evaluate` pads it."""
    import jax
    import numpy as np

    from onona_jax import sharding, summary
    from onona_jax import train as trainer
    from onona_jax.eval.validation import make_eval_step

    devices = devices or topology_devices(s)
    run = trainer.setup(cfg, devices=devices)
    dp = run.dp
    b = max(dp, math.ceil(cfg.eval.batch / dp) * dp)
    params = jax.tree.map(lambda x, sh: _abstract(x.shape, x.dtype, sh), run.abstract_params, run.param_shardings)
    tokens = _abstract((b, cfg.data.seq_len + 1), np.int32, run.batch_sharding)
    weights = _abstract((b,), np.float32, sharding.batch_sharding(run.mesh, 1))
    step = make_eval_step(run.graphdef, run.mesh, run.param_shardings, eot=run.eot)
    compiled, seconds = _compile(step, params, tokens, weights)
    out = _analyse(compiled, seconds, hbm or s.hbm_per_device, len(devices), cfg)
    out["batch"] = b
    out["model_flops"] = summary.flops_per_token(cfg.model, cfg.data.seq_len)["forward"] * b * cfg.data.seq_len / len(devices)
    return out
