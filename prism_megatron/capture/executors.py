"""Where a capture's slices run. A slice is one command (`prism-megatron launch -- SCRIPT ...` as one
sandbox rank) that writes its own graph file and log into the capture folder, so anything that can run
a command where that folder is visible can run it:

- `local` (the default): processes of this machine, `workers` at a time (procs.py: they die with it);
- `submitit_local`: one job of submitit's local executor per slice (what tests a SLURM setup here);
- `submitit_slurm`: one SLURM job per slice through submitit; the capture folder (and the code) must
  be on a filesystem the nodes share; options are submitit's (`partition=gpu`, `timeout_min=60`,
  `gpus_per_node=1`, `slurm_account=...`);
- `ray`: one Ray task per slice; `address=` the cluster to join (none: a local Ray), `num_cpus=`,
  `num_gpus=` per slice (default 1 CPU, and 1 GPU for `--device cuda`).

All but `local` start every slice at once unless `workers` says otherwise: the scheduler queues them.
A job the executor loses (a node failure, a SLURM timeout) counts as a failed slice, which the capture
retries once. Stopping the capture (an error, SIGTERM, Ctrl-C) cancels its jobs; a job on this machine
(submitit_local, a local Ray) also ends when the capture is SIGKILLed (`run_slice` watches it), a job
on another node runs on until its scheduler's time limit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import yaml

from prism_megatron import procs
from prism_megatron.config.schema import ConfigError

EXECUTORS = ("local", "submitit_local", "submitit_slurm", "ray")
LOST = 70
"""The exit status given to a slice whose job the executor lost (no exit status of its own)."""


@dataclass(frozen=True)
class ExecutorSpec:
    """Which executor runs the slices, and its options (typed scalars, as YAML reads them)."""

    kind: str = "local"
    options: tuple[tuple[str, object], ...] = ()

    @staticmethod
    def parse(kind: str, options: list[str]) -> "ExecutorSpec":
        """`kind` and `KEY=VALUE` strings (the command line's), checked; ConfigError if bad."""
        if kind not in EXECUTORS:
            raise ConfigError(f"executor {kind!r}: expected one of {', '.join(EXECUTORS)}")
        parsed = []
        for text in options:
            key, eq, value = text.partition("=")
            if not eq or not key.isidentifier():
                raise ConfigError(f"executor option {text!r}: expected KEY=VALUE (e.g. partition=gpu)")
            parsed.append((key, yaml.safe_load(value) if value else ""))
        if kind == "local" and parsed:
            raise ConfigError(f"executor option {options[0]!r}: the local executor takes none "
                              "(--workers sets how many slices run at once)")
        if kind == "ray":
            unknown = [k for k, _ in parsed if k not in ("address", "num_cpus", "num_gpus")]
            if unknown:
                raise ConfigError(f"executor option {unknown[0]!r} for ray: expected address, num_cpus or num_gpus")
        return ExecutorSpec(kind, tuple(parsed))


class SliceJob(Protocol):
    def poll(self) -> Optional[int]:
        """The slice's exit status once it ended, else None."""

    def kill(self) -> None:
        """Stop it (if it still runs) and forget it."""


class Executor(Protocol):
    remote: bool
    """True when the slice may run on another machine (no local GPU slot is chosen for it)."""

    def start(self, command: list[str], env: dict, cwd: str, log_path: Path, slot: int) -> SliceJob:
        """Start one slice: `command` in `cwd` with `env`, its output into `log_path`."""

    def close(self) -> None:
        """Give back what the executor holds (a local Ray)."""


def check_executor(spec: ExecutorSpec) -> None:
    """ConfigError, before any work, if `spec`'s executor cannot run here: its package is not
    installed, or SLURM's sbatch is not on PATH."""
    if spec.kind.startswith("submitit_"):
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise ConfigError(f"executor {spec.kind}: submitit is not installed (pip install submitit)") from None
    if spec.kind == "submitit_slurm" and not _on_path("sbatch"):
        raise ConfigError("executor submitit_slurm: SLURM's sbatch is not on PATH here; run the capture "
                          "on a SLURM login node (the capture folder on a filesystem the nodes share)")
    if spec.kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("executor ray: ray is not installed (pip install 'ray[default]')") from None


def open_executor(spec: ExecutorSpec, folder: Path, *, gpus_per_slice: int) -> Executor:
    """The executor of `spec`; its own files (submitit's) under `folder`. ConfigError if it cannot
    start here (check_executor; an option it does not take)."""
    check_executor(spec)
    if spec.kind == "local":
        return _Local()
    if spec.kind.startswith("submitit_"):
        return _Submitit(spec, folder, gpus_per_slice)
    return _Ray(spec, gpus_per_slice)


def run_slice(command: list[str], env: dict, cwd: str, log_path: str,
              watch: Optional[tuple[str, int]] = None) -> int:
    """What a remote executor's job runs: the slice's command, its output into `log_path`; its exit
    status. `watch` (host, pid): the capture's process; on that host the slice is killed when the
    capture is gone, however it died."""
    with open(log_path, "w") as log:
        proc = procs.popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        if watch is not None and watch[0] == socket.gethostname():
            threading.Thread(target=_kill_when_gone, args=(watch[1], proc), daemon=True).start()
        return procs.wait(proc)


def _kill_when_gone(pid: int, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            procs.kill(proc)
            return
        except PermissionError:
            pass
        time.sleep(0.5)


def _watch() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


# -- local processes ---------------------------------------------------------------------------


class _LocalJob:
    def __init__(self, proc: subprocess.Popen, log) -> None:
        self.proc, self.log = proc, log

    def poll(self) -> Optional[int]:
        rc = self.proc.poll()
        if rc is not None:
            procs.wait(self.proc)  # reaped: off the list of children to kill
            self.log.close()
        return rc

    def kill(self) -> None:
        procs.kill(self.proc)
        self.log.close()


class _Local:
    remote = False

    def start(self, command, env, cwd, log_path, slot) -> SliceJob:
        log = open(log_path, "w")
        return _LocalJob(procs.popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd), log)

    def close(self) -> None:
        pass


# -- submitit (SLURM, or its local executor) ---------------------------------------------------


class _SubmititJob:
    def __init__(self, job, log_path: Path) -> None:
        self.job, self.log_path = job, log_path

    def poll(self) -> Optional[int]:
        if not self.job.done():
            return None
        try:
            return int(self.job.result())
        except Exception as err:  # noqa: BLE001 - submitit lost the job (node failure, timeout): say why
            with open(self.log_path, "a") as log:
                log.write(f"\nprism: the executor lost this slice's job {self.job.job_id}: "
                          f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]}\n")
            return LOST

    def kill(self) -> None:
        if not self.job.done():
            self.job.cancel(check=False)


class _Submitit:
    remote = True

    def __init__(self, spec: ExecutorSpec, folder: Path, gpus_per_slice: int) -> None:
        import submitit

        cluster = spec.kind.removeprefix("submitit_")
        self.executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
        params = {"timeout_min": 60, "name": "prism-slice"}
        if gpus_per_slice:
            params["gpus_per_node"] = gpus_per_slice
        params.update(dict(spec.options))
        try:
            self.executor.update_parameters(**params)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"executor {spec.kind}: {err}".splitlines()[0]) from None

    def start(self, command, env, cwd, log_path, slot) -> SliceJob:
        job = self.executor.submit(run_slice, command, env, cwd, str(log_path), _watch())
        return _SubmititJob(job, log_path)

    def close(self) -> None:
        pass


def _on_path(program: str) -> bool:
    return any(os.access(os.path.join(d, program), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep) if d)


# -- Ray ---------------------------------------------------------------------------------------


class _RayJob:
    def __init__(self, ray, ref, log_path: Path) -> None:
        self.ray, self.ref, self.log_path = ray, ref, log_path

    def poll(self) -> Optional[int]:
        done, _ = self.ray.wait([self.ref], timeout=0)
        if not done:
            return None
        try:
            return int(self.ray.get(self.ref))
        except Exception as err:  # noqa: BLE001 - Ray lost the task (a node died): say why
            with open(self.log_path, "a") as log:
                log.write(f"\nprism: Ray lost this slice's task: {type(err).__name__}\n")
            return LOST

    def kill(self) -> None:
        self.ray.cancel(self.ref, force=True)


class _Ray:
    remote = True

    def __init__(self, spec: ExecutorSpec, gpus_per_slice: int) -> None:
        import ray

        options = dict(spec.options)
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            ray.init(address=options.get("address"), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        self.task = ray.remote(run_slice).options(num_cpus=options.get("num_cpus", 1),
                                                  num_gpus=options.get("num_gpus", gpus_per_slice),
                                                  max_retries=0)

    def start(self, command, env, cwd, log_path, slot) -> SliceJob:
        return _RayJob(self.ray, self.task.remote(command, env, cwd, str(log_path), _watch()), log_path)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
