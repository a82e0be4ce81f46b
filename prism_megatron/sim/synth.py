"""Full-size GPT iterations built from a captured tiny-layer role: scale studies without a GPU.

`gpt_graph` writes, for every pipeline stage of a world, a 1F1B iteration of a GPT with the given
shape: per microbatch and layer the module-level ops a capture records (norms, attention with its
tensor-parallel all-reduce, MLP with its all-reduce; backward likewise), the pipeline p2p between
stages, the data-parallel gradient all-reduce and the optimizer step. Compute durations come from a
captured role (`per_module_s`, e.g. `module_durations(graph)` of a tiny-layer capture) scaled by the
ratio of FLOPs between the captured shape and the target shape, or, with `flops_per_s` (a device's
sustained rate), distributed in the captured proportions over a layer's forward and backward FLOPs at
that rate: a CPU capture of tiny layers then gives a graph with the structure and node count of
GPT-175B and GPU-like durations. Tensor ranks of a stage share one graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prism_megatron.graph.model import ExecutionGraph, NodeKind, RoleGraphBuilder, StringTable
from prism_megatron.world import VirtualWorld

MODULES = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")


@dataclass(frozen=True)
class GptShape:
    hidden: int
    seq: int
    micro_batch: int
    layers: int
    vocab: int = 51200
    bytes_per_value: int = 2

    def layer_flops(self, tp: int) -> float:
        """Forward FLOPs of one layer on one tensor rank for one microbatch."""
        h, s, b = self.hidden, self.seq, self.micro_batch
        return b * s * (8 * h * h + 4 * s * h + 8 * h * h) / tp


def module_durations(graph: ExecutionGraph) -> dict[str, float]:
    """Mean duration per module kind (forward and `.backward`) over the layers of a captured graph."""
    sums: dict[str, list[float]] = {}
    for g in {id(g.dep_ptr): g for g in graph.roles.values()}.values():
        cols = g.columns
        for i in np.nonzero(cols["kind"] == NodeKind.COMPUTE)[0]:
            name = graph.string(int(cols["name"][i]))
            parts = name.split(".")
            if len(parts) >= 4 and parts[0] == "decoder" and parts[1] == "layers":
                kind = ".".join(parts[3:])
                sums.setdefault(kind, []).append(float(cols["duration_s"][i]))
    return {k: float(np.mean(v)) for k, v in sums.items()}


def gpt_graph(world: VirtualWorld, shape: GptShape, microbatches: int, per_module_s: dict[str, float],
              captured: GptShape, flops_per_s: float | None = None) -> ExecutionGraph:
    """The 1F1B iteration of `shape` on `world` (see the module docstring)."""
    if shape.layers % world.pp:
        raise ValueError(f"{shape.layers} layers do not split over {world.pp} stages")
    if flops_per_s:
        layer_s = sum(v for k, v in per_module_s.items() if k.split(".")[0] in MODULES)
        scale = 3 * shape.layer_flops(world.tp) / flops_per_s / layer_s
    else:
        scale = shape.layer_flops(world.tp) / captured.layer_flops(world.tp)
    dur = {k: v * scale for k, v in per_module_s.items()}
    per_stage = shape.layers // world.pp
    act = shape.micro_batch * shape.seq * shape.hidden * shape.bytes_per_value
    layer_params = 12 * shape.hidden * shape.hidden // world.tp * shape.bytes_per_value
    strings = StringTable()
    by_stage = {}
    for stage in range(world.pp):
        role = next(r for r in world.roles() if r.pp == stage)
        by_stage[stage] = _stage_graph(world, role, stage, per_stage, microbatches, dur, act,
                                       layer_params, strings)
    roles = {}
    for role in world.roles():
        g = by_stage[role.pp]
        roles[role] = g if g.role == role else g.as_role(role, world.representative(role), "synthetic")
    meta = {"config": _config_yaml(world, shape, microbatches), "device": "synthetic"}
    return ExecutionGraph(world=world, roles=roles, strings=strings.strings, meta=meta)


def _stage_graph(world, role, stage, layers, microbatches, dur, act, layer_params, strings):
    b = RoleGraphBuilder(role, world.representative(role), strings)
    t = 0.0
    last = {"compute": None, "comm.tp": None, "comm.pp": None, "comm.dp": None}
    seq: dict[str, int] = {}
    waits: list[int] = []

    def compute(name, seconds):
        nonlocal t, waits
        deps = [d for d in (last["compute"], *waits) if d is not None]
        waits = []
        last["compute"] = b.compute(name, stream="compute", start_s=t, duration_s=seconds, deps=deps)
        t += seconds

    def comm(op, dim, nbytes, peer=None, wait=True):
        stream = f"comm.{dim}"
        seq[dim] = seq.get(dim, -1) + 1
        deps = [d for d in (last["compute"], last[stream]) if d is not None]
        node = b.comm(op, dim=dim, nbytes=nbytes, dtype="bfloat16", seq=seq[dim], stream=stream,
                      start_s=t, duration_s=0.0, peer_delta=peer, deps=deps)
        last[stream] = node
        if wait:
            waits.append(node)

    first, last_stage = stage == 0, stage == world.pp - 1

    def forward(mb):
        if not first:
            comm("recv", "pp", act, peer=-1)
        compute("forward", 2e-5)
        for layer in range(layers):
            p = f"decoder.layers.{layer}."
            compute(p + "input_layernorm", dur.get("input_layernorm", 1e-5))
            compute(p + "self_attention", dur.get("self_attention", 1e-4))
            comm("all_reduce", "tp", act)
            compute(p + "pre_mlp_layernorm", dur.get("pre_mlp_layernorm", 1e-5))
            compute(p + "mlp", dur.get("mlp", 1e-4))
            comm("all_reduce", "tp", act)
        if not last_stage:
            comm("send", "pp", act, peer=1, wait=False)

    def backward(mb):
        if not last_stage:
            comm("recv", "pp", act, peer=1)
        compute("backward", 2e-5)
        for layer in reversed(range(layers)):
            p = f"decoder.layers.{layer}."
            compute(p + "mlp.backward", dur.get("mlp.backward", 2e-4))
            comm("all_reduce", "tp", act)
            compute(p + "pre_mlp_layernorm.backward", dur.get("pre_mlp_layernorm.backward", 1e-5))
            compute(p + "self_attention.backward", dur.get("self_attention.backward", 2e-4))
            comm("all_reduce", "tp", act)
            compute(p + "input_layernorm.backward", dur.get("input_layernorm.backward", 1e-5))
        if not first:
            comm("send", "pp", act, peer=-1, wait=False)

    warmup = min(world.pp - stage - 1, microbatches)
    for mb in range(warmup):
        forward(mb)
    for mb in range(microbatches - warmup):
        forward(warmup + mb)
        backward(mb)
    for mb in range(microbatches - warmup, microbatches):
        backward(mb)
    comm("all_reduce", "dp", layers * layer_params)
    compute("optimizer.step", 1e-3)
    return b.build(mem_t_s=[0.0, t], mem_bytes=[0, 0])


def _config_yaml(world, shape, microbatches) -> str:
    gbs = microbatches * shape.micro_batch * world.dp
    return (f"model: {{hidden_size: {shape.hidden}, num_layers: {shape.layers}, seq_length: {shape.seq}, "
            f"vocab_size: {shape.vocab}, num_attention_heads: 96}}\n"
            f"train: {{global_batch_size: {gbs}, micro_batch_size: {shape.micro_batch}}}\n")
