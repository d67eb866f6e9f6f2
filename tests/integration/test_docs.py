"""The docs cannot rot: the site builds, and every command the docs mark as quick runs.

A fenced bash block in README.md or docs/**/*.md whose line above is an HTML comment

    <!-- quick -->                               or
    <!-- quick: expect "181,104,128" "103,837,184" -->

(invisible in the rendered page) is a command that runs in seconds on a CPU: `test_quick_commands`
runs each of its command lines as written (backslash continuations joined, comment lines
skipped), each as `bash -e -o pipefail -c LINE`, in a scratch directory that links every entry of
the repository's root (so `configs/...`, `train.py`, `benchmarks/...` resolve, and what a command
writes, `runs/...`, `hf/...`, lands in the scratch directory), with JAX_PLATFORMS=cpu, one device,
and a time limit a block. Each `expect` string must be printed by the block (stdout or stderr)
and must be stated in the doc itself outside the comment, so the figure the reader sees is the
one the command prints. Mark only commands that take seconds: training a paper-sized model or a
slice's AOT compile must never be marked.

A block that names `runs/dense-small-twin` (the main job's workdir) needs a run there: the test
makes one first (`PREREQUISITES`: the main job's own `python train.py`, cut to one step and 8
validation windows), once per session and shared by xdist workers.

`scripts/check_main_job.py` (the main job's val_loss against the README's) is unit-tested here too.
"""

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCK_TIMEOUT_S = 120  # a block's commands together
MARKER = re.compile(r"^<!--\s*quick\b(?P<rest>.*?)-->\s*$")
EXPECT = re.compile(r'"([^"]+)"')
# Not linked into the scratch directory: what commands write there, and what is not the checkout's.
NOT_LINKED = {"runs", "hf", "site", "commands.sh", "__pycache__"}
# What a block needs that the docs tell the reader to make first, and how the test makes it
# (cheaply: the same command, cut short). Keyed by a path the block names.
PREREQUISITES = {
    # The README's main job (`python train.py`, dense-small-twin into runs/dense-small-twin),
    # one step instead of 200 and 8 validation windows instead of 64: a real run of the same
    # config in the same workdir, which the serve, export and eval commands read.
    "runs/dense-small-twin": "python train.py --config.train.steps=1 --config.eval.windows=8",
}


def doc_files():
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def quick_blocks():
    """[(location "file:line" of the fence, [command lines], [expected strings], error or None)]."""
    blocks = []
    for path in doc_files():
        rel = path.relative_to(REPO).as_posix()
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if not m:
                continue
            where = f"{rel}:{i + 2}"
            rest = m.group("rest").strip()
            expects = EXPECT.findall(rest)
            if rest and not (rest.startswith(":") and rest[1:].strip().startswith("expect") and expects):
                blocks.append((where, [], [], f"a quick marker is `<!-- quick -->` or "
                               f"`<!-- quick: expect \"TEXT\" ... -->`, not {line.strip()!r}"))
                continue
            if i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
                blocks.append((where, [], expects, "a quick marker must stand directly above a ```bash fence"))
                continue
            body = []
            for j in range(i + 2, len(lines)):
                if lines[j].startswith("```"):
                    break
                body.append(lines[j])
            else:
                blocks.append((where, [], expects, "the ```bash block is not closed"))
                continue
            blocks.append((where, commands(body), expects, None))
    return blocks


def commands(body):
    """The block's command lines: backslash continuations joined, comment and blank lines skipped."""
    out, pending = [], ""
    for line in body:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((pending + line).strip())
        pending = ""
    if pending:
        out.append(pending.strip())
    return out


BLOCKS = quick_blocks()


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # One CPU device, as a reader's: conftest's 8 fake devices are for the sharding tests.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def scratch(tmp_path_factory):
    """The directory quick commands run in: every entry of the repository's root linked (configs,
    train.py, benchmarks, docs, ...), nothing else. One per test run, shared by xdist workers (the
    prerequisites are made once, under a lock)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "docs-quick"
    with _locked(base / "docs-quick.lock"):
        if not root.exists():
            tmp = base / f"docs-quick.{os.getpid()}"
            tmp.mkdir()
            for entry in REPO.iterdir():
                if not entry.name.startswith(".") and entry.name not in NOT_LINKED:
                    (tmp / entry.name).symlink_to(entry)
            tmp.rename(root)
    return root


def _run(line: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", line], cwd=cwd, env=_env(), timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _prerequisite(scratch: Path, needs: str):
    done = scratch / f".made-{needs.replace('/', '_')}"
    with _locked(scratch.parent / "docs-quick.lock"):
        if done.exists():
            return
        shutil.rmtree(scratch / needs, ignore_errors=True)
        r = _run(PREREQUISITES[needs], scratch, 300)
        assert r.returncode == 0, \
            f"making {needs} for the docs' commands failed:\n$ {PREREQUISITES[needs]}\n{r.stdout[-4000:]}"
        done.touch()


def _run_once(line: str, scratch: Path, timeout: float, where: str) -> str:
    """The output of `line` run in the scratch directory, once a test run: a command two docs
    quote (README and a guide) runs once whichever xdist worker takes it first (a second export
    into the same folder would be refused), the other reads its output. A lock per command."""
    key = hashlib.sha1(line.encode()).hexdigest()[:16]
    out = scratch / f".out-{key}"
    with _locked(scratch.parent / f"docs-quick-{key}.lock"):
        if out.exists():
            return out.read_text()
        try:
            r = _run(line, scratch, timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{where}: past the block's {BLOCK_TIMEOUT_S} s at\n$ {line}\n{(e.output or '')[-4000:]}\n"
                        "(a quick block must run in seconds on a CPU: unmark it or make it quicker)")
        assert r.returncode == 0, f"{where}: exit {r.returncode} from\n$ {line}\n{r.stdout[-6000:]}"
        out.write_text(r.stdout)
        return r.stdout


def _params():
    """The blocks as test cases; those that need a run made first (`PREREQUISITES`: a training
    run, about 35 s, then generate, export and eval on it, about 60 s in all) are in the slow
    suite, so the default suite keeps its 15 minutes; the rest run there."""
    for block in BLOCKS:
        needs = any(p in line for p in PREREQUISITES for line in block[1])
        yield pytest.param(*block, id=block[0], marks=[pytest.mark.slow] if needs else [])


@pytest.mark.parametrize("where,lines,expects,error", list(_params()))
def test_quick_commands(where, lines, expects, error, scratch):
    assert error is None, f"{where}: {error}"
    assert lines, f"{where}: the quick block has no command"
    doc = (REPO / where.split(":")[0]).read_text()
    visible = "\n".join(line for line in doc.split("\n") if not MARKER.match(line.strip()))
    for text in expects:
        assert text in visible, f"{where}: expect {text!r} is not stated in the doc outside the marker"
    for needs in PREREQUISITES:
        if any(needs in line for line in lines):
            _prerequisite(scratch, needs)
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    output = [_run_once(line, scratch, max(1.0, deadline - time.monotonic()), where) for line in lines]
    printed = "\n".join(output)
    for text in expects:
        assert text in printed, \
            f"{where}: the doc states {text!r}, but its commands did not print it:\n{printed[-6000:]}"


def test_enough_quick_blocks():
    """The marked blocks are found (a renamed marker would silently run nothing)."""
    assert len(BLOCKS) >= 5, [b[0] for b in BLOCKS]


def test_commands_are_parsed_as_bash_reads_them():
    body = ["# a comment", "python -m x --a=1 \\", "    --b=2   # trailing", "", "python y.py"]
    assert commands(body) == ["python -m x --a=1      --b=2   # trailing", "python y.py"]


def test_docs_build_strict(tmp_path):
    """`mkdocs build --strict`: every page in the nav, every link and anchor resolves."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: the test extra installs it (`pip install -e '.[test]'`)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-8000:]}"


# ----------------------------------------------------------------------------- scripts/check_main_job.py

def _check_main_job():
    spec = importlib.util.spec_from_file_location("check_main_job", REPO / "scripts" / "check_main_job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_main_job_reads_the_readme():
    cmj = _check_main_job()
    stated = cmj.readme_val_loss((REPO / "README.md").read_text())
    # The README's figure is one of the hosts' in docs/performance.md's figures table.
    table = (REPO / "docs" / "performance.md").read_text()
    assert f"val_loss {stated:.3f}" in table
    assert 5 < stated < 7
    assert cmj.readme_val_loss("Train and eval took 1 min on a host, val_loss\n5.5 (other hosts)") == 5.5
    with pytest.raises(cmj.Failed):
        cmj.readme_val_loss("no figure here")


def _workdir(tmp_path, val_loss, step=200, config="dense-small-twin", steps=200):
    wd = tmp_path / "wd"
    (wd / "eval").mkdir(parents=True)
    (wd / "config.json").write_text(json.dumps({"name": config, "train": {"steps": steps}}))
    (wd / "eval" / "step_100.json").write_text(json.dumps({"config": config, "step": 100, "val_loss": 9.0}))
    (wd / "eval" / f"step_{step}.json").write_text(json.dumps({"config": config, "step": step, "val_loss": val_loss}))
    return wd


def test_check_main_job_exit_codes(tmp_path, capsys):
    cmj = _check_main_job()
    readme = tmp_path / "README.md"
    readme.write_text("```bash\npip install -e . && python train.py\n```\n\n"
                      "Train and eval took 1 min 56 s on 2026-12-02 on a 2-core CPU host, val_loss 5.794 (the other\n")
    args = ["--readme", str(readme)]
    within = _workdir(tmp_path / "a", 5.794 + 0.049)
    assert cmj.main([str(within)] + args) == 0
    out = capsys.readouterr().out
    assert "5.794" in out and "5.8430" in out and "within" in out
    assert cmj.main([str(_workdir(tmp_path / "b", 5.794 - 0.049))] + args) == 0
    outside = _workdir(tmp_path / "c", 5.794 + 0.06)
    assert cmj.main([str(outside)] + args) == 1
    captured = capsys.readouterr()
    assert "OUTSIDE" in captured.out and "error:" in captured.err
    assert cmj.main([str(outside), "--tolerance=0.1"] + args) == 0
    capsys.readouterr()
    # Nothing to compare: no evaluation, another config, a step short of the run's last: exit 1, one line.
    assert cmj.main([str(tmp_path / "missing")] + args) == 1
    assert cmj.main([str(_workdir(tmp_path / "d", 5.79, config="dense-small-standard"))] + args) == 1
    assert cmj.main([str(_workdir(tmp_path / "e", 5.79, step=150))] + args) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "dense-small-standard" in err and "step 150" in err
    with pytest.raises(SystemExit) as e:
        cmj.main([])
    assert e.value.code == 2


def test_check_main_job_runs_as_a_script(tmp_path):
    wd = _workdir(tmp_path, 5.80)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "check_main_job.py"), str(wd)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    stated = _check_main_job().readme_val_loss((REPO / "README.md").read_text())
    assert f"README.md:  val_loss {stated:.3f}" in r.stdout
