"""`prism-megatron sweep [-m] [overrides] --out DIR` (see sweep/run.py)."""

from __future__ import annotations

from pathlib import Path

from prism_megatron.config.schema import ConfigError
from prism_megatron.util import atomic_write_text


def sweep_command(args) -> int:
    from prism_megatron.config.job import config_file as config_file_of
    from prism_megatron.sim.cluster import load_cluster
    from prism_megatron.sweep.run import Sweep, expand, is_oom, ranked, ranking_png, summary_json

    if args.jobs < 1 or (args.workers is not None and args.workers < 1):
        raise ConfigError(f"--jobs {args.jobs} / --workers {args.workers}: expected 1 or more")
    load_cluster(args.cluster)  # fail fast on a bad cluster name
    points = expand(list(args.overrides))
    out = Path(args.out)
    config_file = args.config if args.script else config_file_of(args.config)
    rows = Sweep(out, [], points, config_file, cluster=args.cluster, jobs=args.jobs,
                 workers=args.workers, script=args.script).run()
    best = ranked(rows)
    skipped = [r for r in rows if r["status"] != "ok"]
    swept = _swept_keys(points)

    def shown(row: dict) -> str:  # the swept settings only; results.csv keeps every override
        return " ".join(o for o in row["overrides"].split() if o.partition("=")[0] in swept)

    print(f"{len(rows)} points: {len(best)} simulated, {len(skipped)} skipped or failed "
          f"(results: {out / 'results.csv'})")
    print(f"{'rank':>5}{'tokens/s/GPU':>14}{'MFU %':>8}{'iteration ms':>14}{'peak MiB':>10}{'OOM':>5}"
          "  overrides")
    for i, r in enumerate(best, start=1):
        oom = is_oom(r)
        print(f"{i:>5}{float(r['tokens_per_s_per_gpu']):>14.1f}{float(r['mfu']) * 100:>8.2f}"
              f"{float(r['iteration_time_s']) * 1e3:>14.2f}{int(float(r['max_peak_bytes'])) / 2**20:>10.2f}"
              f"{'yes' if oom else 'no':>5}  {shown(r)}")
    for r in skipped:
        print(f"  skipped: {shown(r)}: {r['status']}")
    if best:
        print(f"best: {best[0]['overrides']}")
        ranking_png(out / "ranking.png", best)
    atomic_write_text(str(out / "summary.json"), summary_json(rows))
    if args.json:
        atomic_write_text(args.json, summary_json(rows))
    return 0


def _swept_keys(points: list[list[str]]) -> set[str]:
    values: dict[str, set[str]] = {}
    for p in points:
        for o in p:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    return {k for k, v in values.items() if len(v) > 1}
