"""install(): one call makes init_process_group and megatron's groups virtual; uninstall undoes it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import prism_megatron


@pytest.fixture()
def virtual_8192():
    cfg = prism_megatron.load_config([
        "emulation.virtual_world_size=8192", "emulation.sandbox_ranks=[4711]", "parallel.tp=8",
        "parallel.pp=16", "model.num_layers=16", "model.num_attention_heads=8",
        "train.global_batch_size=128", "train.micro_batch_size=1", "train.device=cpu"])
    originals = (dist.init_process_group, dist.new_group, dist.broadcast_object_list)
    inst = prism_megatron.install(cfg)
    dist.init_process_group("gloo")
    yield inst, originals
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    inst.uninstall()


def test_megatron_builds_the_virtual_world_in_one_process(virtual_8192):
    from megatron.core import parallel_state as ps

    inst, _ = virtual_8192
    assert (dist.get_world_size(), dist.get_rank()) == (8192, 4711)
    ps.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=16)
    world = inst.session.world
    assert world is not None and world.dp == 64
    assert ps.get_pipeline_model_parallel_rank() == 9 and ps.get_tensor_model_parallel_rank() == 7
    assert tuple(dist.get_process_group_ranks(ps.get_data_parallel_group())) == world.group(4711, "dp")
    # megatron's gloo groups are prism groups too: no rendezvous with 8191 absent peers
    assert dist.get_backend(ps.get_data_parallel_group_gloo()) == "prism"
    t = torch.ones(4)
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    assert torch.equal(t, torch.full((4,), 8.0))  # 8 members mirror the local contribution
    assert {"op": "all_reduce", "dim": "tp", "calls": 1, "bytes": 16} in inst.session.log.rows()


def test_groups_without_a_physical_member_are_not_materialized(virtual_8192):
    assert dist.new_group([0, 1, 2, 3]) is dist.GroupMember.NON_GROUP_MEMBER
    group = dist.new_group([4710, 4711])
    assert group.size() == 2 and group.rank() == 1


def test_object_broadcast_from_a_ghost_keeps_the_local_objects(virtual_8192):
    objects = [{"step": 7}]
    dist.broadcast_object_list(objects, src=0)
    assert objects == [{"step": 7}]


def test_uninstall_restores_torch_distributed(virtual_8192):
    inst, originals = virtual_8192
    assert dist.init_process_group is not originals[0]
    inst.uninstall()
    assert (dist.init_process_group, dist.new_group, dist.broadcast_object_list) == originals
    assert torch.cuda.current_device.__module__ != "prism_megatron.runtime.cpu"


def test_without_a_virtual_world_nothing_of_torch_distributed_is_wrapped():
    cfg = prism_megatron.load_config(["train.device=cpu"])
    before = dist.init_process_group
    inst = prism_megatron.install(cfg)
    try:
        assert dist.init_process_group is before and inst.session is None and not inst.virtual
        assert inst.tracker is not None  # the CPU runtime still measures memory
    finally:
        inst.uninstall()
