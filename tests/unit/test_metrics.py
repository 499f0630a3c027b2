"""The Prometheus collector turns an engine's cache stats into hicache_* families: per-tier
gauges and counters, and the L3 backend's own figures (Redis: connection, round trip,
bandwidth, hits / misses) with its name and address as labels."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.server.metrics import Metrics

L3 = {"backend": "redis", "address": "redis://u@10.0.0.5:6379/0", "objects": 12,
      "bytes": 12 << 20, "hits": 30, "misses": 4, "corrupt": 1, "vanished": 2, "errors": 3,
      "bytes_read": 5 << 20, "bytes_written": 7 << 20, "read_bytes_per_s": 400e6,
      "write_bytes_per_s": 300e6, "rtt_us": 85, "connected": 1, "outages": 2,
      "used_tokens": 768, "capacity_tokens": 4096}


def _scrape(stats: dict) -> str:
    return generate_latest(Metrics(lambda: stats).registry).decode()


def test_l3_backend_figures_are_exported():
    text = _scrape({"l1": {"used_tokens": 5}, "l3": L3})
    assert 'hicache_l3_backend_info{address="redis://u@10.0.0.5:6379/0",backend="redis"} 1.0' \
        in text
    for line in ("hicache_l3_objects 12.0", "hicache_l3_object_hits_total 30.0",
                 "hicache_l3_object_misses_total 4.0", "hicache_l3_corrupt_objects_total 1.0",
                 "hicache_l3_vanished_objects_total 2.0", "hicache_l3_errors_total 3.0",
                 "hicache_l3_read_bytes_total 5.24288e+06",
                 "hicache_l3_read_bandwidth_bytes_per_second 4e+08",
                 "hicache_l3_write_bandwidth_bytes_per_second 3e+08",
                 "hicache_l3_round_trip_microseconds 85.0", "hicache_l3_connected 1.0",
                 "hicache_l3_outages_total 2.0",
                 'hicache_cache_used_tokens{tier="l3"} 768.0'):
        assert line in text, line


def test_no_l3_no_l3_families():
    text = _scrape({"l1": {"used_tokens": 5}})
    assert "hicache_l3_" not in text and 'hicache_cache_used_tokens{tier="l1"} 5.0' in text
