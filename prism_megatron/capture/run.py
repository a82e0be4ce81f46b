"""`prism-megatron capture`: run each role as a slice, verify symmetries, merge the full-scale graph.

A slice is the training job as one sandbox rank of the virtual world with the recorder on (one
fresh process each, so device memory starts clean; `workers` at once, one GPU each where GPUs exist),
run by an executor (executors.py: local processes, submitit's SLURM or local executor, Ray).
Slices land in `<out>/slices/rank<R>.prism` and are kept: a rerun with the same config reuses every
slice that loads, and runs only what is missing. A slice that fails is retried once, then reported
(its log is kept next to it) and the capture fails without writing a graph.

Order: the probes of every class first (plan.py), then, for a class whose two probes disagree, the
rest of its roles. The merged graph is checked (DAG, every role present, collectives matching across
roles) before it is written atomically to `<out>/graph.prism`.

Under fake execution the two probes of a verified class ran the same program against the same
kernel-cost and host model, nothing of it measured on this CPU (runtime/fake.py): their durations are
equal node by node, however busy the machine was.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import yaml

from prism_megatron.capture.executors import ExecutorSpec, SliceJob, open_executor
from prism_megatron.capture.plan import RoleClass, plan_classes
from prism_megatron.config.job import TrainingJob
from prism_megatron.config.loader import to_yaml
from prism_megatron.config.schema import ConfigError, PrismConfig
from prism_megatron.graph.check import GraphFileError, check_graph
from prism_megatron.graph.io import load_graph, save_graph
from prism_megatron.graph.model import ExecutionGraph, RoleGraph, StringTable, structure_difference
from prism_megatron.trace.iterations import HOST_BOUND_WARN_SHARE
from prism_megatron.util import atomic_write_text, job_env
from prism_megatron.world import Role, VirtualWorld

class CaptureFailed(RuntimeError):
    """A slice failed twice; the message names it and its log."""


@dataclass
class Slice:
    role: Role
    rank: int
    path: Path
    reused: bool = False
    attempts: int = 0
    wall_s: float = 0.0
    graph: Optional[RoleGraph] = None
    strings: list[str] = field(default_factory=list)
    host_bound: Optional[dict] = None
    """How far the slice ran host-bound on a device clock (trace/recorder.py); None on host clocks."""
    device: str = "?"
    """Where the slice ran (`cuda`, `cpu`) and how: its recorder's meta, not a guess of the parent's."""
    execution: str = "?"


@dataclass
class CaptureResult:
    graph_path: str
    roles_total: int
    slices_run: int
    slices_reused: int
    retries: int
    roles_captured: list[str]
    roles_inferred: list[str]
    classes: list[dict]
    wall_s: float
    graph_bytes: int
    host_bound_share: dict[int, float] = field(default_factory=dict)
    """Captured rank -> the share of its compute that ended with its device waiting for the host
    (trace/iterations.py `host_bound`); empty on host clocks."""

    def summary(self) -> dict:
        return dict(self.__dict__, roles_captured=len(self.roles_captured),
                    roles_inferred=len(self.roles_inferred),
                    captured=self.roles_captured, inferred=self.roles_inferred)


def world_of(cfg: PrismConfig) -> VirtualWorld:
    p, e = cfg.parallel, cfg.emulation
    if e.virtual_world_size is None:
        raise ConfigError("capture needs a virtual world: set emulation.virtual_world_size=N "
                          "(--prism-virtual-world-size N)")
    return VirtualWorld(world_size=e.virtual_world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                        etp=p.etp, vpp=p.vpp, order=p.order, gpus_per_node=e.gpus_per_node)


def microbatches_of(cfg: PrismConfig, world: VirtualWorld) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * world.dp)


class _Progress:
    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total, self.done, self.start, self.stream = total, 0, time.perf_counter(), stream
        self.tty = stream.isatty()

    def grow(self, extra: int) -> None:
        self.total += extra

    def step(self, text: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        line = (f"capture [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} slices "
                f"| {elapsed:.0f}s elapsed, ETA {eta:.0f}s | {text}")
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


class Capture:
    """One capture of `cfg` into `out_dir` (see the module docstring)."""

    def __init__(self, cfg: PrismConfig, out_dir: str, *, workers: Optional[int] = None,
                 device: Optional[str] = None, executor: ExecutorSpec = ExecutorSpec(), timeout_s: float = 1800.0,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> None:
        """Every slice runs the config's job (`train.script`, else the built-in example of
        `train.framework`; config/job.py) under `prism-megatron launch`, on `executor`
        (executors.py); `workers` at once (default: local, the GPUs present, else 2; another
        executor, all of them)."""
        self.cfg, self.out = cfg, Path(out_dir)
        self.job = TrainingJob.of(cfg.train)
        self.world = world_of(cfg)
        self.microbatches = microbatches_of(cfg, self.world)
        self.device = device or cfg.train.device
        self.executor = executor
        gpus = _gpu_count() if self.device in ("cuda", "auto") and executor.kind == "local" else 0
        self.gpus = gpus
        self.workers = workers or (None if executor.kind != "local" else
                                   gpus if gpus else max(1, min(2, os.cpu_count() or 1)))
        self.timeout_s, self.log = timeout_s, log
        job = copy.deepcopy(cfg)  # what every slice runs: only its rank and trace path differ
        job.emulation.sandbox_ranks, job.trace.path, job.train.device = [], None, self.device
        job.faults.inject = None  # the graph is of the clean job: faults act in the replay
        self.config_text = to_yaml(job)
        self.job_key = _job_key(self.config_text)

    # -- slices --------------------------------------------------------------------------------

    def _prepare_dir(self) -> None:
        (self.out / "slices").mkdir(parents=True, exist_ok=True)
        marker = self.out / "config.yaml"
        if marker.exists() and _job_key(marker.read_text()) != self.job_key:
            raise ConfigError(f"{self.out} holds a capture of another config (see {marker}); choose "
                              "another --out directory or delete that one")
        atomic_write_text(str(marker), self.config_text)

    def _slice(self, role: Role) -> Slice:
        rank = self.world.representative(role)
        return Slice(role=role, rank=rank, path=self.out / "slices" / f"rank{rank}.prism")

    def _load(self, s: Slice) -> bool:
        try:
            g = load_graph(str(s.path), check=False)
        except GraphFileError:
            return False
        if _job_key(str(g.meta.get("config", ""))) != self.job_key or s.role not in g.roles:
            return False
        if _shape(g.world) != _shape(self.world):  # the script built other groups than the config says
            raise CaptureFailed(
                f"slice rank {s.rank}: the job built a world of {_shape(g.world)}, but the capture's "
                f"config says {_shape(self.world)}; give the script's parallel flags (or parallel.* "
                "overrides) that match what it builds")
        s.graph, s.strings = g.roles[s.role], g.strings
        ran = _microbatches_run(s.graph, s.strings)
        if ran is not None and ran != self.microbatches:
            raise CaptureFailed(
                f"slice rank {s.rank}: the job ran {ran} microbatches per iteration, but the capture's config "
                f"says {self.microbatches} (global batch {self.cfg.train.global_batch_size} / (micro batch "
                f"{self.cfg.train.micro_batch_size} x dp {self.world.dp})); give the script's "
                "--micro-batch-size and --global-batch-size (or train.* overrides) that it uses")
        s.host_bound = g.meta.get("host_bound")
        s.device, s.execution = str(g.meta.get("device", "?")), str(g.meta.get("execution", "?"))
        return True

    def _command(self, s: Slice) -> list[str]:
        config = self.out / "config.yaml"
        return self.job.command(["--prism-config", str(config.resolve()), "--prism-sandbox-ranks", str(s.rank),
                                 "--prism-trace-path", str(s.path.resolve()),
                                 "--prism-trace-selection", "node-median"])

    def _env(self, slot: int, remote: bool) -> dict:
        env = self.job.env(job_env(cpu=self.device == "cpu" if remote else not self.gpus))
        if self.gpus and not remote:  # a remote job's GPUs are its scheduler's to give
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)
        return env

    def _run_all(self, slices: list[Slice], progress: _Progress) -> None:
        """Run `slices` `workers` at a time on the executor; retry a failure once; raise after a second one."""
        queue = [s for s in slices]
        running: dict[int, tuple[SliceJob, Slice, float]] = {}
        slots = self.workers or len(queue)
        free = list(range(slots))
        executor = open_executor(self.executor, self.out / "jobs", gpus_per_slice=1 if self.device == "cuda" else 0)
        try:
            while queue or running:
                while queue and free:
                    s, slot = queue.pop(0), free.pop(0)
                    s.attempts += 1
                    if s.path.exists():
                        s.path.unlink()
                    job = executor.start(self._command(s), self._env(slot, executor.remote),
                                         str(self.job.workdir), s.path.with_suffix(".log"), slot)
                    running[slot] = (job, s, time.perf_counter())
                time.sleep(0.05)
                for slot, (job, s, t0) in list(running.items()):
                    rc = job.poll()
                    # another executor's job may wait in a queue: its time limit is the scheduler's
                    if rc is None and not executor.remote and time.perf_counter() - t0 > self.timeout_s:
                        job.kill()
                        rc = -9
                    if rc is None:
                        continue
                    del running[slot]
                    free.append(slot)
                    s.wall_s += time.perf_counter() - t0
                    if rc == 0 and self._load(s):
                        idle = (f", {s.host_bound['share']:.0%} of its compute ended with its device "
                                "waiting for the host" if s.host_bound else "")
                        progress.step(f"rank {s.rank} {s.role} in {s.wall_s:.1f}s{idle}")
                    elif s.attempts < 2:
                        self.log(f"capture: slice rank {s.rank} failed (exit {rc}); retrying once")
                        queue.append(s)
                    else:
                        raise CaptureFailed(
                            f"slice rank {s.rank} ({s.role}) failed twice (exit {rc}); see "
                            f"{s.path.with_suffix('.log')}")
        finally:
            for job, _, _ in running.values():
                job.kill()
            executor.close()

    # -- the capture ---------------------------------------------------------------------------

    def run(self) -> CaptureResult:
        start = time.perf_counter()
        self._prepare_dir()
        classes = plan_classes(self.world, self.microbatches)
        slices: dict[Role, Slice] = {}

        def want(roles) -> list[Slice]:
            fresh = []
            for role in roles:
                if role in slices:
                    continue
                s = slices[role] = self._slice(role)
                if self._load(s):
                    s.reused = True
                else:
                    fresh.append(s)
            return fresh

        todo = want([r for c in classes for r in c.probes])
        progress = _Progress(len(todo))
        self._run_all(todo, progress)
        verdicts = {}
        for c in classes:
            verdicts[c.key] = self._verify(c, slices)
        rest = want([r for c in classes if not verdicts[c.key] for r in c.roles])
        if rest:
            progress.grow(len(rest))
            self._run_all(rest, progress)
        progress.close()
        graph, inferred = self._merge(classes, slices, verdicts)
        check_graph(graph, str(self.out / "graph.prism"))
        path = str(self.out / "graph.prism")
        save_graph(graph, path)
        captured = [s for s in slices.values() if s.graph is not None]
        shares = _host_bound_shares(captured)
        warning = host_bound_warning(shares)
        if warning:
            self.log(warning)
        return CaptureResult(
            graph_path=path, roles_total=len(self.world.roles()),
            slices_run=sum(1 for s in captured if not s.reused),
            slices_reused=sum(1 for s in captured if s.reused),
            retries=sum(max(0, s.attempts - 1) for s in captured),
            roles_captured=[str(s.role) for s in captured], roles_inferred=inferred,
            classes=[{"key": c.key, "roles": len(c.roles), "probes": [str(r) for r in c.probes],
                      "symmetric": verdicts[c.key]} for c in classes],
            wall_s=round(time.perf_counter() - start, 3), graph_bytes=os.path.getsize(path),
            host_bound_share=shares)

    def _verify(self, c: RoleClass, slices: dict[Role, Slice]) -> bool:
        if len(c.roles) == 1:
            return True
        a, b = (slices[r] for r in c.probes)
        differ = structure_difference(a.graph, a.strings, b.graph, b.strings)
        if differ:
            self.log(f"capture: class {c.key}: {a.role} and {b.role} differ in {differ}; capturing all "
                     f"{len(c.roles)} roles of it")
        return differ is None

    def _merge(self, classes: list[RoleClass], slices: dict[Role, Slice],
               verdicts: dict[str, bool]) -> tuple[ExecutionGraph, list[str]]:
        table = StringTable()
        remapped: dict[Role, RoleGraph] = {}
        for role, s in slices.items():
            if s.graph is not None:
                mapping = np.asarray([table(x) for x in s.strings], dtype="i4")
                remapped[role] = s.graph.remap_strings(mapping)
        device, execution = _ran_on([s for s in slices.values() if s.graph is not None])
        roles: dict[Role, RoleGraph] = {}
        inferred: list[str] = []
        for c in classes:
            source = remapped[c.probes[0]]
            for role in c.roles:
                if role in remapped:
                    roles[role] = remapped[role]
                elif verdicts[c.key]:
                    shift = (role.pp - c.probes[0].pp) * (self.cfg.model.num_layers // self.world.pp)
                    roles[role] = source.as_role(role, self.world.representative(role),
                                                 f"inferred:{c.probes[0]}", layer_shift=shift)
                    inferred.append(str(role))
        meta = {"config": self.config_text, "microbatches": self.microbatches,
                "classes": {c.key: [str(r) for r in c.probes] for c in classes},
                "device": f"fake:{self.cfg.emulation.target_gpu}" if execution == "fake" else device,
                "execution": execution,
                "host_bound_share": {str(r): share for r, share in _host_bound_shares(
                    [s for s in slices.values() if s.graph is not None]).items()}}
        ordered = {r: roles[r] for r in self.world.roles()}
        return ExecutionGraph(world=self.world, roles=ordered, strings=table.strings, meta=meta), inferred


def _ran_on(slices: list[Slice]) -> tuple[str, str]:
    """The device and execution (real, fake) every slice reports having run with. The parent does not
    guess it: under `train.device=auto` a slice resolves its device itself (a GPU where one is
    visible), and a merge that assumed the CPU took a GPU capture for a fake one."""
    seen = {(s.device, s.execution) for s in slices}
    if len(seen) != 1:
        named = ", ".join(f"rank {s.rank}: {s.execution} on {s.device}" for s in slices)
        raise CaptureFailed(f"the slices ran on different devices or executions ({named}); capture "
                            "with one train.device and emulation.execution for every slice")
    return seen.pop()


def _host_bound_shares(slices: list[Slice]) -> dict[int, float]:
    """Rank -> the share of its compute that ended with its device waiting for the host, for the
    slices recorded on a device clock."""
    return {s.rank: float(s.host_bound["share"]) for s in slices if s.host_bound}


def host_bound_warning(shares: dict[int, float]) -> Optional[str]:
    """The capture's warning for the slices (rank -> share of compute that ended with the device
    waiting for the host) at or above HOST_BOUND_WARN_SHARE; None when there are none."""
    bound = sorted(r for r, share in shares.items() if share >= HOST_BOUND_WARN_SHARE)
    if not bound:
        return None
    named = ", ".join(f"rank {r} ({shares[r]:.0%})" for r in bound[:8])
    more = f" and {len(bound) - 8} more" if len(bound) > 8 else ""
    return (f"capture: WARNING host-bound slices: {named}{more} of their compute ended with the device "
            "waiting for the host; those durations hold this host's Python time and may be longer than "
            "on the production host: capture on a less loaded or faster host")


def _job_key(config_yaml: str) -> Optional[dict]:
    """A slice's config without what differs between slices (its rank, its trace path) or does not
    change the job (which recorded iteration becomes the graph, whether each iteration's durations
    are kept beside it, how long a sandbox waits for a stopped peer): slices captured before such a
    key existed stay reusable."""
    try:
        data = yaml.safe_load(config_yaml)
        data["emulation"].pop("sandbox_ranks", None)
        data["emulation"].pop("peer_timeout_s", None)
        data["trace"].pop("path", None)
        data["trace"].pop("selection", None)
        data["trace"].pop("keep_iterations", None)
    except (yaml.YAMLError, TypeError, KeyError, AttributeError):
        return None
    return data


def _microbatches_run(g: RoleGraph, strings: list[str]) -> Optional[int]:
    """Forward passes of the first model chunk in the recorded iteration (None: no spans)."""
    names = np.asarray([strings[int(i)] for i in g.spans["name"]])
    forward = (names == "forward") & (g.spans["chunk"] == 0)
    return int(forward.sum()) if forward.any() else None


def _shape(world: VirtualWorld) -> str:
    """The world's sizes, as the capture compares them (an expert TP size of None is the TP size)."""
    text = f"{world.world_size} ranks, TP{world.tp} PP{world.pp}"
    for name in ("cp", "ep"):
        if getattr(world, name) > 1:
            text += f" {name.upper()}{getattr(world, name)}"
    if (world.etp or world.tp) != world.tp:
        text += f" ETP{world.etp}"
    return text + (f" VPP{world.vpp}" if world.vpp else "") + f", ranks ordered {world.order}"


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def write_summary(result: CaptureResult, path: Optional[str]) -> None:
    if path:
        atomic_write_text(path, json.dumps(result.summary(), indent=1))
