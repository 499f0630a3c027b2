"""The OpenAI-compatible HTTP API over a real port (in-process daemon, one per module) with the
official `openai` client: greedy output equals the engine's, streams equal whole answers, usage
and cache hits, OpenAI-shaped errors with their statuses, auth and tenants, and a client that
goes away aborts its request."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx2
import openai
import pytest

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.errors import EngineShutdownError, QueueFullError
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings
from engine.server.tenants import Tenant

TOKEN, ACME = "user-token", "acme-key"
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}  # vLLM's extension, through extra_body
TEXT = "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk."
MSGS = [{"role": "user", "content": "Hello world! How are you today?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir) -> Iterator[DaemonThread]:
    settings = DaemonSettings(
        port=0,
        http_port=_free_port(),
        metrics_port=_free_port(),
        warmup=False,
        token=TOKEN,
        tenants=(Tenant("acme", (ACME,)),),
        grace_period_s=2,
    )
    args = ServerArgs(model_path=tiny_llama_dir, max_total_tokens=8192, max_running_requests=8)
    dt = DaemonThread(settings, args).start()
    yield dt
    dt.stop()


@pytest.fixture(scope="module")
def engine(daemon) -> Any:
    return daemon.daemon.state.engine


@pytest.fixture(scope="module")
def url(daemon) -> str:
    return f"http://127.0.0.1:{daemon.daemon.http_port}"


@pytest.fixture(scope="module")
def client(url) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=60) as c:
        yield c


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "m")
    kw.setdefault("messages", MSGS)
    return client.chat.completions.create(**kw)


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def _held_tokens(daemon: DaemonThread) -> int:
    with HicacheClient(f"127.0.0.1:{daemon.port}", token=TOKEN, timeout=30) as c:
        return int(c.cache_stats().tiers[0].extra["held_by_requests_tokens"])


def test_models_list_and_retrieve(client, daemon):
    models = client.models.list().data
    # the model directory's name first (a gateway routes by it), then every other accepted name
    assert [m.id for m in models] == ["m", "default", daemon.daemon.server_args.model_path]
    assert client.models.retrieve("default").id == "default"  # an alias is a listed model
    assert client.models.retrieve("m").owned_by == "hicache"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_chat_equals_engine_greedy(client, engine):
    ref = engine.generate(MSGS, {"max_new_tokens": 8, **GREEDY, **NO_EOS})
    r = _chat(client, max_tokens=8, extra_body=NO_EOS, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "m"
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert ref.text and choice.finish_reason == "length"
    u = r.usage
    assert u.prompt_tokens == len(engine.tokenize(MSGS)) == ref.prompt_tokens
    assert u.completion_tokens == 8 and u.total_tokens == u.prompt_tokens + 8


def test_text_parts_are_joined(client, engine):
    parts = [{"type": "text", "text": "Hello world!"}, {"type": "text", "text": "How are you?"}]
    ref = engine.generate(
        [{"role": "user", "content": "Hello world!\nHow are you?"}],
        {"max_new_tokens": 5, **GREEDY, **NO_EOS},
    )
    r = _chat(
        client,
        messages=[{"role": "user", "content": parts}],
        max_tokens=5,
        extra_body=NO_EOS,
        **GREEDY,
    )
    assert r.choices[0].message.content == ref.text


def test_streamed_chat_equals_whole(client):
    whole = _chat(client, max_tokens=10, extra_body=NO_EOS, **GREEDY)
    chunks = list(
        _chat(
            client,
            max_tokens=10,
            extra_body=NO_EOS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, finish, usage = chunks
    streamed = "".join(c.choices[0].delta.content or "" for c in body)
    assert streamed == whole.choices[0].message.content
    assert finish.choices[0].finish_reason == "length" and finish.usage is None
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_text_and_token_ids_equal_engine(client, engine):
    ref = engine.generate(TEXT, {"max_new_tokens": 12, **GREEDY, **NO_EOS})
    r = client.completions.create(
        model="m", prompt=TEXT, max_tokens=12, extra_body=NO_EOS, **GREEDY
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == 12
    ids = client.completions.create(
        model="default", prompt=engine.tokenize(TEXT), max_tokens=12, extra_body=NO_EOS, **GREEDY
    )
    assert ids.choices[0].text == ref.text and ids.usage.prompt_tokens == ref.prompt_tokens
    stream = client.completions.create(
        model="m", prompt=TEXT, max_tokens=12, stream=True, extra_body=NO_EOS, **GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(client, engine):
    params = {"max_new_tokens": 10, **GREEDY, **NO_EOS}
    free = engine.generate(TEXT, params).text
    at = next((i for i, ch in enumerate(free) if i > 0 and ch.isascii() and ch.isalnum()), None)
    if at is None:
        pytest.skip("the random model produced no plain text")
    stop = free[at : at + 2]
    ref = engine.generate(TEXT, {**params, "stop": [stop]})
    for form in (stop, [stop, "never-seen-stop"]):
        r = client.completions.create(
            model="m", prompt=TEXT, max_tokens=10, stop=form, extra_body=NO_EOS, **GREEDY
        )
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref.text
        assert free.startswith(r.choices[0].text) and stop not in r.choices[0].text


def test_max_completion_tokens_wins_and_ends_with_length(client):
    r = _chat(client, max_tokens=9, max_completion_tokens=3, extra_body=NO_EOS, **GREEDY)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_repeated_long_prompt_reports_cached_tokens(client):
    prompt = "Cached prefix check. " + TEXT * 3
    first = client.completions.create(model="m", prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model="m", prompt=prompt, max_tokens=2, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens - 1 <= cached <= second.usage.prompt_tokens
    tiers = second.usage.prompt_tokens_details.model_extra["cached_tokens_per_tier"]
    assert tiers["l1"] == cached


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": -3}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"logprobs": True}, "logprobs"),
        ({"extra_body": {"cache_namespace": "no spaces allowed"}}, "cache_namespace"),
    ],
)
def test_bad_chat_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **{"max_tokens": 2, **kw})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param
    assert e.value.body["message"]


def test_bad_bodies_and_routes(url, client, engine):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400),
        ("POST", "/v1/chat/completions", b'{"model": "m"}', 400),  # no messages
        ("POST", "/v1/completions", b'{"model": "m"}', 400),  # no prompt
        ("POST", "/v1/completions", b'{"prompt": ["a", "b"]}', 400),  # a batch
        ("GET", "/v1/nowhere", b"", 404),
        ("GET", "/v1/chat/completions", b"", 405),
    ]
    for method, path, body, status in cases:
        r = httpx2.request(method, url + path, content=body, headers=auth, timeout=30)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    with pytest.raises(openai.BadRequestError, match="context"):  # the engine's ValueError
        client.completions.create(model="m", prompt=[5] * engine.max_context_len, max_tokens=1)
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, model="not-this-one", max_tokens=2)
    assert e.value.body["param"] == "model"


def test_auth_and_tenants(url, client):
    body = {"model": "m", "messages": MSGS, "max_tokens": 2}
    r = httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx2.get(f"{url}/v1/models", timeout=30).status_code == 401
    with (
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        _chat(bad, max_tokens=2)
    assert _chat(client, max_tokens=2).usage.completion_tokens >= 1
    prompt = "Tenant namespace check. " + TEXT
    with openai.OpenAI(base_url=f"{url}/v1", api_key=ACME, max_retries=0) as acme:
        with pytest.raises(openai.PermissionDeniedError) as e:
            acme.completions.create(
                model="m",
                prompt=prompt,
                max_tokens=1,
                extra_body={"cache_namespace": "someone-else"},
            )
        assert e.value.body["type"] == "permission_error"
        for _ in range(2):
            own = acme.completions.create(
                model="m", prompt=prompt, max_tokens=1, extra_body={"cache_namespace": "acme"}
            )
        assert own.usage.prompt_tokens_details.cached_tokens > 0
    # The tenant's prompt was cached in its namespace: the shared user does not hit it.
    shared = client.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert shared.usage.prompt_tokens_details.cached_tokens == 0


def test_health_and_draining(url, client, daemon):
    assert httpx2.get(f"{url}/health", timeout=30).json() == {"status": "ok"}  # needs no key
    st = daemon.daemon.state
    st.draining = True
    try:
        r = httpx2.get(f"{url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        with pytest.raises(openai.InternalServerError) as e:
            _chat(client, max_tokens=2)
        assert e.value.status_code == 503
    finally:
        st.draining = False
    assert httpx2.get(f"{url}/health", timeout=30).status_code == 200


def test_engine_errors_map_to_status(client, engine, monkeypatch):
    for exc, error in (
        (QueueFullError("queue full"), openai.RateLimitError),
        (EngineShutdownError("gone"), openai.InternalServerError),
    ):

        def refuse(*args: Any, exc: BaseException = exc) -> Any:
            raise exc

        monkeypatch.setattr(engine, "submit", refuse)
        with pytest.raises(error) as e:
            _chat(client, max_tokens=2)
        assert e.value.status_code == (429 if isinstance(exc, QueueFullError) else 503)
        assert e.value.body["message"] == str(exc)
    monkeypatch.undo()
    assert _chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_metrics_count_http_requests(daemon, client):
    url = f"http://127.0.0.1:{daemon.daemon.metrics_port}/metrics"

    def length_requests() -> float:
        text = httpx2.get(url, timeout=30).text
        m = re.search(
            r'^hicache_requests_total\{finish_reason="length"\} (\S+)$', text, re.MULTILINE
        )
        return float(m.group(1)) if m else 0.0

    before = length_requests()
    _chat(client, max_tokens=2, extra_body=NO_EOS, **GREEDY)
    list(_chat(client, max_tokens=2, extra_body=NO_EOS, stream=True, **GREEDY))
    assert length_requests() == before + 2
    assert re.search(
        r"^hicache_active_streams 0\.0$", httpx2.get(url, timeout=30).text, re.MULTILINE
    )


def test_loads_for_gateways(url, client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx2.get(
        f"{url}/v1/loads", params={"include": "core,disagg,queues,memory"}, headers=auth, timeout=30
    )
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["dp_rank_count"] == 1 and len(report["loads"]) == 1
    load = report["loads"][0]
    assert load["max_total_num_tokens"] == 8192 and load["max_running_requests"] == 8
    assert load["queues"] == {"waiting": load["num_waiting_reqs"]}
    assert load["disaggregation"] == {"mode": "null"}
    assert report["aggregate"]["total_tokens"] == load["num_used_tokens"]
    # a stream held open is counted as running, with its KV in use
    stream = _chat(client, max_tokens=400, extra_body=NO_EOS, stream=True, **GREEDY)
    try:
        next(iter(stream))

        def running() -> bool:
            body = httpx2.get(
                f"{url}/loads", params={"model": "m"}, headers=auth, timeout=30
            ).json()
            return (
                body["loads"][0]["num_running_reqs"] == 1
                and body["loads"][0]["num_used_tokens"] > 0
            )

        _wait(running, "the open stream in /loads")
    finally:
        stream.close()

    def idle() -> bool:  # the stream's KV cached (in L1), evictable: no load
        body = httpx2.get(f"{url}/v1/loads?include=tiers", headers=auth, timeout=30).json()
        load = body["loads"][0]
        assert body["tiers"]["l1"]["used_tokens"] > 0
        return load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0 == load["token_usage"]

    _wait(idle, "the aborted stream's KV to be evictable cache, not load")
    tiers = httpx2.get(f"{url}/v1/loads?include=tiers", headers=auth, timeout=30).json()["tiers"]
    assert tiers["l1"]["capacity_tokens"] == 8192
    for query, status in (("include=bogus", 400), ("model=gpt-4", 404)):
        r = httpx2.get(f"{url}/v1/loads?{query}", headers=auth, timeout=30)
        assert r.status_code == status, r.text
    assert httpx2.get(f"{url}/v1/loads", timeout=30).status_code == 401


def test_metrics_on_the_http_port(url, daemon, client):
    r = httpx2.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "hicache_num_used_tokens" in r.text and "hicache_requests_total" in r.text
    assert httpx2.get(f"{url}/metrics", timeout=30).status_code == 401
    # a tenant's key is refused: the figures name every tenant
    r = httpx2.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ACME}"}, timeout=30)
    assert r.status_code == 403


def test_sglang_worker_auth_and_tenants(daemon):
    """SMG's worker protocol on the gRPC port follows the daemon's auth and tenant rules."""
    from engine.server.gen.smg import sglang_scheduler_pb2 as sg
    from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sg_grpc

    ids = [7, 8, 9, 10, 11, 12, 13, 14]
    req = sg.GenerateRequest(
        tokenized=sg.TokenizedInput(input_ids=ids),
        sampling_params=sg.SamplingParams(max_new_tokens=1),
    )
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        stub = sg_grpc.SglangSchedulerStub(ch)
        assert stub.HealthCheck(sg.HealthCheckRequest(), timeout=30).healthy  # needs no key
        for key, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ("wrong", grpc.StatusCode.UNAUTHENTICATED),
        ):
            meta = None if key is None else [("authorization", f"Bearer {key}")]
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(sg.GetModelInfoRequest(), metadata=meta, timeout=30)
            assert e.value.code() == code
        acme = [("authorization", f"Bearer {ACME}")]
        out = list(stub.Generate(req, metadata=acme, timeout=60))
        assert out[-1].complete.prompt_tokens == len(ids)
    # the tenant's prompt went to its own namespace: the shared user does not see it
    with HicacheClient(f"127.0.0.1:{daemon.port}", token=ACME, timeout=30) as c:
        assert c.match_prefix(ids).matched_tokens >= len(ids) - 1
    with HicacheClient(f"127.0.0.1:{daemon.port}", token=TOKEN, timeout=30) as c:
        assert c.match_prefix(ids).matched_tokens == 0


def _kv_batches(port: int, key: str, start: int, until: Any) -> list[Any]:
    """SubscribeKvEvents from `start`: the batches until until(batches) holds (the RPC's
    deadline bounds the wait)."""
    from engine.server.gen.smg import common_pb2 as smg_common
    from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sg_grpc

    got: list[Any] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stream = sg_grpc.SglangSchedulerStub(ch).SubscribeKvEvents(
            smg_common.SubscribeKvEventsRequest(start_sequence_number=start),
            metadata=[("authorization", f"Bearer {key}")],
            timeout=60,
        )
        for batch in stream:
            got.append(batch)
            if until(got):
                stream.cancel()
                break
    return got


def test_kv_events_tiers_tenants_replay(daemon):
    """SMG's SubscribeKvEvents: a snapshot first, then the blocks a request stores; a tenant's
    identical prompt is other blocks (salted, its name nowhere); replay from a sequence number
    repeats the same batches; out-of-range starts and tenants' keys are refused."""
    from engine.server.gen.smg import common_pb2 as smg_common
    from engine.server.gen.smg import sglang_scheduler_pb2 as sg
    from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sg_grpc

    port = daemon.port
    (snap,) = _kv_batches(port, TOKEN, 0, lambda b: True)
    assert snap.HasField("snapshot") and snap.snapshot.count == 1
    assert snap.events[0].HasField("cleared") and snap.sequence_number >= 1
    ids = list(range(40, 80))  # 40 tokens: 2 full blocks of 16
    req = sg.GenerateRequest(
        tokenized=sg.TokenizedInput(input_ids=ids),
        sampling_params=sg.SamplingParams(max_new_tokens=1),
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = sg_grpc.SglangSchedulerStub(ch)
        for key in (TOKEN, ACME):
            list(stub.Generate(req, metadata=[("authorization", f"Bearer {key}")], timeout=60))

    def device_chains(batches: list[Any]) -> list[Any]:
        return [
            e.stored
            for b in batches
            for e in b.events
            if e.HasField("stored")
            and e.stored.tier == smg_common.KV_CACHE_TIER_DEVICE
            and [t for blk in e.stored.blocks for t in blk.token_ids] == ids[:32]
        ]

    start = snap.sequence_number + 1
    live = _kv_batches(port, TOKEN, start, lambda b: len(device_chains(b)) >= 2)
    shared, salted = sorted(device_chains(live), key=lambda c: c.HasField("cache_salt"))
    assert not shared.HasField("cache_salt") and salted.cache_salt
    assert "acme" not in salted.cache_salt
    assert all(b.block_size == 16 for b in shared.blocks)
    first, second = shared.blocks
    assert not shared.HasField("parent_block_hash")  # the sequence's first block
    assert {first.block_hash, second.block_hash}.isdisjoint({b.block_hash for b in salted.blocks})
    assert [b.sequence_number for b in live] == list(range(start, start + len(live)))
    again = _kv_batches(port, TOKEN, start, lambda b: len(b) >= len(live))
    assert [b.SerializeToString() for b in again] == [b.SerializeToString() for b in live]
    for key, st, code in (
        (TOKEN, 10**9, grpc.StatusCode.OUT_OF_RANGE),
        (ACME, 0, grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as e:
            _kv_batches(port, key, st, lambda b: True)
        assert e.value.code() == code


def _spy_aborts(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    aborted: list[str] = []
    real = engine.abort

    def abort(rid: str) -> None:
        aborted.append(rid)
        real(rid)

    monkeypatch.setattr(engine, "abort", abort)
    return aborted


LONG = {"model": "m", "messages": MSGS, "max_tokens": 1800, "ignore_eos": True, **GREEDY}


def test_client_gone_mid_stream_aborts(url, daemon, engine, monkeypatch):
    st = daemon.daemon.state
    aborted = _spy_aborts(engine, monkeypatch)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with (
        httpx2.Client(headers=auth, timeout=60) as h,
        h.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        # NOTE: the line iterator must outlive the loop: a dropped one closes the response
        lines = r.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break  # tokens are flowing
        (rid,) = st.active
        assert aborted == []
    _wait(lambda: not st.active, "the request to leave state.active")
    assert aborted == [rid]
    _wait(lambda: _held_tokens(daemon) == 0, "the request's KV to be freed")


def test_client_gone_mid_completion_aborts(url, daemon, engine, monkeypatch):
    st = daemon.daemon.state
    aborted = _spy_aborts(engine, monkeypatch)
    body = httpx2.Request("POST", f"{url}/v1/chat/completions", json=LONG).content
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", daemon.daemon.http_port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        _wait(lambda: len(st.active) == 1, "the request to start")
        (rid,) = st.active
    _wait(lambda: not st.active, "the request to leave state.active")
    assert aborted == [rid]
    _wait(lambda: _held_tokens(daemon) == 0, "the request's KV to be freed")


def test_loading_is_503(tiny_llama_dir):
    gate = threading.Event()

    def never_loads() -> Any:
        gate.wait(60)
        raise RuntimeError("this test's model never loads")

    dt = DaemonThread(
        DaemonSettings(port=0, http_port=_free_port(), warmup=False), engine_factory=never_loads
    )
    dt.start(wait_ready=False)
    try:
        url = f"http://127.0.0.1:{dt.daemon.http_port}"
        r = httpx2.get(f"{url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                _chat(c, max_tokens=2)
            assert e.value.status_code == 503 and "loading" in e.value.body["message"]
    finally:
        gate.set()
        dt.stop()


def test_stop_answers_open_requests(tiny_llama_dir):
    """Past the drain's grace, open requests are aborted and still answered: 503 with an OpenAI
    error body, or an error event (then [DONE]) in a stream."""
    settings = DaemonSettings(
        port=0, http_port=_free_port(), processes="single", warmup=False, grace_period_s=0.2
    )
    dt = DaemonThread(settings, ServerArgs(model_path=tiny_llama_dir, max_total_tokens=8192))
    dt.start()
    url = f"http://127.0.0.1:{dt.daemon.http_port}/v1/chat/completions"
    got: dict[str, Any] = {}

    def whole() -> None:
        got["whole"] = httpx2.post(url, json=LONG, timeout=60)

    def streamed() -> None:
        with httpx2.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
            got["stream"] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    try:
        for t in threads:
            t.start()
        _wait(lambda: len(dt.daemon.state.active) == 2, "both requests to start")
    finally:
        dt.stop()
    for t in threads:
        t.join(60)
    assert got["whole"].status_code == 503
    assert got["whole"].json()["error"]["code"] == "draining"
    *_, error, done = got["stream"]
    assert '"code":"draining"' in error and done == "data: [DONE]"
