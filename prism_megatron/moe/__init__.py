"""MoE routing: load-imbalance models (imbalance.py)."""
