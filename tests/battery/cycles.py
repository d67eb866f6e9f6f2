"""kill -9 cycles: a fresh run killed 1-3 times at random moments (a step, a save, a validation,
a SIGTERM, its data's prepare), rerun to the end, and compared bit for bit with an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from .harness import Bench, CYCLE, NotHeld, REPO, digest, expect, final_eval, losses, ok, stop


KINDS = ("step", "save", "eval", "sigterm", "prepare")


class Store:
    """Where a cycle's workdir lives: local disk or a bucket on the GCS emulator."""

    def __init__(self, b: Bench, name: str):
        self.b, self.name = b, name
        if name == "gcs":
            if b.gcs is None:
                sys.path.insert(0, str(REPO / "tests"))
                import fake_gcs

                b.gcs = fake_gcs.start()
                b.env.update(fake_gcs.env(b.gcs.url))
                # A killed run's bucket lease expires after this (lock.LEASE_S is 120 s: each
                # kill would cost two minutes of waiting); renewed every 20/12 s meanwhile.
                b.env["ONONA_LOCK_LEASE_S"] = "20"
            self.bucket = b.gcs.new_bucket()

    def workdir(self, name: str) -> str:
        return f"gs://{self.bucket}/{name}" if self.name == "gcs" else str(self.b.path(name))

    def read(self, path: str) -> str:
        from onona_jax import paths

        return paths.read_text(path)

    def listing(self, path: str) -> list[str]:
        from onona_jax import paths

        return [os.path.basename(p) for p in paths.glob(path, "*")] if paths.isdir(path) else []

    def exists(self, path: str) -> bool:
        from onona_jax import paths

        return paths.exists(path)


def metrics_text(store: Store, wd: str) -> str:
    try:
        return store.read(f"{wd}/metrics.jsonl")
    except (OSError, FileNotFoundError):
        return ""


def _kill_at(b: Bench, store: Store, wd: str, data: Path, kind: str, rng: random.Random) -> str:
    """Start the run and kill it at a moment of `kind`; what happened, in words."""
    steps = CYCLE["train.steps"]
    p = b.popen(b.train_args(wd, data=data, **CYCLE))
    try:
        def logged():
            return losses(metrics_text(store, wd))

        if kind == "save":
            committed: set[str] = set()

            def saving():
                """A step being written: Orbax's temporary directory locally; in a bucket a step
                directory without its commit marker (Orbax writes that object last)."""
                for n in store.listing(f"{wd}/checkpoints"):
                    if "tmp" in n:
                        return True
                    if store.name == "gcs" and n.isdigit() and n not in committed:
                        if not store.exists(f"{wd}/checkpoints/{n}/commit_success.txt"):
                            return True
                        committed.add(n)
                return False
            deadline = time.monotonic() + 300
            while not saving():
                if p.poll() is not None or time.monotonic() > deadline:
                    return f"{kind}: no save seen before the run ended"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))
        elif kind == "eval":
            target = rng.choice([s for s in range(4, steps, CYCLE["train.eval_every"])])

            def validating():
                rows = [json.loads(ln) for ln in metrics_text(store, wd).splitlines()]
                return any(r.get("step") == target and "loss" in r for r in rows)
            deadline = time.monotonic() + 300
            while not validating():
                if p.poll() is not None or time.monotonic() > deadline:
                    return f"{kind}: step {target} not reached before the run ended"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.2))
        else:  # step, sigterm: after a random logged step
            done = max(logged(), default=0)
            target = rng.randint(done + 1, steps - 1) if done + 1 < steps else steps
            deadline = time.monotonic() + 300
            while max(logged(), default=0) < target:
                if p.poll() is not None or time.monotonic() > deadline:
                    return f"{kind}: step {target} not reached before the run ended"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.3))
        if p.poll() is not None:
            return f"{kind}: the run ended first"
        if kind == "sigterm":
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=120)
            if p.returncode != 0 or "Traceback" in err:
                raise NotHeld(f"SIGTERM: exit {p.returncode}: {err[-800:]}")
            return f"sigterm after step {max(logged(), default=0)}"
        p.kill()
        p.wait()
        return f"kill -9 {kind} (logged up to step {max(logged(), default=0)})"
    finally:
        stop(p)


def _prepare_killed(b: Bench, rng: random.Random) -> tuple[Path, str]:
    """Prepare the battery's corpus into a new dir, kill -9 it at a random moment, rerun it."""
    out = b.path("cycle-data")
    p = b.popen(["-m", "onona_jax.data.prepare", "--input", str(b.corpus), "--output", str(out),
                 "--heldout_fraction=0.1", "--workers=2"])
    time.sleep(rng.uniform(0.5, 4.0))
    finished = p.poll() is not None
    stop(p)
    if finished:
        moment = "after it finished"
    else:  # the rerun must find nothing that training would accept, and start clean
        moment = "mid-way"
        expect(not (out / "manifest.json").exists(), "a killed prepare left a manifest")
        ok(b.prepare([b.corpus], out))
    expect(digest(out) == digest(b.data), "the data prepared after the kill differs from a clean prepare's")
    return out, f"kill -9 prepare {moment}"


def cycle(b: Bench, store: Store, reference: str, rng: random.Random, index: int) -> str:
    wd = store.workdir(f"cycle-{index}")
    kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, 3))]
    data, events = b.data, []
    for kind in kinds:
        if kind == "prepare":
            data, event = _prepare_killed(b, rng)
        else:
            event = _kill_at(b, store, wd, data, kind, rng)
        events.append(event)
    res = b.train(wd, data=data, **CYCLE)
    ok(res)
    got, ref = losses(metrics_text(store, wd)), losses(reference)
    expect(sorted(got) == sorted(ref), f"steps logged {sorted(got)}")
    for s, values in got.items():
        expect(all(v == ref[s][0] for v in values), f"step {s}: losses {values} vs {ref[s][0]} uninterrupted")
    mine, theirs = final_eval(metrics_text(store, wd)), final_eval(reference)
    expect(all(mine[k] == theirs[k] for k in theirs if k.startswith("val_loss")), f"final eval {mine} vs {theirs}")
    expect(not store.exists(f"{wd}/lock.json"), "lock.json left behind")
    left = [n for n in store.listing(f"{wd}/checkpoints") if "tmp" in n]
    expect(not left, f"temporary checkpoints left: {left}")
    return "; ".join(events)
