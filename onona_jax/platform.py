"""Process start-up: join the other hosts of a multi-host run before JAX touches devices."""

import os

import jax


def initialize():
    """Call `jax.distributed.initialize()` when this process is one of several.

    On TPU pods and SLURM/Open MPI clusters JAX discovers the coordinator itself
    (ONONA_DISTRIBUTED=1 asks for that); elsewhere set JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID. CPU processes use gloo collectives."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        if jax.config.jax_platforms in (None, "", "cpu") and not os.environ.get("JAX_PLATFORMS", "").startswith(("gpu", "cuda", "tpu")):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif os.environ.get("ONONA_DISTRIBUTED") == "1":
        jax.distributed.initialize()
