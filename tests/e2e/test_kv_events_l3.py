"""L3 in the KV events, from daemons on real ports: a real ZMQ subscriber decodes DISK blocks
once backups land on a file L3, equal to what the cache holds, and sees them removed by a flush
of L3; a restarted daemon's snapshot (SMG's SubscribeKvEvents) lists the DISK blocks its files
hold; a daemon on a real Valkey publishes EXTERNAL blocks; daemons given one salt key publish a
tenant's prompt under one hash (and without one, under different hashes)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq

from engine.config import ServerArgs
from engine.runtime import cache_admin
from engine.runtime.kv_block_view import kv_blocks
from engine.runtime.scheduler import SchedulerCall
from engine.server.app import DaemonThread
from engine.server.gen.smg import common_pb2 as smg_common
from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sg_grpc
from engine.server.settings import DaemonSettings
from hicache.observe.blocks import block_hash
from tests import valkey_servers
from tools.benchlib import free_port

valkey_server = valkey_servers.valkey_server

MEDIUM = {"l1": "GPU", "l2": "CPU", "disk": "DISK", "external": "EXTERNAL"}
BLOCK, OBJECT = 16, 32  # tokens per event block, per L3 object
GREEDY = {"max_new_tokens": 3, "temperature": 0.0}
PROMPTS = [[(7 * n + i) % 300 + 5 for i in range(n)] for n in (70, 100, 40)]
State = dict[str, dict[int, tuple[int | None, tuple[int, ...]]]]


def _start(
    tmp: Path | None,
    zmq_ports: tuple[int, int] | None = None,
    redis: str | None = None,
    **settings: Any,
) -> DaemonThread:
    """An in-process daemon with L1 + L2 + L3 (a file L3 in ``tmp``, or Valkey at ``redis``;
    ``tmp`` None and no ``redis``: no L3) and, with ``zmq_ports``, vLLM-format events."""
    if zmq_ports is not None:
        pub, replay = zmq_ports
        settings["kv_events_config"] = json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "topic": "kv",
                "endpoint": f"tcp://*:{pub}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
        )
    l3: dict[str, Any] = {}
    if redis is not None:
        l3 = {"hicache_storage_backend": "redis", "hicache_storage_url": redis}
    elif tmp is not None:
        l3 = {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp)}
    args = ServerArgs(
        model_path=settings.pop("model"),
        max_total_tokens=2048,
        enable_hierarchical_cache=True,
        hicache_storage_page_size=OBJECT,
        **l3,
    )
    return DaemonThread(
        DaemonSettings(port=0, warmup=False, processes="single", grace_period_s=2, **settings), args
    ).start()


def _cache_state(dt: DaemonThread) -> State:
    """What the cache holds now, per medium (the blocks the events must describe)."""
    d = dt.daemon
    assert d is not None
    now = d.state.engine.call_in_scheduler(
        SchedulerCall(kv_blocks, (d.kv_events.block_size, d.kv_events.salt_key))
    )
    return {
        MEDIUM[t]: {b.block_hash: (b.parent_hash, b.token_ids) for b in blocks}
        for t, blocks in now.items()
    }


def _storage_idle(scheduler: Any) -> bool:
    return not scheduler.tree_cache.l3.storage_busy()


class Follower:
    """A real ZMQ subscriber of a daemon's vLLM-format events: replays from sequence 1, then
    applies the live batches in order to ``state`` (medium -> block hash -> (parent, tokens))."""

    def __init__(self, pub: int, replay: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{replay}")
        self.state: State = {m: {} for m in MEDIUM.values()}
        self.removed: dict[str, int] = {m: 0 for m in MEDIUM.values()}  # blocks removed
        self.cleared = 0
        self.last = 0

    def replay(self) -> None:
        self.dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        while True:
            assert self.dealer.poll(30_000), "no replay answer"
            _, seq, payload = self.dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return
            self._take(int.from_bytes(seq, "big"), payload)

    def until(self, cond: Callable[[State], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond(self.state):
            assert time.monotonic() < deadline, f"the events never showed {what}"
            if self.sub.poll(500):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == b"kv"
                self._take(int.from_bytes(seq, "big"), payload)

    def _take(self, seq: int, payload: bytes) -> None:
        if seq <= self.last:
            return  # replayed already
        assert seq == self.last + 1, f"gap: {self.last} -> {seq}"
        self.last = seq
        for ev in msgpack.unpackb(payload)[1]:
            if ev[0] == "BlockStored":
                hashes, parent, tokens, size, _, medium = ev[1:7]
                for k, h in enumerate(hashes):
                    self.state[medium][h] = (parent, tuple(tokens[k * size : (k + 1) * size]))
                    parent = h
            elif ev[0] == "BlockRemoved":
                for h in ev[1]:
                    del self.state[ev[2]][h]
                self.removed[ev[2]] += len(ev[1])
            else:
                self.cleared += 1
                for blocks in self.state.values():
                    blocks.clear()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)
        self.ctx.term()


@pytest.fixture
def follow() -> Iterator[Callable[[int, int], Follower]]:
    made: list[Follower] = []

    def make(pub: int, replay: int) -> Follower:
        made.append(Follower(pub, replay))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _chain(tokens: list[int], salt: str | None = None) -> list[int]:
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = block_hash(parent, salt, tuple(tokens[i : i + BLOCK]))
        out.append(parent)
    return out


# the blocks inside whole objects of the prompts' KV (a prompt and its first 2 generated tokens
# have KV: 72, 102 and 42 tokens, so 2, 3 and 1 objects of 32 tokens)
IN_OBJECTS = [h for p in PROMPTS for h in _chain(p[: len(p) + 2 - (len(p) + 2) % OBJECT])]


def _settled(dt: DaemonThread, f: Follower, medium: str) -> None:
    """Until every object of the prompts landed in L3 and the events describe the cache."""
    engine = dt.daemon.state.engine
    f.until(
        lambda s: (
            set(IN_OBJECTS) <= set(s[medium])
            and engine.call_in_scheduler(SchedulerCall(_storage_idle))
            and s == _cache_state(dt)
        ),
        f"{medium} blocks",
    )


def test_disk_blocks_follow_backups_and_a_flush_of_l3(tiny_llama_dir, tmp_path, follow):
    ports = (free_port(), free_port())
    dt = _start(tmp_path / "kv", ports, model=tiny_llama_dir)
    try:
        f = follow(*ports)
        engine = dt.daemon.state.engine
        engine.generate(PROMPTS, GREEDY)
        f.replay()
        _settled(dt, f, "DISK")
        disk = f.state["DISK"]
        # whole objects only, one hash for a block in L1, L2 and L3
        want = IN_OBJECTS
        assert sorted(disk) == sorted(want)
        assert set(disk) <= set(f.state["GPU"]) | set(f.state["CPU"])
        assert all(len(tokens) == BLOCK for _, tokens in disk.values())
        engine.call_in_scheduler(SchedulerCall(cache_admin.flush, (["l3"],)))
        f.until(lambda s: not s["DISK"] and s == _cache_state(dt), "DISK blocks removed")
        assert f.removed["DISK"] == len(want) and f.cleared == 0 and f.state["GPU"]
    finally:
        dt.stop()


def _snapshot(dt: DaemonThread) -> Any:
    """The first batch of SMG's SubscribeKvEvents from 0: the publisher's snapshot."""
    with grpc.insecure_channel(f"127.0.0.1:{dt.port}") as ch:
        stream = sg_grpc.SglangSchedulerStub(ch).SubscribeKvEvents(
            smg_common.SubscribeKvEventsRequest(start_sequence_number=0), timeout=60
        )
        first = next(iter(stream))
        stream.cancel()
    assert first.HasField("snapshot") and first.events[0].HasField("cleared")
    return first


def _stored(batch: Any, tier: int) -> dict[int, tuple[int, ...]]:
    """block hash -> tokens of the batch's stored blocks in ``tier``."""
    out = {}
    for e in batch.events:
        if e.HasField("stored") and e.stored.tier == tier:
            out.update({b.block_hash: tuple(b.token_ids) for b in e.stored.blocks})
    return out


def test_restarted_daemon_snapshot_lists_its_disk_blocks(tiny_llama_dir, tmp_path, follow):
    ports = (free_port(), free_port())
    first = _start(tmp_path / "kv", ports, model=tiny_llama_dir)
    try:
        f = follow(*ports)
        first.daemon.state.engine.generate(PROMPTS, GREEDY)
        f.replay()
        _settled(first, f, "DISK")
        before = {h: tokens for h, (_, tokens) in f.state["DISK"].items()}
    finally:
        first.stop()
    again = _start(tmp_path / "kv", model=tiny_llama_dir)
    try:
        snap = _snapshot(again)
        assert _stored(snap, smg_common.KV_CACHE_TIER_DISK) == before
        assert not _stored(snap, smg_common.KV_CACHE_TIER_DEVICE)  # nothing computed yet
        for e in snap.events[1:]:
            s = e.stored
            assert (s.medium, s.locality) == ("DISK", smg_common.KV_CACHE_LOCALITY_LOCAL)
            assert all(b.cache_level == 2 and b.block_size == BLOCK for b in s.blocks)
        assert snap.snapshot.blocks == len(before)
        # the prompt comes back from the disk: its L1 blocks are the DISK blocks' hashes
        again.daemon.state.engine.generate(PROMPTS[0], GREEDY)

        def device_has_prompt() -> bool:
            device = _stored(_snapshot(again), smg_common.KV_CACHE_TIER_DEVICE)
            return set(_chain(PROMPTS[0][:64])) <= set(device)

        deadline = time.monotonic() + 60
        while not device_has_prompt():
            assert time.monotonic() < deadline, "the prompt's blocks never reached L1"
            time.sleep(0.2)
        assert set(_chain(PROMPTS[0][:64])) <= set(before)
    finally:
        again.stop()


def test_valkey_daemon_publishes_external_blocks(tiny_llama_dir, valkey_server, follow):
    ports = (free_port(), free_port())
    dt = _start(None, ports, redis=valkey_server.url, model=tiny_llama_dir)
    try:
        f = follow(*ports)
        dt.daemon.state.engine.generate(PROMPTS, GREEDY)
        f.replay()
        _settled(dt, f, "EXTERNAL")
        want = IN_OBJECTS
        assert sorted(f.state["EXTERNAL"]) == sorted(want) and not f.state["DISK"]
        snap = _snapshot(dt)
        assert set(_stored(snap, smg_common.KV_CACHE_TIER_EXTERNAL)) == set(want)
        external = [
            e.stored for e in snap.events if e.HasField("stored") and e.stored.medium == "EXTERNAL"
        ]
        assert external and all(
            s.locality == smg_common.KV_CACHE_LOCALITY_REMOTE
            and all(b.cache_level == 3 for b in s.blocks)
            for s in external
        )
    finally:
        dt.stop()


def _salted(dt: DaemonThread, tokens: list[int]) -> dict[str, set[int]]:
    """cache_salt -> the device block hashes of ``tokens``' blocks in the daemon's snapshot."""
    deadline = time.monotonic() + 60
    while True:
        out: dict[str, set[int]] = {}
        for e in _snapshot(dt).events:
            s = e.stored
            if (
                e.HasField("stored")
                and s.tier == smg_common.KV_CACHE_TIER_DEVICE
                and s.HasField("cache_salt")
            ):
                for b in s.blocks:
                    out.setdefault(s.cache_salt, set()).add(b.block_hash)
        if len(out) == 2 and all(len(h) == 2 for h in out.values()):  # 2 full blocks each
            return out
        assert time.monotonic() < deadline, "the namespaced blocks were never published"
        time.sleep(0.2)


def test_one_salt_key_gives_a_tenant_one_hash_on_every_daemon(tiny_llama_dir, tmp_path):
    key = "0123456789abcdef0123456789abcdef"
    key_file = tmp_path / "salt.key"
    key_file.write_text(key + "\n")
    prompt = PROMPTS[2]
    daemons = [
        _start(None, model=tiny_llama_dir, kv_events_salt_key=key),
        _start(None, model=tiny_llama_dir, kv_events_salt_key_file=str(key_file)),
        _start(None, model=tiny_llama_dir),
    ]  # no key: drawn for the process
    try:
        hashes = []
        for dt in daemons:
            for ns in ("acme", "beta"):
                dt.daemon.state.engine.generate(prompt, GREEDY, namespace=ns)
            hashes.append(_salted(dt, prompt))
        a, b, c = hashes
        assert a == b  # the same key: the same salts, the same hashes, tenant by tenant
        assert all("acme" not in salt and "beta" not in salt for salt in a)
        acme, beta = a.values()
        assert not acme & beta  # two tenants: other blocks
        assert not set(c) & set(a) and not set().union(*c.values()) & (acme | beta)
    finally:
        for dt in daemons:
            dt.stop()
