"""The daemon over a real localhost port (in-process, one shared per module): streaming equals
the engine's greedy output, concurrency, cancellation frees KV, admin RPCs, events, auth."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from engine.client import AsyncHicacheClient, HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.pb import admin_pb2, gen_pb2
from engine.server.settings import DaemonSettings

TOKEN, ADMIN = "user-token", "admin-token"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
TEXT = "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk."


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir):
    dt = DaemonThread(
        DaemonSettings(port=0, token=TOKEN, admin_token=ADMIN, grace_period_s=2),
        ServerArgs(
            model_path=tiny_llama_dir,
            max_total_tokens=8192,
            max_running_requests=16,
            debug_check_invariants=True,
        ),
    ).start()
    yield dt
    dt.stop()


@pytest.fixture(scope="module")
def engine(daemon):
    return daemon.daemon.state.engine


@pytest.fixture
def client(daemon):
    with HicacheClient(f"127.0.0.1:{daemon.port}", token=TOKEN, admin_token=ADMIN, timeout=60) as c:
        yield c


def _held(c: HicacheClient) -> tuple[int, int]:
    l1 = c.cache_stats().tiers[0]
    return int(l1.extra["held_by_requests_tokens"]), l1.used_tokens - int(l1.extra["cached_tokens"])


def _wait_kv_released(c: HicacheClient, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _held(c) != (0, 0):
        assert time.monotonic() < deadline, f"KV still held: {_held(c)}"
        time.sleep(0.05)


def test_stream_equals_engine_greedy(client, engine):
    ref = engine.generate(TEXT, {"max_new_tokens": 12, **GREEDY})
    text, ids, done = client.generate_text(TEXT, max_new_tokens=12, **GREEDY)
    assert ids == ref.token_ids and text == ref.text
    assert done.finish_reason == gen_pb2.FINISH_REASON_LENGTH
    assert done.usage.prompt_tokens == ref.prompt_tokens and done.usage.completion_tokens == 12
    # The second time the prompt is a cache hit, reported per tier.
    assert done.usage.cached_tokens > 0
    assert done.usage.cached_tokens_per_tier.l1 == done.usage.cached_tokens


def test_chat_and_token_id_prompts(client, engine):
    msgs = [{"role": "user", "content": "Hello world!"}]
    ref = engine.generate(msgs, {"max_new_tokens": 5, **GREEDY})
    _, ids, _ = client.generate_text("Hello world!", chat=True, max_new_tokens=5, **GREEDY)
    assert ids == ref.token_ids
    _, ids2, done = client.generate_text(engine.tokenize(msgs), max_new_tokens=5, **GREEDY)
    assert ids2 == ref.token_ids and done.usage.prompt_tokens == len(engine.tokenize(msgs))


def test_stop_string_reports_matched_stop(client, engine):
    free = engine.generate(TEXT, {"max_new_tokens": 10, **GREEDY}).text
    stop = free.strip()[:2]
    if not stop:
        pytest.skip("the random model produced no text")
    text, _, done = client.generate_text(TEXT, max_new_tokens=10, stop=[stop], **GREEDY)
    assert done.finish_reason == gen_pb2.FINISH_REASON_STOP
    assert done.matched_stop_string == stop and stop not in text


def test_32_concurrent_streams(daemon, engine, client):
    prompts = [f"Request number {i}: the quick brown fox" for i in range(32)]
    refs = [r.token_ids for r in engine.generate(prompts, {"max_new_tokens": 6, **GREEDY})]

    async def run() -> list[list[int]]:
        async with AsyncHicacheClient(f"127.0.0.1:{daemon.port}", token=TOKEN) as ac:

            async def one(p: str) -> list[int]:
                ids: list[int] = []
                async for r in ac.generate(p, max_new_tokens=6, **GREEDY):
                    ids += r.chunk.token_ids if r.HasField("chunk") else []
                return ids

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == refs
    _wait_kv_released(client)


def test_cancel_mid_stream_frees_kv(client):
    _wait_kv_released(client)
    stream = client.generate(TEXT, max_new_tokens=1500, **GREEDY)
    got = 0
    for r in stream:
        got += len(r.chunk.token_ids)
        if got >= 3:
            break
    assert _held(client)[0] > 0  # the running request holds KV
    stream.cancel()
    _wait_kv_released(client)
    assert client.server_info().active_requests == 0


def test_deadline_aborts_the_request(client):
    with pytest.raises(grpc.RpcError) as e:
        for _ in client.generate(TEXT + " deadline", max_new_tokens=1500, timeout=0.5, **GREEDY):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_kv_released(client)


def test_abort_rpc_ends_stream_with_abort(client):
    out: list = []
    stream = client.generate(TEXT, request_id="to-abort", max_new_tokens=1500, **GREEDY)
    first = next(iter(stream))
    assert first.request_id == "to-abort"
    assert client.abort("to-abort").found is True
    out = list(stream)
    assert out[-1].complete.finish_reason == gen_pb2.FINISH_REASON_ABORT
    assert client.abort("to-abort").found is False
    _wait_kv_released(client)


def test_match_prefetch_pin_evict_flush(client, engine):
    client.flush()
    start = client.cache_stats()
    assert start.tiers[0].used_tokens == 0
    prompt = "Prefill computes the prompt; decode produces one token at a time. " * 3
    # Match on an empty cache: nothing, and no side effects.
    m = client.match_prefix(prompt)
    assert m.matched_tokens == 0 and m.prompt_tokens > 10
    stages = list(client.prefetch(prompt, pin=True, pin_ttl_s=30))
    assert [s.stage for s in stages] == [
        admin_pb2.PREFETCH_STAGE_MATCHED,
        admin_pb2.PREFETCH_STAGE_RUNNING,
        admin_pb2.PREFETCH_STAGE_DONE,
    ]
    done = stages[-1]
    assert done.computed_tokens == m.prompt_tokens and done.pin_id
    assert done.cached_per_tier.l1 == m.prompt_tokens  # page size 1: the whole prompt
    assert client.match_prefix(prompt).matched_tokens == m.prompt_tokens
    stats = client.cache_stats()
    assert stats.num_pins == 1 and stats.admin_pinned_tokens == m.prompt_tokens
    assert stats.tiers[0].pinned_tokens >= m.prompt_tokens
    # Pinned: eviction cannot take it; a dry run reports and changes nothing.
    assert client.evict(all=True, dry_run=True).evicted_tokens == 0
    assert client.evict(all=True).evicted_tokens == 0
    assert client.match_prefix(prompt).matched_tokens == m.prompt_tokens
    tree = list(client.iter_tree())
    assert any(n.pinned for n in tree) and all(n.residency for n in tree)
    assert client.unpin(done.pin_id).unpinned == 1
    with pytest.raises(grpc.RpcError) as e:
        client.unpin(done.pin_id)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    prefix = engine.tokenize(prompt)[:10]
    dry = client.evict(prefix=prefix, dry_run=True)
    assert dry.evicted_tokens == m.prompt_tokens and dry.dry_run
    assert client.match_prefix(prompt).matched_tokens == m.prompt_tokens
    assert client.evict(prefix=prefix).evicted_tokens == m.prompt_tokens
    assert client.match_prefix(prompt).matched_tokens == 0
    list(client.prefetch(prompt))
    pin = client.pin(prompt, ttl_s=0.3)
    assert pin.pinned_tokens == m.prompt_tokens - 0  # the whole prompt is on L1
    time.sleep(0.6)  # the TTL passes; the scheduler's step hook unpins
    assert client.cache_stats().num_pins == 0
    flushed = client.flush()
    assert flushed.freed_tokens == m.prompt_tokens
    assert client.cache_stats().tiers[0].used_tokens == 0
    assert client.match_prefix(prompt).matched_tokens == 0
    assert client.match_prefix(prompt).matched_tokens == 0


def test_events_stream_and_resume(client):
    seen: list = []
    stream = client.watch_events(timeout=10)  # new events only

    def consume() -> None:
        try:
            for r in stream:
                seen.append(r.event)
        except grpc.RpcError:
            pass

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.3)
    client.flush()
    deadline = time.monotonic() + 5
    while not any(e.kind == admin_pb2.CACHE_EVENT_KIND_CLEARED for e in seen):
        assert time.monotonic() < deadline, "no cleared event"
        time.sleep(0.05)
    stream.cancel()
    t.join()
    cleared = next(e for e in seen if e.kind == admin_pb2.CACHE_EVENT_KIND_CLEARED)
    assert cleared.tier == 1 and cleared.seq > 0
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)
    # Resuming after a sequence number replays only the newer events.
    replay = next(iter(client.watch_events(after_seq=cleared.seq - 1, timeout=5)))
    assert replay.event.seq == cleared.seq
    later = client.watch_events(after_seq=cleared.seq, kinds=["cleared"], timeout=5)
    flush = threading.Timer(0.2, client.flush)
    flush.start()
    assert next(iter(later)).event.seq > cleared.seq
    later.cancel()
    # NOTE: the event is published before the Flush call returns: the client (closed after the
    # test) must outlive the call
    flush.join()


def test_flush_waits_for_idle_then_fails_unchanged(client):
    list(client.prefetch("The quick brown fox jumps over the lazy dog."))
    used = client.cache_stats().tiers[0].used_tokens
    stream = client.generate(TEXT, max_new_tokens=1500, **GREEDY)
    next(iter(stream))
    with pytest.raises(grpc.RpcError) as e:
        client.flush(timeout_s=0.3)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not idle" in e.value.details()
    assert client.cache_stats().tiers[0].used_tokens >= used  # nothing was flushed
    stream.cancel()
    _wait_kv_released(client)
    assert client.flush(timeout_s=5).freed_tokens > 0


def test_namespaces_do_not_share_prefixes(client, engine):
    client.flush()
    prompt = "Radix trees share common prefixes between requests; tenants must not."
    list(client.prefetch(prompt, namespace="tenant-a"))
    assert client.match_prefix(prompt, namespace="tenant-a").matched_tokens > 0
    assert client.match_prefix(prompt, namespace="tenant-b").matched_tokens == 0
    _, _, done = client.generate_text(prompt, namespace="tenant-b", max_new_tokens=2, **GREEDY)
    assert done.usage.cached_tokens == 0


def test_auth(daemon):
    addr = f"127.0.0.1:{daemon.port}"
    with (
        HicacheClient(addr) as anon,
        HicacheClient(addr, token="wrong") as wrong,
        HicacheClient(addr, token=TOKEN) as user,
    ):
        assert anon.health() == "SERVING"  # health is exempt
        for c, code in (
            (anon, grpc.StatusCode.UNAUTHENTICATED),
            (wrong, grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.RpcError) as e:
                c.cache_stats()
            assert e.value.code() == code
        assert user.cache_stats().tiers[0].enabled  # the user token reads
        with pytest.raises(grpc.RpcError) as e:
            anon.flush()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for c in (user, wrong):  # a token that is not the admin token
            for call in (
                lambda c: c.flush(),
                lambda c: c.evict(all=True),
                lambda c: list(c.prefetch("x")),
                lambda c: c.unpin(),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call(c)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()


def test_reflection_lists_both_services(daemon):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        # Reflection needs the bearer token too when the daemon has one.
        resp = next(
            iter(
                stub.ServerReflectionInfo(
                    iter([req]), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5
                )
            )
        )
    services = {s.name for s in resp.list_services_response.service}
    assert {
        "hicache.v1.GenerationService",
        "hicache.v1.CacheAdminService",
        "grpc.health.v1.Health",
    } <= services


def test_metrics_off_and_server_info(client):
    info = client.server_info()
    assert info.version and "auth" in info.features and "admin_auth" in info.features
    assert "metrics" not in info.features and info.config["max_total_tokens"] == "8192"
    assert info.config["daemon.token"] == '"***"'  # secrets never leave the server
    assert client.model_info().vocab_size > 0
