"""The `prism` torch.distributed backend: a process group of a virtual world.

Each group's backend is native (comm/native.py, `csrc/backend.cpp`); this module registers it with
torch.distributed and states what it does. For each operation, the members that are physical processes
exchange real data through the inner backend (gloo/NCCL over just them); the ghost members'
contributions are then folded in place by the session's ghost policy (comm/ghost.py). With no ghosts
the inner backend's result is returned untouched, so an emulated run with N equal to the physical world
is bitwise the plain run.

Completion: collectives wait for their inner operation and return a completed `Work` (real members run
the same program, so they issue a group's collectives in the same order and this cannot deadlock);
p2p between real ranks returns the inner backend's asynchronous work, wrapped, since paired
isend/irecv may be posted in either order. Every operation is counted and, where a recorder or a
listener asks, recorded (comm/events.py).

An in-place all-gather (the input is this rank's slot of the output, as for the distributed
optimizer's parameter shards) under `mirror` leaves the ghosts' slots as they were: a ghost owns its
shard. A broadcast rooted at ghost j under `mirror` delivers real member (j mod r)'s buffer, which with one
real member is the local buffer (DDP's parameter broadcast then keeps the local parameters, as a ghost
root holding identical parameters would give); a scatter from a ghost root keeps the receiver's
buffer; under `zeros`/`random` both are filled. A recv from a ghost under `mirror` returns the first
tensor of that shape and dtype this rank sent the other way (comm/ghost.py). Known limits: `recv` from
any source is unsupported; ghost-data providers are asked for integer data only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from prism_megatron.comm.session import VirtualSession

BACKEND_NAME = "prism"


def create_prism_group(opts, backend_options):
    """The creator torch calls for every group of backend `prism` (extended API).

    The default group receives the `VirtualSession` as its backend options; subgroups find it on
    the default group's backend."""
    if isinstance(backend_options, VirtualSession):
        session = backend_options
    else:
        session = None
        try:
            default = dist.distributed_c10d._get_default_group()
            reference = getattr(default._get_backend(torch.device("cpu")), "session_object", None)
            session = reference() if reference is not None else None
        except (RuntimeError, ValueError):
            pass
        if session is None:
            raise RuntimeError("the prism backend has no session: call prism_megatron.install(cfg) "
                               "before torch.distributed.init_process_group")
    members = list(opts.global_ranks_in_group) or list(range(session.world_size))
    return session.make_backend(members, opts.group_rank, str(opts.group_id), opts.store)


def register_prism_backend() -> None:
    """Register `prism` with torch.distributed once (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_prism_group, extended_api=True,
                                  devices=["cpu", "cuda"])
