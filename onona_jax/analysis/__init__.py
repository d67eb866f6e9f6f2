"""Analyses of trained runs.

    python -m onona_jax.analysis.gate --workdir=DIR     # the twin gate over the vocabulary
    python -m onona_jax.analysis.curves DIR [DIR ...]   # validation-loss curves (Figure 1(c))
"""
