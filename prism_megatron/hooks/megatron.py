"""Thin wrappers on megatron-core: `parallel_state.initialize_model_parallel`, and the tied-embedding
set-up of a last stage whose first stage is a ghost (`make_setup_embeddings`).

The sizes megatron is asked for are the truth: from them we build the `VirtualWorld` (pure rank
arithmetic through megatron's own `RankGenerator`) and hand it to the session, which labels every
group by its dim. After megatron has built its groups, the groups this rank belongs to are checked
against the VirtualWorld's, so a disagreement is an error at start-up, not a silent wrong group.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from prism_megatron.comm.session import VirtualSession
from prism_megatron.world import VirtualWorld

# megatron getter -> our dim; checked after initialize_model_parallel.
_CHECKED_DIMS = {
    "get_tensor_model_parallel_group": "tp",
    "get_pipeline_model_parallel_group": "pp",
    "get_context_parallel_group": "cp",
    "get_expert_model_parallel_group": "ep",
    "get_expert_tensor_parallel_group": "etp",
    "get_expert_data_parallel_group": "expert_dp",
}


def world_from_megatron_args(world_size: int, gpus_per_node: int, bound: dict) -> VirtualWorld:
    """The VirtualWorld megatron will build for these `initialize_model_parallel` arguments."""
    return VirtualWorld(
        world_size=world_size,
        tp=bound.get("tensor_model_parallel_size", 1),
        pp=bound.get("pipeline_model_parallel_size", 1),
        cp=bound.get("context_parallel_size", 1),
        ep=bound.get("expert_model_parallel_size", 1),
        etp=bound.get("expert_tensor_parallel_size"),
        vpp=bound.get("virtual_pipeline_model_parallel_size"),
        order=bound.get("order", "tp-cp-ep-dp-pp"),
        gpus_per_node=gpus_per_node,
    )


def make_initialize_model_parallel(original: Callable, session_of: Callable[[], Optional[VirtualSession]],
                                   gpus_per_node: int) -> Callable:
    signature = inspect.signature(original)

    def initialize_model_parallel(*args, **kwargs):
        session = session_of()
        if session is None:  # not virtual: plain megatron
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        world = world_from_megatron_args(session.world_size, gpus_per_node, dict(bound.arguments))
        session.world = world
        result = original(*args, **kwargs)
        check_groups(world, session.virtual_rank)
        return result

    initialize_model_parallel.__wrapped__ = original
    return initialize_model_parallel


def check_groups(world: VirtualWorld, virtual_rank: int) -> None:
    """Megatron's groups of this rank must equal the VirtualWorld's (same members, same order)."""
    from megatron.core import parallel_state

    for getter, dim in _CHECKED_DIMS.items():
        group = getattr(parallel_state, getter)(check_initialized=False)
        if group is None or isinstance(group, list):
            continue
        ranks = tuple(dist.get_process_group_ranks(group))
        expected = world.group(virtual_rank, dim)
        if ranks != tuple(expected):
            raise RuntimeError(f"megatron built {dim} group {list(ranks)[:16]} for rank {virtual_rank} "
                               f"but the virtual world expects {list(expected)[:16]}; please report "
                               "this with the parallel sizes")


def make_setup_embeddings(original: Callable, session_of: Callable[[], Optional[VirtualSession]],
                          seed_of: Callable[[], int]) -> Callable:
    """A replacement for `LanguageModule.setup_embeddings_and_output_layer` for tied embeddings.

    With pipeline parallelism and tied embeddings, megatron zeroes the last stage's copy of the word
    embeddings and all-reduces it with the first stage's over the embedding group, so both start
    equal. When the first stage is a ghost, its contribution is the ghost policy's (mirror: the
    last stage's own zeros), and the last stage would train with a zero output layer. So the copy is
    initialised here as the first stage initialises its embedding: the model's embedding init method
    on a fresh model-parallel RNG state (megatron's seed + 2718 + tensor-parallel rank; the first
    stage draws its embedding first). That is exactly the first stage's weight when every stage
    seeds megatron with the same seed (megatron-core's examples and ours); under Megatron-LM's
    per-stage seed offset it is a different draw of the same distribution."""

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        session = session_of()
        tied = getattr(self, "share_embeddings_and_output_weights", False)
        if session is None or not tied or self.pre_process or not self.post_process:
            return result
        if self.config.pipeline_model_parallel_size == 1 or not self._is_in_embd_group():
            return result
        from megatron.core import parallel_state

        embd = parallel_state.get_embedding_group()
        members = [dist.get_global_rank(embd, i) for i in range(embd.size())]
        first = members[0]
        if session.physical.physical_of(first) is not None:
            return result  # a real first stage sent its embedding
        _init_like_first_stage(self, seed_of())
        return result

    return setup_embeddings_and_output_layer


def _init_like_first_stage(model: Any, seed: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    weight = model.shared_embedding_or_output_weight()
    init = getattr(model.config, "embedding_init_method", None) or model.config.init_method
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    with torch.no_grad(), tracker.fork("model-parallel-rng"):
        init(weight.data)
