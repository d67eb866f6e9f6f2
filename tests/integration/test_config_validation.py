"""Bad values are refused up front (issue 12 item 6): one error line before any write, every float
key checked for finite values, a range for every value a step reads; grad_clip 0 is no clipping;
generate's --max_new_tokens and a prompt longer than the window.
"""

import re

import jax
import pytest

import train as train_cli
from onona_jax import config as config_lib
from run_fixtures import argv, errors, the_config
from run_fixtures import run_dir  # noqa: F401 - fixtures


# (overrides, words of the one error line). NaN and inf are refused for any key, one the run
# reads or not (model.moe.* on a dense model); ranges for every value a step reads. MoE and GDN
# keys are checked when the model has such layers: those rows set model.arch (or a pattern with GDN).
BAD_VALUES = [
    ({"train.b1": "nan"}, "train.b1=nan is not a finite number"),
    ({"train.weight_decay": "nan"}, "train.weight_decay=nan is not a finite number"),
    ({"train.grad_clip": "nan"}, "train.grad_clip=nan is not a finite number"),
    ({"model.rope_theta": "nan"}, "model.rope_theta=nan is not a finite number"),
    ({"model.norm_eps": "nan"}, "model.norm_eps=nan is not a finite number"),
    ({"train.lr": "inf"}, "train.lr=inf is not a finite number"),
    ({"train.final_lr": "-inf"}, "train.final_lr=-inf is not a finite number"),
    ({"model.moe.aux_coef": "nan"}, "model.moe.aux_coef=nan is not a finite number"),
    ({"train.tokens_per_param": "inf"}, "train.tokens_per_param=inf is not a finite number"),
    ({"train.grad_clip": -1}, "train.grad_clip=-1.0 must be positive (the largest global gradient norm) or 0"),
    ({"train.b1": -0.1}, "train.b1=-0.1 must lie in [0, 1)"),
    ({"train.b2": 2.0}, "train.b2=2.0 must lie in [0, 1)"),
    ({"train.b2": 1.0}, "train.b2=1.0 must lie in [0, 1)"),
    ({"train.eps": -1}, "train.eps=-1.0 must be positive"),
    ({"train.eps": 0}, "train.eps=0.0 must be positive"),
    ({"train.weight_decay": -0.1}, "train.weight_decay=-0.1 must be zero (off) or positive"),
    ({"train.steps": -5}, "train.steps=-5 must be positive"),
    ({"train.steps": 0, "train.tokens_per_param": 0}, "train.tokens_per_param=0.0 must be positive when train.steps=0"),
    ({"train.lr": -1e-3}, "train.lr=-0.001 must be positive"),
    ({"train.lr": 0.0}, "train.lr=0.0 must be positive"),
    ({"train.final_lr": -1e-4}, "train.final_lr=-0.0001 must lie in [0, train.lr=0.003]"),
    ({"train.final_lr": 0.01}, "train.final_lr=0.01 must lie in [0, train.lr=0.003]"),
    ({"train.warmup_steps": -1}, "train.warmup_steps=-1 must be zero or positive"),
    ({"train.decay_fraction": 1.5}, "train.decay_fraction=1.5 must lie in [0, 1]"),
    ({"train.global_batch": 0}, "train.global_batch=0 must be positive"),
    ({"train.micro_batch": -1}, "train.micro_batch=-1 must be positive, or 0"),
    ({"train.checkpoint_every": 0}, "train.checkpoint_every=0 must be positive"),
    ({"train.log_every": 0}, "train.log_every=0 must be positive"),
    ({"train.eval_every": 0}, "train.eval_every=0 must be positive"),
    ({"train.keep_checkpoints": 0}, "train.keep_checkpoints=0 must be positive"),
    ({"train.checkpoint_minutes": -1}, "train.checkpoint_minutes=-1.0 must be positive (minutes between timer "
     "saves, besides train.checkpoint_every's) or 0 (no timer saves)"),
    ({"train.checkpoint_minutes": "nan"}, "train.checkpoint_minutes=nan is not a finite number"),
    ({"train.peak_tflops": -1}, "train.peak_tflops=-1.0 must be positive (per device, for MFU) or 0"),
    ({"model.rope_theta": 0}, "model.rope_theta=0.0 must be positive"),
    ({"model.norm_eps": -1e-6}, "model.norm_eps=-1e-06 must be positive"),
    ({"model.mos_components": 0}, "model.mos_components=0 must be at least 1"),
    ({"model.loss_token_tile": -1}, "model.loss_token_tile=-1: a positive number of tokens, or 0 for the platform's default"),
    ({"model.arch": "moe", "model.moe.n_experts": 0}, "model.moe.n_experts=0 must be at least 1"),
    ({"model.arch": "moe", "model.moe.top_k": 0}, "model.moe.top_k=0 must be in 1..n_experts (8)"),
    ({"model.arch": "moe", "model.moe.top_k": 9}, "model.moe.top_k=9 must be in 1..n_experts (8)"),
    ({"model.arch": "moe", "model.moe.d_expert": 0}, "model.moe.d_expert=0 must be positive"),
    ({"model.arch": "moe", "model.moe.capacity_factor": -0.5}, "model.moe.capacity_factor=-0.5 must be positive"),
    ({"model.arch": "moe", "model.moe.eval_capacity_factor": -1}, "model.moe.eval_capacity_factor=-1.0 must be positive"),
    ({"model.arch": "moe", "model.moe.aux_coef": -0.1}, "model.moe.aux_coef=-0.1 must be zero"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.chunk": 0}, "model.gdn.chunk=0 must be positive"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.conv_kernel": 0}, "model.gdn.conv_kernel=0 must be positive"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.head_dim_k": 0}, "model.gdn.head_dim_k=0 must be positive"),
    ({"model.layer_pattern": "gdn,attention", "model.gdn.precision": "bf16"},
     "model.gdn.precision 'bf16': one of default, highest"),
    ({"model.arch": "attnres", "model.attnres.block_size": 0}, "model.attnres.block_size=0 must be ≥ 1"),
    ({"data.seq_len": 0}, "data.seq_len=0 must be positive"),
    ({"data.seed": -1}, "data.seed=-1 must lie in [0, 2**32)"),
    ({"seed": 2**32}, "seed=4294967296 must lie in [0, 2**32)"),
    ({"eval.seed": -1}, "eval.seed=-1 must be zero or positive"),
    ({"eval.windows": 0}, "eval.windows=0 must be positive"),
    ({"eval.batch": 0}, "eval.batch=0 must be positive"),
    ({"mesh.fsdp": 0}, "mesh.fsdp=0 must be positive, or -1"),
    ({"mesh.tensor": -2}, "mesh.tensor=-2 must be positive, or -1"),
    ({"mesh.fsdp": -1}, "mesh.data=-1, mesh.fsdp=-1, mesh.expert=1, mesh.tensor=1: at most one mesh axis may be -1"),
]


@pytest.mark.parametrize("overrides,words", BAD_VALUES,
                         ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _ in BAD_VALUES])
def test_bad_values_rejected_before_any_write(tiny_data, tmp_path, capfd, overrides, words):
    """Exit 2, the one error line naming the key and its range, before anything is compiled
    or written (the workdir is not created)."""
    workdir = tmp_path / "wd"
    assert train_cli.main(argv(tiny_data, workdir, **overrides)) == 2
    [line] = errors(capfd.readouterr().err)
    assert words in line, line
    assert not workdir.exists()


def test_every_float_key_is_checked_for_finite_values():
    """The finite check walks the whole config: NaN in each float key of base_config() (a key
    added later included) is refused naming that key."""
    cfg = the_config("/nonexistent")
    floats = [k for k, v in config_lib.flatten(cfg).items() if isinstance(v, float)]
    assert len(floats) >= 15
    for key in floats:
        bad = the_config("/nonexistent")
        *path, leaf = key.split(".")
        node = bad
        for p in path:
            node = node[p]
        node[leaf] = float("nan")
        with pytest.raises(ValueError, match=rf": {re.escape(key)}=nan is not a finite number"):
            config_lib.validate(bad)


def test_grad_clip_0_is_no_clipping():
    """train.grad_clip=0 turns clipping off: the update equals the unclipped AdamW's (optax's
    clip_by_global_norm(0) would zero it), while 1.0 clips this gradient (norm 55)."""
    import jax.numpy as jnp
    import optax

    from onona_jax.train import optimizer

    cfg = the_config("/nonexistent")
    params = {"w": jnp.full((4, 4), 0.5), "b": jnp.zeros(4)}
    logical = {"w": jax.sharding.PartitionSpec("embed", "mlp"), "b": jax.sharding.PartitionSpec("embed")}
    grads = {"w": jnp.full((4, 4), 10.0), "b": jnp.arange(4.0) * 10}

    def update(tx):
        def two_steps():  # the second sees the first's moments
            state = tx.init(params)
            for _ in range(2):
                updates, state = tx.update(grads, state, params)
            return updates
        return jax.jit(two_steps)()

    def ours(grad_clip):
        cfg.train.grad_clip = grad_clip
        return update(optimizer.make_optimizer(cfg, 10, logical)[0])

    expected = update(optax.adamw(optimizer.schedule(cfg, 10), b1=cfg.train.b1, b2=cfg.train.b2, eps=cfg.train.eps,
                                  weight_decay=cfg.train.weight_decay, mask=optimizer.decay_mask(logical)))
    off = ours(0.0)
    for k in params:
        np_off, np_expected = jax.device_get(off[k]), jax.device_get(expected[k])
        assert (np_off == np_expected).all(), k
        assert abs(np_off).max() > 0
    clipped = ours(1.0)
    assert any((jax.device_get(clipped[k]) != jax.device_get(expected[k])).any() for k in params)


def test_generate_max_new_tokens_and_long_prompt(run_dir, capfd):
    from onona_jax.serve import generate

    assert generate.main([f"--workdir={run_dir}", "--max_new_tokens=0"]) == 2
    assert errors(capfd.readouterr().err) == ["error: --max_new_tokens=0: give at least 1 token to generate"]
    prompt = list(range(100))
    assert generate.fit_prompt(prompt, 32, 8) == (list(range(76, 100)), 76)  # the END is kept
    assert generate.fit_prompt(prompt[:5], 32, 8) == (prompt[:5], 0)
