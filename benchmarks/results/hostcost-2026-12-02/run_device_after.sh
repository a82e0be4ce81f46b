#!/bin/bash
# One H200, after the host-time cuts of this directory's README: the hold kernel alone (its launcher
# and the plain launch side by side, hold_smoke.py), then realtime emulation against the virtual
# figure for CONFIGS (default moe_ep2 tp2), REPS each. Call 3 ran this as LIMIT_S=260 (an earlier
# copy of the same steps, before it delegated to realtime-2026-12-02/run_device.sh).
CONFIGS=${CONFIGS:-"moe_ep2 tp2"} exec bash "$(dirname "$0")/../realtime-2026-12-02/run_device.sh"
