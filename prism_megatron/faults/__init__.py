"""Faults: stragglers, thermal throttling, degraded links and slow hosts, injected into the replay
(spec.py), their impact at scale (impact.py), and the fault profile that explains a measured log
(fit.py)."""
