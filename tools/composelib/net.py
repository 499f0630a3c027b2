"""Compose's default network, made by hand: a "host" network namespace with a bridge, and one
namespace per service on it with its own address, so that every service listens on the ports its
command names (two daemons on 50051, as in compose) and reaches the others by service name (the
containers' /etc/hosts). The published `ports:` are TCP forwarders on the host namespace's
loopback (what Docker's userland proxy does), so clients use the addresses compose.yaml
publishes (127.0.0.1:30000, 127.0.0.1:50052, ...) without touching the machine's own loopback.

NOTE: every address is inside namespaces this module creates; nothing here routes to or from
the machine's own network."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from tools.composelib.spec import Port

SUBNET = "10.28.0"  # /24 on the bridge; .1 is the host namespace
PREFIX = "hcc"  # namespace and link names: hcc-host, hcc-<service>, hcc0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Network:
    """The namespaces and addresses of one run: `host` is where clients and the published ports
    live; `addresses` maps each service to its address on the bridge."""

    host: str
    addresses: dict[str, str]

    def netns(self, service: str) -> str:
        return f"{PREFIX}-{service}"

    def hosts(self) -> list[str]:
        """`buildah from --add-host` values: every service by name."""
        return [f"{name}:{ip}" for name, ip in self.addresses.items()]

    def exec_prefix(self, service: str) -> list[str]:
        """The argv prefix that runs a command in the service's namespace."""
        return ["ip", "netns", "exec", self.netns(service)]


def existing() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    return [
        line.split()[0]
        for line in out.stdout.splitlines()
        if line.split() and line.split()[0].startswith(PREFIX + "-")
    ]


def kill_inside(ns: str) -> list[int]:
    """SIGKILLs whatever still runs in a namespace of ours (what a service left behind when its
    wrapper died); returns the pids."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def teardown() -> None:
    """Deletes every namespace of a run (this one's or one left by an interrupted run), after
    killing what still runs in it; the veths and the bridge go with them."""
    for ns in existing():
        if ns != f"{PREFIX}-host":  # the caller may live there
            kill_inside(ns)
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def create(services: Iterable[str]) -> Network:
    teardown()
    host = f"{PREFIX}-host"
    _ip("netns", "add", host)
    _ip("-n", host, "link", "set", "lo", "up")
    _ip("-n", host, "link", "add", f"{PREFIX}0", "type", "bridge")
    _ip("-n", host, "addr", "add", f"{SUBNET}.1/24", "dev", f"{PREFIX}0")
    _ip("-n", host, "link", "set", f"{PREFIX}0", "up")
    addresses: dict[str, str] = {}
    for k, name in enumerate(services, start=2):
        ns, peer, addr = f"{PREFIX}-{name}", f"v{k}", f"{SUBNET}.{k}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", host, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", host, "link", "set", peer, "master", f"{PREFIX}0", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        addresses[name] = addr
    return Network(host, addresses)


class Forwarders:
    """The published ports: a listener on host_ip:host_port per port, each connection piped
    to the service's address:container_port. Runs an event loop in a thread of a process that
    lives in the host namespace."""

    def __init__(self, published: Iterable[tuple[Port, str]]) -> None:
        self._published = list(published)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="forwarders", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        servers = []
        try:
            for port, target in self._published:
                servers.append(
                    self._loop.run_until_complete(
                        asyncio.start_server(
                            self._handler(target, port.container_port), port.host_ip, port.host_port
                        )
                    )
                )
        except OSError as e:
            self._error = e
        self._ready.set()
        if self._error is None:
            self._loop.run_forever()
        for s in servers:
            s.close()
        self._loop.close()

    @staticmethod
    def _handler(
        address: str, port: int
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
                writer.write_eof()  # a half-close passes through

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(address, port)
            except OSError:
                writer.close()  # nothing listens there (yet): the client sees a reset
                return
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            for w in (writer, up_writer):
                w.close()

        return handle
