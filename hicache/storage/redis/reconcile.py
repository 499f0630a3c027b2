"""Reconciler: the redis backend's count of its scope's objects and payload bytes on the server,
and what the server says of its memory (maxmemory, used memory, evicted keys).

The server keeps no count per scope, so a sweep counts: SCAN of the metadata keys, STRLEN of
their payloads, pipelined per page, on every primary. One pass scans at most
``RECONCILE_MAX_KEYS`` keys; a larger store is swept over several passes and the counts are
published when a sweep completes. Between sweeps the counts follow this process's own writes
and deletions (``add``): ``objects`` / ``bytes`` = the last complete sweep + what we wrote
(new objects) and deleted since that sweep began. Writes that land during a sweep may be
counted twice until the next one; other processes' writes and the server's evictions show up
at the next sweep.

A sweep is dropped, never published in part, when a pass fails, when any call meets an outage
between two passes (``drop_sweep``: the server may have restarted, its data gone and our
cursor meaningless, or failed over), and when a server restarted since the sweep began (its
INFO run id changed: redis-py reconnects a pooled connection on its own, so no call saw it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from hicache.storage.redis import client as redis_client
from hicache.storage.redis.format import data_key_of, meta_pattern

# NOTE: the backend's logger: everything the redis backend logs goes under one name
logger = logging.getLogger("hicache.storage.redis.backend")

RECONCILE_MAX_KEYS = 100_000  # metadata keys one reconcile pass scans; a sweep resumes after


@dataclass
class Sweep:
    """A reconcile sweep over the primaries, possibly spread over several passes."""

    todo: list[tuple[Any, int]]  # (node, scan cursor) still to finish
    run_ids: dict[str, str] | None  # each primary's run id when the sweep began
    objects: int = 0
    nbytes: int = 0
    delta: list[int] = field(default_factory=lambda: [0, 0])  # our writes since it began


class ServerCounts(NamedTuple):
    """This scope's objects and payload bytes, and the server's memory (summed over the
    primaries) as of the last pass that read it."""

    objects: int
    nbytes: int
    capacity_bytes: int  # maxmemory; 0 = unlimited (on any primary)
    used_memory: int
    evicted_keys: int


class Reconciler:
    """The counts of one backend's scope (see the module docstring). ``run_pass(client)`` runs
    inside the backend's call runner, which counts and logs its errors; ``execute(op, pipe)``
    runs a pipeline the same way the backend's other calls do. Thread-safe; passes themselves
    are serialized by the caller."""

    def __init__(
        self,
        namespace: str,
        address: str,
        cluster: bool,
        execute: Callable[[str, Any], list[Any]],
    ) -> None:
        self._namespace = namespace
        self._address = address
        self._cluster = cluster
        self._execute = execute
        self._lock = threading.Lock()  # everything below
        self._base = (0, 0)  # (objects, bytes) of the last complete sweep
        self._delta = [0, 0]  # written - deleted by us since that sweep began
        self.sweep: Sweep | None = None
        self._no_touch: bool | None = None  # does the server take CLIENT NO-TOUCH (unknown)
        self._server = (0, 0, 0)  # capacity_bytes, used_memory, evicted_keys

    def add(self, objects: int, nbytes: int) -> None:
        """This process wrote (new objects) or deleted (negative) on the server."""
        with self._lock:
            self._delta[0] += objects
            self._delta[1] += nbytes
            if self.sweep is not None:
                self.sweep.delta[0] += objects
                self.sweep.delta[1] += nbytes

    def reset(self) -> None:
        """The scope was cleared: nothing left, no sweep going on."""
        with self._lock:
            self._base, self._delta, self.sweep = (0, 0), [0, 0], None

    def drop_sweep(self) -> None:
        """The sweep going on (if any) cannot go on: the next pass starts over."""
        with self._lock:
            self.sweep = None

    def counts(self) -> ServerCounts:
        with self._lock:
            return ServerCounts(
                max(0, self._base[0] + self._delta[0]),
                max(0, self._base[1] + self._delta[1]),
                *self._server,
            )

    def run_pass(self, client: Any) -> bool:
        """One pass of the sweep (a new one if none is going on); True (for the call runner:
        answered)."""
        with self._lock:
            sweep = self.sweep
        if sweep is None:
            # the servers' run ids before the first SCAN: see the check below
            started = Sweep([(n, 0) for n in self._primaries(client)], self._run_ids(client))
            with self._lock:
                sweep = self.sweep = started
        budget = RECONCILE_MAX_KEYS
        try:
            while sweep.todo and budget > 0:
                node, cursor = sweep.todo[0]
                cursor, found = self._scan(client, node, cursor)
                budget -= len(found)
                sweep.objects += len(found)
                sweep.nbytes += self._payload_bytes(client, node, found)
                sweep.todo[0] = (node, cursor)
                if cursor == 0:
                    sweep.todo.pop(0)
            self._read_server_info(client)
            # NOTE: a server that restarted since the sweep began lost what the sweep counted
            # there, and its cursor now walks another keyspace: redis-py reconnects a pooled
            # connection on its own, so this is no outage to us; the run id says it
            restarted = self._run_ids(client) != sweep.run_ids
        except BaseException:
            with self._lock:
                if self.sweep is sweep:
                    self.sweep = None  # start over next time
            raise
        with self._lock:
            if self.sweep is not sweep:
                return True  # dropped meanwhile (an outage seen by another call)
            if restarted:
                self.sweep = None
            elif not sweep.todo:
                self._base = (sweep.objects, sweep.nbytes)
                self._delta = sweep.delta
                self.sweep = None
        return True

    def _primaries(self, client: Any) -> list[Any]:
        return redis_client.primaries(client, self._cluster)

    def _scan(self, client: Any, node: Any, cursor: int) -> tuple[int, list[bytes]]:
        """One page of the scope's metadata keys on ``node``."""
        return redis_client.scan(client, node, cursor, meta_pattern(self._namespace))

    def _run_ids(self, client: Any) -> dict[str, str] | None:
        """Each primary's run id (a new one at every start of the server); None where INFO
        is refused (then a restart cannot be told)."""
        ids: dict[str, str] = {}
        for node in self._primaries(client):
            try:
                info = redis_client.on(client, node, "info", "server")
            except redis.ResponseError:
                return None
            ids[getattr(node, "name", "")] = str(info.get("run_id", ""))
        return ids

    def _payload_bytes(self, client: Any, node: Any, meta_names: Sequence[bytes]) -> int:
        """STRLEN of the payloads of ``meta_names`` (on ``node``), without touching them.

        NOTE: STRLEN refreshes a key's LRU clock: a sweep would make every object it counted
        look as new as the ones written since, and allkeys-lru would then evict among them at
        random. ``CLIENT NO-TOUCH`` (Valkey / Redis 7.2+) keeps the sweep invisible to the
        eviction policy; older servers answer it with an error and are swept touching."""
        if not meta_names:
            return 0
        conn = client.get_redis_connection(node) if node is not None else client
        if self._no_touch is None:
            try:
                conn.execute_command("CLIENT", "NO-TOUCH", "OFF")
                self._no_touch = True
            except redis.ResponseError:
                self._no_touch = False
                logger.info(
                    "L3 redis %s: no CLIENT NO-TOUCH (Redis < 7.2): the idle rescan "
                    "refreshes the LRU clock of the payloads it counts",
                    self._address,
                )
        pipe = conn.pipeline(transaction=False)  # one connection: the mode covers the STRLENs
        if self._no_touch:
            pipe.execute_command("CLIENT", "NO-TOUCH", "ON")
        for name in meta_names:
            pipe.strlen(data_key_of(name))
        if self._no_touch:
            pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")
        res = self._execute("reconcile", pipe)
        return sum(r for r in (res[1:-1] if self._no_touch else res) if isinstance(r, int))

    def _read_server_info(self, client: Any) -> None:
        """maxmemory (INFO memory: also where CONFIG GET is disabled), used memory and the
        server's evicted_keys, summed over primaries; refused (ACL) sections are skipped."""
        capacity = used = evicted = 0
        unlimited = False
        for node in self._primaries(client):
            try:
                mem = redis_client.on(client, node, "info", "memory")
                stats = redis_client.on(client, node, "info", "stats")
            except redis.ResponseError:
                return
            unlimited |= int(mem.get("maxmemory", 0)) == 0
            capacity += int(mem.get("maxmemory", 0))
            used += int(mem.get("used_memory", 0))
            evicted += int(stats.get("evicted_keys", 0))
        with self._lock:
            self._server = (0 if unlimited else capacity, used, evicted)
