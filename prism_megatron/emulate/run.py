"""Hybrid emulation: sandbox ranks run for real, every other rank is replayed from the captured graph.

`Emulation` runs the training job as the chosen sandbox ranks of the virtual world (P processes, one
per sandbox; sandboxes that share a group exchange real data over gloo/NCCL, ghosts contribute data by
the ghost policy), records each sandbox's own iteration (its real compute on the device clock, its
communication, its memory), and replays the whole job with the DES: the sandboxes' recorded graphs
take their ranks' places and every ghost runs its role's captured graph. Because the replay is one
simulation of all N ranks, a ghost peer arrives when its own graph says, a collective ends when its
last member (sandbox or ghost) arrives plus its modelled duration, and a late sandbox delays its
ghost peers exactly as a late real rank would. That is the virtual clock: nothing is slept, the
iteration time is computed.

Pruning: the DES keeps ghosts in equivalence classes; the sandboxes split off only the classes of
ranks whose groups see a sandbox (sim/classes.py), so the classes stay O(peers), not O(N). The
summary reports N, the sandboxes, the direct-peer ghosts (emulate/sandbox.py) and the classes.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from prism_megatron import procs
from prism_megatron.config.job import TrainingJob
from prism_megatron.config.schema import ConfigError, TrainConfig
from prism_megatron.emulate.holds import Hold, holds, write_plan
from prism_megatron.emulate.sandbox import direct_peers, resolve_sandbox
from prism_megatron.graph import load_graph
from prism_megatron.graph.check import GraphFileError
from prism_megatron.graph.model import ExecutionGraph, RoleGraph, StringTable
from prism_megatron.sim.cluster import ClusterConfig
from prism_megatron.sim.des import Simulator
from prism_megatron.sim.report import job_figures
from prism_megatron.comm import native
from prism_megatron.trace.iterations import HOST_BOUND_WARN_SHARE, durations_path, read_durations
from prism_megatron.util import atomic_write_text, free_port, job_env

RANK_TIMES_UP_TO = 4096  # the summary lists every rank's iteration time up to this many ranks
MEASURED_FAULT_THRESHOLD = 0.01  # realtime compute off by more than this: a measured fault profile
OWN_ITERATIONS_UP_TO = 16  # iterations replayed one by one per run for the realtime check (a replay each)


class EmulationFailed(RuntimeError):
    """The sandbox job failed; the message names its log."""


@dataclass
class Emulation:
    """One emulation of the job captured in `graph_path` (see the module docstring)."""

    graph_path: str
    out_dir: str
    sandbox: list[str]
    """Virtual ranks or role names (emulate/sandbox.py)."""
    cluster: ClusterConfig
    calibration: Optional[object] = None
    device: Optional[str] = None
    """Where sandboxes run (default: the device the graph was captured for)."""
    script_tokens: Optional[list[str]] = None
    """`SCRIPT ARGS` the sandboxes run instead of the job the graph was captured from (the same job
    elsewhere: another checkout, another machine's paths); None: the graph's job (config/job.py)."""
    timeout_s: float = 3600.0
    trace_ranks: list[int] = field(default_factory=list)
    """Ranks whose simulated timeline goes to `<out>/emulation.trace.json` (default: the sandboxes)."""
    clock: str = "virtual"
    """virtual: the iteration time is computed; realtime: then the sandboxes run again with their
    communication held as the replay says (`<out>/delay_plan.json`, emulate/holds.py), and their
    measured wall-clock iteration is reported beside the virtual figure."""
    pace: Optional[bool] = None
    """Run the sandboxes with each collective holding the device stream as a ghost-only replay says
    (emulate/holds.py; default: on GPU where the native backend was built with nvcc). A real rank's
    host keeps launching while its NCCL kernel waits; a sandbox whose collectives end at once has no
    such slack, and in a launch-bound job its measured compute then includes device idle the real
    job does not have. Nothing changes
    on CPU (a sleep there holds the host too), and the iteration time is still computed."""
    faults: Optional[str] = None
    """Fault specs (faults/spec.py) injected into the job: ghosts they name are replayed slowed, their
    links and stalls act in every replay, and a sandbox they name slows its own compute for real
    (faults/inject.py), so its measured compute already holds the fault."""
    _timed: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    """rank -> the iteration (0-based) whose durations its sandbox graph holds (trace/recorder.py)."""
    _meta: dict[int, dict] = field(default_factory=dict, init=False, repr=False)
    """rank -> its sandbox graph's meta (how it was recorded)."""

    def check(self) -> ExecutionGraph:
        """The graph, once the sandboxes and faults are known to name ranks of its world (ConfigError
        otherwise); nothing is written. `run` begins with it."""
        graph = load_graph(self.graph_path)
        resolve_sandbox([s for s in self.sandbox if s != "slowest"] or ["first-stage"], graph, None)
        self._simulator(graph, self.cluster.cost_model(self.calibration), [])
        return graph

    def run(self) -> dict:
        start = time.perf_counter()
        graph = self.check()
        out = Path(self.out_dir)
        cost = self.cluster.cost_model(self.calibration)
        times = None
        if "slowest" in self.sandbox:
            times = self._simulator(graph, cost, []).run().rank_times()
        ranks = resolve_sandbox(self.sandbox, graph, times)
        text = str(graph.meta.get("config", ""))
        device = self.device or _device_of(text)
        paced = self.pace if self.pace is not None else (device == "cuda" and native.cuda_built())
        if device == "cuda" and (paced or self.clock == "realtime") and not native.cuda_built():
            raise ConfigError("pacing and the realtime clock on GPU hold the stream with prism's CUDA kernel, "
                              "and its native backend was built without nvcc: set CUDA_HOME to the CUDA "
                              f"toolkit and remove {native.build_dir()} to rebuild it, or run with --pace off "
                              "and --clock virtual")
        job = text = _with_faults(_with_script(text, self.script_tokens), self.faults)
        (out / "sandbox").mkdir(parents=True, exist_ok=True)  # every input checked: the work begins
        if paced:  # the ghost-only replay's holds: what a collective of this rank lasts at scale
            first = self._simulator(graph, cost, []).run(causes=True)
            job = _with_holds(text, {r: holds(first, r, graph.roles[graph.world.role(r)]) for r in ranks},
                              out / "pace_plan.json")
        measured = self._run_sandbox(job, ranks, out / "sandbox")
        merged, rank_graphs = _with_sandbox(graph, measured)
        sim = self._simulator(merged, cost, ranks, rank_graphs=rank_graphs)
        result = sim.run(tuple(sorted({*(self.trace_ranks or ranks), *ranks})),
                         causes=self.clock == "realtime")
        world = graph.world
        figures = job_figures(result.iteration_s, world.world_size, str(graph.meta.get("config", "")),
                              self.cluster)
        class_times = result.rank_times()
        overhead = {r: _overhead(out / "sandbox" / f"summary{r}.json", measured[r], result.sim_wall_s,
                                 self._timed[r]) for r in ranks}
        summary = {
            **figures, "ranks": world.world_size, "sandbox_count": len(ranks),
            "physical_fraction": len(ranks) / world.world_size,
            "materialized_ghosts": len(direct_peers(graph, ranks)), "classes": len(result.classes),
            "sim_wall_s": round(result.sim_wall_s, 4), "cluster": self.cluster.name, "faults": self.faults,
            "clock": "virtual", "paced": paced, "compute_durations_from": graph.meta.get("device", "?"),
            "capture_host_bound_share": _capture_share(graph.meta),
            "sandbox": [{"virtual_rank": r, "iteration_time_s": float(class_times[r]),
                         "timed_iteration": self._timed[r] + 1,
                         "recorded_iteration_s": _span_s(measured[r]),
                         "peak_allocated_bytes": int(measured[r].peak_bytes),
                         "peak_reserved_bytes": int(measured[r].peak_reserved_bytes),
                         "memory_source": measured[r].memory_source, **overhead[r],
                         **_host_bound(self._meta.get(r, {}))} for r in ranks],
            "wall_s": round(time.perf_counter() - start, 2), "graph_path": str(self.graph_path)}
        if world.world_size <= RANK_TIMES_UP_TO:  # as each rank's own log shows them: back to back
            summary["rank_iteration_time_s"] = [float(t) for t in sim.rank_periods(result)]
        if self.clock == "realtime":
            summary["clock"] = "realtime"
            self._realtime(text, ranks, out, result, merged, rank_graphs, summary)
        if result.timelines:
            from prism_megatron.graph.perfetto import write_chrome_trace

            trace = out / "emulation.trace.json"
            write_chrome_trace(merged, sorted(result.timelines), str(trace), times=result.timelines,
                               source="emulated", rank_graphs=rank_graphs)
            summary["perfetto"] = str(trace)
        atomic_write_text(str(out / "emulation.json"), json.dumps(summary, indent=1))
        return summary

    def _simulator(self, graph: ExecutionGraph, cost, sandboxes: list[int], **kw) -> Simulator:
        """A replay with the injected faults; compute faults of sandboxes whose measured compute
        holds them (`sandboxes`) are not applied twice."""
        if not self.faults:
            return Simulator(graph, cost, **kw)
        from prism_megatron.faults.spec import FaultError, FaultSet

        world = graph.world
        try:
            p = FaultSet.parse(self.faults, world.world_size, world.gpus_per_node).at(0, 0.0)
        except FaultError as err:
            raise ConfigError(f"faults: {err}") from None
        compute = {r: f for r, f in p.compute.items() if r not in sandboxes}
        return Simulator(graph, cost, slowdown=compute, link_slowdown=p.link, start_s=p.start_s, **kw)

    def _realtime(self, text: str, ranks: list[int], out: Path, result, first: ExecutionGraph,
                  rank_graphs: dict, summary: dict) -> None:
        """Run the sandboxes again, each communication held as the replay says (emulate/holds.py:
        closed-loop, so a sandbox that runs early or late meets its ghosts where real peers would);
        report their wall-clock time, and the replay of the job with the compute they recorded under
        that duty cycle (a device fed by a host that could run ahead during the holds, as a real
        rank's host does during its collectives; the replay ignores the recorded length of a
        communication node, so the holds are not counted twice)."""
        job = _with_holds(text, {r: holds(result, r, rank_graphs[r]) for r in ranks}, out / "delay_plan.json")
        pooled: dict[int, list[int]] = {}
        measured = self._run_sandbox(job, ranks, out / "realtime", pooled)
        graph = load_graph(self.graph_path)
        merged, again = _with_sandbox(graph, measured)
        replay = self._simulator(merged, self.cluster.cost_model(self.calibration), ranks,
                                 rank_graphs=again).run()
        times = replay.rank_times()
        summary["realtime_replay_iteration_s"] = float(replay.iteration_s)
        # iteration by iteration: each pooled iteration's wall against the replay of its own compute,
        # in the realtime run and in the paced first run (a host that stalls now and then puts a stall
        # in most iterations' walls, where the graph's median per node has none)
        own = {"realtime": self._iteration_replays(merged, again, out / "realtime"),
               "paced": self._iteration_replays(first, rank_graphs, out / "sandbox") if summary["paced"] else {}}
        measured_faults = []
        for row in summary["sandbox"]:
            r = row["virtual_rank"]
            run = json.loads((out / "realtime" / f"summary{r}.json").read_text())
            # the iterations whose durations the graph holds (pooled node by node): a host-bound job's
            # iterations differ by several percent, and the replay of the graph is their typical one
            walls = [run["iteration_times_ms"][j] * 1e-3 for j in pooled[r]]
            wall = float(np.median(walls))
            row["realtime_iteration_s"] = wall
            row["realtime_iterations_s"] = walls
            row["realtime_vs_virtual_pct"] = (wall / row["iteration_time_s"] - 1) * 100
            row["realtime_replay_iteration_s"] = float(times[r])
            # the holds' own check: the wall against the replay of this run's own compute
            row["realtime_vs_replay_pct"] = (wall / float(times[r]) - 1) * 100
            row["realtime_injected_waits"] = run.get("injected_waits")
            for name, rows in own.items():
                if rows.get(r):
                    row[f"{name}_own_iterations"] = rows[r]
                    row[f"{name}_vs_own_iterations_pct"] = float(np.median([x["err_pct"] for x in rows[r]]))
            bound = _host_bound(self._meta.get(r, {}))  # the realtime run's own (its graph's meta)
            if bound:
                row["realtime_host_bound"] = bound["host_bound"]
            # the sandbox's compute at the production duty cycle against its compute in the first run
            # (clocks, power and thermal state differ): a measured fault profile for the replay
            factor = _compute_s(again[r]) / max(_compute_s(rank_graphs[r]), 1e-12)
            row["realtime_compute_factor"] = factor
            if abs(factor - 1.0) > MEASURED_FAULT_THRESHOLD:
                measured_faults.append(f"slow({r}, {factor:.4f})")
        # `prism-megatron faults GRAPH --inject "<this>"` replays the job with what the sandboxes measured
        summary["measured_faults"] = "; ".join(measured_faults) or None

    def _iteration_replays(self, merged: ExecutionGraph, rank_graphs: dict[int, RoleGraph],
                           run_dir: Path) -> dict[int, list[dict]]:
        """rank -> per iteration the sandbox pooled its graph from (trace/recorder.py
        `iteration_durations`): {iteration (1-based), wall_s, replay_s, err_pct}, the replay taking
        that iteration's own durations for every sandbox. Empty where a sandbox kept none."""
        kept = {r: read_durations(str(run_dir / f"rank{r}.prism")) for r in rank_graphs}
        if any(k is None or k[1].shape[1] != rank_graphs[r].num_nodes for r, k in kept.items()):
            return {}  # none kept, or not of this graph
        common = sorted(set.intersection(*(set(its) for its, _ in kept.values())))
        if len(common) > OWN_ITERATIONS_UP_TO:  # a whole replay each: evenly spaced ones
            common = [common[round(k * (len(common) - 1) / (OWN_ITERATIONS_UP_TO - 1))]
                      for k in range(OWN_ITERATIONS_UP_TO)]
        walls = {r: json.loads((run_dir / f"summary{r}.json").read_text())["iteration_times_ms"]
                 for r in rank_graphs}
        cost = self.cluster.cost_model(self.calibration)
        out: dict[int, list[dict]] = {r: [] for r in rank_graphs}
        for it in common:
            graphs = {r: g.with_durations(kept[r][1][kept[r][0].index(it)]) for r, g in rank_graphs.items()}
            times = self._simulator(merged, cost, list(graphs), rank_graphs=graphs).run().rank_times()
            for r in graphs:
                wall, replay = walls[r][it - 1] * 1e-3, float(times[r])
                out[r].append({"iteration": it, "wall_s": wall, "replay_s": replay,
                               "err_pct": (wall / replay - 1) * 100})
        return out

    def _run_sandbox(self, text: str, ranks: list[int], out: Path,
                     pooled: Optional[dict[int, list[int]]] = None) -> dict[int, tuple]:
        if not text:
            raise ConfigError(f"{self.graph_path} holds no job config; capture it again with this version")
        timed: dict[int, int] = {}
        graphs = run_sandboxes(text, ranks, out, device=self.device or _device_of(text),
                               timeout_s=self.timeout_s, timed=timed, pooled=pooled, meta=self._meta)
        self._timed = timed
        return graphs


def run_sandboxes(config_yaml: str, ranks: list[int], out: Path, *, device: str,
                  timeout_s: float = 3600.0,
                  timed: Optional[dict[int, int]] = None,
                  pooled: Optional[dict[int, list[int]]] = None,
                  meta: Optional[dict[int, dict]] = None) -> dict[int, tuple]:
    """Run the job of `config_yaml` as sandbox ranks `ranks` (one process each, torchrun when more than
    one) with the recorder on; returns rank -> (its RoleGraph, the graph's strings). Writes
    `<out>/rank<R>.prism`, `<out>/summary<R>.json` and `<out>/run.log`. `timed` receives rank -> the
    index (0-based) of the iteration whose durations the graph holds (trace/recorder.py), `pooled`
    rank -> the indices of every iteration they were pooled from (the timed one alone if none), `meta`
    rank -> its graph's meta."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.yaml"
    job_cfg = yaml.safe_load(config_yaml)
    job_cfg.setdefault("trace", {})["keep_iterations"] = True  # the realtime check, iteration by iteration
    job_cfg.setdefault("train", {})["device"] = device
    atomic_write_text(str(config), yaml.safe_dump(job_cfg, sort_keys=False))
    job = TrainingJob.of(TrainConfig(**job_cfg["train"]))
    trace = out.resolve() / "rank{rank}.prism"
    for r in ranks:
        Path(str(trace).replace("{rank}", str(r))).unlink(missing_ok=True)
        Path(durations_path(str(trace).replace("{rank}", str(r)))).unlink(missing_ok=True)
    cmd = job.command(["--prism-config", str(config.resolve()), "--prism-sandbox-ranks", *map(str, ranks),
                       "--prism-trace-path", str(trace), "--prism-trace-selection", "node-median",
                       "--prism-summary-json", str(out.resolve() / "summary{rank}.json")],
                      nproc=len(ranks), master_port=free_port())
    env = job.env(job_env(cpu=device == "cpu"))
    log = out / "run.log"
    with open(log, "w") as handle:
        rc, lost = _run_job(cmd, handle, env, str(job.workdir), timeout_s, log)
    if lost:
        raise EmulationFailed(f"the sandbox job (ranks {ranks}) failed: {lost}; see {log}")
    if rc != 0:
        raise EmulationFailed(f"the sandbox job (ranks {ranks}) failed ({rc}); see {log}")
    graphs = {}
    for r in ranks:
        path = str(trace).replace("{rank}", str(r))
        try:
            g = load_graph(path, check=False)
        except GraphFileError as err:
            raise EmulationFailed(f"sandbox rank {r} wrote no usable graph ({err}); see {log}") from None
        graphs[r] = (g.graph_of(r), g.strings)
        index = int(g.meta.get("timed_iteration") or g.meta.get("iterations_run", 1) - 1) - 1
        if timed is not None:
            timed[r] = index
        if pooled is not None:
            pooled[r] = [int(j) - 1 for j in g.meta.get("pooled_iterations") or []] or [index]
        if meta is not None:
            meta[r] = dict(g.meta)
    return graphs


def _run_job(cmd: list[str], handle, env: dict, cwd: str, timeout_s: float, log: Path) -> tuple:
    """Run the sandbox job, its output to `handle` (the file `log`); (its exit status or "timeout",
    the line of a sandbox that found another one stopped or gone, or None). The job ends as soon as
    that line appears: the other sandboxes would wait for the stopped one, and torchrun gives a
    stopped worker its 30 s of SIGTERM grace before it kills it."""
    proc = procs.popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    mark = native.PEER_MARK.encode()
    seen, tail = 0, b""
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            with open(log, "rb") as reader:
                reader.seek(seen)
                fresh = reader.read()
            seen += len(fresh)
            *lines, tail = (tail + fresh).split(b"\n")
            lost = next((line for line in lines if mark in line), None)
            if lost is not None:
                procs.kill(proc)
                return "lost", _peer_line(lost)
            if time.monotonic() > deadline:
                procs.kill(proc)
                return "timeout", None
    except BaseException:
        procs.kill(proc)
        raise
    procs.wait(proc)
    lost = next((line for line in log.read_bytes().splitlines() if mark in line), None)
    return rc, _peer_line(lost) if lost is not None else None


def _peer_line(line: bytes) -> str:
    text = line.decode(errors="replace")
    return text[text.index(native.PEER_MARK):].strip()


def _with_script(config_yaml: str, tokens: Optional[list[str]]) -> str:
    """The job config with its script replaced by `tokens` (SCRIPT ARGS), read as `capture` reads
    them; the job's shape must stay the graph's (the sandbox graphs are checked against it)."""
    if not tokens:
        return config_yaml
    from prism_megatron.config.job import job_config
    from prism_megatron.config.loader import to_yaml

    base = yaml.safe_load(config_yaml)
    base["train"].update(script=None, script_args=[], workdir=None)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(base, handle, sort_keys=False)
    try:
        return to_yaml(job_config([], handle.name, tokens))
    finally:
        Path(handle.name).unlink(missing_ok=True)


def _with_faults(config_yaml: str, faults: Optional[str]) -> str:
    """The job config with `faults.inject` set (a faulted sandbox slows itself for real)."""
    if not faults:
        return config_yaml
    job = yaml.safe_load(config_yaml)
    job.setdefault("faults", {})["inject"] = faults
    return yaml.safe_dump(job, sort_keys=False)


def _with_holds(config_yaml: str, plans: dict[int, list[Optional[Hold]]], path: Path) -> str:
    """The job config with these per-rank holds (emulate/holds.py) injected (clock=realtime); the
    plan goes to `path`."""
    write_plan(path, plans)
    job = yaml.safe_load(config_yaml)
    job["emulation"].update(clock="realtime", delay_plan=str(path))
    return yaml.safe_dump(job, sort_keys=False)


def _with_sandbox(graph: ExecutionGraph, measured: dict) -> tuple[ExecutionGraph, dict[int, RoleGraph]]:
    """The captured graph with one string table that also holds the sandboxes' strings, and the
    sandboxes' graphs in it; `measured` becomes rank -> RoleGraph (remapped)."""
    table = StringTable(graph.strings)
    rank_graphs = {}
    for rank, (g, strings) in list(measured.items()):
        mapping = np.asarray([table(s) for s in strings], dtype="i4")
        rank_graphs[rank] = g.remap_strings(mapping)
        measured[rank] = rank_graphs[rank]
    merged = ExecutionGraph(world=graph.world, roles=graph.roles, strings=table.strings, meta=graph.meta)
    return merged, rank_graphs


def _overhead(summary_path: Path, g: RoleGraph, replay_s: float, timed: int) -> dict:
    """The emulator's own host time per iteration, the backend's operations in the recorded
    iteration, against the sandbox's compute in it; the backend's host time per operation (which does
    not depend on the model size); and the replay's time (the oracle, once per emulation).

    On a GPU the host time overstates what the emulation costs the rank when the device is the
    bottleneck: the host then runs ahead and waits inside its launches, in the backend as anywhere.
    `backend_device_s_per_iteration` is what the device spent from the operations' begin marks to
    their issue marks (the ghost folds, and any idle while it waited for the host to return from the
    backend). On CPU it is the host time between those marks: the backend's time before the begin
    mark and after the issue mark (its wrapper, the event) falls into the neighbouring compute
    segments. With a real peer (another sandbox) the real exchange is in both."""
    try:
        per_iteration = json.loads(summary_path.read_text()).get("backend_host_s_per_iteration") or []
    except (OSError, ValueError):
        return {}
    if not per_iteration:
        return {}
    backend_s = float(per_iteration[min(timed, len(per_iteration) - 1)])  # the iteration the graph timed
    compute_s = _compute_s(g)
    comm = g.columns["kind"] != 0
    ops = int(comm.sum())
    device_s = float(g.columns["duration_s"][comm].sum())
    return {"backend_host_s_per_iteration": backend_s, "comm_ops_per_iteration": ops,
            "backend_host_s_per_op": backend_s / ops if ops else 0.0, "replay_s": replay_s,
            "compute_s": compute_s,
            "overhead_ratio": backend_s / compute_s if compute_s > 0 else None,
            "backend_device_s_per_iteration": device_s,
            "device_overhead_ratio": device_s / compute_s if compute_s > 0 else None}


def _capture_share(meta: dict) -> Optional[dict]:
    """{"rank", "max", "warning"}: the captured rank whose compute most ended with its device waiting
    for the host (capture/run.py), that share, and whether it reaches HOST_BOUND_WARN_SHARE; None for
    a graph captured on host clocks."""
    shares = meta.get("host_bound_share") or {}
    if not shares:
        return None
    rank = max(shares, key=shares.get)
    return {"max": float(shares[rank]), "rank": int(rank),
            "warning": float(shares[rank]) >= HOST_BOUND_WARN_SHARE}


def _host_bound(meta: dict) -> dict:
    """`host_bound` of a sandbox graph recorded on a device clock (trace/recorder.py), with `warning`
    set where its share reaches HOST_BOUND_WARN_SHARE; {} on host clocks, where the host is the
    device."""
    figures = meta.get("host_bound")
    if not figures:
        return {}
    figures = dict(figures)
    figures["warning"] = figures.get("share", 0.0) >= HOST_BOUND_WARN_SHARE
    return {"host_bound": figures}


def _compute_s(g: RoleGraph) -> float:
    return float(g.columns["duration_s"][g.columns["kind"] == 0].sum())


def _span_s(g: RoleGraph) -> float:
    cols = g.columns
    return float((cols["start_s"] + cols["duration_s"]).max()) if len(cols["start_s"]) else 0.0


def _train_field(config_yaml: str, key: str, default: str) -> str:
    """`train.<key>` of a job config's YAML text (`default` when absent or unreadable)."""
    try:
        cfg = yaml.safe_load(config_yaml) or {}
        return str((cfg.get("train") or {}).get(key) or default)
    except (yaml.YAMLError, AttributeError):
        return default


def _device_of(config_yaml: str) -> str:
    return _train_field(config_yaml, "device", "cpu")
