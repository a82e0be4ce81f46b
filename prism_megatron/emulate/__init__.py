"""Hybrid emulation: sandbox ranks for real, ghosts replayed from the captured graph (run.py)."""
