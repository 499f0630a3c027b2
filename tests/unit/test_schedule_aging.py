"""SchedulePolicy aging: cache-aware orders keep their order among young requests, but a
request that waited ``aging_s`` goes first (in arrival order), so no request starves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.scheduler.policy import SchedulePolicy


def req(rid: str, cached: int, created: float, host: int = 0):
    return SimpleNamespace(rid=rid, prefix_indices=torch.zeros(cached, dtype=torch.int64),
                           host_hit_length=host, fill_ids=list(range(1000, 1000 + cached + 50)),
                           cache_namespace=rid, created=created, last_node=None,
                           max_new_tokens=8)


def order(policy: SchedulePolicy, waiting: list, now: float) -> list[str]:
    policy.calc_priority(waiting, lambda r: None, now=now)
    return [r.rid for r in waiting]


def test_lpm_orders_young_requests_by_cached_prefix_including_host():
    p = SchedulePolicy("lpm", tree_cache=None, aging_s=2.0)
    w = [req("cold", 0, 10.0), req("l1", 500, 10.1), req("l2", 100, 10.2, host=600)]
    assert order(p, w, now=10.5) == ["l2", "l1", "cold"]


def test_lpm_aged_request_goes_first():
    p = SchedulePolicy("lpm", tree_cache=None, aging_s=2.0)
    w = [req("warm-b", 900, 11.5), req("first-turn", 0, 9.0), req("warm-a", 800, 11.0),
         req("older-first-turn", 0, 8.0)]
    assert order(p, w, now=11.6) == ["older-first-turn", "first-turn", "warm-b", "warm-a"]


def test_aging_off_keeps_plain_lpm():
    p = SchedulePolicy("lpm", tree_cache=None, aging_s=0.0)
    w = [req("old-cold", 0, 0.0), req("warm", 10, 100.0)]
    assert order(p, w, now=1000.0) == ["warm", "old-cold"]


def test_fcfs_is_arrival_order_whatever_aging():
    p = SchedulePolicy("fcfs", tree_cache=None, aging_s=1.0)
    w = [req("a", 0, 1.0), req("b", 900, 2.0), req("c", 5, 3.0)]
    assert order(p, w, now=10.0) == ["a", "b", "c"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.floats(0, 100)), min_size=1, max_size=20),
       st.floats(0.1, 10))
def test_no_young_request_ever_precedes_an_aged_one(specs, aging):
    p = SchedulePolicy("lpm", tree_cache=None, aging_s=aging)
    now = 120.0
    w = [req(f"r{i}", c, t) for i, (c, t) in enumerate(specs)]
    out = order(p, w, now)
    by = {r.rid: r for r in w}
    aged = [now - by[r].created >= aging for r in out]
    assert aged == sorted(aged, reverse=True)  # every aged request before every young one
    aged_times = [by[r].created for r, a in zip(out, aged) if a]
    assert aged_times == sorted(aged_times)  # aged ones in arrival order


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_aging_applies_to_cache_aware_policies(policy):
    tree = SimpleNamespace(root_node=SimpleNamespace(children={}, parent=None))
    p = SchedulePolicy(policy, tree_cache=tree, aging_s=1.0)
    w = [req("young", 50, 9.9), req("old", 0, 5.0)]
    assert order(p, w, now=10.0)[0] == "old"
