"""Import a transformers folder (our export, or a Qwen3 / Qwen3-MoE checkpoint) as a workdir
checkpoint at step 0 with a fresh optimizer state.

    python -m onona_jax.train.import_hf --from_hf=DIR --workdir=OUT [--mesh=-1,1,1]

The tokenizer (`choose_tokenizer`): where our export's training config names gpt2 or a
tiktoken rank file that loads here, that stays data.tokenizer (the folder holds a conversion
of it, whose identity differs; data prepared with the original stays accepted). Otherwise the
folder's own `tokenizer.json` (with its tokenizer_config.json; our export copies a HF
tokenizer's byte for byte) is copied into OUT/tokenizer/ and becomes data.tokenizer. Copied, not
pointed at: the imported run keeps working when the folder (a download cache, an export) is
moved or deleted, and the copy has the same identity (the sha256 of tokenizer.json) as the
original, so data prepared with either is accepted. (A cloud OUT points at the folder
instead: tokenizers are read from local files.) A folder with neither is read as GPT-2's
(what every checkpoint was before tokenizers could be chosen), with a notice.

The vocabulary: model.vocab_size is the checkpoint's vocab_size (its table rows), which must
hold the tokenizer's entries; model.vocab_multiple is kept when the entries rounded up to it
give those rows, else set to the smallest multiple that does (a divisor of the rows), so the
config validates as any run's.

It lives with training because what it writes is a run's starting state (parameters, AdamW
moments, step); the tensor mapping is `serve.hf_format`'s. eval.py, serving, export and
`train.py --config.init_from=OUT` (upcycling) read the result.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from absl import flags

from onona_jax import cli, paths, staging
from onona_jax import tokenizer as tokenizer_lib


def import_folder(path: str, workdir: str, mesh=(-1, 1, 1), devices=None) -> dict:
    """A transformers folder -> a workdir checkpoint at step 0 (`workdir/checkpoints/0`): the
    parameters, a FRESH optimizer state, step 0 and the config (the export's own training
    config when the folder has `onona_train_config.json`). eval.py, serving, export and
    `train.py --config.init_from` read it. Refuses a workdir that already has checkpoints, or
    whose lock (lock.json, as train.py takes it) another writer holds, before writing anything."""
    import jax  # (here, not at the top: --help stays fast without jax)
    import ml_collections

    from onona_jax import config as config_lib
    from onona_jax.checkpoint import Checkpoints
    from onona_jax.serve import hf_format
    from onona_jax.train.lock import WorkdirLock
    from onona_jax.train.state import new_state, setup

    hf = hf_format.read_config(path)
    train_config = hf_format.read_train_config(path)
    base = None if train_config is None else ml_collections.ConfigDict(train_config)
    cfg = hf_format.model_config_from_hf(hf, base)
    if base is None:
        cfg.name = f"hf-{os.path.basename(os.path.normpath(path))}"
        cfg.model.dtype = "float32"
    cfg.init_from = ""
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh
    tok, copy_from = choose_tokenizer(path, cfg, hf, base is not None, workdir)
    cfg.model.vocab_multiple = vocab_multiple(tok.n_vocab, int(cfg.model.vocab_size), int(cfg.model.vocab_multiple))
    config_lib.validate(cfg)
    hf_format.check_supported(cfg.model)
    ckpt_dir = paths.Workdir(workdir).checkpoints

    def refuse_a_used_workdir():
        # (Not the leftovers of a killed import, removed below once locked, nor the lock of a
        # checkpoints/ that lives elsewhere: lock.py.)
        used = [e.name for e in paths.path(ckpt_dir).iterdir() if "orbax-checkpoint-tmp" not in e.name
                and e.name != paths.Workdir.LOCK] if paths.isdir(ckpt_dir) else []
        if used:
            raise ValueError(f"{ckpt_dir} already holds checkpoints ({', '.join(sorted(used)[:3])}); import into an "
                             "empty workdir")

    refuse_a_used_workdir()
    params = hf_format.from_hf(hf_format.read_weights(path), cfg.model)  # every name and shape checked before any write
    run = setup(cfg, devices)
    new_workdir = not paths.is_cloud(workdir) and not os.path.isdir(workdir)
    # From the lock on, a Ctrl-C lets the writes below finish, then undoes them (`_undo`): never cut inside one.
    with cli.graceful_stop() as stop, WorkdirLock(workdir):  # a writer like train.py: refused (exit 2, nothing
        refuse_a_used_workdir()  # written) while one runs; again, now that no other writer can start meanwhile
        before = _entries(workdir)
        if paths.isdir(ckpt_dir):  # an import killed during its save left a temporary step: ours to remove
            removed = Checkpoints(ckpt_dir, keep=cfg.train.keep_checkpoints).remove_unfinished()
            if removed:
                print(f"removed {removed} from {ckpt_dir}, the unfinished save of an import that was killed",
                      file=sys.stderr)
        if copy_from:  # the folder's tokenizer files, then data.tokenizer names the copy (`choose_tokenizer`)
            target = os.path.abspath(paths.Workdir(workdir).tokenizer)
            _copy_tokenizer(copy_from, Path(target))
            cfg.data.tokenizer = target
            assert tokenizer_lib.same(tokenizer_lib.from_config(cfg.data).identity(), tok.identity())
        params = jax.device_put(params, run.param_shardings)
        train_state = jax.jit(lambda p: new_state(run, p), out_shardings=run.state_shardings)(params)
        paths.write_atomic(paths.Workdir(workdir).config, cfg.to_json(indent=2))
        ckpts = Checkpoints(ckpt_dir, keep=cfg.train.keep_checkpoints)
        # No data iterator to record: training on this workdir directly is refused by the
        # iterator's state check; start a new run with --config.init_from=<this workdir> instead.
        ckpts.save(0, train_state, {"step": 0, "imported_from": os.path.abspath(path)}, cfg.to_json())
        ckpts.wait()
        if stop.requested:
            _undo(workdir, before)
    if stop.requested:
        if new_workdir:
            try:
                os.rmdir(workdir)  # (only if empty)
            except OSError:
                pass
        stop.raise_if_requested(f"{workdir} is left as it was: nothing was imported (rerun the same command to import)")
    return dict(workdir=paths.absolute(workdir), step=0, source=os.path.abspath(path),
                model_type=hf.get("model_type"), config=cfg.name, arch=cfg.model.arch, head=cfg.model.head,
                tokenizer=cfg.data.tokenizer, vocab_size=int(cfg.model.vocab_size),
                vocab_multiple=int(cfg.model.vocab_multiple))


def _copy_tokenizer(files: list[str], target: Path) -> None:
    """The folder's tokenizer files into `target` (built beside it, then moved into place: a
    killed import leaves no half-copied tokenizer; other files already there are kept)."""

    def write(tmp: Path) -> None:
        for file in files:
            shutil.copyfile(file, tmp / os.path.basename(file))

    staging.remove_stale(target)
    names = [os.path.basename(f) for f in files]
    staging.build(target, write, overwrite=True, owned=names)


def _entries(workdir: str) -> set[str]:
    return {p.name for p in paths.path(workdir).iterdir()} if paths.isdir(workdir) else set()


def _undo(workdir: str, before: set[str]):
    """Remove what an import made in `workdir` (its lock's files are the lock's)."""
    for name in _entries(workdir) - before - {paths.Workdir.LOCK}:
        entry = paths.path(paths.join(workdir, name))
        try:
            entry.rmtree() if entry.is_dir() else entry.unlink()
        except Exception:  # noqa: BLE001 - already stopping: what stays is named by nothing, used by nothing
            pass


def vocab_multiple(entries: int, rows: int, multiple: int) -> int:
    """`multiple` when the tokenizer's entries rounded up to it are the checkpoint's table
    rows, else the smallest m that gives them (a divisor of rows past rows - entries)."""
    if rows < entries:
        raise ValueError(f"the checkpoint's vocab_size={rows:,} is below its tokenizer's {entries:,} entries: its "
                         "table has no row for some token ids; give the folder its own tokenizer (tokenizer.json)")
    if -(-entries // multiple) * multiple == rows:
        return multiple
    return next(m for m in range(rows - entries + 1, rows + 1) if rows % m == 0)


def choose_tokenizer(path: str, cfg, hf: dict, from_export: bool, workdir: str):
    """(the imported run's Tokenizer, the files to copy into workdir/tokenizer/ or ()), setting
    cfg.data's tokenizer keys (module docstring; data.tokenizer names the folder until the
    files are copied). An unusable tokenizer is one ValueError."""
    d = cfg.data
    has_json = os.path.isfile(os.path.join(path, "tokenizer.json"))
    if from_export:
        try:
            tok = tokenizer_lib.from_config(d)
            if tok.kind != "hf" or not has_json:  # gpt2, a rank file: the export converted it, keep the original
                return tok, ()
        except (ValueError, OSError) as err:
            if not has_json:
                raise ValueError(f"the export's data.tokenizer={d.tokenizer!r} does not load here ({err}) and {path} "
                                 "has no tokenizer.json; copy the tokenizer here or export with the tokenizer") from None
            print(f"notice: the export's data.tokenizer={d.tokenizer!r} does not load here; using the folder's "
                  "tokenizer.json", file=sys.stderr)
    if not has_json:
        print(f"notice: {path} has no tokenizer.json; reading it as GPT-2's tokenizer (data.tokenizer=gpt2)",
              file=sys.stderr)
        d.update(tokenizer=tokenizer_lib.DEFAULT, eot="", special_tokens="", tokenizer_pattern="")
        return tokenizer_lib.from_config(d), ()
    folder = os.path.abspath(path)
    d.update(tokenizer=folder, eot=_eot_text(folder, hf), special_tokens="", tokenizer_pattern="")
    tok = tokenizer_lib.from_config(d)
    return tok, () if paths.is_cloud(workdir) else tok.files


def _eot_text(folder: str, hf: dict) -> str:
    """data.eot for a HF tokenizer folder: "" when its tokenizer_config.json (or its special
    tokens) say which token ends a document, else the special token config.json's
    eos_token_id names."""
    try:
        tokenizer_lib.load(folder)
        return ""
    except ValueError:
        eos = hf.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        import tokenizers

        impl = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        named = impl.id_to_token(int(eos)) if isinstance(eos, int) else None
        if named is None:
            raise
        return named


def define(fv, argv):
    flags.DEFINE_string("from_hf", None, "transformers model folder to import", flag_values=fv, required=True)
    flags.DEFINE_string("workdir", None, "run directory to write (must hold no checkpoints)", flag_values=fv,
                        required=True)
    cli.define_mesh(fv)


def _main(fv, args):
    if args:
        raise cli.UsageError(f"unexpected arguments {args}")
    try:
        summary = import_folder(fv.from_hf, fv.workdir, cli.mesh(fv))
    except OSError as err:  # unreadable folder, full disk: nothing is overwritten
        raise cli.Failure(str(err)) from None
    print(json.dumps(summary, indent=2))


def main(argv=None) -> int:
    return cli.run(define, _main, argv, __doc__)


if __name__ == "__main__":
    cli.run_module(define, _main, __doc__)
