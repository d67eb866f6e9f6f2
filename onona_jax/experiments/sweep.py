"""Run one of the paper's experiment grids (`experiments/grids.py`): every arm × seed is
trained with `train.py` and evaluated with `eval.py`, in sequence, in `DIR/<arm>/seed<k>`.

    python -m onona_jax.experiments.sweep --grid=factorial --size=small --seeds=0,1 --workdir=runs/fact
    python -m onona_jax.experiments.sweep --grid=table1 --seeds=0,1,2 --workdir=runs/t1 \
        --emit=commands.sh -- --config.data.dir=/data/climbmix --config.mesh.data=8
    python -m onona_jax.experiments.sweep --grid=depth --workdir=runs/depth --dry_run
    python -m onona_jax.experiments.report runs/fact          # DIR/report.md, report.json, report.png

Flags after `--` go to every `train.py` call; `--arms=a,b` runs a subset of the grid. Each
run's stdout and stderr go to `DIR/<arm>/seed<k>/logs/{train,eval}.{out,err}`. A run that fails (train or eval exits
non-zero) is recorded in `DIR/sweep_status.json` with its exit code and the tail of its
stderr, and the sweep continues with the next one; rerunning the same command resumes each
run from its checkpoints (train.py) and re-evaluates it. `--emit=PATH` writes one shell line
per arm × seed (train && eval) for a cluster scheduler and runs nothing (`--python=python`
names the interpreter the cluster's nodes use; default: this one). `DIR/grid.json`
describes the grid (arms, baselines, seeds, size) for the report; seeds of earlier calls on
the same DIR are kept in it. (Runs launched from emitted lines record no status: the report
shows a run without an eval file as missing.) A sweep holds `DIR/lock.json` (the lock train.py
takes on a workdir) while it writes DIR, so a second sweep on DIR exits 2 naming the first; each
run's train.py holds its own run directory.

`--engine=ray --address=auto|HOST:PORT` runs the same commands on a Ray cluster instead, each
run placed by Ray (`--cpus`, `--gpus`, `--tpu`; `--hosts=N`: a gang of N hosts), relaunched
after a pre-emption and retried after a failure within `--max_preemptions` / `--max_failures`,
each run's account in `DIR/fleet/` (experiments/ray_engine.py, fleet.py; docs/pods.md, "A grid
on a fleet"). `--status` prints every run's state, step, pre-emptions, failures, last error line
and logs, and runs nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time

from absl import flags

from onona_jax import cli, paths
from onona_jax.experiments import grids
from onona_jax.experiments.grids import PAPER_CONFIGS, command_line, commands, config_flags, repo_root, run_dir
from onona_jax.train.lock import WorkdirLock, raise_if_lost as raise_if_lock_lost

STDERR_TAIL = 4000  # characters of a failed run's stderr kept in sweep_status.json


def arm_config(spec: str, overrides: dict, extra=(), root: str | None = None):
    """The validated config train.py builds for an arm: `--config=configs/paper.py:<spec>`, the
    arm's overrides and the sweep's `--config.*` flags after `--`, parsed as train.py parses them."""
    from onona_jax import config as config_lib

    argv = ["train.py", f"--config={os.path.join(root or repo_root(), PAPER_CONFIGS)}:{spec}",
            *config_flags(overrides), *[a for a in extra if a.startswith("--config.")]]
    fv = flags.FlagValues()
    config_lib.define_flag(fv, argv)
    fv(argv)
    return config_lib.validate(fv.config)


def grid_info(name: str, size: str | None = None, root: str | None = None, extra=()) -> dict:
    """The grid (`grids.grid_info`) with every arm's config built as its train.py command line
    builds it, `--` flags included (a parameter-matched arm matches the model it will be compared
    with), and each arm's budget under "budget"."""
    from onona_jax import summary

    info = grids.grid_info(name, size, lambda spec, o: arm_config(spec, o, extra, root), root)
    for arm in info["arms"]:  # steps, tokens, FLOPs, params as train.py will run it
        arm["budget"] = summary.budget(arm_config(arm["spec"], arm["overrides"], extra, root))
    return info


def budget_table(arms) -> str:
    """Each arm's parameters, steps, tokens and training FLOPs (`summary.budget`), against its
    size's reference (Dense Standard): what the grid matches, before anything trains."""
    rows = [("arm", "budget", "params", "steps", "tokens", "tokens/param", "train FLOPs", "FLOPs/reference")]
    for a in arms:
        b = a["budget"]
        rows.append((a["name"], b["budget"], f"{b['params']:,}", f"{b['steps']:,}", f"{b['tokens']:,}",
                     f"{b['tokens_per_param']:.2f}", f"{b['flops']:.4e}", f"{b['flops'] / b['reference_flops']:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _read_json(path: str, default):
    try:
        return json.loads(paths.read_text(path))
    except FileNotFoundError:
        return default


def write_grid_json(workdir: str, info: dict, seeds, extra=()) -> dict:
    """DIR/grid.json; seeds already recorded there by an earlier call on this grid are kept."""
    path = paths.Sweepdir(workdir).grid
    old = _read_json(path, None)
    if old is not None and (old.get("grid"), old.get("size")) != (info["grid"], info["size"]):
        raise ValueError(
            f"{path} describes grid {old.get('grid')!r} at size {old.get('size')!r}, not "
            f"{info['grid']!r} at {info['size']!r}; use another --workdir"
        )
    all_seeds = sorted(set(seeds) | set(old.get("seeds", []) if old else []))
    grid = dict(info, seeds=all_seeds, train_flags=list(extra), updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    paths.write_json(path, grid)
    return grid


def emit(path: str, arms, seeds, workdir: str, extra=(), root: str | None = None,
         python: str | None = None):
    """Write one shell line per arm × seed (train && eval) to path; nothing runs."""
    lines = [command_line(arm, seed, workdir, extra, root, python) for arm in arms for seed in seeds]
    paths.write_atomic(path, "\n".join(lines) + "\n")
    return lines


def _send(child, signum):
    try:
        child.send_signal(signum)
    except OSError:
        pass


def _run_one(stage: str, argv, cwd: str, log_dir: str):
    """Run argv with stdout/stderr into log_dir/<stage>.{out,err} (written locally, then copied
    whole to a bucket log_dir); (returncode, stderr tail)."""
    local = tempfile.mkdtemp(prefix="onona-sweep-log-") if paths.is_cloud(log_dir) else log_dir
    os.makedirs(local, exist_ok=True)
    out_path, err_path = (os.path.join(local, f"{stage}.{x}") for x in ("out", "err"))
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            child = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err)
            # A Ctrl-C at a terminal reaches the run itself (the same process group); a SIGINT to the
            # sweep alone (`kill -INT`) is passed on as a SIGTERM, a pre-emption: either way the run
            # saves its step and stops, and the sweep after it (`run_sweep`). A second SIGINT kills it.
            with cli.graceful_stop(lambda: _send(child, signal.SIGTERM), child.kill):
                rc = child.wait()
        with open(err_path, errors="replace") as f:
            tail = f.read()[-STDERR_TAIL:]
        if local != log_dir:
            for f in (out_path, err_path):
                paths.upload(f, paths.join(log_dir, os.path.basename(f)))
    finally:
        if local != log_dir:
            shutil.rmtree(local, ignore_errors=True)
    return rc, tail


def run_sweep(arms, seeds, workdir: str, extra=(), root: str | None = None, command_fn=None,
              log=print, python: str | None = None) -> dict:
    """Train then evaluate every arm × seed in sequence; a failure is recorded in
    DIR/sweep_status.json and the sweep goes on. `command_fn(arm, seed, workdir, extra)` ->
    [(stage, argv), ...] replaces the train/eval commands (tests)."""
    root = root or repo_root()
    command_fn = command_fn or (lambda arm, seed, wd, ex: commands(arm, seed, wd, ex, python))
    status_path = paths.Sweepdir(workdir).status
    status = _read_json(status_path, {})
    total, done = len(arms) * len(seeds), 0
    for arm in arms:
        for seed in seeds:
            raise_if_lock_lost()  # a sweep whose lock on DIR was lost (a bucket lease) starts no more runs
            done += 1
            key = f"{arm['name']}/seed{seed}"
            rd = run_dir(workdir, arm["name"], seed)
            entry = dict(arm=arm["name"], seed=seed, spec=arm["spec"], status="running",
                         started=time.strftime("%Y-%m-%dT%H:%M:%S"), run_dir=rd)
            status[key] = entry
            paths.write_json(status_path, status)
            t0 = time.time()
            log(f"[{done}/{total}] {key}: {arm['spec']} {arm.get('overrides') or ''}".rstrip())
            for stage, argv in command_fn(arm, seed, workdir, extra):
                rc, tail = _run_one(stage, argv, root, paths.Workdir(rd).logs)
                if cli.interrupted():  # (a Ctrl-C: the run stopped as it does alone; the sweep stops after it)
                    entry.update(status="interrupted", stage=stage, returncode=rc, duration_s=round(time.time() - t0, 1))
                    paths.write_json(status_path, status)
                    raise cli.Interrupted(f"stopped {key} at its {stage} (exit {rc}; its log: "
                                          f"{paths.Workdir(rd).logs}); rerun the same command to resume the sweep")
                if rc != 0:
                    entry.update(status="failed", stage=stage, returncode=rc, stderr_tail=tail,
                                 command=shlex.join(argv))
                    log(f"    {stage} failed with exit code {rc} (logs in {paths.Workdir(rd).logs})")
                    break
            else:
                entry.update(status="ok")
            entry["duration_s"] = round(time.time() - t0, 1)
            paths.write_json(status_path, status)
    return status


def define(fv, argv):
    flags.DEFINE_string("grid", None, f"the grid: {', '.join(grids.GRIDS)}", flag_values=fv, required=True)
    flags.DEFINE_string("size", None, "run every arm at this size (e.g. small); default: the paper's", flag_values=fv)
    flags.DEFINE_list("seeds", ["0"], "comma-separated seeds, e.g. 0,1,2", flag_values=fv)
    flags.DEFINE_list("arms", [], "comma-separated subset of the grid's arms to run", flag_values=fv)
    flags.DEFINE_string("workdir", None, "sweep directory; runs go to DIR/<arm>/seed<k>", flag_values=fv, required=True)
    flags.DEFINE_string("emit", None, "write the command lines to this file and run nothing", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "print the commands and write nothing", flag_values=fv)
    flags.DEFINE_string("python", None, "interpreter in the commands (default: this one); e.g. python for --emit",
                        flag_values=fv)
    flags.DEFINE_enum("engine", "local", ["local", "ray"], "local: every run in turn on this host; ray: the "
                      "runs on a Ray cluster (--address), relaunched after a pre-emption (docs/pods.md)",
                      flag_values=fv)
    flags.DEFINE_bool("status", False, "print each run's state (queued, running, pre-empted, failed, done), "
                      "step, pre-emptions, failures, last error line and logs; run nothing", flag_values=fv)
    # --engine=ray (experiments/ray_engine.py, fleet.py)
    flags.DEFINE_string("address", None, "the Ray cluster: auto (the one this host belongs to) or its head's "
                        "HOST:PORT", flag_values=fv)
    flags.DEFINE_integer("max_failures", None, "failed attempts of a run tried again (default 2)", flag_values=fv)
    flags.DEFINE_integer("max_preemptions", None, "pre-emptions of a run tried again (default: no limit)",
                         flag_values=fv)
    flags.DEFINE_integer("hosts", None, "hosts per run (default 1); more: a gang, one process per host",
                         flag_values=fv)
    flags.DEFINE_float("cpus", None, "CPUs per host of a run (default 1)", flag_values=fv)
    flags.DEFINE_float("gpus", None, "GPUs per host of a run (default 0)", flag_values=fv)
    flags.DEFINE_string("tpu", None, "a TPU slice per run, <version>:<topology> (e.g. v5e:4x4)", flag_values=fv)


RAY_FLAGS = ("address", "max_failures", "max_preemptions", "hosts", "cpus", "gpus", "tpu")


def _fleet_options(fv):
    """(address, Placement, Budgets) of --engine=ray, validated; one `error:` line otherwise."""
    from onona_jax.experiments import fleet, ray_engine

    given = [f"--{k}" for k in RAY_FLAGS if getattr(fv, k) is not None]
    if fv.engine != "ray":
        if given:
            raise cli.UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --engine=ray")
        return None
    placement = ray_engine.Placement(fv.hosts if fv.hosts is not None else 1,
                                     fv.cpus if fv.cpus is not None else 1, fv.gpus or 0, fv.tpu or "")
    budgets = fleet.Budgets(fv.max_preemptions, fv.max_failures if fv.max_failures is not None else 2)
    address = fv.address or "auto"
    ray_engine.check_flags(address, placement, budgets)
    return address, placement, budgets


def _main(fv, extra):
    """`extra`: the flags after `--`, passed to every train.py call (-- --config.train.steps=500)."""
    try:
        seeds = [int(s) for s in fv.seeds if s.strip()]
    except ValueError:
        raise cli.UsageError(f"--seeds={','.join(fv.seeds)}: expected comma-separated integers") from None
    if not seeds:
        raise cli.UsageError("--seeds is empty")
    stray = [a for a in extra if not a.startswith("-")]
    if stray:
        raise cli.UsageError(f"unexpected arguments {stray}; flags for train.py go after `--`")
    root = repo_root()
    try:
        info = grid_info(fv.grid, fv.size, root, extra)
    except (ValueError, flags.Error) as err:
        raise cli.UsageError(str(err).splitlines()[0]) from None
    workdir = paths.absolute(fv.workdir)
    arms = info["arms"]
    if fv.arms:
        unknown = sorted(set(fv.arms) - {a["name"] for a in arms})
        if unknown:
            raise cli.UsageError(f"--arms {', '.join(unknown)} not in grid {fv.grid} "
                                 f"({', '.join(a['name'] for a in arms)})")
        arms = [a for a in arms if a["name"] in fv.arms]
    if fv.status:
        from onona_jax.experiments import fleet

        print(fleet.table(fleet.runs(arms, seeds, workdir), _read_json(paths.Sweepdir(workdir).status, {})))
        return 0
    engine = _fleet_options(fv)
    if fv.dry_run:
        print("# " + budget_table(arms).replace("\n", "\n# "))
        for arm in arms:
            for seed in seeds:
                print(command_line(arm, seed, workdir, extra, root, fv.python))
        return 0
    ray = None
    if engine and not fv.emit:
        from onona_jax.experiments import ray_engine

        ray = ray_engine.connect(engine[0])
        ray_engine.check_storage(ray, workdir)
    with WorkdirLock(workdir):  # one sweep per directory: grid.json, sweep_status.json and the runs' logs
        write_grid_json(workdir, info, seeds, extra)
        if ray is not None:
            return _run_on_fleet(ray, engine, arms, seeds, workdir, extra, fv.python)
        if fv.emit:
            lines = emit(fv.emit, arms, seeds, workdir, extra, root, fv.python)
            print(f"wrote {len(lines)} command lines to {fv.emit}; "
                  f"then: python -m onona_jax.experiments.report {workdir}")
            return 0
        try:
            status = run_sweep(arms, seeds, workdir, extra, root, python=fv.python)
        except cli.Interrupted as err:
            if str(err).startswith("stopped "):  # (run_sweep's own line: which run it stopped)
                raise
            raise cli.Interrupted("the sweep stopped between runs; rerun the same command to resume it") from None
    keys = [f"{a['name']}/seed{s}" for a in arms for s in seeds]
    failed = [k for k in keys if status[k].get("status") == "failed"]
    print(f"done: {len(arms) * len(seeds)} runs, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "")
          + f"; python -m onona_jax.experiments.report {workdir}")
    return 1 if failed else 0


def _run_on_fleet(ray, engine, arms, seeds, workdir, extra, python) -> int:
    from onona_jax.experiments import fleet, ray_engine

    address, placement, budgets = engine
    runs = fleet.runs(arms, seeds, workdir)
    states = ray_engine.run_sweep(address, runs, budgets, placement, extra, python, ray=ray)
    print(fleet.table(runs))
    missing = [k for k, r in states.items() if r["state"] != "done"]
    print(f"done: {len(runs) - len(missing)} of {len(runs)} runs"
          + (f"; not done: {', '.join(missing)} (sweep --status; rerun the same command to retry them)"
             if missing else "")
          + f"; python -m onona_jax.experiments.report {workdir}")
    return 1 if missing else 0


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
