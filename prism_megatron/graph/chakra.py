"""Export to the MLCommons Chakra execution trace (ET), the input format of ASTRA-sim.

A Chakra ET file holds one rank: a `GlobalMetadata` message, then one `Node` message per node, each
preceded by its length as a protobuf varint. The messages follow Chakra's published schema
(`schema/protobuf/et_def.proto`, package `ChakraProtoMsg`): the part of it we write is declared below
with the same names, field numbers and types, so the bytes are what Chakra's own bindings read; it is
built as a descriptor at import, so no protoc is needed.

Mapping: compute nodes become COMP_NODE; collectives COMM_COLL_NODE with `comm_type` (Chakra's
CollectiveCommType), `comm_size` (bytes) and `pg_name` (`<dim>/<lowest member>`); p2p becomes
COMM_SEND_NODE / COMM_RECV_NODE with `comm_src`, `comm_dst` and `comm_tag` (the sequence number on
the group). The previous node of the same stream is a control dependency; every other dependency
(waits on communication) is a data dependency. Times are the captured ones, in microseconds.
"""

from __future__ import annotations

import os
from typing import Iterable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from prism_megatron.graph.model import NO_PEER, ExecutionGraph, NodeKind
from prism_megatron.util import atomic_write_bytes

CHAKRA_VERSION = "0.0.4"
NODE_TYPES = {"COMP_NODE": 4, "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7}
COLLECTIVES = {"all_reduce": 0, "reduce": 1, "all_gather": 2, "gather": 3, "scatter": 4,
               "broadcast": 5, "all_to_all": 6, "reduce_scatter": 7, "barrier": 9}

_F = descriptor_pb2.FieldDescriptorProto


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="prism_chakra_et_def.proto", package="ChakraProtoMsg",
                                           syntax="proto3")

    def message(name, fields, oneof=None):
        m = f.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name=oneof)
        for number, fname, ftype, label, type_name, in_oneof in fields:
            field = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name
            if in_oneof:
                field.oneof_index = 0
        return m

    opt, rep = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    message("AttributeProto", [
        (1, "name", _F.TYPE_STRING, opt, None, False),
        (2, "doc_string", _F.TYPE_STRING, opt, None, False),
        (3, "double_val", _F.TYPE_DOUBLE, opt, None, True),
        (7, "int32_val", _F.TYPE_INT32, opt, None, True),
        (9, "int64_val", _F.TYPE_INT64, opt, None, True),
        (13, "uint64_val", _F.TYPE_UINT64, opt, None, True),
        (27, "bool_val", _F.TYPE_BOOL, opt, None, True),
        (29, "string_val", _F.TYPE_STRING, opt, None, True),
    ], oneof="value")
    message("GlobalMetadata", [
        (1, "version", _F.TYPE_STRING, opt, None, False),
        (2, "attr", _F.TYPE_MESSAGE, rep, ".ChakraProtoMsg.AttributeProto", False),
    ])
    message("IOInfo", [(1, "values", _F.TYPE_STRING, opt, None, False),
                       (2, "shapes", _F.TYPE_STRING, opt, None, False),
                       (3, "types", _F.TYPE_STRING, opt, None, False)])
    message("Node", [
        (1, "id", _F.TYPE_UINT64, opt, None, False),
        (2, "name", _F.TYPE_STRING, opt, None, False),
        (3, "type", _F.TYPE_ENUM, opt, ".ChakraProtoMsg.NodeType", False),
        (4, "ctrl_deps", _F.TYPE_UINT64, rep, None, False),
        (5, "data_deps", _F.TYPE_UINT64, rep, None, False),
        (6, "start_time_micros", _F.TYPE_UINT64, opt, None, False),
        (7, "duration_micros", _F.TYPE_UINT64, opt, None, False),
        (8, "inputs", _F.TYPE_MESSAGE, opt, ".ChakraProtoMsg.IOInfo", False),
        (9, "outputs", _F.TYPE_MESSAGE, opt, ".ChakraProtoMsg.IOInfo", False),
        (10, "attr", _F.TYPE_MESSAGE, rep, ".ChakraProtoMsg.AttributeProto", False),
    ])
    node_type = f.enum_type.add(name="NodeType")
    for name, number in (("INVALID_NODE", 0), ("METADATA_NODE", 1), ("MEM_LOAD_NODE", 2),
                         ("MEM_STORE_NODE", 3), *NODE_TYPES.items(), ("STORAGE_NODE", 8),
                         ("BATCH_NODE", 9), ("CHECKPOINT_NODE", 10)):
        node_type.value.add(name=name, number=number)
    coll = f.enum_type.add(name="CollectiveCommType")
    for name, number in (("ALL_REDUCE", 0), ("REDUCE", 1), ("ALL_GATHER", 2), ("GATHER", 3),
                         ("SCATTER", 4), ("BROADCAST", 5), ("ALL_TO_ALL", 6), ("REDUCE_SCATTER", 7),
                         ("REDUCE_SCATTER_BLOCK", 8), ("BARRIER", 9)):
        coll.value.add(name=name, number=number)
    return f


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
GlobalMetadata = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("ChakraProtoMsg.GlobalMetadata"))
Node = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("ChakraProtoMsg.Node"))


def _attr(msg, name: str, **value) -> None:
    a = msg.attr.add(name=name)
    for key, v in value.items():
        setattr(a, key, v)


def chakra_messages(graph: ExecutionGraph, rank: int) -> tuple:
    """(GlobalMetadata, [Node]) of virtual rank `rank`."""
    world, g = graph.world, graph.graph_of(rank)
    meta = GlobalMetadata(version=CHAKRA_VERSION)
    _attr(meta, "schema", string_val="prism_megatron execution graph")
    _attr(meta, "rank", int64_val=rank)
    _attr(meta, "world_size", int64_val=world.world_size)
    _attr(meta, "role", string_val=str(g.role))
    cols, nodes = g.columns, []
    last_on_stream: dict[int, int] = {}
    for i in range(g.num_nodes):
        name, op = graph.string(int(cols["name"][i])), graph.string(int(cols["op"][i]))
        node = Node(id=i, name=name, start_time_micros=round(float(cols["start_s"][i]) * 1e6),
                    duration_micros=round(float(cols["duration_s"][i]) * 1e6))
        stream = int(cols["stream"][i])
        previous = last_on_stream.get(stream)
        for d in g.deps(i).tolist():
            (node.ctrl_deps if d == previous else node.data_deps).append(d)
        last_on_stream[stream] = i
        _attr(node, "stream", string_val=graph.string(stream))
        if cols["kind"][i] == NodeKind.COMPUTE:
            node.type = NODE_TYPES["COMP_NODE"]
            _attr(node, "is_cpu_op", bool_val=False)
        else:
            dim = graph.string(int(cols["dim"][i]))
            members = range(world.world_size) if dim in ("world", "other") else world.group(rank, dim)
            _attr(node, "comm_size", int64_val=int(cols["nbytes"][i]))
            _attr(node, "pg_name", string_val=f"{dim}/{min(members)}")
            if cols["peer_delta"][i] != NO_PEER:
                members = list(members)
                peer = members[(members.index(rank) + int(cols["peer_delta"][i])) % len(members)]
                send = op == "send"
                node.type = NODE_TYPES["COMM_SEND_NODE" if send else "COMM_RECV_NODE"]
                _attr(node, "comm_src", int32_val=rank if send else peer)
                _attr(node, "comm_dst", int32_val=peer if send else rank)
                _attr(node, "comm_tag", int32_val=int(cols["seq"][i]))
            else:
                node.type = NODE_TYPES["COMM_COLL_NODE"]
                _attr(node, "comm_type", int64_val=COLLECTIVES.get(op, 0))
        nodes.append(node)
    return meta, nodes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated Chakra ET stream (varint)")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def encode(messages: Iterable) -> bytes:
    """Length-delimited protobuf stream (varint size, then the message), as Chakra writes it."""
    out = bytearray()
    for msg in messages:
        data = msg.SerializeToString()
        out += _varint(len(data)) + data
    return bytes(out)


def decode(data: bytes) -> tuple:
    """(GlobalMetadata, [Node]) back from `encode`'s bytes."""
    pos, messages = 0, []
    while pos < len(data):
        size, pos = _read_varint(data, pos)
        if pos + size > len(data):
            raise ValueError("truncated Chakra ET stream")
        cls = GlobalMetadata if not messages else Node
        msg = cls()
        msg.ParseFromString(data[pos:pos + size])
        messages.append(msg)
        pos += size
    if not messages:
        raise ValueError("empty Chakra ET stream")
    return messages[0], messages[1:]


def write_chakra(graph: ExecutionGraph, ranks: Iterable[int], out_dir: str) -> list[str]:
    """Write `et.<rank>.et` for each rank into `out_dir` (atomically each); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for rank in ranks:
        meta, nodes = chakra_messages(graph, rank)
        path = os.path.join(out_dir, f"et.{rank}.et")
        atomic_write_bytes(path, encode([meta, *nodes]))
        paths.append(path)
    return paths
