"""The training clock: where each log interval's seconds went, and the rates made of them."""

from __future__ import annotations

import contextlib
import time

import jax

from onona_jax import chips, compile_cache


def peak_tflops(cfg) -> float | None:
    """Peak dense bf16 TFLOP/s per device, for model FLOPs utilisation: train.peak_tflops, else
    the chip's (`chips.CHIPS`); None on a CPU."""
    if cfg.train.peak_tflops > 0:
        return float(cfg.train.peak_tflops)
    chip = chips.by_device_kind(jax.devices()[0].device_kind)
    return chip.peak_tflops if chip else None


class Clock:
    """One log interval's time, from the last logged step to the next (`lap`).

    Paused seconds (`PAUSES`: the first step's compile, a validation, a checkpoint's
    device-to-host copy, writing a profile, scoring train.tasks) were not training: kept out of
    tokens/s and MFU, logged apart (task_s in its scores' own row). Data wait (the iterator and
    the host-to-device copy of the next batch) is training time, an input-bound run being that
    slow, and logged apart per step as data_wait_s beside step_s, so an input-bound run shows at
    once."""

    PAUSES = ("compile_s", "validation_s", "checkpoint_s", "profile_s", "task_s")

    def __init__(self, step: int, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.began, self.step = time.perf_counter(), step
        self.seconds_paused = dict.fromkeys(self.PAUSES, 0.0)
        self.data_wait = 0.0
        self.cache_hits = None  # the first step's compile: programs loaded from the persistent cache

    @contextlib.contextmanager
    def pause(self, kind: str):
        """Time the block as `kind`, one of PAUSES."""
        began = time.perf_counter()
        yield
        self.add_pause(kind, time.perf_counter() - began)

    def add_pause(self, kind: str, seconds: float):
        self.seconds_paused[kind] += seconds

    @contextlib.contextmanager
    def waiting_for_data(self):
        began = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - began

    @contextlib.contextmanager
    def compiling(self, count_cache_hits: bool):
        """The first step: its call compiles (or loads from the cache) before it dispatches."""
        began, hits = time.perf_counter(), compile_cache.hits()
        yield
        self.seconds_paused["compile_s"] += time.perf_counter() - began
        if count_cache_hits:
            self.cache_hits = compile_cache.hits() - hits

    def lap(self, step: int) -> tuple[float, dict, dict]:
        """End the interval at `step`: (tokens/s, {step_s, data_wait_s} per step, the interval's
        paused seconds that were not zero, and the first step's compile_cache_hits), and start
        the next one."""
        now = time.perf_counter()
        training = now - self.began - sum(self.seconds_paused.values())
        steps = step - self.step
        tokens_per_s = steps * self.tokens_per_step / max(training, 1e-9)
        times = {"step_s": max(training - self.data_wait, 0.0) / steps, "data_wait_s": self.data_wait / steps}
        self.began, self.step = now, step
        pauses = {k: v for k, v in self.seconds_paused.items() if v and k != "task_s"}
        if self.cache_hits is not None:
            pauses["compile_cache_hits"] = self.cache_hits
        self.seconds_paused = dict.fromkeys(self.PAUSES, 0.0)
        self.data_wait, self.cache_hits = 0.0, None
        return tokens_per_s, times, pauses
