"""Weights & Biases (train.wandb_project), offline (WANDB_MODE=offline: no network, no login):
the W&B run records the same scalars at the same steps as metrics.jsonl, and the config; a run
pre-empted and rerun logs on under the same W&B run id (`<workdir>/wandb_id`). Without the
package, train.wandb_project is refused before anything is written.

The offline run is read back from its `run-<id>.wandb` file: W&B's record log (LevelDB's log
format, records of W&B's protobuf `Record`), which W&B no longer ships a reader for.
"""

import glob
import json
import os
import signal
import struct
import sys

import jax
import pytest

from conftest import tiny_config
from onona_jax import train as trainer
from onona_jax.train import loop

STEPS = 4


def config(data_dir):
    cfg = tiny_config(data_dir, "standard", micro_batch=8, steps=STEPS)
    cfg.mesh.data = 1
    cfg.train.wandb_project = "onona-test"
    cfg.name = "wandb-test"
    return cfg


def records(path):
    """The protobuf records of a W&B run file: a 7-byte header (":W&B", 0xBEE1, version), then
    32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert struct.unpack("<4sH", data[:6]) == (b":W&B", 0xBEE1), path
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def offline_runs(workdir) -> list[dict]:
    """Each offline W&B run under the workdir, oldest first: its id, its config and the rows it
    logged (W&B's own `_*` keys left out)."""
    out = []
    for path in sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        run = {"rows": [], "config": {}}
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["project"] = record.run.project
                run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["rows"].append({k: v for k, v in row.items() if not k.startswith("_")})
        out.append(run)
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="the [wandb] extra (pip install -e '.[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to $HOME
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


def test_wandb_logs_the_scalars_and_resumes_the_same_run(tiny_data, tmp_path, monkeypatch, offline):
    cfg = config(tiny_data)
    workdir = tmp_path / "run"

    # First start: pre-empted (SIGTERM to this process) while step 2 is being fed; saves step 2.
    global_batch, fed = loop.global_batch, [0]

    def preempting(run_, local):
        fed[0] += 1
        if fed[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return global_batch(run_, local)

    with monkeypatch.context() as m:
        m.setattr(loop, "global_batch", preempting)
        first = trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    assert first == {"step": 2, "preempted": True}
    run_id = (workdir / "wandb_id").read_text().strip()
    assert run_id

    trainer.train(cfg, str(workdir), devices=jax.devices()[:1], progress=False)
    assert (workdir / "wandb_id").read_text().strip() == run_id

    runs = offline_runs(workdir)
    assert [r["id"] for r in runs] == [run_id, run_id] and {r["project"] for r in runs} == {"onona-test"}
    logged = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    expected = [m for m in logged if "restart" not in m]  # (metrics.jsonl's own mark of the rerun)
    rows = [row for r in runs for row in r["rows"]]
    assert [m["step"] for m in expected if "loss" in m] == list(range(1, STEPS + 1))
    assert rows == expected  # every scalar of every logged step, the same values (TensorBoard's too)
    assert [row["step"] for row in runs[0]["rows"]] == [1, 2]
    for r in runs:
        assert r["config"]["model"] == cfg.model.to_dict()
        assert r["config"]["train"]["wandb_project"] == "onona-test"


def test_wandb_without_the_package_is_refused_before_any_write(tiny_data, tmp_path, monkeypatch, capfd):
    import train as train_cli
    from test_bad_input import assert_rejected
    from run_fixtures import argv, errors

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import and find_spec fail
    assert_rejected(config(tiny_data), tmp_path, "train.wandb_project='onona-test'", "pip install -e '.[wandb]'")
    workdir = tmp_path / "wd"
    assert train_cli.main(argv(tiny_data, workdir, **{"train.wandb_project": "onona-test"})) == 2
    [line] = errors(capfd.readouterr().err)
    assert "needs the wandb package, which is not installed: pip install -e '.[wandb]'" in line, line
    assert not workdir.exists()
