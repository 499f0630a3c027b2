"""One recorded call: a Generate stream checked for its shape (one ``complete``, a finish
reason, usage equal to the tokens streamed, the length asked for) and its answer kept for the
reference check, or a unary admin call."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.client import HicacheClient
from tools.soaklib.config import STREAM_TIMEOUT_S
from tools.soaklib.recorder import Call, Recorder, rpc_code, rpc_details


@dataclass
class StreamResult:
    code: str
    ids: list[int] = field(default_factory=list)
    finish: str = ""
    abort_message: str = ""
    completes: int = 0
    first: float | None = None
    end: float = 0.0


FINISH = {0: "UNSPECIFIED", 1: "STOP", 2: "LENGTH", 3: "ABORT"}


def stream_generate(
    rec: Recorder,
    c: HicacheClient,
    ids: list[int],
    variant: str,
    allowed: set[str],
    finishes: set[str],
    *,
    rid: str = "",
    ns: str = "",
    timeout: float = STREAM_TIMEOUT_S,
    cancel_after: int | None = None,
    on_first: Callable[[], bool] | None = None,
    **sampling: Any,
) -> StreamResult:
    """One Generate stream, recorded; checks it ends with exactly one ``complete`` whose
    finish reason is in ``finishes`` and whose usage agrees with the tokens streamed.
    ``on_first`` runs at the first response; the stream is cancelled when it returns True."""
    t0 = time.monotonic()
    res = StreamResult("OK")
    usage = None
    chunks = 0
    try:
        call = c.generate(ids, request_id=rid, namespace=ns, timeout=timeout, **sampling)
        for r in call:
            if res.first is None:
                res.first = time.monotonic()
                if on_first is not None and on_first():
                    call.cancel()
            if r.HasField("chunk"):
                chunks += 1
                res.ids += r.chunk.token_ids
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
            else:
                res.completes += 1
                res.finish = FINISH.get(r.complete.finish_reason, "?")
                res.abort_message = r.complete.abort_message
                usage = r.complete.usage
    except grpc.RpcError as e:
        res.code = rpc_code(e)
        res.abort_message = rpc_details(e)
    res.end = time.monotonic()
    first_token = res.first if res.ids else None
    rec.record(
        Call(
            "Generate",
            variant,
            res.code,
            t0,
            res.end,
            ttft=(first_token - t0) if first_token and variant == "plain" else None,
            first=res.first,
        ),
        allowed | {"OK"},
        res.abort_message,
    )
    rec.answer(
        variant,
        ids,
        sampling,
        res.ids,
        code=res.code,
        finish=res.finish,
        rid=rid,
        namespace=ns,
        cached=usage_tiers(usage),
        t0=t0,
        t1=res.end,
    )
    if res.code == "OK":
        if res.completes != 1:
            rec.violate("stream shape", f"{variant}: {res.completes} complete messages")
        elif res.finish not in finishes:
            rec.violate("unexpected finish", f"{variant}: {res.finish} {res.abort_message!r}")
        elif usage is not None and usage.completion_tokens != len(res.ids):
            rec.violate(
                "usage",
                f"{variant}: completion_tokens {usage.completion_tokens} "
                f"!= {len(res.ids)} streamed",
            )
        mx = sampling.get("max_new_tokens")
        if mx is not None and (
            len(res.ids) > mx
            or (res.finish == "LENGTH" and sampling.get("ignore_eos") and len(res.ids) != mx)
        ):
            rec.violate("length", f"{variant}: {len(res.ids)} tokens for max_new_tokens {mx}")
    return res


def usage_tiers(usage: Any) -> tuple[int, int, int, int] | None:
    """(l1, l2, l3 cached tokens, prompt tokens) of a Usage message; None for None."""
    if usage is None:
        return None
    t = usage.cached_tokens_per_tier
    return (t.l1, t.l2, t.l3, usage.prompt_tokens)


def unary(
    rec: Recorder, rpc: str, fn: Callable[[], Any], allowed: Iterable[str] = (), variant: str = ""
) -> Any:
    """One unary admin call, recorded; its response or None."""
    t0 = time.monotonic()
    try:
        out = fn()
        code, detail = "OK", ""
    except grpc.RpcError as e:
        out, code, detail = None, rpc_code(e), rpc_details(e)
    rec.record(Call(rpc, variant or rpc, code, t0, time.monotonic()), {"OK", *allowed}, detail)
    return out
