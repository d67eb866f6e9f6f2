"""Evaluation: validation loss and one-table ablations (`validation`), downstream tasks
(`tasks`), and the lm-evaluation-harness model (`lm_eval_model`). Everything here restores
parameters only (`checkpoint.restore_params`)."""
