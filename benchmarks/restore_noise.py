"""How much a damaged newest checkpoint prints (issue 12 item 8).

    python benchmarks/restore_noise.py [--modes=truncate,garble,remove_d,remove_metadata]

Saves checkpoints 2 and 4 of the tiny standard model (a fresh state, one device), damages
step 4 in each way, and in a fresh process restores as train.py does
(`Checkpoints.restore_latest`), counting the stderr lines it prints: one warning line is the
goal. Damage modes: `truncate` (the biggest array file cut in half, as by a full disk),
`garble` (every array file random bytes), `remove_d` (the array directory gone),
`remove_metadata` (state/_METADATA gone).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from absl import flags

import common  # benchmarks/common.py, beside this script
from onona_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = """
import os, sys
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, {repo!r})
from absl import logging; logging.set_verbosity(logging.ERROR)
import jax
from onona_jax import config as C, train as T
from onona_jax.checkpoint import Checkpoints
cfg = C.load({repo!r} + '/configs/paper.py:dense-tiny-standard')
cfg.model.update(n_heads=8, n_kv_heads=4, head_dim=8)
cfg.train.update(global_batch=8, micro_batch=8)
cfg.data.seq_len = 32
cfg.mesh.data = 1
run = T.setup(C.validate(cfg), jax.devices()[:1])
ckpts = Checkpoints({ckpts!r})
"""
SAVE = "state = T.init_state(run, 0)\nfor s in (2, 4): ckpts.save(s, state, {{'step': s}}, cfg.to_json())\nckpts.wait()\n"
RESTORE = "print('restored step', ckpts.restore_latest(T.abstract_train_state(run))[0], file=sys.stderr)\n"


def damage(state: pathlib.Path, mode: str):
    arrays = sorted((p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    if mode == "truncate":
        with open(arrays[-1], "r+b") as f:
            f.truncate(arrays[-1].stat().st_size // 2)
    elif mode == "garble":
        for p in arrays:
            p.write_bytes(os.urandom(p.stat().st_size))
    elif mode == "remove_d":
        shutil.rmtree(state / "d")
    elif mode == "remove_metadata":
        (state / "_METADATA").unlink()
    else:
        raise cli.UsageError(f"unknown mode {mode}")


def define(fv, argv):
    flags.DEFINE_list("modes", ["truncate", "garble", "remove_d", "remove_metadata"], "damage to apply",
                      flag_values=fv)
    flags.DEFINE_string("repo", REPO, "the checkout whose restore is measured", flag_values=fv)


def _main(fv, rest):
    if rest:
        raise cli.UsageError(f"unexpected arguments {rest}")
    args = fv
    with tempfile.TemporaryDirectory() as tmp:
        pristine = os.path.join(tmp, "pristine")
        subprocess.run([sys.executable, "-c", SETUP.format(repo=args.repo, ckpts=pristine) + SAVE.format()],
                       check=True, capture_output=True)
        for mode in args.modes:
            ckpts = os.path.join(tmp, mode)
            shutil.copytree(pristine, ckpts)
            damage(pathlib.Path(ckpts, "4", "state"), mode)
            p = subprocess.run([sys.executable, "-c", SETUP.format(repo=args.repo, ckpts=ckpts) + RESTORE],
                               capture_output=True, text=True)
            lines = p.stderr.splitlines()
            print(f"{mode:16s} exit {p.returncode}  stderr lines {len(lines) - 1:5d}  ({lines[-1] if lines else ''})")


if __name__ == "__main__":
    sys.exit(common.run(define, _main, None, __doc__))
