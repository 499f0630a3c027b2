"""A prefill batch that does not fit the KV pool never makes the scheduler spin: it is requeued,
retried one request at a time, and a lone request that can never fit is failed with a message."""

from __future__ import annotations

import pytest

from engine import Engine
from engine.runtime.scheduler.batch import OutOfKVError

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def eng(tiny_llama_dir):
    with Engine(tiny_llama_dir, max_total_tokens=2048, debug_check_invariants=True) as e:
        yield e


def test_batch_that_does_not_fit_is_retried_one_at_a_time(eng):
    ref = eng.generate([[5, 6, 7], [8, 9, 10, 11]], GREEDY)
    eng.call_in_scheduler(lambda s: s.tree_cache.evict(1 << 30))
    builder = eng.scheduler.builder
    real = builder.prepare_extend
    sizes: list[int] = []

    def flaky(reqs):
        sizes.append(len(reqs))
        if len(reqs) > 1:  # only single-request batches fit
            raise OutOfKVError("test: batch too large")
        return real(reqs)

    builder.prepare_extend = flaky
    try:
        outs = eng.generate([[5, 6, 7], [8, 9, 10, 11]], GREEDY)
    finally:
        builder.prepare_extend = real
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert 1 in sizes and sizes.count(2) <= 3  # it stopped retrying the big batch
    assert eng.cache_stats().l1.held_by_requests_tokens == 0


def test_request_that_never_fits_is_failed_not_spun(eng):
    builder = eng.scheduler.builder
    real = builder.prepare_extend
    calls = []

    def never(reqs):
        calls.append(len(reqs))
        raise OutOfKVError("test: no room")

    builder.prepare_extend = never
    try:
        out = eng.generate([5, 6, 7, 8], GREEDY)
    finally:
        builder.prepare_extend = real
    assert out.finish_reason == "abort" and "cannot hold" in out.error
    assert len(calls) <= 3
    assert eng.generate([5, 6, 7, 8], GREEDY).finish_reason == "length"  # still serving
