"""The prism backend with ghosts only: one process plays virtual rank 5 of a world of 16.

Every case of `collective_battery` (the operations megatron-core and deepspeed issue) runs on the world
group and on subgroups made by `dist.new_group`, under each ghost policy, and is checked against the
documented semantics: the result, the events it records, and `session.log.rows()` for the whole run.
"""

from __future__ import annotations

import collective_battery as battery
import pytest
import torch
import torch.distributed as dist

from prism_megatron.comm import native
from prism_megatron.comm.ghost import GhostPolicy
from prism_megatron.comm.session import PhysicalWorld, VirtualSession

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch renames what megatron calls

WORLD_SIZE = 16
SANDBOX = (5,)
GROUPS = {"world": None, "tp4": (2, 5, 9, 11), "trio": (3, 5, 6), "solo": (5,)}
VIEWS = battery.views(WORLD_SIZE, SANDBOX, GROUPS, me=SANDBOX[0])
CASE_PARAMS = [pytest.param(group, name, id=f"{group}-{name}")
               for group, view in VIEWS.items() for name, case in battery.CASES.items() if case.applies(view)]


@pytest.fixture(scope="module", params=battery.POLICIES)
def battery_run(request):
    """(policy, the battery's output) — one run per policy, shared by the tests of this module."""
    return request.param, battery.run_battery(request.param, WORLD_SIZE, SANDBOX, GROUPS)


@pytest.mark.parametrize("group,name", CASE_PARAMS)
def test_result_follows_the_policy(battery_run, group, name, request):
    policy, out = battery_run
    case, view = battery.CASES[name], VIEWS[group]
    reason = case.known_bug(view, policy)
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    error = out["errors"].get(group, {}).get(name)
    assert error is None, error
    case.check(view, policy, out["results"][group][name])


@pytest.mark.parametrize("group,name", [p for p in CASE_PARAMS if battery.CASES[p.values[1]].events])
def test_events_are_recorded_in_nccl_tests_sizes(battery_run, group, name, request):
    _, out = battery_run
    case, view = battery.CASES[name], VIEWS[group]
    reason = case.known_event_bug(view)
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    battery.check_events(view, case.events(view), out["events"][group][name], f"{group}/{name}")


def test_log_rows_count_every_operation(battery_run):
    """`rows()` after the tensor cases: one row per (op, dim), calls and bytes summed exactly."""
    _, out = battery_run
    expected = {group: {name: battery.CASES[name].events(VIEWS[group]) for name in out["events"][group]
                        if battery.CASES[name].events} for group in out["events"]}
    dims = {group: view.dim for group, view in VIEWS.items()}
    assert out["rows"] == battery.expected_rows(expected, dims)
    assert {row["op"] for row in out["rows"]} >= {"gather", "scatter"}


# -- one-process behaviour outside the battery --------------------------------------------------------

@pytest.fixture()
def session():
    battery.register_prism_backend()
    session = VirtualSession(world_size=WORLD_SIZE, physical=PhysicalWorld(rank=0, sandbox_ranks=SANDBOX),
                             policy=GhostPolicy(name="mirror", seed=battery.SEED))
    dist.init_process_group("prism", store=dist.HashStore(), rank=SANDBOX[0], world_size=WORLD_SIZE,
                            pg_options=session)
    yield session
    dist.destroy_process_group()


def test_recv_from_any_source_is_refused_with_a_clear_error(session):
    with pytest.raises(NotImplementedError, match="named rank"):
        dist.recv(torch.empty(4))


def test_subgroup_sees_its_group_ranks_and_labels_events_other(session):
    group = dist.new_group([2, 5, 9, 11])
    assert (dist.get_rank(group), dist.get_world_size(group)) == (1, 4)
    assert dist.get_process_group_ranks(group) == [2, 5, 9, 11]
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), 4.0))
    assert session.log.rows() == [{"op": "all_reduce", "dim": "other", "calls": 1, "bytes": 12}]


def test_group_name_is_the_registered_name(session):
    group = dist.new_group([2, 5, 9, 11])
    assert group.group_name == dist.distributed_c10d._world.pg_names[group]


def _native_session(policy: str = "mirror"):
    return native.load().Session(WORLD_SIZE, list(SANDBOX), 0, native.POLICY_CODES[policy], battery.SEED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32])
@pytest.mark.parametrize("n", [2, 8, 24, 257, 8192])
def test_a_mirror_sum_with_one_real_member_is_n_times_the_local_tensor_bit_for_bit(dtype, n):
    """The fold multiplies by a cached 0-dim tensor where the dtype holds n exactly (bf16 does not
    hold 257, where it multiplies by the number): the same bits as `mul_(n)`, each call, any dtype."""
    session = _native_session()
    base = (torch.randn(4096) * 100).to(dtype)
    for _ in range(2):  # the second call takes the cached factor
        out = base.clone()
        native.load().finish_reduction(session, out, 0, n, 1, 0)
        assert torch.equal(out, base.clone().mul_(n))


@pytest.mark.parametrize("have,rows", [(3, 7), (3, 9), (5, 2), (4, 4), (1, 6)])
def test_a_mirror_slot_of_another_length_repeats_the_source_rows_in_order(have, rows):
    """An all-to-all ghost slot longer or shorter than the mirrored member's piece: its rows are the
    source's rows repeated from the first, truncated (at most two copies, however many repeats)."""
    session, fill = _native_session(), native.load().fill
    source = torch.arange(have * 2, dtype=torch.float32).reshape(have, 2)
    dst = torch.full((rows, 2), -1.0)
    fill(session, dst, source, 0)
    want = torch.stack([source[i % have] for i in range(rows)])
    assert torch.equal(dst, want)
    flat = torch.full((rows * 2 + 1,), -1.0)  # other trailing dims: tiled flat
    fill(session, flat, source, 0)
    assert torch.equal(flat, source.reshape(-1).repeat(rows + 1)[:rows * 2 + 1])


@pytest.mark.parametrize("rows", [[2, 2, 2, 2], [2, 0, 5, 1], [0, 0, 0, 0], [2, 7, 3, 2]])
@pytest.mark.parametrize("have", [2, 0])
def test_one_real_members_all_to_all_is_its_own_piece_tiled_into_every_slot_at_once(rows, have):
    """The only real member under mirror: the whole output is made in one copy or one gather, and each
    slot holds what the slot-by-slot fill gives it (the piece's rows repeated or cut; zeros from an
    empty piece). A device tensor with unequal slots is left to the slot-by-slot fill (its index
    would come from the device allocator)."""
    mirror_own_piece, fill = native.load().mirror_own_piece, native.load().fill
    session = _native_session()
    local = torch.arange(have * 3, dtype=torch.float32).reshape(have, 3) + 1
    rows = [have, *rows[1:]]  # our own slot (the first here) holds what we send ourselves
    out = torch.full((sum(rows), 3), -1.0)
    assert mirror_own_piece(out, local, rows)
    for slot, r in zip(out.split(rows), rows):
        want = torch.full((r, 3), -1.0)
        fill(session, want, local, 0)
        assert torch.equal(slot, want)
    meta = torch.empty((sum(rows), 3), device="meta")
    uneven = rows.count(have) != len(rows) and have > 0
    assert mirror_own_piece(meta, local.to("meta"), rows) is not uneven
    assert not mirror_own_piece(torch.empty(sum(rows) + 1, 3), local, rows)  # splits short of the output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64, torch.bool])
@pytest.mark.parametrize("shape", [(256, 48), (3, 5), (7,), (2, 4, 6)])
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_a_broadcast_copy_viewed_as_wider_elements_writes_the_same_bytes(dtype, shape, offset):
    """The ghosts' slots as copies of ours, through the widened view the GPU takes (forced here on
    CPU): byte for byte the plain broadcast copy, whatever the row's length, dtype or alignment
    (rows and slots that do not split into wider elements fall back to the plain copy)."""
    copy_broadcast = native.load().copy_broadcast
    numel = torch.Size(shape).numel()
    store = (torch.randn(numel + offset) * 50).to(dtype)
    row = store[offset:].view(shape)  # an offset view: its address may not align to 16 bytes
    for widen in (1, 0):
        dst = torch.zeros(5 * numel + offset, dtype=dtype)[offset:].view(5, numel)
        copy_broadcast(dst, row, widen)
        assert torch.equal(dst, row.reshape(1, -1).expand(5, -1))
    wide = torch.zeros(4, numel, dtype=torch.float64)
    copy_broadcast(wide, row, 1)  # another dtype: converted, as a plain copy converts
    assert torch.equal(wide, row.reshape(1, -1).expand(4, -1).to(torch.float64))


def test_the_log_counts_every_operation_from_several_threads(session):
    """The summary's comm rows count every operation of a run, from several threads at once (an
    autograd thread's collectives), with none lost or counted twice, and every listener hears each."""
    import threading

    group = dist.new_group([2, 5, 9, 11])
    seen = []
    session.log.listeners.append(seen.append)

    def run(op: str, count: int) -> None:
        for i in range(count):
            t = torch.ones(1 + i % 2)
            if op == "all_reduce":
                dist.all_reduce(t, group=group)
            else:
                dist.all_gather_into_tensor(torch.empty(4 * t.numel()), t, group=group)

    threads = [threading.Thread(target=run, args=(op, 503)) for op in ("all_reduce", "all_gather")]
    for t in threads:
        t.start()
    run("all_reduce", 7)
    for t in threads:
        t.join()
    assert len(seen) == 1013
    assert session.log.total_calls == 1013
    assert session.log.rows() == [
        {"op": "all_gather", "dim": "other", "calls": 503, "bytes": 4 * (252 * 4 + 251 * 8)},
        {"op": "all_reduce", "dim": "other", "calls": 510, "bytes": 252 * 4 + 251 * 8 + 4 * 4 + 3 * 8}]
    assert session.log.rows() == session.log.rows()
