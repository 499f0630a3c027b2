"""The messages between the split daemon's processes, and the ZMQ plumbing they travel on.
Torch-free, like what they carry (engine/front.py's records): the API server process imports it.

Every socket carries pickled lists of the dataclasses below (one list per send: a sender batches
what is queued). PUSH/PULL over IPC sockets in one private directory:

    API server --SubmitReq/AbortReq/CallReq/Shutdown--> scheduler        (sched_in)
    scheduler  --Reply----------------------------------> API server     (api_reply)
    scheduler  --TokenOut / DetokStop-------------------> detokenizer    (detok_in)
    detokenizer --TokenOut (with text)------------------> API server     (api_chunks)
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from engine.admin_records import TenantQuota
from engine.config import ServerArgs
from engine.front import SamplingParams, StreamChunk

log = logging.getLogger(__name__)
SEND_BATCH = 256  # messages per send at most


# --- messages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SubmitReq:
    call_id: int
    rid: str
    ids: list[int]
    params: SamplingParams
    namespace: str | None


@dataclass(frozen=True)
class AbortReq:
    rid: str


# Operations the API server asks of the scheduler process, one dataclass each: the scheduler
# process answers each with one declared method (SchedulerServer._run), so an operation that is
# not listed here cannot be asked for.
@dataclass(frozen=True)
class InScheduler:
    """engine.call_in_scheduler(fn, timeout): fn must pickle."""

    fn: Callable[[Any], Any]
    timeout: float | None


@dataclass(frozen=True)
class CacheStats:
    """engine.cache_stats(): answered with a hicache.observe.stats.CacheStats record"""


@dataclass(frozen=True)
class ModelInfo:
    """engine.model_info()"""


@dataclass(frozen=True)
class StorageInfo:
    """engine.storage_info()"""


@dataclass(frozen=True)
class GetServerArgs:
    """engine.server_args (changed by attaching or detaching L3)."""


@dataclass(frozen=True)
class AttachStorage:
    """engine.attach_storage(backend, url, directory)"""

    backend: str
    url: str | None
    directory: str | None


@dataclass(frozen=True)
class DetachStorage:
    """engine.detach_storage(timeout)"""

    timeout: float


@dataclass(frozen=True)
class KvBlockChanges:
    """engine.kv_block_changes(block_size, salt_key, reset)"""

    block_size: int
    salt_key: bytes
    reset: bool


@dataclass(frozen=True)
class MatchPrefix:
    """engine.match_prefix(key, namespace)"""

    key: list[int]
    namespace: str | None


@dataclass(frozen=True)
class Evict:
    """engine.evict(tier, num_tokens, prefix, namespace, dry_run, namespaces)"""

    tier: str
    num_tokens: int | None
    prefix: list[int] | None
    namespace: str | None
    dry_run: bool
    namespaces: frozenset[str] | None


@dataclass(frozen=True)
class PinPrefix:
    """engine.pin(key, namespace, ttl_s, owner)"""

    key: list[int]
    namespace: str | None
    ttl_s: float
    owner: str | None


@dataclass(frozen=True)
class Unpin:
    """engine.unpin(pin_id, owner)"""

    pin_id: str | None
    owner: str | None


@dataclass(frozen=True)
class PinSummary:
    """engine.pin_summary()"""


@dataclass(frozen=True)
class Flush:
    """engine.flush(tiers)"""

    tiers: list[str] | None


@dataclass(frozen=True)
class FlushNamespaces:
    """engine.flush_namespaces(namespaces, tiers, owner)"""

    namespaces: frozenset[str]
    tiers: list[str] | None
    owner: str | None


@dataclass(frozen=True)
class InspectTree:
    """engine.inspect_tree(offset, limit, preview_tokens, namespaces)"""

    offset: int
    limit: int
    preview_tokens: int
    namespaces: frozenset[str] | None


@dataclass(frozen=True)
class ApplyQuotas:
    """engine.apply_quotas(quotas)"""

    quotas: tuple[TenantQuota, ...]


@dataclass(frozen=True)
class TenantView:
    """engine.tenant_view(tenant, namespaces)"""

    tenant: str
    namespaces: frozenset[str]


@dataclass(frozen=True)
class TenantFigures:
    """engine.tenant_figures(quotas)"""

    quotas: tuple[TenantQuota, ...]


class EventCall:
    """An operation on the scheduler's CacheEventLog: served by its own threads, so that
    WatchCacheEvents streams waiting for events never hold up admin calls."""


@dataclass(frozen=True)
class EventsLastSeq(EventCall):
    """event_log.last_seq (also creates the log)."""


@dataclass(frozen=True)
class EventsFirstSeq(EventCall):
    """event_log.first_seq"""


@dataclass(frozen=True)
class EventsSince(EventCall):
    """event_log.since(seq, limit)"""

    seq: int
    limit: int | None


@dataclass(frozen=True)
class EventsMissed(EventCall):
    """event_log.missed(seq)"""

    seq: int


@dataclass(frozen=True)
class EventsWaitFor(EventCall):
    """event_log.wait_for(seq, timeout)"""

    seq: int
    timeout: float | None


Operation = (
    InScheduler
    | CacheStats
    | ModelInfo
    | StorageInfo
    | GetServerArgs
    | AttachStorage
    | DetachStorage
    | KvBlockChanges
    | MatchPrefix
    | Evict
    | PinPrefix
    | Unpin
    | PinSummary
    | Flush
    | FlushNamespaces
    | InspectTree
    | ApplyQuotas
    | TenantView
    | TenantFigures
    | EventsLastSeq
    | EventsFirstSeq
    | EventsSince
    | EventsMissed
    | EventsWaitFor
)


@dataclass(frozen=True)
class CallReq:
    """One operation, answered by a Reply with the same call_id."""

    call_id: int
    op: Operation


@dataclass(frozen=True)
class Shutdown:
    call_id: int


@dataclass(frozen=True)
class Reply:
    call_id: int
    ok: bool
    value: Any  # the result, or the exception when not ok


@dataclass(frozen=True)
class TokenOut:
    """One request's chunk; the first one of a request carries what its text needs."""

    rid: str
    chunk: StreamChunk
    start: tuple[bool, list[str]] | None = None  # (skip_special_tokens, stop strings)


@dataclass(frozen=True)
class DetokStop:
    """The scheduler has shut down: nothing more will come."""


@dataclass(frozen=True)
class SchedulerInfo:
    """What the API server needs from the loaded engine (sent with the scheduler process' ready
    signal)."""

    tokenizer: Any
    vocab_size: int
    max_context_len: int
    server_args: ServerArgs


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


# --- sockets -------------------------------------------------------------------------------
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
