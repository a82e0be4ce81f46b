"""The execution graph: data model, file format and consistency checks (pure: no torch.distributed)."""

from prism_megatron.graph.check import GraphFileError, check_graph
from prism_megatron.graph.io import load_graph, save_graph
from prism_megatron.graph.model import (
    SCHEMA_VERSION,
    ExecutionGraph,
    NodeKind,
    RoleGraph,
    RoleGraphBuilder,
    StringTable,
)

__all__ = ["SCHEMA_VERSION", "ExecutionGraph", "GraphFileError", "NodeKind", "RoleGraph",
           "RoleGraphBuilder", "StringTable", "check_graph", "load_graph", "save_graph"]
