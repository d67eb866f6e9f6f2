"""Data preparation (`onona_jax.data.prepare`) and grain-based loading (`onona_jax.data.pipeline`).

`prepare` is deliberately not re-exported: its name is the submodule's, and importing it here
would make `python -m onona_jax.data.prepare` warn. Use `from onona_jax.data.prepare import prepare`.
"""

import importlib

_PIPELINE = ("DataSource", "TokenStore", "WindowSource", "TrainIterator", "train_batches", "validation_windows",
             "ensure_bundled_data")
__all__ = list(_PIPELINE)


def __getattr__(name):
    # Lazy, so that running the prepare CLI does not import grain.
    if name in _PIPELINE:
        return getattr(importlib.import_module(f"{__name__}.pipeline"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
