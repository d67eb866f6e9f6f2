"""Throughput of `python -m onona_jax.data.prepare` (tokens/s) against --workers, end to end.

    flock /tmp/onona-heavy.lock python benchmarks/prepare_bench.py [--copies 4] [--rounds 3] \
        [--workers 1 2] [--format jsonl] [--json out.json]

The corpus is the bundled Austen text repeated `--copies` times (about 1M tokens a copy), one
document per paragraph, written as `.jsonl` (or `.txt`/`.parquet`). Each round times one full
prepare per worker count, in turn (paired rounds: load from other jobs on a shared machine hits
every arm alike), including the start of the worker processes and the writing of the shards.
Prints tokens/s per arm (median over rounds), each round's speed-up over the first arm, the CPU
seconds of the main process and of the workers (how the work divides, whatever the load), the
load average before and after, and checks that every arm wrote bit-identical shards.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli
from onona_jax.data.prepare import prepare
from onona_jax.tokenizer import bundled_corpus_path


def make_corpus(d: Path, copies: int, fmt: str) -> Path:
    text = lzma.open(bundled_corpus_path(), "rt", encoding="utf-8").read()
    docs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()] * copies
    if fmt == "txt":
        path = d / "corpus.txt"
        path.write_text("\n\n".join(docs))
    elif fmt == "jsonl":
        path = d / "corpus.jsonl"
        with open(path, "w") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = d / "corpus.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=10_000)
    return path


def shards_digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("*.bin")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished (joined) worker processes."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def define(fv, argv):
    flags.DEFINE_integer("copies", 4, "copies of the bundled corpus (~1M tokens each)", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "paired rounds", flag_values=fv)
    flags.DEFINE_list("workers", ["1", "2"], "worker counts to compare, the first the baseline", flag_values=fv)
    flags.DEFINE_enum("format", "jsonl", ["jsonl", "txt", "parquet"], "input format", flag_values=fv)
    flags.DEFINE_string("json", None, "also write the results here", flag_values=fv)


def _main(fv, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    args = fv
    workers = [int(w) for w in fv.workers]

    tmp = Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    try:
        src = make_corpus(tmp, args.copies, args.format)
        rates: dict[int, list[float]] = {w: [] for w in workers}
        cpu: dict[int, list[tuple[float, float]]] = {w: [] for w in workers}
        digests = set()
        tokens = 0
        for r in range(args.rounds):
            for w in workers:
                out = tmp / f"out-{r}-{w}"
                t0, r0 = time.perf_counter(), _cpu()
                m = prepare([str(src)], str(out), shard_tokens=50_000_000, workers=w)
                dt, r1 = time.perf_counter() - t0, _cpu()
                cpu[w].append((r1[0] - r0[0], r1[1] - r0[1]))
                tokens = m["splits"]["train"]["tokens"] + m["splits"]["heldout"]["tokens"]
                rates[w].append(tokens / dt)
                digests.add(shards_digest(out))
                shutil.rmtree(out)
                print(f"round {r}: workers={w}: {tokens / dt / 1e6:.3f} M tokens/s ({dt:.2f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = workers[0]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "format": args.format,
        "tokens": tokens,
        "rounds": args.rounds,
        "tokens_per_s_median": {w: statistics.median(v) for w, v in rates.items()},
        "speedup_per_round": {w: [a / b for a, b in zip(v, rates[base])] for w, v in rates.items()},
        # CPU seconds (main process, workers) per run: how the work divides, independent of other load.
        "cpu_s_main_workers": cpu,
        "bit_identical": len(digests) == 1,
        "machine": common.record(),
    }
    print(f"corpus: {tokens:,} tokens ({args.format}), {result['machine']['cores']} CPUs, {args.rounds} paired rounds")
    for w in workers:
        sp = result["speedup_per_round"][w]
        print(f"workers={w}: {result['tokens_per_s_median'][w] / 1e6:.3f} M tokens/s (median); "
              f"speed-up over workers={base} per round: {', '.join(f'{x:.2f}' for x in sp)}; CPU s (main, workers) "
              f"per run: {', '.join(f'({a:.2f}, {b:.2f})' for a, b in cpu[w])}")
    print(f"all arms wrote bit-identical shards: {result['bit_identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not result["bit_identical"]:
        raise cli.Failure("the worker counts wrote different shards")


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__))
