"""StorageIO: the L3 side of the HiCacheController, two threads beside the copy workers.

    tree --backup(job)----> backup_queue ---> backup thread: keys, skip stored, read host
         (host slots protected)                  slots, batch_set --> ack_backup_queue
    tree --prefetch(op)---> prefetch_queue -> prefetch thread: batch_get -> host slots, object
         (host slots allocated+protected)        by object (op.completed grows) --> ack_prefetch
    tree --terminate(op)    (scheduler thread) takes the objects landed so far; the thread stops
                            at its next batch

NOTE: neither thread touches device memory or an allocator: host protections are released, and
the tree updated, on the scheduler thread when it drains the acks (``HiRadixCache.check``). A
backend that blocks therefore only delays L3; device eviction, loads and decode go on.

Counting: a backend counts its own I/O trouble in its ``errors`` (one per failed call) and says
which objects it did not store (False from ``batch_set``); here ``backup_failed_objects`` counts
those objects and ``backup_errors`` / ``prefetch_errors`` only what the backend could not count
(it raised), so that the sum of the two layers' errors counts each failure once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.storage.base import ObjectContent, StorageBackend, object_keys, prefix_hash_seed

log = logging.getLogger(__name__)

BACKUP_BATCH_OBJECTS = 32  # objects per batch_set
# The backup thread, when idle, lets the backend re-check its index against the store (and so
# its objects / bytes stats): at most 2% of the time (a pass over a large store takes a while),
# at most once a second, and at least every RECONCILE_MAX_INTERVAL_S: a pass that took long
# because it waited out a socket timeout (an outage) must not push the next one minutes away
# (2 s / 2% = 100 s of stale stats after the server is back)
RECONCILE_MIN_INTERVAL_S = 1.0
RECONCILE_MAX_INTERVAL_S = 30.0
RECONCILE_MAX_SHARE = 0.02
PREFETCH_BATCH_OBJECTS = 4  # objects per batch_get: the granularity of prefetch progress


@dataclass
class BackupJob:
    """Back up objects ``first .. first + num - 1`` of one token path to L3."""

    namespace: str | None
    path_tokens: list[int]  # the path from the root up to the end of the last object
    first: int  # index of the first object to store
    host_indices: torch.Tensor  # [num * object_size] int64 host slots (protected)
    node_ids: list[int]  # nodes whose objects these are (``in_storage`` once all stored)
    stored: int = 0  # objects stored (or already present)
    failed: int = 0
    # set by the backup thread: the path's object keys from the root (``first + num``), and
    # the indices of the objects it found stored or stored (what the ack tells L3's index)
    keys: list[str] = field(default_factory=list)
    landed: list[int] = field(default_factory=list)


@dataclass
class PrefetchOperation:
    """Read ``keys`` (consecutive objects of one chain) into ``host_indices``."""

    req_id: str
    keys: list[str]
    host_indices: torch.Tensor  # [len(keys) * object_size] int64 host slots (protected)
    start_time: float = field(default_factory=time.monotonic)
    completed: int = 0  # leading objects whose bytes are in host memory
    terminated: bool = False  # the tree took ``completed``; the thread stops
    missed: bool = False  # the backend lost an object of the chain
    done: bool = False  # the thread is finished with it (set before the ack)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def complete(self) -> bool:
        return self.completed == len(self.keys)

    def terminate(self) -> int:
        """Stop the read; returns the leading objects landed (final: never grows after)."""
        with self.lock:
            self.terminated = True
            return self.completed


class StorageIO:
    """Backup and prefetch threads over one StorageBackend for one host pool."""

    def __init__(
        self,
        storage: StorageBackend,
        host_pool: MHATokenToKVPoolHost,
        object_size: int,
        model_fingerprint: str,
        notify: Callable[[], None] | None = None,
    ) -> None:
        if object_size % host_pool.page_size:
            raise ValueError(
                f"L3 object size {object_size} is not a multiple of the page size "
                f"{host_pool.page_size}"
            )
        self.storage = storage
        self.host_pool = host_pool
        self.object_size = object_size
        self.fingerprint = model_fingerprint + "|" + host_pool.storage_fingerprint()
        self.notify = notify
        self.backup_queue: queue.Queue[BackupJob | None] = queue.Queue()
        self.prefetch_queue: queue.Queue[PrefetchOperation | None] = queue.Queue()
        self.ack_backup_queue: queue.Queue[BackupJob] = queue.Queue()
        self.ack_prefetch_queue: queue.Queue[PrefetchOperation] = queue.Queue()
        # objects: L3 objects; *_errors: jobs / operations that raised (see the module docstring)
        self.stats = {
            "backup_objects": 0,
            "backup_skipped_present": 0,
            "backup_failed_objects": 0,
            "backup_errors": 0,
            "prefetch_objects": 0,
            "prefetch_errors": 0,
            "prefetch_misses": 0,
        }
        self._pending = 0  # jobs + operations handed to a thread and not yet finished
        self._pending_objects = 0  # objects of the backup jobs among them
        self._reconcile_interval = RECONCILE_MIN_INTERVAL_S
        self._last_reconcile = time.monotonic()
        self._idle = threading.Condition()
        self._threads = [
            threading.Thread(target=self._backup_worker, name="hicache-l3-backup", daemon=True),
            threading.Thread(target=self._prefetch_worker, name="hicache-l3-prefetch", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    # ---- keys --------------------------------------------------------------------------------
    def keys(self, token_ids: list[int], namespace: str | None) -> list[str]:
        """One key per full object of ``token_ids`` (a path from the root)."""
        return object_keys(
            token_ids, self.object_size, prefix_hash_seed(self.fingerprint, namespace)
        )

    # ---- producer side (scheduler thread) ----------------------------------------------------
    def backup(self, job: BackupJob) -> None:
        """Queue ``job``; after ``shutdown`` it is acknowledged at once as failed (the caller
        that shut down counted what was still waiting)."""
        if self._closed:
            job.failed = self._num_objects(job) - job.stored
            self.stats["backup_failed_objects"] += job.failed
            self.ack_backup_queue.put(job)
            return
        self._start(self._num_objects(job))
        self.backup_queue.put(job)

    def prefetch(self, op: PrefetchOperation) -> None:
        self._start()
        self.prefetch_queue.put(op)

    def drain_backup_acks(self) -> list[BackupJob]:
        return _drain(self.ack_backup_queue)

    def drain_prefetch_acks(self) -> list[PrefetchOperation]:
        return _drain(self.ack_prefetch_queue)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued backup and prefetch finished (acks not yet drained)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def pending(self) -> int:
        with self._idle:
            return self._pending

    def pending_objects(self) -> int:
        """Objects of the queued and running backup jobs."""
        with self._idle:
            return self._pending_objects

    def shutdown(self, timeout: float = 60.0, warn: bool = True) -> bool:
        """Finish queued backups (a backend that hangs gets ``timeout`` seconds), stop. Logs
        how many objects were not stored when they did not finish (unless ``warn`` is False:
        the caller logged them)."""
        if self._closed:
            return True
        finished = self.wait_idle(timeout)
        if not finished and warn:
            with self._idle:
                jobs, objects = self._pending, self._pending_objects
            log.warning(
                "L3: %d backups/prefetches (%d objects to store) still pending at "
                "shutdown after %.0f s; those objects are not stored",
                jobs,
                objects,
                timeout,
            )
        self._closed = True
        self.backup_queue.put(None)
        self.prefetch_queue.put(None)
        for t in self._threads:
            t.join(timeout=1.0 if not finished else 10.0)
        return finished

    # ---- workers -----------------------------------------------------------------------------
    def _num_objects(self, job: BackupJob) -> int:
        return len(job.host_indices) // self.object_size

    def _start(self, objects: int = 0) -> None:
        with self._idle:
            self._pending += 1
            self._pending_objects += objects

    def _finish(self, objects: int = 0) -> None:
        with self._idle:
            self._pending -= 1
            self._pending_objects -= objects
            self._idle.notify_all()
        if self.notify is not None:
            self.notify()

    def _backup_worker(self) -> None:
        while True:
            try:
                job = self.backup_queue.get(timeout=self._reconcile_interval)
            except queue.Empty:
                self._reconcile()
                continue
            if job is None:
                return
            num = self._num_objects(job)
            try:
                if self._closed:  # shut down before its turn (the store hung): not stored
                    job.failed = num - job.stored
                    self.stats["backup_failed_objects"] += job.failed
                else:
                    self._store(job)
            except Exception:
                log.exception("L3 backup failed")
                self.stats["backup_errors"] += 1
                self.stats["backup_failed_objects"] += num - job.stored - job.failed
                job.failed = num - job.stored
            self.ack_backup_queue.put(job)
            self._finish(num)

    def _reconcile(self) -> None:
        """Idle: let the backend drop what vanished behind our back (off the scheduler)."""
        if time.monotonic() - self._last_reconcile < self._reconcile_interval:
            return
        t0 = time.monotonic()
        try:
            self.storage.reconcile()
        except Exception:
            log.exception("L3 reconcile failed")
        self._last_reconcile = time.monotonic()
        self._reconcile_interval = reconcile_interval(self._last_reconcile - t0)

    def _store(self, job: BackupJob) -> None:
        S = self.object_size
        seed = prefix_hash_seed(self.fingerprint, job.namespace)
        chain = object_keys(job.path_tokens, S, seed)  # [first + num] keys, root first
        job.keys = chain
        num = len(job.host_indices) // S
        keys = chain[job.first : job.first + num]
        parents = [chain[job.first + i - 1] if job.first + i > 0 else None for i in range(num)]
        present = self.storage.exists_mask(keys)
        todo = [i for i in range(num) if not present[i]]
        job.landed += [job.first + i for i in range(num) if present[i]]
        job.stored += num - len(todo)
        self.stats["backup_skipped_present"] += num - len(todo)
        for start in range(0, len(todo), BACKUP_BATCH_OBJECTS):
            batch = todo[start : start + BACKUP_BATCH_OBJECTS]
            # [2, L, S, H, D] (layer_first) / [2, S, L, H, D] (page_first), contiguous, on host
            values = [
                self.host_pool.get_flat_data(job.host_indices[i * S : (i + 1) * S]) for i in batch
            ]
            at = [(job.first + i) * S for i in batch]
            ok = self.storage.batch_set(
                [keys[i] for i in batch],
                values,
                [parents[i] for i in batch],
                [ObjectContent.of(job.namespace, job.path_tokens[a : a + S]) for a in at],
            )
            job.landed += [job.first + i for i, o in zip(batch, ok) if o]
            job.stored += sum(ok)
            job.failed += len(ok) - sum(ok)
            self.stats["backup_objects"] += sum(ok)
            # NOTE: not errors: the backend counted its trouble itself (once per call)
            self.stats["backup_failed_objects"] += len(ok) - sum(ok)

    def _prefetch_worker(self) -> None:
        while (op := self.prefetch_queue.get()) is not None:
            try:
                self._read(op)
            except Exception:
                log.exception("L3 prefetch failed")
                self.stats["prefetch_errors"] += 1
            op.done = True
            self.ack_prefetch_queue.put(op)
            self._finish()

    def _read(self, op: PrefetchOperation) -> None:
        S = self.object_size
        for start in range(0, len(op.keys), PREFETCH_BATCH_OBJECTS):
            if op.terminated:
                return
            values = self.storage.batch_get(op.keys[start : start + PREFETCH_BATCH_OBJECTS])
            landed = 0
            for i, value in enumerate(values):
                if value is None:
                    break
                host = op.host_indices[(start + i) * S : (start + i + 1) * S]
                expected = self.host_pool.get_flat_data_shape(len(host))
                data = (
                    value
                    if isinstance(value, torch.Tensor)
                    else torch.frombuffer(bytearray(value), dtype=self.host_pool.store_dtype)
                )
                data = data.view(self.host_pool.store_dtype)
                if data.numel() != _numel(expected):
                    log.warning(
                        "L3 object %s has %d elements, expected %s; treated as a miss",
                        op.keys[start + i],
                        data.numel(),
                        tuple(expected),
                    )
                    self.storage.delete(op.keys[start + i])
                    break
                self.host_pool.set_from_flat_data(host, data.reshape(expected))
                landed += 1
            with op.lock:
                if not op.terminated:
                    op.completed += landed
            self.stats["prefetch_objects"] += landed
            if landed < len(values):
                op.missed = True
                self.stats["prefetch_misses"] += 1
                return


def reconcile_interval(took_s: float) -> float:
    """Seconds from the end of a reconcile pass that took ``took_s`` to the next one."""
    return min(
        RECONCILE_MAX_INTERVAL_S, max(RECONCILE_MIN_INTERVAL_S, took_s / RECONCILE_MAX_SHARE)
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
