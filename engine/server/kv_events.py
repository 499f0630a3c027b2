"""KV events for routers: the cache's blocks per tier (L1, L2, and L3 as "disk" or "external")
as numbered batches of stored / removed / cleared events, with replay and a snapshot for a late
subscriber.

The publisher starts with its first subscriber (SMG's SubscribeKvEvents, or the ZMQ publisher
at load) and runs on the daemon's event loop: whenever the cache's event log moves (and at least
once a second), it asks the engine what changed in the cache's blocks per tier since its last
look (EngineFront.kv_block_changes, engine/runtime/kv_block_view.py; the first look, and one after a failed look, get the
whole state, which is diffed here), and appends one batch with the difference:

    batch 1: the blocks at start (Stored per tier)      batch n: Removed / Stored / Cleared
    seq      1 ............................................ n      (ring of `capacity` batches)

Between two looks the cache may store and drop a block; subscribers see the net change, which is
what routing needs: after every batch, the published state equals the cache's blocks at that
look, tier by tier.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.errors import EngineShutdownError
from engine.server.state import DaemonState
from hicache.observe.blocks import TIERS, Block

log = logging.getLogger(__name__)

# coalesce the changes of consecutive scheduler steps into one batch; a look costs the scheduler
# thread about 6 ms per 30k cached blocks (the walk; only changes cross to this process)
MIN_INTERVAL_S = 0.1
IDLE_LOOK_S = 1.0  # a look without a logged event (host writes landing log nothing)


@dataclass(frozen=True)
class Stored:
    """Blocks stored in a tier, a chain: each block's parent is the one before it, the first
    one's is `parent_hash`."""

    tier: str
    parent_hash: int | None
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Removed:
    tier: str
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    """Every tier emptied."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class EventBatch:
    seq: int
    timestamp: float
    events: tuple[Event, ...]
    snapshot_blocks: int | None = None  # a snapshot: the blocks it lists (every tier)


class OutOfRangeError(LookupError):
    """A start sequence the publisher no longer holds, or has not reached."""


def chains(tier: str, blocks: list[Block]) -> list[Stored]:
    """Consecutive blocks (parents before children) grouped into Stored chains."""
    out: list[Stored] = []
    run: list[Block] = []
    for b in blocks:
        if run and b.parent_hash == run[-1].block_hash and b.salt == run[-1].salt:
            run.append(b)
            continue
        if run:
            out.append(Stored(tier, run[0].parent_hash, tuple(run)))
        run = [b]
    if run:
        out.append(Stored(tier, run[0].parent_hash, tuple(run)))
    return out


def diff(old: dict[str, dict[int, Block]], new: dict[str, list[Block]]) -> list[Event]:
    """The events that turn the published `old` into `new` (a tier absent: empty)."""
    if any(old.values()) and not any(new.values()):
        return [Cleared()]
    events: list[Event] = []
    for tier in TIERS:
        was, blocks = old.get(tier, {}), new.get(tier, [])
        now = {b.block_hash for b in blocks}
        gone = tuple(h for h in was if h not in now)
        if gone:
            events.append(Removed(tier, gone))
        events += chains(tier, [b for b in blocks if b.block_hash not in was])
    return events


class KvEventPublisher:
    def __init__(
        self,
        state: DaemonState,
        block_size: int,
        capacity: int = 10_000,
        salt_key: bytes | None = None,
    ):
        self.state = state
        self.block_size = block_size
        # the HMAC key of namespaces' salts: configured (every daemon behind one gateway hashes
        # a namespace's blocks alike), else drawn for this process
        self.salt_key = salt_key if salt_key is not None else secrets.token_bytes(32)
        self.batches: collections.deque[EventBatch] = collections.deque(maxlen=capacity)
        self.seq = 0
        self.blocks: dict[str, dict[int, Block]] = {t: {} for t in TIERS}
        self._task: asyncio.Task[None] | None = None
        self._reset = True  # the next look asks for the whole state (first, or after a failure)
        self._listeners: list[asyncio.Queue[EventBatch]] = []

    def listen(self) -> asyncio.Queue[EventBatch]:
        """A queue that gets every batch from now on (unlisten() it when done)."""
        queue: asyncio.Queue[EventBatch] = asyncio.Queue()
        self._listeners.append(queue)
        return queue

    def unlisten(self, queue: asyncio.Queue[EventBatch]) -> None:
        if queue in self._listeners:
            self._listeners.remove(queue)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Takes the first look (batch 1) and starts following the tree; idempotent."""
        if self.running:
            return
        await self._look()
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _look(self) -> None:
        st = self.state
        reset = self._reset
        self._reset = True  # until this look is applied: a lost answer must not skip changes
        engine = st.engine
        if engine is None:
            raise EngineShutdownError("the engine is not loaded")
        ch = await st.run(engine.kv_block_changes, self.block_size, self.salt_key, reset)
        if ch.full:
            events = diff(self.blocks, ch.stored)
            self.blocks = {t: {b.block_hash: b for b in ch.stored[t]} for t in TIERS}
        else:
            had = any(self.blocks.values())
            for t in TIERS:
                for h in ch.removed[t]:
                    self.blocks[t].pop(h, None)
                self.blocks[t].update((b.block_hash, b) for b in ch.stored[t])
            if had and not any(self.blocks.values()):
                events = [Cleared()]
            else:
                events = [Removed(t, tuple(ch.removed[t])) for t in TIERS if ch.removed[t]]
                for t in TIERS:
                    events += chains(t, ch.stored[t])
        self._reset = False
        if events or self.seq == 0:
            self.seq += 1
            batch = EventBatch(self.seq, time.time(), tuple(events))
            self.batches.append(batch)
            for q in self._listeners:
                q.put_nowait(batch)

    async def _follow(self) -> None:
        st = self.state
        event_log = st.event_log
        if event_log is None:
            raise EngineShutdownError("the engine is not loaded")
        seen = await st.run(lambda: event_log.last_seq)
        while not st.draining:
            try:
                if await st.run(event_log.wait_for, seen, IDLE_LOOK_S):
                    seen = await st.run(lambda: event_log.last_seq)
                await self._look()
            except Exception:  # the engine stopping under a look; otherwise: try again
                if st.draining or not st.ready:
                    return
                log.warning("KV events: a look at the cache failed", exc_info=True)
            await asyncio.sleep(MIN_INTERVAL_S)

    def snapshot(self) -> EventBatch:
        """The published state as one batch numbered `seq`: Cleared, then every block."""
        events: list[Event] = [Cleared()]
        for tier in TIERS:
            events += chains(tier, list(self.blocks[tier].values()))
        count = sum(len(b) for b in self.blocks.values())
        return EventBatch(self.seq, time.time(), tuple(events), snapshot_blocks=count)

    def since(self, start: int) -> list[EventBatch]:
        """The batches numbered >= start; OutOfRangeError when they are no longer (or not yet)
        all held."""
        first = self.batches[0].seq if self.batches else self.seq + 1
        if start < first or start > self.seq + 1:
            raise OutOfRangeError(
                f"start sequence {start} is outside the held batches [{first}, {self.seq + 1}]"
            )
        return [b for b in self.batches if b.seq >= start]

    async def subscribe(self, start: int) -> AsyncIterator[EventBatch]:
        """Batches from `start` (0: a snapshot of the current state, then what follows) until
        the publisher stops."""
        await self.start()
        queue = self.listen()  # NOTE: before reading the backlog: nothing falls between
        try:
            backlog = [self.snapshot()] if start == 0 else self.since(start)
            cursor = 0
            for batch in backlog:
                cursor = batch.seq
                yield batch
            while self.running:
                try:
                    batch = await asyncio.wait_for(queue.get(), IDLE_LOOK_S)
                except asyncio.TimeoutError:
                    continue
                if batch.seq > cursor:  # the queue may repeat what the backlog had
                    cursor = batch.seq
                    yield batch
        finally:
            self.unlisten(queue)
