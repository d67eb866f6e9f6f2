"""Damaged, missing and live checkpoints: set aside and retrained, skipped by eval, refused in one
line; the damage fuzzer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from .harness import (Bench, NotHeld, Result, case, digest, excerpt, expect, final_eval, losses, ok, one_error,
                      step_logged, stop, unchanged, wait_for)


def _truncate_arrays(wd: Path, step: int):
    # Every array file, not only the largest: OCDBT's writer threads decide which file holds
    # the parameters, so a reader of the parameters alone (eval.py) might never touch the largest.
    files = [p for p in (wd / "checkpoints" / str(step) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


@case("checkpoint", "train.py", "the newest checkpoint's array file truncated", "exit 0; set aside; steps 3-4 again, bit-exact")
def damaged_newest_checkpoint(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    res = b.train(wd)
    ok(res)
    warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "step 4" in warnings[0], f"expected one warning about step 4: {res.err[-800:]}")
    expect(len(list((wd / "checkpoints" / "corrupt").iterdir())) == 1, "step 4 not set aside")
    got, ref = losses((wd / "metrics.jsonl").read_text()), losses((b.run_dir / "metrics.jsonl").read_text())
    expect(all(v == [ref[s][0]] * len(v) for s, v in got.items()), f"losses differ: {got} vs {ref}")


@case("checkpoint", "eval.py", "the newest checkpoint damaged", "exit 0 on step 2; checkpoints/ unchanged")
def eval_skips_a_damaged_step(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    before = digest(wd / "checkpoints")
    res = b.run(["eval.py", f"--workdir={wd}", "--mesh=1,1,1"])
    ok(res)
    expect(json.loads((wd / "eval" / "step_2.json").read_text())["step"] == 2, "eval did not use step 2")
    unchanged(before, wd / "checkpoints", "checkpoints/")


@case("checkpoint", "eval.py --step=4", "that step damaged", "exit 1, one line; unchanged")
def eval_of_a_damaged_step(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    before = digest(wd)
    one_error(b.run(["eval.py", f"--workdir={wd}", "--step=4", "--mesh=1,1,1"]), 1, "step 4")
    unchanged(before, wd)


@case("checkpoint", "eval.py --step=3", "no such step", "exit 2, one line; unchanged")
def eval_of_a_missing_step(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.run(["eval.py", f"--workdir={wd}", "--step=3", "--mesh=1,1,1"]), 2, "step 3")
    unchanged(before, wd)


@case("checkpoint", "train.py", "the newest checkpoint damaged, checkpoints/corrupt a file (and corrupt.1 a dangling link)",
      "exit 0; one warning; set aside to corrupt.2/; the file and link untouched; bit-exact")
def set_aside_with_corrupt_in_the_way(b: Bench):
    wd = b.copy_run()
    _truncate_arrays(wd, 4)
    ckpts = wd / "checkpoints"
    (ckpts / "corrupt").write_text("a user's file\n")
    (ckpts / "corrupt.1").symlink_to(wd / "nowhere")
    res = b.train(wd)
    ok(res)
    warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "step 4" in warnings[0] and "corrupt.2/4-" in warnings[0],
           f"expected one warning moving step 4 to corrupt.2/: {warnings or res.tail()}")
    expect((ckpts / "corrupt").read_text() == "a user's file\n", "checkpoints/corrupt changed")
    expect((ckpts / "corrupt.1").is_symlink() and not (wd / "nowhere").exists(), "corrupt.1 changed")
    expect([p.name[:2] for p in (ckpts / "corrupt.2").iterdir()] == ["4-"], "step 4 not in corrupt.2/")
    got, ref = losses((wd / "metrics.jsonl").read_text()), losses((b.run_dir / "metrics.jsonl").read_text())
    expect(all(v == [ref[s][0]] * len(v) for s, v in got.items()) and sorted(got) == sorted(ref),
           f"losses differ: {got} vs {ref}")


DAMAGES = ("truncate", "other_step", "other_array", "flip", "delete", "empty")


def _damage(wd: Path, step: int, rng: random.Random) -> str:
    """Damage one random file of checkpoint `step` in one random way (DAMAGES); what was done, in words."""
    root = wd / "checkpoints"
    kind = rng.choice(DAMAGES)
    mine = sorted(p for p in (root / str(step)).rglob("*") if p.is_file())
    arrays = [p for p in mine if p.parent.name == "d"]
    # A role first (each item's metadata, its manifest, its array files...), then a file of it: drawn
    # uniformly over files, most seeds would hit one of the many array files, most of them never read.
    roles = {}
    for p in mine:
        rel = p.relative_to(root / str(step))
        roles.setdefault((rel.parts[0] if len(rel.parts) > 1 else "", p.parent.name == "d", p.name if
                          p.parent.name != "d" else ""), []).append(p)
    path = rng.choice(arrays if kind == "other_array" else rng.choice(sorted(roles.values())))
    rel = path.relative_to(root / str(step))
    detail = ""
    if kind == "truncate":
        size = path.stat().st_size
        keep = rng.randrange(size) if size else 0
        path.write_bytes(path.read_bytes()[:keep])
        detail = f" to {keep} of {size} bytes"
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "delete":
        path.unlink()
    elif kind == "flip":
        raw = bytearray(path.read_bytes())
        flips = [(rng.randrange(len(raw)), rng.randrange(8)) for _ in range(rng.randint(1, 8))] if raw else []
        for at, bit in flips:
            raw[at] ^= 1 << bit
        path.write_bytes(bytes(raw))
        detail = f" ({len(flips)} bits at bytes {sorted(at for at, _ in flips)})"
    elif kind == "other_step":
        other = root / str(6 - step) / rel  # steps 2 and 4
        if not other.is_file():  # array files have random names: the one of the same size rank
            here = sorted(path.parent.iterdir(), key=lambda p: (p.stat().st_size, p.name))
            there = sorted((p for p in other.parent.iterdir() if p.is_file()), key=lambda p: (p.stat().st_size, p.name))
            other = there[min(here.index(path), len(there) - 1)]
        shutil.copyfile(other, path)
        detail = f" (from {other.relative_to(root)})"
    else:  # other_array
        other = rng.choice([p for p in arrays if p != path] or [path])
        shutil.copyfile(other, path)
        detail = f" (from {other.relative_to(root / str(step))})"
    return f"{kind} {step}/{rel}{detail}"


def _fails_in_one_line_or_ok(res: Result, what: str) -> str:
    """Exit 0 (at most one warning), or exactly one `error:` line; never a traceback."""
    expect("Traceback" not in res.err and "Event loop is closed" not in res.err,
           f"{what}: a traceback: {excerpt(res.err)}")
    if res.rc == 0:
        warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
        expect(len(warnings) <= 1, f"{what}: {len(warnings)} warnings: {warnings}")
        return f"{what} ok" + (" (skipped it)" if warnings else "")
    one_error(res, res.rc)
    return f"{what} exit {res.rc}: {res.errors()[0][7:90]}"


@case("checkpoint", "train.py, eval.py, serve.generate", "--damage_seeds random damages: a random file of step 2 or 4 "
      "truncated, emptied, deleted, bit-flipped, or replaced by step 4's/2's or another array file",
      "eval/generate exit 0 or one error line, workdir unchanged; train exit 0, at most one warning, bit-exact "
      "(flipped array bytes: no checksum, reported)")
def damage_fuzzer(b: Bench):
    notes = []
    for seed in range(b.damage_seeds):
        rng = random.Random(seed)
        wd = b.copy_run(f"damage-{seed}")
        step = rng.choice((2, 4))
        what = _damage(wd, step, rng)
        where = f"seed {seed}: {what}"
        try:
            before = digest(wd)
            outcome = []
            for cmd in ("eval", "generate"):
                explicit = rng.random() < 0.5
                args = (["eval.py", f"--workdir={wd}", "--mesh=1,1,1", f"--output={b.path('eval.json')}"]
                        if cmd == "eval" else
                        ["-m", "onona_jax.serve.generate", f"--workdir={wd}", "--prompt=It is", "--max_new_tokens=4",
                         "--greedy"])
                label = cmd + (f" --step={step}" if explicit else "")
                outcome.append(_fails_in_one_line_or_ok(b.run(args + ([f"--step={step}"] if explicit else [])), label))
            unchanged(before, wd)
            res = b.train(wd)
            if what.startswith("flip") and res.rc != 0:  # a flip that leaves valid JSON of other values
                outcome.append(f"train UNDETECTED flip, exit {res.rc}: {one_error(res, res.rc)[7:120]}")
                notes.append(f"{where} -> {', '.join(outcome)}")
                continue
            ok(res)
            warnings = [ln for ln in res.err.splitlines() if ln.startswith("warning:")]
            expect(len(warnings) <= 1, f"train: {len(warnings)} warnings: {warnings}")
            aside = [p for d in (wd / "checkpoints").glob("corrupt*") for p in d.iterdir()]
            expect(len(aside) == len(warnings), f"train: {len(warnings)} warnings, {len(aside)} steps set aside")
            got, ref = losses((wd / "metrics.jsonl").read_text()), losses((b.run_dir / "metrics.jsonl").read_text())
            same = all(v == [ref[s][0]] * len(v) for s, v in got.items()) and sorted(got) == sorted(ref)
            val = final_eval((wd / "metrics.jsonl").read_text())["val_loss"]
            ref_val = final_eval((b.run_dir / "metrics.jsonl").read_text())["val_loss"]
            if what.startswith("flip") and not warnings and (not same or val != ref_val):
                outcome.append(f"train UNDETECTED: val_loss {val} vs {ref_val} (flipped bytes inside an array "
                               "chunk: Orbax's zarr chunks carry no checksum)")
            else:
                expect(same, f"train: losses differ: {got} vs {ref}")
                expect(val == ref_val, f"train: final val_loss {val} vs {ref_val}")
                outcome.append("train fell back, bit-exact" if warnings else "train ok, bit-exact")
        except NotHeld as why:
            raise NotHeld(f"{where}: {why}") from None
        notes.append(f"{where} -> {', '.join(outcome)}")
    return " | ".join(notes)


@case("checkpoint", "python -m onona_jax.serve.generate", "train.py saving every step, keeping 3 (a live run)",
      "exit 0 twice, on a step that exists")
def generate_on_a_live_run(b: Bench):
    wd = b.path("wd")
    run = b.popen(b.train_args(wd, **{"train.steps": 60, "train.checkpoint_every": 1, "train.keep_checkpoints": 3}))
    try:
        wait_for(lambda: step_logged(wd, 3), 300, "step 3", run)
        for _ in range(2):
            res = b.run(["-m", "onona_jax.serve.generate", f"--workdir={wd}", "--prompt=It is", "--max_new_tokens=4",
                         "--greedy"])
            ok(res)
    finally:
        stop(run)
