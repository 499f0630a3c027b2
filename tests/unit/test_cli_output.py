"""The `hicache stats` table and `hicache info` lines, from hand-built responses."""

from __future__ import annotations

import io
import json

from engine.client.cli_output import number, server_info_report, stats_report
from engine.server.pb import admin_pb2, common_pb2, gen_pb2


def _stats() -> admin_pb2.GetCacheStatsResponse:
    l1 = admin_pb2.TierStats(
        tier=common_pb2.TIER_L1,
        enabled=True,
        capacity_tokens=4096,
        used_tokens=100,
        hit_tokens=64,
        bytes_in=3 << 20,
    )
    l1.extra["free_tokens"] = 3996.0
    l2 = admin_pb2.TierStats(
        tier=common_pb2.TIER_L2, enabled=True, capacity_tokens=8192, evicted_tokens=7
    )
    l2.extra["demotions"] = 3.0
    l2.extra["hit_rate"] = 0.25
    l2.info["write_policy"] = "write_through"
    l3 = admin_pb2.TierStats(tier=common_pb2.TIER_L3, enabled=False)
    return admin_pb2.GetCacheStatsResponse(
        tiers=[l1, l2, l3], miss_tokens=12, num_pins=1, admin_pinned_tokens=8
    )


def _cells(text: str) -> dict[str, list[str]]:
    """Row label -> its cells, from the table's lines (the header and rule skipped)."""
    lines = text.split("\n\n")[0].splitlines()
    widths = [len(c) for c in lines[1].split("  ")]
    rows = {}
    for line in lines[2:]:
        cells, pos = [], 0
        for w in widths:
            cells.append(line[pos : pos + w].strip())
            pos += w + 2
        rows[cells[0]] = cells[1:]
    return rows


def test_stats_is_one_table_with_a_column_per_tier():
    out = io.StringIO()
    stats_report(_stats(), out)
    text = out.getvalue()
    assert text.splitlines()[0].split() == ["stat", "l1", "l2", "l3"]
    rows = _cells(text)
    assert rows["enabled"] == ["yes", "yes", "off"]
    assert rows["capacity_tokens"] == ["4096", "8192", ""]
    assert rows["evicted_tokens"] == ["0", "7", ""]
    assert rows["bytes_in"] == ["3.0MiB", "0B", ""]
    assert rows["demotions"] == ["-", "3", ""]  # an integer, not 3.0
    assert rows["hit_rate"] == ["-", "0.25", ""]
    assert rows["free_tokens"] == ["3996", "-", ""]
    assert rows["write_policy"] == ["-", "write_through", ""]
    labels = [line.split()[0] for line in text.split("\n\n")[0].splitlines()[2:]]
    assert len(labels) == len(set(labels))  # every figure once
    assert "miss_tokens: 12" in text and "pins: 1 (8 tokens)" in text


def test_number_prints_integers_as_integers():
    assert (number(3.0), number(0), number(0.125), number(1e12)) == (
        "3",
        "0",
        "0.125",
        "1000000000000",
    )


def test_info_lines_decode_the_config():
    info = gen_pb2.GetServerInfoResponse(
        version="1.2", features=["radix_cache", "auth"], uptime_s=3.25, active_requests=2
    )
    for k, v in {
        "page_size": 16,
        "hicache_ratio": 2.0,
        "model_path": "/m",
        "tp": None,
        "enable_hierarchical_cache": True,
        "tenants": [{"name": "a"}],
    }.items():
        info.config[k] = json.dumps(v)
    out = io.StringIO()
    server_info_report(info, "l1 device", out)
    lines = out.getvalue().splitlines()
    assert lines[:6] == [
        "version: 1.2",
        "features: radix_cache, auth",
        "uptime_s: 3.2",
        "active_requests: 2",
        "draining: no",
        "tiers: l1 device",
    ]
    assert lines[6] == "config:"
    assert lines[7:] == [
        "  enable_hierarchical_cache: true",
        "  hicache_ratio: 2",
        "  model_path: /m",
        "  page_size: 16",
        '  tenants: [{"name": "a"}]',
        "  tp: none",
    ]
