"""Ahead-of-time compilation for TPU slices (onona_jax/aot/): the slice table, TPU buffer
assignment against the shardings, the collective-bytes reader, and the does-not-fit path.

Needs libtpu (`pip install -e '.[tpu-aot]'`; the README's test command installs it). The 142M
compiles are `slow` (about 2 minutes of CPU each):  python -m pytest -q -m slow tests/unit/test_aot.py
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

from onona_jax.aot.fit import modelled_time, recomputed_flops_per_token
from onona_jax.aot.hlo import collective_bytes, hbm_bytes
from onona_jax.aot.steps import compile_train, expected_argument_bytes, parse_resource_exhausted
from onona_jax.aot.topology import (SLICES, GiB, compiler_missing, cudnn_missing, get_slice, gpu_target,
                                    libtpu_missing, topology_devices)

needs_libtpu = pytest.mark.skipif(libtpu_missing() is not None, reason="libtpu missing: pip install -e '.[tpu-aot]'")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs_libtpu
def test_slice_names_map_to_topologies_with_their_chip_and_device_counts():
    # v4/v5p names count TensorCores (2 per chip), v5e/v6e names count chips.
    expected = {
        "v4-8": ("v4:2x2x1", 4), "v4-4096": ("v4:8x16x16", 2048),
        "v5p-8": ("v5p:2x2x1", 4), "v5p-64": ("v5p:2x4x4", 32), "v5p-256": ("v5p:4x4x8", 128),
        "v5p-1024": ("v5p:8x8x8", 512),
        "v5e-1": ("v5e:1x1", 1), "v5e-16": ("v5e:4x4", 16), "v5e-256": ("v5e:16x16", 256),
        "v6e-1": ("v6e:1x1", 1), "v6e-8": ("v6e:2x4", 8), "v6e-256": ("v6e:16x16", 256),
    }
    for name, (topology, chips) in expected.items():
        s = get_slice(name)
        assert (s.topology, s.chips) == (topology, chips), name
    tpu = {n: s for n, s in SLICES.items() if s.platform == "tpu"}
    assert len(tpu) == 10 + 8 + 8 + 8  # v4-8..4096, v5p-8..1024, v5e/v6e-1..256
    assert (get_slice("h100-16").topology, get_slice("h200-8").chips) == ("1x2x8", 8)
    kinds = {"v4": "TPU v4", "v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
    for name, s in tpu.items():
        devices = topology_devices(s)
        assert len(devices) == s.devices, name
        assert len({tuple(d.coords) for d in devices}) == s.chips, name  # one coordinate per chip
        assert {d.device_kind for d in devices} == {kinds[s.generation]}, name
    assert get_slice("v5e:4x4") is SLICES["v5e-16"]
    with pytest.raises(ValueError, match="unknown --topology='v5e-17'"):
        get_slice("v5e-17")


@needs_libtpu
def test_tiny_compile_on_v5e_4_argument_bytes_match_the_shardings():
    """TPU buffer assignment of the train step's inputs = parameters + AdamW state + step +
    batch, each at its shard's size. The model's widths are multiples of 128 so that no shard
    is padded to TPU's (8, 128) tiles (dense-tiny's 16-wide shards pad by 3%)."""
    from onona_jax import config
    from onona_jax import train as trainer

    cfg = config.load("configs/paper.py:dense-tiny-twin")
    cfg.model.update(d_model=128, n_heads=1, n_kv_heads=1, head_dim=128, d_ff=256)
    cfg.mesh.update(data=1, fsdp=4, tensor=1)
    cfg.train.micro_batch = 1  # 8 rows over 4 replicas: 2 micro-batches accumulated
    s = get_slice("v5e-4")
    devices = topology_devices(s)
    expected = expected_argument_bytes(trainer.setup(cfg, devices=devices))
    # fsdp=4 splits every table and matrix 4 ways: 2 tables of 50,304 × 128 fp32 per device
    assert expected["params"] > 2 * 50304 * 128 * 4 // 4
    assert expected["opt_state"] == pytest.approx(2 * expected["params"], rel=1e-4)  # AdamW mu, nu
    report = compile_train(cfg, s, devices)
    assert report["arguments"] == pytest.approx(sum(expected.values()), rel=0.01)
    assert report["fits"] and report["hbm"] == 16 * GiB
    assert report["total"] >= report["arguments"] + report["temporaries"]
    # fsdp gathers the 3/4 of each table a device lacks in every micro-batch (the loops' trips)
    assert report["accum"] == 2
    assert report["collective_bytes"]["all-gather"] >= 2 * 2 * 50304 * 128 * 4 * 3 // 4


def _tiny_kernel_config(**model):
    """Widths distinct from T = 384 (3 splash blocks of 128), so that only attention's arrays
    end in [T, T]."""
    from onona_jax import config

    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
    cfg.model.update(d_model=128, n_heads=2, n_kv_heads=1, head_dim=128, d_ff=256, **model)
    cfg.data.seq_len = 384
    return cfg


@pytest.mark.slow  # suite-time margin: two TPU compiles (cover: test_tiny_compile_on_v5e_4_*; the kernel: test_attention's splash tests)
@needs_libtpu
def test_v5e_compile_runs_splash_and_keeps_no_score_matrix():
    """`auto` on a TPU slice is splash: its forward and both backward kernels appear in the
    optimized HLO as Mosaic calls, and no [..., T, T] array is materialised; `xla` keeps the
    score and probability matrices for the backward pass and calls no kernel."""
    cfg = _tiny_kernel_config()
    cfg.mesh.update(data=1, fsdp=4, tensor=1)
    s = get_slice("v5e-4")
    devices = topology_devices(s)
    splash = compile_train(cfg, s, devices)
    assert splash["attention_kernels"] == ["mosaic:splash_mha_dkv_no_residuals", "mosaic:splash_mha_dq_no_residuals",
                                           "mosaic:splash_mha_fwd_residuals"]
    assert splash["score_matrices"] == []
    cfg.model.attention_impl = "xla"
    xla = compile_train(cfg, s, devices)
    assert xla["attention_kernels"] == [] and any(m.startswith("f32[") and m.endswith(",384,384]")
                                                  for m in xla["score_matrices"])
    assert splash["temporaries"] < xla["temporaries"]


def _gpu_aot_missing():
    h100 = get_slice("h100-8")
    return compiler_missing(h100) or cudnn_missing(_tiny_kernel_config(dtype="bfloat16"), h100)


@pytest.mark.skipif(_gpu_aot_missing() is not None, reason=str(_gpu_aot_missing()))
def test_h100_compile_runs_cudnn_flash_attention():
    """`auto` on a GPU host in bf16 is cuDNN's fused attention, compiled without a GPU by the
    PJRT CUDA plugin (with the cuDNN wheel): its forward and backward calls are in the HLO."""
    cfg = _tiny_kernel_config(dtype="bfloat16")
    cfg.mesh.update(data=-1, fsdp=1, tensor=1)
    report = compile_train(cfg, get_slice("h100-8"))
    assert report["attention_kernels"] == ["cudnn:__cudnn$fmhaSoftmax", "cudnn:__cudnn$fmhaSoftmaxBackward"]


def test_gpu_compile_target_and_slice_hbm_read_the_one_chip_table():
    """`chips.CHIPS` is the one table of hardware peaks: a slice's HBM and the GPU compile
    target's memory and bandwidth (what CUDA reports for an H100) are its rows."""
    from onona_jax import chips

    target = gpu_target("h100")
    assert "device_memory_size: 84929347584\n" in target and "memory_bandwidth: 3352320000000\n" in target
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in target
    assert get_slice("h100-8").hbm_per_device == chips.CHIPS["h100"].hbm_bytes == 84_929_347_584
    assert get_slice("h200-8").hbm_per_device == 150_754_820_096
    assert get_slice("v5e-16").hbm_per_device == 16 * GiB
    assert get_slice("v4-8").hbm_per_device == 16 * GiB  # a v4 chip is two devices in libtpu's description


def test_modelled_step_time_and_recompute_by_policy():
    """`modelled_time` is arithmetic on the report and the chip's row: compute = FLOPs (model +
    recomputed) / peak, HBM = the materialised buffers' bytes / bandwidth, collectives = bytes /
    link bandwidth; overlapped = the largest, serial = compute-or-HBM + collectives. Recompute
    grows from none to full."""
    from onona_jax import chips, config

    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-142m-twin"))
    s = get_slice("v5e-16")
    report = {"model_flops": 19.7e12, "hbm_bytes": 60e9,
              "collective_bytes": {"all-gather": 1.5e9, "reduce-scatter": 0.5e9}}
    chip = chips.CHIPS["v5e"]
    m = modelled_time(report, cfg, s)  # remat none: nothing recomputed
    assert m["recomputed_flops"] == 0
    assert m["compute_s"] == pytest.approx(19.7e12 / (chip.peak_tflops * 1e12))
    assert m["memory_s"] == pytest.approx(60e9 / (chip.hbm_gbps * 1e9))
    assert m["comm_s"] == pytest.approx(2e9 / (chip.link_gbps * 1e9))
    assert m["overlapped_s"] == max(m["compute_s"], m["memory_s"], m["comm_s"])
    assert m["serial_s"] == pytest.approx(max(m["compute_s"], m["memory_s"]) + m["comm_s"])
    recompute = []
    for remat in ("none", "dots", "attention", "full"):
        cfg.model.remat = remat
        recompute.append(recomputed_flops_per_token(cfg))
    assert recompute == sorted(recompute) and recompute[0] == 0 < recompute[1]


def test_hbm_bytes_counts_materialised_buffers_by_loop_trips():
    """Synthetic HLO: a fusion's [8,128] f32 output in a 16-trip loop body is written and read
    16 times (2 × 16 × 4 KiB); a dynamic-update-slice writes its [1,128] update, not the
    [16,128] buffer; instructions inside fusions, bitcasts and the loop's tuples are no buffers."""
    hlo = """HloModule m

%fused (x: f32[8,128]) -> f32[8,128] {
  %x = f32[8,128] parameter(0)
  %big = f32[64,128] broadcast(%x), dimensions={}
  ROOT %y = f32[8,128] exponential(%x)
}

%cond (p: (s32[], f32[8,128], f32[16,128])) -> pred[] {
  %p = (s32[], f32[8,128], f32[16,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8,128], f32[16,128])) -> (s32[], f32[8,128], f32[16,128]) {
  %p = (s32[], f32[8,128], f32[16,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,128] get-tuple-element(%p), index=1
  %acc = f32[16,128] get-tuple-element(%p), index=2
  %f = f32[8,128] fusion(%x), kind=kLoop, calls=%fused
  %row = f32[1,128] bitcast(%x)
  %upd = f32[16,128] dynamic-update-slice(%acc, %row, %i, %i)
  ROOT %t = (s32[], f32[8,128], f32[16,128]) tuple(%i, %f, %upd)
}

ENTRY %main (a: f32[8,128]) -> f32[8,128] {
  %a = f32[8,128] parameter(0)
  %w = (s32[], f32[8,128], f32[16,128]) while(%t0), condition=%cond, body=%body
  ROOT %r = f32[8,128] get-tuple-element(%w), index=1
}
"""
    loop_condition = 2 * 1  # its pred[] result (the model counts a condition once)
    assert hbm_bytes(hlo) == 2 * 16 * (8 * 128 * 4 + 1 * 128 * 4) + loop_condition


SYNTHETIC_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[8,128])) -> pred[] {
  %p = (s32[], f32[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%start_fusion (x: f32[8,128]) -> (f32[8,128], f32[32,128]) {
  %x = f32[8,128] parameter(0)
  %ag = f32[32,128]{1,0:T(8,128)} all-gather(%x), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %cc = (f32[8,128], f32[32,128]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}

%done_fusion (x: f32[8,128]) -> f32[32,128] {
  %x = f32[8,128] parameter(0)
  %ag2 = f32[32,128]{1,0:T(8,128)} all-gather(%x), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %cd = f32[32,128] custom-call(%ag2), custom_call_target="AsyncCollectiveDone"
}

%continuation (x: f32[8,128]) -> f32[32,128] {
  %x = f32[8,128] parameter(0)
  ROOT %ag3 = f32[32,128]{1,0:T(8,128)} all-gather(%x), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}
}

%inner (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[], f32[8,128]) parameter(0)
  %x = f32[8,128] get-tuple-element(%p), index=1
  %c = f32[32,128] fusion(%x), kind=kCustom, calls=%continuation
  ROOT %t = (s32[], f32[8,128]) tuple(%i, %x)
}

%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[], f32[8,128]) parameter(0)
  %x = f32[8,128] get-tuple-element(%p), index=1
  %s = (f32[8,128], f32[32,128]) fusion(%x), kind=kCustom, calls=%start_fusion
  %w2 = (s32[], f32[8,128]) while(%t1), condition=%cond, body=%inner
  %d = f32[32,128] fusion(%x), kind=kCustom, calls=%done_fusion
  %rs = bf16[2,128]{1,0} reduce-scatter(%d), channel_id=8, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %rs2 = f32[2,128]{1,0} reduce-scatter(%d), channel_id=11, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[8,128]) tuple(%i, %x)
}

ENTRY %main (a: f32[8,128]) -> f32[8,128] {
  %a = f32[8,128] parameter(0)
  %w = (s32[], f32[8,128]) while(%t0), condition=%cond, body=%body
  %ar = f32[8,128]{1,0} all-reduce(%a), channel_id=9, replica_groups=[1,8]<=[8], to_apply=%add
  %cp = (f32[8,128], f32[8,128], u32[], u32[]) collective-permute-start(f32[8,128] %a), channel_id=10, source_target_pairs={{0,1}}
  %cpd = f32[8,128] collective-permute-done(%cp)
  ROOT %r = f32[8,128] add(%ar, %cpd)
}
"""


def test_collective_bytes_reads_loops_async_pairs_and_reduce_scatter():
    out = collective_bytes(SYNTHETIC_HLO, n_devices=8)
    assert out == {
        # once per channel (start, done and a continuation carried through the inner loop
        # repeat it), as often as it is issued: 16 trips, not 16 × 16
        "all-gather": 16 * 32 * 128 * 4,
        "reduce-scatter": 16 * 2 * 128 * (2 + 4) * 4,  # the full input: result × group of 4
        "all-reduce": 8 * 128 * 4,
        "all-to-all": 0,
        "collective-permute": 8 * 128 * 4,  # the -start tuple holds input and output: counted once
    }


SHARD_MAP_HLO = """
HloModule m

%body (p: (s32[], f32[8,640])) -> (s32[], f32[8,640]) {
  %p = (s32[], f32[8,640]) parameter(0)
  %x = f32[8,640] get-tuple-element(%p), index=1
  %to = f32[8,640]{1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/shard_map/all_to_all" stack_frame_id=7}
  %back = f32[8,640]{1,0} all-to-all(%to), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/shard_map/all_to_all" stack_frame_id=9}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,640]) tuple(%i, %back)
}

%cond (p: (s32[], f32[8,640])) -> pred[] {
  %p = (s32[], f32[8,640]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,640]) -> f32[8,640] {
  %a = f32[8,640] parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,640]) tuple(%z, %a)
  %w = (s32[], f32[8,640]) while(%t), condition=%cond, body=%body
  %ar = f32[8,640]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(step)/shard_map/psum" stack_frame_id=3}
  ROOT %r = f32[8,640] get-tuple-element(%w), index=1
}
"""


def test_collective_bytes_tells_apart_shard_map_ops_that_share_a_channel_id():
    """XLA:TPU may give every collective of a shard_map channel_id=1 (an expert-parallel MoE's
    dispatch and combine all-to-alls, the fused loss's psum): each distinct op counts, by its
    source; keyed by channel id alone, all but one vanished from the report."""
    out = collective_bytes(SHARD_MAP_HLO, n_devices=8)
    assert out["all-to-all"] == 4 * 2 * 8 * 640 * 4  # 4 layers × (dispatch + combine)
    assert out["all-reduce"] == 8 * 640 * 4


# One slice's program of a 2-slice job: an all-gather over the slice's 4 devices, and two
# cross-slice (DCN) transfers as libtpu writes them: host-transfer sends to the megascale
# runtime, an all-reduce inside a 3-trip loop and an all-gather.
MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="{r}",' \
            '_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{{1,2}}x{{0:3}}",' \
            '_xla_megascale_transfer_type="{t}"'
TWO_SLICE_HLO = """HloModule two_slices, num_partitions=4

%body (p: (s32[], f32[16,128])) -> (s32[], f32[16,128]) {
  %p = (s32[], f32[16,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[16,128] get-tuple-element(%p), index=1
  %aa = token[] after-all()
  %s = (f32[16,128], u32[], token[]) send(%x, %aa), channel_id=1, is_host_transfer=true, frontend_attributes={%s}
  %sd = token[] send-done(%s), channel_id=1, is_host_transfer=true, frontend_attributes={%s}
  %r = (f32[16,128], u32[], token[]) recv(%aa), channel_id=2, is_host_transfer=true, frontend_attributes={%s}
  ROOT %t = (s32[], f32[16,128]) tuple(%i, %x)
}

%cond (p: (s32[], f32[16,128])) -> pred[] {
  %p = (s32[], f32[16,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,128]) -> f32[32,128] {
  %a = f32[8,128] parameter(0)
  %ag = f32[32,128] all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %aa = token[] after-all()
  %g = (f32[8,128], u32[], token[]) send(%a, %aa), channel_id=3, is_host_transfer=true, frontend_attributes={%g}
  %z = s32[] constant(0)
  %b = f32[16,128] broadcast(%z), dimensions={}
  %init = (s32[], f32[16,128]) tuple(%z, %b)
  %w = (s32[], f32[16,128]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[32,128] copy(%ag)
}
""".replace("{%s}", "{" + MEGASCALE.format(r="all-reduce.7_0", t="ALL_REDUCE") + "}").replace(
    "{%g}", "{" + MEGASCALE.format(r="all-gather.9_0", t="ALL_GATHER") + "}")


def test_collective_bytes_split_within_and_across_slices():
    links: dict = {}
    out = collective_bytes(TWO_SLICE_HLO, n_devices=4, by_link=links, slices=2)
    within, cross = links["within_slice"], links["cross_slice"]
    assert within["all-gather"] == 32 * 128 * 4 and within["all-reduce"] == 0
    # the send counts once per trip (its send-done and the matching recv do not count); a
    # cross-slice all-gather counts its result, the part sent × 2 slices
    assert cross["all-reduce"] == 3 * 16 * 128 * 4
    assert cross["all-gather"] == 2 * 8 * 128 * 4
    assert out["all-gather"] == within["all-gather"] + cross["all-gather"]
    assert out["all-reduce"] == cross["all-reduce"]
    # a one-slice program has no cross-slice traffic
    collective_bytes(SYNTHETIC_HLO, n_devices=8, by_link=links)
    assert set(links["cross_slice"].values()) == {0}


@pytest.mark.slow  # suite-time margin (cover: test_sharding's two-slice mesh, test_collective_bytes_split_within_and_across_slices)
@needs_libtpu
def test_two_slice_compile_keeps_parameter_gathers_within_a_slice():
    """2 × v5e-4, FSDP over each slice (mesh.slices=2, data=1, fsdp=-1): the data axis spans the
    slices, so the only cross-slice traffic is the gradient's all-reduce; every parameter
    all-gather stays on a slice's ICI. Asserted on the optimized HLO that libtpu compiles for
    the real 2-slice topology (one slice's program, its DCN transfers sends to the megascale
    runtime)."""
    import jax

    from onona_jax import config, sharding
    from onona_jax import train as trainer

    cfg = config.load(os.path.join(REPO, "configs/paper.py:dense-tiny-twin"))
    cfg.mesh.update(data=1, fsdp=-1, tensor=1, slices=2)
    cfg.train.micro_batch = 0
    s = dataclasses.replace(get_slice("v5e-4"), slices=2)
    devices = topology_devices(s)
    assert len(devices) == s.devices == 8 and {d.slice_index for d in devices} == {0, 1}
    run = trainer.setup(cfg, devices=devices)
    assert dict(run.mesh.shape) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    for row in run.mesh.devices:  # each data row (its fsdp group) lies in one slice
        assert len({d.slice_index for d in row.flat}) == 1
    report = compile_train(cfg, s, devices)
    within, cross = (report["collective_bytes_by_link"][k] for k in ("within_slice", "cross_slice"))
    assert cross["all-gather"] == 0  # the target: no parameter gather over DCN
    assert within["all-gather"] > 0  # FSDP does gather them, within the slice
    assert {k for k, v in cross.items() if v} == {"all-reduce"}
    # the gradient all-reduce: every parameter's f32 gradient, reduced within the slice to a
    # device's quarter before it crosses (at least that much leaves each device)
    n_params = sum(x.size for x in jax.tree.leaves(run.abstract_params))
    assert cross["all-reduce"] >= n_params * 4 // 4
    assert sharding.data_parallel_size(run.mesh) == 8


def test_resource_exhausted_message_gives_needed_and_available():
    msg = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
           "HLO temporaries (33.57G) exceeds available HBM (15.75G)")
    assert parse_resource_exhausted(msg) == (int(33.57 * GiB), int(15.75 * GiB))
    assert parse_resource_exhausted("Used 40.10G of 15.75G hbm. Exceeded hbm capacity by 24.35G.") == (
        int(40.10 * GiB), int(15.75 * GiB))


def _cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "onona_jax.aot", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@needs_libtpu
def test_config_that_does_not_fit_exits_1_with_needed_available_and_overrides():
    r = _cli("--config=configs/paper.py:dense-tiny-twin", "--topology=v5e-4", "--hbm_gib=0.01",
             "--noeval_step")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    [err] = _errors(r.stderr)
    assert "dense-tiny-twin (twin) does not fit on v5e-4: needs " in err
    assert "GiB of HBM per device, 0.01 GiB available" in err
    # data parallelism replicates the state: sharding it is the first thing to try
    assert "--config.mesh.data=1 --config.mesh.fsdp=-1" in err and "--config.model.remat=dots" in err
    # the report still went to stdout, with the row that does not fit
    assert "NO" in r.stdout.split("twin       train")[1].splitlines()[0]


@pytest.mark.slow  # suite-time margin (cover: the report of test_config_that_does_not_fit_*)
@needs_libtpu
def test_report_records_the_vocabulary_and_the_ratio_row(tmp_path):
    """Any tokenizer's vocabulary (here a planning tokenizer of 1,000 entries: 1,024 rows) is in
    the JSON report, and scripts/aot_table.py --ratios reads its twin/standard row from it."""
    import json

    out = tmp_path / "r.json"
    r = _cli("--config=configs/paper.py:dense-tiny-twin", "--config.data.tokenizer=size:1000", "--topology=v5e-4",
             "--compare_head=standard", "--noeval_step", f"--json_out={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["tokenizer"], report["vocab_size"]) == ("size:1000", 1024)
    # twin's extra [V, d] table and its second projection: more HBM and more model FLOPs
    assert report["ratio"]["hbm_total"] > 1 and report["ratio"]["model_flops"] > 1
    row = subprocess.run([sys.executable, "scripts/aot_table.py", "--ratios", str(out)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    assert row.startswith("| dense-tiny | 1,024 | v5e-4 | ")
    assert f"**{report['ratio']['hbm_total']:.3f}** | {report['ratio']['model_flops']:.3f} |" in row


def test_without_libtpu_the_message_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert compiler_missing(get_slice("v5e-16")) == libtpu_missing()
    assert "pip install -e '.[tpu-aot]' (or pip install 'libtpu==0.0.42.*'" in libtpu_missing()
    assert "pip install -e '.[gpu-aot]'" in compiler_missing(get_slice("h100-8"))


def test_unknown_slice_is_one_error_line_before_any_compile():
    r = _cli("--config=configs/paper.py:dense-tiny-twin", "--topology=v5e-17")
    assert r.returncode == 2
    # nothing else: no libtpu load, no compile. (With the gpu-aot extra installed, `import jax`
    # itself logs the CUDA plugin's "Could not find cuda drivers" on a machine without a GPU.)
    lines = [ln for ln in r.stderr.strip().splitlines()
             if "cudart_stub.cc" not in ln and not ln.startswith("WARNING: All log messages before absl")]
    assert lines == _errors(r.stderr)
    assert "unknown --topology='v5e-17'; choose a slice name: v4-8" in r.stderr


def test_bad_slices_are_one_error_line_before_any_compile():
    r = _cli("--config=configs/paper.py:dense-tiny-twin", "--topology=v5e-4", "--slices=2",
             "--config.mesh.slices=3")
    assert r.returncode == 2 and "--slices=2 and --config.mesh.slices=3 disagree" in r.stderr
    r = _cli("--config=configs/paper.py:dense-tiny-twin", "--topology=h100-8", "--slices=2")
    assert r.returncode == 2 and "multi-slice compiles are for TPU slices" in r.stderr
    assert len(_errors(r.stderr)) == 1


@needs_libtpu
@pytest.mark.slow
def test_paper_142m_twin_fits_v5e_16_with_micro_batch_4():
    """The issue's target: dense-142m-twin at global batch 256 × 1,024 on v5e-16 with fsdp=16
    fits at micro-batch 4 (about 2 minutes of CPU per compile)."""
    import jax

    from onona_jax import config

    cfg = config.load("configs/paper.py:dense-142m-twin")
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    cfg.train.micro_batch = 4
    s = get_slice("v5e-16")
    with pytest.raises(ValueError, match="splash attention on TPU with model.dtype=bfloat16 cannot run under "
                                         "jax_default_matmul_precision='highest'"):
        compile_train(cfg, s)  # the suite's conftest asks for "highest"
    with jax.default_matmul_precision("default"):
        report = compile_train(cfg, s)
    assert report["fits"] and report["accum"] == 4
    assert report["total"] < 15.75 * GiB
