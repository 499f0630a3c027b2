"""How the split daemon's messages (engine/ipc/messages.py) travel: the IPC socket addresses,
ZMQ PUSH/PULL sockets carrying pickled lists of messages, the Outbox that sends from any thread
in batches, and a spawned child process' set-up."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

log = logging.getLogger(__name__)
SEND_BATCH = 256  # messages per send at most


# --- addresses and sockets -------------------------------------------------------------------
@dataclass(frozen=True)
class Addresses:
    sched_in: str
    api_reply: str
    detok_in: str
    api_chunks: str

    @classmethod
    def in_dir(cls, directory: str | Path) -> Addresses:
        d = Path(directory)
        return cls(*(f"ipc://{d / name}" for name in ("sched", "reply", "detok", "chunks")))


def pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    return sock


def push(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)  # at close, queued messages get 2 s to leave
    sock.connect(addr)
    return sock


def send(sock: zmq.Socket, msgs: list[Any]) -> None:
    sock.send(pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL), copy=False)


def recv(sock: zmq.Socket, timeout_ms: int) -> list[Any] | None:
    """One batch, or None when nothing came within timeout_ms."""
    if not sock.poll(timeout_ms):
        return None
    return pickle.loads(sock.recv(copy=False).buffer)


def picklable_error(exc: BaseException) -> BaseException:
    """`exc` if it survives a round trip through pickle, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may come here
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class Outbox:
    """Messages from any thread to PUSH sockets, sent by one thread (ZMQ sockets are not
    thread-safe) in batches: a busy scheduler sends one message per destination per pass."""

    def __init__(self, socks: dict[str, zmq.Socket]):
        self.socks = socks
        self.q: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="hicache-outbox", daemon=True)
        self.thread.start()

    def put(self, dest: str, msg: Any) -> None:
        self.q.put((dest, msg))

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops."""
        self.q.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            batch: dict[str, list[Any]] = {}
            n = 0
            while item is not None:
                batch.setdefault(item[0], []).append(item[1])
                n += 1
                if n >= SEND_BATCH:
                    break
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
            for dest, msgs in batch.items():
                try:
                    send(self.socks[dest], msgs)
                except zmq.ZMQError:
                    log.exception("sending %d message(s) to %s failed", len(msgs), dest)
            if item is None:
                return


# --- child process set-up ------------------------------------------------------------------
def child_setup(name: str, log_level: str) -> None:
    """In a spawned child: log with its name, leave Ctrl-C to the API server (it drains and
    stops the children in order), and exit when the parent dies (even by kill -9)."""
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:

        def watch() -> None:
            # NOTE: the sentinel becomes ready when the parent exits, however it exits
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(1)

        threading.Thread(target=watch, name="hicache-parent-watch", daemon=True).start()
