"""vLLM-format KV events over ZMQ (--kv-events-config) from a daemon on real ports, read by a
real ZMQ subscriber: 3-frame messages (topic, big-endian sequence, msgpack EventBatch), a replay
of the buffered batches from sequence 1, and the blocks the events describe, applied in order,
equal to the tree's blocks per tier after requests and an eviction."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from engine.config import ServerArgs
from engine.runtime import cache_admin
from engine.runtime.kv_block_view import kv_blocks
from engine.runtime.scheduler import SchedulerCall
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings
from tools.benchlib import free_port

MEDIUM = {"l1": "GPU", "l2": "CPU", "disk": "DISK", "external": "EXTERNAL"}


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir) -> Iterator[tuple[DaemonThread, int, int]]:
    pub, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": "kv",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    settings = DaemonSettings(
        port=0,
        warmup=False,
        processes="single",
        grace_period_s=2,
        kv_events_config=json.dumps(config),
    )
    args = ServerArgs(
        model_path=tiny_llama_dir, max_total_tokens=2048, enable_hierarchical_cache=True
    )
    dt = DaemonThread(settings, args).start()
    yield dt, pub, replay
    dt.stop()


def _apply(state: dict[str, dict[int, tuple[int | None, tuple[int, ...]]]], payload: bytes) -> None:
    ts, events = msgpack.unpackb(payload)[:2]
    assert isinstance(ts, float)
    for ev in events:
        if ev[0] == "BlockStored":
            hashes, parent, tokens, size, lora_id, medium = ev[1:7]
            assert lora_id is None and len(tokens) == size * len(hashes)
            for k, h in enumerate(hashes):
                state[medium][h] = (parent, tuple(tokens[k * size : (k + 1) * size]))
                parent = h
        elif ev[0] == "BlockRemoved":
            for h in ev[1]:
                del state[ev[2]][h]
        else:
            assert ev == ["AllBlocksCleared"]
            for blocks in state.values():
                blocks.clear()


def _tree_state(dt: DaemonThread) -> dict[str, dict[int, tuple[int | None, tuple[int, ...]]]]:
    d = dt.daemon
    now = d.state.engine.call_in_scheduler(
        SchedulerCall(kv_blocks, (d.kv_events.block_size, d.kv_events.salt_key))
    )
    return {
        MEDIUM[t]: {b.block_hash: (b.parent_hash, b.token_ids) for b in blocks}
        for t, blocks in now.items()
    }


def test_zmq_events_equal_the_tree(daemon):
    dt, pub_port, replay_port = daemon
    engine = dt.daemon.state.engine
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        for n in (40, 70, 33):  # prompts of 2, 4 and 2 full blocks, sharing nothing
            prompt = [(7 * n + i) % 300 + 5 for i in range(n)]
            engine.generate(prompt, {"max_new_tokens": 3, "temperature": 0.0})
        engine.call_in_scheduler(SchedulerCall(cache_admin.evict, ("l1",)))
        engine.generate([9] * 20, {"max_new_tokens": 2, "temperature": 0.0})
        # the buffered batches from the start, through the replay socket
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(30_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert empty == b"" and payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in replayed] == list(range(1, len(replayed) + 1))
        state: dict[str, dict[int, Any]] = {m: {} for m in MEDIUM.values()}
        for _, payload in replayed:
            _apply(state, payload)
        last = replayed[-1][0]
        # then live messages, until what they describe is the tree (host copies may still land)
        deadline = time.monotonic() + 60
        while state != _tree_state(dt):
            assert time.monotonic() < deadline, "the events never caught up with the tree"
            if not sub.poll(1000):
                continue
            topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            assert topic == b"kv" and len(seq_bytes) == 8
            if seq <= last:
                continue  # replayed already
            assert seq == last + 1, f"gap: {last} -> {seq}"
            _apply(state, payload)
            last = seq
        assert state["CPU"] and any(len(v[1]) == 16 for v in state["CPU"].values())
        assert len(state["GPU"]) == 1  # after the eviction: the last prompt's one full block
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
