"""Training: the run's fixed parts and the train state (`state`), the optimizer and WSD
schedule (`optimizer`), the jitted step (`step`), upcycling a Standard run (`upcycling`),
the loop that resumes and steps (`loop`) and the periodic actions after a step: logging,
validation, saves (`actions`), with the run's clock (`clock`), metrics files (`metrics`),
profiler (`profile`), start-up (`startup`) and resume rules (`resume`).

    from onona_jax import train
    train.train(cfg, workdir)          # what train.py runs
"""

# The names each module gives the package. They are imported at first use (PEP 562), not with the
# package: `python -m onona_jax.train.import_hf --help`, and the sweep (which imports `train.lock`),
# then start without jax.
_NAMES = {
    "actions": ("NonFiniteLoss",),
    "clock": ("peak_tflops",),
    "loop": ("train",),
    "state": ("Run", "abstract_train_state", "init_state", "setup"),
    "step": ("accumulated_grads", "global_batch", "loss_and_aux", "make_train_step"),
    "upcycling": ("upcycle",),
}


def __getattr__(name: str):
    import importlib

    for module, names in _NAMES.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *(n for names in _NAMES.values() for n in names)})
