"""StorageTracker: exact live CPU storage bytes, peak and breakdown by category (pure tier, no torch.distributed)."""

import gc
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prism_megatron.runtime.memory import MemCategory, StorageTracker

F32_BYTES = 4


def storage_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def by_category(tracker):
    return tracker.snapshot()["by_category"]


# --------------------------------------------------------------------------- exact bytes


def test_empty_counts_4000_bytes_and_free_returns_to_zero():
    with StorageTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)
        assert tracker.allocated_bytes == 4000
        del a
        assert tracker.allocated_bytes == 0
        assert tracker.peak_allocated_bytes == 4000


def test_views_share_their_storage_and_count_once():
    with StorageTracker() as tracker:
        a = torch.empty(1000)
        views = [a[10:], a.view(10, 100), a.view(10, 100).t(), a.unsqueeze(0), a.detach(), *a.split(100)]
        assert tracker.allocated_bytes == 4000
        del a
        assert tracker.allocated_bytes == 4000  # views keep the whole storage alive
        del views
        assert tracker.allocated_bytes == 0


def test_counts_storage_nbytes_not_numel_times_itemsize():
    with StorageTracker() as tracker:
        small_view = torch.empty(1000)[:10]
        assert small_view.numel() * F32_BYTES == 40
        assert tracker.allocated_bytes == 4000
        copy = small_view.clone()
        assert tracker.allocated_bytes == 4040
        del small_view, copy


def test_peak_is_the_maximum_of_live_bytes_and_reset_peak_restarts_it():
    with StorageTracker() as tracker:
        a = torch.empty(1000)
        b = torch.empty(500)
        del a
        c = torch.empty(100)
        assert tracker.allocated_bytes == 2400
        assert tracker.peak_allocated_bytes == 6000
        tracker.reset_peak()
        assert tracker.peak_allocated_bytes == 2400
        d = torch.empty(1000)
        assert tracker.peak_allocated_bytes == 6400
        del b, c, d


def test_to_copies_are_new_storages_and_same_dtype_to_is_not():
    with StorageTracker() as tracker:
        a = torch.ones(1000)
        b = a.to(torch.float64)
        assert tracker.allocated_bytes == 4000 + 8000
        same = a.to(torch.float32)
        assert same.untyped_storage()._cdata == a.untyped_storage()._cdata
        assert tracker.allocated_bytes == 12000
        del a, b, same


def test_op_outputs_and_list_outputs_are_counted():
    with StorageTracker() as tracker:
        x = torch.ones(100)
        y = x * 2 + 1  # two ops, the intermediate is freed at once
        assert tracker.allocated_bytes == 800
        assert tracker.peak_allocated_bytes == 1200  # x, x * 2 and y were live together
        outs = torch._foreach_add([x, y], 1.0)
        assert tracker.allocated_bytes == 1600
        del x, y, outs
        assert tracker.allocated_bytes == 0
        assert tracker.peak_allocated_bytes == 1600


def test_non_cpu_tensors_are_ignored():
    with StorageTracker() as tracker:
        meta = torch.empty(1000, device="meta")
        assert tracker.allocated_bytes == 0
        tracker.classify(meta, MemCategory.PARAM)
        assert tracker.allocated_bytes == 0


# --------------------------------------------------------------------------- resizes


def test_tensor_resize_is_reaccounted():
    with StorageTracker() as tracker:
        t = torch.empty(10)
        t.resize_(1000)
        assert tracker.allocated_bytes == 4000
        t.resize_(10)  # shrinking a tensor keeps its storage
        assert tracker.allocated_bytes == 4000
        assert tracker.peak_allocated_bytes == 4000
        del t
        assert tracker.allocated_bytes == 0


def test_out_argument_that_grows_its_output_is_reaccounted():
    with StorageTracker() as tracker:
        a, b = torch.ones(1000), torch.ones(1000)
        out = torch.empty(0)
        torch.add(a, b, out=out)
        assert tracker.allocated_bytes == 3 * 4000
        del a, b, out


def test_direct_storage_resize_like_megatron_buffers_is_seen():
    with StorageTracker() as tracker:
        buffer = torch.zeros(1000)
        buffer.untyped_storage().resize_(0)  # megatron frees buffers this way
        assert tracker.allocated_bytes == 0
        buffer.untyped_storage().resize_(8000)
        assert tracker.allocated_bytes == 8000
        assert tracker.peak_allocated_bytes == 8000
        del buffer
    assert "resize_" not in torch.UntypedStorage.__dict__  # the wrapper is gone after stop()
    assert tracker.allocated_bytes == 0


# --------------------------------------------------------------------------- autograd and categories


def test_activations_are_act_and_released_after_backward():
    tracker = StorageTracker()
    with tracker:
        x = torch.randn(1000, requires_grad=True)
        tracker.set_phase("forward")
        h = x * 2
        y = h.sin()
        loss = y.sum()
        assert by_category(tracker)[MemCategory.ACT] == 4000 + 4000 + F32_BYTES
        del h, y  # h is still saved by sin's backward
        assert by_category(tracker)[MemCategory.ACT] > 0
        tracker.set_phase("backward")
        loss.backward()
        del loss
        tracker.set_phase(None)
        assert by_category(tracker)[MemCategory.ACT] == 0
        assert x.grad is not None
    assert tracker.allocated_bytes == storage_bytes([x, x.grad])


def test_grads_made_in_backward_are_seen_and_labelled_by_register_model():
    model = torch.nn.Linear(16, 8)
    tracker = StorageTracker()
    tracker.register_model(model)
    with tracker:
        tracker.set_phase("forward")
        loss = model(torch.ones(4, 16)).sum()
        tracker.set_phase("backward")
        labels_seen_in_backward = []
        model.bias.register_post_accumulate_grad_hook(
            lambda p: labels_seen_in_backward.append(by_category(tracker)[MemCategory.GRAD]))
        loss.backward()
        del loss
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert by_category(tracker)[MemCategory.GRAD] == storage_bytes(grads) == (16 * 8 + 8) * F32_BYTES
    assert labels_seen_in_backward and labels_seen_in_backward[0] > 0  # labelled during backward


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.Adam(params, lr=1e-3),
], ids=["sgd_momentum", "adam"])
def test_linear_step_categories_equal_exact_tensor_bytes(make_optimizer):
    model = torch.nn.Linear(64, 32)  # created before start(): adopted by register_model
    optimizer = make_optimizer(model.parameters())
    tracker = StorageTracker()
    tracker.register_model(model)
    tracker.register_optimizer(optimizer)
    with tracker:
        for _ in range(2):
            train_step(tracker, model, optimizer, torch.ones(8, 64))
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counts = tracker.snapshot()
    assert counts["by_category"]["params"] == storage_bytes(params) == (64 * 32 + 32) * F32_BYTES
    assert counts["by_category"]["grads"] == storage_bytes([p.grad for p in params])
    assert counts["by_category"]["optimizer_state"] == storage_bytes(state) > 0
    assert counts["by_category"]["activations"] == 0
    assert counts["by_category"]["temporary"] == 0
    assert counts["allocated_bytes"] == sum(counts["by_category"].values())
    assert counts["peak_allocated_bytes"] == sum(counts["peak_by_category"].values())
    # the peak is in a step, when the optimizer state and its temporaries are all live
    assert counts["peak_by_category"]["optimizer_state"] == counts["by_category"]["optimizer_state"]


def train_step(tracker, model, optimizer, batch):
    tracker.set_phase("forward")
    loss = model(batch).square().mean()
    tracker.set_phase("backward")
    loss.backward()
    del loss
    tracker.set_phase("optimizer")
    optimizer.step()
    tracker.set_phase(None)


def test_same_program_twice_gives_the_same_peak_byte_for_byte():
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = StorageTracker()
        tracker.register_model(model)
        tracker.register_optimizer(optimizer)
        with tracker:
            for _ in range(3):
                optimizer.zero_grad()
                train_step(tracker, model, optimizer, torch.randn(16, 32))
        return tracker.snapshot()

    first, second = run(), run()
    assert first["peak_allocated_bytes"] > 0
    assert first == second


def test_classify_relabels_and_moves_the_peak_share_of_storages_live_at_the_peak():
    tracker = StorageTracker()
    with tracker:
        state = torch.empty(1000)  # live at the peak
        gone = torch.empty(500)
        del gone
        late = torch.empty(10)  # made after the peak
        tracker.classify([state, late], MemCategory.OPT)
    snap = tracker.snapshot()
    assert snap["by_category"][MemCategory.OPT] == 4040
    assert snap["peak_allocated_bytes"] == 6000
    assert snap["peak_by_category"][MemCategory.OPT] == 4000
    assert snap["peak_by_category"][MemCategory.TEMP] == 2000


def test_track_existing_adopts_old_storages_and_keeps_existing_labels():
    old = torch.empty(1000)
    tracker = StorageTracker()
    with tracker:
        assert tracker.allocated_bytes == 0  # made before start(): unknown
        old.add_(1)  # an in-place op on an untracked storage does not adopt it
        assert tracker.allocated_bytes == 0
        tracker.track_existing([old, None], MemCategory.PARAM)
        assert by_category(tracker)[MemCategory.PARAM] == 4000
        tracker.track_existing(old, MemCategory.BUFFER)  # already tracked: label kept
        assert by_category(tracker)[MemCategory.PARAM] == 4000
        tracker.classify(old, "buffers")  # classify does re-label
        assert by_category(tracker)[MemCategory.BUFFER] == 4000
        assert by_category(tracker)[MemCategory.PARAM] == 0


def test_megatron_style_wrappers_and_main_grad_buffers():
    model = torch.nn.Linear(8, 4)
    flat_grad_buffer = torch.zeros(64)  # padded, like megatron's contiguous grad buffer
    model.weight.main_grad = flat_grad_buffer[:32].view(4, 8)
    model.bias.main_grad = flat_grad_buffer[32:36]
    model.register_buffer("running", torch.zeros(3))
    master = [p.detach().clone().float() for p in model.parameters()]  # fp32 main params
    inner_a = torch.optim.SGD(master[:1], lr=0.1, momentum=0.9)
    inner_b = torch.optim.SGD(master[1:], lr=0.1, momentum=0.9)

    class Wrapper:  # like megatron's MegatronOptimizer / ChainedOptimizer, without importing them
        def __init__(self, optimizer=None, chained=None):
            if chained is not None:
                self.chained_optimizers = chained
            else:
                self.optimizer = optimizer

    chained = Wrapper(chained=[Wrapper(inner_a), Wrapper(inner_b), Wrapper(None)])
    tracker = StorageTracker()
    tracker.register_model(model)
    tracker.register_optimizer(chained)
    with tracker:
        for main in master:
            main.grad = torch.ones_like(main)
        tracker.set_phase("optimizer")
        inner_a.step()
        inner_b.step()
    momentum = [s["momentum_buffer"] for o in (inner_a, inner_b) for s in o.state.values()]
    cats = by_category(tracker)
    assert cats[MemCategory.PARAM] == storage_bytes(model.parameters())
    assert cats[MemCategory.BUFFER] == 3 * F32_BYTES
    assert cats[MemCategory.OPT] == storage_bytes(master + momentum)  # master weights and state
    assert cats[MemCategory.GRAD] == 64 * F32_BYTES + storage_bytes([m.grad for m in master])


# --------------------------------------------------------------------------- lifecycle, threads, errors


def test_tracker_holds_no_strong_references():
    with StorageTracker():
        t = torch.empty(1000)
        storage_ref = weakref.ref(t.untyped_storage())
        del t
        gc.collect()
        assert storage_ref() is None


def test_frees_from_another_thread_and_concurrent_queries_stay_consistent():
    with StorageTracker() as tracker:
        tensors = [torch.empty(100) for _ in range(50)]
        assert tracker.allocated_bytes == 50 * 400
        snapshots = []
        stop = threading.Event()

        def query():
            while not stop.is_set():
                snapshots.append(tracker.snapshot())

        reader = threading.Thread(target=query)
        reader.start()
        dropper = threading.Thread(target=tensors.clear)  # the last references die on this thread
        dropper.start()
        dropper.join()
        for _ in range(200):
            torch.empty(10)
        stop.set()
        reader.join()
        assert tracker.allocated_bytes == 0
    assert snapshots
    assert all(s["allocated_bytes"] == sum(s["by_category"].values()) for s in snapshots)


def test_start_stop_explicitly_and_nested_trackers_both_count():
    outer, inner = StorageTracker(), StorageTracker()
    outer.start()
    a = torch.empty(100)
    with inner:
        b = torch.empty(1000)
    c = torch.empty(10)
    outer.stop()
    d = torch.empty(10)  # not tracked
    assert outer.allocated_bytes == 400 + 4000 + 40
    assert inner.allocated_bytes == 4000
    del a, b, c, d


def test_user_errors_say_what_was_expected():
    tracker = StorageTracker()
    with pytest.raises(RuntimeError, match="not active"):
        tracker.stop()
    with pytest.raises(ValueError, match="'forward', 'backward', 'optimizer' or None"):
        tracker.set_phase("fwd")
    with pytest.raises(ValueError, match="'optimizer_state'"):
        tracker.classify(torch.empty(1), "weights")
    with pytest.raises(TypeError, match="iterable of tensors"):
        tracker.classify([1.0], MemCategory.TEMP)
    with pytest.raises(TypeError, match="chained_optimizers"):
        tracker.register_optimizer(object())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        tracker.register_model(object())
    with tracker:
        with pytest.raises(RuntimeError, match="already active"):
            tracker.start()


def test_stop_refuses_to_pop_a_mode_entered_after_start():
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    tracker = StorageTracker().start()
    other = Other()
    other.__enter__()
    try:
        with pytest.raises(RuntimeError, match="exit it first"):
            tracker.stop()
    finally:
        other.__exit__(None, None, None)
    tracker.stop()


def test_memcategory_values():
    assert [c.value for c in MemCategory] == [
        "params", "buffers", "grads", "optimizer_state", "activations", "temporary"]


def test_a_gpu_ranks_allocated_figures_leave_out_the_holds_plan(monkeypatch):
    """On GPU the realtime and paced holds keep their plan in two device buffers from the install on
    (comm/csrc/holds_cuda.h): the emulator's memory, not the rank's (a real rank's NCCL buffers are not the
    caching allocator's). The peak reported for the rank (its summary and its graph) leaves them out,
    so the sandbox's peak equals the real rank's byte for byte (2026-11-30, before the plan lived on
    the device). The allocator and the plan are stubbed: CI has no GPU; the plan's own measurement
    (DeviceHolds.device_bytes) and the recorder's samples run on a GPU only."""
    from prism_megatron.config.loader import load_config
    from prism_megatron.hooks.install import Installation
    from prism_megatron.trace.clock import CudaClock
    from prism_megatron.trace.output import memory_figures

    clock = CudaClock.__new__(CudaClock)  # no device: only the plan's bookkeeping is read
    clock.trace = SimpleNamespace(own_device_bytes=0)
    assert clock.own_device_bytes == 0
    clock.trace = SimpleNamespace(own_device_bytes=57_344)  # TP2's plan on the H200: 594 operations
    inst = Installation(cfg=load_config([]), device="cuda")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 22_400_356_864)
    assert inst.peak_memory_bytes() == 22_400_356_864  # no recorder: nothing of prism's to leave out
    inst.recorder = SimpleNamespace(clock=clock)
    assert inst.own_device_bytes() == 57_344
    assert inst.peak_memory_bytes() == 22_400_299_520  # the real TP2 rank's peak of 2026-11-30
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 24_092_082_176)
    figures = memory_figures(inst)  # what the rank's graph records
    assert figures["peak_bytes"] == 22_400_299_520 and figures["peak_reserved_bytes"] == 24_092_082_176
