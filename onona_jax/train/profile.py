"""The profiler: a `jax.profiler` trace of a range of steps into the workdir."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import jax

from onona_jax import cli, paths
from onona_jax.train.startup import require_writable


class Profiler:
    """A `jax.profiler` trace of steps train.profile_start .. + train.profile_steps - 1 into
    <workdir>/profile/ (plugins/profile/<run>/<host>.xplane.pb, what TensorBoard's profile plugin
    and Perfetto read), on process 0 or, with train.profile_all_hosts, on every process. A bucket
    workdir is traced into a local temporary directory and uploaded when the trace stops (the
    profiler writes through its own file layer, not through `paths`). A start that resumes inside
    the range traces the rest of it; one that resumes after it traces nothing."""

    def __init__(self, cfg, workdir: str):
        t = cfg.train
        self.first, self.last = t.profile_start, t.profile_start + t.profile_steps - 1
        self.on = t.profile_start > 0 and (t.profile_all_hosts or jax.process_index() == 0)
        self.directory = paths.Workdir(workdir).profile
        self.local = None
        self.tracing = self.done = False

    def require_writable(self):
        """Before the first step: an unwritable profile directory is one error line, not a lost trace."""
        if self.on:
            require_writable(self.directory)

    def start_if_due(self, step: int):
        """Before `step` dispatches: start the trace at the range's first step (or a resume's)."""
        if self.on and not self.tracing and not self.done and self.first <= step <= self.last:
            self.local = (tempfile.mkdtemp(prefix="onona-profile-") if paths.is_cloud(self.directory)
                          else self.directory)
            jax.profiler.start_trace(self.local)
            self.tracing = True

    def stop_due(self, step: int, last: bool) -> bool:
        """After the range's last step (or the run's), while tracing."""
        return self.tracing and (step >= self.last or last)

    def finish(self, step: int, state) -> float:
        """Stop the trace after `step` and write it; the seconds that took."""
        jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
        began = time.perf_counter()
        self.stop()
        print(f"wrote a profile of steps {self.first}-{min(step, self.last)} to {self.directory}", file=sys.stderr)
        return time.perf_counter() - began

    def stop(self):
        if not self.tracing:
            return
        self.tracing, self.done = False, True
        jax.profiler.stop_trace()
        if self.local != self.directory:
            try:
                for root, _, files in os.walk(self.local):
                    for name in files:
                        rel = os.path.relpath(os.path.join(root, name), self.local)
                        paths.upload(os.path.join(root, name), paths.join(self.directory, rel))
            except OSError as err:
                raise cli.Failure(f"could not write the profile to {self.directory} ({err.strerror or err}); "
                                  "make it writable, then rerun the same command") from None
            finally:
                shutil.rmtree(self.local, ignore_errors=True)

