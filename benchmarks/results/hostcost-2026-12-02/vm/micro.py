"""Hot host cost, on this CPU, of two pieces changed in session 26: the imbalance model's counts
(computed against answered from the memo) and the reduce-op lookup (keyed by the pybind enum against
keyed by its integer). Median of 5 timeit rounds; prints one JSON line.

    python benchmarks/results/hostcost-2026-12-02/vm/micro.py
"""

import json
import statistics
import timeit

import torch.distributed as dist
from torch.distributed import ReduceOp

from prism_megatron.comm.ops import REDUCE_NAMES, reduce_op_of
from prism_megatron.moe.imbalance import Imbalance


def us(fn, n: int) -> float:
    return statistics.median(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


model = Imbalance.parse("zipf(1.2)")
kw = dict(experts=4, tokens=2048, topk=2, layer=3, microbatch=1, iteration=0, source=1)  # the [D] MoE shape
model.counts(**kw)
opts = dist.AllreduceOptions()
opts.reduceOp = ReduceOp.AVG
by_enum = {op: op for op in REDUCE_NAMES}  # the lookup before


def before():
    given = opts.reduceOp
    return by_enum.get(getattr(given, "op", given))


print(json.dumps({
    "counts_computed_us": us(lambda: model._counts(4, 2048, 2, 3, 1, 0, 1), 500),
    "counts_memo_us": us(lambda: model.counts(**kw), 20000),
    "reduce_op_by_enum_us": us(before, 20000),
    "reduce_op_by_value_us": us(lambda: reduce_op_of(opts), 20000),
}))
