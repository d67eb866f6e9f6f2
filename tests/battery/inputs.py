"""What a run is given: bad values (exit 2, the workdir never created), a resume whose config or
data changed, and mixtures whose sources are missing, differ or were reweighted."""

from __future__ import annotations

import json
import shutil

from .harness import Bench, REPO, case, digest, expect, ok, one_error, unchanged


BAD_VALUES = [
    ("train.steps", -5), ("train.lr", -1e-3), ("train.checkpoint_every", 0), ("train.log_every", 0),
    ("data.seq_len", 0), ("train.global_batch", 0), ("train.grad_clip", -1), ("train.b2", 2.0),
    ("train.eps", -1), ("train.b1", "nan"), ("train.weight_decay", "nan"), ("train.grad_clip", "nan"),
    ("model.rope_theta", "nan"), ("model.norm_eps", "nan"), ("train.lr", "inf"),
]


def _bad_value(key, value):
    def fn(b: Bench):
        wd = b.path("wd")
        one_error(b.train(wd, **{key: value}), 2, key)
        expect(not wd.exists(), f"{wd} was created")
    fn.__name__ = f"bad_{key.replace('.', '_')}_{value}"
    return fn


for _key, _value in BAD_VALUES:
    case("validation", f"train.py --config.{_key}={_value}", "a bad value", "exit 2 naming the key; no workdir")(
        _bad_value(_key, _value))


@case("validation", "train.py --config=configs/paper.py:nonsense", "a bad config spec", "exit 2, one line, no traceback")
def bad_config_spec(b: Bench):
    wd = b.path("wd")
    res = b.run(["train.py", f"--config={REPO}/configs/paper.py:nonsense", f"--workdir={wd}"])
    one_error(res, 2, "nonsense")
    expect("File \"" not in res.err, f"traceback text in the error: {res.err[-600:]}")
    expect(not wd.exists(), f"{wd} was created")


# -- resuming (issue 12 items 2-3; issue 24 items 3-4)


@case("resume", "train.py --config=...dense-tiny-standard", "a finished twin run's workdir", "exit 2 listing model.head; unchanged")
def changed_model(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.train(wd, spec=f"{REPO}/configs/paper.py:dense-tiny-standard"), 2, "model.head")
    unchanged(before, wd)


@case("resume", "train.py --config.train.lr=1e-3", "a finished run's workdir", "exit 2 listing train.lr; unchanged")
def changed_lr(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.train(wd, **{"train.lr": 1e-3}), 2, "train.lr")
    unchanged(before, wd)


@case("resume", "train.py --config.train.steps=8", "a run whose decay has begun", "exit 2 naming the choices; unchanged")
def extend_after_the_decay(b: Bench):
    wd = b.copy_run()
    before = digest(wd)
    one_error(b.train(wd, **{"train.steps": 8}), 2, "train.steps", "--workdir")
    unchanged(before, wd)


@case("resume", "train.py --config.train.steps=8", "a run checkpointed before its decay", "exit 0; the decay moves, no lr jump")
def extend_before_the_decay(b: Bench):
    wd = b.copy_run()
    shutil.rmtree(wd / "checkpoints" / "4")  # newest: step 2, still in the warm-up
    ok(b.train(wd, **{"train.steps": 8}))
    rows = [json.loads(ln) for ln in (wd / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}  # the last logged value of each step
    peak = 3e-3  # dense-tiny's lr; 8 steps decay over steps 5-8, where 4 steps decayed over 3-4
    expect(all(abs(lrs[s] - peak) <= 1e-9 for s in (3, 4, 5)) and lrs[8] < peak / 2,
           f"lr of steps 3-5 not the peak, or step 8 not decayed: {lrs}")


@case("resume", "train.py --config.data.dir=<a copy>", "the data dir moved (same manifest)", "exit 0, resumes")
def data_moved(b: Bench):
    wd = b.copy_run()
    moved = b.path("moved-data")
    shutil.copytree(b.data, moved)
    ok(b.train(wd, data=moved))


@case("resume", "train.py --config.data.cache_dir=<another>", "the cache dir changed", "exit 0, resumes")
def cache_dir_changed(b: Bench):
    wd = b.copy_run()
    ok(b.train(wd, **{"data.cache_dir": str(b.path("cache"))}))


@case("resume", "train.py --config.data.dir=<other data>", "data prepared with another split seed", "exit 2 naming both; unchanged")
def other_data(b: Bench):
    wd = b.copy_run()
    other = b.path("other-data")
    ok(b.prepare([b.corpus], other, "--seed=7"))
    before = digest(wd)
    one_error(b.train(wd, data=other), 2, str(other))
    unchanged(before, wd)


@case("data", "train.py", "a train shard replaced by random ids of the same size after the first start",
      "exit 2 naming the shard; unchanged")
def shard_replaced(b: Bench):
    import numpy as np

    wd = b.copy_run()
    data = b.path("data")
    shutil.copytree(b.data, data)
    ok(b.train(wd, data=data))  # the first start on this data dir records it
    shard = sorted(data.glob("train_*.bin"))[0]
    shard.write_bytes(np.random.default_rng(0).integers(0, 50257, shard.stat().st_size // 2, np.uint16).tobytes())
    before = digest(wd)
    one_error(b.train(wd, data=data), 2, shard.name)
    unchanged(before, wd)


@case("data", "train.py", "manifest.json truncated", "exit 2 naming it; no workdir")
def manifest_truncated(b: Bench):
    data = b.path("data")
    shutil.copytree(b.data, data)
    text = (data / "manifest.json").read_text()
    (data / "manifest.json").write_text(text[: len(text) // 2])
    wd = b.path("wd")
    one_error(b.train(wd, data=data), 2, "manifest.json")
    expect(not wd.exists(), f"{wd} was created")


@case("data", "train.py on a fresh workdir", "a shard damaged before the first start", "exit 2; the workdir left as it was")
def refused_start_leaves_nothing(b: Bench):
    data = b.path("data")
    shutil.copytree(b.data, data)
    shard = sorted(data.glob("train_*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    raw[:2] = bytes([raw[0] ^ 1, raw[1]])  # one token id changed: same size, another hash
    shard.write_bytes(bytes(raw))
    wd = b.path("wd")
    wd.mkdir()
    one_error(b.train(wd, data=data), 2, shard.name)
    expect(digest(wd) == {}, f"the refused start left {sorted(digest(wd))}")


# -- mixtures (issue 40 item 7)


@case("mixture", "train.py --config.data.mixture=a:<data>:0.5,b:<missing>:0.5", "a mixture source missing",
      "exit 2 naming the source and prepare; no workdir")
def mixture_source_missing(b: Bench):
    wd, missing = b.path("wd"), b.path("missing")
    one_error(b.train(wd, **b.mixture(b=missing)), 2, "data.mixture source 'b'", str(missing), "onona_jax.data.prepare")
    expect(not wd.exists(), f"{wd} was created")


def _bad_weight(weight):
    def fn(b: Bench):
        wd = b.path("wd")
        one_error(b.train(wd, **b.mixture((0.5, weight))), 2, f"data.mixture source 'b' has weight {weight}",
                  "must be positive")
        expect(not wd.exists(), f"{wd} was created")
    fn.__name__ = f"mixture_weight_{'zero' if weight == 0 else 'negative'}"
    return fn


for _weight in (0, -0.5):
    case("mixture", f"train.py --config.data.mixture=a:<data>:0.5,b:<data>:{_weight}", "a weight that is not positive",
         "exit 2 naming the source and the weight; no workdir")(_bad_weight(_weight))


@case("mixture", "train.py --config.data.mixture=a:<data>:0.5,b:<other>:0.5", "b prepared with another tokenizer",
      "exit 2 naming source b and the tokenizers; no workdir")
def mixture_other_tokenizer(b: Bench):
    other = b.path("other-tokenizer")
    shutil.copytree(b.data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"] = {"kind": "hf", "name": "llama3", "sha256": "ab" * 32, "vocab": 50257, "eot": 0,
                             "config": {"tokenizer": "/models/llama3/tokenizer.json"}}
    (other / "manifest.json").write_text(json.dumps(manifest))
    wd = b.path("wd")
    one_error(b.train(wd, **b.mixture(b=other)), 2, "data.mixture source 'b'", "/models/llama3/tokenizer.json",
              "data.tokenizer is gpt2")
    expect(not wd.exists(), f"{wd} was created")


@case("mixture", "train.py --config.data.mixture=<new weights>", "a mixture run resumed from step 2 with other weights",
      "exit 0; the change recorded in metrics.jsonl")
def mixture_reweighted(b: Bench):
    wd = b.path("run")
    shutil.copytree(b.mixture_run, wd)
    shutil.rmtree(wd / "checkpoints" / "4")
    ok(b.train(wd, **b.mixture((0.25, 0.75))))
    rows = [json.loads(ln) for ln in (wd / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in rows if "mixture_change" in r]
    expect([(r["step"], r["mixture_change"]) for r in changes] == [(2, {"from": {"a": 0.5, "b": 0.5},
                                                                        "to": {"a": 0.25, "b": 0.75}})],
           f"metrics.jsonl records {changes}")


@case("mixture", "train.py --config.data.mixture=<other sources>", "a mixture run resumed with a source replaced",
      "exit 2 naming the run's mixture and --workdir; unchanged")
def mixture_sources_changed(b: Bench):
    wd = b.path("run")
    shutil.copytree(b.mixture_run, wd)
    before = digest(wd)
    run_mixture = b.mixture()["data.mixture"]
    renamed = {**b.mixture(), "data.mixture": run_mixture.replace("b:", "c:")}  # a source the run did not have
    one_error(b.train(wd, **renamed), 2, "may not change on resume", f"--config.data.mixture={run_mixture}",
              "--workdir")
    unchanged(before, wd)
