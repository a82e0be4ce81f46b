"""`prism-megatron emulate GRAPH` and `prism-megatron run [overrides]` (see emulate/run.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from prism_megatron.config.schema import ConfigError
from prism_megatron.util import atomic_write_text

SIM_PREFIXES = ("cluster=", "cluster.", "calibration=")


def _specs(text: Optional[str], default: list) -> list[str]:
    """Sandbox specs from --sandbox (checked for form now, resolved against the graph later)."""
    from prism_megatron.emulate.sandbox import ROLE_NAMES

    specs = [s.strip() for s in text.split(",") if s.strip()] if text else [str(r) for r in default]
    bad = [s for s in specs if not s.isdigit() and s not in ROLE_NAMES]
    if bad:
        raise ConfigError(f"--sandbox {bad[0]!r}: expected a virtual rank or one of {', '.join(ROLE_NAMES)}")
    return specs or ["first-stage"]


def _pace(choice: str) -> Optional[bool]:
    return {"on": True, "off": False}.get(choice)


def emulate_command(args) -> int:
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.sim.report import emulation_cluster

    cluster, calibration = emulation_cluster(args.overrides)
    summary = Emulation(args.graph, args.out, _specs(args.sandbox, []), cluster, calibration,
                        device=args.device, clock=args.clock, pace=_pace(args.pace), faults=args.faults,
                        script_tokens=args.script).run()
    _print(summary)
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    return 0


def run_command(args) -> int:
    from prism_megatron.capture.run import Capture
    from prism_megatron.config.job import job_of
    from prism_megatron.emulate.run import Emulation
    from prism_megatron.sim.report import emulation_cluster

    sim = [o for o in args.overrides if o.startswith(SIM_PREFIXES)]
    job = [o for o in args.overrides if not o.startswith(SIM_PREFIXES)]
    cluster, calibration = emulation_cluster(sim)
    # the config file's sandbox ranks belong to its own world size; the sandboxes come from --sandbox
    # or an emulation.sandbox_ranks override (default: the first stage)
    cfg = job_of(args, job)
    specs = _specs(args.sandbox, list(cfg.emulation.sandbox_ranks))
    cfg.emulation.sandbox_ranks = []  # the capture chooses its own ranks
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: expected 1 or more slices at once")
    out = Path(args.out)
    capture = Capture(cfg, str(out / "capture"), workers=args.workers, device=args.device).run()
    print(f"graph: {capture.graph_path} ({capture.slices_run} slices run, {capture.slices_reused} reused)")
    summary = Emulation(capture.graph_path, str(out / "emulation"), specs, cluster, calibration,
                        device=args.device, clock=args.clock, pace=_pace(args.pace),
                        faults=args.faults or cfg.faults.inject).run()
    summary["graph_path"] = capture.graph_path
    _print(summary)
    atomic_write_text(str(out / "run.json"), json.dumps(summary, indent=1))
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    return 0


def _print(s: dict) -> None:
    print(f"N={s['ranks']} ranks: {s['sandbox_count']} sandbox ({s['physical_fraction']:.6f} of the job), "
          f"{s['materialized_ghosts']} direct-peer ghosts, {s['classes']} classes on {s['cluster']} "
          f"({s['clock']} clock; replay {s['sim_wall_s']:.3f} s)")
    for row in s["sandbox"]:
        print(f"  sandbox rank {row['virtual_rank']}: iteration {row['iteration_time_s'] * 1e3:.3f} ms "
              f"(its own compute and waits: {row['recorded_iteration_s'] * 1e3:.3f} ms recorded), peak "
              f"allocated {row['peak_allocated_bytes'] / 2**20:.2f} MiB, reserved "
              f"{row['peak_reserved_bytes'] / 2**20:.2f} MiB")
        if "realtime_iteration_s" in row:
            print(f"    realtime: measured {row['realtime_iteration_s'] * 1e3:.3f} ms with the holds "
                  f"({row['realtime_vs_virtual_pct']:+.2f}% against the virtual figure, "
                  f"{row['realtime_vs_replay_pct']:+.2f}% against the replay of this run's own compute)"
                  + (f"; {row['realtime_host_bound']['share']:.1%} of its compute ended with its device "
                     "waiting for the host" if row.get("realtime_host_bound") else ""))
            own = [f"{run} run {row[f'{run}_vs_own_iterations_pct']:+.2f}%" for run in ("realtime", "paced")
                   if f"{run}_vs_own_iterations_pct" in row]
            if own:
                print("    each iteration's wall against the replay of its own compute (median): " + ", ".join(own))
            waits = row.get("realtime_injected_waits")
            if waits and waits.get("error_pct") is not None:
                print(f"    holds that waited: {waits['count']}, asked {waits['planned_s'] * 1e3:.3f} ms, "
                      f"{waits['error_pct']:+.2f}% as measured")
        if row.get("overhead_ratio") is not None:
            print(f"    emulator overhead: backend {row['backend_host_s_per_iteration'] * 1e3:.2f} "
                  f"ms/iteration = {row['overhead_ratio'] * 100:.2f}% of its compute "
                  f"({row['backend_host_s_per_op'] * 1e6:.0f} us per operation); on the device "
                  f"{row['backend_device_s_per_iteration'] * 1e3:.2f} ms = "
                  f"{row['device_overhead_ratio'] * 100:.2f}%; replay {row['replay_s'] * 1e3:.1f} ms once")
        bound = row.get("host_bound")
        if bound:
            print(f"    {'WARNING host-bound: ' if bound['warning'] else ''}the device waited for the "
                  f"host at {bound['idle_ops']} of {bound['ops']} operations' begin; "
                  f"{bound['share'] * 100:.1f}% of its compute ({bound['idle_compute_s'] * 1e3:.2f} of "
                  f"{bound['compute_s'] * 1e3:.2f} ms) ended there" + (
                      "; that compute waited for this host's Python and may be longer than on the "
                      "production host: emulate on a less loaded or faster host, or --pace off"
                      if bound["warning"] else ""))
    captured = s.get("capture_host_bound_share")
    if captured and captured["warning"]:
        print(f"  WARNING the graph's capture was host-bound: {captured['max']:.0%} of rank "
              f"{captured['rank']}'s compute ended with its device waiting for the host; the ghosts "
              "replay those durations")
    print(f"job: iteration {s['iteration_time_s'] * 1e3:.3f} ms | {s['tokens_per_s_per_gpu']:.1f} "
          f"tokens/s/GPU | MFU {s['mfu'] * 100:.2f}%")
    if s.get("perfetto"):
        print(f"perfetto: {s['perfetto']}")
