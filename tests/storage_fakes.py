"""A StorageBackend wrapper whose reads and writes the test holds back: blocked forever, or
released batch by batch. It wraps a real FileStorageBackend, so what it stores is real. And
``delay_writes`` / ``gate_writes``: a slow / hung store."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from hicache.storage.base import ObjectContent, StorageBackend, StorageValue, Watcher


class Gate:
    """Blocks callers until opened; ``allow(n)`` lets ``n`` calls through, ``open()`` all."""

    def __init__(self, opened: bool = True) -> None:
        self._cond = threading.Condition()
        self._open = opened
        self._credits = 0
        self.waiting = 0  # callers blocked right now
        self.passed = 0

    def wait(self) -> None:
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open or self._credits > 0)
            if not self._open:
                self._credits -= 1
            self.waiting -= 1
            self.passed += 1
            self._cond.notify_all()

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self._credits += n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False

    def wait_blocked(self, n: int = 1, timeout: float = 10.0) -> bool:
        """Until ``n`` callers are blocked in ``wait``."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting >= n, timeout)

    def wait_passed(self, n: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.passed >= n, timeout)


class GatedStorage(StorageBackend):
    """``inner`` behind two gates: ``writes`` (batch_set) and ``reads`` (batch_get)."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.medium = inner.medium
        self.writes = Gate()
        self.reads = Gate()
        self.get_calls = 0
        self.set_calls = 0

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self.inner.batch_exists(keys)

    def exists_mask(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_mask(keys)

    def batch_get(self, keys: Sequence[str]) -> list[StorageValue | None]:
        self.get_calls += 1
        self.reads.wait()
        return self.inner.batch_get(keys)

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[StorageValue],
        parents: Sequence[str | None] | None = None,
        contents: Sequence[ObjectContent | None] | None = None,
    ) -> list[bool]:
        self.set_calls += 1
        self.writes.wait()
        return self.inner.batch_set(keys, values, parents, contents)

    def watch(self, watcher: Watcher | None) -> bool:
        return self.inner.watch(watcher)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def reconcile(self) -> int:
        return self.inner.reconcile()

    def release_all(self) -> None:
        self.writes.open()
        self.reads.open()


def delay_writes(backend: StorageBackend, seconds: float) -> None:
    """A slow store: each ``batch_set`` of ``backend`` takes ``seconds`` longer (patched on the
    instance, so a backend an Engine built itself slows down too)."""
    real = backend.batch_set

    def batch_set(
        keys: Sequence[str],
        values: Sequence[StorageValue],
        parents: Sequence[str | None] | None = None,
        contents: Sequence[ObjectContent | None] | None = None,
    ) -> list[bool]:
        time.sleep(seconds)
        return real(keys, values, parents, contents)

    backend.batch_set = batch_set  # type: ignore[method-assign]


def gate_writes(backend: StorageBackend) -> Gate:
    """A hung store: each ``batch_set`` of ``backend`` waits for the returned (closed) gate
    (patched on the instance, like ``delay_writes``)."""
    gate = Gate(opened=False)
    real = backend.batch_set

    def batch_set(
        keys: Sequence[str],
        values: Sequence[StorageValue],
        parents: Sequence[str | None] | None = None,
        contents: Sequence[ObjectContent | None] | None = None,
    ) -> list[bool]:
        gate.wait()
        return real(keys, values, parents, contents)

    backend.batch_set = batch_set  # type: ignore[method-assign]
    return gate
