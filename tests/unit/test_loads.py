"""The load report gateways poll (/v1/loads, GetLoads) and the model names /v1/models lists."""

from __future__ import annotations

import pytest

from engine.server.loads import UnknownSectionError, loads_report, parse_include
from engine.server.openai_api import model_ids
from tests import stats_records as rec

STATS = rec.cache_stats(
    l1=rec.l1(used_tokens=700, evictable_tokens=400, capacity_tokens=1000),
    l2=rec.l2(used_tokens=50, capacity_tokens=4000),
    running_requests=2,
    waiting_requests=3,
    prompt_tokens=400,
    miss_tokens=300,  # a hit rate of 0.25
)


def test_core_report_in_sglang_shape():
    r = loads_report(STATS, 64, "1.2.3")
    (load,) = r["loads"]
    assert r["dp_rank_count"] == 1 and r["version"] == "1.2.3"
    assert load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 3
    assert load["num_total_reqs"] == 5 and load["max_running_requests"] == 64
    assert load["num_used_tokens"] == load["num_total_tokens"] == 300
    assert load["token_usage"] == pytest.approx(0.3) and load["cache_hit_rate"] == 0.25
    assert r["aggregate"] == {
        "total_running_reqs": 2,
        "total_waiting_reqs": 3,
        "total_reqs": 5,
        "total_tokens": 300,
        "avg_token_usage": pytest.approx(0.3),
    }
    assert "queues" not in load and "tiers" not in r


def test_usage_leaves_out_the_evictable_cache():
    """A cache kept full of evictable prefixes is no pressure: SGLang's token_usage counts what
    cannot be freed now, and SMG leaves a worker at >= 0.8 out of routing by default."""
    full = rec.cache_stats(
        l1=rec.l1(
            used_tokens=1000,
            evictable_tokens=900,
            pinned_tokens=60,
            held_by_requests_tokens=40,
            capacity_tokens=1000,
        )
    )
    (load,) = loads_report(full, 64, "x")["loads"]
    assert load["num_used_tokens"] == 100 and load["token_usage"] == pytest.approx(0.1)


def test_sections():
    r = loads_report(STATS, 64, "x", parse_include(["queues,memory", "tiers"]))
    assert r["loads"][0]["queues"] == {"waiting": 3}
    assert r["loads"][0]["memory"] == {"token_capacity": 1000}
    assert r["tiers"] == {
        "l1": {"used_tokens": 700, "capacity_tokens": 1000},
        "l2": {"used_tokens": 50, "capacity_tokens": 4000},
    }
    assert parse_include([]) == {"core"}
    with pytest.raises(UnknownSectionError, match="nope"):
        parse_include(["core,nope"])


def test_model_ids():
    assert model_ids("/models/llama-3") == ("llama-3", "default", "/models/llama-3")
    assert model_ids("/models/llama-3", "chat") == ("chat", "llama-3", "default", "/models/llama-3")
    assert model_ids("embedded:SmolLM2") == ("SmolLM2", "default", "embedded:SmolLM2")
