"""Runs `train.py` (same flags) with recording hooks, for tests/integration/test_multihost.py.

    ONONA_TEST_RECORD=<dir> python tests/multihost_driver.py --config=... --workdir=...

Before train.py starts (and joins the other processes through `platform.initialize()`), it
wraps two functions of this process only (no package code changes):

- `pipeline.WindowSource.__getitem__` and `.windows`: every *training* window index this process reads;
- `global_batch` (onona_jax/train/step.py): the local rows it feeds each step, and which rows
  of the global batch this process's devices hold. It is replaced under every name any
  `onona_jax` module holds it by (`from ... import global_batch` binds a second name, which a
  patch of one module misses: that once made this test record nothing), and the record is
  refused unless it holds one batch per step.

- `Checkpoints.save`: the steps this process saved, and which were timer saves;
- with ONONA_TEST_STEP_SECONDS=<s>, `checkpoint.timer_clock` (train.checkpoint_minutes' clock): on
  process 0 it advances <s> seconds per step fed, on every other process it stands still, so
  a timer save happens at all only if every process takes process 0's decision.

On exit it writes `<dir>/record-<process index>.npz` with `ids`, `fed` [steps, rows, T+1],
`rows` [steps, rows], `saves` and `timer_saves`, `process_index`, `process_count`,
`local_devices`, `devices`.
"""

import os
import runpy
import sys
import threading

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def replace_everywhere(original, replacement) -> list[str]:
    """Rebind every module-level name of a loaded `onona_jax` module that holds `original`;
    returns the names rebound."""
    rebound = []
    for name, module in list(sys.modules.items()):
        if name.startswith("onona_jax") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)
                    rebound.append(f"{name}.{attr}")
    return rebound


def install_hooks():
    import jax

    from onona_jax import checkpoint
    from onona_jax.checkpoint import Checkpoints
    from onona_jax.data import pipeline
    from onona_jax.train import loop, step  # every module that binds global_batch (the package's own
    # name, `onona_jax.train.global_batch`, is bound at first use, from step's: after this hook's)

    record = {"ids": [], "fed": [], "rows": [], "saves": [], "timer_saves": []}
    lock = threading.Lock()  # grain reads on its own thread(s)
    get_window, get_windows = pipeline.WindowSource.__getitem__, pipeline.WindowSource.windows

    def recording_getitem(self, index):
        if self.store.split == "train":
            with lock:
                record["ids"].append(int(index))
        return get_window(self, index)

    def recording_windows(self, indices):  # (a batch share is read in one call)
        if self.store.split == "train":
            with lock:
                record["ids"].extend(int(i) for i in indices)
        return get_windows(self, indices)

    make_global = step.global_batch

    def recording_global_batch(run, local):
        arr = make_global(run, local)
        n = arr.shape[0]
        rows = sorted({r for s in arr.addressable_shards for r in range(*s.index[0].indices(n))})
        record["fed"].append(np.array(local, copy=True))
        record["rows"].append(rows)
        return arr

    save = Checkpoints.save

    def recording_save(self, step_, *args, timer=False):
        record["saves"].append(step_)
        if timer:
            record["timer_saves"].append(step_)
        return save(self, step_, *args, timer=timer)

    if "ONONA_TEST_STEP_SECONDS" in os.environ:
        tick = float(os.environ["ONONA_TEST_STEP_SECONDS"])
        # (jax.process_index() only once train.py has joined the processes: asked at each call)
        checkpoint.timer_clock = lambda: tick * len(record["fed"]) if jax.process_index() == 0 else 0.0

    Checkpoints.save = recording_save
    pipeline.WindowSource.__getitem__ = recording_getitem
    pipeline.WindowSource.windows = recording_windows
    rebound = replace_everywhere(make_global, recording_global_batch)
    if loop.global_batch is not recording_global_batch:  # the name the training loop calls
        sys.exit(f"multihost_driver: could not hook the loop's global_batch (rebound {rebound})")
    return record


def write(record, out_dir, steps: int):
    import jax

    if len(record["fed"]) != steps:
        sys.exit(f"multihost_driver: recorded {len(record['fed'])} fed batches for {steps} steps: the hook on "
                 "global_batch missed the training loop's calls")
    path = os.path.join(out_dir, f"record-{jax.process_index()}.npz")
    np.savez(
        path + ".tmp.npz",
        ids=np.array(record["ids"], np.int64),
        fed=np.stack(record["fed"]) if record["fed"] else np.zeros((0, 0, 0), np.int32),
        rows=np.array(record["rows"], np.int64).reshape(len(record["rows"]), -1),
        saves=np.array(record["saves"], np.int64),
        timer_saves=np.array(record["timer_saves"], np.int64),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        devices=jax.device_count(),
    )
    os.replace(path + ".tmp.npz", path)


def main():
    out_dir = os.environ["ONONA_TEST_RECORD"]
    record = install_hooks()
    sys.argv = [os.path.join(REPO, "train.py"), *sys.argv[1:]]
    sys.path.insert(0, REPO)
    code = 0
    try:
        runpy.run_path(os.path.join(REPO, "train.py"), run_name="__main__")
    except SystemExit as exit_:  # absl's app.run always exits
        code = exit_.code
    if code in (0, None):
        write(record, out_dir, int(os.environ["ONONA_TEST_STEPS"]))
    sys.exit(code)


if __name__ == "__main__":
    main()
