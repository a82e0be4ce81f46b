"""The program's own host time per module class: measured on the GPU machine's host, added by fake
execution.

Fake execution models the host as the GPU host's launch time per op (`host_launch_s`, a quarter of
it per view); it measures nothing of the host here, so that a prediction does not depend on this
CPU or its load. The launch figure alone misses the Python that module code runs between its ops: on the H200 machine's host, host-bound tiny jobs take 1.04 s (MoE) and
0.36 s (dense) per iteration where launches alone give far less, short mostly in the forward
pass, whose ops are issued from megatron's module code (the backward's come from the autograd
engine in C++). This VM cannot measure that Python itself: here every metadata call of it goes
through the CPU runtime's function mode and costs several times what it costs on the GPU host.

So it is measured where it runs, per module class, as the kernel table is measured per op:

- `ModuleStack` keeps, with global forward hooks, which module's forward is running (the innermost);
  timed, it also collects every call's *exclusive* wall time (its own code, not its children's).
- `prism-megatron calibrate --host-modules --out CAL` (on the GPU machine) runs host-bound jobs
  (`HOST_JOBS`) twice: for real on the GPU, timed; and under fake execution, counting each class's
  own ops (kernels and views). `module_table` turns the two
  into the modelled host time the model lacks: per op of the class (spread over its ops, as Python
  runs between them), or per call for a class that issues no op of its own.
- Under fake execution (`hooks/fake.py`) the stack tells the `CostClock` which class's figure to add
  per op.

The figures are the target host's seconds: nothing of them is measured on the CPU that runs fake
execution. `calibrate --host-modules --recount` keeps a table's real figures and counts the ops again
on any machine, for when what fake execution counts or charges changes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = ["HOST_JOBS", "ModuleStack", "calibrate_host_modules", "module_key", "module_table"]

HOST_JOBS = {
    "dense-tiny": ["model.num_layers=8", "model.hidden_size=256", "model.num_attention_heads=4",
                   "model.seq_length=256", "model.vocab_size=32000", "model.params_dtype=bf16",
                   "train.micro_batch_size=1", "train.global_batch_size=16", "train.iters=8"],
}
"""Jobs whose GPU work is negligible, so that a real iteration is the host's time: the [D] GPT and
MoE programs at hidden 256 and sequence 256 (overrides of the default config)."""
HOST_JOBS["moe-tiny"] = HOST_JOBS["dense-tiny"] + ["model.num_experts=4", "model.moe_router_topk=2",
                                                    "moe.imbalance=zipf(1.2)"]
ENV = "PRISM_MODULE_HOST"
"""A training process with this set to a path writes its per-module figures there at exit (timed
when it runs for real, counted under fake execution)."""
WINDOW_ENV = "PRISM_MODULE_HOST_WINDOW"
"""The outermost module call (0-based) from which that process counts: the first forward of the
first iteration measured."""
OUTSIDE = "<outside modules>"
"""The table's row for what runs outside every module's forward: the backward (issued by the autograd
engine), the optimizer step, the schedule. One of its "calls" is one iteration."""
FORMAT = "prism-module-host/1"


_KEYS: dict[type, str] = {}


def module_key(module: torch.nn.Module) -> str:
    """`package.module.Class` of a module (made once per class: the stack asks at every call)."""
    cls = type(module)
    key = _KEYS.get(cls)
    if key is None:
        key = _KEYS[cls] = f"{cls.__module__}.{cls.__qualname__}"
    return key


class ModuleStack:
    """Which module's forward runs now, from global forward hooks (see module docstring).

    `on_change(key, entered)` is called with the innermost module's key after every entry (`entered`
    True) and exit (False; None: outside every module). Calls are counted, and timed when `timed`,
    from the `window_root`-th outermost call on (0-based; the iterations before it warm up caches and
    lazy state), when `on_window()` is called once. Timed: each call's exclusive wall seconds go to `durations[key]`
    (a child's call counts in its parent's time as the child's wall time plus `hook_s`, what these
    hooks themselves add around it), and the outermost calls' wall seconds add up in `root_s`."""

    def __init__(self, on_change: Optional[Callable[[Optional[str], bool], None]] = None,
                 timed: bool = False, hook_s: float = 0.0, window_root: int = 0,
                 on_window: Optional[Callable[[], None]] = None) -> None:
        self.on_change = on_change
        self.timed = timed
        self.hook_s = hook_s
        self.window_root = window_root
        self.on_window = on_window
        self.roots = 0
        """Outermost calls so far (one per microbatch's forward in a training step)."""
        self.root_s = 0.0
        self.calls: dict[str, int] = {}
        self.durations: dict[str, list[float]] = {}
        self._open = False
        self._stack: list[list] = []  # [key, start_s, children_s]
        self._handles: list = []

    @property
    def current(self) -> Optional[str]:
        return self._stack[-1][0] if self._stack else None

    def install(self) -> "ModuleStack":
        from torch.nn.modules import module as nn_module

        self._handles = [nn_module.register_module_forward_pre_hook(self._enter),
                         nn_module.register_module_forward_hook(self._exit, always_call=True)]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        key = module_key(module)
        if not self._stack:
            if self.roots == self.window_root:
                self._open = True
                if self.on_window is not None:
                    self.on_window()
            self.roots += 1
        if self._open:
            self.calls[key] = self.calls.get(key, 0) + 1
        self._stack.append([key, time.perf_counter() if self.timed else 0.0, 0.0])
        if self.on_change is not None:
            self.on_change(key, True)

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        key, start, children = self._stack.pop()
        if self.timed and self._open:
            wall = time.perf_counter() - start
            self.durations.setdefault(key, []).append(wall - children)
            if self._stack:
                self._stack[-1][2] += wall + self.hook_s
            else:
                self.root_s += wall
        if self.on_change is not None:
            self.on_change(self.current, False)


def hook_overhead_s(calls: int = 2000, repeats: int = 5) -> float:
    """Seconds the timed stack adds to one module call (an empty module, with and without it; the
    fastest of `repeats`): what a parent's exclusive time holds for each child call beyond the
    child's own wall time."""
    class Empty(torch.nn.Module):
        def forward(self, x):
            return x

    empty = Empty()

    def loop() -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                empty(None)
            best = min(best, (time.perf_counter() - start) / calls)
        return best

    plain = loop()
    stack = ModuleStack(timed=True).install()
    try:
        hooked = loop()
    finally:
        stack.remove()
    return max(hooked - plain, 0.0)


def module_table(real: dict, counted: dict, launch_s: float) -> dict:
    """The host seconds per op (or per call) each module class lacks in the fake model.

    `real`: key -> {"calls", "mean_s"} (exclusive wall seconds per call on the GPU host, over the
    measured iterations). `counted`: key -> {"calls", "kernels", "views"} of the same job under fake
    execution (its own ops). The model charges a call `(kernels * launch_s + views * launch_s / 4) /
    calls`; what the real call
    took beyond that is spread over the call's ops, or added per call where it has none. Never
    negative: the model is not made faster than it is. Classes seen in only one of the two runs are
    left out. `OUTSIDE` is a row like the others (a call: an iteration)."""
    table = {}
    for key in sorted(set(real) & set(counted)):
        r, c = real[key], counted[key]
        if not c["calls"]:
            continue
        modelled = (c["kernels"] * launch_s + c["views"] * launch_s / 4) / c["calls"]
        ops = (c["kernels"] + c["views"]) / c["calls"]
        missing = max(r["mean_s"] - modelled, 0.0)
        row = {"per_op_s": missing / ops if ops >= 1 else 0.0, "per_call_s": 0.0 if ops >= 1 else missing,
               "real_s_per_call": r["mean_s"], "modelled_s_per_call": modelled, "ops_per_call": ops,
               "calls": c["calls"], "kernels": c["kernels"], "views": c["views"]}
        table[key] = row
    return table


def real_figures(stack: ModuleStack) -> dict:
    """key -> calls and the mean and median exclusive seconds per call over the measured window (the
    mean is what an iteration adds up; collector pauses included, as a GPU host has them too)."""
    return {key: {"calls": len(d), "mean_s": statistics.fmean(d), "median_s": statistics.median(d)}
            for key, d in stack.durations.items() if d}


def write_figures(path: str, figures: dict, **meta: Any) -> None:
    from prism_megatron.util import atomic_write_text

    atomic_write_text(path, json.dumps({"format": FORMAT, **meta, "modules": figures}, indent=1))


def _run_job(args: list[str], env_path: Path, log_path: Path, device: str, window_root: int) -> dict:
    from prism_megatron import procs
    from prism_megatron.util import job_env

    env = job_env(cpu=False, **{ENV: str(env_path), WINDOW_ENV: str(window_root)})
    if device == "cpu":  # the CPU runtime runs only where no GPU is visible
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env_path.unlink(missing_ok=True)  # a kept folder's earlier output is not this job's
    with open(log_path, "w") as handle:
        rc = procs.run([sys.executable, *args], stdout=handle, stderr=subprocess.STDOUT, env=env)
    if rc != 0 or not env_path.is_file():
        raise RuntimeError(f"host calibration job failed ({rc}); see {log_path}")
    return json.loads(env_path.read_text())


def calibrate_host_modules(calibration_path: str, jobs: Optional[dict[str, list[str]]] = None,
                           log: Callable[[str], None] = print, keep: Optional[str] = None,
                           device: str = "cuda", recount: bool = False) -> dict:
    """Measure `jobs` (name -> config overrides; default `HOST_JOBS`) here, real on `device` and then
    fake on this CPU, and add the module table to the kernel calibration at `calibration_path` (made
    by `calibrate --kernels` on this machine: its launch figure is the model's). Returns the table.
    `keep`: a folder for the jobs' files (default: a new temporary one). `recount`: no real run; the
    real figures are the table's own (measured on its GPU machine), only the fake counts are made
    again here (for when what fake execution counts or charges changes)."""
    from prism_megatron.config.job import example_for
    from prism_megatron.config import load_config
    from prism_megatron.config.loader import to_yaml
    from prism_megatron.util import atomic_write_text

    try:
        with open(calibration_path) as f:
            calibration = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{calibration_path}: cannot read a kernel calibration ({err}); make one here with "
                         f"`prism-megatron calibrate --kernels --out {calibration_path}`") from None
    is_kernels = isinstance(calibration, dict) and calibration.get("format") == "prism-kernels/1"
    launch_s = calibration.get("host_figures", {}).get("host_launch_s") if is_kernels else None
    if not launch_s:
        raise ValueError(f"{calibration_path}: not a kernel calibration with host figures; make one here "
                         f"with `prism-megatron calibrate --kernels --out {calibration_path}` first")
    previous = calibration.get("host_modules") if recount else None
    if recount and not (previous or {}).get("modules"):
        raise ValueError(f"{calibration_path}: no module table to recount; make one on the GPU machine with "
                         f"`prism-megatron calibrate --host-modules --out {calibration_path}`")
    if device == "cuda" and not recount:  # the launch figure is this host's too: the table is the rest
        import torch

        from prism_megatron.kernels.calibrate import host_figures

        before = {k: v for k, v in calibration["host_figures"].items() if k != "previous"}
        calibration["host_figures"].update(host_figures(torch), previous=before)
        launch_s = calibration["host_figures"]["host_launch_s"]
        log(f"host figures here: launch {launch_s * 1e6:.1f} us (was {before['host_launch_s'] * 1e6:.1f})")
    script = str(example_for("megatron"))
    work = Path(keep or tempfile.mkdtemp(prefix="prism-host-"))
    work.mkdir(parents=True, exist_ok=True)
    # the fake jobs read this host's launch figures from a copy: the calibration itself is replaced
    # once, at the end, so a failed job leaves it as it was (its table and figures together)
    target = work / "calibration.json"
    atomic_write_text(str(target), json.dumps(calibration))
    real_all: dict = {}
    counted_all: dict = {}
    runs = {}
    for name, overrides in (jobs or HOST_JOBS).items():
        cfg = load_config([*overrides, "emulation.sandbox_ranks=[]", f"train.device={device}"])
        real_cfg = work / f"{name}-real.yaml"
        real_cfg.write_text(to_yaml(cfg))
        fake = load_config(["emulation.virtual_world_size=1", "emulation.execution=fake", "train.device=cpu",
                            f"emulation.target_gpu={target.resolve()}", "train.iters=3"],
                           str(real_cfg))
        fake_cfg = work / f"{name}-fake.yaml"
        fake_cfg.write_text(to_yaml(fake))
        iters, skip = cfg.train.iters, max(cfg.train.iters // 4, 1)
        if iters < 2:
            raise ValueError(f"host calibration job {name}: train.iters={iters}; expected 2 or more (the "
                             "first iterations warm up and are not measured)")
        micro = cfg.train.global_batch_size // cfg.train.micro_batch_size  # one GPU: no data parallelism
        if previous is None:
            real = _real_job(name, script, real_cfg, work, device, skip, micro, log)
            runs[name] = real.pop("run")
            _pool(real_all, real["modules"], ("calls",), "mean_s")
        log(f"host calibration {name}: fake run (cpu), iterations 2-{fake.train.iters} counted")
        counted = _run_job([script, "--prism-config", str(fake_cfg), "--prism-sandbox-ranks", "0",
                            "--device", "cpu"], work / f"{name}-fake.json", work / f"{name}-fake.log", "cpu",
                           micro)
        counted["modules"].get(OUTSIDE, {})["calls"] = fake.train.iters - 1
        _pool(counted_all, counted["modules"], ("calls", "kernels", "views"), None)
    if previous is not None:  # the real side as measured: calls and seconds per call of each class
        runs = previous["jobs"]
        real_all = {key: {"calls": row["calls"], "mean_s": row["real_s_per_call"]}
                    for key, row in previous["modules"].items()}
    table = module_table(real_all, counted_all, launch_s)
    measured = previous or {"host": os.uname().nodename, "date": time.strftime("%Y-%m-%d")}
    calibration["host_modules"] = {"jobs": runs, "host": measured["host"], "date": measured.get("date"),
                                   "modules": table}
    atomic_write_text(calibration_path, json.dumps(calibration))
    log(f"host calibration: {len(table)} module classes -> {calibration_path}")
    return table


def _real_job(name: str, script: str, real_cfg: Path, work: Path, device: str, skip: int, micro: int,
              log: Callable[[str], None]) -> dict:
    """One host job run for real on `device`, timed per module class from iteration `skip + 1` on:
    {"modules": key -> calls and seconds per call, "run": the iterations' figures}."""
    log(f"host calibration {name}: real run ({device}), iterations {skip + 1} on measured")
    summary = work / f"{name}-real-summary.json"
    real = _run_job([script, "--prism-config", str(real_cfg), "--device", device, "--prism-summary-json",
                     str(summary)], work / f"{name}-real.json", work / f"{name}-real.log", device,
                    skip * micro)
    try:
        times_s = [t / 1e3 for t in json.loads(summary.read_text())["iteration_times_ms"][skip:]]
    except (OSError, ValueError, KeyError):
        raise RuntimeError(f"host calibration job {name} wrote no iteration times; see "
                           f"{work / (name + '-real.log')}") from None
    real["modules"][OUTSIDE] = {"calls": len(times_s), "mean_s": (sum(times_s) - real["root_s"]) / len(times_s)}
    real["run"] = {"hook_s": real.get("hook_s"), "real_iterations_s": times_s,
                   "real_forward_s_per_iteration": real["root_s"] / len(times_s)}
    return real


def _pool(into: dict, rows: dict, summed: tuple, weighted: Optional[str]) -> None:
    """Add one job's per-class rows to `into`: `summed` fields add up; `weighted` is averaged by calls."""
    for key, row in rows.items():
        have = into.get(key)
        if have is None:
            into[key] = dict(row)
            continue
        if weighted:
            total = have["calls"] + row["calls"]
            have[weighted] = (have[weighted] * have["calls"] + row[weighted] * row["calls"]) / total
        for field_ in summed:
            have[field_] += row[field_]
