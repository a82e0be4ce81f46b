"""The prism backend over several real gloo processes plus ghosts.

Two virtual worlds of 8 ranks: 2 processes playing ranks (1, 6), and 4 playing (0, 3, 4, 7). Each
process runs the whole `collective_battery` under every ghost policy, on the world group and on
subgroups that mix real and ghost members (and one of real members only); the parent then checks
every real member's results and events against the documented semantics (which include the other
processes' contributions, so real data must have crossed processes), and that real members got
bitwise identical results wherever the semantics promise it (mirror and random ghost data included).
"""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import collective_battery as battery
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.multiproc, pytest.mark.filterwarnings("ignore::FutureWarning")]

DEADLINE_S = 150.0
"""For one world, every policy, spawn included: a hang fails the test instead of blocking CI."""
WORLDS = {
    "p2": (8, (1, 6), {"world": None, "mixed": (0, 1, 2, 6), "odd": (1, 3, 6), "real": (1, 6)}),
    "p4": (8, (0, 3, 4, 7), {"world": None, "mixed": (0, 1, 3, 4, 5), "real": (3, 7), "one_real": (2, 4, 6)}),
}


def member_views(world: str, group: str) -> list[battery.GroupView]:
    """The group as each of its real members sees it, in physical-rank order."""
    world_size, sandboxes, groups = WORLDS[world]
    views = [battery.views(world_size, sandboxes, groups, me).get(group) for me in sandboxes]
    return [view for view in views if view is not None]


def _params(world_level: bool = False) -> list:
    return list(_iter_params(world_level))


def _iter_params(world_level: bool):
    for world, (_, _, groups) in WORLDS.items():
        for policy in battery.POLICIES:
            if world_level:
                yield pytest.param(world, policy, id=f"{world}-{policy}")
                continue
            for group in groups:
                view = member_views(world, group)[0]
                for name, case in battery.CASES.items():
                    if case.applies(view):
                        yield pytest.param(world, group, policy, name, id=f"{world}-{group}-{policy}-{name}")


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    """world -> [each physical rank's battery output per policy]; each world spawned once, lazily."""
    cache: dict[str, object] = {}

    def get(world: str) -> list[dict]:
        if world not in cache:
            try:
                cache[world] = _spawn(world, tmp_path_factory.mktemp(world))
            except Exception as error:  # noqa: BLE001 - every test of this world reports it
                cache[world] = error
        if isinstance(cache[world], Exception):
            pytest.fail(f"world {world} did not run: {cache[world]}")
        return cache[world]

    return get


def _spawn(world: str, out_dir) -> list[dict]:
    world_size, sandboxes, groups = WORLDS[world]
    # forkserver: torch is imported once, by the server, not once per worker (CI has two cores).
    multiprocessing.get_context("forkserver").set_forkserver_preload(["collective_battery"])
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.start_processes(battery.worker, args=(store.port, world_size, sandboxes, groups, str(out_dir)),
                             nprocs=len(sandboxes), join=False, start_method="forkserver")
    try:
        battery.wait_all(ctx, DEADLINE_S)
    except Exception as error:
        errors = "".join(p.read_text() for p in sorted(out_dir.glob("*.err")))
        raise RuntimeError(f"{error}\n{errors}") from error
    return [torch.load(out_dir / f"{p}.pt", weights_only=False) for p in range(len(sandboxes))]


def _outputs(world_results, world: str, group: str, policy: str):
    """(view, battery output of that member's process) for each real member of the group."""
    _, sandboxes, _ = WORLDS[world]
    runs = world_results(world)
    return [(view, runs[sandboxes.index(view.me)][policy]) for view in member_views(world, group)]


@pytest.mark.parametrize("world,group,policy,name", _params())
def test_result_follows_the_policy_and_real_members_agree(world_results, world, group, policy, name, request):
    case = battery.CASES[name]
    members = _outputs(world_results, world, group, policy)
    reason = next(filter(None, (case.known_bug(view, policy) for view, _ in members)), None)
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    for view, out in members:
        error = out["errors"].get(group, {}).get(name)
        assert error is None, f"virtual rank {view.me}: {error}"
        case.check(view, policy, out["results"][group][name])
    if case.same_on_all:  # mirror and random ghost data are designed to agree across real members
        (first_view, first), *rest = members
        for view, out in rest:
            assert _same(first["results"][group][name], out["results"][group][name]), \
                f"virtual ranks {first_view.me} and {view.me} got different results"


@pytest.mark.parametrize("world,group,policy,name", [p for p in _params() if battery.CASES[p.values[3]].events])
def test_events_are_recorded_in_nccl_tests_sizes(world_results, world, group, policy, name, request):
    case = battery.CASES[name]
    members = _outputs(world_results, world, group, policy)
    reason = next(filter(None, (case.known_event_bug(view) for view, _ in members)), None)
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    for view, out in members:
        battery.check_events(view, case.events(view), out["events"][group][name], f"virtual rank {view.me}")


@pytest.mark.parametrize("world,policy", _params(world_level=True))
def test_log_rows_count_every_operation(world_results, world, policy):
    """Each process's `rows()` after the tensor cases: calls and bytes summed exactly."""
    world_size, sandboxes, groups = WORLDS[world]
    for p, me in enumerate(sandboxes):
        out = world_results(world)[p][policy]
        views = battery.views(world_size, sandboxes, groups, me)
        expected = {group: {name: battery.CASES[name].events(views[group]) for name in out["events"][group]
                            if battery.CASES[name].events} for group in out["events"]}
        want = battery.expected_rows(expected, {group: view.dim for group, view in views.items()})
        assert out["rows"] == want, f"virtual rank {me}"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b
