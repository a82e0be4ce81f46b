"""MoE load-imbalance models (moe/imbalance.py): exact totals, caps, determinism, shapes of skew."""

from __future__ import annotations

import numpy as np
import pytest

from prism_megatron.moe.imbalance import Imbalance, ImbalanceError, apportion, routing_map

SPECS = ["uniform", "force-balanced", "zipf(1.2)", "dirichlet(0.3)", "hot-experts(2, 0.6)"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("experts,tokens,topk", [(8, 64, 2), (64, 512, 8), (8, 3, 2)])
def test_counts_sum_exactly_fit_a_routing_map_and_repeat_for_every_rank(spec, experts, tokens, topk):
    model = Imbalance.parse(spec, seed=7)
    counts = model.counts(experts=experts, tokens=tokens, topk=topk, layer=3, microbatch=1, source=5)
    assert counts.dtype == np.int64 and counts.sum() == tokens * topk
    assert counts.min() >= 0 and counts.max() <= tokens  # a token's k experts are distinct
    again = Imbalance.parse(spec, seed=7).counts(experts=experts, tokens=tokens, topk=topk, layer=3,
                                                 microbatch=1, source=5)
    np.testing.assert_array_equal(counts, again)  # any rank, any process: the same routing
    rmap = routing_map(counts, tokens, topk)
    assert (rmap.sum(axis=1) == topk).all()
    np.testing.assert_array_equal(rmap.sum(axis=0), counts)


def test_routing_map_is_exact_for_any_feasible_counts():
    """Every feasible count vector (sum tokens * k, none above tokens) gives k distinct experts per
    token and exactly those column sums, including experts that take every token or none."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        experts = int(rng.integers(1, 17))
        topk = int(rng.integers(1, experts + 1))
        tokens = int(rng.integers(1, 300))
        counts = np.zeros(experts, dtype=np.int64)
        for _ in range(tokens * topk):  # place assignments on experts with room left
            room = np.flatnonzero(counts < tokens)
            counts[rng.choice(room)] += 1
        rmap = routing_map(counts, tokens, topk)
        assert (rmap.sum(axis=1) == topk).all()
        np.testing.assert_array_equal(rmap.sum(axis=0), counts)
    edge = routing_map(np.array([5, 3, 0, 2]), tokens=5, topk=2)
    assert edge[:, 0].all() and not edge[:, 2].any() and (edge.sum(axis=1) == 2).all()
    with pytest.raises(ImbalanceError):
        routing_map(np.array([6, 4]), tokens=5, topk=2)  # an expert cannot take a token twice


def test_skews_have_their_shape():
    kw = dict(experts=8, tokens=4096, topk=2, layer=0)
    balanced = Imbalance.parse("force-balanced").counts(**kw)
    assert balanced.tolist() == [1024] * 8
    zipf = np.sort(Imbalance.parse("zipf(1.2)").counts(**kw))[::-1]
    ratio = zipf[0] / zipf[1]
    assert abs(ratio - 2 ** 1.2) < 0.01  # popularity ranks 1 and 2: 2^s apart
    hot = np.sort(Imbalance.parse("hot-experts(2, 0.6)").counts(**kw))[::-1]
    assert hot[:2].sum() == pytest.approx(0.6 * 8192, abs=2) and hot[0] - hot[1] <= 1
    capped = Imbalance.parse("zipf(4)").counts(experts=8, tokens=100, topk=2, layer=0)
    assert capped.max() == 100 and capped.sum() == 200  # the top expert takes every token, no more


def test_layers_differ_and_drift_moves_the_hot_expert():
    model = Imbalance.parse("zipf(1.5)", drift_per_iteration=1)
    kw = dict(experts=16, tokens=256, topk=2)
    hot = [int(np.argmax(model.counts(layer=0, iteration=i, **kw))) for i in range(4)]
    assert len(set(hot)) == 4  # one place further each iteration
    still = Imbalance.parse("zipf(1.5)")
    assert len({int(np.argmax(still.counts(layer=0, iteration=i, **kw))) for i in range(4)}) == 1
    assert len({int(np.argmax(still.counts(layer=layer, **kw))) for layer in range(8)}) > 1


def test_apportion_is_largest_remainder_with_a_cap():
    assert apportion(np.array([0.5, 0.3, 0.2]), 10, cap=10).tolist() == [5, 3, 2]
    assert apportion(np.array([0.9, 0.05, 0.05]), 10, cap=4).tolist() == [4, 3, 3]
    with pytest.raises(ImbalanceError, match="cannot fit"):
        apportion(np.ones(2), 5, cap=2)


@pytest.mark.parametrize("spec,message", [
    ("zipf", "takes 1 number"), ("zipf(0)", "must be > 0"), ("pareto(1)", "expected one of"),
    ("hot-experts(1.5, 0.2)", "integer h"), ("hot-experts(2, 1.5)", "0 <= p <= 1"),
])
def test_bad_specs_say_what_is_expected(spec, message):
    with pytest.raises(ImbalanceError, match=message.replace("(", r"\(")):
        Imbalance.parse(spec)


@pytest.mark.parametrize("spec", ["zipf(1.2)", "uniform", "dirichlet(0.5)", "force-balanced"])
def test_counts_are_answered_again_from_the_memo_read_only_and_as_computed(spec):
    """Every router call and count all-gather asks for counts: the same arguments give the same
    (read-only) array, equal to a fresh computation; other arguments are not confused with them."""
    model = Imbalance.parse(spec, seed=7)
    kw = dict(experts=8, tokens=64, topk=2, layer=3, microbatch=1, iteration=2, source=5)
    first = model.counts(**kw)
    assert model.counts(**kw) is first
    assert not first.flags.writeable
    with pytest.raises(ValueError):
        first[0] = 0
    fresh = Imbalance.parse(spec, seed=7)._counts(8, 64, 2, 3, 1, 2, 5)
    np.testing.assert_array_equal(first, fresh)
    for change in ({"layer": 4}, {"microbatch": 0}, {"iteration": 3}, {"source": 6}, {"tokens": 32}):
        other = model.counts(**{**kw, **change})
        np.testing.assert_array_equal(other, Imbalance.parse(spec, seed=7).counts(**{**kw, **change}))
