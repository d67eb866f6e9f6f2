"""The battery's command, `python -m tests.battery` (its flags: `--help`): the chosen cases in the
table's order, then the kill -9 cycles of each store, one line each and the count at the end."""

from __future__ import annotations

import random
import socket
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

from benchmarks import common  # the scripts' command-line harness (the machine line, cli.run)
from onona_jax import cli

# the cases register in the table in this order (the order of --list and of a run)
from . import lock, inputs, checkpoints, storage, prepare, commands, interrupt  # noqa: F401
from . import __doc__ as DOC
from . import harness
from .cycles import Store, cycle, metrics_text
from .harness import Bench, CASES, CYCLE, Load, NotHeld, Skip, final_eval, ok


def define(fv, argv):
    flags.DEFINE_list("groups", [], "case groups to run (default: all): " + ", ".join(sorted({c["group"] for c in CASES})),
                      flag_values=fv)
    flags.DEFINE_list("cases", [], "case names to run (default: all; see --list)", flag_values=fv)
    flags.DEFINE_integer("cycles", 3, "kill -9 cycles per store", flag_values=fv)
    flags.DEFINE_list("stores", ["local", "gcs"], "where the cycles' workdirs live: local, gcs", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "the cycles' random moments", flag_values=fv)
    flags.DEFINE_integer("damage_seeds", 3, "damage-fuzzer's seeds (0, 1, ...): each damages one random file of a "
                         "checkpoint, then runs eval, generate and train", flag_values=fv)
    flags.DEFINE_bool("list", False, "print the table and run nothing", flag_values=fv)
    flags.DEFINE_string("keep", None, "keep the battery's files in this directory (default: a temporary one)",
                        flag_values=fv)
    flags.DEFINE_bool("verbose", False, "print each case's stderr tail", flag_values=fv)
    flags.DEFINE_integer("load", 0, "busy processes beside each timed case (CI: 8, a loaded 2-core host)",
                         flag_values=fv)


def _main(fv, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    unknown = sorted(set(fv.groups) - {c["group"] for c in CASES}) + sorted(set(fv.cases) - {c["name"] for c in CASES})
    if unknown:
        raise cli.UsageError(f"unknown groups or cases {unknown}; see --list")
    if set(fv.stores) - {"local", "gcs"}:
        raise cli.UsageError(f"--stores={','.join(fv.stores)}: local and/or gcs")
    chosen = [c for c in CASES if (not fv.groups or c["group"] in fv.groups) and (not fv.cases or c["name"] in fv.cases)]
    if fv.load < 0:
        raise cli.UsageError(f"--load={fv.load}: give a number of busy processes, 0 or more")
    if fv.list:
        for c in CASES:
            print(f"{c['group']:10s} {c['name']:36s} {c['command']} | fault: {c['fault']} | expect: {c['expected']}")
        return 0
    if fv.keep:
        root = Path(fv.keep).resolve()
        root.mkdir(parents=True, exist_ok=False)
        return _battery(fv, chosen, root)
    with tempfile.TemporaryDirectory(prefix="onona-faults-") as tmp:
        return _battery(fv, chosen, Path(tmp))


def _battery(fv, chosen, root: Path) -> int:
    b = Bench(root, fv.verbose)
    b.damage_seeds = fv.damage_seeds
    tried = held = skipped = 0
    failed = []
    t0 = time.perf_counter()
    print(f"fault battery on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M')}: {len(chosen)} cases, "
          f"{fv.cycles} kill cycles on {','.join(fv.stores) if fv.cycles else 'no store'}"
          + (f"; timed cases beside {fv.load} busy processes" if fv.load else ""), flush=True)

    def report(name: str, fn):
        nonlocal tried, held, skipped
        t = time.perf_counter()
        try:
            note = fn()
        except Skip as why:
            skipped += 1
            print(f"  skipped  {name}  ({why})", flush=True)
            return
        except NotHeld as why:
            tried += 1
            failed.append(name)
            print(f"  FAILED   {name}  [{time.perf_counter() - t:5.1f} s]  {why}", flush=True)
            return
        except Exception as err:  # noqa: BLE001 - an expectation the case could not even check
            tried += 1
            failed.append(name)
            print(f"  FAILED   {name}  [{time.perf_counter() - t:5.1f} s]  {type(err).__name__}: {err}", flush=True)
            return
        tried += 1
        held += 1
        print(f"  held     {name}  [{time.perf_counter() - t:5.1f} s]{'  ' + note if note else ''}", flush=True)

    try:
        def loaded(c):
            harness.LOAD = Load(fv.load if c["timed"] else 0)  # what exit_bound reads
            with harness.LOAD:
                return c["fn"](b)

        for c in chosen:
            report(f"{c['group']}/{c['name']}", lambda c=c: loaded(c))
        if fv.cycles:
            rng = random.Random(fv.seed)
            for store_name in fv.stores:
                store = Store(b, store_name)
                reference = {}

                def uninterrupted(store=store, reference=reference):
                    wd = store.workdir("reference")
                    ok(b.train(wd, **CYCLE))
                    reference["text"] = metrics_text(store, wd)
                    return f"val_loss {final_eval(reference['text'])['val_loss']:.6f}"

                report(f"cycles/{store_name}/uninterrupted", uninterrupted)
                if "text" not in reference:
                    continue
                for i in range(fv.cycles):
                    report(f"cycles/{store_name}/{i}", lambda store=store, i=i: cycle(b, store, reference["text"], rng, i))
    finally:
        if b.gcs is not None:
            b.gcs.stop()
    print(f"{tried} cases tried, {held} held, {skipped} skipped ({time.perf_counter() - t0:.0f} s)"
          + (f"; not held: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, DOC))
