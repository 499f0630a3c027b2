"""L3 on Redis / Valkey end to end, against real servers the tests start on 127.0.0.1 (a single
node and a three-primary cluster): what one daemon computed is served to another from L3 with
bit-identical logits and greedy tokens; faults on the server (stopped and restarted, keys evicted
by maxmemory, a damaged value, bytes without metadata) never return wrong data nor take the
daemon down; L3 attached and detached at run time while requests stream; Flush of L3 deletes only
this model's keys."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings
from tests import valkey_servers
from tests.e2e.test_hicache_engine import _prompts, _second_turn_logits
from tools.benchlib import free_port
from tools.benchlib.daemon import wait_serving
from tools.benchlib.valkey import ValkeyServer

valkey_server = valkey_servers.valkey_server  # fixtures: a fresh server / a shared cluster
valkey_cluster = valkey_servers.valkey_cluster

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
OBJECT = 16  # tokens per L3 object in these tests (the tiny model's prompts are short)


def _l3(client: HicacheClient) -> dict:
    """L3's figures, and the tokens backed up to it (counted on L2, the tier they leave)."""
    stats = client.cache_stats()
    t = stats.tiers[2]
    return {
        "enabled": t.enabled,
        **dict(t.extra),
        **dict(t.info),
        "hit_tokens": t.hit_tokens,
        "used_tokens": t.used_tokens,
        "errors": t.errors,
        "backed_up_tokens": stats.tiers[1].demoted_tokens,
    }


def _wait(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _settled(client: HicacheClient) -> bool:
    """The daemon's L3 work landed (nothing pending, something stored)."""
    s = _l3(client)
    return s["pending_backups"] == 0 and s["backed_up_tokens"] > 0


# --- in-process: bit-identical prefill logits from Redis ---------------------------------------
@pytest.mark.parametrize("topology", ["single", "cluster"])
def test_prefill_logits_bit_identical_from_redis(tiny_llama_dir, topology, request):
    """A fresh engine on the same server gets the second turn's prefix from Redis: the same
    prefill logits bit for bit as an engine with a huge L1."""
    server = request.getfixturevalue("valkey_server" if topology == "single" else "valkey_cluster")
    conv = _prompts(1, seed=11)[0]
    fillers = _prompts(8, seed=98, length=70)
    big_logits, big, _ = _second_turn_logits(
        tiny_llama_dir, conv, fillers, max_total_tokens=8192, page_size=16
    )
    l3_logits, l3, stats = _second_turn_logits(
        tiny_llama_dir,
        conv,
        fillers,
        restart=True,
        page_size=16,
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_storage_backend="redis",
        hicache_storage_url=server.url,
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_page_size=16,
        hicache_prefetch_threshold=0,
    )
    assert stats.l3.backend == ("redis" if topology == "single" else "redis-cluster")
    assert stats.l3.hit_tokens > 0 and stats.l3.errors == 0
    assert big.cached_tokens == l3.cached_tokens > 0
    assert l3.cached_tokens_per_tier.get("l3", 0) == l3.cached_tokens
    assert torch.equal(big_logits, l3_logits)


# --- two daemon processes sharing one server ---------------------------------------------------
def _spawn(model: str, url: str, tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    env.update(XDG_CACHE_HOME=str(tmp), HICACHE_LOG_LEVEL="warning")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.client.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--max-total-tokens",
            "512",
            "--hicache-storage-backend",
            "redis",
            "--hicache-storage-url",
            url,
            "--hicache-storage-page-size",
            str(OBJECT),
            "--hicache-prefetch-threshold",
            "0",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"127.0.0.1:{port}"


@pytest.mark.parametrize("topology", ["single", "cluster"])
def test_two_daemons_share_one_l3(tiny_llama_dir, tmp_path, topology, request):
    server = request.getfixturevalue("valkey_server" if topology == "single" else "valkey_cluster")
    procs = [_spawn(tiny_llama_dir, server.url, tmp_path / name) for name in ("a", "b")]
    try:
        for proc, addr in procs:
            wait_serving(proc, addr)
        prompt = _prompts(1, seed=7, length=120)[0]
        with (
            HicacheClient(procs[0][1], timeout=60) as a,
            HicacheClient(procs[1][1], timeout=60) as b,
        ):
            _, ids_a, done_a = a.generate_text(prompt, max_new_tokens=8, **GREEDY)
            assert done_a.usage.cached_tokens == 0
            _wait(lambda: _settled(a), what="daemon a's L3 backups")
            assert b.match_prefix(prompt).matched_per_tier.l3 == 112  # 7 objects of 16
            _, ids_b, done_b = b.generate_text(prompt, max_new_tokens=8, **GREEDY)
            assert ids_b == ids_a
            assert done_b.usage.cached_tokens_per_tier.l3 == 112
            sb = _l3(b)
            assert sb["hit_tokens"] == 112 and sb["errors"] == 0
            assert sb["backend"] == ("redis" if topology == "single" else "redis-cluster")
            assert b.health() == a.health() == "SERVING"
        out = subprocess.run(
            [sys.executable, "-m", "engine.client.cli", "storage", "--addr", procs[1][1]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "attached:True" in out and f"object_tokens:{OBJECT}" in out
        assert f"address:{server.url.split('://')[0]}" in out
        stats = subprocess.run(
            [sys.executable, "-m", "engine.client.cli", "stats", "--addr", procs[1][1]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        rows = {r.split()[0]: r.split()[1:] for r in stats.split("\n\n")[0].splitlines()[2:]}
        assert rows["hit_tokens"][2] == "112"  # the l3 column
        assert rows["backend"][2] == ("redis" if topology == "single" else "redis-cluster")
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --- faults on the server, one in-process daemon -----------------------------------------------
@pytest.fixture
def redis_daemon(tiny_llama_dir, valkey_server):
    args = ServerArgs(
        model_path=tiny_llama_dir,
        max_total_tokens=512,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_storage_backend="redis",
        hicache_storage_url=valkey_server.url,
        hicache_storage_page_size=OBJECT,
        hicache_prefetch_threshold=0,
        hicache_storage_prefetch_policy="wait_complete",
        debug_check_invariants=True,
    )
    dt = DaemonThread(DaemonSettings(port=0, grace_period_s=2), args).start()
    with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
        yield c, valkey_server
    dt.stop()


def _from_l3_again(c: HicacheClient, prompt: list[int]) -> tuple[list[int], object]:
    """Generate ``prompt`` with L1 and L2 emptied first (only L3 can serve its prefix)."""
    c.flush(["l1", "l2"])
    _, ids, done = c.generate_text(prompt, max_new_tokens=6, **GREEDY)
    return ids, done


def test_server_down_mid_run_then_back(redis_daemon):
    c, server = redis_daemon
    prompts = _prompts(3, seed=21, length=80)
    ref = [c.generate_text(p, max_new_tokens=6, **GREEDY)[1] for p in prompts]
    _wait(lambda: _settled(c), what="backups")
    server.stop()
    for p, want in zip(prompts, ref):  # L3 gone: served by recompute, never wrong, never stuck
        ids, done = _from_l3_again(c, p)
        assert ids == want and done.usage.cached_tokens_per_tier.l3 == 0
    fresh = _prompts(1, seed=22, length=80)[0]
    c.generate_text(fresh, max_new_tokens=6, **GREEDY)  # its backup fails: counted, not raised
    s = _l3(c)
    assert c.health() == "SERVING"
    assert s["connected"] == 0 and s["errors"] > 0 and s["outages"] == 1
    server.start()  # same port, empty (no persistence)

    def stored_again() -> bool:
        c.generate_text(
            _prompts(1, seed=random.randrange(1 << 30), length=40)[0], max_new_tokens=1, **GREEDY
        )  # new work to back up after the backoff
        return _l3(c)["connected"] == 1 and _settled(c)

    _wait(stored_again, timeout=90, what="L3 back after the restart")
    assert _l3(c)["outages"] == 1
    _, ids, _ = c.generate_text(prompts[0], max_new_tokens=6, **GREEDY)
    assert ids == ref[0]
    # the restart lost every object: the daemon recomputes and stores the prefix again
    _wait(lambda: _settled(c), what="backups")
    ids, done = _from_l3_again(c, prompts[0])
    assert ids == ref[0] and done.usage.cached_tokens_per_tier.l3 > 0


def test_keys_evicted_by_maxmemory_are_misses(redis_daemon):
    c, server = redis_daemon
    raw = server.client()
    raw.config_set("maxmemory-policy", "allkeys-lru")
    # the tiny model's KV: 512 B / token, 8 KB / object; 48 prompts write ~2 MB of objects.
    # NOTE: the room must exceed what one backup pipeline (32 objects, ~260 KB) puts in the
    # server's query buffer: a slow server holds it there while it executes the SETs, that
    # counts as used memory, and with less room it evicts every key, the newest too
    raw.config_set("maxmemory", str(int(raw.info("memory")["used_memory"]) + (1 << 20)))
    prompts = _prompts(48, seed=31, length=90)
    ref = [c.generate_text(p, max_new_tokens=6, **GREEDY)[1] for p in prompts[:44]]
    _wait(lambda: _l3(c)["pending_backups"] == 0, what="backups")
    # NOTE: the server's LRU clock ticks once a second: keys written within one tick are equally
    # old to it and it evicts among them at random; the last prompts go in a tick later
    time.sleep(1.1)
    ref += [c.generate_text(p, max_new_tokens=6, **GREEDY)[1] for p in prompts[44:]]
    _wait(lambda: _l3(c)["pending_backups"] == 0, what="backups")
    assert int(raw.info("stats")["evicted_keys"]) > 0
    # newest first: the last prompts' objects are still there; the first ones were evicted
    # (each recompute stores them again and evicts others: every output must still be right)
    for p, want in reversed(list(zip(prompts, ref))):
        ids, _ = _from_l3_again(c, p)
        assert ids == want
    # evicted metadata: the match sees no object (nothing read); evicted bytes: a read finds
    # them gone (vanished). The server's eviction count shows in the stats after a rescan.
    _wait(lambda: _l3(c)["server_evicted_keys"] > 0, what="the idle rescan")
    s = _l3(c)
    assert s["hit_tokens"] > 0 and s["corrupt"] == 0, (s, raw.info("stats"), raw.dbsize())
    assert s["used_tokens"] < s["backed_up_tokens"]  # what the server still holds
    assert c.health() == "SERVING"


def test_damaged_value_and_bytes_without_metadata(redis_daemon):
    c, server = redis_daemon
    raw = server.client()
    p1, p2 = _prompts(2, seed=41, length=70)
    ref1 = c.generate_text(p1, max_new_tokens=6, **GREEDY)[1]
    _wait(lambda: _settled(c), what="backups")
    data_keys = sorted(raw.scan_iter(match=b"hicache:*:d", count=1000))
    assert data_keys
    damaged = {}
    for k in data_keys:  # every object of p1: same length, wrong bytes
        v = bytearray(raw.get(k))
        v[len(v) // 2] ^= 0xFF
        damaged[k] = bytes(v)
        raw.set(k, damaged[k])
    ids, done = _from_l3_again(c, p1)
    assert ids == ref1 and done.usage.cached_tokens_per_tier.l3 == 0
    assert _l3(c)["corrupt"] >= 1
    # the damaged object was removed; the recompute stored it again, right this time
    _wait(lambda: _l3(c)["pending_backups"] == 0, what="backups")
    assert raw.get(data_keys[0]) != damaged[data_keys[0]]
    # bytes without metadata: an unfinished write, never read
    ref2 = c.generate_text(p2, max_new_tokens=6, **GREEDY)[1]
    _wait(lambda: _l3(c)["pending_backups"] == 0, what="backups")
    meta = sorted(raw.scan_iter(match=b"hicache:*:m", count=1000))
    raw.delete(*meta)
    ids, done = _from_l3_again(c, p2)
    assert ids == ref2 and done.usage.cached_tokens_per_tier.l3 == 0
    assert c.health() == "SERVING"


def test_flush_l3_deletes_only_this_models_keys(redis_daemon):
    c, server = redis_daemon
    raw = server.client()
    raw.set("someone-else:key", b"keep me")
    raw.set("hicache:0123456789abcdef:{x}:m", b"another model's object")
    c.generate_text(_prompts(1, seed=51, length=70)[0], max_new_tokens=2, **GREEDY)
    _wait(lambda: _settled(c), what="backups")
    ours = [k for k in raw.scan_iter(match=b"hicache:*") if not k.startswith(b"hicache:0123")]
    assert ours
    c.flush(["l3"])
    assert raw.get("someone-else:key") == b"keep me"
    assert raw.exists("hicache:0123456789abcdef:{x}:m")
    assert not any(raw.exists(k) for k in ours)


# --- attach / detach at run time ---------------------------------------------------------------
def test_attach_and_detach_while_requests_stream(tiny_llama_dir, tmp_path):
    server = ValkeyServer().start()
    args = ServerArgs(
        model_path=tiny_llama_dir,
        max_total_tokens=512,
        max_running_requests=4,
        enable_hierarchical_cache=True,
        hicache_storage_page_size=OBJECT,
        hicache_prefetch_threshold=0,
        debug_check_invariants=True,
    )
    dt = DaemonThread(DaemonSettings(port=0, grace_period_s=2), args).start()
    prompts = _prompts(6, seed=61, length=90)
    try:
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
            ref = [c.generate_text(p, max_new_tokens=8, **GREEDY)[1] for p in prompts]
            assert not c.storage().attached and not c.cache_stats().tiers[2].enabled
            info = c.attach_storage("redis", url=server.url)
            assert info.attached and info.backend == "redis" and info.object_tokens == OBJECT
            with pytest.raises(grpc.RpcError) as e:
                c.attach_storage("redis", url=server.url)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as e:
                c.attach_storage("s3", url="s3://x")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            errors: list[BaseException] = []
            outputs: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}

            def stream(i: int) -> None:
                try:
                    with HicacheClient(f"127.0.0.1:{dt.port}", timeout=120) as s:
                        for _ in range(3):
                            outputs[i].append(
                                s.generate_text(prompts[i], max_new_tokens=8, **GREEDY)[1]
                            )
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for _ in range(3):  # detach and attach again while they run
                before = c.detach_storage(timeout_s=60)
                assert before.attached and before.backend == "redis"
                assert not c.storage().attached
                c.attach_storage("redis", url=server.url)
            for t in threads:
                t.join(timeout=300)
            assert not errors, errors
            for i, outs in outputs.items():
                assert outs == [ref[i]] * 3

            # The prefix is served from the re-attached L3. Objects the server got before the
            # last detach are not written again (nothing to count then); a prefix L2 holds is
            # stored at its next match, unless that match found the backup queue full
            # (documented): so land what is in flight, drop L1 and L2, ask; if it was not in L3
            # the recompute writes it through, and the next round finds it there.
            def served_from_l3() -> bool:
                _wait(lambda: _l3(c)["pending_backups"] == 0, what="backups in flight")
                c.flush(["l1", "l2"])
                _, ids, done = c.generate_text(prompts[0], max_new_tokens=8, **GREEDY)
                assert ids == ref[0]
                return done.usage.cached_tokens_per_tier.l3 > 0

            _wait(served_from_l3, what="the prefix served from L3 after re-attach")
            assert c.health() == "SERVING"
    finally:
        dt.stop()
        server.cleanup()
