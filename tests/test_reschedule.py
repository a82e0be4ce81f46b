"""The microbatch what-if (sim/reschedule.py) against real recordings at two batch sizes.

Every rank of a real gloo run records itself at M microbatches and again at M'; rewriting the M graph
for M' must give the program the M' run really ran: the same nodes, dependencies, sequence numbers and
spans, and the same peak memory up to the few bytes of per-microbatch loss scalars.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bad_inputs import run_in_process  # cli.main in this process, a hang alarm armed

from prism_megatron.graph import load_graph, save_graph
from prism_megatron.graph.model import ExecutionGraph, StringTable, structure_hash
from prism_megatron.sim.cluster import load_cluster
from prism_megatron.sim.des import Simulator
from prism_megatron.sim.reschedule import RescheduleError, microbatches_of, with_microbatches

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
TINY = ["--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "2"]
# name -> (processes, parallel args, the two global batch sizes)
RUNS = {"pp4_1f1b": (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "4"], (12, 20)),
        "tp2_no_pipelining": (2, ["--tensor-model-parallel-size", "2", "--num-layers", "2"], (8, 12))}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record(name: str, tmp: Path) -> dict[int, list[ExecutionGraph]]:
    """Every rank's graph of run `name` at each of its two global batch sizes."""
    nproc, args, sizes = RUNS[name]
    out = {}
    for gbs in sizes:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
             str(_port()), str(REPO / "examples" / "pretrain_gpt.py"), *TINY, *args,
             "--global-batch-size", str(gbs), "--prism-trace-path", str(tmp / str(gbs) / "rank{rank}.prism")],
            capture_output=True, text=True, env=ENV, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[gbs] = [_rank_graph(str(tmp / str(gbs) / f"rank{r}.prism"), r) for r in range(nproc)]
    return out


# tp2 in the default run; the 4-stage pipeline (four recordings of a minute) in .ci/run's slow pass.
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow if n == "pp4_1f1b" else ())
                                        for n in sorted(RUNS)])
def recordings(request, tmp_path_factory):
    return request.param, RUNS[request.param][2], _record(request.param, tmp_path_factory.mktemp(request.param))


def _rank_graph(path: str, rank: int) -> ExecutionGraph:
    g = load_graph(path, check=False)
    return ExecutionGraph(world=g.world, roles={g.world.role(rank): g.graph_of(rank)}, strings=g.strings,
                          meta=g.meta)


def _job_graph(per_rank: list[ExecutionGraph]) -> ExecutionGraph:
    """One graph of the whole job from every rank's recording (one string table)."""
    table = StringTable()
    roles = {}
    for g in per_rank:
        mapping = np.asarray([table(s) for s in g.strings], dtype="i4")
        for role, rg in g.roles.items():
            roles.setdefault(role, rg.remap_strings(mapping))
    return ExecutionGraph(world=per_rank[0].world, roles=roles, strings=table.strings, meta=per_rank[0].meta)


def _only(graph: ExecutionGraph):
    (g,) = graph.roles.values()
    return g


def test_rewritten_graph_is_the_program_the_other_batch_size_ran(recordings):
    _, (small, large), graphs = recordings
    m_small, m_large = (microbatches_of(graphs[s][0]) for s in (small, large))
    assert (m_small, m_large) == (small // 2, large // 2)
    for a, b, target in ((small, large, m_large), (large, small, m_small)):
        for rank, (ga, gb) in enumerate(zip(graphs[a], graphs[b])):
            rewritten = _only(with_microbatches(ga, target))
            real = _only(gb)
            for name_ in real.columns:
                if name_ not in ("start_s", "duration_s"):
                    expected = _strings_as(real.columns[name_], name_, gb, ga)
                    assert np.array_equal(rewritten.columns[name_], expected), (rank, name_)
            assert np.array_equal(rewritten.dep_ptr, real.dep_ptr)
            assert np.array_equal(rewritten.dep_idx, real.dep_idx)
            for span in ("microbatch", "chunk", "first", "last"):
                assert np.array_equal(rewritten.spans[span], real.spans[span]), (rank, span)
            assert len(rewritten.mem_t_s) == len(rewritten.mem_bytes)
    # The last stage keeps a few bytes per microbatch (its reduced losses); nothing else moves in the
    # program. Between two real recordings of one program, though, a stage's peak has differed by one or
    # two activation buffers (mbs x seq x hidden fp32) in CI, never on an idle machine; the cause is not
    # found. The rewrite is held to that, and no looser.
    arg = TINY.index
    activation_bytes = 4 * int(TINY[arg("--micro-batch-size") + 1]) * int(TINY[arg("--seq-length") + 1]) \
        * int(TINY[arg("--hidden-size") + 1])
    bound = 2 * activation_bytes + 16 * abs(m_large - m_small)
    misses = _peak_misses(graphs, small, large, m_small, m_large, bound)
    assert not misses, f"rewritten peaks miss the recorded ones by more than {bound} B: {misses}"


def _peak_misses(graphs, small, large, m_small, m_large, bound) -> list:
    """(from, rank, rewritten peak, recorded peak) where rewriting misses the other recording's peak."""
    misses = []
    for a, b, target in ((small, large, m_large), (large, small, m_small)):
        for rank, (ga, gb) in enumerate(zip(graphs[a], graphs[b])):
            rewritten, real = _only(with_microbatches(ga, target)).peak_bytes, _only(gb).peak_bytes
            if abs(rewritten - real) > bound:
                misses.append((a, rank, rewritten, real))
    return misses


def _strings_as(column, name, src: ExecutionGraph, dst: ExecutionGraph):
    """A string column of `src` in `dst`'s string table (two recordings intern in their own order)."""
    if name not in ("name", "stream", "op", "dim", "dtype"):
        return column
    index = {s: i for i, s in enumerate(dst.strings)}
    return np.asarray([index[src.strings[i]] if i >= 0 else -1 for i in column.tolist()], dtype=column.dtype)


def test_round_trip_and_identity_and_the_simulated_time_grows(recordings):
    _, (small, large), graphs = recordings
    ga = graphs[small][0]
    m = microbatches_of(ga)
    assert with_microbatches(ga, m) is ga
    back = _only(with_microbatches(with_microbatches(ga, m + 3), m))
    orig = _only(ga)
    assert structure_hash(back, ga.strings) == structure_hash(orig, ga.strings)
    assert np.allclose(back.columns["duration_s"], orig.columns["duration_s"])
    job = _job_graph(graphs[small])
    cost = load_cluster("cpu_host").cost_model()
    times = [Simulator(with_microbatches(job, mm), cost).run().iteration_s for mm in (m - 1, m, m + 2, m + 6)]
    assert times == sorted(times) and len(set(times)) == 4
    more = with_microbatches(ga, m + 6)
    assert f"global_batch_size: {(m + 6) * 2}" in more.meta["config"]  # tokens/s and MFU follow
    assert more.meta["microbatches"] == {"captured": m, "simulated": m + 6}


def test_counts_the_schedule_cannot_take_are_refused(recordings):
    name, (small, _), graphs = recordings
    ga = graphs[small][0]
    pp = ga.world.pp
    with pytest.raises(RescheduleError, match=f"at least {pp + 1} simulated"):
        with_microbatches(ga, pp)
    with pytest.raises(RescheduleError, match="positive"):
        with_microbatches(ga, 0)
    g = _only(ga)
    chunk = g.spans["chunk"].copy()
    chunk[-1] = 1  # one backward of a second virtual stage
    interleaved = ExecutionGraph(world=ga.world, strings=ga.strings, meta=ga.meta, roles={
        role: type(g)(**{**g.__dict__, "spans": {**g.spans, "chunk": chunk}}) for role in ga.roles})
    with pytest.raises(RescheduleError, match="interleaved"):
        with_microbatches(interleaved, 8)


def test_simulate_command_takes_the_microbatch_override(recordings, tmp_path, capsys):
    _, (small, _), graphs = recordings
    job = _job_graph(graphs[small])
    m = microbatches_of(job)
    save_graph(job, str(tmp_path / "g.prism"))
    summaries = []
    for extra in ([], [f"microbatches={m + 4}"]):  # the command's entry point, in this process
        code, err = run_in_process(["simulate", str(tmp_path / "g.prism"), "cluster=cpu_host", *extra,
                                    "--json", str(tmp_path / "s.json")], capsys)
        assert code == 0, err[-2000:]
        summaries.append(json.loads((tmp_path / "s.json").read_text()))
    base, more = summaries
    assert base["microbatches"] is None and more["microbatches"] == {"captured": m, "simulated": m + 4}
    assert more["tokens_per_iteration"] == base["tokens_per_iteration"] * (m + 4) // m
    assert more["iteration_time_s"] > base["iteration_time_s"]
