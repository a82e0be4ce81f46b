"""The explicit state of one emulated process: who it is in the virtual world and who is real.

A `VirtualSession` is created by the hooks when `torch.distributed.init_process_group` runs, and handed
to the `prism` backend as the default group's options; every subgroup finds it through the default
group. Nothing here is module-global, so tests can build sessions side by side. Its per-operation half
is native (`self.native`, comm/native.py): the ghost policy, the counters, the trace a recorder reads.

Physical processes (torchrun, P >= 1) each play one sandbox virtual rank. Members of a virtual group
that are physical exchange real data through an *inner* backend (gloo on CPU, NCCL on GPU) built over
just those processes, with the group's own store prefix, so no process waits for a ghost to connect.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from prism_megatron.comm import native as native_path
from prism_megatron.comm.events import CommLog, GroupInfo, _Watched
from prism_megatron.comm.ghost import GhostPolicy


@contextlib.contextmanager
def _naming_peers(phys: "PhysicalWorld", others: Sequence[int], where: str) -> Iterator[None]:
    """A wait on the other sandboxes `others` that times out (or finds one gone) raises an error that
    names them, as the native backend's waits do (csrc/backend.cpp `peer_error`)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        text = str(err)
        if not any(sign in text for sign in native_path.PEER_LOST_SIGNS):
            raise
        ranks = ", ".join(map(str, others))
        raise dist.DistBackendError(
            f"{native_path.PEER_MARK}{'s' if len(others) != 1 else ''} {ranks} to sandbox rank "
            f"{phys.virtual_rank} in {where} within emulation.peer_timeout_s "
            f"({phys.timeout.total_seconds():g} s): that sandbox stopped, hung or died (raise the "
            f"timeout if it is only slow). {text.splitlines()[0] if text else ''}") from None


@dataclass(kw_only=True)
class PhysicalWorld:
    """The real processes: this one's physical rank and the virtual rank each of them plays."""

    rank: int
    sandbox_ranks: tuple[int, ...]
    store: Optional[dist.Store] = None
    device_type: str = "cpu"
    timeout: timedelta = timedelta(minutes=30)

    def __post_init__(self) -> None:
        if len(self.sandbox_ranks) != len(set(self.sandbox_ranks)):
            raise ValueError(f"sandbox ranks {list(self.sandbox_ranks)} repeat a virtual rank; "
                             "give each physical process its own virtual rank")
        if not 0 <= self.rank < len(self.sandbox_ranks):
            raise ValueError(
                f"physical rank {self.rank} has no sandbox rank: {len(self.sandbox_ranks)} given "
                f"({list(self.sandbox_ranks)}); give one --prism-sandbox-ranks entry per process")
        if len(self.sandbox_ranks) > 1 and self.store is None:
            raise ValueError("several physical processes need a store to rendezvous")
        self._physical_of = {v: p for p, v in enumerate(self.sandbox_ranks)}
        self.sandbox_set = frozenset(self.sandbox_ranks)

    @property
    def size(self) -> int:
        return len(self.sandbox_ranks)

    @property
    def virtual_rank(self) -> int:
        return self.sandbox_ranks[self.rank]

    def physical_of(self, virtual_rank: int) -> Optional[int]:
        """The physical rank playing `virtual_rank`, or None for a ghost."""
        return self._physical_of.get(virtual_rank)

    def make_backend(self, store: dist.Store, physical_members: Sequence[int],
                     device_type: Optional[str] = None):
        """A real backend over `physical_members` for `device_type` (default: this world's):
        NCCL for cuda, gloo for cpu; it rendezvouses under `store`."""
        rank = physical_members.index(self.rank)
        size = len(physical_members)
        if (device_type or self.device_type) == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, self.timeout)


@dataclass(kw_only=True)
class VirtualSession:
    """This process in the virtual world: world size, its virtual rank, the real peers, ghost data."""

    world_size: int
    physical: PhysicalWorld
    policy: GhostPolicy = field(default_factory=GhostPolicy)
    world: Optional[object] = None
    """The `VirtualWorld` (megatron dims) if known; used to label groups by dim."""
    log: CommLog = field(default_factory=CommLog)
    p2p_backends: dict[str, object] = field(default_factory=dict)
    """Real backends over all physical processes by device type, only for real-to-real send/recv."""
    ghost_data: list = field(init=False)
    """Providers of what the ghosts contribute to integer data (counts, sizes), asked once per
    operation before the ghost policy: called with (op, group members, the ghosts' virtual ranks, one
    ghost slot as the template); one that knows returns one row of values per ghost (an array of
    len(ghosts) x the slot's elements), else None. The MoE routing model gives the ghosts' token counts
    this way (moe/routing.py)."""
    ghost_reductions: list = field(init=False)
    """Providers of the ghosts' part of a reduction of integer data, asked before the ghost policy:
    called with (op, group members, the ghosts' virtual ranks, this rank's tensor, the ReduceOp); one
    that knows returns the ghosts' contributions reduced by that op (a tensor like the input), else
    None. DeepSpeed-MoE's dropless capacity (the maximum expert load over the expert-parallel group)
    comes this way from the routing model (moe/deepspeed_routing.py)."""
    native: Any = field(init=False, repr=False)
    """The native half (comm/native.py `Session`)."""
    groups: list[GroupInfo] = field(init=False, repr=False)
    """Every group of this process, by the native backend's index."""

    def __post_init__(self) -> None:
        bad = [v for v in self.physical.sandbox_ranks if not 0 <= v < self.world_size]
        if bad:
            raise ValueError(f"sandbox rank(s) {bad} are outside the virtual world of "
                             f"{self.world_size} ranks; choose ranks in 0..{self.world_size - 1}")
        if self.world is not None and getattr(self.world, "world_size", self.world_size) != self.world_size:
            raise ValueError(f"virtual world describes {self.world.world_size} ranks but the session "
                             f"has {self.world_size}")
        module = native_path.load()
        self.native = module.Session(self.world_size, list(self.physical.sandbox_ranks), self.physical.rank,
                                     native_path.POLICY_CODES[self.policy.name], self.policy.seed)
        self.groups = []
        self.ghost_data = _Watched(self._rewire_providers)
        self.ghost_reductions = _Watched(self._rewire_providers)
        self.log.bind(self.native, self.groups, tuple(module.OP_NAMES), native_path.dtype_names())

    @property
    def virtual_rank(self) -> int:
        return self.physical.virtual_rank

    @property
    def fresh_gathers(self) -> int:
        """> 0 while the framework gathers in place into a freshly allocated buffer (ZeRO-3's parameter
        gathers, hooks/deepspeed.py): ghost slots then have no last known value to keep, and the mirror
        policy gives them copies of this rank's shard."""
        return self.native.fresh_gathers

    @fresh_gathers.setter
    def fresh_gathers(self, value: int) -> None:
        self.native.fresh_gathers = int(value)

    def make_backend(self, members: Sequence[int], group_rank: int, group_id: str, store: Optional[dist.Store]):
        """The native backend of one group (made when torch creates the group)."""
        members = tuple(int(m) for m in members)
        index = len(self.groups)
        ghosts = sum(self.physical.physical_of(v) is None for v in members)
        self.groups.append(GroupInfo(self.dim_of(members), group_id, members, ghosts))
        phys = self.physical

        def make_inner(device_type: str):
            """The real backend over this group's physical members (NCCL for CUDA, gloo for CPU: object
            collectives use CPU tensors even on GPU)."""
            real = [phys.physical_of(v) for v in members if phys.physical_of(v) is not None]
            prefixed = dist.PrefixStore(f"prism/inner/{device_type}/", store)
            others = [v for v in members if phys.physical_of(v) not in (None, phys.rank)]
            with _naming_peers(phys, others, f"creating group {group_id}"):
                return phys.make_backend(prefixed, real, device_type)

        backend = native_path.load().Backend(self.native, list(members), group_rank, index, group_id,
                                             phys.device_type, make_inner)
        backend.session_object = weakref.ref(self)
        backend.connect()  # rendezvous now, while every real member is creating this group
        return backend

    def _rewire_providers(self) -> None:
        self.native.set_providers(self._ghost_rows if self.ghost_data else None,
                                  self._ghost_reduction if self.ghost_reductions else None)

    def _ghost_rows(self, group: int, op: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        info = self.groups[group]
        ghosts = [v for v in info.members if self.physical.physical_of(v) is None]
        name = native_path.load().OP_NAMES[op]
        for provide in tuple(self.ghost_data):
            values = provide(name, info.members, ghosts, like)
            if values is not None:
                return torch.from_numpy(np.ascontiguousarray(values)).reshape(len(ghosts), -1)
        return None

    def _ghost_reduction(self, group: int, op: int, tensor: torch.Tensor, reduce: int) -> Optional[torch.Tensor]:
        info = self.groups[group]
        ghosts = [v for v in info.members if self.physical.physical_of(v) is None]
        name = native_path.load().OP_NAMES[op]
        reduce_op = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
                     dist.ReduceOp.PRODUCT)[reduce]
        for provide in tuple(self.ghost_reductions):
            part = provide(name, info.members, ghosts, tensor, reduce_op)
            if part is not None:
                return part
        return None

    def connect_p2p(self) -> None:
        """Build the real p2p backends among all physical processes (collective over them): gloo,
        and NCCL on GPU. Both now, since a pair of ranks alone cannot build one later."""
        if self.physical.size == 1 or self.p2p_backends:
            return
        everyone = list(range(self.physical.size))
        for device_type in sorted({"cpu", self.physical.device_type}):
            store = dist.PrefixStore(f"prism/p2p/{device_type}/", self.physical.store)
            others = [v for v in self.physical.sandbox_ranks if v != self.virtual_rank]
            with _naming_peers(self.physical, others, "connecting the sandboxes for send/recv"):
                self.p2p_backends[device_type] = self.physical.make_backend(store, everyone, device_type)
            self.native.set_p2p(device_type, self.p2p_backends[device_type])

    def dim_of(self, members: Sequence[int]) -> str:
        """Megatron dim of a member list (tp, dp, ...), `world` for everyone, else `other`."""
        if len(members) == self.world_size:
            return "world"
        if self.world is not None:
            dim = self.world.dim_of(tuple(members))
            if dim is not None:
                return str(dim)
        return "other"

    def device(self) -> torch.device:
        if self.physical.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
