"""Overlap scheduling (SGLang's future token ids).

The forward of step N runs on the ``ForwardWorker`` thread while the scheduler thread builds
step N+1 and handles step N's results once N+1 is on its way:

    scheduler:  build N | build N+1 | results N | build N+2 | results N+1 | ...
    worker:             | forward N ........... | forward N+1 ........... | ...

Step N+1 is built before step N's tokens are known. A decode input whose token is still being
sampled is written as ``-slot``: the worker writes each batch's sampled tokens into
``token_map[slot]`` and swaps those placeholders for them before the next forward (batches run
in launch order, so the producer has always finished). A request that finished at step N
(EOS, a stop string) is known only after N+1 was built: it runs one step more, and that token
is dropped. The worker only runs forwards; every pool, tree and request structure stays on the
scheduler thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.request import Req

if TYPE_CHECKING:
    from engine.runtime.model_runner import ModelRunner


@dataclass
class Launched:
    """A batch handed to the forward: its requests, the KV positions each one writes, and the
    sampled token ids (``future``)."""

    reqs: list[Req]
    lens: list[int]  # KV positions written per request (extend length; 1 for decode)
    is_extend: bool
    chunked: Req | None = None  # the request whose (non-final) chunk this extend runs
    future: Future = field(default_factory=Future)


class ForwardWorker:
    """Runs launched forwards (and sampling) in order on its own thread."""

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        # NOTE: a slot is read at most one batch after the batch that wrote it: 3 batches of room
        self.capacity = 3 * max_batch + 1
        self.token_map = torch.zeros(self.capacity, dtype=torch.int64, device=runner.device)
        self._next = 1  # slot 0 is never used: -0 is no placeholder
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hicache-forward", daemon=True)
        self._thread.start()

    def reserve(self, n: int) -> int:
        """First of ``n`` consecutive token_map slots for one batch's sampled tokens."""
        if self._next + n > self.capacity:
            self._next = 1
        start, self._next = self._next, self._next + n
        return start

    def submit(self, fb: ForwardBatch, reqs: Sequence[Any], slot: int, fut: Future) -> None:
        self._jobs.put((fb, list(reqs), slot, fut))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30.0)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fb, reqs, slot, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.run(fb, reqs, slot))
            except BaseException as e:  # noqa: BLE001 - raised on the scheduler thread
                fut.set_exception(e)

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, reqs: Sequence[Any], slot: int) -> list[int]:
        if fb.forward_mode.is_decode():
            ids = fb.input_ids
            fb.input_ids = torch.where(ids < 0, self.token_map[(-ids).clamp(min=0)], ids)
        next_ids = self.runner.sample(self.runner.forward(fb), list(reqs))
        self.token_map[slot : slot + len(reqs)] = next_ids
        return next_ids.tolist()  # the one host sync per step (on this thread)
