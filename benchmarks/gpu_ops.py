"""GPU benchmark: a captured role's per-op durations against a profiled plain run of the same ops.

One role (virtual rank 0: first pipeline stage, tensor rank 0) of a GPT job (TP2 PP2 DP2, 8 layers,
hidden 2048, seq 2048, bf16) runs three ways on one GPU, in fresh processes:

1. `record`: the recorder as a capture slice uses it (CUDA events at every boundary, device clock);
2. `profile`: the same job with torch.profiler (CUPTI kernel timings) over its last iteration, and
   only a zero-length profiler marker at each boundary; each kernel is attributed, by its launch on
   the host, to the segment (module-level op) it was launched in. This run's recorder uses host
   timestamps (perf_counter), i.e. when the launches happened, for comparison;
3. `compare`: per op name, the summed durations of (1), the summed kernel time of (2) and the host
   time of (2), side by side, written to `ops.json`. Communication nodes appear as `comm:<op>.<dim>`:
   in a slice that is the backend call itself, where ghost contributions are folded in on the device
   (its kernels are attributed there in both runs). A recorder duration is the device timeline
   between two boundaries, so it includes the GPU's idle time while the host launches (what the
   replay needs); the kernel sum does not: the two agree where the GPU is busy, and differ by the
   launch gaps where the job is host-bound.

    python benchmarks/gpu_ops.py record|profile|compare --out DIR [--device cuda] [--small] [flags]

(extra flags go to the example, after the defaults: e.g. --micro-batch-size 8 --global-batch-size 32)
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOB = ["--prism-virtual-world-size", "8", "--prism-sandbox-ranks", "0",
       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "8",
       "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--bf16",
       "--vocab-size", "32000"]
ITERS = 4
SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--vocab-size", "256"]  # --small: a plumbing check that runs anywhere


def _example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", REPO / "examples" / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(out: Path, job: list[str]) -> int:
    return _example().main([*job, "--prism-trace-path", str(out / "record.prism")])


def profile(out: Path, job: list[str]) -> int:
    import torch
    import torch.distributed as dist

    import prism_megatron
    from prism_megatron.config.flags import (
        OneLineParser,
        add_megatron_args,
        add_prism_args,
        config_from_args,
    )
    from prism_megatron.trace.clock import CpuClock
    from prism_megatron.trace.recorder import Recorder

    class MarkingRecorder(Recorder):
        """Host-clock recorder that leaves a profiler marker at every boundary and profiles the last
        iteration."""

        prof = None

        def _cut(self, *args, **kwargs):
            with torch.profiler.record_function("prism@" + self._labels[-1]):
                pass
            return super()._cut(*args, **kwargs)

        def comm_issued(self, work):  # what ran inside the backend call is the operation's
            node = self._cur.nodes[-1]
            with torch.profiler.record_function(f"prism@comm:{node.op}.{node.dim}"):
                pass
            return super().comm_issued(work)

        def begin_iteration(self):
            super().begin_iteration()
            if len(self.iterations) == ITERS and self.prof is None:
                torch.cuda.synchronize()  # a no-op stub on the CPU runtime
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.__enter__()

        def build(self, *args, **kwargs):
            if self.prof is not None:
                torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                self.prof.export_chrome_trace(str(out / "profile_trace.json"))
                self.prof = None
            return super().build(*args, **kwargs)

    ex = _example()
    parser = OneLineParser(prog="gpu_ops")
    add_megatron_args(add_prism_args(parser))
    args = parser.parse_args([*job, "--prism-trace-path", str(out / "profile_host.prism")])
    cfg = config_from_args(args)
    recorder = MarkingRecorder(CpuClock(), lambda: torch.cuda.memory_allocated())  # CPU: the tracker
    inst = prism_megatron.install(cfg, recorder=recorder)
    try:
        ex.train(cfg, inst, None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        inst.uninstall()
    return 0


def _kernel_ms_by_label(trace_path: Path) -> dict[str, float]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    markers: dict[object, list[tuple[float, str]]] = defaultdict(list)
    launches: dict[int, tuple[object, float]] = {}
    kernels: list[tuple[int, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args", {})
        if cat == "user_annotation" and e["name"].startswith("prism@"):
            markers[e["tid"]].append((float(e["ts"]), e["name"][len("prism@"):]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = (e["tid"], float(e["ts"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in args:
            kernels.append((args["correlation"], float(e["dur"])))
    for tid in markers:
        markers[tid].sort()
    out: dict[str, float] = defaultdict(float)
    for corr, dur in kernels:
        tid, ts = launches.get(corr, (None, 0.0))
        seq = markers.get(tid, [])
        i = bisect.bisect_left(seq, (ts, ""))
        out[seq[i][1] if i < len(seq) else "(after last marker)"] += dur / 1e3
    return dict(out)


def _ms_by_name(path: Path) -> dict[str, float]:
    from prism_megatron.graph import load_graph
    from prism_megatron.graph.model import NodeKind

    graph = load_graph(str(path), check=False)
    g = next(iter(graph.roles.values()))
    out: dict[str, float] = defaultdict(float)
    cols = g.columns
    for i in range(g.num_nodes):
        name = graph.string(int(cols["name"][i]))
        if cols["kind"][i] != NodeKind.COMPUTE:  # the backend call (ghost data folded in on device)
            name = f"comm:{name}.{graph.string(int(cols['dim'][i]))}"
        out[name] += float(cols["duration_s"][i]) * 1e3
    return dict(out)


def compare(out: Path, job: list[str]) -> int:
    from prism_megatron.util import atomic_write_text

    events = _ms_by_name(out / "record.prism")
    host = _ms_by_name(out / "profile_host.prism")
    kernels = _kernel_ms_by_label(out / "profile_trace.json")
    names = sorted(set(events) | set(kernels), key=lambda n: -kernels.get(n, 0.0))
    rows = [{"op": n, "cuda_event_ms": round(events.get(n, 0.0), 4),
             "profiler_kernel_ms": round(kernels.get(n, 0.0), 4),
             "host_clock_ms": round(host.get(n, 0.0), 4)} for n in names]
    print(f"{'op':48}{'recorder (CUDA events) ms':>27}{'profiler kernels ms':>21}{'ratio':>8}"
          f"{'host clock ms':>15}")
    for r in rows:
        if max(r["cuda_event_ms"], r["profiler_kernel_ms"]) < 0.05:
            continue
        ratio = r["cuda_event_ms"] / r["profiler_kernel_ms"] if r["profiler_kernel_ms"] else float("nan")
        print(f"{r['op'][:47]:48}{r['cuda_event_ms']:>27.3f}{r['profiler_kernel_ms']:>21.3f}"
              f"{ratio:>8.3f}{r['host_clock_ms']:>15.3f}")
    total = {k: round(sum(r[k] for r in rows), 3) for k in ("cuda_event_ms", "profiler_kernel_ms",
                                                             "host_clock_ms")}
    ratio = total["cuda_event_ms"] / max(total["profiler_kernel_ms"], 1e-9)
    print(f"{'total (one iteration)':48}{total['cuda_event_ms']:>27.3f}"
          f"{total['profiler_kernel_ms']:>21.3f}{ratio:>8.3f}{total['host_clock_ms']:>15.3f}")
    atomic_write_text(str(out / "ops.json"), json.dumps({"job": job, "rows": rows, "total": total},
                                                        indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("record", "profile", "compare"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny model (plumbing check)")
    args, extra = parser.parse_known_args()  # extra: more example flags, e.g. --micro-batch-size 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = ["--device", args.device, *JOB, *(SMALL if args.small else []), *extra]
    return {"record": record, "profile": profile, "compare": compare}[args.step](out, job)


if __name__ == "__main__":
    sys.exit(main())
