"""A middle pipeline stage derived from another equals its direct capture (graph/derive.py).

Two captures of a tiny GPT over 64 virtual ranks, every stage captured directly: PP8 with interleaving
(VPP2, 16 micro-batches: warm-up 20..10 on the middle stages) and PP8 1F1B. Each middle stage derived
from stage 1 is compared with its own capture: nodes, dependencies, spans and MoE rows exactly. Memory
and durations are not compared: the known limits of graph/derive.py's docstring.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_megatron.capture.run import Capture
from prism_megatron.config import load_config
from prism_megatron.graph import load_graph
from prism_megatron.graph.derive import DeriveError, derive_stage, merge_order
from prism_megatron.graph.model import structure_parts

REPO = Path(__file__).resolve().parents[1]
MICROBATCHES = 16
LAYOUTS = {"pp8_vpp2": ["parallel.vpp=2"], "pp8_1f1b": []}


def _warmup(pp: int, vpp, stage: int) -> int:
    if vpp:
        return min((pp - stage - 1) * 2 + (vpp - 1) * pp, MICROBATCHES * vpp)
    return min(pp - stage - 1, MICROBATCHES)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def captured(request, tmp_path_factory):
    cfg = load_config(["emulation.execution=fake", "emulation.virtual_world_size=64", "emulation.sandbox_ranks=[]", "parallel.tp=1",
                       "parallel.pp=8", "model.num_layers=16", "train.global_batch_size=128",
                       *LAYOUTS[request.param]], str(REPO / "configs" / "tiny_8192.yaml"))
    out = tmp_path_factory.mktemp(request.param)
    result = Capture(cfg, str(out), workers=2, log=lambda s: None).run()
    return request.param, load_graph(result.graph_path)


def test_merge_order_is_megatrons_warmup_steady_cooldown():
    assert merge_order(4, 2) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                                 ("B", 3)]
    assert merge_order(2, 5) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.slow
def test_every_middle_stage_derived_from_stage_1_equals_its_capture(captured):
    name, g = captured
    pp, vpp = g.world.pp, g.world.vpp
    by_stage = {role.pp: rg for role, rg in g.roles.items()}
    source = by_stage[1]
    for stage in range(2, pp - 1):
        derived = derive_stage(source, g.strings, _warmup(pp, vpp, 1), _warmup(pp, vpp, stage))
        direct = by_stage[stage]
        a, b = structure_parts(derived, g.strings), structure_parts(direct, g.strings)
        for part in ("nodes", "dependencies", "spans", "moe"):
            assert a[part] == b[part], f"{name} stage {stage}: {part} differ"


@pytest.mark.slow
def test_a_first_stage_is_refused_with_the_reason(captured):
    name, g = captured
    first = next(rg for role, rg in g.roles.items() if role.pp == 0)
    pp, vpp = g.world.pp, g.world.vpp
    try:
        derived = derive_stage(first, g.strings, _warmup(pp, vpp, 0), _warmup(pp, vpp, 3))
    except DeriveError as err:
        assert "depends on" in str(err) or "glue" in str(err) or "span sequence" in str(err)
    else:  # the first stage has no receive from a previous stage: its derivation is not stage 3
        third = next(rg for role, rg in g.roles.items() if role.pp == 3)
        assert structure_parts(derived, g.strings)["nodes"] != structure_parts(third, g.strings)["nodes"]
