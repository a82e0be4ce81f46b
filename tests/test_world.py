"""Pure tests of prism_megatron.world: our groups must be exactly megatron-core's.

The reference is megatron-core's own ``initialize_model_parallel``, run with ``create_group``
replaced by a recorder and torch.distributed faked to a world of N ranks: no process group is made.
"""

from __future__ import annotations

import itertools
import math
import random

import megatron.core.parallel_state as ps
import pytest
import torch

from prism_megatron.world import AXES, Dim, Role, VirtualWorld

PP_LAST = "tp-cp-ep-dp-pp"
PP_DP = "tp-cp-ep-pp-dp"

# megatron's group_desc -> our dim. Anything else megatron creates must be in _SKIPPED, so a group
# added by a new megatron version fails the test instead of going unnoticed.
_DESC_TO_DIM = {
    "TENSOR_MODEL_PARALLEL_GROUP": Dim.TP,
    "PIPELINE_MODEL_PARALLEL_GROUP": Dim.PP,
    "DATA_PARALLEL_GROUP": Dim.DP,
    "CONTEXT_PARALLEL_GROUP": Dim.CP,
    "DATA_PARALLEL_GROUP_WITH_CP": Dim.DP_CP,
    "MODEL_PARALLEL_GROUP": Dim.TP_PP,
    "TENSOR_AND_DATA_PARALLEL_GROUP": Dim.TP_DP,
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": Dim.TP_DP_CP,
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": Dim.TP_CP,
    "EXPERT_MODEL_PARALLEL_GROUP": Dim.EP,
    "EXPERT_TENSOR_PARALLEL_GROUP": Dim.ETP,
    "EXPERT_DATA_PARALLEL_GROUP": Dim.EXPERT_DP,
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": Dim.TP_EP,
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": Dim.TP_EP_PP,
    "EMBEDDING_GROUP": Dim.EMBEDDING,
    "POSITION_EMBEDDING_GROUP": Dim.POSITION_EMBEDDING,
}
_SKIPPED = {
    "DATA_PARALLEL_GROUP_GLOO",
    "DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
}


class MegatronRejected(Exception):
    """megatron's initialize_model_parallel refused the configuration."""


def megatron_groups(monkeypatch, world: VirtualWorld) -> dict[Dim, list[tuple[int, ...]]]:
    """The groups megatron-core's initialize_model_parallel creates for ``world``, per dim."""
    recorded: list[tuple[str, tuple[int, ...]]] = []

    def record(ranks=None, timeout=None, backend=None, pg_options=None,
               use_local_synchronization=False, group_desc=None):
        recorded.append((group_desc, tuple(ranks)))
        return object()

    with monkeypatch.context() as m:
        m.setattr(ps, "create_group", record)
        m.setattr(torch.distributed, "is_initialized", lambda: True)
        m.setattr(torch.distributed, "get_world_size", lambda group=None: world.world_size)
        m.setattr(torch.distributed, "get_rank", lambda group=None: 0)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=world.tp,
                pipeline_model_parallel_size=world.pp,
                virtual_pipeline_model_parallel_size=world.vpp,
                context_parallel_size=world.cp,
                expert_model_parallel_size=world.ep,
                expert_tensor_parallel_size=world.etp,
                order=world.order,
            )
        except (RuntimeError, AssertionError) as e:
            raise MegatronRejected(str(e)) from e
        finally:
            ps.destroy_model_parallel()
    unknown = {d for d, _ in recorded} - set(_DESC_TO_DIM) - _SKIPPED
    assert not unknown, f"megatron created groups this test does not map: {unknown}"
    out: dict[Dim, list[tuple[int, ...]]] = {dim: [] for dim in Dim}
    for desc, ranks in recorded:
        if desc in _DESC_TO_DIM:
            out[_DESC_TO_DIM[desc]].append(ranks)
    return out


def unchecked_world(**kw) -> VirtualWorld:
    """A VirtualWorld built without validation, to ask megatron about configs we would reject."""
    world = object.__new__(VirtualWorld)
    fields = dict(tp=1, pp=1, cp=1, ep=1, etp=None, order=PP_LAST, gpus_per_node=8, vpp=None)
    for name, value in {**fields, **kw, "_cache": {}}.items():
        object.__setattr__(world, name, value)
    return world


GRID = [
    dict(world_size=8),
    dict(world_size=8, tp=8),
    dict(world_size=8, pp=8, vpp=2),
    dict(world_size=8, tp=2, pp=2, cp=2),
    dict(world_size=8, ep=8),
    dict(world_size=8, tp=2, ep=4, etp=1),
    dict(world_size=16, tp=2, pp=2, ep=2, vpp=3),
    dict(world_size=16, tp=2, cp=2, ep=4),  # EP and CP together
    dict(world_size=16, tp=4, pp=2, ep=2, etp=2),
    dict(world_size=24, tp=2, pp=3, cp=2, ep=2),  # not a power of two
    dict(world_size=32, tp=4, pp=2, ep=4, etp=1),
    dict(world_size=64, tp=2, pp=4, cp=2, ep=4, etp=1, vpp=2),
    dict(world_size=8, tp=2, pp=2, order=PP_DP),
    dict(world_size=16, tp=2, pp=2, cp=2, ep=4, etp=1, order=PP_DP),
    dict(world_size=32, tp=4, pp=2, ep=2, etp=2, order=PP_DP, vpp=2),
    dict(world_size=48, tp=2, pp=3, ep=2, etp=1, order=PP_DP),
    dict(world_size=16, tp=2, ep=4, etp=1, order=PP_DP),  # pp = 1: dp may differ from expert_dp
    dict(world_size=64, tp=4, cp=2, pp=4, ep=8, etp=1, order=PP_DP),
    dict(world_size=16, tp=2, cp=2, pp=2, ep=2, etp=2, order="tp-pp-cp-ep-dp"),
    dict(world_size=12, tp=2, pp=3, order="pp-tp-dp"),  # cp, ep left out: size 1
    dict(world_size=1024, tp=8, pp=8, ep=8, etp=1),
    dict(world_size=1024, tp=4, pp=4, cp=4, ep=16, etp=1, order=PP_DP),
    dict(world_size=8192, tp=8, pp=16, vpp=4),
    dict(world_size=8192, tp=4, pp=8, cp=2, ep=8, etp=1, order=PP_DP),
    dict(world_size=8192, tp=8, pp=4, ep=64, etp=1),
]


def _id(kw: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in kw.items() if k != "order") + (
        "-" + kw["order"] if "order" in kw else ""
    )


def assert_same_as_megatron(monkeypatch, world: VirtualWorld) -> None:
    expected = megatron_groups(monkeypatch, world)
    for dim in Dim:
        assert world.groups(dim) == expected[dim], dim
        # dim_of sorts members (torch's new_group does too); that is only sound if megatron's are.
        assert all(list(g) == sorted(g) for g in expected[dim]), dim


@pytest.mark.parametrize("kw", GRID, ids=_id)
def test_groups_equal_megatron(monkeypatch, kw):
    assert_same_as_megatron(monkeypatch, VirtualWorld(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        dict(world_size=65536, tp=8, pp=16),
        dict(world_size=65536, tp=4, pp=8, cp=2, ep=8, etp=1, order=PP_DP),
    ],
    ids=_id,
)
def test_groups_equal_megatron_at_65536(monkeypatch, kw):
    # megatron itself takes ~3.5 s here (pure Python per rank); every dim is compared.
    assert_same_as_megatron(monkeypatch, VirtualWorld(**kw))


def _small_configs():
    for n, tp, pp, cp, ep, etp, order in itertools.product(
        (8, 12, 16), (1, 2, 4), (1, 2, 3), (1, 2), (1, 2, 4), (None, 1, 2),
        (PP_LAST, PP_DP, "tp-dp-pp", "tp-pp-cp-ep-dp"),
    ):
        yield dict(world_size=n, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
    yield dict(world_size=8, pp=1, vpp=2)
    yield dict(world_size=8, pp=2, vpp=2)


def test_accepts_exactly_what_megatron_accepts(monkeypatch):
    """Over a dense grid of small worlds, we reject a config iff megatron does; else same groups."""
    accepted = rejected = 0
    for kw in _small_configs():
        try:
            expected = megatron_groups(monkeypatch, unchecked_world(**kw))
        except MegatronRejected:
            with pytest.raises(ValueError):
                VirtualWorld(**kw)
            rejected += 1
            continue
        world = VirtualWorld(**kw)
        assert {d: world.groups(d) for d in Dim} == expected, kw
        accepted += 1
    assert accepted > 100 and rejected > 100  # the grid really exercises both sides


@pytest.mark.parametrize(
    "kw, factors",
    [
        (dict(world_size=8192, tp=8, pp=16, cp=3),
         ["virtual world 8192 is not divisible by tp(8) * pp(16) * cp(3) = 384; choose sizes"]),
        (dict(world_size=64, tp=2, pp=2, ep=3),
         ["64", "etp(2)", "etp defaults to tp", "ep(3)", "pp(2)", "= 12"]),
        (dict(world_size=100, tp=8, ep=7, etp=1),  # both sides wrong: both reported
         ["tp(8) * pp(1) * cp(1) = 8", "etp(1) * ep(7) * pp(1) = 7"]),
        (dict(world_size=8, tp=0, cp=-2), ["tp=0", "cp=-2", "positive"]),
        (dict(world_size=8.0), ["world_size=8.0"]),
        (dict(world_size=8, gpus_per_node=0), ["gpus_per_node=0"]),
        (dict(world_size=8, order="tp-sp-dp-pp"), ["'sp'", "tp, cp, ep, dp, pp"]),
        (dict(world_size=8, order="tp-dp-dp-pp"), ["repeats", "'dp'"]),
        (dict(world_size=16, cp=2, ep=2, order="tp-dp-pp"), ["leaves out", "cp(2)", "ep(2)"]),
        (dict(world_size=8, vpp=2), ["vpp(2)", "pp(1)"]),
        (dict(world_size=16, vpp=2, cp=2, order="tp-dp-pp"), ["vpp(2)", "leaves out cp(2)"]),
        (dict(world_size=8, order=None), ["order must be a string"]),
        (dict(world_size=16, tp=2, pp=2, ep=4, etp=1, order=PP_DP),
         ["pp not last", "dp = world/(tp*pp*cp) = 4", "expert_dp = world/(etp*ep*pp) = 2",
          "tp(2) * cp(1)", "etp(1) * ep(4)", "put pp last"]),
        (dict(world_size=16, tp=2, pp=2, ep=2, etp=1, order="tp-pp-cp-ep-dp"),
         ["rank step 2", "rank step 1", "put pp last"]),
    ],
)
def test_invalid_config_names_every_factor(kw, factors):
    with pytest.raises(ValueError) as info:
        VirtualWorld(**kw)
    message = str(info.value)
    for factor in factors:
        assert factor in message


def test_invalid_queries_raise():
    world = VirtualWorld(world_size=16, tp=2, pp=2)
    for bad in (-1, 16, 1.5):
        with pytest.raises(ValueError, match="expected 0 <= rank < 16"):
            world.group(bad, Dim.TP)
    with pytest.raises(ValueError, match="unknown group dim 'sp'"):
        world.group(0, "sp")
    with pytest.raises(ValueError, match="not a role"):
        world.role_members(Role(pp=5, tp=0, cp=0, ep=0, etp=0))


CONSISTENCY = [
    dict(world_size=64, tp=2, pp=4, cp=2, ep=4, etp=1, gpus_per_node=8),
    dict(world_size=48, tp=2, pp=3, ep=2, etp=1, order=PP_DP, gpus_per_node=4),
    dict(world_size=16, tp=2, ep=4, etp=1, order=PP_DP),
    dict(world_size=12, tp=2, pp=3, order="pp-tp-dp", gpus_per_node=5),
]


@pytest.mark.parametrize("kw", CONSISTENCY, ids=_id)
def test_coords_roles_nodes_consistent(kw):
    w = VirtualWorld(**kw)
    n = w.world_size
    assert w.num_nodes == math.ceil(n / w.gpus_per_node)
    for r in range(n):
        assert w.node(r) * w.gpus_per_node + w.local_rank(r) == r
        c = w.coords(r)
        # A coordinate is the rank's index in its group of that dim (megatron's group rank).
        for key, dim in [("tp", Dim.TP), ("cp", Dim.CP), ("dp", Dim.DP), ("pp", Dim.PP),
                         ("ep", Dim.EP), ("etp", Dim.ETP), ("expert_dp", Dim.EXPERT_DP)]:
            assert w.group(r, dim)[c[key]] == r
        role = w.role(r)
        assert role == Role(pp=c["pp"], tp=c["tp"], cp=c["cp"], ep=c["ep"], etp=c["etp"])
        assert r in w.role_members(role)
        # A pipeline stage's embedding membership follows its role.
        assert bool(w.group(r, Dim.EMBEDDING)) == (role.pp in (0, w.pp - 1))

    roles = w.roles()
    assert roles == sorted(set(roles))
    # Within a pp stage a rank's role is its rank modulo both the dense tp*cp block and the
    # expert etp*ep block, hence the lcm.
    assert len(roles) == w.pp * math.lcm(w.tp * w.cp, (w.etp or w.tp) * w.ep)
    members = [w.role_members(role) for role in roles]
    assert sorted(itertools.chain.from_iterable(members)) == list(range(n))  # a partition
    for role, ranks in zip(roles, members):
        assert len(ranks) == n // len(roles)  # every role has as many replicas
        assert w.representative(role) == min(ranks)
        assert {w.role(r) for r in ranks} == {role}
        # Members are data-parallel replicas: they differ in (dp, expert_dp) and nothing else.
        replica_ids = {(w.coords(r)["dp"], w.coords(r)["expert_dp"]) for r in ranks}
        assert len(replica_ids) == len(ranks)


@pytest.mark.parametrize("kw", CONSISTENCY[:2], ids=_id)
def test_dim_of_round_trips(kw):
    w = VirtualWorld(**kw)
    rng = random.Random(0)
    for r in range(w.world_size):
        for dim in Dim:
            members = w.group(r, dim)
            if not members:
                continue
            first = next(d for d in Dim if w.group(members[0], d) == members)
            shuffled = rng.sample(members, len(members))
            assert w.dim_of(members) == w.dim_of(shuffled) == first
            assert w.group(members[0], w.dim_of(members)) == members
    assert w.dim_of([0, 1, 2]) is None  # a prefix of a tp-dp group is no group
    assert w.dim_of([]) is None


def test_dims_and_cache_keep_world_a_plain_value():
    assert AXES == tuple(Dim) and len(AXES) == 16 and Dim.TP_PP == "tp_pp"
    a = VirtualWorld(world_size=64, tp=2, pp=4, ep=4)
    b = VirtualWorld(world_size=64, tp=2, pp=4, ep=4)
    a.groups(Dim.TP)  # fills a's cache only
    assert a == b and hash(a) == hash(b) and "_cache" not in repr(a)
    assert a.dp == 8 and a.expert_dp == 2 and a.num_nodes == 8
    with pytest.raises(AttributeError):
        a.tp = 4  # frozen
