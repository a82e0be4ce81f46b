"""Thin wrappers on torch.distributed's entry points that make the default group virtual.

- `init_process_group`: rendezvous the *physical* processes as launched (torchrun env, or one process),
  then create the default group with backend `prism`, world size N and this process's sandbox rank.
- `new_group`: every group of a virtual world is a prism group (a `gloo` or `nccl` group over 8192
  virtual ranks would try to connect to 8192 peers), so the requested backend and its options are
  dropped and the default (prism) is used.
- `broadcast_object_list`: from a ghost root there is no object to receive; the local list is kept,
  the object-level analogue of the `mirror` policy (torch would otherwise read garbage sizes).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from prism_megatron.comm.backend import BACKEND_NAME
from prism_megatron.comm.ghost import GhostPolicy
from prism_megatron.comm.session import PhysicalWorld, VirtualSession
from prism_megatron.config.schema import ConfigError, EmulationConfig
from prism_megatron.util import PHYSICAL_RANK_ENV, PHYSICAL_WORLD_SIZE_ENV


RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
"""The longest the physical processes wait for each other at init_process_group (the group's own
timeout, when shorter, wins). Only the sandbox processes meet here, on one machine or a few."""


def physical_from_env() -> Optional[tuple[int, int]]:
    """(physical rank, physical process count) that `launch` recorded, or None outside `launch`."""
    if PHYSICAL_WORLD_SIZE_ENV not in os.environ:
        return None
    return int(os.environ.get(PHYSICAL_RANK_ENV, "0")), int(os.environ[PHYSICAL_WORLD_SIZE_ENV])


def _physical_rendezvous(init_method, world_size: int, rank: int, store, timeout: timedelta,
                         emulation: EmulationConfig):
    """(store, physical rank, physical size) of the processes as launched.

    Checks before it waits: the number of processes the environment announces must be the number
    of sandboxes, so a virtual WORLD_SIZE (8192) given to a plain process fails at once instead of
    waiting for 8191 processes that will never come."""
    launched = physical_from_env()
    if store is not None:
        return store, rank, world_size
    if launched is not None:  # under `launch`: RANK/WORLD_SIZE (and the call's arguments) are virtual
        _check_virtual_args(world_size, rank, emulation, launched[0])
        p_rank, p_size = launched
    else:
        p_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size in (-1, None) else world_size
        p_rank = int(os.environ.get("RANK", "0")) if rank in (-1, None) else rank
    sandboxes = len(emulation.sandbox_ranks)
    if sandboxes and p_size != sandboxes:
        raise ConfigError(
            f"init_process_group: {p_size} physical process(es) announced (WORLD_SIZE or world_size) "
            f"but {sandboxes} sandbox rank(s) {list(emulation.sandbox_ranks)}; give one "
            "--prism-sandbox-ranks entry per process, or run the script under `prism-megatron launch`, "
            "which presents the virtual world to it")
    if p_size == 1:
        return dist.HashStore(), 0, 1  # one process: nobody to rendezvous with
    wait = min(timeout, RENDEZVOUS_TIMEOUT)
    try:
        store, p_rank, p_size = next(dist.rendezvous(init_method or "env://", p_rank, p_size,
                                                     timeout=wait))
    except (RuntimeError, ValueError, dist.DistError) as err:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise ConfigError(
            f"init_process_group: physical process {p_rank} of {p_size} did not meet the others at "
            f"{init_method or where} within {wait.total_seconds():.0f} s ({err}); start all {p_size} "
            "processes (e.g. `prism-megatron launch --nproc-per-node P -- SCRIPT ...`)") from None
    store.set_timeout(timeout)
    return store, p_rank, p_size


def _check_virtual_args(world_size: int, rank: int, emulation: EmulationConfig, p_rank: int) -> None:
    """Under `launch`, a script passes on the virtual RANK/WORLD_SIZE it was given; other values
    mean it thinks of a different world."""
    n = emulation.virtual_world_size
    if world_size not in (-1, None, n):
        raise ConfigError(f"init_process_group(world_size={world_size}) but the virtual world has {n} "
                          "ranks; pass WORLD_SIZE from the environment (launch sets it) or -1")
    sandbox = emulation.sandbox_ranks
    own = sandbox[p_rank] if p_rank < len(sandbox) else None
    if rank not in (-1, None) and own is not None and rank != own:
        raise ConfigError(f"init_process_group(rank={rank}) but this process is sandbox rank {own}; "
                          "pass RANK from the environment (launch sets it) or -1")


def make_init_process_group(original: Callable, emulation: EmulationConfig,
                            on_session: Callable[[VirtualSession], None],
                            device_type: Optional[str] = None) -> Callable:
    """A replacement for `init_process_group` that builds the virtual default group.

    `device_type`: where the sandbox's tensors live (`cpu` under the CPU runtime, whatever backend
    the script asks for); None: CUDA for `nccl` (or no backend on a GPU machine), else CPU."""

    def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                           timeout: Optional[timedelta] = None, world_size: int = -1, rank: int = -1,
                           store=None, group_name: str = "", pg_options=None, device_id=None,
                           **kwargs) -> None:
        timeout = timeout or timedelta(minutes=30)
        store, p_rank, p_size = _physical_rendezvous(init_method, world_size, rank, store, timeout,
                                                     emulation)
        # after the rendezvous (processes may start minutes apart), a sandbox waits for another one
        # at most this long: a stopped peer is an error naming it, not the group's 30 minutes
        timeout = min(timeout, timedelta(seconds=emulation.peer_timeout_s))
        if p_size > 1:
            store.set_timeout(timeout)
        sandbox = tuple(emulation.sandbox_ranks) or tuple(range(p_size))
        if len(sandbox) != p_size:
            raise ConfigError(
                f"{p_size} physical process(es) but {len(sandbox)} sandbox rank(s) "
                f"{list(sandbox)}; give exactly one --prism-sandbox-ranks entry per process")
        n = emulation.virtual_world_size
        wants_cuda = (backend or "").split(":")[-1] == "nccl" or (
            backend is None and torch.cuda.is_available())
        device = device_type or ("cuda" if wants_cuda else "cpu")
        physical = PhysicalWorld(rank=p_rank, sandbox_ranks=sandbox, store=store,
                                 device_type=device, timeout=timeout)
        session = VirtualSession(world_size=n, physical=physical,
                                 policy=GhostPolicy(name=emulation.ghost_policy,
                                                    seed=emulation.ghost_seed))
        on_session(session)
        original(backend=BACKEND_NAME, store=dist.PrefixStore("prism/", store), rank=session.virtual_rank,
                 world_size=n, timeout=timeout, group_name=group_name, pg_options=session)
        session.connect_p2p()

    return init_process_group


def make_new_group(original: Callable, session_of: Callable[[], Optional[VirtualSession]]) -> Callable:
    """A replacement for `new_group` that keeps every group of the virtual world on prism.

    A group with no physical member is answered `NON_GROUP_MEMBER` at once: every physical process
    makes that same decision for the same call, so torch's group numbering stays consistent among
    them, and megatron's ~180,000 groups of a 65,536-rank world cost a set test each.
    """

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        session = session_of()
        if session is not None and ranks is not None and session.physical.sandbox_set.isdisjoint(ranks):
            return dist.GroupMember.NON_GROUP_MEMBER
        return original(ranks, timeout, None, None, *args, **kwargs)

    return new_group


def make_broadcast_object_list(original: Callable,
                               session_of: Callable[[], Optional[VirtualSession]]) -> Callable:
    """A replacement for `broadcast_object_list` that keeps the local objects when the root is a ghost."""

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        session = session_of()
        if session is not None:
            root = src
            if group_src is not None:
                root = dist.get_global_rank(group or dist.group.WORLD, group_src)
            if root is not None and session.physical.physical_of(root) is None:
                return None
        return original(object_list, src=src, group=group, device=device, group_src=group_src)

    return broadcast_object_list
