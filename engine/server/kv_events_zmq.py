"""vLLM-format KV events over ZMQ, for the consumers of vLLM's (llm-d's KV-cache indexer,
Dynamo, AIBrix), switched on like vLLM's `--kv-events-config`:

    hicache serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}'

The batches are the KvEventPublisher's (engine/server/kv_events.py), from its first look on.
Each goes out on a PUB socket as 3 frames: the topic, the sequence number (8 bytes, big-endian)
and msgpack of vLLM's EventBatch, positional and tagged by class name as vLLM's msgspec structs
encode it:

    [ts, [["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
           medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]]]

`medium`: "GPU" for L1, "CPU" for L2 (vLLM's words for the device and the host tier), "DISK" for
a file L3 and "EXTERNAL" for a Redis / Valkey L3 (SGLang's, which Dynamo and llm-d read). A ROUTER
socket on `replay_endpoint` answers a client's 8-byte start sequence with `(seq, payload)` for
every buffered batch from there on, then `(-1, b"")`. Endpoints bind when they name no host
(`*`, `::`) or are `ipc://` / `inproc://`, and connect otherwise, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from engine.server.kv_events import Cleared, EventBatch, KvEventPublisher, Removed, Stored
from engine.server.kv_events_config import KvEventsConfig

log = logging.getLogger(__name__)

MEDIUM = {"l1": "GPU", "l2": "CPU", "disk": "DISK", "external": "EXTERNAL"}


def encode(batch: EventBatch, block_size: int) -> bytes:
    """A batch as vLLM's msgpack EventBatch."""
    events: list[list[Any]] = []
    for ev in batch.events:
        if isinstance(ev, Stored):
            tokens = [t for b in ev.blocks for t in b.token_ids]
            events.append(
                [
                    "BlockStored",
                    [b.block_hash for b in ev.blocks],
                    ev.parent_hash,
                    tokens,
                    block_size,
                    None,
                    MEDIUM[ev.tier],
                ]
            )
        elif isinstance(ev, Removed):
            events.append(["BlockRemoved", list(ev.block_hashes), MEDIUM[ev.tier]])
        else:
            assert isinstance(ev, Cleared)
            events.append(["AllBlocksCleared"])
    return msgpack.packb([batch.timestamp, events])


def _open(ctx: zmq.asyncio.Context, kind: int, endpoint: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    if endpoint.startswith(("ipc://", "inproc://")) or host in ("*", "[::]", "::"):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class ZmqKvEvents:
    """Forwards the publisher's batches to a PUB socket and answers replays."""

    def __init__(self, config: KvEventsConfig, source: KvEventPublisher):
        self.config = config
        self.source = source
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        pub = _open(self._ctx, zmq.PUB, cfg.endpoint)
        pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        queue = self.source.listen()  # NOTE: before the source's first look: batch 1 included
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._forward(pub, queue), name="kv-events-pub"))
        if cfg.replay_endpoint:
            router = _open(self._ctx, zmq.ROUTER, cfg.replay_endpoint)
            self._tasks.append(loop.create_task(self._replay(router), name="kv-events-replay"))
        await self.source.start()
        log.info(
            "KV events (vLLM format) on %s%s",
            cfg.endpoint,
            f", replay on {cfg.replay_endpoint}" if cfg.replay_endpoint else "",
        )

    async def _forward(self, pub: zmq.asyncio.Socket, queue: asyncio.Queue[EventBatch]) -> None:
        topic = self.config.topic.encode()
        try:
            while True:
                batch = await queue.get()
                payload = encode(batch, self.source.block_size)
                self.buffer.append((batch.seq, payload))
                await pub.send_multipart([topic, batch.seq.to_bytes(8, "big"), payload])
        finally:
            self.source.unlisten(queue)
            pub.close(linger=0)

    async def _replay(self, router: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await router.recv_multipart()
                client, start = frames[0], frames[-1]
                if len(start) != 8:
                    continue  # not a start sequence: nothing to answer
                first = int.from_bytes(start, "big")
                for seq, payload in list(self.buffer):
                    if seq >= first:
                        await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                await router.send_multipart(
                    [client, b"", (-1).to_bytes(8, "big", signed=True), b""]
                )
        finally:
            router.close(linger=0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
