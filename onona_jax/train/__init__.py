"""Training: the run's fixed parts and the train state (`state`), the optimizer and WSD
schedule (`optimizer`), the jitted step (`step`), upcycling (`upcycle`) and the loop that
resumes, logs, validates and checkpoints (`loop`).

    from onona_jax import train
    train.train(cfg, workdir)          # what train.py runs
"""

from onona_jax.train.loop import NonFiniteLoss, peak_tflops, train  # noqa: F401
from onona_jax.train.state import Run, abstract_train_state, init_state, setup  # noqa: F401
from onona_jax.train.step import accumulated_grads, global_batch, loss_and_aux, make_train_step  # noqa: F401
from onona_jax.train.upcycle import upcycle  # noqa: F401
