"""CopyStream: where the controller's KV copies run, off the compute stream.

    compute stream  ──forward──●ready──────────────wait(ev[0])─attn L0──wait(ev[1])─attn L1──
                               │                      ▲                    ▲
    load stream                └─wait(ready)─copy L0─●ev[0]──copy L1──────●ev[1]── ...

CUDA: a side ``torch.cuda.Stream`` per direction. ``mark_compute`` records where the compute
stream is (the copy must not start before the kernels that wrote, or still read, its slots);
the worker thread makes its stream wait on that mark, launches the copies and records an event
per layer. The forward makes the *compute stream* wait on layer i's event, so the host never
blocks on a copy inside the forward. Only the worker thread blocks (``synchronize``) before it
acks, so host slots stay protected until their bytes really landed.

CPU: there are no streams; the worker thread's copies are synchronous, every event is None and
every wait is a no-op, so the same controller code runs on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

Event = Any  # torch.cuda.Event on CUDA, None on CPU


class CopyStream:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def mark_compute(self) -> Event:
        """On the scheduler thread: an event at the compute stream's current position."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @contextlib.contextmanager
    def running(self, after: Event = None) -> Iterator[None]:
        """On the worker thread: copies launched inside run on this stream, after ``after``."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield

    def record(self) -> Event:
        """An event after everything launched on this stream so far (None on CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    @staticmethod
    def compute_wait(ev: Event) -> None:
        """Make the current (compute) stream wait for ``ev``; the host does not wait."""
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def synchronize(self) -> None:
        """Block this host thread until every copy launched on this stream completed (the
        worker, before it acks: host slots stay protected until their bytes landed)."""
        if self.stream is not None:
            self.stream.synchronize()
