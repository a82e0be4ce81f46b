"""Per-operation host time of the prism backend, by operation and group dim, in a sandbox process
(`pretrain_gpt.py`) whose environment has OPSTAT_OUT (a folder) and this folder on PYTHONPATH.

For each call of a `PrismGroup` operation: the host time of the call (the whole method, the
operation wrapper included), and on CUDA whether the current stream had finished all its work when
the call began (`Stream.query()`): there the device is idle, waiting for the host, so the backend's
host time is device time the real rank would not have spent (a real NCCL launch costs about 16 us
on this host). Also the recorder's `comm_begin` and `comm_issued`, the parts of that time that are
the recorder's. At exit, one JSON per process: OPSTAT_OUT/opstat-<pid>.json."""

import os
import sys

if os.environ.get("OPSTAT_OUT") and sys.argv and sys.argv[0].endswith("pretrain_gpt.py"):
    import atexit
    import collections
    import json
    import time

    import torch

    from prism_megatron.comm import backend as _backend
    from prism_megatron.trace import recorder as _recorder

    _rows = collections.defaultdict(list)  # (name, dim) -> [(host s, idle at entry)]
    _cuda = torch.cuda.is_available()

    def _wrap_op(name):
        inner = getattr(_backend.PrismGroup, name)

        def call(self, *args, **kwargs):
            idle = bool(_cuda and torch.cuda.current_stream().query())
            start = time.perf_counter()
            out = inner(self, *args, **kwargs)
            _rows[(name, self.dim)].append((time.perf_counter() - start, idle))
            return out

        setattr(_backend.PrismGroup, name, call)
        return call

    for _name in ("allreduce", "allgather", "_allgather_base", "_reduce_scatter_base", "broadcast",
                  "send", "recv", "alltoall_base", "barrier", "allreduce_coalesced",
                  "reduce_scatter_tensor_coalesced", "allgather_into_tensor_coalesced", "reduce",
                  "reduce_scatter", "alltoall", "gather", "scatter", "allgather_coalesced"):
        _wrapped = _wrap_op(_name)
        for _alias, _of in (("all_gather_single", "_allgather_base"),
                            ("reduce_scatter_single", "_reduce_scatter_base"),
                            ("all_to_all_single", "alltoall_base"),
                            ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
                            ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")):
            if _of == _name:
                setattr(_backend.PrismGroup, _alias, _wrapped)

    def _wrap_rec(name):
        inner = getattr(_recorder.Recorder, name)

        def call(self, *args, **kwargs):
            start = time.perf_counter()
            out = inner(self, *args, **kwargs)
            _rows[("recorder." + name, "")].append((time.perf_counter() - start, False))
            return out

        setattr(_recorder.Recorder, name, call)

    for _name in ("comm_begin", "comm_issued"):
        _wrap_rec(_name)

    def _dump():
        out = {}
        for (name, dim), rows in _rows.items():
            rows = rows[len(rows) // 4:]  # past set-up and the first iterations
            if not rows:
                continue
            times = sorted(t for t, _ in rows)
            idle = [t for t, i in rows if i]
            out[f"{name}/{dim}"] = {"n": len(rows), "sum_s": sum(times), "median_us": times[len(times) // 2] * 1e6,
                                    "idle_n": len(idle), "idle_sum_s": sum(idle),
                                    "idle_median_us": sorted(idle)[len(idle) // 2] * 1e6 if idle else None}
        mode = "?"
        if "--prism-config" in sys.argv:
            try:
                text = open(sys.argv[sys.argv.index("--prism-config") + 1]).read()
                mode = "realtime" if "clock: realtime" in text else "virtual"
            except OSError:
                pass
        path = os.path.join(os.environ["OPSTAT_OUT"], f"opstat-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.argv, "mode": mode, "ops": out}, f, indent=1)
        os.replace(path + ".tmp", path)

    atexit.register(_dump)
