"""Kernel-cost model of GPU types (pure: op signatures in, seconds out) and its GPU calibration."""
