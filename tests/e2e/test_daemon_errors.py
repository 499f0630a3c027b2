"""Malformed requests get the right status code and a precise message, and the daemon stays
healthy; health goes NOT_SERVING -> SERVING once the model is loaded."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.pb import admin_pb2, common_pb2, gen_pb2
from engine.server.settings import DaemonSettings

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir):
    dt = DaemonThread(
        DaemonSettings(port=0, grace_period_s=1),
        ServerArgs(model_path=tiny_llama_dir, max_total_tokens=4096, context_length=256),
    ).start()
    yield dt
    dt.stop()


@pytest.fixture(scope="module")
def client(daemon):
    with HicacheClient(f"127.0.0.1:{daemon.port}", timeout=30) as c:
        yield c


def _text(s: str = "hello") -> common_pb2.Prompt:
    return common_pb2.Prompt(text=s)


def _gen(
    prompt: common_pb2.Prompt | None = None, ns: str = "", rid: str = "", **sp
) -> gen_pb2.GenerateRequest:
    return gen_pb2.GenerateRequest(
        prompt=prompt if prompt is not None else _text(),
        cache_namespace=ns,
        request_id=rid,
        sampling_params=gen_pb2.SamplingParams(**sp),
    )


def _chat(*msgs: tuple[str, str]) -> common_pb2.Prompt:
    return common_pb2.Prompt(
        chat=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in msgs]
        )
    )


def _ids(*ids: int) -> common_pb2.Prompt:
    return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=list(ids)))


GENERATE_CASES = [
    ("no prompt", gen_pb2.GenerateRequest(), INVALID, "prompt is required"),
    ("empty text", _gen(_text("")), INVALID, "prompt.text is empty"),
    ("empty token ids", _gen(_ids()), INVALID, "token_ids.ids is empty"),
    ("token id out of vocab", _gen(_ids(1, 2, 10**6)), INVALID, "ids[2] = 1000000"),
    ("empty chat", _gen(_chat()), INVALID, "chat.messages is empty"),
    ("bad chat role", _gen(_chat(("robot", "hi"))), INVALID, "messages[0].role"),
    ("max_new_tokens 0", _gen(max_new_tokens=0), INVALID, "max_new_tokens must be >= 1"),
    ("max_new_tokens < 0", _gen(max_new_tokens=-3), INVALID, "got -3"),
    ("temperature < 0", _gen(temperature=-0.5), INVALID, "temperature must be >= 0"),
    ("temperature NaN", _gen(temperature=math.nan), INVALID, "temperature must be a finite"),
    ("top_p 0", _gen(top_p=0.0), INVALID, "top_p must be in (0, 1]"),
    ("top_p > 1", _gen(top_p=1.5), INVALID, "top_p must be in (0, 1]"),
    ("top_k 0", _gen(top_k=0), INVALID, "top_k must be -1 (off) or >= 1"),
    ("top_k -5", _gen(top_k=-5), INVALID, "got -5"),
    ("min_p > 1", _gen(min_p=2.0), INVALID, "min_p must be in [0, 1]"),
    ("seed < 0", _gen(seed=-1), INVALID, "seed must be >= 0"),
    ("empty stop string", _gen(stop=[""]), INVALID, "stop[0]"),
    ("too many stops", _gen(stop=["x"] * 33), INVALID, "the limit is 32"),
    ("stop token out of vocab", _gen(stop_token_ids=[10**6]), INVALID, "stop_token_ids[0]"),
    ("namespace with space", _gen(ns="a b"), INVALID, "cache_namespace must match"),
    ("namespace too long", _gen(ns="n" * 65), INVALID, "cache_namespace must match"),
    ("request id with slash", _gen(rid="a/b"), INVALID, "request_id must match"),
    ("prompt over the context", _gen(_ids(*([5] * 300))), INVALID, "context limit"),
]

ADMIN_CASES = [
    (
        "match without prompt",
        "MatchPrefix",
        admin_pb2.MatchPrefixRequest(),
        INVALID,
        "prompt is required",
    ),
    (
        "match bad namespace",
        "MatchPrefix",
        admin_pb2.MatchPrefixRequest(prompt=_text(), cache_namespace="x!"),
        INVALID,
        "cache_namespace",
    ),
    ("evict without target", "Evict", admin_pb2.EvictRequest(), INVALID, "target is required"),
    (
        "evict zero tokens",
        "Evict",
        admin_pb2.EvictRequest(num_tokens=0),
        INVALID,
        "num_tokens must be >= 1",
    ),
    ("evict all=false", "Evict", admin_pb2.EvictRequest(all=False), INVALID, "target"),
    (
        "evict unknown tier",
        "Evict",
        admin_pb2.EvictRequest(tier=9, all=True),
        INVALID,
        "tier must be",
    ),
    (
        "evict l2 not enabled",
        "Evict",
        admin_pb2.EvictRequest(tier=2, all=True),
        grpc.StatusCode.FAILED_PRECONDITION,
        "tier l2 is not enabled",
    ),
    (
        "evict empty prefix",
        "Evict",
        admin_pb2.EvictRequest(prefix=_text("")),
        INVALID,
        "prefix.text is empty",
    ),
    (
        "pin negative ttl",
        "Pin",
        admin_pb2.PinRequest(prompt=_text(), ttl_s=-1),
        INVALID,
        "ttl_s must be",
    ),
    (
        "pin NaN ttl",
        "Pin",
        admin_pb2.PinRequest(prompt=_text(), ttl_s=math.nan),
        INVALID,
        "ttl_s must be",
    ),
    (
        "pin uncached",
        "Pin",
        admin_pb2.PinRequest(prompt=_text("never seen before")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "Prefetch it first",
    ),
    ("unpin without target", "Unpin", admin_pb2.UnpinRequest(), INVALID, "target is required"),
    (
        "unpin unknown id",
        "Unpin",
        admin_pb2.UnpinRequest(pin_id="pin-404"),
        grpc.StatusCode.NOT_FOUND,
        "pin-404",
    ),
    ("flush bad tier", "Flush", admin_pb2.FlushRequest(tiers=[7]), INVALID, "tiers must be"),
    (
        "flush negative timeout",
        "Flush",
        admin_pb2.FlushRequest(timeout_s=-1),
        INVALID,
        "timeout_s must be",
    ),
    (
        "tree page too big",
        "InspectTree",
        admin_pb2.InspectTreeRequest(page_size=5000),
        INVALID,
        "page_size must be <= 1000",
    ),
    (
        "tree bad page token",
        "InspectTree",
        admin_pb2.InspectTreeRequest(page_token="abc"),
        INVALID,
        "page_token",
    ),
    (
        "tree preview too long",
        "InspectTree",
        admin_pb2.InspectTreeRequest(preview_tokens=999),
        INVALID,
        "preview_tokens",
    ),
    (
        "prefetch bad ttl",
        "Prefetch",
        admin_pb2.PrefetchRequest(prompt=_text(), pin_ttl_s=-2),
        INVALID,
        "pin_ttl_s",
    ),
    ("prefetch no prompt", "Prefetch", admin_pb2.PrefetchRequest(), INVALID, "prompt"),
    (
        "events unknown kind",
        "WatchCacheEvents",
        admin_pb2.WatchCacheEventsRequest(kinds=[42]),
        INVALID,
        "kinds",
    ),
    (
        "events unknown tier",
        "WatchCacheEvents",
        admin_pb2.WatchCacheEventsRequest(tiers=[8]),
        INVALID,
        "tiers",
    ),
]


def _consume(result) -> None:
    if hasattr(result, "__iter__") and not hasattr(result, "DESCRIPTOR"):
        for _ in result:
            pass


@pytest.mark.parametrize(
    "name,req,code,message", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES]
)
def test_malformed_generate(client, name, req, code, message):
    with pytest.raises(grpc.RpcError) as e:
        _consume(client.gen.Generate(req, timeout=10))
    assert e.value.code() == code, e.value.details()
    assert message in e.value.details()


@pytest.mark.parametrize(
    "name,method,req,code,message", ADMIN_CASES, ids=[c[0] for c in ADMIN_CASES]
)
def test_malformed_admin(client, name, method, req, code, message):
    with pytest.raises(grpc.RpcError) as e:
        _consume(getattr(client.admin, method)(req, timeout=10))
    assert e.value.code() == code, e.value.details()
    assert message in e.value.details()


def test_abort_without_id_and_duplicate_request_id(client):
    with pytest.raises(grpc.RpcError) as e:
        client.abort("")
    assert e.value.code() == INVALID
    stream = client.generate(
        "hello there", request_id="dup", max_new_tokens=1000, temperature=0.0, ignore_eos=True
    )
    next(iter(stream))
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text("hello", request_id="dup", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()


def test_concurrent_duplicate_request_ids_only_one_accepted(daemon, client, monkeypatch):
    """Four Generate calls with one request_id at once: one runs, the others get ALREADY_EXISTS.
    A slow submit widens the window between the id check and the engine taking the request."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    engine = daemon.daemon.state.engine
    submit = engine.submit

    def slow_submit(*a, **kw):
        time.sleep(0.3)
        return submit(*a, **kw)

    monkeypatch.setattr(engine, "submit", slow_submit)
    barrier = threading.Barrier(4)

    def one(_: int) -> str:
        barrier.wait()
        try:
            client.generate_text(
                "hello there",
                request_id="same-id",
                max_new_tokens=4,
                temperature=0.0,
                ignore_eos=True,
            )
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    with ThreadPoolExecutor(4) as pool:
        codes = sorted(pool.map(one, range(4)))
    assert codes == ["ALREADY_EXISTS"] * 3 + ["OK"], codes


def test_request_cancelled_while_being_submitted_does_not_run(daemon, client, monkeypatch):
    """A deadline that passes while the engine is taking the request: the request is aborted
    once it is in, not left to generate for nobody."""
    import queue
    import time

    engine = daemon.daemon.state.engine
    submit = engine.submit
    handles: queue.Queue = queue.Queue()

    def slow_submit(*a, **kw):
        time.sleep(0.5)
        handle = submit(*a, **kw)
        handles.put(handle)
        return handle

    monkeypatch.setattr(engine, "submit", slow_submit)
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text(
            "hello there", max_new_tokens=200, temperature=0.0, ignore_eos=True, timeout=0.2
        )
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    handle = handles.get(timeout=10)
    chunk = handle.chunks.get(timeout=30)
    while not chunk.finished:
        chunk = handle.chunks.get(timeout=30)
    assert chunk.finish_reason == "abort", chunk.finish_reason


def _raw(daemon, method: str, payload: bytes, streaming: bool) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        kind = ch.unary_stream if streaming else ch.unary_unary
        call = kind(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            _consume(call(payload, timeout=10))
    return e.value


UNDECODABLE = [
    # field 1 (prompt) -> field 1 (text) holding invalid UTF-8
    ("bad utf-8 text", "/hicache.v1.GenerationService/Generate", b"\x0a\x04\x0a\x02\xff\xfe", True),
    ("garbage bytes", "/hicache.v1.GenerationService/Generate", b"\xff\xff\xff\xff", True),
    ("garbage abort", "/hicache.v1.GenerationService/Abort", b"\x0a\x05\xc3\x28abc", False),
    ("garbage stats", "/hicache.v1.CacheAdminService/GetCacheStats", b"\x08\xff", False),
    ("truncated", "/hicache.v1.CacheAdminService/MatchPrefix", b"\x0a\x10abc", False),
]


@pytest.mark.parametrize(
    "name,method,payload,streaming", UNDECODABLE, ids=[c[0] for c in UNDECODABLE]
)
def test_undecodable_message_is_invalid_argument(daemon, name, method, payload, streaming):
    err = _raw(daemon, method, payload, streaming)
    assert err.code() == INVALID, (err.code(), err.details())
    assert "cannot be decoded" in err.details()


def test_daemon_still_healthy_after_the_catalogue(client):
    assert len(GENERATE_CASES) + len(ADMIN_CASES) >= 25
    assert client.health() == "SERVING"
    _, ids, done = client.generate_text("hello", max_new_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(ids) == 3 and done.finish_reason == gen_pb2.FINISH_REASON_LENGTH


def test_health_not_serving_until_loaded(tiny_llama_dir):
    from engine.server.app import default_engine_factory

    gate = threading.Event()
    build = default_engine_factory(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=1024))

    def gated():
        gate.wait(60)
        return build()

    dt = DaemonThread(DaemonSettings(port=0, warmup=True), engine_factory=gated)
    dt.start(wait_ready=False)
    try:
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=10) as c:
            for service in ("", "hicache.v1.GenerationService", "hicache.v1.CacheAdminService"):
                assert c.health(service) == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as e:
                c.generate_text("hello", max_new_tokens=1)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in e.value.details()
            assert "generate" in c.server_info().features  # info works while loading
            gate.set()
            watch = c.health_stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            for status in watch:
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            watch.cancel()
            assert c.health() == "SERVING"
            assert c.generate_text("hello", max_new_tokens=2)[2].usage.completion_tokens >= 1
    finally:
        dt.stop()


def test_stop_past_the_grace_ends_open_streams_unavailable(tiny_llama_dir):
    """A stream still open when the drain's grace runs out is aborted (its KV freed) and ends
    with UNAVAILABLE, the server shutting down: not CANCELLED, which reads as the client's doing."""
    dt = DaemonThread(
        DaemonSettings(port=0, warmup=False, grace_period_s=0.2),
        ServerArgs(model_path=tiny_llama_dir, max_total_tokens=4096),
    ).start()
    stopper = threading.Thread(target=dt.stop)
    try:
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
            it = iter(c.generate([40] * 8, max_new_tokens=1900, temperature=0.0, ignore_eos=True))
            next(it)
            stopper.start()
            with pytest.raises(grpc.RpcError) as e:
                for _ in it:
                    pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "shutting down" in e.value.details()
    finally:
        if stopper.ident is None:  # failed before the stop began
            dt.stop()
        else:
            stopper.join(60)


def test_a_client_abort_while_draining_still_ends_with_abort(tiny_llama_dir):
    """The client's own Abort of a stream during the drain: the stream ends OK with finish ABORT
    (only the stop's aborts, past the grace, are the server's doing)."""
    dt = DaemonThread(
        DaemonSettings(port=0, warmup=False, grace_period_s=30),
        ServerArgs(model_path=tiny_llama_dir, max_total_tokens=4096),
    ).start()
    stopper = threading.Thread(target=dt.stop)
    try:
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
            it = iter(
                c.generate(
                    [40] * 8,
                    max_new_tokens=1900,
                    temperature=0.0,
                    ignore_eos=True,
                    request_id="drain-abort",
                )
            )
            next(it)
            stopper.start()
            deadline = time.monotonic() + 10
            while c.health() != "NOT_SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert c.abort("drain-abort").found
            last = None
            for r in it:
                last = r
        assert last.complete.finish_reason == gen_pb2.FINISH_REASON_ABORT
    finally:
        if stopper.ident is None:
            dt.stop()
        else:
            stopper.join(60)
