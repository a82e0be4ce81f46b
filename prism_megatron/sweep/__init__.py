"""Config-override sweeps for tuning (run.py)."""
