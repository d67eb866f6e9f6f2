"""Ahead-of-time compilation for TPU slices (and 8-GPU H100/H200 hosts) from a CPU host: does
a config fit, and what does one step cost there?

    python -m onona_jax.aot --config=configs/paper.py:dense-142m-twin --topology=v5e-16 \\
        --config.mesh.data=1 --config.mesh.fsdp=-1 [--slices=2] [--compare_head=standard] [--fit] [--json]

With `libtpu` installed (`pip install -e '.[tpu-aot]'`), `jax.experimental.topologies` describes
the devices of any TPU slice without owning one (with the PJRT CUDA plugin, `.[gpu-aot]`, and a
GPU target config, those of GPU hosts). This module builds the run's mesh on those
devices with the trainer's own `setup` (the same `sharding.RULES`), lowers the trainer's own
train and eval steps (`make_train_step`, `make_eval_step`) from abstract shapes that carry the
shardings, compiles them with the TPU compiler and reports, per device:

* HBM from XLA's buffer assignment (`compiled.memory_analysis()`): arguments, temporaries,
  outputs (less what the donated state aliases) and their total, against the chip's HBM;
* FLOPs per step and device: the model's (`summary.flops_per_token` × tokens / devices) and
  XLA's `compiled.cost_analysis()` (`xla_flops`, which counts every while-loop body once: the
  scanned layers, micro-batches and loss chunks, so it is a lower bound);
* collective bytes per step by kind, read from the optimized HLO: each all-gather,
  reduce-scatter, all-reduce, all-to-all and collective-permute counts the larger of its
  input and output on one device, times the trip counts of the loops around it (the layer
  scan, the micro-batch scan). `--slices=N` compiles for N such slices joined by the
  data-center network (mesh.slices: the data axis across slices, the rest within one), and
  the bytes are also split by link (`collective_bytes_by_link`: within a slice over ICI,
  across slices over DCN).

* the attention kernel in the optimized HLO (`attention_kernels`: splash's Mosaic calls on
  TPU, cuDNN's fused attention on GPU, none for plain XLA), the `[..., T, T]` score matrices the
  program materialises, and its largest arrays by shape.

`--fit` weighs plans: for each remat policy (none, attention_experts for MoE, attention, dots,
attention_offload, full) the
largest micro-batch that fits, each with its HBM, collective bytes, recomputed FLOPs and a
MODELLED step time (`modelled_time`: a roofline from the compiled program and the chip's
peaks, `chips.CHIPS`; not a measurement), and picks the fastest. A config that does not fit
exits with status 1, the needed and the available HBM and the overrides that would help.

The package, one module a job: `topology` (the slices and GPU hosts, their compile-only
devices, the compilers they need), `steps` (compile the train and eval steps there and report
one compiled program), `hlo` (what the optimized HLO says: collective bytes by kind and link,
HBM traffic, materialised arrays, attention kernels), `fit` (the remat × micro-batch search and
the modelled step time), `report` (everything the command reports, and its table), and
`__main__` (the command line).
"""
