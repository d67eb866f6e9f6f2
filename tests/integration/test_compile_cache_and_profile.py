"""Operating a run (issue 27): the persistent compilation cache, a profile of chosen steps, and
throughput that is honest at start-up (compile kept out, data wait logged apart)."""

import glob
import json
import os
import time

import jax
import pytest

from conftest import tiny_config
from onona_jax import cli
from onona_jax import config as config_lib
from onona_jax import compile_cache
from onona_jax import train as trainer
from onona_jax.data import pipeline
from onona_jax.train import loop

ONE = jax.devices()[:1]


def rows(workdir) -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "tokens_per_s" in r]


@pytest.fixture
def cache_off_after():
    """A test that points the cache elsewhere gives the tests after it the session's back
    (in-process; tests/conftest.py)."""
    yield
    compile_cache.use(compile_cache.default_dir())


def test_second_start_loads_the_train_step_from_the_cache(tiny_data, tmp_path, cache_off_after):
    """The first start writes the compiled train step into train.compile_cache; a second start
    of the same run (a new step function, so nothing in memory) loads it from there: the first
    logged step says so (`compile_cache_hits`), and the first start's says it compiled."""
    cache = tmp_path / "cache"
    cfg = tiny_config(tiny_data, "standard", steps=2, compile_cache=str(cache), compile_cache_min_s=0.0)
    cfg.mesh.data = 1
    trainer.train(cfg, str(tmp_path / "first"), devices=ONE, progress=False)
    entries = glob.glob(str(cache / "jit_train_step-*-cache"))
    assert len(entries) == 1, sorted(os.listdir(cache))
    assert rows(tmp_path / "first")[0]["compile_cache_hits"] == 0
    trainer.train(cfg, str(tmp_path / "second"), devices=ONE, progress=False)
    first = rows(tmp_path / "second")[0]
    assert first["step"] == 1 and first["compile_cache_hits"] >= 1 and first["compile_s"] > 0
    assert glob.glob(str(cache / "jit_train_step-*-cache")) == entries  # read, not written again


def test_cache_threshold_keeps_small_programs_out(tiny_data, tmp_path, cache_off_after):
    """Above every program's compile time, nothing is cached (and nothing is read)."""
    cache = tmp_path / "cache"
    cfg = tiny_config(tiny_data, "standard", steps=1, compile_cache=str(cache), compile_cache_min_s=1e6)
    cfg.mesh.data = 1
    trainer.train(cfg, str(tmp_path / "run"), devices=ONE, progress=False)
    assert os.listdir(cache) == []
    assert rows(tmp_path / "run")[0]["compile_cache_hits"] == 0


def test_default_cache_is_under_the_users_cache(monkeypatch):
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert config_lib.base_config().train.compile_cache == "/somewhere/cache/onona_jax/jax_cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.default_dir() == os.path.expanduser("~/.cache/onona_jax/jax_cache")
    monkeypatch.setenv(compile_cache.ENV, "")
    assert compile_cache.default_dir() == ""


def test_unwritable_cache_is_one_error_before_any_write(tiny_data, tmp_path, capfd):
    """A cache path that cannot be made (under a regular file) is exit 2 with one error line,
    and the workdir is never created."""
    import train as train_cli

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    workdir = tmp_path / "wd"
    overrides = {"data.dir": tiny_data, "data.seq_len": 32, "model.n_heads": 8, "model.n_kv_heads": 4,
                 "model.head_dim": 8, "train.global_batch": 8, "train.micro_batch": 1, "train.steps": 2,
                 "eval.windows": 8, "train.compile_cache": str(blocker / "cache")}
    rc = train_cli.main(["--config=configs/paper.py:dense-tiny-standard", f"--workdir={workdir}",
                         *(f"--config.{k}={v}" for k, v in overrides.items())])
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, err[-2000:]
    assert f"train.compile_cache={blocker / 'cache'}" in errors[0] and "compilation cache off" in errors[0]
    assert not workdir.exists()


@pytest.mark.parametrize("key,value,words", [
    ("profile_start", -1, "train.profile_start=-1"),
    ("profile_steps", 0, "train.profile_steps=0"),
    ("compile_cache_min_s", -1.0, "train.compile_cache_min_s=-1.0"),
])
def test_bad_profile_and_cache_values(tiny_data, key, value, words):
    cfg = tiny_config(tiny_data, "standard")
    cfg.train[key] = value
    with pytest.raises(ValueError, match=words):
        config_lib.validate(cfg)


def test_profile_after_the_last_step_is_refused(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, "standard", steps=3, profile_start=4)
    with pytest.raises(ValueError, match=r"train.profile_start=4 lies after the run's last step 3"):
        trainer.train(cfg, str(tmp_path / "wd"), progress=False)
    assert not (tmp_path / "wd").exists()


def test_unwritable_profile_directory_is_one_error_and_leaves_nothing(tiny_data, tmp_path):
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "profile").write_text("a file where the profile directory goes")
    cfg = tiny_config(tiny_data, "standard", steps=2, profile_start=2)
    with pytest.raises(cli.Failure, match=r"cannot write to .*profile"):
        loop.train(cfg, str(workdir), devices=ONE, progress=False)
    assert sorted(os.listdir(workdir)) == ["profile"]  # the lock's files and the start's entries gone


def test_profile_traces_the_train_step(tiny_data, tmp_path):
    """train.profile_start=2, profile_steps=2: an xplane trace under <workdir>/profile/ that
    holds the compiled train step (jit_train_step), its writing time logged apart."""
    cfg = tiny_config(tiny_data, "standard", steps=4, profile_start=2, profile_steps=2)
    cfg.mesh.data = 1
    trainer.train(cfg, str(tmp_path), devices=ONE, progress=False)
    traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1, sorted(glob.glob(str(tmp_path / "profile" / "**"), recursive=True))
    assert b"jit_train_step" in open(traces[0], "rb").read()
    logged = rows(tmp_path)
    assert [r["step"] for r in logged if "profile_s" in r] == [3]


class SlowData:
    """The data iterator, `seconds` slower per batch."""

    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds

    def __next__(self):
        time.sleep(self.seconds)
        return next(self.inner)

    def __getattr__(self, name):  # get_state / set_state
        return getattr(self.inner, name)


def test_first_interval_excludes_compile_and_logs_data_wait_apart(tiny_data, tmp_path, monkeypatch):
    """A first step that takes 2 s longer (a slow compile) does not lower the first interval's
    tokens/s: step_s + data_wait_s is the interval's time per step, compile left out; a data
    iterator that sleeps 0.3 s a batch shows as data_wait_s >= 0.3 on every logged step."""
    real_batches, real_step = pipeline.train_batches, loop.make_train_step
    monkeypatch.setattr(pipeline, "train_batches", lambda *a, **k: SlowData(real_batches(*a, **k), 0.3))

    def slow_first_call(run):
        step, calls = real_step(run), []

        def call(*args):
            if not calls:
                calls.append(1)
                time.sleep(2.0)
            return step(*args)
        return call

    monkeypatch.setattr(loop, "make_train_step", slow_first_call)
    cfg = tiny_config(tiny_data, "standard", steps=3, peak_tflops=1.0)
    cfg.mesh.data = 1
    trainer.train(cfg, str(tmp_path), devices=ONE, progress=False)
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3]
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    assert logged[0]["compile_s"] >= 2.0
    for r in logged:
        assert r["data_wait_s"] >= 0.3, r
        assert r["tokens_per_s"] * (r["step_s"] + r["data_wait_s"]) == pytest.approx(tokens_per_step, rel=1e-6)
        assert r["step_s"] + r["data_wait_s"] < 2.0, r  # the first step's 2 s of compile are not in it
        assert ("compile_cache_hits" in r) == (r["step"] == 1)  # (the session's cache: conftest)


@pytest.mark.slow  # suite-time margin (cover: test_profile_traces_the_train_step; buckets: test_cloud_checkpoint)
def test_profile_of_a_bucket_workdir_is_uploaded(tiny_data, fake_gcs):
    """A bucket workdir's trace is written locally and uploaded under <workdir>/profile/."""
    from onona_jax import paths

    workdir = f"{fake_gcs}/run"
    cfg = tiny_config(tiny_data, "standard", steps=2, profile_start=2, profile_steps=1)
    cfg.mesh.data = 1
    trainer.train(cfg, workdir, devices=ONE, progress=False)
    traces = [str(p) for p in paths.path(f"{workdir}/profile").glob("plugins/profile/*/*.xplane.pb")]
    assert len(traces) == 1, traces
    assert b"jit_train_step" in paths.read_bytes(traces[0])
