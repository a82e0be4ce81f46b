"""DeepSpeed pipeline parallelism (`PipelineEngine`) as a sandbox stage among ghost stages.

The engine runs its whole schedule in `train_batch`; the instructions every schedule passes through
are `_exec_forward_pass`, `_exec_backward_pass` and `_exec_optimizer_step`, wrapped here (on the
engine instance) for what megatron's schedule hooks give megatron: an iteration per `train_batch`,
one forward and one backward span per microbatch, the memory tracker's phase, the optimizer label.

Ghost stages: activations and gradients cross stages by DeepSpeed's p2p (send/recv through the prism
backend). Before the first activations a stage receives the tensors' metadata (dtype, shape) from its
previous stage; a ghost sender's metadata is data the ghost policy cannot give (mirror would hand back
this stage's own empty buffer). So when the previous stage is a ghost, the metadata is computed: the
PipelineModule's layers of every stage up to the sender are built on the meta device (no memory, no
compute) and run on the shapes of the first microbatch's inputs, peeked from `train_batch`'s data
iterator (which DeepSpeed asks every stage to pass). The metadata receive itself still happens, so
the stage's communication is the real stage's.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch


class PipeHooks:
    wrapped = ("train_batch", "_recv_tensor_meta")
    """Engine methods replaced on the instance (called as `self.<name>`)."""
    instructions = {"ForwardPass": "_exec_forward_pass", "BackwardPass": "_exec_backward_pass",
                    "OptimizerStep": "_exec_optimizer_step"}
    """Schedule instructions, which the engine dispatches through its class-level
    `_INSTRUCTION_MAP` (unbound functions): an instance-level copy maps them to the wrappers."""

    def install_instructions(self) -> None:
        from deepspeed.runtime.pipe import schedule

        engine = self.engine
        table = dict(type(engine)._INSTRUCTION_MAP)
        for kind, name in self.instructions.items():
            wrapped = getattr(self, name)(getattr(engine, name))
            table[getattr(schedule, kind)] = lambda _engine, _w=wrapped, **kwargs: _w(**kwargs)
        engine._INSTRUCTION_MAP = table

    def __init__(self, hooks: Any) -> None:
        self.hooks, self.engine = hooks, hooks.engine
        self.recorder, self.tracker = hooks.recorder, hooks.tracker
        self.forwards = self.backwards = 0
        self.sample: Any = None  # the first microbatch's inputs (their shapes)

    def train_batch(self, original):
        @functools.wraps(original)
        def train_batch(data_iter=None, *args, **kwargs):
            if data_iter is not None and self.sample is None:
                first = next(data_iter)
                inputs = first[0] if isinstance(first, (tuple, list)) else first
                self.sample = _meta(inputs)  # shapes only: holding the batch would be memory
                data_iter = itertools.chain([first], data_iter)
                del first, inputs
            self.forwards = self.backwards = 0
            if self.hooks.inst.iterations is not None:
                self.hooks.inst.iterations.begin()
            if self.recorder is not None:
                self.recorder.begin_iteration()
            return original(data_iter, *args, **kwargs)

        return train_batch

    def _span(self, original, phase: str):
        @functools.wraps(original)
        def step(*args, **kwargs):
            microbatch = self.forwards if phase == "forward" else self.backwards
            previous = self.hooks._phase(phase)
            if self.recorder is not None:
                self.recorder.span_begin(phase, microbatch, 0)
            try:
                return original(*args, **kwargs)
            finally:
                if self.recorder is not None:
                    self.recorder.span_end()
                self.hooks._phase(previous)
                if phase == "forward":
                    self.forwards += 1
                else:
                    self.backwards += 1

        return step

    def _exec_forward_pass(self, original):
        return self._span(original, "forward")

    def _exec_backward_pass(self, original):
        return self._span(original, "backward")

    def _exec_optimizer_step(self, original):
        @functools.wraps(original)
        def optimizer_step(*args, **kwargs):
            if self.recorder is not None:
                self.recorder.enter("optimizer.step")
            try:
                return original(*args, **kwargs)
            finally:
                if self.recorder is not None:
                    self.recorder.exit()
                self.hooks.classify()

        return optimizer_step

    def _recv_tensor_meta(self, original):
        @functools.wraps(original)
        def recv_tensor_meta(send_stage):
            session = self.hooks.inst.session
            sender = self.engine.grid.stage_to_global(send_stage)
            if session is None or session.physical.physical_of(sender) is not None or self.sample is None:
                return original(send_stage)
            from deepspeed.runtime.pipe import p2p
            from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE

            buffer = torch.empty(TENSOR_META_SIZE, dtype=torch.int32, device=self.engine.device)
            p2p.recv(buffer, send_stage)  # the stage's own communication, as at scale
            sent = sent_by_stage(self.engine, send_stage, self.sample)
            if isinstance(sent, torch.Tensor):
                return self.engine._allocate_or_extend_buffers(0, list(sent.shape), sent.dtype)
            return tuple(self.engine._allocate_or_extend_buffers(i, list(t.shape), t.dtype)
                         for i, t in enumerate(sent))

        return recv_tensor_meta


def sent_by_stage(engine: Any, stage: int, sample: Any) -> Any:
    """What pipeline stage `stage` sends on (meta tensors): the PipelineModule's layers of stages
    0..stage built on the meta device and run on the inputs' shapes, in the engine's precision."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    module = engine.module
    dtype = (torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled()
             else None)

    x = _meta(sample)
    with torch.device("meta"), torch.no_grad():
        for spec in module._layer_specs[:module.parts[stage + 1]]:
            if isinstance(spec, (LayerSpec, TiedLayerSpec)):
                layer = spec.build()
                if dtype is not None:
                    layer = layer.to(dtype)
                forward = getattr(spec, "forward_fn", None)
                x = forward(layer, x) if forward is not None else layer(x)
            elif callable(spec):
                x = spec(x)
    return x


def _meta(value: Any) -> Any:
    """`value` (a tensor or a tuple of them) as meta tensors of the same shapes and dtypes."""
    if isinstance(value, (tuple, list)):
        return tuple(_meta(v) for v in value)
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value
