"""HiCacheController: the only code that moves KV bytes between tiers.

    tree --write(device_indices)--> write_queue --start_writing--> write worker: D->H all
         (host slots allocated+protected)                          layers --> ack_write_queue
    tree --load(host_indices)-----> load_queue --start_loading---> load worker: H->D layer by
         (device slots allocated, host protected)                  layer, LayerDoneCounter ticks
                                                                   --> ack_load_queue
    tree --backup / prefetch------> StorageIO (hicache.transfer.storage_io): L2 -> L3 and L3 -> L2 on
                                    their own threads, reading / writing host slots only

NOTE: a device->host write is acknowledged as soon as its host bytes landed; L3 never holds a
device page. Worker threads only copy bytes: host protection is released, and every allocator
is touched, on the caller's (scheduler) thread in ``drain_write_acks`` / ``drain_load_acks``.
Every ack calls ``notify`` so a scheduler blocked on its inbox wakes up.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.storage.base import StorageBackend
from hicache.transfer.copy_stream import CopyStream
from hicache.transfer.storage_io import StorageIO

log = logging.getLogger(__name__)

# Longest a held load waits for its release (a safety net: the reader releases it right after
# its forward; correctness never depends on it, the copy only writes device slots nobody reads).
HOLD_TIMEOUT_S = 5.0


class LayerDoneCounter:
    """Per-layer progress of one load batch.

    ``increment(ev)``: layer i's copy was issued (on CPU it is already done; on CUDA ``ev`` marks
    its end on the load stream). ``wait_until(i)``: the host waits until layer i was issued, then
    the compute stream waits on its event: no host sync on the copy itself. ``finish()``: every
    byte landed (the worker synchronized), so the load may be acked and its host slots released.
    ``on_wait``: called before any wait (the controller releases held loads: a waiter needs the
    bytes now).
    """

    def __init__(
        self, num_layers: int, done: int = 0, on_wait: Callable[[], None] | None = None
    ) -> None:
        self.num_layers = num_layers
        self.on_wait = on_wait
        self._done = done
        self._finished = done >= num_layers
        self._events: list[Any] = []
        self._cond = threading.Condition()

    @property
    def done(self) -> int:
        with self._cond:
            return self._done

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._finished

    def increment(self, event: Any = None) -> None:
        with self._cond:
            self._events.append(event)
            self._done += 1
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._done = self.num_layers
            self._finished = True
            self._cond.notify_all()

    def wait_until(self, layer_id: int, timeout: float | None = None) -> bool:
        if self.on_wait is not None:
            self.on_wait()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._done > layer_id, timeout)
            event = self._events[layer_id] if ok and layer_id < len(self._events) else None
        if ok:
            CopyStream.compute_wait(event)
        return ok

    def wait_finished(self, timeout: float | None = None) -> bool:
        if self.on_wait is not None:
            self.on_wait()
        with self._cond:
            return self._cond.wait_for(lambda: self._finished, timeout)


@dataclass
class CacheOperation:
    host_indices: torch.Tensor  # [n] int64 host slots
    device_indices: torch.Tensor  # [n] int64 device slots
    node_ids: list[int]
    priority: int = 0
    ok: bool = True
    ready: Any = None  # CUDA: compute-stream event the copy must start after (CopyStream)

    @staticmethod
    def merge(ops: list[CacheOperation]) -> CacheOperation:
        if len(ops) == 1:
            return ops[0]
        return CacheOperation(
            torch.cat([o.host_indices for o in ops]),
            torch.cat([o.device_indices for o in ops]),
            [i for o in ops for i in o.node_ids],
            max(o.priority for o in ops),
        )


class HiCacheController:
    """Owns the D<->H copy workers and the L3 backup; see the module docstring."""

    def __init__(
        self,
        device_pool: MHATokenToKVPool,
        host_pool: MHATokenToKVPoolHost,
        device_allocator: TokenToKVPoolAllocator,
        io_backend: str = "kernel",
        layer_num: int | None = None,
        storage: StorageBackend | None = None,
        model_fingerprint: str = "",
        layer_hook: Callable[[int], None] | None = None,
        storage_object_size: int | None = None,
    ) -> None:
        self.device_pool, self.host_pool = device_pool, host_pool
        self.device_allocator = device_allocator
        self.io_backend = io_backend
        self.layer_num = layer_num if layer_num is not None else host_pool.layer_num
        self.page_size = host_pool.page_size
        self.storage = storage
        self.model_fingerprint = model_fingerprint
        self.notify: Callable[[], None] | None = None  # set by the owner (scheduler wake-up)
        self.storage_io: StorageIO | None = None
        if storage is not None:
            self.storage_io = StorageIO(
                storage,
                host_pool,
                storage_object_size or 64,
                model_fingerprint,
                notify=self._notify,
            )
        self.layer_hook = layer_hook  # test instrumentation: called after each loaded layer
        self.bytes_per_token = device_pool.bytes_per_token()
        # CUDA: one side stream per direction, so copies overlap the forward (CPU: no-ops)
        self.write_stream = CopyStream(device_pool.device)
        self.load_stream = CopyStream(device_pool.device)
        self.write_queue: list[CacheOperation] = []
        self.load_queue: list[CacheOperation] = []
        self.ack_write_queue: queue.Queue[CacheOperation] = queue.Queue()
        self.ack_load_queue: queue.Queue[CacheOperation] = queue.Queue()
        self.current_load = LayerDoneCounter(self.layer_num, done=self.layer_num)
        # loads not finished yet, oldest first (scheduler thread only): see ``pending_loads``
        self._loads: list[tuple[CacheOperation, LayerDoneCounter]] = []
        self._held = False  # the load worker waits before its next job: see ``start_loading``
        self.stats = {"bytes_d2h": 0, "bytes_h2d": 0, "errors": 0}
        self._inflight_writes = 0
        self._inflight_loads = 0
        self._idle = threading.Condition()
        self._write_jobs: queue.Queue[CacheOperation | None] = queue.Queue()
        self._load_jobs: queue.Queue[tuple[CacheOperation, LayerDoneCounter] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_worker, name="hicache-write", daemon=True),
            threading.Thread(target=self._load_worker, name="hicache-load", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    # ---- writes: device -> host ---------------------------------------------------------------
    def write(
        self, device_indices: torch.Tensor, node_id: int, priority: int = 0
    ) -> torch.Tensor | None:
        """Allocate and protect host slots for ``device_indices`` and queue the copy; None when
        the host pool is full (the caller may evict host and retry)."""
        host_indices = self.host_pool.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.host_pool.protect(host_indices)
        self.write_queue.append(
            CacheOperation(host_indices, device_indices.clone(), [node_id], priority)
        )
        return host_indices

    def start_writing(self) -> None:
        """Hand every queued write to the worker as one merged copy."""
        if not self.write_queue:
            return
        op = CacheOperation.merge(self.write_queue)
        op.ready = self.write_stream.mark_compute()  # after the kernels that wrote this KV
        self.write_queue = []  # only now: if the above raised, the next call starts them
        with self._idle:
            self._inflight_writes += 1
        self._write_jobs.put(op)

    def drain_write_acks(self) -> list[CacheOperation]:
        """Finished writes (their host protection released here, on the caller's thread)."""
        return self._drain(self.ack_write_queue)

    # ---- loads: host -> device -------------------------------------------------------------
    def load(
        self, host_indices: torch.Tensor, node_id: int, priority: int = 0
    ) -> torch.Tensor | None:
        """Allocate device slots for ``host_indices`` and queue the copy; None when the device
        pool has no room (the caller evicts and retries)."""
        device_indices = self.device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.host_pool.protect(host_indices)
        self.load_queue.append(CacheOperation(host_indices, device_indices, [node_id], priority))
        return device_indices

    def start_loading(self, hold: bool = False) -> LayerDoneCounter:
        """Hand every queued load to the worker as one batch; returns its layer counter, which
        also becomes ``current_load`` for ``wait_layer``.

        ``hold``: the worker copies nothing until ``release_loads`` (or anyone waits on a load,
        or HOLD_TIMEOUT_S passed). For a reader that reads the loading KV from host memory in
        place (``pending_loads``): on a CPU the copy only competes with that reader's forward
        for the same cores and memory bandwidth, so it goes after it."""
        if not self.load_queue:
            return self.current_load
        op = CacheOperation.merge(self.load_queue)
        op.ready = self.load_stream.mark_compute()  # after kernels still using these slots
        counter = LayerDoneCounter(self.layer_num, on_wait=self.release_loads)
        # NOTE: nothing above changed any state: if it raised, the queue is intact for
        # cancel_queued_loads
        self.load_queue = []
        self.current_load = counter
        self._loads = [(o, c) for o, c in self._loads if not c.finished] + [(op, counter)]
        with self._idle:
            self._inflight_loads += 1
            self._held = self._held or hold
        self._load_jobs.put((op, counter))
        return counter

    def cancel_queued_loads(self) -> int:
        """Drop the loads queued since the last ``start_loading`` (their caller failed before
        starting them): their device slots are freed, their host slots unprotected. Returns
        the number of device slots freed."""
        ops, self.load_queue = self.load_queue, []
        for op in ops:
            self.host_pool.release(op.host_indices)
            self.device_allocator.free(op.device_indices)
        return sum(len(op.device_indices) for op in ops)

    def release_loads(self) -> None:
        """Let the load worker copy held loads (``start_loading(hold=True)``)."""
        with self._idle:
            if self._held:
                self._held = False
                self._idle.notify_all()

    def pending_loads(self) -> list[CacheOperation]:
        """Started loads whose bytes have not all landed, oldest first: their device slots may
        not hold their KV yet; their host slots do (protected until the ack is drained)."""
        self._loads = [(o, c) for o, c in self._loads if not c.finished]
        return [o for o, _ in self._loads]

    def wait_layer(self, layer_id: int, timeout: float | None = None) -> bool:
        """Model-runner hook: block until layer ``layer_id`` of every started load landed
        (loads run FIFO, so the newest batch's layer implies all earlier batches)."""
        return self.current_load.wait_until(layer_id, timeout)

    def drain_load_acks(self) -> list[CacheOperation]:
        return self._drain(self.ack_load_queue)

    # ---- sync points -------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every started device<->host write and load finished (L3 backups and
        prefetches are not waited for: see ``wait_storage_idle``)."""
        self.release_loads()
        with self._idle:
            return self._idle.wait_for(
                lambda: self._inflight_writes == 0 and self._inflight_loads == 0, timeout
            )

    def shutdown(self) -> None:
        """Flush queued writes, finish in-flight work (pending storage writes), stop workers."""
        if self._closed:
            return
        self.start_writing()
        self.start_loading()
        self.wait_idle(timeout=60)
        if self.storage_io is not None:
            self.storage_io.shutdown()
        self._closed = True
        self._write_jobs.put(None)
        self._load_jobs.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def attach_storage(self, storage: StorageBackend, object_size: int) -> StorageIO:
        """Start L3 I/O over ``storage`` (run-time attach; none may be attached)."""
        if self.storage_io is not None:
            raise RuntimeError("an L3 backend is already attached")
        self.storage = storage
        self.storage_io = StorageIO(
            storage, self.host_pool, object_size, self.model_fingerprint, notify=self._notify
        )
        return self.storage_io

    def detach_storage(self, timeout: float) -> bool:
        """Stop L3 I/O once queued backups and prefetches finished; False (still attached)
        when they did not within ``timeout``: their threads still use host slots."""
        if self.storage_io is None:
            return True
        if not self.storage_io.wait_idle(timeout):
            return False
        self.storage_io.shutdown(timeout=0.0)
        self.storage_io, self.storage = None, None
        return True

    def wait_storage_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued L3 backup and prefetch finished (acks not drained)."""
        return self.storage_io is None or self.storage_io.wait_idle(timeout)

    def _notify(self) -> None:
        if self.notify is not None:
            self.notify()

    # ---- workers -----------------------------------------------------------------------------
    def _drain(self, q: queue.Queue[CacheOperation]) -> list[CacheOperation]:
        out: list[CacheOperation] = []
        while True:
            try:
                op = q.get_nowait()
            except queue.Empty:
                return out
            self.host_pool.release(op.host_indices)
            out.append(op)

    def _done(self, kind: str) -> None:
        with self._idle:
            if kind == "write":
                self._inflight_writes -= 1
            else:
                self._inflight_loads -= 1
            self._idle.notify_all()
        self._notify()

    def _write_worker(self) -> None:
        while (op := self._write_jobs.get()) is not None:
            try:
                with self.write_stream.running(after=op.ready):
                    self.host_pool.backup_from_device_all_layer(
                        self.device_pool, op.host_indices, op.device_indices, self.io_backend
                    )
                self.write_stream.synchronize()  # host bytes complete before the ack
                self.stats["bytes_d2h"] += len(op.host_indices) * self.bytes_per_token
            except Exception:
                log.exception("device->host write failed")
                self.stats["errors"] += 1
                op.ok = False
                self.write_stream.synchronize()  # nothing still in flight once acked
            self.ack_write_queue.put(op)
            self._done("write")

    def _load_worker(self) -> None:
        while (job := self._load_jobs.get()) is not None:
            op, counter = job
            with self._idle:  # a held load (start_loading) waits for its reader
                if not self._idle.wait_for(lambda: not self._held, HOLD_TIMEOUT_S):
                    log.warning(
                        "a held host->device load was not released in %.0f s; copying it",
                        HOLD_TIMEOUT_S,
                    )
                    self._held = False
            try:
                with self.load_stream.running(after=op.ready):
                    # CUDA kernels read the host slot ids from device memory: move them once
                    host_indices = (
                        op.host_indices.to(self.device_pool.device)
                        if self.io_backend == "kernel"
                        else op.host_indices
                    )
                    for layer_id in range(self.layer_num):
                        self.host_pool.load_to_device_per_layer(
                            self.device_pool,
                            host_indices,
                            op.device_indices,
                            layer_id,
                            self.io_backend,
                        )
                        counter.increment(self.load_stream.record())
                        if self.layer_hook is not None:
                            self.layer_hook(layer_id)
                # the forward waits per layer on the GPU; the ack (host slots released) waits here
                self.load_stream.synchronize()
                self.stats["bytes_h2d"] += len(op.host_indices) * self.bytes_per_token
            except Exception:
                log.exception("host->device load failed")
                self.stats["errors"] += 1
                op.ok = False
                self.load_stream.synchronize()
            counter.finish()
            self.ack_load_queue.put(op)
            self._done("load")
