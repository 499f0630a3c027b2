"""Inbox: the one way other threads reach the scheduler thread, as typed messages.

Any thread puts: a new request (``Arrival``), an abort (``Abort``), a function to run between
steps (``Call``), a wake-up (``Wake``; coalesced: at most one is queued). Only the scheduler
thread takes (``take``). The inbox also counts the arrivals and aborts not taken yet, for the
queue-length limit (``Scheduler.num_queued``). When the scheduler loop ends it closes the inbox
(``close``): every call queued then, and every call put later, fails with EngineShutdownError at
once; nothing is left waiting on a loop that is gone.

Every put also makes the inbox's file descriptor (``fileno``: one end of a socket pair)
readable until the next ``take``, so a loop that waits on other sockets too (the scheduler
process: its ZMQ socket, engine/runtime/process.py) waits on the inbox in the same poll.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import EngineShutdownError

if TYPE_CHECKING:
    from engine.runtime.request import Req
    from engine.runtime.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class Arrival:
    req: Req


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Call:
    fn: Callable[[Scheduler], Any]
    future: Future


@dataclass(frozen=True)
class Wake:
    pass


Message = Arrival | Abort | Call | Wake


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.Queue[Message] = queue.Queue()
        self._lock = threading.Lock()
        self._arrivals = 0  # Arrival messages not taken yet
        self._aborts = 0  # Abort messages not taken yet
        self._wake_pending = threading.Event()
        self._closed = False  # the scheduler loop has ended: calls fail at once
        # NOTE: a byte in the pair means "something was put since the last take"; the sockets
        # close with the inbox (never at the loop's end: a copy thread may still wake it)
        self._signaled = False  # under _lock: a byte is (about to be) in the pair
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)

    # ---- any thread ----------------------------------------------------------------------------
    def put_request(self, req: Req) -> None:
        with self._lock:
            self._arrivals += 1
        self._put(Arrival(req))

    def put_abort(self, rid: str) -> None:
        with self._lock:
            self._aborts += 1
        self._put(Abort(rid))

    def put_call(self, fn: Callable[[Scheduler], Any]) -> Future:
        """The call's future; failed at once (EngineShutdownError) once the inbox is closed."""
        fut: Future = Future()
        # NOTE: checked and queued under the lock close() takes: a call either is queued before
        # the close (and failed by it) or sees the close; none can slip in between
        with self._lock:
            queued = not self._closed
            if queued:
                self._queue.put(Call(fn, fut))
        if queued:
            self._signal()
            return fut
        fut.set_exception(_stopped())
        return fut

    def wake(self) -> None:
        """Make a sleeping scheduler run a step (coalesced)."""
        if not self._wake_pending.is_set():
            self._wake_pending.set()
            self._put(Wake())

    def _put(self, msg: Message) -> None:
        self._queue.put(msg)  # NOTE: before the signal: a take after it finds the message
        self._signal()

    def _signal(self) -> None:
        with self._lock:
            if self._signaled:
                return
            self._signaled = True
        try:
            self._writer.send(b"\0")
        except OSError:  # full (readable anyway), or closed with the inbox
            pass

    def pending_arrivals(self) -> int:
        """Arrivals not taken yet, less the aborts not taken yet."""
        return self._arrivals - self._aborts

    # ---- the scheduler thread ------------------------------------------------------------------
    def fileno(self) -> int:
        """Readable while something was put since the last ``take`` (for ``select`` / a ZMQ
        poller)."""
        return self._reader.fileno()

    def wait(self, timeout: float) -> None:
        """Block until something is put, or ``timeout`` seconds passed."""
        select.select([self._reader], [], [], timeout)

    def close(self) -> None:
        """The loop has ended: fail every queued call, and every later one, with
        EngineShutdownError (their callers would otherwise wait out their timeouts on threads
        that keep the process from exiting). Arrivals and aborts left are dropped: the
        requests' streams end when their engine shuts down."""
        with self._lock:
            self._closed = True
        while True:
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Call) and msg.future.set_running_or_notify_cancel():
                msg.future.set_exception(_stopped())

    def take(self, block: bool, timeout: float) -> Iterator[Message]:
        """Every queued message (waiting at most ``timeout`` s for the first when ``block``)."""
        if block:
            self.wait(timeout)
        with self._lock:  # NOTE: before taking: what is put from now on signals again
            self._signaled = False
            try:
                while self._reader.recv(4096):
                    pass
            except BlockingIOError:
                pass
        try:
            msg = self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, Wake):
                self._wake_pending.clear()
            elif isinstance(msg, Arrival):
                with self._lock:
                    self._arrivals -= 1
            elif isinstance(msg, Abort):
                with self._lock:
                    self._aborts -= 1
            yield msg
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                return


def _stopped() -> EngineShutdownError:
    return EngineShutdownError("the scheduler has stopped")
