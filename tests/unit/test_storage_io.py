"""StorageIO's idle reconcile passes: how far apart they are."""

from __future__ import annotations

import threading
import time
import types

import pytest

from hicache.storage.base import StorageBackend, StorageValue
from hicache.transfer import storage_io
from hicache.transfer.storage_io import StorageIO, reconcile_interval


def test_reconcile_interval_bounds() -> None:
    """2% of the time between the bounds: a pass cut short by a 2 s socket timeout (an outage)
    is followed by the next within RECONCILE_MAX_INTERVAL_S, not 100 s later; a quick pass
    never makes the passes run back to back."""
    assert reconcile_interval(0.0) == storage_io.RECONCILE_MIN_INTERVAL_S == 1.0
    assert reconcile_interval(0.1) == pytest.approx(5.0)
    assert reconcile_interval(2.0) == storage_io.RECONCILE_MAX_INTERVAL_S == 30.0
    assert reconcile_interval(3600.0) == 30.0


class _SlowReconcile(StorageBackend):
    """Empty store whose first reconcile pass takes ``first_pass_s`` on ``clock`` (as a pass
    that waited out a socket timeout does); later passes are quick. Records each pass."""

    def __init__(self, clock: list[float], first_pass_s: float) -> None:
        self.clock = clock
        self.first_pass_s = first_pass_s
        self.passes = 0
        self.second_pass = threading.Event()

    def reconcile(self) -> int:
        self.passes += 1
        if self.passes == 1:
            self.clock[0] += self.first_pass_s
        else:
            self.second_pass.set()
        return 0

    def batch_exists(self, keys) -> int:
        return 0

    def batch_get(self, keys) -> list[StorageValue | None]:
        return [None] * len(keys)

    def batch_set(self, keys, values, parents=None, contents=None) -> list[bool]:
        return [False] * len(keys)

    def delete(self, key: str) -> None:
        pass

    def clear(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


def test_a_slow_pass_does_not_keep_the_next_one_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backup thread, idle, runs a pass; that pass took 1,000 s by the clock (no real
    wait: the clock is moved); the next pass still comes RECONCILE_MAX_INTERVAL_S later (made
    0.1 s here), not 1,000 s / 2% later."""
    offset = [0.0]  # seconds the test moved StorageIO's clock ahead of the real one
    monkeypatch.setattr(
        storage_io, "time", types.SimpleNamespace(monotonic=lambda: time.monotonic() + offset[0])
    )
    monkeypatch.setattr(storage_io, "RECONCILE_MIN_INTERVAL_S", 0.01)
    monkeypatch.setattr(storage_io, "RECONCILE_MAX_INTERVAL_S", 0.1)
    store = _SlowReconcile(offset, first_pass_s=1000.0)
    host_pool = types.SimpleNamespace(page_size=1, storage_fingerprint=lambda: "pool")
    sio = StorageIO(store, host_pool, object_size=1, model_fingerprint="model")
    try:
        # liveness bound only: the pass is due 0.1 s after the first; uncapped, 50,000 s
        assert store.second_pass.wait(timeout=60)
    finally:
        sio.shutdown()
