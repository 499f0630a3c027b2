"""The daemon with the hierarchical cache (L1 + L2 + L3 file storage) over a real port:
Evict(l1) demotes a prefix to host, MatchPrefix shows it in L2, the next request loads it back
with the same output; Flush empties every tier, L3 included; events arrive for each step."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.pb import admin_pb2
from engine.server.settings import DaemonSettings
from tests import stats_records as rec

GREEDY = {"temperature": 0.0, "ignore_eos": True}
TEXT = (
    "Radix trees share common prefixes between requests; eviction frees the least recently "
    "used. A hierarchical KV cache keeps prefixes in device memory, host memory and on disk."
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("l3"))
    args = ServerArgs(
        model_path=tiny_llama_dir,
        max_total_tokens=1024,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_storage_backend="file",
        hicache_storage_dir=storage,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=0,
        debug_check_invariants=True,
    )
    dt = DaemonThread(
        DaemonSettings(port=0, grace_period_s=2, metrics_port=_free_port()), args
    ).start()
    yield dt
    dt.stop()


@pytest.fixture
def client(daemon):
    with HicacheClient(f"127.0.0.1:{daemon.port}", timeout=60) as c:
        yield c


def _tier(stats, name: str):
    return next(t for t in stats.tiers if t.tier == ["", "l1", "l2", "l3"].index(name))


def test_evict_demotes_to_l2_and_next_request_loads_back(client):
    client.flush()
    _, ref_ids, first = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert first.usage.cached_tokens == 0
    before = client.match_prefix(TEXT)
    assert before.matched_per_tier.l1 > 0
    evicted = client.evict("l1", all=True)
    assert evicted.evicted_tokens > 0
    after = client.match_prefix(TEXT)
    assert after.matched_per_tier.l1 == 0
    assert after.matched_per_tier.l2 == before.matched_per_tier.l1  # demoted, not dropped
    _, ids, done = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert ids == ref_ids
    assert done.usage.cached_tokens > 0 and done.usage.cached_tokens_per_tier.l2 > 0
    kinds = {e.kind for e in _events(client)}
    assert {"demoted", "promoted"} <= kinds
    stats = client.cache_stats()  # the movements are counted on the tier they enter / leave
    l1, l2 = _tier(stats, "l1"), _tier(stats, "l2")
    assert l1.demoted_tokens > 0 and l1.promoted_tokens > 0, l1
    assert l1.bytes_in > 0 and l1.bytes_out > 0, l1
    assert l2.demoted_tokens > 0 and l2.bytes_out > 0, l2  # backed up to the file L3


def test_flush_empties_every_tier_including_l3(client):
    _, ref_ids, _ = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    _, _, hit = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert hit.usage.cached_tokens > 0
    res = client.flush()
    assert res.freed_tokens > 0
    stats = client.cache_stats()
    for name in ("l1", "l2", "l3"):
        assert _tier(stats, name).used_tokens == 0, name
    m = client.match_prefix(TEXT)
    assert m.matched_tokens == 0
    _, ids, miss = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert miss.usage.cached_tokens == 0 and ids == ref_ids
    assert "cleared" in {e.kind for e in _events(client)}


def _idle_stats(engine, timeout: float = 60.0):
    """The engine's record once nothing is in flight between tiers (then nothing changes it)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.cache_stats()
        busy = (
            s.running_requests
            + s.waiting_requests
            + s.l1.held_by_requests_tokens
            + s.l2.ongoing_writes
            + s.l2.pending_free_tokens
            + s.l3.pending_backups
            + s.l3.deferred_backups
            + s.l3.pending_prefetches
        )
        if not busy:
            return s
        assert time.monotonic() < deadline, f"still busy: {s}"
        time.sleep(0.05)


def test_get_cache_stats_and_metrics_carry_the_engines_record(client, daemon):
    """After traffic through every tier (an L1 hit, an L2 hit after Evict(l1), an L3 hit after
    Flush(l1, l2)), GetCacheStats and /metrics report the engine's record field by field."""
    client.flush()
    _, ref_ids, _ = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    _, _, l1_hit = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert l1_hit.usage.cached_tokens_per_tier.l1 > 0
    client.evict("l1", all=True)
    _, ids, l2_hit = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert l2_hit.usage.cached_tokens_per_tier.l2 > 0 and ids == ref_ids
    engine = daemon.daemon.state.engine  # the scheduler process's, over the split daemon's IPC
    _idle_stats(engine)  # the backups landed
    client.flush(["l1", "l2"])
    _, ids, l3_hit = client.generate_text(TEXT, max_new_tokens=8, **GREEDY)
    assert l3_hit.usage.cached_tokens_per_tier.l3 > 0 and ids == ref_ids
    stats = _idle_stats(engine)
    msg = client.cache_stats()
    url = f"http://127.0.0.1:{daemon.daemon.metrics_port}/metrics"
    scraped = rec.samples(urllib.request.urlopen(url, timeout=30).read().decode())
    assert engine.cache_stats() == stats  # nothing changed meanwhile
    for tier in ("l1", "l2", "l3"):
        assert stats.tier(tier).hit_tokens > 0 and stats.tier(tier).used_tokens > 0, tier
    rec.assert_message_equals(msg, stats)
    rec.assert_metrics_equal(scraped, stats)


def _events(client: HicacheClient):
    """Every retained event, replayed over WatchCacheEvents(after_seq=0) until a short idle."""
    import grpc

    out = []
    stream = client.watch_events(after_seq=0, timeout=3.0)
    try:
        for resp in stream:
            out.append(resp.event)
            if len(out) > 100_000:
                break
    except grpc.RpcError as e:  # the deadline ends the replay
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    names = {v: k for k, v in admin_pb2.CacheEventKind.items()}
    return [type("E", (), {"kind": names[ev.kind].rsplit("_", 1)[-1].lower()})() for ev in out]
