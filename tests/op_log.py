"""Run examples/pretrain_gpt.py and log every aten op of its training steps (forward/backward), in
order, as (op, shapes, dtypes): `python tests/op_log.py OUT.json <pretrain_gpt.py args>`.

The logger is the outermost dispatch mode, entered when the schedule starts and left when it ends, so
a real and a fake run log the same program points."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(out if isinstance(out, (list, tuple)) else (out,)))
                   if isinstance(a, torch.Tensor)]
        self.ops.append([str(func), [list(t.shape) for t in tensors], [str(t.dtype) for t in tensors]])
        return out


def main() -> int:
    import pretrain_gpt
    from megatron.core import pipeline_parallel

    log = OpLog()
    get = pipeline_parallel.get_forward_backward_func

    def logged_get(*args, **kwargs):
        schedule = get(*args, **kwargs)

        def run(*a, **k):
            with log:
                return schedule(*a, **k)
        return run

    pipeline_parallel.get_forward_backward_func = logged_get
    code = pretrain_gpt.main(sys.argv[2:])
    Path(sys.argv[1]).write_text(json.dumps(log.ops))
    return code


if __name__ == "__main__":
    sys.exit(main())
