"""Upcycling: a twin model started from a standard checkpoint (A = B = E, body copied) is the
standard model, so its first evaluation equals the standard checkpoint's loss."""

import json

import jax
import pytest

from conftest import tiny_config
from onona_jax.checkpoint import restore_params
from onona_jax import train as trainer


@pytest.mark.slow  # suite-time margin; the refusal tests below stay in the default suite
def test_upcycled_twin_starts_at_the_standard_loss(tiny_data, tmp_path):
    std_cfg = tiny_config(tiny_data, head="standard", steps=3)
    std_cfg.mesh.data = 8
    std = trainer.train(std_cfg, str(tmp_path / "std"), progress=False)

    twin_cfg = tiny_config(tiny_data, head="twin", steps=1)
    twin_cfg.mesh.data = 8
    twin_cfg.init_from = str(tmp_path / "std")
    trainer.train(twin_cfg, str(tmp_path / "twin"), progress=False)
    logged = [json.loads(line) for line in open(tmp_path / "twin" / "metrics.jsonl")]
    first = next(r for r in logged if r["step"] == 0)
    assert first["val_loss"] == pytest.approx(std["val_loss"], abs=1e-6)

    # The upcycled parameters themselves: A = B = E and the same body.
    run = trainer.setup(twin_cfg)
    state = trainer.upcycle(run, trainer.init_state(run, 0), str(tmp_path / "std"))
    src, _, _, _ = restore_params(str(tmp_path / "std"), mesh=(8, 1, 1))
    assert (state["params"]["head"]["A"] == src["head"]["embedding"]).all()
    assert (state["params"]["head"]["B"] == src["head"]["embedding"]).all()
    for a, b in zip(jax.tree.leaves(state["params"]["trunk"]), jax.tree.leaves(src["trunk"])):
        assert (a == b).all()


@pytest.mark.slow
def test_upcycling_refuses_a_twin_source(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, head="twin", steps=1)
    cfg.mesh.data = 8
    trainer.train(cfg, str(tmp_path / "twin"), progress=False)
    cfg2 = tiny_config(tiny_data, head="twin", steps=1)
    cfg2.mesh.data = 8
    cfg2.init_from = str(tmp_path / "twin")
    with pytest.raises(ValueError, match="standard checkpoint"):
        trainer.train(cfg2, str(tmp_path / "again"), progress=False)


@pytest.mark.parametrize("head", ["standard", "untied", "mos", "sigsoftmax"])
def test_upcycling_into_a_head_without_A_and_B_is_refused(tiny_data, head):
    """Only the heads whose `Head.upcycle` fills their tables from E take init_from; the
    check comes before anything is read (the source here does not even exist)."""
    run = trainer.setup(tiny_config(tiny_data, head=head))
    with pytest.raises(ValueError, match=f"head '{head}' has no A and B to fill .*twin"):
        trainer.upcycle(run, None, "/nonexistent/run")
