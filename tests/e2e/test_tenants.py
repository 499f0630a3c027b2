"""Tenants over a real port (docs/daemon.md "Tenants"): one hierarchical daemon (L1 + L2 + file
L3) shared by acme (two namespaces, an L1 quota), beta (no quota) and gamma (L1 and L2 quotas),
plus the admin token. Each tenant is confined to its namespaces: it cannot read, learn about,
change or flush another's cache, reach its requests or pins, or see its tree nodes and events;
quotas move a tenant's least recently used nodes down a tier once its requests are cached."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.pb import admin_pb2, gen_pb2
from engine.server.settings import DaemonSettings
from engine.server.tenants import Tenant

ADMIN = "A"
TOKENS = {"acme": "tok-a", "beta": "tok-b", "gamma": "tok-g", "delta": "tok-d"}
ACME_L1_QUOTA = 64
GAMMA_L1_QUOTA, GAMMA_L2_QUOTA = 16, 64
DELTA_L3_QUOTA = 64
L3_OBJECT = 64  # tokens per L3 object (hicache_storage_page_size)
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SHORT = {"max_new_tokens": 2, **GREEDY}
L3_PROMPT = L3_OBJECT + 6  # one whole L3 object
LONG = {"max_new_tokens": 200, **GREEDY}  # long enough to still run while another call is made
DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
APP_LOGGER = "engine.server.app"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def daemon_log() -> Iterator[_Lines]:
    logger = logging.getLogger(APP_LOGGER)
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory, daemon_log):
    storage = str(tmp_path_factory.mktemp("l3"))
    tenants = (
        Tenant("acme", (TOKENS["acme"],), ("acme", "acme-rag"), quota_l1_tokens=ACME_L1_QUOTA),
        Tenant("beta", (TOKENS["beta"],)),
        Tenant(
            "gamma",
            (TOKENS["gamma"],),
            quota_l1_tokens=GAMMA_L1_QUOTA,
            quota_l2_tokens=GAMMA_L2_QUOTA,
        ),
        Tenant("delta", (TOKENS["delta"],), quota_l3_tokens=DELTA_L3_QUOTA),
    )
    args = ServerArgs(
        model_path=tiny_llama_dir,
        max_total_tokens=2048,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_storage_backend="file",
        hicache_storage_dir=storage,
        hicache_storage_page_size=L3_OBJECT,
        debug_check_invariants=True,
    )
    dt = DaemonThread(
        DaemonSettings(port=0, admin_token=ADMIN, grace_period_s=2, tenants=tenants), args
    ).start()
    yield dt
    dt.stop()


def _client(daemon, token: str | None) -> HicacheClient:
    return HicacheClient(f"127.0.0.1:{daemon.port}", token=token, timeout=60)


@pytest.fixture(scope="module")
def admin(daemon):
    with _client(daemon, ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def acme(daemon):
    with _client(daemon, TOKENS["acme"]) as c:
        yield c


@pytest.fixture(scope="module")
def beta(daemon):
    with _client(daemon, TOKENS["beta"]) as c:
        yield c


@pytest.fixture(scope="module")
def gamma(daemon):
    with _client(daemon, TOKENS["gamma"]) as c:
        yield c


@pytest.fixture(scope="module")
def delta(daemon):
    with _client(daemon, TOKENS["delta"]) as c:
        yield c


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def clean(admin):
    """The test starts from an empty cache (the admin flushes every tenant's tiers)."""
    admin.flush(timeout_s=30)


# --- helpers -------------------------------------------------------------------------------------
def _prompt(k: int, n: int = 20) -> list[int]:
    """A token-id prompt of n ids; distinct k start with distinct ids (no shared prefix)."""
    return [3 + (k * 53 + i * 31) % 380 for i in range(n)]


def _gen(c: HicacheClient, prompt: Any, **kw: Any) -> gen_pb2.GenerateComplete:
    return c.generate_text(prompt, **{**SHORT, **kw})[2]


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status a call ends with (a stream is read to its end)."""
    try:
        r = call()
        if hasattr(r, "__iter__") and not hasattr(r, "DESCRIPTOR"):
            for _ in r:
                pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _tier(stats: admin_pb2.GetCacheStatsResponse, name: str) -> admin_pb2.TierStats:
    return next(t for t in stats.tiers if t.tier == ["", "l1", "l2", "l3"].index(name))


def _used(c: HicacheClient, name: str) -> int:
    return _tier(c.cache_stats(), name).used_tokens


def _matched(c: HicacheClient, prompt: Any, namespace: str = "") -> int:
    return c.match_prefix(prompt, namespace=namespace).matched_tokens


def _l1(c: HicacheClient, prompt: Any, namespace: str = "") -> int:
    return c.match_prefix(prompt, namespace=namespace).matched_per_tier.l1


def _wait_for(
    pred: Callable[[], bool], what: str | Callable[[], str], timeout: float = 20.0
) -> None:
    """Polls an eventually-true condition (transfers between tiers are asynchronous)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            pytest.fail(what if isinstance(what, str) else what())
        time.sleep(0.05)


def _usage(c: HicacheClient) -> str:
    """Used tokens per tier, for failure messages."""
    stats = c.cache_stats()
    return " ".join(f"{t}={_tier(stats, t).used_tokens}" for t in ("l1", "l2", "l3"))


def _start(c: HicacheClient, prompt: Any, **kw: Any) -> tuple[Any, gen_pb2.GenerateResponse]:
    """A long request that is running once this returns (its first token has arrived)."""
    stream = c.generate(prompt, **{**LONG, **kw})
    return stream, next(stream)


def _finish(stream: Any) -> gen_pb2.GenerateComplete:
    done = [r.complete for r in stream if r.HasField("complete")]
    assert len(done) == 1
    return done[0]


def _l3_idle(admin: HicacheClient) -> None:
    _wait_for(lambda: admin.storage().pending == 0, "L3 work still pending")


def _events(c: HicacheClient, timeout: float = 1.5) -> list[admin_pb2.CacheEvent]:
    """Every retained event this caller may see: WatchCacheEvents(after_seq=0) until the
    deadline ends the replay."""
    out = []
    stream = c.watch_events(after_seq=0, timeout=timeout)
    try:
        for r in stream:
            out.append(r.event)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (e.code(), e.details())
    finally:
        stream.cancel()
    return out


# --- authentication ------------------------------------------------------------------------------
def test_health_needs_no_token(daemon):
    with _client(daemon, None) as anon:
        assert anon.health() == "SERVING"
        assert anon.health("hicache.v1.CacheAdminService") == "SERVING"


READS: list[tuple[str, Callable[[HicacheClient], Any]]] = [
    ("GetCacheStats", lambda c: c.cache_stats()),
    ("GetServerInfo", lambda c: c.server_info()),
    ("GetModelInfo", lambda c: c.model_info()),
    ("GetStorage", lambda c: c.storage()),
    ("Generate", lambda c: c.generate_text(_prompt(0), **SHORT)),
    ("Abort", lambda c: c.abort("some-id")),
    ("MatchPrefix", lambda c: c.match_prefix(_prompt(0))),
    ("InspectTree", lambda c: c.inspect_tree()),
    ("WatchCacheEvents", lambda c: next(iter(c.watch_events(after_seq=0, timeout=5)))),
]
MUTATIONS: list[tuple[str, Callable[[HicacheClient], Any]]] = [
    ("Prefetch", lambda c: c.prefetch(_prompt(0))),
    ("Evict", lambda c: c.evict(all=True)),
    ("Pin", lambda c: c.pin(_prompt(0))),
    ("Unpin", lambda c: c.unpin()),
    ("Flush", lambda c: c.flush(timeout_s=1)),
    ("AttachStorage", lambda c: c.attach_storage("file")),
    ("DetachStorage", lambda c: c.detach_storage(timeout_s=1)),
]


@pytest.mark.parametrize(
    "token",
    [None, "nope", "tok-a-but-longer", "tok-"],
    ids=["no token", "unknown", "tenant token + suffix", "token prefix"],
)
@pytest.mark.parametrize("name,call", READS, ids=[r[0] for r in READS])
def test_no_or_unknown_token_is_unauthenticated(daemon, token, name, call):
    with _client(daemon, token) as c:
        assert _code(lambda: call(c)) == UNAUTH


@pytest.mark.parametrize("token", [None, "nope"], ids=["no token", "unknown"])
@pytest.mark.parametrize("name,call", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_no_or_unknown_token_on_a_mutation_is_unauthenticated(daemon, admin, token, name, call):
    """With tenants configured, none or an unknown token is UNAUTHENTICATED, mutations too."""
    with _client(daemon, token) as c:
        assert _code(lambda: call(c)) == UNAUTH
    assert admin.storage().attached  # nothing was detached


def test_storage_attach_and_detach_are_denied_to_tenants(admin, acme, beta):
    try:
        for c in (acme, beta):
            assert _code(lambda c=c: c.attach_storage("file")) == DENIED
            assert _code(lambda c=c: c.detach_storage(timeout_s=1)) == DENIED
        assert admin.storage().attached
    finally:  # keep the module's daemon usable should a detach have got through
        if not admin.storage().attached:
            admin.attach_storage("file")


def test_tenant_and_admin_tokens_are_accepted(acme, beta, gamma, delta, admin):
    for c in (acme, beta, gamma, delta, admin):
        assert c.cache_stats().tiers[0].enabled
        assert c.server_info().version


def test_server_info_shows_no_tenant_token(acme, admin):
    for c in (acme, admin):
        text = repr(dict(c.server_info().config))
        for tok in TOKENS.values():
            assert tok not in text, (tok, text)


# --- namespaces ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("clean")
def test_empty_namespace_is_the_tenants_first_namespace(acme, beta, admin):
    p, q = _prompt(1), _prompt(2)
    assert _gen(acme, p).usage.cached_tokens == 0
    assert _gen(beta, q).usage.cached_tokens == 0
    assert _matched(admin, p, "acme") > 0
    assert _matched(admin, p) == 0  # not the shared default namespace
    assert _matched(admin, p, "acme-rag") == 0
    assert _matched(acme, p) == _matched(acme, p, "acme") > 0
    assert _matched(admin, q, "beta") > 0 and _matched(admin, q) == 0
    assert _gen(acme, p, namespace="acme").usage.cached_tokens > 0  # the same namespace


@pytest.mark.usefixtures("clean")
def test_own_other_namespace_is_allowed(acme, admin):
    p, q, r = _prompt(3, 10), _prompt(4, 10), _prompt(5, 10)  # all within acme's L1 quota
    assert _gen(acme, p, namespace="acme-rag").usage.cached_tokens == 0
    assert _matched(acme, p, "acme-rag") > 0 and _matched(admin, p, "acme-rag") > 0
    assert _matched(acme, p) == 0  # not in the default namespace
    assert _gen(acme, p, namespace="acme-rag").usage.cached_tokens > 0
    done = list(acme.prefetch(q, namespace="acme-rag", pin=True))[-1]
    assert done.stage == admin_pb2.PREFETCH_STAGE_DONE and done.pin_id
    assert _matched(admin, q, "acme-rag") == len(q)
    _gen(acme, r, namespace="acme-rag")
    pin = acme.pin(r, namespace="acme-rag")
    assert pin.pin_id and pin.pinned_tokens > 0
    assert acme.unpin().unpinned == 2
    ev = acme.evict(prefix=p[:4], namespace="acme-rag")  # p's nodes were split: the whole p
    assert ev.evicted_tokens > 0
    assert _l1(acme, p, "acme-rag") == 0


FOREIGN: list[tuple[str, Callable[[HicacheClient, list[int], str], Any]]] = [
    ("Generate", lambda c, p, ns: c.generate_text(p, namespace=ns, **SHORT)),
    ("MatchPrefix", lambda c, p, ns: c.match_prefix(p, namespace=ns)),
    ("Prefetch", lambda c, p, ns: c.prefetch(p, namespace=ns)),
    ("Prefetch+pin", lambda c, p, ns: c.prefetch(p, namespace=ns, pin=True)),
    ("Pin", lambda c, p, ns: c.pin(p, namespace=ns)),
    ("Evict by prefix", lambda c, p, ns: c.evict(prefix=p, namespace=ns)),
    ("Evict by prefix, dry run", lambda c, p, ns: c.evict(prefix=p, namespace=ns, dry_run=True)),
]


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize(
    "ns", ["beta", "nobodys", "acme"], ids=["other tenant's", "unowned", "acme's from beta"]
)
@pytest.mark.parametrize("name,call", FOREIGN, ids=[f[0] for f in FOREIGN])
def test_foreign_namespace_is_permission_denied(acme, beta, admin, ns, name, call):
    """The namespace holds the prompt (so a leak would succeed) and is left unchanged."""
    p = _prompt(6)
    caller = beta if ns == "acme" else acme
    owner = acme if ns == "acme" else beta
    if ns == "nobodys":
        list(admin.prefetch(p, namespace=ns))
    else:
        _gen(owner, p)
    before = admin.match_prefix(p, namespace=ns)
    assert before.matched_tokens > 0
    assert _code(lambda: call(caller, p, ns)) == DENIED
    after = admin.match_prefix(p, namespace=ns)
    assert after.matched_per_tier == before.matched_per_tier
    assert admin.cache_stats().num_pins == 0


@pytest.mark.usefixtures("clean")
def test_guessed_prompt_reveals_nothing(acme, beta, admin):
    """beta's prompt is cached; acme, guessing it, cannot tell by any oracle."""
    s = _prompt(7, 30)
    assert _gen(beta, s).usage.cached_tokens == 0
    assert _gen(beta, s).usage.cached_tokens > 0  # cached for beta
    m = acme.match_prefix(s)
    assert m.matched_tokens == 0 and (
        m.matched_per_tier.l1,
        m.matched_per_tier.l2,
        m.matched_per_tier.l3,
    ) == (0, 0, 0)
    assert _code(lambda: acme.match_prefix(s, namespace="beta")) == DENIED
    assert _code(lambda: acme.generate_text(s, namespace="beta", **SHORT)) == DENIED
    assert acme.evict(prefix=s, dry_run=True).evicted_tokens == 0
    assert _code(lambda: acme.pin(s)) == grpc.StatusCode.FAILED_PRECONDITION  # nothing cached
    admin.flush(timeout_s=30)
    _gen(beta, s)
    done = _gen(acme, s)
    assert done.usage.cached_tokens == 0
    per_tier = done.usage.cached_tokens_per_tier
    assert (per_tier.l1, per_tier.l2, per_tier.l3) == (0, 0, 0)
    # NOTE: last, because a prefetch cancelled after MATCHED may still compute s for acme
    # (its own namespace) before the cancel reaches the daemon
    stages = acme.prefetch(s, namespace="acme-rag")
    matched = next(stages)  # the MATCHED stage: before any work
    stages.cancel()
    assert matched.stage == admin_pb2.PREFETCH_STAGE_MATCHED
    assert (matched.cached_per_tier.l1, matched.cached_per_tier.l2, matched.cached_per_tier.l3) == (
        0,
        0,
        0,
    )
    assert _gen(acme, s).usage.cached_tokens > 0  # its own cache works
    assert _matched(beta, s) > 0  # and beta's is still there


# --- requests ------------------------------------------------------------------------------------
@pytest.mark.usefixtures("clean")
def test_same_request_id_in_two_tenants_and_abort_reaches_only_its_own(acme, beta):
    b_stream, b_first = _start(beta, _prompt(8), request_id="job-1")
    a_stream, a_first = _start(acme, _prompt(9), request_id="job-1")  # no ALREADY_EXISTS
    assert a_first.request_id == b_first.request_id == "job-1"
    # Within one tenant an id is still unique among its running requests.
    assert _code(lambda: beta.generate_text(_prompt(10), request_id="job-1", **SHORT)) == (
        grpc.StatusCode.ALREADY_EXISTS
    )
    assert acme.abort("job-1").found is True  # acme's own
    assert _finish(a_stream).finish_reason == gen_pb2.FINISH_REASON_ABORT
    done = _finish(b_stream)
    assert done.finish_reason == gen_pb2.FINISH_REASON_LENGTH
    assert done.usage.completion_tokens == LONG["max_new_tokens"]


@pytest.mark.usefixtures("clean")
def test_same_request_id_both_complete(acme, beta):
    out: dict[str, gen_pb2.GenerateComplete] = {}
    barrier = threading.Barrier(2)

    def run(name: str, c: HicacheClient, k: int) -> None:
        barrier.wait()
        out[name] = _gen(c, _prompt(k), request_id="shared-id", max_new_tokens=32)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: run(*a), [("acme", acme, 11), ("beta", beta, 12)]))
    for name in ("acme", "beta"):
        assert out[name].finish_reason == gen_pb2.FINISH_REASON_LENGTH, name
        assert out[name].usage.completion_tokens == 32


@pytest.mark.usefixtures("clean")
def test_abort_of_another_tenants_request_is_not_found(acme, beta):
    stream, _ = _start(beta, _prompt(13), request_id="beta-only")
    assert acme.abort("beta-only").found is False
    done = _finish(stream)
    assert done.finish_reason == gen_pb2.FINISH_REASON_LENGTH
    assert done.usage.completion_tokens == LONG["max_new_tokens"]


# --- pins, evict, flush --------------------------------------------------------------------------
@pytest.mark.usefixtures("clean")
def test_pins_belong_to_their_tenant(acme, beta, admin):
    pb, pa = _prompt(14), _prompt(15)
    pin_b = list(beta.prefetch(pb, pin=True))[-1].pin_id
    assert pin_b
    assert _code(lambda: acme.unpin(pin_b)) == grpc.StatusCode.NOT_FOUND
    assert _tier(acme.cache_stats(), "l1").pinned_tokens == 0
    assert _tier(beta.cache_stats(), "l1").pinned_tokens >= len(pb)
    pin_a = list(acme.prefetch(pa, pin=True))[-1].pin_id
    assert pin_a
    if pin_a != pin_b:  # NOTE: pin ids need not be unique across tenants
        assert _code(lambda: beta.unpin(pin_a)) == grpc.StatusCode.NOT_FOUND
    assert admin.cache_stats().num_pins == 2
    assert acme.unpin().unpinned == 1  # unpin all: only acme's
    assert admin.cache_stats().num_pins == 1
    assert beta.evict(all=True).evicted_tokens == 0  # beta's prefix is still pinned
    assert beta.unpin(pin_b).unpinned == 1
    assert admin.cache_stats().num_pins == 0


@pytest.mark.usefixtures("clean")
def test_evict_by_prefix_touches_only_the_callers_namespace(acme, beta):
    p = _prompt(16)
    _gen(acme, p)
    _gen(beta, p)
    assert _l1(acme, p) > 0 and _l1(beta, p) > 0
    beta_l1 = _l1(beta, p)
    assert acme.evict(prefix=p[:4]).evicted_tokens > 0
    assert _l1(acme, p) == 0
    assert _l1(beta, p) == beta_l1


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("how", [{"all": True}, {"num_tokens": 10**6}], ids=["all", "by count"])
def test_evict_touches_only_own_namespaces(acme, beta, admin, how):
    pa, pa2, pb = _prompt(17), _prompt(18), _prompt(19)
    _gen(acme, pa)
    _gen(acme, pa2, namespace="acme-rag")
    _gen(beta, pb)
    beta_l1 = _l1(beta, pb)
    beta_used = _used(beta, "l1")
    assert beta_l1 > 0
    assert acme.evict("l1", **how).evicted_tokens > 0
    assert _l1(acme, pa) == 0 and _l1(acme, pa2, "acme-rag") == 0
    assert _matched(acme, pa) > 0  # demoted to L2, not dropped
    assert _l1(beta, pb) == beta_l1 and _used(beta, "l1") == beta_used
    beta_l2 = _used(beta, "l2")
    acme.evict("l2", **how)
    assert _used(beta, "l2") >= beta_l2
    assert _l1(beta, pb) == beta_l1
    assert acme.evict("l1", **how).evicted_tokens == 0  # nothing of acme's is left on L1
    assert _l1(beta, pb) == beta_l1


@pytest.mark.usefixtures("clean")
def test_tenant_flush_empties_only_its_namespaces_while_another_runs(acme, beta, admin):
    pa, pa2, pb = _prompt(20), _prompt(21), _prompt(22)
    # L3 stores whole objects (64 tokens on this daemon): these reach L3
    la, lb = _prompt(31, L3_PROMPT), _prompt(32, L3_PROMPT)
    _gen(acme, la, namespace="acme-rag")
    _gen(beta, lb)
    _wait_for(lambda: _used(acme, "l3") > 0 and _used(beta, "l3") > 0, "nothing reached L3")
    _gen(acme, pa)
    _gen(acme, pa2, namespace="acme-rag")
    assert list(acme.prefetch(pa, pin=True))[-1].pin_id
    pin_b = list(beta.prefetch(pb, pin=True))[-1].pin_id
    beta_l1, beta_l3 = _l1(beta, pb), _used(beta, "l3")
    _l3_idle(admin)
    stream, _ = _start(beta, _prompt(23))  # beta keeps running through acme's flush
    res = acme.flush(timeout_s=5)
    assert res.freed_tokens > 0 and res.unpinned == 1
    assert _matched(acme, pa) == 0 and _matched(acme, pa2, "acme-rag") == 0
    assert _matched(acme, la, "acme-rag") == 0  # L3 included
    assert [_used(acme, t) for t in ("l1", "l2", "l3")] == [0, 0, 0]
    assert _l1(beta, pb) == beta_l1
    assert _used(beta, "l3") >= beta_l3 and _matched(beta, lb) >= L3_OBJECT
    assert admin.cache_stats().num_pins == 1  # beta's pin survives
    done = _finish(stream)
    assert done.finish_reason == gen_pb2.FINISH_REASON_LENGTH
    assert done.usage.completion_tokens == LONG["max_new_tokens"]
    assert beta.unpin(pin_b).unpinned == 1


# --- stats, tree, events -------------------------------------------------------------------------
@pytest.mark.usefixtures("clean")
def test_cache_stats_are_the_tenants_own(acme, beta, admin):
    pb, pa = _prompt(24), _prompt(25, 12)
    _gen(beta, pb)
    a, b = acme.cache_stats(), beta.cache_stats()
    assert _tier(a, "l1").used_tokens == 0 and _tier(a, "l2").used_tokens == 0
    assert _tier(b, "l1").used_tokens >= len(pb)
    _gen(acme, pa)
    a, b, whole = acme.cache_stats(), beta.cache_stats(), admin.cache_stats()
    assert len(pa) <= _tier(a, "l1").used_tokens <= len(pa) + SHORT["max_new_tokens"]
    for name in ("l1", "l2"):
        assert _tier(whole, name).used_tokens >= (
            _tier(a, name).used_tokens + _tier(b, name).used_tokens
        ), name
    # capacity_tokens = the tenant's quota, else the tier's capacity
    assert _tier(a, "l1").capacity_tokens == ACME_L1_QUOTA
    assert _tier(a, "l2").capacity_tokens == _tier(whole, "l2").capacity_tokens
    assert _tier(b, "l1").capacity_tokens == _tier(whole, "l1").capacity_tokens
    for name in ("l1", "l2", "l3"):
        assert _tier(a, name).enabled and _tier(b, name).enabled
        assert "acme" in _tier(a, name).info.values(), (name, dict(_tier(a, name).info))
        assert "beta" in _tier(b, name).info.values(), (name, dict(_tier(b, name).info))
        assert "acme" not in _tier(b, name).info.values()
        # cumulative counters are quota evictions only: beta has no quota
        assert _tier(b, name).evicted_tokens == 0, name
    # an admin eviction of beta's prefix is not a quota eviction
    assert admin.evict(prefix=pb, namespace="beta").evicted_tokens > 0
    assert _tier(beta.cache_stats(), "l1").evicted_tokens == 0


@pytest.mark.usefixtures("clean")
def test_inspect_tree_shows_only_own_nodes(acme, beta, admin, tok):
    sa = tok.encode("acme-visible-prompt kiwi 77 acme acme", add_special_tokens=False)
    sb = tok.encode("ZQXJ-beta-secret-0042 wombat beta beta", add_special_tokens=False)
    mark_a, mark_b = tok.decode(sa[:8]), tok.decode(sb[:8])
    assert mark_a not in tok.decode(sb) and mark_b not in tok.decode(sa)
    _gen(beta, sb)
    _gen(acme, sa)

    def previews(c: HicacheClient) -> list[str]:
        return [n.preview for n in c.iter_tree(page_size=50, preview_tokens=256)]

    seen_a, seen_b, seen_all = previews(acme), previews(beta), previews(admin)
    assert any(mark_a in p for p in seen_a) and not any(mark_b in p for p in seen_a), seen_a
    assert any(mark_b in p for p in seen_b) and not any(mark_a in p for p in seen_b), seen_b
    assert any(mark_a in p for p in seen_all) and any(mark_b in p for p in seen_all)
    a_nodes = list(acme.iter_tree())
    assert sum(n.token_length for n in a_nodes) <= len(sa) + SHORT["max_new_tokens"]
    assert acme.inspect_tree().total_nodes < admin.inspect_tree().total_nodes


@pytest.mark.usefixtures("clean")
def test_watch_events_yields_only_own_namespaces(acme, beta, admin):
    _gen(acme, _prompt(26))
    _gen(acme, _prompt(27), namespace="acme-rag")
    _gen(beta, _prompt(28))
    with ThreadPoolExecutor(3) as pool:
        ev_a, ev_b, ev_all = pool.map(_events, (acme, beta, admin))
    ns_a = {e.cache_namespace for e in ev_a}
    ns_b = {e.cache_namespace for e in ev_b}
    assert ns_a and ns_a <= {"acme", "acme-rag"} and {"acme", "acme-rag"} <= ns_a, ns_a
    assert ns_b == {"beta"}, ns_b
    assert {"acme", "acme-rag", "beta"} <= {e.cache_namespace for e in ev_all}
    assert any(e.kind == admin_pb2.CACHE_EVENT_KIND_STORED for e in ev_a)
    assert [e.seq for e in ev_a] == sorted(e.seq for e in ev_a)


@pytest.mark.usefixtures("clean")
def test_admin_sees_and_changes_everything(acme, beta, admin):
    pa, pb = _prompt(29), _prompt(30)
    _gen(acme, pa, namespace="acme-rag")
    _gen(beta, pb)
    assert _matched(admin, pa, "acme-rag") > 0 and _matched(admin, pb, "beta") > 0
    assert _gen(admin, pb, namespace="beta").usage.cached_tokens > 0
    pin = admin.pin(pb, namespace="beta")
    assert pin.pinned_tokens > 0
    assert admin.unpin(pin.pin_id).unpinned == 1
    assert admin.evict(prefix=pa, namespace="acme-rag").evicted_tokens > 0
    assert _l1(acme, pa, "acme-rag") == 0


# --- quotas --------------------------------------------------------------------------------------
@pytest.mark.usefixtures("clean")
def test_l1_quota_demotes_the_tenants_lru_nodes_to_l2(acme, beta):
    prompts = [_prompt(40 + i, 40) for i in range(4)]
    evicted_before = _tier(acme.cache_stats(), "l1").evicted_tokens
    first_ids = acme.generate_text(prompts[0], **SHORT)[1]
    for p in prompts[1:]:
        _gen(acme, p)
    _wait_for(
        lambda: _used(acme, "l1") <= ACME_L1_QUOTA,
        lambda: f"acme stays over its L1 quota: {_usage(acme)}",
    )
    stats = acme.cache_stats()
    assert 0 < _tier(stats, "l1").used_tokens <= ACME_L1_QUOTA
    assert _tier(stats, "l2").used_tokens > 0
    assert _tier(stats, "l1").evicted_tokens > evicted_before  # counted as quota evictions
    oldest = acme.match_prefix(prompts[0]).matched_per_tier
    assert oldest.l1 == 0 and oldest.l2 > 0  # least recently used: demoted, not dropped
    assert _l1(acme, prompts[-1]) > 0  # the newest stays
    # beta (no quota) keeps all of the same amount on L1
    for i in range(4):
        _gen(beta, _prompt(40 + i, 40))
    for i in range(4):
        assert _l1(beta, _prompt(40 + i, 40)) == 40
    assert _used(beta, "l1") >= 4 * 40
    assert _tier(beta.cache_stats(), "l1").evicted_tokens == 0
    # acme's demoted prefix loads back from L2, with the same output
    _, ids, done = acme.generate_text(prompts[0], **SHORT)
    assert ids == first_ids and done.usage.cached_tokens_per_tier.l2 > 0


@pytest.mark.usefixtures("clean")
def test_l2_quota_caps_the_tenants_l2(gamma, beta):
    prompts = [_prompt(50 + i, 40) for i in range(4)]
    evicted_before = _tier(gamma.cache_stats(), "l2").evicted_tokens
    for p in prompts:
        _gen(gamma, p)
    _wait_for(
        lambda: _used(gamma, "l1") <= GAMMA_L1_QUOTA and _used(gamma, "l2") <= GAMMA_L2_QUOTA,
        lambda: f"gamma stays over its L1 / L2 quota: {_usage(gamma)}",
    )
    stats = gamma.cache_stats()
    assert _tier(stats, "l1").capacity_tokens == GAMMA_L1_QUOTA
    assert _tier(stats, "l2").capacity_tokens == GAMMA_L2_QUOTA
    assert 0 < _tier(stats, "l2").used_tokens <= GAMMA_L2_QUOTA
    assert _tier(stats, "l2").evicted_tokens > evicted_before
    oldest = gamma.match_prefix(prompts[0]).matched_per_tier
    assert oldest.l1 == 0 and oldest.l2 == 0  # left L2 as well (L3 may still hold it)
    for p in prompts:
        _gen(beta, p)
    assert all(_l1(beta, p) == 40 for p in prompts)  # beta is not squeezed by gamma's quota


@pytest.mark.usefixtures("clean")
def test_l3_quota_stops_the_tenants_backups(delta, beta, admin):
    prompts = [_prompt(60 + i, L3_PROMPT) for i in range(3)]
    _gen(delta, prompts[0])
    # NOTE: the quota counts what the tree knows is on L3, so let the first object land
    _wait_for(lambda: _used(delta, "l3") >= DELTA_L3_QUOTA, "delta's first backup")
    for p in prompts[1:]:
        _gen(delta, p)
    for p in prompts:  # the control: beta, without a quota, gets every object stored
        _gen(beta, p)
    _wait_for(lambda: _used(beta, "l3") >= 3 * L3_OBJECT, "beta's backups did not reach L3")
    _l3_idle(admin)
    stats = delta.cache_stats()
    assert _tier(stats, "l3").capacity_tokens == DELTA_L3_QUOTA
    # at or above the quota no further backups: at most one object past it
    assert 0 < _tier(stats, "l3").used_tokens < DELTA_L3_QUOTA + L3_OBJECT
    assert _used(beta, "l3") >= 3 * L3_OBJECT


# --- start-up log --------------------------------------------------------------------------------
def test_tenant_daemon_does_not_say_auth_is_off(daemon, daemon_log):
    assert not any("no authentication" in line for line in daemon_log.lines), daemon_log.lines


def test_daemon_without_any_token_says_auth_is_off(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger=APP_LOGGER)
    args = ServerArgs(model_path=tiny_llama_dir, max_total_tokens=256)
    dt = DaemonThread(DaemonSettings(port=0, warmup=False, grace_period_s=0), args).start()
    try:
        with _client(dt, None) as c:
            assert c.cache_stats().tiers[0].enabled  # served without a token
    finally:
        dt.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == APP_LOGGER]
    assert any("no authentication" in line for line in lines), lines
