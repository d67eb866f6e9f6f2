"""The paper's experiment grids: `grids` defines them (and each arm's commands), `sweep` trains every
arm of a grid (in sequence, or as one command per arm for a scheduler) and `report` gathers their final evaluations."""
