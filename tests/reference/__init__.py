"""Reference code the tests hold the package to: the paper's PyTorch model (`torch_ref`) and
the per-head and whole-logits math (`jax_math`). Not part of the package."""
