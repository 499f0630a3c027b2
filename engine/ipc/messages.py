"""The messages between the split daemon's processes: requests in, replies and token chunks
out, and what the scheduler process tells the API server once it is loaded. A call (an engine
operation other than a request) travels as a ``CallReq`` holding its ``Operation``
(engine/operations.py); the scheduler process answers it with a ``Reply``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ServerArgs
from engine.front import StreamChunk
from engine.operations import Operation
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SubmitReq:
    """A prepared request (TokenizerManager.prepare), answered by a Reply with its rid."""

    call_id: int
    rid: str
    ids: list[int]
    params: SamplingParams
    namespace: str | None


@dataclass(frozen=True)
class AbortReq:
    rid: str


@dataclass(frozen=True)
class CallReq:
    """One operation, answered by a Reply with the same call_id."""

    call_id: int
    op: Operation[Any]


@dataclass(frozen=True)
class Shutdown:
    call_id: int


@dataclass(frozen=True)
class Reply:
    call_id: int
    ok: bool
    value: Any  # the result, or the exception when not ok


@dataclass(frozen=True)
class TokenOut:
    """One request's chunk; the first one of a request carries what its text needs."""

    rid: str
    chunk: StreamChunk
    start: tuple[bool, list[str]] | None = None  # (skip_special_tokens, stop strings)


@dataclass(frozen=True)
class DetokStop:
    """The scheduler has shut down: nothing more will come."""


@dataclass(frozen=True)
class SchedulerInfo:
    """What the API server needs from the loaded engine (sent with the scheduler process' ready
    signal)."""

    tokenizer: Any
    vocab_size: int
    max_context_len: int
    server_args: ServerArgs
