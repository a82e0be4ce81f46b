"""Per-rank MoE load and memory log (`moe.log_path`): JSON Lines during the run, a table at its end.

Hooks on megatron-core's modules, no forked code: the router's output (its routing map: assignments
kept after capacity dropping), the experts' input (`tokens_per_expert`, what this rank's local experts
receive), and the MoE layer's end (memory then). One line per MoE layer and microbatch:

    {"iteration", "microbatch", "layer", "experts": [global ids of the local experts],
     "tokens": [tokens per local expert], "routed": assignments made here, "routed_per_expert": [this
     rank's assignments to every expert], "dropped": assignments the capacity factor dropped here,
     "memory": {allocated, reserved, peak, and on CPU the categories}}

DeepSpeed-MoE layers are logged alike (moe/deepspeed_routing.py: `attach_load_log`), with the
call's expert `capacity` added.

The logs of every rank of a run are a routing trace: `moe.imbalance=replay(<log path with {rank}>)`
routes each source rank's tokens as it routed them then (moe/imbalance.py).

The k-th forward of a layer in the run is microbatch k mod M of iteration k div M (M per iteration).
Each line is written whole and flushed, so a killed run keeps every line it finished. At the end, a
table per layer (tokens per expert: min, mean, max, max/mean; dropped) goes to stderr and
`<log>.summary.json` is written atomically.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

import numpy as np
import torch

from prism_megatron.util import atomic_write_text, per_rank_path


class MoeLoadLog:
    """Collects and writes one rank's MoE load (see the module docstring)."""

    def __init__(self, path: str, rank: Callable[[], int], microbatches: Callable[[], int],
                 memory: Callable[[], dict]) -> None:
        self.path_template, self._rank = path, rank
        self._microbatches, self._memory = microbatches, memory
        self.path: Optional[str] = None
        self.rank: Optional[int] = None
        self._file = None
        self._calls: dict[int, int] = {}
        self._pending: dict[int, dict] = {}
        self.rows: list[dict] = []

    def attach(self, model: torch.nn.Module) -> list[Any]:
        """Hook every MoE layer of `model`; returns the handles."""
        from megatron.core.transformer.moe.moe_layer import MoELayer

        handles = []
        for module in model.modules():
            if isinstance(module, MoELayer):
                layer = int(getattr(module, "layer_number", 0) or 0)
                local = [int(i) for i in getattr(module, "local_expert_indices", [])]
                topk = int(module.config.moe_router_topk)
                handles.append(module.router.register_forward_hook(self._on_router(layer, topk)))
                handles.append(module.experts.register_forward_pre_hook(self._on_experts(layer)))
                handles.append(module.register_forward_hook(self._on_layer_end(layer, local),
                                                            always_call=True))
        return handles

    def _on_router(self, layer: int, topk: int):
        def hook(mod, args, output):
            routing_map = output[1] if isinstance(output, tuple) else None
            if isinstance(routing_map, torch.Tensor):
                per_expert = routing_map.sum(dim=0).tolist()
                routed = int(sum(per_expert))
                pending = self._pending.setdefault(layer, {})
                pending.update(routed=routed, dropped=max(0, routing_map.shape[0] * topk - routed),
                               routed_per_expert=[int(x) for x in per_expert])
        return hook

    def _on_experts(self, layer: int):
        def hook(mod, args):
            tokens = args[1] if len(args) > 1 else None
            if isinstance(tokens, torch.Tensor):
                self._pending.setdefault(layer, {})["tokens"] = [int(x) for x in tokens.tolist()]
        return hook

    def _on_layer_end(self, layer: int, local: list[int]):
        def hook(mod, args, output):
            if not torch.is_grad_enabled() and not mod.training:
                return  # evaluation forwards are not training microbatches
            k = self._calls.get(layer, 0)
            self._calls[layer] = k + 1
            iteration, microbatch = divmod(k, max(1, self._microbatches()))
            seen = self._pending.pop(layer, {})
            row = {"iteration": iteration + 1, "microbatch": microbatch, "layer": layer, "experts": local,
                   "tokens": seen.get("tokens", []), "routed": seen.get("routed"),
                   "routed_per_expert": seen.get("routed_per_expert", []),
                   "dropped": seen.get("dropped"), "memory": self._memory()}
            if "capacity" in seen:  # DeepSpeed-MoE: the expert capacity of this call (tokens)
                row["capacity"] = seen["capacity"]
            self.rows.append(row)
            self._write(row)
        return hook

    def _write(self, row: dict) -> None:
        if self._file is None:
            self.rank = self._rank()  # the process group may be gone by close()
            self.path = per_rank_path(self.path_template, self.rank)
            self._file = open(self.path, "w", buffering=1)  # line-buffered: whole lines reach disk
        self._file.write(json.dumps(row) + "\n")

    def close(self, stream=sys.stderr) -> Optional[dict]:
        """Close the log, write `<log>.summary.json` and print the per-layer table."""
        if self._file is None:
            return None
        self._file.close()
        summary = summarize(self.rows)
        atomic_write_text(self.path + ".summary.json", json.dumps(summary, indent=1))
        print(f"MoE load, rank {self.rank} ({self.path}):", file=stream)
        print(f"{'layer':>7}{'experts':>9}{'min':>8}{'mean':>10}{'max':>8}{'max/mean':>10}"
              f"{'dropped':>9}", file=stream)
        for row in summary["layers"]:
            print(f"{row['layer']:>7}{row['experts']:>9}{row['min']:>8}{row['mean']:>10.1f}{row['max']:>8}"
                  f"{row['max_over_mean']:>10.2f}{row['dropped']:>9}", file=stream)
        return summary


def summarize(rows: list[dict]) -> dict:
    """Per layer over the logged microbatches: tokens per local expert and dropped assignments; and
    the peak memory seen at a layer's end."""
    layers = {}
    for row in rows:
        entry = layers.setdefault(row["layer"], {"tokens": [], "dropped": 0})
        entry["tokens"].extend(row["tokens"])
        entry["dropped"] += row["dropped"] or 0
    out = []
    for layer, entry in sorted(layers.items()):
        t = np.asarray(entry["tokens"] or [0])
        out.append({"layer": layer, "experts": len(rows[0]["experts"]) if rows else 0, "min": int(t.min()),
                    "mean": float(t.mean()), "max": int(t.max()),
                    "max_over_mean": float(t.max() / t.mean()) if t.mean() > 0 else 0.0,
                    "dropped": int(entry["dropped"])})
    peak = max((r["memory"].get("peak_allocated_bytes", 0) for r in rows), default=0)
    return {"layers": out, "lines": len(rows), "peak_allocated_bytes_at_layer_ends": peak}


def memory_reader(tracker: Any) -> Callable[[], dict]:
    """Memory at a moment: the exact tracker on CPU, the CUDA allocator on GPU."""
    if tracker is not None:
        def cpu() -> dict:
            snap = tracker.snapshot()
            return {"allocated_bytes": snap["allocated_bytes"], "reserved_bytes": snap["allocated_bytes"],
                    "peak_allocated_bytes": snap["peak_allocated_bytes"], "by_category": snap["by_category"]}
        return cpu

    def gpu() -> dict:
        stats = torch.cuda.memory_stats()
        return {"allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
                "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
                "peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0))}
    return gpu
