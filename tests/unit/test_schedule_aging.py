"""SchedulePolicy aging: cache-aware orders keep their order among requests that have not been
overtaken much, but a request that ``max_bypass`` later arrivals overtook goes first (in
arrival order), so no request starves however long the queue is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.scheduler.policy import SchedulePolicy

# the cache manager's answer to ``l3_hit`` (tokens of a request's prefix L3 held): each fake
# request's ``l3`` field
L3_HIT = lambda r: r.l3
NO_TREE = SimpleNamespace(root_node=SimpleNamespace(children={}, parent=None))


def req(rid: str, cached: int, created: float, host: int = 0, bypassed: int = 0, l3: int = 0):
    """A waiting request as the policy reads it (engine's Req: its ``kv`` and ``admission``)."""
    kv = SimpleNamespace(
        prefix_indices=torch.zeros(cached, dtype=torch.int64),
        host_hit_length=host,
        fill_ids=list(range(1000, 1000 + cached + 50)),
        last_node=None,
    )
    return SimpleNamespace(
        rid=rid,
        cache_namespace=rid,
        max_new_tokens=8,
        l3=l3,
        kv=kv,
        admission=SimpleNamespace(created=created, bypassed=bypassed),
    )


def order(policy: SchedulePolicy, waiting: list) -> list[str]:
    policy.calc_priority(waiting, lambda r: None)
    return [r.rid for r in waiting]


def test_lpm_orders_by_cached_prefix_including_host_and_l3():
    p = SchedulePolicy("lpm", tree_cache=NO_TREE, l3_hit=L3_HIT, max_bypass=4)
    w = [
        req("cold", 0, 10.0),
        req("l1", 500, 10.1),
        req("l2", 100, 10.2, host=600),
        req("l3", 0, 10.3, l3=640),
    ]
    assert order(p, w) == ["l2", "l3", "l1", "cold"]


def test_lpm_overtaken_request_goes_first_in_arrival_order():
    p = SchedulePolicy("lpm", tree_cache=NO_TREE, l3_hit=L3_HIT, max_bypass=4)
    w = [
        req("warm-b", 900, 11.5),
        req("first-turn", 0, 9.0, bypassed=4),
        req("warm-a", 800, 11.0),
        req("older-first-turn", 0, 8.0, bypassed=7),
        req("young-cold", 0, 7.0, bypassed=3),
    ]
    assert order(p, w) == ["older-first-turn", "first-turn", "warm-b", "warm-a", "young-cold"]


def test_aging_off_keeps_plain_lpm():
    p = SchedulePolicy("lpm", tree_cache=NO_TREE, l3_hit=L3_HIT, max_bypass=0)
    w = [req("old-cold", 0, 0.0, bypassed=10**6), req("warm", 10, 100.0)]
    assert order(p, w) == ["warm", "old-cold"]


def test_fcfs_is_arrival_order_whatever_aging():
    p = SchedulePolicy("fcfs", tree_cache=NO_TREE, l3_hit=L3_HIT, max_bypass=1)
    w = [req("a", 0, 1.0), req("b", 900, 2.0, bypassed=5), req("c", 5, 3.0)]
    assert order(p, w) == ["a", "b", "c"]


def test_bypasses_count_only_later_arrivals():
    waiting = [req("old", 0, 1.0), req("mid", 0, 5.0), req("new", 0, 9.0)]
    admitted = [req("x", 500, 4.0), req("y", 500, 6.0), req("z", 500, 0.5)]
    SchedulePolicy.count_bypasses(waiting, admitted)
    assert [r.admission.bypassed for r in waiting] == [2, 1, 0]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1000), st.floats(0, 100), st.integers(0, 10)),
        min_size=1,
        max_size=20,
    ),
    st.integers(1, 8),
)
def test_no_fresh_request_ever_precedes_an_aged_one(specs, max_bypass):
    p = SchedulePolicy("lpm", tree_cache=NO_TREE, l3_hit=L3_HIT, max_bypass=max_bypass)
    w = [req(f"r{i}", c, t, bypassed=b) for i, (c, t, b) in enumerate(specs)]
    out = order(p, w)
    by = {r.rid: r for r in w}
    aged = [by[r].admission.bypassed >= max_bypass for r in out]
    assert aged == sorted(aged, reverse=True)  # every aged request before every fresh one
    aged_times = [by[r].admission.created for r, a in zip(out, aged) if a]
    assert aged_times == sorted(aged_times)  # aged ones in arrival order


def test_starvation_is_bounded_in_a_stream_of_cached_arrivals():
    """A cold request among a stream of well-cached later arrivals, one admitted per round:
    it is admitted after at most max_bypass of them."""
    p = SchedulePolicy("lpm", tree_cache=NO_TREE, l3_hit=L3_HIT, max_bypass=5)
    cold = req("cold", 0, 0.0)
    rounds = 0
    while True:
        w = [cold, req(f"warm{rounds}", 1000, 1.0 + rounds)]
        first = order(p, w)[0]
        rounds += 1
        if first == "cold":
            break
        SchedulePolicy.count_bypasses([cold], [r for r in w if r.rid == first])
    assert rounds == 6


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_aging_applies_to_cache_aware_policies(policy):
    tree = SimpleNamespace(root_node=SimpleNamespace(children={}, parent=None))
    p = SchedulePolicy(policy, tree_cache=tree, l3_hit=L3_HIT, max_bypass=1)
    w = [req("young", 50, 9.9), req("old", 0, 5.0, bypassed=1)]
    assert order(p, w)[0] == "old"
