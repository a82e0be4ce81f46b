"""`prism-megatron capture`: the full-scale execution graph, by running roles as slices."""

from __future__ import annotations

from prism_megatron.commands import add_config_arguments, add_executor_arguments, executor_of
from prism_megatron.config import ConfigError
from prism_megatron.config.job import job_of


def add_arguments(cmd) -> None:
    add_config_arguments(cmd)
    cmd.add_argument("--out", required=True, help="directory for the slices and graph.prism")
    cmd.add_argument("--json", default=None, help="write the capture summary JSON here")
    cmd.add_argument("--workers", type=int, default=None,
                     help="slices at once (default: the GPUs present, else 2)")
    add_executor_arguments(cmd)
    cmd.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                     help="where slices run (default: train.device)")


def run(args) -> int:
    from prism_megatron.capture.run import Capture, CaptureFailed, write_summary
    from prism_megatron.graph.check import GraphFileError

    cfg = job_of(args)
    cfg.emulation.sandbox_ranks = []  # the capture chooses the ranks it runs
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: expected 1 or more slices at once")
    executor = executor_of(args)
    try:
        result = Capture(cfg, args.out, workers=args.workers, device=args.device, executor=executor).run()
    except GraphFileError as err:  # the merged graph is inconsistent: not the user's input
        raise CaptureFailed(str(err)) from None
    write_summary(result, args.json)
    print(f"captured {len(result.roles_captured)} of {result.roles_total} roles in "
          f"{result.slices_run} slices ({result.slices_reused} reused, {result.retries} retried); "
          f"{len(result.roles_inferred)} inferred from verified symmetric roles")
    for c in result.classes:
        verdict = "symmetric" if c["symmetric"] else "NOT symmetric: all captured"
        print(f"  class {c['key']:>20}: {c['roles']:4d} roles, probes {', '.join(c['probes'])}: {verdict}")
    print(f"graph: {result.graph_path} ({result.graph_bytes / 1024:.1f} KiB), wall {result.wall_s:.1f} s")
    return 0
