"""`python benchmarks/bench.py --what=prepare`: data preparation's throughput by worker count, in
paired rounds, its shards checked bit-identical (bench.py's docstring)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli


def make_corpus(d: Path, copies: int, fmt: str) -> Path:
    """The bundled corpus `copies` times over, one document per paragraph, as `fmt`."""
    import lzma
    import re

    from onona_jax.tokenizer import bundled_corpus_path

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
    import hashlib

    h = hashlib.sha256()
    for p in sorted(out.glob("*.bin")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished (joined) worker processes."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def define_prepare(fv, argv):
    flags.DEFINE_integer("copies", 4, "copies of the bundled corpus (~1M tokens each)", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "paired rounds", flag_values=fv)
    flags.DEFINE_list("workers", ["1", "2"], "worker counts to compare, the first the baseline", flag_values=fv)
    flags.DEFINE_enum("format", "jsonl", ["jsonl", "txt", "parquet"], "input format", flag_values=fv)
    flags.DEFINE_string("output", None, "also write the results as JSON here", flag_values=fv)


def main_prepare(fv, rest, argv):
    import shutil

    from onona_jax.data.prepare import prepare

    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    try:
        workers = [int(w) for w in fv.workers]
    except ValueError:
        workers = []
    if not workers or min(workers) < 1 or fv.rounds < 1 or fv.copies < 1:
        raise cli.UsageError(f"--workers={','.join(fv.workers)}: positive integers, e.g. 1,2; --rounds and "
                             "--copies ≥ 1")
    tmp = Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    try:
        src = make_corpus(tmp, fv.copies, fv.format)
        rates: dict[int, list[float]] = {w: [] for w in workers}
        cpu: dict[int, list[tuple[float, float]]] = {w: [] for w in workers}
        digests = set()
        tokens = 0
        for r in range(fv.rounds):
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
        "format": fv.format,
        "tokens": tokens,
        "rounds": fv.rounds,
        "tokens_per_s_median": {w: statistics.median(v) for w, v in rates.items()},
        "speedup_per_round": {w: [a / b for a, b in zip(v, rates[base])] for w, v in rates.items()},
        # CPU seconds (main process, workers) per run: how the work divides, independent of other load.
        "cpu_s_main_workers": cpu,
        "bit_identical": len(digests) == 1,
        "machine": common.record(),
    }
    print(f"corpus: {tokens:,} tokens ({fv.format}), {result['machine']['cores']} CPUs, {fv.rounds} paired rounds")
    for w in workers:
        sp = result["speedup_per_round"][w]
        print(f"workers={w}: {result['tokens_per_s_median'][w] / 1e6:.3f} M tokens/s (median); "
              f"speed-up over workers={base} per round: {', '.join(f'{x:.2f}' for x in sp)}; CPU s (main, workers) "
              f"per run: {', '.join(f'({a:.2f}, {b:.2f})' for a, b in cpu[w])}")
    print(f"all arms wrote bit-identical shards: {result['bit_identical']}")
    if fv.output:
        Path(fv.output).write_text(json.dumps(result, indent=2) + "\n")
    if not result["bit_identical"]:
        raise cli.Failure("the worker counts wrote different shards")
