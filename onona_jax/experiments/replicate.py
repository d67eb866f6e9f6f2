"""A first answer on a CPU (docs/results.md): Dense onóna vs Standard at the `micro` size, with a
byte-level BPE trained on the corpus itself, over seeds, with its report and gate analysis, in one
command, on the bundled corpus or any text a user points it at:

    python -m onona_jax.experiments.replicate --workdir=runs/replicate
    python -m onona_jax.experiments.replicate --workdir=runs/mine --text=/data/corpus.jsonl [--entries=1024]

1. DIR/data: `prepare` of --text (default: the bundled corpus), tokenised with a BPE of --entries
   entries trained on its training split (`prepare --train_tokenizer`);
2. DIR/sweep: grid `headline` (standard, twin) at --size over --seeds (`experiments.sweep`), each
   run's data and tokenizer DIR/data's; flags after `--` go to every train.py;
3. DIR/sweep/report.md (`experiments.report`: Δ twin − Standard paired by seed with its 95% interval,
   the budgets and data passes, the table ablations) and each twin run's gate analysis
   (`analysis.gate`: the gate by token class);
4. DIR/replicate.json: the stages' wall times, the machine, the command.

Rerunning the same command goes on where it stopped: the data is kept, the sweep resumes each run
from its checkpoints.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

from absl import flags

from onona_jax import cli, paths


def machine() -> dict:
    """What the timings ran on: CPU model, cores, memory, load, jax's version."""
    model = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    mem = next((line.split()[1] for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), "0")
    import jax

    return dict(cpu=model, cores=os.cpu_count(), memory_gib=round(int(mem) / 2**20, 1),
                load_average=list(os.getloadavg()), python=platform.python_version(), jax=jax.__version__)


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def prepare_data(workdir: str, text: list[str], entries: int) -> str:
    """DIR/data with a BPE of `entries` entries trained on the text, or the one a previous call
    prepared there (the same entries, else an error naming the fix)."""
    from onona_jax.data import prepare
    from onona_jax.tokenizer import bundled_corpus_path

    data = paths.join(workdir, "data")
    manifest = paths.join(data, "manifest.json")
    if paths.exists(manifest):
        trained = json.loads(paths.read_text(manifest))["tokenizer"].get("trained", {})
        if trained.get("entries") != entries:
            raise ValueError(f"{data} holds data prepared with a tokenizer of {trained.get('entries')} trained entries, "
                             f"not --entries={entries}; use another --workdir")
        print(f"reusing {data} (prepared before)", file=sys.stderr)
        return data
    prepare.prepare(text or [str(bundled_corpus_path())], data, train_tokenizer=entries)
    return data


def define(fv, argv):
    flags.DEFINE_string("workdir", None, "directory of the data, the sweep and the report", flag_values=fv,
                        required=True)
    flags.DEFINE_multi_string("text", [], "the corpus (what prepare's --input takes; repeatable); default: the "
                              "bundled corpus", flag_values=fv)
    flags.DEFINE_integer("entries", 1024, "entries of the BPE trained on the text (the model's vocabulary)",
                         flag_values=fv)
    flags.DEFINE_string("size", "micro", "the model size (configs/paper.py SIZES)", flag_values=fv)
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of each arm", flag_values=fv)


def _main(fv, extra):
    from onona_jax.experiments import report, sweep

    if paths.is_cloud(fv.workdir):  # the BPE it trains is data.tokenizer, which is read from a local file
        raise cli.UsageError(f"--workdir={fv.workdir}: a local directory (the tokenizer it trains is read from a "
                             "local file); copy the results to the bucket afterwards")
    workdir = paths.absolute(fv.workdir)
    timings, t0 = {}, time.time()
    before = machine()
    data = prepare_data(workdir, fv.text, fv.entries)
    timings["prepare_s"] = round(time.time() - t0, 1)
    flags_ = [f"--config.data.dir={data}", f"--config.data.tokenizer={paths.join(data, 'tokenizer.json')}",
              *extra]
    sweep_dir = paths.join(workdir, "sweep")
    t = time.time()
    rc = sweep.main(["--grid=headline", f"--size={fv.size}", f"--seeds={','.join(fv.seeds)}",
                     f"--workdir={sweep_dir}", "--", *flags_])
    timings["sweep_s"] = round(time.time() - t, 1)
    if rc:
        raise cli.Failure(f"the sweep in {sweep_dir} ended with exit code {rc} (its sweep_status.json says which "
                          "runs failed); rerun the same command to go on")
    rep = report.write(sweep_dir)
    t = time.time()
    for arm in (a for a in rep["arms"] if a["spec"].endswith("-twin")):
        for seed in fv.seeds:
            run = paths.Sweepdir(sweep_dir).run(arm["name"], int(seed)).root
            done = subprocess.run([sys.executable, "-m", "onona_jax.analysis.gate", f"--workdir={run}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:  # its own error line, not a CalledProcessError traceback
                last = (done.stderr.strip().splitlines() or [""])[-1]
                raise cli.Failure(f"the gate analysis of {run} failed ({last}); the runs and the report are kept: "
                                  f"rerun python -m onona_jax.analysis.gate --workdir={run}")
    timings["gate_s"] = round(time.time() - t, 1)
    status = json.loads(paths.read_text(paths.Sweepdir(sweep_dir).status))
    record = dict(command=" ".join(["python -m onona_jax.experiments.replicate", *sys.argv[1:]]),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine_before=before,
                  machine_after=machine(), timings=timings,
                  runs_s={k: v.get("duration_s") for k, v in status.items()},
                  total_s=round(time.time() - t0, 1))
    paths.write_json(paths.join(workdir, "replicate.json"), record)
    twin = next(a for a in rep["arms"] if not a["is_baseline"])
    d = twin.get("delta") or {}
    print(f"Δ {twin['name']} − {twin['baseline']}: {d.get('mean')} ± {d.get('ci95')} (95%, n={d.get('n')}); "
          f"{paths.join(sweep_dir, 'report.md')}; {record['total_s']:.0f} s in all")


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
