"""The paper's experiment grids: `sweep` trains every arm of a grid (in sequence, or as one
command per arm for a scheduler) and `report` gathers their final evaluations."""
