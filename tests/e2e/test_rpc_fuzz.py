"""A hypothesis fuzzer of every RPC's request message (GenerationService and CacheAdminService)
against one real `hicache serve` subprocess (tiny model, L1 + L2 + file L3, KV invariants checked
after every scheduler step). Messages are drawn from the proto descriptors: every field set or
not, any value of its type (extreme and negative ints, NaN / inf, empty / huge / odd unicode
strings, unknown enum values, random token ids), with realistic values mixed in so that calls
also get past validation. Besides typed messages, raw bytes go through a generic channel:
garbage, and valid messages with a string field that is not UTF-8.

Every call must end with OK or a documented status code (docs/daemon.md "Status codes"; the
streams this test cancels or gives a short deadline aside): never UNKNOWN or INTERNAL. Afterwards
the daemon is SERVING, its KV accounting is exact, and a greedy request gives the tokens it gave
before the fuzzing. Reproducible: derandomized, no example database."""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.client import HicacheClient
from engine.server.pb import admin_pb2, common_pb2, gen_pb2
from tools.soak import DOCUMENTED, DaemonProcess, L3Dir, SoakConfig, kv_accounting, wait_idle

FD = pb_descriptor.FieldDescriptor
VOCAB = 384  # tests/tiny_models.py
CONTEXT = 160  # keeps a huge max_new_tokens short
DEADLINE_S = 30.0  # a call still running then is a hang
STREAM_READ = 40  # responses read from a stream before this test cancels it
CHECK_PROMPT = list(range(20, 70))
METHODS = {
    m.name: m
    for mod, svc in ((gen_pb2, "GenerationService"), (admin_pb2, "CacheAdminService"))
    for m in mod.DESCRIPTOR.services_by_name[svc].methods
}
EXAMPLES = {"Generate": 60, "Prefetch": 30, "Evict": 30, "Flush": 25, "AttachStorage": 30}
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    """One daemon for the module; its cwd is a temp dir (AttachStorage's relative paths land
    there). Yields (address, L3 dir, work dir, the greedy tokens before any fuzzing)."""
    work = tmp_path_factory.mktemp("fuzz")
    l3 = L3Dir(work, mount=False)
    cfg = SoakConfig(
        model=tiny_llama_dir,
        max_total_tokens=512,
        page_size=16,
        l3_cap_mb=64,
        max_queued_requests=8,
        grace_period_s=5,
        extra_args=("--context-length", str(CONTEXT)),
    )
    d = DaemonProcess(cfg, work, l3.path)
    d.start()
    try:
        d.wait_serving()
        with HicacheClient(d.addr, timeout=DEADLINE_S) as c:
            before = _greedy(c)
        yield {"addr": d.addr, "l3": l3, "work": work, "greedy": before, "proc": d}
    finally:
        d.stop()


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(daemon["addr"]) as ch:
        yield ch


def _greedy(c: HicacheClient) -> list[int]:
    return c.generate_text(
        CHECK_PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True, timeout=DEADLINE_S
    )[1]


# ---- strategies from the descriptors ----------------------------------------------------------
I32, I64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1)
U32, U64 = (0, 2**32 - 1), (0, 2**64 - 1)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, max(lo, -1), hi // 2, min(hi, 2**31)})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -5), 300))


HUGE = st.builds(
    lambda c, n: c * n,
    st.sampled_from(["a", "\u20ac", "\U0001d11e", "\0", " "]),
    st.integers(1_000, 300_000),
)
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=400),
    st.sampled_from(["", "a", "\0", "\u202e\u0301", "\ufeff", "%s%n{}", "../../x", " " * 64]),
    HUGE,
)
SHORT = st.text(max_size=40)
WORDS = st.text("abcdefghijklmnopqrstuvwxyz .,!?", min_size=1, max_size=80)
# wild: any value of the field's type
WILD: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_INT32: _ints(*I32),
    FD.TYPE_SINT32: _ints(*I32),
    FD.TYPE_SFIXED32: _ints(*I32),
    FD.TYPE_INT64: _ints(*I64),
    FD.TYPE_SINT64: _ints(*I64),
    FD.TYPE_SFIXED64: _ints(*I64),
    FD.TYPE_UINT32: _ints(*U32),
    FD.TYPE_FIXED32: _ints(*U32),
    FD.TYPE_UINT64: _ints(*U64),
    FD.TYPE_FIXED64: _ints(*U64),
    FD.TYPE_FLOAT: st.floats(width=32),
    FD.TYPE_DOUBLE: st.floats(),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: TEXT,
    FD.TYPE_BYTES: st.binary(max_size=64),
}
# valid-looking: what a well-behaved client sends (fields without an entry in valid_fields)
TAME: dict[int, st.SearchStrategy[Any]] = {
    **{
        t: st.integers(0, 300)
        for t in (FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64)
    },
    FD.TYPE_FLOAT: st.floats(0, 4, width=32),
    FD.TYPE_DOUBLE: st.floats(0, 4),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_STRING: SHORT,
}
# set in every valid-mode message: without them a call is refused before doing anything
REQUIRED = frozenset(
    {
        "hicache.v1.GenerateRequest.prompt",
        "hicache.v1.MatchPrefixRequest.prompt",
        "hicache.v1.TokenIds.ids",
        "hicache.v1.ChatMessages.messages",
        "hicache.v1.PrefetchRequest.prompt",
        "hicache.v1.PinRequest.prompt",
        "hicache.v1.Prompt.input",
        "hicache.v1.EvictRequest.target",
        "hicache.v1.UnpinRequest.target",
    }
)
PROMPTS = [CHECK_PROMPT, list(range(100, 180)), CHECK_PROMPT[:30] + [7] * 20]


def _seconds(hi: float) -> st.SearchStrategy[float]:
    return st.one_of(st.floats(0, hi), st.sampled_from([0.0, hi]))


def valid_fields(work: Path) -> dict[str, st.SearchStrategy[Any]]:
    """Values that pass validation (full field name, or a bare name for every message)."""
    rid = st.one_of(st.just(""), st.from_regex(r"\A[A-Za-z0-9_.:\-]{1,128}\Z"))
    return {
        "hicache.v1.TokenIds.ids": st.one_of(
            st.sampled_from(PROMPTS), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=120)
        ),
        "hicache.v1.Prompt.text": WORDS,
        "hicache.v1.ChatMessages.messages": st.lists(
            st.builds(
                lambda r, c: common_pb2.ChatMessage(role=r, content=c),
                st.sampled_from(["system", "user", "assistant", "tool"]),
                st.text("abcdefgh ", max_size=20),
            ),
            min_size=1,
            max_size=3,
        ),
        "hicache.v1.SamplingParams.max_new_tokens": st.integers(1, 8),
        "hicache.v1.SamplingParams.top_p": st.floats(0.0625, 1.0, width=32),
        "hicache.v1.SamplingParams.top_k": st.one_of(st.just(-1), st.integers(1, 50)),
        "hicache.v1.SamplingParams.min_p": st.floats(0, 1, width=32),
        "hicache.v1.SamplingParams.seed": st.integers(0, 2**63 - 1),
        "hicache.v1.SamplingParams.stop": st.lists(WORDS, max_size=3),
        "hicache.v1.SamplingParams.stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
        "request_id": rid,
        "cache_namespace": st.one_of(
            st.sampled_from(["", "", "fuzz"]), st.from_regex(r"\A[A-Za-z0-9_.\-]{1,64}\Z")
        ),
        "ttl_s": _seconds(10),
        "pin_ttl_s": _seconds(10),
        "timeout_s": _seconds(2),
        "hicache.v1.EvictRequest.num_tokens": st.integers(1, 600),
        "hicache.v1.EvictRequest.all": st.just(True),
        "hicache.v1.UnpinRequest.all": st.just(True),
        "hicache.v1.UnpinRequest.pin_id": st.sampled_from(["pin-1", "pin-2", "pin-3", "pin-9"]),
        "hicache.v1.InspectTreeRequest.page_size": st.integers(0, 1000),
        "hicache.v1.InspectTreeRequest.preview_tokens": st.integers(0, 256),
        "hicache.v1.InspectTreeRequest.page_token": st.one_of(
            st.just(""), st.integers(0, 50).map(str)
        ),
        **_storage_fields(work),
    }


def wild_fields(work: Path) -> dict[str, st.SearchStrategy[Any]]:
    """Fields whose wild values need a shape (or must stay harmless)."""
    return {
        "hicache.v1.TokenIds.ids": st.one_of(
            st.lists(st.integers(0, VOCAB - 1), max_size=400), st.lists(_ints(*U32), max_size=20)
        ),
        # one character over the limit (built lazily: a 4 MB repr in every failure report)
        "hicache.v1.Prompt.text": st.one_of(TEXT, st.just(4_000_001).map(lambda n: "a" * n)),
        "hicache.v1.SamplingParams.stop": st.lists(SHORT, max_size=40),
        **_storage_fields(work),
    }


def _storage_fields(work: Path) -> dict[str, st.SearchStrategy[Any]]:
    """NOTE: attach acts on what it is given: no other hosts, no ~ and no absolute path outside
    the temp dir (relative paths land in the daemon's cwd, that temp dir)."""
    dirs = [str(work / "attach-a"), str(work / "attach" / "b"), str(work / "kv")]
    rel = st.text("abcXYZ019_-.", min_size=1, max_size=300).filter(lambda s: s not in ("..",))
    urls = [
        "redis://127.0.0.1:1/0",
        "rediss://127.0.0.1:1/0",
        "unix:///nonexistent/redis.sock",
        "redis-cluster://127.0.0.1:1,127.0.0.1:2",
        "redis://:pw@127.0.0.1:1/99999",
        "redis://127.0.0.1:99999/0",
        "http://127.0.0.1:1",
        "redis://",
    ]
    return {
        "hicache.v1.AttachStorageRequest.backend": st.one_of(
            st.sampled_from(["file", "file", "redis", "", "FILE", "none"]), SHORT
        ),
        "hicache.v1.AttachStorageRequest.directory": st.one_of(
            st.just(""),
            st.sampled_from(dirs),
            rel,
            st.sampled_from(["bad\0name", "x" * 300, "a/" * 200 + "b"]),
        ),
        "hicache.v1.AttachStorageRequest.url": st.one_of(
            st.just(""), st.sampled_from(urls), SHORT.filter(lambda s: ":" not in s)
        ),
    }


def message_strategy(
    desc: Any, valid: dict[str, Any], wild: dict[str, Any], wild_share: float
) -> st.SearchStrategy:
    """Messages of type ``desc``: every field valid (wild_share 0), any value of its type (1),
    or each field wild with about that probability. Fields are set or not (a oneof: one member
    or none), except REQUIRED ones unless every field is wild."""
    cls = message_factory.GetMessageClass(desc)
    real_oneofs = [o for o in desc.oneofs if not _synthetic(o)]
    in_oneof = {f.name for o in real_oneofs for f in o.fields}

    def one(f: Any, table: dict[str, Any], types: dict[int, Any], share: float) -> Any:
        got = table.get(f.full_name, table.get(f.name))
        if got is not None:
            return got
        if f.type == FD.TYPE_MESSAGE:
            item = message_strategy(f.message_type, valid, wild, share)
        elif f.type == FD.TYPE_ENUM:
            declared = st.sampled_from([v.number for v in f.enum_type.values])
            item = declared if share == 0 else st.one_of(declared, st.integers(-3, 50))
        else:
            item = types[f.type]
        return st.lists(item, max_size=6) if _repeated(f) else item

    def value(f: Any) -> st.SearchStrategy[Any]:
        tame, any_ = one(f, valid, TAME, 0.0), one(f, wild, WILD, 1.0)
        if wild_share <= 0:
            return tame
        if wild_share >= 1:
            return any_
        n = max(1, round(1 / wild_share) - 1)
        return st.one_of(*[tame] * n, any_)

    keep = wild_share < 1  # REQUIRED fields set unless every field is wild
    fields = [f for f in desc.fields if f.name not in in_oneof]
    required = {f.name: value(f) for f in fields if keep and f.full_name in REQUIRED}
    optional = {f.name: value(f) for f in fields if f.name not in required}
    choices = []
    for o in real_oneofs:
        members = [st.tuples(st.just(f.name), value(f)) for f in o.fields]
        must = keep and o.full_name in REQUIRED
        choices.append(st.one_of(*members) if must else st.one_of(st.none(), *members))

    def build(fields: dict[str, Any], picked: tuple[Any, ...]) -> Any:
        msg = cls()
        for name, v in [*fields.items(), *(p for p in picked if p is not None)]:
            f = desc.fields_by_name[name]
            if _repeated(f):
                target = getattr(msg, name)
                for item in v:
                    target.add().CopyFrom(item) if f.type == FD.TYPE_MESSAGE else target.append(
                        item
                    )
            elif f.type == FD.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return st.builds(build, st.fixed_dictionaries(required, optional=optional), st.tuples(*choices))


def request_strategy(desc: Any, work: Path) -> st.SearchStrategy[bytes]:
    """All valid, mostly valid (about one field in six wild), or all wild; serialized."""
    valid, wild = valid_fields(work), wild_fields(work)
    return st.one_of(
        *[message_strategy(desc, valid, wild, share) for share in (0.0, 1 / 6, 1.0)]
    ).map(lambda m: m.SerializeToString())


def _synthetic(oneof: Any) -> bool:
    """proto3 `optional` wraps its field in a oneof of its own."""
    return len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name


def _repeated(f: Any) -> bool:
    return bool(f.is_repeated)


# ---- raw bytes --------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string_paths(desc: Any, depth: int = 0) -> list[tuple[Any, ...]]:
    """Paths (field descriptors, outermost first) to every string field of ``desc``."""
    out: list[tuple[Any, ...]] = []
    for f in desc.fields:
        if f.type == FD.TYPE_STRING:
            out.append((f,))
        elif f.type == FD.TYPE_MESSAGE and depth < 4:
            out += [(f, *p) for p in _string_paths(f.message_type, depth + 1)]
    return out


def _encode_path(path: tuple[Any, ...], payload: bytes) -> bytes:
    for f in reversed(path):
        payload = _varint(f.number << 3 | 2) + _varint(len(payload)) + payload
    return payload


BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"ok\x80", b"\xc0\xaf"]


def raw_payloads(desc: Any) -> st.SearchStrategy[bytes]:
    """Garbage, truncated varints, and messages with one string field that is not UTF-8."""
    paths = _string_paths(desc)
    garbage = st.one_of(
        st.binary(max_size=600),
        st.sampled_from(
            [b"\x08", b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 16, b"\x12\x05ab", b"\x00"]
        ),
    )
    if not paths:
        return garbage
    bad = st.builds(_encode_path, st.sampled_from(paths), st.sampled_from(BAD_UTF8))
    return st.one_of(garbage, bad)


# ---- calling ----------------------------------------------------------------------------------
def call_raw(ch: grpc.Channel, name: str, payload: bytes) -> tuple[str, str, list[bytes]]:
    """One call with serialized bytes; (status name, details, raw responses)."""
    m = METHODS[name]
    path = f"/{m.containing_service.full_name}/{name}"
    streaming = m.server_streaming
    timeout = 0.5 if name == "WatchCacheEvents" else DEADLINE_S
    out: list[bytes] = []
    try:
        if not streaming:
            out.append(ch.unary_unary(path)(payload, timeout=timeout))
            return "OK", "", out
        call = ch.unary_stream(path)(payload, timeout=timeout)
        for r in call:
            out.append(r)
            if len(out) >= STREAM_READ:
                call.cancel()
                return "CANCELLED_BY_TEST", "", out
        return "OK", "", out
    except grpc.RpcError as e:
        return e.code().name, e.details() or "", out


# docs/daemon.md "Status codes": who may answer what (this daemon is up, without auth)
_COMMON = frozenset({"OK", "INVALID_ARGUMENT"})
ALLOWED = {name: _COMMON for name in METHODS} | {
    "Generate": _COMMON | {"RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "CANCELLED_BY_TEST"},
    "Prefetch": _COMMON | {"RESOURCE_EXHAUSTED", "CANCELLED_BY_TEST"},
    "Evict": _COMMON | {"FAILED_PRECONDITION"},  # L3: not evictable, use Flush
    "Pin": _COMMON | {"FAILED_PRECONDITION"},
    "Unpin": _COMMON | {"NOT_FOUND"},
    "Flush": _COMMON | {"FAILED_PRECONDITION"},
    "AttachStorage": _COMMON | {"FAILED_PRECONDITION"},
    "DetachStorage": _COMMON | {"FAILED_PRECONDITION"},
    # an endless stream: this test cancels it, or its 0.5 s deadline passes
    "WatchCacheEvents": _COMMON | {"UNIMPLEMENTED", "CANCELLED_BY_TEST", "DEADLINE_EXCEEDED"},
}
assert all(
    codes - {"CANCELLED_BY_TEST", "DEADLINE_EXCEEDED"} <= DOCUMENTED for codes in ALLOWED.values()
)
SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def check(ch: grpc.Channel, name: str, payload: bytes, kind: str = "message") -> None:
    code, details, out = call_raw(ch, name, payload)
    SEEN[f"{kind} {name}"][code] += 1
    assert code in ALLOWED[name], f"{name}: {code} {details[:300]!r}"
    m = METHODS[name]
    if code == "OK" and name in ("Generate", "Prefetch"):
        cls = message_factory.GetMessageClass(m.output_type)
        last = cls.FromString(out[-1]) if out else None
        done = (
            (last is not None and last.HasField("complete"))
            if name == "Generate"
            else (last is not None and last.stage == admin_pb2.PREFETCH_STAGE_DONE)
        )
        assert done, f"{name}: OK without its final message ({len(out)} responses)"


def fuzz(draw: st.SearchStrategy[bytes], examples: int, body: Callable[[bytes], None]) -> None:
    @settings(FUZZ, max_examples=examples)
    @given(draw)
    def run(payload: bytes) -> None:
        body(payload)

    run()


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(METHODS))
def test_fuzz_messages(daemon, channel, name):
    fuzz(
        request_strategy(METHODS[name].input_type, daemon["work"]),
        EXAMPLES.get(name, 20),
        lambda payload: check(channel, name, payload),
    )


@pytest.mark.parametrize("name", list(METHODS))
def test_fuzz_raw_bytes(daemon, channel, name):
    fuzz(
        raw_payloads(METHODS[name].input_type),
        12,
        lambda payload: check(channel, name, payload, "raw"),
    )


LONG = "x" * 20_000


@pytest.mark.parametrize(
    "name,payload,code",
    [
        ("Unpin", admin_pb2.UnpinRequest(pin_id=LONG), "NOT_FOUND"),
        (
            "Generate",
            gen_pb2.GenerateRequest(
                prompt=common_pb2.Prompt(
                    chat=common_pb2.ChatMessages(
                        messages=[common_pb2.ChatMessage(role=LONG, content="hi")]
                    )
                )
            ),
            "INVALID_ARGUMENT",
        ),
        ("AttachStorage", admin_pb2.AttachStorageRequest(backend=LONG), "INVALID_ARGUMENT"),
        (
            "AttachStorage",
            admin_pb2.AttachStorageRequest(backend="file", directory=LONG),
            "INVALID_ARGUMENT",
        ),
    ],
)
def test_long_values_in_error_messages(channel, name, payload, code):
    got, details, _ = call_raw(channel, name, payload.SerializeToString())
    assert got == code, f"{got}: {details[:200]}"


def test_fuzzing_got_past_validation():
    """The drawn messages reach the engine, not only the validators (when the fuzz ran)."""
    ran = {k.split(" ", 1)[1] for k in SEEN if k.startswith("message ")}
    if not ran:
        pytest.skip("the fuzz tests did not run")
    for name in {
        "Generate",
        "MatchPrefix",
        "Prefetch",
        "Evict",
        "Flush",
        "InspectTree",
        "DetachStorage",
        "Abort",
    } & ran:
        assert SEEN[f"message {name}"]["OK"] > 0, (name, dict(SEEN[f"message {name}"]))
        assert SEEN[f"message {name}"]["INVALID_ARGUMENT"] > 0, name


def test_daemon_unharmed_after_fuzzing(daemon):
    """Last in the module: SERVING, exact KV accounting (with the original L3 attached again),
    and the greedy tokens of before."""
    assert daemon["proc"].proc.poll() is None, daemon["proc"].log_tail()
    with HicacheClient(daemon["addr"], timeout=DEADLINE_S) as c:
        assert c.health() == "SERVING"
        c.unpin(None)
        c.detach_storage(timeout_s=10)
        c.attach_storage("file", directory=str(daemon["l3"].path))
        wait_idle(c)
        leaks, problems = kv_accounting(c, daemon["l3"])
        assert not problems and leaks == {"l1": 0, "l2": 0, "l3": 0}, problems
        assert _greedy(c) == daemon["greedy"]
    tracebacks = [p for p in daemon["proc"].log_problems() if "Traceback" in p]
    assert not tracebacks, tracebacks
