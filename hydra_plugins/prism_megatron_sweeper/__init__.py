"""Hydra finds sweepers only in the `hydra_plugins` namespace: `hydra/sweeper=prism` is this class,
prism_megatron/sweep/sweeper.py's driver."""

from prism_megatron.sweep.sweeper import SweepDriver


class PrismSweeper(SweepDriver):
    """`prism-megatron sweep`'s grid and Optuna search (prism_megatron/sweep/sweeper.py)."""
