"""The `prism` torch.distributed backend: a process group of a virtual world.

`PrismGroup` is a Python `ProcessGroup` over virtual ranks. For each operation, the members that are
physical processes exchange real data through the inner backend (gloo/NCCL over just them); the ghost
members' contributions are then folded in place by the session's `GhostPolicy`. With no ghosts the
inner backend's result is returned untouched, so an emulated run with N equal to the physical world is
bitwise the plain run.

Completion: collectives wait for their inner operation and return a completed `Work` (real members run
the same program, so they issue a group's collectives in the same order and this cannot deadlock);
p2p between real ranks returns the inner backend's asynchronous `Work`, since paired isend/irecv may
be posted in either order. Every operation is recorded as a `CommEvent` in `session.log`.

An in-place all-gather (the input is this rank's slot of the output, as for the distributed
optimizer's parameter shards) under `mirror` leaves the ghosts' slots as they were: a ghost owns its
shard. A broadcast rooted at ghost j under `mirror` delivers real member (j mod r)'s buffer, which with one
real member is the local buffer (DDP's parameter broadcast then keeps the local parameters, as a ghost
root holding identical parameters would give); a scatter from a ghost root keeps the receiver's
buffer; under `zeros`/`random` both are filled. Known limits: `recv` from any source is unsupported.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ReduceOp

from prism_megatron.comm.events import CommEvent
from prism_megatron.comm.ops import (
    REDUCE_NAMES,
    copy_broadcast,
    done,
    inner_reduce_opts,
    nbytes_of,
    operation,
    reduce_op_of,
    row_sizes,
    same_memory,
    split_rows,
)
from prism_megatron.comm.session import VirtualSession
from prism_megatron.comm.slots import GhostSlots, RowPieces, dtype_name, even_pieces, host_copy

BACKEND_NAME = "prism"


def _fake(t: torch.Tensor) -> bool:
    """`is_fake`, with a tensor of exactly `torch.Tensor`'s type (every p2p buffer of a real run)
    answered without its walk. Functionalization's and functorch's wrappers have that type too and
    would count as real; fake execution hands the backend FakeTensors, never those."""
    return type(t) is not torch.Tensor and is_fake(t)


class PrismGroup(dist.ProcessGroup):
    """A group of the virtual world as seen by one sandbox rank."""

    def __init__(self, session: VirtualSession, members: Sequence[int], group_rank: int,
                 group_id: str, store: Optional[dist.Store]) -> None:
        super().__init__(group_rank, len(members))
        self.me = group_rank  # rank() is a call into torch; the hot paths read this
        self.session = session
        self.members = tuple(members)
        self.group_id = group_id
        phys = session.physical
        self.real = [g for g, v in enumerate(self.members) if phys.physical_of(v) is not None]
        self._real_set = frozenset(self.real)
        self.ghosts = [g for g in range(len(self.members)) if phys.physical_of(self.members[g]) is None]
        r = len(self.real)
        # Ghost j of the group mirrors real member j mod r (the local one when it is alone).
        self.mirror_source = {g: self.real[j % r] for j, g in enumerate(self.ghosts)}
        self.dim = session.dim_of(self.members)
        self.slots = GhostSlots(session, self.members, self.real, self.ghosts, group_rank,
                                self.mirror_source, self._gen)
        self._seq = itertools.count()  # next() is atomic under the GIL: calls from any thread
        self._stash: dict[tuple, dict[int, torch.Tensor]] = {}  # (shape, dtype) -> peer -> host copy
        self.has_peers = r > 1
        self._store = store
        self._inners: dict[str, object] = {}
        if self.has_peers:  # rendezvous now, while every real member is creating this group
            self._inner(phys.device_type)

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.members)

    # torch keeps a group's name on its backend, and a Python group registers none: keep it here.
    def _set_group_name(self, name: str) -> None:
        self._prism_group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_prism_group_name", self.group_id)

    def name(self) -> str:  # noqa: D401 - torch API
        return BACKEND_NAME

    def _begin(self, op: str, tensors: Sequence[torch.Tensor], *, peer: Optional[int] = None,
               reduce_op: Optional[ReduceOp] = None) -> int:
        seq = next(self._seq)
        if peer is None:
            peer_rank, delta, real_peer = None, None, self.has_peers
        else:
            n = len(self.members)
            d = (peer - self.me) % n
            peer_rank, delta = self.members[peer], (d - n if d > n // 2 else d)
            real_peer = peer in self._real_set
        self.session.log.record(CommEvent(
            op, self.dim, self.group_id, nbytes_of(tensors),
            dtype_name(tensors[0].dtype) if tensors else "none", seq, self.members, len(self.ghosts),
            peer_rank, None if reduce_op is None else REDUCE_NAMES[reduce_op], delta, real_peer))
        return seq

    def _gen(self, device: torch.device, seq: int, salt: int = 0):
        return lambda: self.session.policy.generator(device, self.group_id, seq, salt)

    def _gen_for(self, tensor: torch.Tensor, seq: int, salt: int = 0):
        """`_gen` for `tensor`'s device, read only if a generator is asked for (rarely: the random
        policy), since a tensor's `device` builds a new object per read."""
        return lambda: self.session.policy.generator(tensor.device, self.group_id, seq, salt)

    def _inner(self, like):
        """The real backend over this group's physical members for `like`'s device (a tensor or a
        device type): NCCL for CUDA tensors, gloo for CPU ones (object collectives use CPU tensors
        even on GPU). A second device's backend is made on first use, which every real member
        reaches at the same operation."""
        device_type = like if isinstance(like, str) else like.device.type
        if device_type not in self._inners:
            phys = self.session.physical
            members = [phys.physical_of(self.members[g]) for g in self.real]
            store = dist.PrefixStore(f"prism/inner/{device_type}/", self._store)
            self._inners[device_type] = phys.make_backend(store, members, device_type)
        return self._inners[device_type]

    def _inner_index(self, group_rank: int) -> Optional[int]:
        try:
            return self.real.index(group_rank)
        except ValueError:
            return None

    # -- reductions ----------------------------------------------------------------------------

    @operation
    def allreduce(self, tensors, opts=None):
        op = reduce_op_of(opts or dist.AllreduceOptions())
        seq = self._begin("all_reduce", tensors, reduce_op=op)
        if self.has_peers:
            self._inner(tensors[0]).allreduce(tensors, inner_reduce_opts(dist.AllreduceOptions, op)).wait()
        for i, t in enumerate(tensors):
            if not self._reduce_provided(t, op):
                self.session.policy.finish_reduction(t, op, n=self.n, r=len(self.real),
                                                     gen_factory=self._gen_for(t, seq, i))
        return done(tensors)

    def _reduce_provided(self, out: torch.Tensor, op: ReduceOp) -> bool:
        """Fold in the ghosts' part from a provider (session.ghost_reductions) if one knows it."""
        providers = self.session.ghost_reductions
        if not providers or not self.ghosts or op not in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.SUM):
            return False
        ghosts = [self.members[g] for g in self.ghosts]
        for provide in providers:
            part = provide("all_reduce", self.members, ghosts, out, op)
            if part is not None:
                part = part.to(device=out.device, dtype=out.dtype).reshape(out.shape)
                if op == ReduceOp.MAX:
                    torch.maximum(out, part, out=out)
                elif op == ReduceOp.MIN:
                    torch.minimum(out, part, out=out)
                else:
                    out.add_(part)
                return True
        return False

    @operation
    def allreduce_coalesced(self, tensors, opts=None):
        opts_single = dist.AllreduceOptions()
        opts_single.reduceOp = (opts or dist.AllreduceCoalescedOptions()).reduceOp
        for t in tensors:
            self.allreduce([t], opts_single)
        return done(tensors)

    @operation
    def reduce(self, tensors, opts):
        op = reduce_op_of(opts)
        seq = self._begin("reduce", tensors, reduce_op=op)
        root = opts.rootRank
        if self.has_peers and root in self.real:
            self._inner(tensors[0]).reduce(tensors, inner_reduce_opts(
                dist.ReduceOptions, op, rootRank=self._inner_index(root), rootTensor=opts.rootTensor)).wait()
        if root == self.me:
            for i, t in enumerate(tensors):
                self.session.policy.finish_reduction(t, op, n=self.n, r=len(self.real),
                                                     gen_factory=self._gen_for(t, seq, i))
        return done(tensors)

    @operation
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = reduce_op_of(opts or dist.ReduceScatterOptions())
        seq = self._begin("reduce_scatter", [t for ts in input_tensors for t in ts], reduce_op=op)
        for i, (out, inputs) in enumerate(zip(output_tensors, input_tensors)):
            self._reduce_scatter_one(out, list(inputs), op, seq, i)
        return done(output_tensors)

    @operation
    def _reduce_scatter_base(self, output, input, opts=None):
        op = reduce_op_of(opts or dist.ReduceScatterOptions())
        seq = self._begin("reduce_scatter", [input], reduce_op=op)
        if self.has_peers and not self.ghosts:
            self._inner(output)._reduce_scatter_base(
                output, input, inner_reduce_opts(dist.ReduceScatterOptions, op)).wait()
            self.session.policy.finish_reduction(output, op, n=self.n, r=self.n,
                                                 gen_factory=self._gen_for(output, seq))
        else:
            self._reduce_scatter_one(output, list(input.chunk(self.n)), op, seq, 0)
        return done([output])

    @operation
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self._reduce_scatter_base(out, inp, opts)
        return done(outputs)

    def _reduce_scatter_one(self, out, inputs, op, seq, salt):
        if self.has_peers:
            real_inputs = [inputs[g] for g in self.real]
            self._inner(out).reduce_scatter([out], [real_inputs],
                                      inner_reduce_opts(dist.ReduceScatterOptions, op)).wait()
        elif not same_memory(out, inputs[self.me]):
            out.copy_(inputs[self.me])
        self.session.policy.finish_reduction(out, op, n=self.n, r=len(self.real),
                                             gen_factory=self._gen_for(out, seq, salt))

    # -- gathers -------------------------------------------------------------------------------

    @operation
    def allgather(self, output_tensors, input_tensors, opts=None):
        seq = self._begin("all_gather", [t for ts in output_tensors for t in ts])
        for outs, inp in zip(output_tensors, input_tensors):
            outs = list(outs)
            in_place = same_memory(outs[self.me], inp)
            if self.has_peers:
                self._inner(inp).allgather([[outs[g] for g in self.real]], [inp]).wait()
            elif not in_place:
                outs[self.me].copy_(inp)
            if not (in_place and self.session.policy.effective(inp.dtype) == "mirror"):
                self.slots.fill(outs, seq, "all_gather")  # in place under mirror: ghosts keep their shards
        return done(output_tensors)

    @operation
    def _allgather_base(self, output, input, opts=None):
        seq = self._begin("all_gather", [output])
        if self.has_peers and not self.ghosts:
            self._inner(output)._allgather_base(output, input).wait()
            return done([output])
        pieces = even_pieces(output, self.n)
        slots = RowPieces(*pieces) if pieces else list(output.chunk(self.n))
        mirror = self.session.policy.effective(output.dtype) == "mirror"
        in_place = same_memory(input, slots[self.me])
        if mirror and in_place:
            # In-place gather of sharded state (distributed optimizer / ZeRO parameters): each ghost
            # owns its shard and would have updated it as we did ours; we keep its last known value
            # rather than overwrite it with copies of our shard. A fresh buffer (ZeRO-3) has none:
            # there every slot gets a copy of ours, one broadcasted copy, before the real members'.
            if self.session.fresh_gathers and output.is_contiguous():
                copy_broadcast(output.view(self.n, -1), input.detach().clone())
            if self.has_peers:
                self._inner(input).allgather([[slots[g] for g in self.real]], [input]).wait()
            return done([output])
        provided = self.slots.provided(slots, "all_gather", pieces)
        if not self.has_peers and mirror and output.is_contiguous() and not provided:
            # One real member: every slot is a copy of the local input; one broadcasted copy.
            copy_broadcast(output.view(self.n, -1), input)
            return done([output])
        if self.has_peers:
            self._inner(input).allgather([[slots[g] for g in self.real]], [input]).wait()
        else:
            slots[self.me].copy_(input)
        self.slots.fill(slots, seq, "all_gather", skip=provided, pieces=pieces)
        return done([output])

    @operation
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        for outs, inp in zip(output_lists, input_list):
            self.allgather([outs], [inp], opts)
        return done(output_lists)

    @operation
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self._allgather_base(out, inp, opts)
        return done(outputs)

    @operation
    def gather(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        # Bytes are the full gathered output on every member (nccl-tests' size), root or not.
        seq = self._begin("gather", list(input_tensors) * self.n)
        if root in self.ghosts:
            return done(output_tensors)  # the data goes to a ghost: nothing to do
        outs = list(output_tensors[0]) if self.me == root else []
        if self.has_peers:
            inner_opts = dist.GatherOptions()
            inner_opts.rootRank = self._inner_index(root)
            inner_out = [[outs[g] for g in self.real]] if outs else []
            self._inner(input_tensors[0]).gather(inner_out, input_tensors, inner_opts).wait()
        elif outs:
            outs[root].copy_(input_tensors[0])
        if outs:
            self.slots.fill(outs, seq, "gather")
        return done(output_tensors)

    # -- one-to-all ----------------------------------------------------------------------------

    @operation
    def broadcast(self, tensors, opts):
        root = opts.rootRank
        seq = self._begin("broadcast", tensors)
        if root in self.real:
            if self.has_peers:
                inner_opts = dist.BroadcastOptions()
                inner_opts.rootRank = self._inner_index(root)
                inner_opts.rootTensor = opts.rootTensor
                self._inner(tensors[0]).broadcast(tensors, inner_opts).wait()
            return done(tensors)
        source = self.mirror_source[root]  # ghost root j mirrors real member j mod r
        for i, t in enumerate(tensors):
            if self.session.policy.effective(t.dtype) == "mirror":
                if self.has_peers:  # all real members agree on the mirrored root's data
                    inner_opts = dist.BroadcastOptions()
                    inner_opts.rootRank = self._inner_index(source)
                    self._inner(t).broadcast([t], inner_opts).wait()
            else:
                self.session.policy.fill(t, None, self._gen(t.device, seq, i))
        return done(tensors)

    @operation
    def scatter(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        seq = self._begin("scatter", list(output_tensors) * self.n)  # the full input, on every member
        out = output_tensors[0]
        if root in self.real:
            if self.has_peers:
                inner_opts = dist.ScatterOptions()
                inner_opts.rootRank = self._inner_index(root)
                inputs = [[input_tensors[0][g] for g in self.real]] if self.me == root else []
                self._inner(out).scatter([out], inputs, inner_opts).wait()
            elif not same_memory(out, input_tensors[0][root]):
                out.copy_(input_tensors[0][root])
        elif self.session.policy.effective(out.dtype) != "mirror":
            self.session.policy.fill(out, None, self._gen(out.device, seq))
        return done(output_tensors)

    # -- all-to-all ----------------------------------------------------------------------------

    @operation
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        seq = self._begin("all_to_all", [input])
        if self.has_peers and not self.ghosts:
            self._inner(output).alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                     dist.AllToAllOptions()).wait()
            return done([output])
        rows = row_sizes(output, output_split_sizes, self.n)
        pieces = (output, rows) if output.is_contiguous() else None
        if self.has_peers:
            outs = split_rows(output, rows)
            ins = split_rows(input, row_sizes(input, input_split_sizes, self.n))
            provided = None
        else:  # only our own piece moves: the ghosts' are cut only if they are filled one by one
            outs = RowPieces(output, rows)
            ins = RowPieces(input, row_sizes(input, input_split_sizes, self.n))
            provided = self.slots.provided(outs, "all_to_all", pieces)
            if not provided and self.slots.mirror_alone(output, input, ins[self.me], rows):
                return done([output])
        self._alltoall_real(outs, ins)
        self.slots.fill(outs, seq, "all_to_all", skip=provided, pieces=pieces)
        return done([output])

    @operation
    def alltoall(self, output_tensors, input_tensors, opts=None):
        seq = self._begin("all_to_all", input_tensors)
        outs, ins = list(output_tensors), list(input_tensors)
        self._alltoall_real(outs, ins)
        self.slots.fill(outs, seq, "all_to_all")
        return done(output_tensors)

    def _alltoall_real(self, outs, ins):
        if not self.has_peers:
            mine, theirs = outs[self.me], ins[self.me]
            if not same_memory(mine, theirs):
                mine.copy_(theirs)
            return
        # Real members only: one packed exchange through the inner backend (gloo has no list form).
        send = torch.cat([ins[g].reshape(-1) for g in self.real])
        recv = torch.empty(sum(outs[g].numel() for g in self.real), dtype=send.dtype,
                           device=send.device)
        self._inner(send).alltoall_base(recv, send, [outs[g].numel() for g in self.real],
                                 [ins[g].numel() for g in self.real], dist.AllToAllOptions()).wait()
        offset = 0
        for g in self.real:
            count = outs[g].numel()
            outs[g].copy_(recv[offset:offset + count].view(outs[g].shape))
            offset += count

    # -- point to point ------------------------------------------------------------------------

    @operation
    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch API names
        self._begin("send", tensors, peer=dstRank)
        physical = self.session.physical.physical_of(self.members[dstRank])
        if physical is not None:
            return self.session.p2p_backends[tensors[0].device.type].send(tensors, physical, tag)
        for t in tensors:  # keep a host copy outside torch's allocator: memory stays a real rank's
            if _fake(t):  # fake execution: shapes only, there are no bytes to mirror
                continue
            # The first one only: mirroring our latest output back into our input would form a loop
            # (activations and gradients fed back through the same layers) that grows without bound.
            sent = self._stash.setdefault((tuple(t.shape), t.dtype), {})
            if dstRank not in sent:
                sent[dstRank] = host_copy(t)
        return done(tensors)

    @operation
    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        seq = self._begin("recv", tensors, peer=srcRank)
        physical = self.session.physical.physical_of(self.members[srcRank])
        if physical is not None:
            return self.session.p2p_backends[tensors[0].device.type].recv(tensors, physical, tag)
        for i, t in enumerate(tensors):
            policy = self.session.policy
            if _fake(t):
                continue
            if policy.effective(t.dtype) == "mirror":
                sent = self._stash.get((tuple(t.shape), t.dtype), {})
                # Prefer what we sent the *other* way: a ghost previous stage's activations look
                # like the ones we send on; a ghost next stage's gradients like the ones we send back.
                other = [p for p in sent if p != srcRank]  # peers in the order first sent to
                raw = sent[other[0]] if other else None
                if raw is None and t.dtype.is_floating_point:  # nothing like it yet: N(0, 1) data
                    t.normal_(generator=self._gen(t.device, seq, i)())
                elif raw is None:
                    t.zero_()
                else:  # from pinned memory on GPU: an asynchronous copy, as a recv is
                    t.copy_(raw, non_blocking=True)
            else:
                policy.fill(t, None, self._gen(t.device, seq, i))
        return done(tensors)

    # torch >= 2.12 names the tensor forms *_single; older releases call the underscored names.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("recv from any source is not supported by the prism backend; "
                                  "receive from a named rank")

    @operation
    def barrier(self, opts=None):
        self._begin("barrier", [])
        if self.has_peers:
            self._inner(self.session.physical.device_type).barrier(dist.BarrierOptions()).wait()
        return done(None)


def create_prism_group(opts, backend_options) -> PrismGroup:
    """The creator torch calls for every group of backend `prism` (extended API).

    The default group receives the `VirtualSession` as its backend options; subgroups find it on
    the default group.
    """
    if isinstance(backend_options, VirtualSession):
        session = backend_options
    else:
        default = dist.distributed_c10d._get_default_group()
        session = getattr(default, "session", None)
        if session is None:
            raise RuntimeError("the prism backend has no session: call prism_megatron.install(cfg) "
                               "before torch.distributed.init_process_group")
    members = list(opts.global_ranks_in_group) or list(range(session.world_size))
    return PrismGroup(session, members, opts.group_rank, str(opts.group_id), opts.store)


def register_prism_backend() -> None:
    """Register `prism` with torch.distributed once (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_prism_group, extended_api=True,
                                  devices=["cpu", "cuda"])
