"""Thin wrappers on Megatron-LM's training loop (`megatron.training`, not megatron-core), installed
where it is importable (`prism-megatron launch -- pretrain_gpt.py ...`). One more, not about ghosts:
rank 0's start-up build of the dataset helpers is skipped where they come compiled
(`_compile_helpers_unless_built`).

In Megatron-LM only tensor-parallel rank 0 loads data: it builds the datasets and the iterators
(`build_train_valid_test_data_iterators`), sends the do-train/valid/test flags from global rank 0,
and each step reads a batch and broadcasts it over its TP group (`get_batch_on_this_tp_rank`); the
other TP ranks allocate empty tensors and receive. When a sandbox's TP source is a ghost nothing
real can be received: the ghost policy keeps the receiver's own buffer (`mirror`), which is
uninitialised memory. Token ids from it index past the embedding, and zero flags stop the loop
before its first iteration.

Two remedies, both inside exactly those two functions. The do-train/valid/test flags: when global
rank 0 is a ghost, this rank sets them before the broadcast to what rank 0 (first stage, TP rank 0,
which builds the datasets) decides by Megatron-LM's own rule: train when `train_iters` > 0 and not
`skip_train`, validate and test when `eval_iters` > 0 or `full_validation`; Megatron keeps flags
already set. The batch: a sandbox whose TP source is a ghost answers
`get_tensor_model_parallel_rank() == 0` there, so it loads the batch its source would have sent, and the
broadcasts still run (their cost is the job's) and keep it. What the sandbox holds is what the
real rank holds: the same tensors, from the same dataset, at the same sample offsets (the data
parallel rank is untouched). Its host does the source's loading work besides, which a TP rank
other than 0 does not do in the real job; with mock data that is a few tensor copies per step.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from prism_megatron.comm.session import VirtualSession
from prism_megatron.runtime.patching import PatchSet


def _source_is_ghost(session: Optional[VirtualSession], parallel_state) -> bool:
    if session is None or not parallel_state.model_parallel_is_initialized():
        return False
    return session.physical.physical_of(parallel_state.get_tensor_model_parallel_src_rank()) is None


def _as_data_source(function: Callable, parallel_state,
                    session_of: Callable[[], Optional[VirtualSession]]) -> Callable:
    """`function` run with this rank answering TP rank 0 when its TP source is a ghost."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not _source_is_ghost(session_of(), parallel_state):
            return function(*args, **kwargs)
        own = parallel_state.get_tensor_model_parallel_rank
        parallel_state.get_tensor_model_parallel_rank = lambda: 0
        try:
            return function(*args, **kwargs)
        finally:
            parallel_state.get_tensor_model_parallel_rank = own

    return wrapper


def _positive(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_positive(v) for v in value)
    return bool(value) and value > 0


def _with_rank0_flags(function: Callable, session_of: Callable[[], Optional[VirtualSession]]) -> Callable:
    """`build_train_valid_test_data_iterators` with rank 0's do-train/valid/test decision set
    beforehand when rank 0 is a ghost (its broadcast cannot carry it)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        session = session_of()
        if session is not None and session.physical.physical_of(0) is None:
            from megatron.training.global_vars import get_args

            margs = get_args()
            margs.do_train = getattr(margs, "do_train", False) or (
                not getattr(margs, "skip_train", False) and _positive(margs.train_iters))
            evaluates = getattr(margs, "full_validation", False) or _positive(margs.eval_iters)
            margs.do_valid = getattr(margs, "do_valid", False) or evaluates
            margs.do_test = getattr(margs, "do_test", False) or evaluates
        return function(*args, **kwargs)

    return wrapper


def _compile_helpers_unless_built(original: Callable) -> Callable:
    """Megatron-LM's global rank 0 compiles the dataset index helpers with `make` in
    megatron/core/datasets at start-up, and exits when that fails. The megatron-core wheel ships them
    compiled (`helpers_cpp`) and without the Makefile, so there `make` fails and rank 0 of a plain
    run exits before training; where the compiled module imports, there is nothing to build."""

    @functools.wraps(original)
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            return original()
        return None

    return compile_helpers


def install_megatron_lm(patches: PatchSet, session_of: Callable[[], Optional[VirtualSession]]) -> bool:
    """Wrap Megatron-LM's data-loading entry points; False when megatron.training is absent."""
    try:
        from megatron.core import parallel_state
        from megatron.core.datasets import utils as dataset_utils
        from megatron.training import training, utils
    except ImportError:
        return False
    patches.patch(dataset_utils, "compile_helpers", _compile_helpers_unless_built(dataset_utils.compile_helpers))
    patches.patch(training, "build_train_valid_test_data_iterators", _with_rank0_flags(_as_data_source(
        training.build_train_valid_test_data_iterators, parallel_state, session_of), session_of))
    patches.patch(utils, "get_batch_on_this_tp_rank", _as_data_source(
        utils.get_batch_on_this_tp_rank, parallel_state, session_of))
    return True
