"""onóna in JAX: twin embeddings with tied unembeddings (arXiv 2611.10556)."""

__version__ = "0.1.0"
