"""Writing a run's metrics: metrics.jsonl (one JSON object per logged step), TensorBoard event
records, and the other loggers a config asks for (Weights & Biases: `wandb_log.WandbLog`)."""

from __future__ import annotations

import json
import os
import sys
import time

import jax

from onona_jax import cli, paths


def tensorboard_records(step: int, metrics: dict, wall_time: float, first: bool = False) -> bytes:
    """One logged step's scalars as TensorBoard event-file records (TFRecord framing: length,
    its CRC, the `Event` proto, its CRC), one event per scalar as tensorboardX's add_scalar
    writes them; `first`: the file's version record before them."""
    import struct

    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c
    from tensorboardX.summary import scalar

    events = [event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2")] if first else []
    events += [event_pb2.Event(wall_time=wall_time, step=step, summary=scalar(k, v)) for k, v in metrics.items()]
    out = bytearray()
    for event in events:
        data = event.SerializeToString()
        head = struct.pack("Q", len(data))
        out += head + struct.pack("I", masked_crc32c(head)) + data + struct.pack("I", masked_crc32c(data))
    return bytes(out)


class MetricsLog:
    """metrics.jsonl (one JSON object per logged step) and TensorBoard events, from process 0 only,
    and every logged step fanned out to the other loggers the config asks for (`self.others`:
    Weights & Biases with train.wandb_project, `wandb_log.WandbLog`).

    Both are written alike, on the calling thread: one append per logged step (`paths.Appender`:
    no torn line or record, locally or in a bucket), and a failed append (a full disk) stops the
    run with one error line. (tensorboardX's SummaryWriter writes from a thread of its own: on a
    full disk that thread died with a traceback, and its close() raised over the run's own error.)
    The events file is made at the first logged step, so a start refused before it leaves none.
    A torn last line of metrics.jsonl left by an older version or a crash is removed when a run
    resumes, and the restart is marked by a line `{"step": S, "restart": true}`."""

    def __init__(self, workdir: str, cfg=None):
        import socket

        self.primary = jax.process_index() == 0
        wd = paths.Workdir(workdir)
        self.path = wd.metrics
        self.tb_path = paths.join(wd.tensorboard, f"events.out.tfevents.{int(time.time())}."
                                                  f"{socket.gethostname()}.{os.getpid()}")
        self.file = self.tb = None
        self.others = []  # each with write(step, metrics) and close() (never raising)
        if self.primary:
            try:
                self.file = paths.Appender(self.path)
                self.resumed = self._repair()
            except OSError as err:
                raise cli.Failure(f"cannot write {self.path} ({err.strerror or err}); make the workdir "
                                  "writable (or free space), then rerun the same command") from None
            # tensorboardX's first import takes seconds (it imports torch where installed): paid
            # here, at start-up, not inside the second logged interval's tokens/s.
            import tensorboardX.summary  # noqa: F401
            if cfg is not None and cfg.train.wandb_project:
                from onona_jax.train.wandb_log import WandbLog

                try:
                    self.others.append(WandbLog(cfg, workdir))
                except BaseException:
                    self.close()  # (no caller holds this log yet to close it)
                    raise

    def _repair(self) -> bool:
        """Cut a torn last line (no newline); True when the file already held lines."""
        size = self.file.size()
        if size == 0:
            return False
        tail = self.file.tail(65536)
        if tail.endswith(b"\n"):
            return True
        keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        self.file.truncate(keep)
        print(f"warning: {self.path} ended in a torn line ({size - keep} bytes of a write cut short); "
              "removed it", file=sys.stderr)
        return keep > 0

    def _append(self, data: bytes, tensorboard: bool = False):
        path = self.tb_path if tensorboard else self.path
        try:
            if tensorboard and self.tb is None:
                self.tb = paths.Appender(self.tb_path)
            (self.tb if tensorboard else self.file).append(data)
        except OSError as err:
            raise cli.Failure(
                f"could not write {path} ({err.strerror or err}); stopping. Free space on that "
                f"filesystem (or make it writable), then rerun the same command to resume from the last checkpoint"
            ) from None

    def restart(self, step: int):
        if self.primary and self.resumed:
            self._append((json.dumps({"step": step, "restart": True, "time": time.time()}) + "\n").encode())

    def note(self, step: int, **fields):
        """A line of metrics.jsonl alone (not a scalar: TensorBoard and W&B get none), e.g. a mixture change."""
        if self.primary:
            self._append((json.dumps({"step": step, **fields, "time": time.time()}) + "\n").encode())

    def write(self, step: int, metrics: dict):
        if not self.primary:
            return
        self._append((json.dumps({"step": step, **metrics}) + "\n").encode())
        self._append(tensorboard_records(step, metrics, time.time(), first=self.tb is None), tensorboard=True)
        for other in self.others:
            other.write(step, metrics)

    def close(self):
        """Never raises: every logged step is already written whole."""
        for f in (self.file, self.tb):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self.file = self.tb = None
        for other in self.others:
            other.close()
        self.others = []

