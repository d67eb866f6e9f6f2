"""Run one of the paper's experiment grids (`configs/paper.py` GRIDS): every arm × seed is
trained with `train.py` and evaluated with `eval.py`, in sequence, in `DIR/<arm>/seed<k>`.

    python -m onona_jax.sweep --grid=factorial --size=small --seeds=0,1 --workdir=runs/fact
    python -m onona_jax.sweep --grid=table1 --seeds=0,1,2 --workdir=runs/t1 \
        --emit=commands.sh -- --config.data.dir=/data/climbmix --config.mesh.data=8
    python -m onona_jax.sweep --grid=depth --workdir=runs/depth --dry_run
    python -m onona_jax.report runs/fact          # DIR/report.md, report.json, report.png

Flags after `--` go to every `train.py` call; `--arms=a,b` runs a subset of the grid. Each
run's stdout and stderr go to `DIR/<arm>/seed<k>/logs/{train,eval}.{out,err}`. A run that fails (train or eval exits
non-zero) is recorded in `DIR/sweep_status.json` with its exit code and the tail of its
stderr, and the sweep continues with the next one; rerunning the same command resumes each
run from its checkpoints (train.py) and re-evaluates it. `--emit=PATH` writes one shell line
per arm × seed (train && eval) for a cluster scheduler and runs nothing (`--python=python`
names the interpreter the cluster's nodes use; default: this one). `DIR/grid.json`
describes the grid (arms, baselines, seeds, size) for the report; seeds of earlier calls on
the same DIR are kept in it. (Runs launched from emitted lines record no status: the report
shows a run without an eval file as missing.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

STDERR_TAIL = 4000  # characters of a failed run's stderr kept in sweep_status.json


def repo_root() -> str:
    """The directory holding train.py, eval.py and configs/paper.py."""
    candidates = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.getcwd()]
    for root in candidates:
        if all(os.path.exists(os.path.join(root, f)) for f in ("train.py", "eval.py", "configs/paper.py")):
            return root
    raise SystemExit(
        "error: cannot find train.py, eval.py and configs/paper.py next to the onona_jax package "
        "or in the current directory; run from the onona-jax repository root"
    )


def load_paper_configs(root: str | None = None):
    """configs/paper.py as a module (it is a config file, not part of the package)."""
    path = os.path.join(root or repo_root(), "configs", "paper.py")
    spec = importlib.util.spec_from_file_location("_onona_paper_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grid_info(name: str, size: str | None = None, root: str | None = None) -> dict:
    return load_paper_configs(root).grid_info(name, size)


def run_dir(workdir: str, arm: str, seed: int) -> str:
    return os.path.join(workdir, arm, f"seed{seed}")


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def commands(arm: dict, seed: int, workdir: str, extra=(), python: str | None = None) -> list:
    """[("train", argv), ("eval", argv)] for one arm × seed; argv run with cwd = repo root."""
    python = python or sys.executable
    rd = run_dir(workdir, arm["name"], seed)
    train = [python, "train.py", f"--config=configs/paper.py:{arm['spec']}", f"--workdir={rd}",
             f"--config.seed={seed}"]
    train += [f"--config.{k}={_value(v)}" for k, v in arm.get("overrides", {}).items()]
    train += list(extra)
    return [("train", train), ("eval", [python, "eval.py", f"--workdir={rd}"])]


def _write_json(obj, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def _read_json(path: str, default):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def write_grid_json(workdir: str, info: dict, seeds, extra=()) -> dict:
    """DIR/grid.json; seeds already recorded there by an earlier call on this grid are kept."""
    path = os.path.join(workdir, "grid.json")
    old = _read_json(path, None)
    if old is not None and (old.get("grid"), old.get("size")) != (info["grid"], info["size"]):
        raise SystemExit(
            f"error: {path} describes grid {old.get('grid')!r} at size {old.get('size')!r}, not "
            f"{info['grid']!r} at {info['size']!r}; use another --workdir"
        )
    all_seeds = sorted(set(seeds) | set(old.get("seeds", []) if old else []))
    grid = dict(info, seeds=all_seeds, train_flags=list(extra), updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _write_json(grid, path)
    return grid


def command_line(arm: dict, seed: int, workdir: str, extra=(), root: str | None = None,
                 python: str | None = None) -> str:
    """`cd ROOT && <train> && <eval>` for one arm × seed."""
    parts = [f"cd {shlex.quote(root or repo_root())}"]
    argvs = commands(arm, seed, workdir, extra, python)
    return " && ".join(parts + [shlex.join(argv) for _, argv in argvs])


def emit(path: str, arms, seeds, workdir: str, extra=(), root: str | None = None,
         python: str | None = None):
    """Write one shell line per arm × seed (train && eval) to path; nothing runs."""
    lines = [command_line(arm, seed, workdir, extra, root, python) for arm in arms for seed in seeds]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def _run_one(stage: str, argv, cwd: str, log_dir: str):
    """Run argv with stdout/stderr into log_dir/<stage>.{out,err}; (returncode, stderr tail)."""
    os.makedirs(log_dir, exist_ok=True)
    out_path, err_path = (os.path.join(log_dir, f"{stage}.{x}") for x in ("out", "err"))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        rc = subprocess.call(argv, cwd=cwd, stdout=out, stderr=err)
    with open(err_path, errors="replace") as f:
        tail = f.read()[-STDERR_TAIL:]
    return rc, tail


def run_sweep(arms, seeds, workdir: str, extra=(), root: str | None = None, command_fn=None,
              log=print, python: str | None = None) -> dict:
    """Train then evaluate every arm × seed in sequence; a failure is recorded in
    DIR/sweep_status.json and the sweep goes on. `command_fn(arm, seed, workdir, extra)` ->
    [(stage, argv), ...] replaces the train/eval commands (tests)."""
    root = root or repo_root()
    command_fn = command_fn or (lambda arm, seed, wd, ex: commands(arm, seed, wd, ex, python))
    status_path = os.path.join(workdir, "sweep_status.json")
    status = _read_json(status_path, {})
    total, done = len(arms) * len(seeds), 0
    for arm in arms:
        for seed in seeds:
            done += 1
            key = f"{arm['name']}/seed{seed}"
            rd = run_dir(workdir, arm["name"], seed)
            entry = dict(arm=arm["name"], seed=seed, spec=arm["spec"], status="running",
                         started=time.strftime("%Y-%m-%dT%H:%M:%S"), run_dir=rd)
            status[key] = entry
            _write_json(status, status_path)
            t0 = time.time()
            log(f"[{done}/{total}] {key}: {arm['spec']} {arm.get('overrides') or ''}".rstrip())
            for stage, argv in command_fn(arm, seed, workdir, extra):
                rc, tail = _run_one(stage, argv, root, os.path.join(rd, "logs"))
                if rc != 0:
                    entry.update(status="failed", stage=stage, returncode=rc, stderr_tail=tail,
                                 command=shlex.join(argv))
                    log(f"    {stage} failed with exit code {rc} (logs in {os.path.join(rd, 'logs')})")
                    break
            else:
                entry.update(status="ok")
            entry["duration_s"] = round(time.time() - t0, 1)
            _write_json(status, status_path)
    return status


def parse_args(argv):
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    else:
        extra = []
    p = argparse.ArgumentParser(
        prog="python -m onona_jax.sweep", description=__doc__.split("\n\n")[0],
        epilog="Flags after `--` are passed to every train.py call, e.g. -- --config.train.steps=500",
    )
    p.add_argument("--grid", required=True, help="table1, output_layer, controls, factorial or depth")
    p.add_argument("--size", default=None, help="run every arm at this size (e.g. small); default: the paper's")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    p.add_argument("--arms", default=None, help="comma-separated subset of the grid's arms to run")
    p.add_argument("--workdir", required=True, help="sweep directory; runs go to DIR/<arm>/seed<k>")
    p.add_argument("--emit", default=None, help="write the command lines to this file and run nothing")
    p.add_argument("--dry_run", action="store_true", help="print the commands and write nothing")
    p.add_argument("--python", default=None,
                   help="interpreter in the commands (default: this one); e.g. python for --emit")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"unrecognized arguments {' '.join(unknown)}; flags for train.py go after `--`")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds={args.seeds!r}: expected comma-separated integers")
    if not args.seeds:
        p.error("--seeds is empty")
    return args, extra


def main(argv=None):
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    root = repo_root()
    try:
        info = grid_info(args.grid, args.size, root)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    workdir = os.path.abspath(args.workdir)
    arms = info["arms"]
    if args.arms:
        wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = sorted(set(wanted) - {a["name"] for a in arms})
        if unknown:
            raise SystemExit(f"error: --arms {', '.join(unknown)} not in grid {args.grid} "
                             f"({', '.join(a['name'] for a in arms)})")
        arms = [a for a in arms if a["name"] in wanted]
    if args.dry_run:
        for arm in arms:
            for seed in args.seeds:
                print(command_line(arm, seed, workdir, extra, root, args.python))
        return 0
    write_grid_json(workdir, info, args.seeds, extra)
    if args.emit:
        lines = emit(args.emit, arms, args.seeds, workdir, extra, root, args.python)
        print(f"wrote {len(lines)} command lines to {args.emit}; then: python -m onona_jax.report {workdir}")
        return 0
    status = run_sweep(arms, args.seeds, workdir, extra, root, python=args.python)
    keys = [f"{a['name']}/seed{s}" for a in arms for s in args.seeds]
    failed = [k for k in keys if status[k].get("status") == "failed"]
    print(f"done: {len(arms) * len(args.seeds)} runs, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "")
          + f"; python -m onona_jax.report {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
