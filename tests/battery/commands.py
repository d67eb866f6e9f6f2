"""Export, import and the other commands' inputs: outputs that cannot be written, partial saves,
bad environment variables, hand-edited configs, truncated weights."""

from __future__ import annotations

import json
import shutil

from .harness import Bench, NotHeld, Tmpfs, case, digest, expect, immutable, ok, one_error, stop, unchanged, wait_for


@case("cli", "serve.export --output=<non-empty dir>", "a folder holding other files", "exit 2; folder unchanged")
def export_into_a_non_empty_dir(b: Bench):
    out = b.path("out")
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = digest(out)
    one_error(b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}"]), 2, "--overwrite")
    unchanged(before, out, "the folder")


@case("cli", "serve.export --overwrite", "a folder with a stale export and a file of the user's",
      "exit 0; the user's file kept; files 0644")
def export_overwrite(b: Bench):
    out = b.path("out")
    shutil.copytree(b.hf_folder, out)
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"stale")
    ok(b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}", "--overwrite",
              "--notokenizer"]))
    expect((out / "notes.txt").read_text() == "mine", "the user's file was removed")
    expect(digest(out)["model.safetensors"] == digest(b.hf_folder)["model.safetensors"], "stale weights kept")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file() and p.name != "notes.txt"}
    expect(set(modes.values()) == {"0o644"}, f"modes: {modes}")


@case("cli", "serve.export --output=<a file> | <under a file> | <read-only dir>", "an impossible output",
      "exit 2 each, before any checkpoint is read")
def export_to_impossible_places(b: Bench):
    f = b.path("file")
    f.write_text("x")
    ro = b.path("ro")
    ro.mkdir()
    immutable(ro)
    try:
        for out in (f, f / "sub", ro / "out"):
            res = b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}"])
            one_error(res, 2, str(out))
    finally:
        immutable(ro, False)


@case("cli", "serve.export | prepare --output=<a mount point>", "an empty volume as the output",
      "exit 2 each, before any work, naming a folder inside it; the volume unchanged")
def outputs_onto_a_mount_point(b: Bench):
    fs = Tmpfs(b.path("volume"), "64m")
    try:
        res = b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={fs.path}", "--notokenizer"])
        one_error(res, 2, "is a mount point", f"--output={fs.path / 'export'}")
        res = b.prepare([b.corpus], fs.path)
        one_error(res, 2, "is a mount point", f"--output={fs.path / 'data'}")
        expect(not list(fs.path.iterdir()) and not list(fs.path.parent.glob(f"{fs.path.name}.tmp-*")),
               "something was written")
        ok(b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={fs.path / 'export'}",
                  "--notokenizer"]))  # the folder it names works
    finally:
        fs.close()


@case("cli", "serve.export", "the disk fills while model.safetensors is written",
      "exit 1, one line naming the disk; no folder, no temporary")
def export_onto_a_full_disk(b: Bench):
    fs = Tmpfs(b.path("small"), "2m")  # the tiny model's weights: several MB
    try:
        out = fs.path / "export"
        res = b.run(["-m", "onona_jax.serve.export", f"--workdir={b.run_dir}", f"--output={out}", "--notokenizer"])
        one_error(res, 1, "No space left on device", str(out))
        expect(not list(fs.path.iterdir()), f"left behind: {list(fs.path.iterdir())}")
    finally:
        fs.close()


@case("cli", "train.import_hf", "killed (SIGKILL) during its step-0 save", "the rerun exit 0, removing the partial save")
def import_killed_during_its_save(b: Bench):
    wd = b.path("wd")
    p = b.popen(["-m", "onona_jax.train.import_hf", f"--from_hf={b.hf_folder}", f"--workdir={wd}"])
    try:
        wait_for(lambda: any((wd / "checkpoints").glob("0.orbax-checkpoint-tmp*")), 300, "the step-0 save", p,
                 poll=0.005)
        p.kill()
        p.wait()
    finally:
        stop(p)
    if (wd / "checkpoints" / "0").is_dir():
        raise NotHeld("the save finished before the kill: rerun the case")
    res = b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={b.hf_folder}", f"--workdir={wd}"])
    ok(res)
    expect("unfinished save of an import that was killed" in res.err, f"no word of the partial save: {res.tail()}")
    expect(sorted(p.name for p in (wd / "checkpoints").iterdir()) == ["0"], "checkpoints/ holds more than step 0")
    ok(b.run(["eval.py", f"--workdir={wd}", "--mesh=1,1,1", f"--output={b.path('eval.json')}"]))


@case("cli", "train.py --config.train.steps=10**12", "more steps than an int32 counter holds",
      "exit 2 before the compile, one line; no workdir")
def steps_past_int32(b: Bench):
    wd = b.path("wd")
    res = b.train(wd, **{"train.steps": 10**12})
    one_error(res, 2, "train.steps", "2,147,483,647")
    expect(not wd.exists(), "a workdir was made")


@case("cli", "train.py --workdir=gs://...", "gcsfs not installed (the gcs extra)", "exit 2, one line naming the extra")
def bucket_without_its_extra(b: Bench):
    code = ("import sys; sys.modules['gcsfs'] = None; sys.argv[0] = 'train.py'; import train; "
            "sys.exit(train.main(sys.argv[1:]))")
    res = b.run(["-c", code, "--workdir=gs://bucket/run"])
    one_error(res, 2, "gs://", ".[gcs]")


@case("cli", "train.py, eval.py", "JAX_PLATFORMS naming a platform this machine lacks (tpu, cuda, nonsense)",
      "exit 2, one line naming JAX_PLATFORMS; nothing written")
def jax_platforms_this_machine_lacks(b: Bench):
    for platform in ("tpu", "cuda", "nonsense"):
        wd = b.path("wd")
        one_error(b.run(b.train_args(wd), env={"JAX_PLATFORMS": platform}), 2, f"JAX_PLATFORMS={platform}")
        expect(not wd.exists(), "a workdir was made")
    one_error(b.run(["eval.py", f"--workdir={b.run_dir}"], env={"JAX_PLATFORMS": "tpu"}), 2, "JAX_PLATFORMS=tpu")


@case("cli", "train.py", "ONONA_DISTRIBUTED=yes | ONONA_LOCK_LEASE_S=soon | ONONA_COMPILE_CACHE=<unwritable>",
      "exit 2, one line naming the variable; nothing written")
def onona_variables(b: Bench):
    for name, value in (("ONONA_DISTRIBUTED", "yes"), ("ONONA_LOCK_LEASE_S", "soon"),
                        ("ONONA_COMPILE_CACHE", "/proc/no-cache-here")):
        wd = b.path("wd")
        one_error(b.run(b.train_args(wd), env={name: value}), 2, name)
        expect(not wd.exists(), "a workdir was made")


@case("cli", "train.py (resume)", "config.json edited by hand", "exit 0; one warning naming the key; rewritten")
def config_json_edited_by_hand(b: Bench):
    wd = b.copy_run()
    cfg = json.loads((wd / "config.json").read_text())
    cfg["train"]["lr"] = 0.5
    (wd / "config.json").write_text(json.dumps(cfg))
    res = b.train(wd)
    ok(res)
    warnings = [ln for ln in res.err.replace("\r", "\n").splitlines() if ln.startswith("warning:")]
    expect(len(warnings) == 1 and "train.lr" in warnings[0] and "edited by hand" in warnings[0], f"{warnings}")
    expect(json.loads((wd / "config.json").read_text())["train"]["lr"] != 0.5, "config.json keeps the edit")


@case("cli", "train.import_hf", "model.safetensors truncated", "exit 2 naming the file; nothing written")
def import_truncated_weights(b: Bench):
    hf = b.path("hf")
    shutil.copytree(b.hf_folder, hf)
    w = hf / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    wd = b.path("wd")
    res = b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={hf}", f"--workdir={wd}"])
    expect(res.rc in (1, 2), f"exit {res.rc}")
    one_error(res, res.rc, "model.safetensors")
    expect(not (wd / "checkpoints").exists() and not (wd / "config.json").exists(), "written")


@case("cli", "train.import_hf", "config.json not JSON", "exit 2 naming the file; nothing written")
def import_config_not_json(b: Bench):
    hf = b.path("hf")
    shutil.copytree(b.hf_folder, hf)
    (hf / "config.json").write_text("{not json")
    wd = b.path("wd")
    res = b.run(["-m", "onona_jax.train.import_hf", f"--from_hf={hf}", f"--workdir={wd}"])
    one_error(res, 2, str(hf / "config.json"))
    expect(not (wd / "checkpoints").exists(), "written")


@case("cli", "serve.generate --max_new_tokens=0", "a bad value", "exit 2, one line")
def generate_zero_tokens(b: Bench):
    one_error(b.run(["-m", "onona_jax.serve.generate", f"--workdir={b.run_dir}", "--max_new_tokens=0"]), 2,
              "--max_new_tokens")
