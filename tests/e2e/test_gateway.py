"""hicache behind the real SMG gateway (PyPI `smg`): two `hicache serve` daemons (one pair for
the module) and `smg launch` in front of them, as HTTP workers and as gRPC workers (SMG's
SglangScheduler protocol on the daemon's gRPC port); chat and completions, whole and streamed,
with the daemon's served name and a gateway alias, equal the daemons' own answers. With the
daemons' KV events, a conversation's next turn lands on the daemon holding its prefix, also
after the gateway restarts; a daemon killed under a stream is dropped, the stream fails. The
SglangScheduler RPCs' own checks (and a fuzz of Generate) need no gateway: only the tests
marked needs_smg are skipped without it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.server.gen.smg import common_pb2 as smg_common
from engine.server.gen.smg import sglang_scheduler_pb2 as sg
from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sg_grpc
from hicache.observe.blocks import block_hash
from tools.benchlib.daemon import Daemon
from tools.benchlib.peers import Gateway, smg_binary

needs_smg = pytest.mark.skipif(
    smg_binary() is None,
    reason="the SMG gateway is not installed (PyPI `smg`, in the `test` extra: "
    "pip install -e '.[test]')",
)

MODEL = "tiny"  # --served-model-name of both daemons
NO_EOS = {"ignore_eos": True}
MSGS = [{"role": "user", "content": "Hello world! How are you today?"}]
PROMPT = "A hierarchical KV cache keeps prefixes in device memory"


@pytest.fixture(scope="module")
def daemons(tiny_llama_dir, tmp_path_factory) -> Iterator[list[Daemon]]:
    args = ["--max-total-tokens", "4096", "--grace-period-s", "5", "--served-model-name", MODEL]
    procs = [
        Daemon(tmp_path_factory.mktemp(f"daemon{i}"), args, model=tiny_llama_dir).start()
        for i in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Daemon.wait_http, procs))
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def http_gateway(daemons, tmp_path_factory) -> Iterator[Gateway]:
    log = tmp_path_factory.mktemp("smg_http") / "smg.log"
    gw = Gateway(
        [d.url for d in daemons],
        log,
        "--policy",
        "cache_aware",
        "--model-alias",
        f"default={MODEL}",
    ).start()
    try:
        gw.wait_routes(MODEL, len(daemons))
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def grpc_gateway(daemons, tmp_path_factory) -> Iterator[Gateway]:
    log = tmp_path_factory.mktemp("smg_grpc") / "smg.log"
    workers = [f"grpc://127.0.0.1:{d.port}" for d in daemons]
    gw = Gateway(
        workers, log, "--policy", "cache_aware", "--model-alias", f"default={MODEL}"
    ).start()
    try:
        gw.wait_routes(MODEL, len(daemons))
        yield gw
    finally:
        gw.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _requests_total(daemon: Daemon) -> float:
    text = httpx2.get(f"{daemon.url}/metrics", timeout=30).text
    return sum(
        float(v) for v in re.findall(r"^hicache_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    )


def _answers(client: openai.OpenAI, model: str, trim: bool = False) -> dict[str, Any]:
    """Greedy chat and completion, whole and streamed: their texts and finish reasons. `trim`:
    without a trailing U+FFFD (random weights end on half a UTF-8 character now and then: the
    daemon's detokenizer shows it as U+FFFD, SMG's holds it back)."""
    kw: dict[str, Any] = {"model": model, "max_tokens": 6, "temperature": 0.0, "extra_body": NO_EOS}
    chat = client.chat.completions.create(messages=MSGS, **kw)
    chat_stream = client.chat.completions.create(messages=MSGS, stream=True, **kw)
    comp = client.completions.create(prompt=PROMPT, **kw)
    comp_stream = client.completions.create(prompt=PROMPT, stream=True, **kw)
    chat_parts = [c.choices[0] for c in chat_stream if c.choices]
    comp_parts = [c.choices[0] for c in comp_stream if c.choices]

    def text(t: str | None) -> str:
        return (t or "").rstrip("\ufffd") if trim else (t or "")

    return {
        "chat": (text(chat.choices[0].message.content), chat.choices[0].finish_reason),
        "chat_stream": (
            text("".join(p.delta.content or "" for p in chat_parts)),
            chat_parts[-1].finish_reason,
        ),
        "completion": (text(comp.choices[0].text), comp.choices[0].finish_reason),
        "completion_stream": (
            text("".join(p.text for p in comp_parts)),
            comp_parts[-1].finish_reason,
        ),
        "usage": (
            chat.usage.prompt_tokens,
            chat.usage.completion_tokens,
            comp.usage.prompt_tokens,
            comp.usage.completion_tokens,
        ),
    }


def test_daemon_lists_its_served_name(daemons):
    ids = [m["id"] for m in httpx2.get(f"{daemons[0].url}/v1/models", timeout=30).json()["data"]]
    assert ids[0] == MODEL and "default" in ids and "m" in ids


@needs_smg
def test_http_workers_serve_chat_and_completions(daemons, http_gateway):
    with _client(daemons[0].url) as direct:
        want = _answers(direct, MODEL)
    assert want["chat"][0] and want["completion"][0]
    assert want["chat"] == want["chat_stream"] and want["completion"] == want["completion_stream"]
    before = sum(_requests_total(d) for d in daemons)
    with _client(http_gateway.url) as gw:
        assert [m.id for m in gw.models.list().data] == [MODEL]
        assert _answers(gw, MODEL) == want
        assert _answers(gw, "default") == want  # the gateway's alias for the served name
        with pytest.raises(openai.NotFoundError):
            gw.chat.completions.create(model="gpt-4", messages=MSGS, max_tokens=2)
    # every request through the gateway reached one of the two daemons
    assert sum(_requests_total(d) for d in daemons) == before + 8


@needs_smg
def test_grpc_workers_serve_chat_and_completions(daemons, grpc_gateway):
    """The gateway tokenizes (with the tokenizer from GetTokenizer and its chat template) and
    sends token ids; the answers equal the daemon's own HTTP answers."""
    with _client(daemons[0].url) as direct:
        want = _answers(direct, MODEL, trim=True)
    assert want["usage"][1] == want["usage"][3] == 6
    before = sum(_requests_total(d) for d in daemons)
    with _client(grpc_gateway.url) as gw:
        assert [m.id for m in gw.models.list().data] == [MODEL]
        assert _answers(gw, MODEL, trim=True) == want
        assert _answers(gw, "default", trim=True) == want
    assert sum(_requests_total(d) for d in daemons) == before + 8


def test_sglang_worker_rpcs(daemons):
    """SMG's worker protocol spoken directly: what the gateway reads, and bad input refused
    with INVALID_ARGUMENT naming the field."""
    with grpc.insecure_channel(f"127.0.0.1:{daemons[0].port}") as ch:
        stub = sg_grpc.SglangSchedulerStub(ch)
        assert stub.HealthCheck(sg.HealthCheckRequest(), timeout=30).healthy
        info = stub.GetModelInfo(sg.GetModelInfoRequest(), timeout=30)
        assert info.served_model_name == MODEL and info.vocab_size > 0
        assert stub.GetServerInfo(sg.GetServerInfoRequest(), timeout=30).server_type == "grpc"
        loads = stub.GetLoads(sg.GetLoadsRequest(include=["all"]), timeout=30)
        assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens == 4096
        chunks = list(stub.GetTokenizer(smg_common.GetTokenizerRequest(), timeout=60))
        assert chunks[-1].sha256 and all(not c.sha256 for c in chunks[:-1])
        ids = [5, 6, 7, 8]
        params = sg.SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        streamed = list(
            stub.Generate(
                sg.GenerateRequest(
                    request_id="direct-1",
                    tokenized=sg.TokenizedInput(input_ids=ids),
                    sampling_params=params,
                    stream=True,
                ),
                timeout=60,
            )
        )
        whole = list(
            stub.Generate(
                sg.GenerateRequest(
                    request_id="direct-2",
                    tokenized=sg.TokenizedInput(input_ids=ids),
                    sampling_params=params,
                ),
                timeout=60,
            )
        )
        deltas = [t for r in streamed[:-1] for t in r.chunk.token_ids]
        assert len(whole) == 1 and whole[0].complete.finish_reason == "length"
        assert (
            list(whole[0].complete.output_ids) == deltas == list(streamed[-1].complete.output_ids)
        )
        assert len(deltas) == 4 and whole[0].complete.prompt_tokens == 4
        for bad, field in (
            (sg.GenerateRequest(tokenized=sg.TokenizedInput(input_ids=[10**6])), "input_ids"),
            (sg.GenerateRequest(tokenized=sg.TokenizedInput(input_ids=[])), "input_ids"),
            (
                sg.GenerateRequest(tokenized=sg.TokenizedInput(input_ids=ids), return_logprob=True),
                "return_logprob",
            ),
            (
                sg.GenerateRequest(
                    tokenized=sg.TokenizedInput(input_ids=ids),
                    sampling_params=sg.SamplingParams(n=2),
                ),
                "n",
            ),
            (
                sg.GenerateRequest(
                    tokenized=sg.TokenizedInput(input_ids=ids),
                    sampling_params=sg.SamplingParams(regex="a+"),
                ),
                "regex",
            ),
        ):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert field in e.value.details()
        assert not stub.Abort(sg.AbortRequest(request_id="nothing-runs"), timeout=30).success
        for call, bad in (
            (stub.GetLoads, sg.GetLoadsRequest(include=["bogus"])),
            (stub.GetLoads, sg.GetLoadsRequest(dp_rank=3)),
            (stub.FlushCache, smg_common.FlushCacheRequest(timeout_s=float("nan"))),
            (stub.Abort, sg.AbortRequest()),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(bad, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        for sp in (
            sg.SamplingParams(temperature=float("nan")),
            sg.SamplingParams(top_p=1.5),
            sg.SamplingParams(top_k=-7),
            sg.SamplingParams(stop=[""]),
            sg.SamplingParams(stop_token_ids=[10**6]),
        ):
            with pytest.raises(grpc.RpcError) as e:
                list(
                    stub.Generate(
                        sg.GenerateRequest(
                            tokenized=sg.TokenizedInput(input_ids=ids), sampling_params=sp
                        ),
                        timeout=30,
                    )
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    sg.GenerateRequest(
                        request_id="bad id!", tokenized=sg.TokenizedInput(input_ids=ids)
                    ),
                    timeout=30,
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the daemon still serves after all that
        assert stub.HealthCheck(sg.HealthCheckRequest(), timeout=30).healthy


TOPICS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "Radix trees share common prefixes between requests; eviction frees the least recently used.",
    "Prefill computes the prompt; decode produces one token at a time.",
]
BLOCK = 16  # the daemons' default --kv-events-block-size
OBJECT = 16  # their default L3 object on a CPU (hicache_storage_page_size at page size 1)


def _conversation(i: int) -> list[dict[str, str]]:
    """A long system prompt, different from its first block on (the number leads)."""
    system = f"Conversation {i}. " + " ".join(TOPICS[(i + k) % 4] for k in range(6))
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Tell me about number {i}."},
    ]


def _tier_blocks(
    daemon: Daemon, tier: int = smg_common.KV_CACHE_TIER_DEVICE
) -> tuple[int, set[int]]:
    """(sequence number, the block hashes in ``tier``) of a snapshot of the daemon's KV
    events."""
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        stream = sg_grpc.SglangSchedulerStub(ch).SubscribeKvEvents(
            smg_common.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30
        )
        first = next(iter(stream))
        stream.cancel()
    assert first.HasField("snapshot") and first.events[0].HasField("cleared")
    blocks = {
        b.block_hash
        for e in first.events
        if e.HasField("stored") and e.stored.tier == tier
        for b in e.stored.blocks
    }
    return first.sequence_number, blocks


def _device_blocks(daemon: Daemon) -> tuple[int, set[int]]:
    """(sequence number, L1 block hashes) of a snapshot of the daemon's KV events."""
    return _tier_blocks(daemon)


def _chain(ids: list[int]) -> list[int]:
    """The hashes of the full blocks of ``ids`` (shared namespace), from the root."""
    hashes, parent = [], None
    for k in range(len(ids) // BLOCK):
        parent = block_hash(parent, None, tuple(ids[k * BLOCK : (k + 1) * BLOCK]))
        hashes.append(parent)
    return hashes


def _seed_ids(daemon: Daemon, i: int, model_dir: str) -> tuple[str, list[int]]:
    """Conversation i straight to the daemon (no gateway): its reply and its prompt's token
    ids (the chat template applied here)."""
    from transformers import AutoTokenizer

    msgs = _conversation(i)
    with _client(daemon.url) as c:
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0.0)
    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(ids) == r.usage.prompt_tokens and len(ids) >= 4 * BLOCK
    return r.choices[0].message.content or "", ids


def _seed(daemon: Daemon, i: int, model_dir: str) -> tuple[str, set[int]]:
    """Conversation i straight to the daemon (no gateway): its reply, and the hashes of its
    prompt's full blocks, computed here from the token ids."""
    reply, ids = _seed_ids(daemon, i, model_dir)
    return reply, set(_chain(ids))


def _gateway_metric(
    gw: Gateway, name: str, worker: str, label: str, key: str = "disposition"
) -> float:
    text = httpx2.get(gw.metrics_url, timeout=30).text
    pattern = rf'^{name}\{{worker="{re.escape(worker)}",{key}="{label}"\}} (\S+)$'
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _wait(cond: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.2)


def _landed(daemons: list[Daemon], gw: Gateway, msgs: list[dict[str, str]]) -> int:
    """The daemon a chat through the gateway ran on (requests run one at a time here)."""
    before = [_requests_total(d) for d in daemons]
    with _client(gw.url) as c:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0.0)
    grew = [_requests_total(d) - b for d, b in zip(daemons, before, strict=True)]
    assert sorted(grew) == [0.0, 1.0], grew
    return grew.index(1.0)


@needs_smg
def test_next_turn_lands_on_the_daemon_holding_its_prefix(
    daemons, grpc_gateway, tiny_llama_dir, tmp_path_factory
):
    """Conversations seeded on the daemons directly (the gateway never saw them): only the
    daemons' KV events can tell the gateway where each prefix is. The seeded prompts' blocks,
    hashed here from the token ids, are in the daemons' published L1 state, and those inside
    whole L3 objects in their DISK state: SMG takes the stream with its DISK blocks (it indexes
    L1 and L2 only) without a gap or a resync."""
    seeded: dict[int, tuple[int, str]] = {}
    want: list[set[int]] = [set(), set()]
    disk_want: list[set[int]] = [set(), set()]
    for i in range(6):
        home = i % 2
        reply, ids = _seed_ids(daemons[home], i, tiny_llama_dir)
        want[home] |= set(_chain(ids))
        disk_want[home] |= set(_chain(ids[: len(ids) // OBJECT * OBJECT]))
        seeded[i] = (home, reply)
    # every seeded block is published as stored in L1 (and in L3) by the daemon that computed
    # it, and no other daemon claims it
    seqs = [0, 0]
    for d in (0, 1):

        def published(d: int = d) -> bool:
            seq, device = _device_blocks(daemons[d])
            seqs[d], disk = _tier_blocks(daemons[d], smg_common.KV_CACHE_TIER_DISK)
            assert seqs[d] >= seq
            return (
                want[d] <= device
                and not want[1 - d] & device
                and disk_want[d] <= disk
                and not disk_want[1 - d] & disk
            )

        _wait(published, f"daemon {d} to publish its seeded blocks")
    workers = [f"grpc://127.0.0.1:{d.port}" for d in daemons]
    # the gateway subscribed first (its snapshot is batch 1): it has applied up to seqs[d]
    for d in (0, 1):
        _wait(
            lambda d=d: (
                1
                + _gateway_metric(grpc_gateway, "smg_kv_event_batches_total", workers[d], "applied")
                >= seqs[d]
            ),
            f"the gateway to apply daemon {d}'s batches up to {seqs[d]}",
        )

    def next_turn(i: int, n: int) -> list[dict[str, str]]:
        _, reply = seeded[i]
        return [
            *_conversation(i),
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"And then? ({n})"},
        ]

    assert [_landed(daemons, grpc_gateway, next_turn(i, 1)) for i in seeded] == [
        home for home, _ in seeded.values()
    ]
    for w in workers:  # every batch applied in order: no resync but the first snapshot
        assert (
            _gateway_metric(grpc_gateway, "smg_kv_event_resyncs_total", w, "snapshot", key="reason")
            == 1
        )
        for reason in ("data_loss", "gap_cleared", "out_of_range", "publisher_restart"):
            assert (
                _gateway_metric(grpc_gateway, "smg_kv_event_resyncs_total", w, reason, key="reason")
                == 0
            ), (w, reason)
    # a new gateway knows nothing of its own: the daemons' snapshots tell it
    grpc_gateway.stop()
    log = tmp_path_factory.mktemp("smg_grpc_again") / "smg.log"
    again = Gateway(workers, log, "--policy", "cache_aware").start()
    try:
        again.wait_routes(MODEL, len(workers))
        for w in workers:
            _wait(
                lambda w=w: (
                    _gateway_metric(again, "smg_kv_event_batches_total", w, "snapshot") >= 1
                ),
                f"a snapshot from {w}",
            )
        assert [_landed(daemons, again, next_turn(i, 2)) for i in seeded] == [
            home for home, _ in seeded.values()
        ]
    finally:
        again.stop()


FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1.0, -1.0, 0.5]))


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=40)
    | st.lists(st.integers(0, 383), min_size=1, max_size=40),
    temperature=FLOATS,
    top_p=FLOATS,
    top_k=st.integers(-(2**31), 2**31 - 1),
    min_p=FLOATS,
    max_new=st.none() | st.integers(0, 2**32 - 1) | st.integers(1, 4),
    stop=st.lists(st.text(max_size=8), max_size=3),
    stop_ids=st.lists(st.integers(0, 2**32 - 1), max_size=3),
    rid=st.text(max_size=12),
    stream=st.booleans(),
)
def test_sglang_generate_fuzz(
    daemons, ids, temperature, top_p, top_k, min_p, max_new, stop, stop_ids, rid, stream
):
    """Any GenerateRequest of these fields ends OK (with its GenerateComplete) or
    INVALID_ARGUMENT: never another status, never a hang."""
    sp = sg.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=True,
    )
    if max_new is not None:
        sp.max_new_tokens = min(max_new, 4) if max_new else 0
    req = sg.GenerateRequest(
        request_id=rid,
        tokenized=sg.TokenizedInput(input_ids=ids),
        sampling_params=sp,
        stream=stream,
    )
    with grpc.insecure_channel(f"127.0.0.1:{daemons[0].port}") as ch:
        try:
            out = list(sg_grpc.SglangSchedulerStub(ch).Generate(req, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            return
    assert out and out[-1].HasField("complete") and out[-1].complete.finish_reason


@needs_smg
def test_killed_daemon_is_dropped_and_its_streams_fail(
    daemons, http_gateway, tiny_llama_dir, tmp_path_factory
):
    """SIGKILL a daemon under a stream: the stream ends with an error (no hang), and both
    gateways serve the next requests from the daemon left. NOTE: the module's last test (it
    kills one of the module's daemons)."""
    victim, survivor = daemons[1], daemons[0]
    workers = [f"grpc://127.0.0.1:{d.port}" for d in daemons]
    _, hashes = _seed(victim, 7, tiny_llama_dir)
    _wait(lambda: hashes <= _device_blocks(victim)[1], "the victim to publish the seeded blocks")
    gw = Gateway(
        workers,
        tmp_path_factory.mktemp("smg_kill") / "smg.log",
        "--policy",
        "cache_aware",
        "--health-check-interval-secs",
        "1",
    ).start()
    try:
        gw.wait_routes(MODEL, len(workers))
        for w in workers:
            _wait(
                lambda w=w: _gateway_metric(gw, "smg_kv_event_batches_total", w, "snapshot") >= 1,
                f"a snapshot from {w}",
            )
        # conversation 7 was seeded on the victim: the gateway's snapshot routes its next turn there
        msgs = [*_conversation(7), {"role": "user", "content": "Keep going."}]
        before = _requests_total(survivor)
        with _client(gw.url) as c:
            stream = c.chat.completions.create(
                model=MODEL,
                messages=msgs,
                max_tokens=1500,
                temperature=0.0,
                stream=True,
                extra_body=NO_EOS,
            )
            chunks = iter(stream)
            next(chunks)  # running on a daemon now
            victim.proc.kill()
            victim.proc.wait()
            with pytest.raises((openai.APIError, httpx2.HTTPError)):
                for _ in chunks:
                    pass
        assert _requests_total(survivor) == before  # it ran on the victim

        def served(g: Gateway) -> bool:
            with _client(g.url) as c:
                try:
                    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
                except openai.APIError:
                    return False
            return r.choices[0].finish_reason is not None

        for g in (gw, http_gateway):
            _wait(lambda g=g: served(g), f"{g.url} to serve without the killed daemon")
    finally:
        gw.stop()
