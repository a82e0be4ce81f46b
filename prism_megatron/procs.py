"""The processes this tool starts (capture slices, sandboxes, calibration jobs, torchrun) die with it.

Every child goes through `popen`/`run`/`call` here: it starts in a process group of its own, with the
kernel asked (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`) to kill it when this process dies, however it
dies, SIGKILL included. While this process can still act (a normal exit, an exception, SIGTERM, SIGHUP,
Ctrl-C), it kills each living child's whole group, so the child's own helpers go too. A process that
we start without a preexec hook (a torchrun worker, which torchrun puts in a session of its own; a
`torch.multiprocessing` worker) calls `die_with_parent` first thing.

Known limits: the death signal is Linux-only (elsewhere children are only killed by the group
cleanup, which SIGKILL of this process skips); it fires when the *thread* that started the child
ends, so a child must be waited for by the thread that started it (every caller here does); a
grandchild that is none of ours and leaves its process group (setsid) is beyond reach once its
parent is SIGKILLed.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Optional, Sequence

PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
_prctl = None
if _LINUX:
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    except (OSError, AttributeError):
        _prctl = None

CHILD_ENV = "PRISM_DIES_WITH_PARENT"
"""Set in a child's environment: a process of ours deeper down (a torchrun worker) that finds it calls
`die_with_parent` (`adopt`), and one that a user started directly (no variable) keeps living as before."""

_children: dict[int, subprocess.Popen] = {}
_lock = threading.RLock()  # an RLock: the signal handler may run while the main thread holds it
_exit_registered = False
_signals_installed = False
KILL_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""What this process takes as 'stop': its children's groups are killed, then it dies of the signal.
SIGINT raises KeyboardInterrupt as usual; the exit that follows kills the groups."""


def die_with_parent(parent_pid: Optional[int] = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; a no-op elsewhere).

    `parent_pid`: the parent this process was started by; if it is already gone (this process was
    reparented before the request took effect), this process exits at once."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def adopt() -> None:
    """First thing in a process of ours that a child of ours started without our preexec hook (a
    torchrun worker): die with that parent if this tool started the chain (`CHILD_ENV`). A worker
    whose parent is already gone (reparented to init) exits."""
    if os.environ.get(CHILD_ENV) == "1":
        die_with_parent()
        if os.getppid() == 1:
            os._exit(1)


def _child_setup(parent_pid: int) -> None:
    # Runs in the child between fork and exec: only pre-resolved calls, no imports, no locks.
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)


def popen(cmd: Sequence[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kwargs)` whose child dies with this process (module docstring)."""
    for key in ("preexec_fn", "process_group", "start_new_session"):
        if key in kwargs:
            raise TypeError(f"procs.popen sets {key} itself")
    _install_handlers()
    parent = os.getpid()
    kwargs["env"] = {**(os.environ if kwargs.get("env") is None else kwargs["env"]), CHILD_ENV: "1"}
    proc = subprocess.Popen(list(cmd), preexec_fn=lambda: _child_setup(parent), process_group=0, **kwargs)
    with _lock:
        _children[proc.pid] = proc
    return proc


def kill(proc: subprocess.Popen) -> int:
    """Kill `proc`'s process group (if `proc` is not reaped yet) and wait for it; its exit status."""
    with _lock:
        _children.pop(proc.pid, None)
    if proc.returncode is None:
        # not reaped: its pid, and so its group id, cannot belong to anyone else yet
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.wait()


def wait(proc: subprocess.Popen, timeout: Optional[float] = None) -> int:
    """`proc.wait(timeout)`; on a timeout (or any interruption) its group is killed before raising."""
    try:
        rc = proc.wait(timeout)
    except BaseException:
        kill(proc)
        raise
    with _lock:
        _children.pop(proc.pid, None)
    return rc


def run(cmd: Sequence[str], *, timeout: Optional[float] = None, **kwargs) -> int:
    """Run `cmd` to its end (as `subprocess.run`); its exit status. Past `timeout` seconds its group
    is killed and `subprocess.TimeoutExpired` raised."""
    return wait(popen(cmd, **kwargs), timeout)


call = run


def kill_all() -> None:
    """Kill the group of every child started here and not yet waited for."""
    with _lock:
        living = list(_children.values())
    for proc in living:
        kill(proc)


def _on_signal(signum, frame) -> None:
    kill_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """Kill the children on exit and on SIGTERM/SIGHUP (signal handlers can only be set from the main
    thread: `guard` sets them for children started by other threads; a handler someone else set is
    kept)."""
    global _exit_registered, _signals_installed
    with _lock:
        if not _exit_registered:
            atexit.register(kill_all)
            _exit_registered = True
    if _signals_installed or threading.current_thread() is not threading.main_thread():
        return
    _signals_installed = True
    for signum in KILL_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _on_signal)


def guard() -> None:
    """Set the exit and signal cleanup now (from the main thread), for a process whose children are
    started from other threads (a sweep's points)."""
    _install_handlers()
