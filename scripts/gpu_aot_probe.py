"""Try deviceless compilation of the train step for an 8-GPU H100/H200 host with jax 0.10.

    pip install --target /tmp/jaxcuda_site --no-deps 'jax-cuda12-pjrt==0.10.2' 'jax-cuda12-plugin==0.10.2'
    PYTHONPATH=/tmp/jaxcuda_site:$PWD python scripts/gpu_aot_probe.py --gpu=h100 [--config=...]

A CUDA topology comes from the PJRT GPU plugin with a GPU target config (the device
description XLA would query from a real GPU); this prints what each stage returns or the
exact error, for docs/SCALING.md.
"""

import argparse
import os
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 8
}}
device_description_str: "{name}"
"""
GPUS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84929347584, bandwidth=3352320000000),
    "h200": dict(name="NVIDIA H200", memory=150754820096, bandwidth=4800000000000),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", choices=tuple(GPUS), default="h100")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--config", default="configs/paper.py:dense-tiny-twin")
    args = ap.parse_args()
    import jax
    from jax.experimental import topologies

    print("jax", jax.__version__)
    target = TARGET.format(**GPUS[args.gpu])
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{args.gpus}", target_config=target)
        devices = list(topo.devices)
        print("topology devices:", devices)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        print("get_topology_desc failed:", type(err).__name__, str(err).splitlines()[0])
        return 1
    from onona_jax import aot, config

    cfg = config.load(args.config)
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    s = aot.Slice(f"{args.gpus}x{args.gpu}", "gpu", "", args.gpus)
    try:
        report = aot.compile_train(cfg, s, devices, hbm=GPUS[args.gpu]["memory"])
        print({k: report[k] for k in ("arguments", "temporaries", "outputs", "total", "compile_s", "flops")})
    except Exception as err:  # noqa: BLE001
        traceback.print_exc(limit=3)
        print("compile failed:", type(err).__name__, str(err).splitlines()[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
