"""Pieces of tools/bench_serving.py: random text prompts, one streamed request over gRPC or HTTP
timed chunk by chunk, a closed-loop load of C clients, and the per-run statistics.

Timeline of one run (every time is time.perf_counter() in this process):

    t_start          w0 = t_start + warmup_s          w1 = w0 + duration_s        drained
    |---- warm-up ---|------------- window ------------|--- in-flight requests end ---|
    clients loop: send, stream, record; none starts a request after w1

    out tok/s  = tokens of the chunks that arrived in [w0, w1) / duration_s
    req/s      = requests that ended without error in [w0, w1) / duration_s
    TTFT, ITL  = over the requests that started in [w0, w1) and ended without error
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import grpc
import httpx2 as httpx
import numpy as np

from engine.client import AsyncHicacheClient, HicacheClient
from engine.server.pb import gen_pb2
from tools.benchlib import summary

REQUEST_TIMEOUT_S = 600.0

# Common English words (one token each, with their leading space, in most BPE vocabularies).
_WORDS_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy music market sense
nation plan college interest death experience effect class control care field development role
effort rate heart drug show leader light voice wife police mind price report decision son view
relationship town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair window
evidence population site glass river bank summer garden stone winter bridge island forest
"""
WORDS = tuple(dict.fromkeys(_WORDS_TEXT.split()))  # distinct, in order


def words_per_token(addr: str, seed: int) -> float:
    """Calibrates the prompt length: the daemon's prompt_tokens for 200 random words."""
    text = " ".join(random.Random(f"{seed}-calibrate").choices(WORDS, k=200))
    with HicacheClient(addr, timeout=120) as c:
        _, _, done = c.generate_text(text, max_new_tokens=1, temperature=0.0)
    return 200 / max(1, done.usage.prompt_tokens)


def prompt_maker(seed: str, num_words: int) -> Callable[[], str]:
    """A fresh random prompt per call: `num_words` words drawn from WORDS (seeded)."""
    rng = random.Random(seed)
    return lambda: " ".join(rng.choices(WORDS, k=num_words))


# --- one request ------------------------------------------------------------------------------
@dataclass
class Record:
    """One streamed request. events: (arrival time, tokens) per token-bearing chunk; over HTTP
    the tokens of a chunk are an estimate (completion_tokens / text chunks)."""

    start: float = 0.0
    end: float = 0.0
    events: list[tuple[float, float]] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


Sender = Callable[[str, Record], Awaitable[None]]


def grpc_sender(client: AsyncHicacheClient, max_new: int) -> Sender:
    async def send(prompt: str, rec: Record) -> None:
        rec.start = time.perf_counter()
        try:
            stream = client.generate(
                prompt,
                max_new_tokens=max_new,
                temperature=0.0,
                ignore_eos=True,
                timeout=REQUEST_TIMEOUT_S,
            )
            async for r in stream:
                now = time.perf_counter()
                if r.HasField("chunk"):
                    if r.chunk.token_ids:
                        rec.events.append((now, len(r.chunk.token_ids)))
                    continue
                done = r.complete
                rec.tokens, rec.prompt_tokens = (
                    done.usage.completion_tokens,
                    done.usage.prompt_tokens,
                )
                if done.finish_reason == gen_pb2.FINISH_REASON_ABORT:
                    rec.error = f"abort: {done.abort_message}"
        except grpc.RpcError as e:
            rec.error = f"grpc {e.code().name}: {e.details()}"
        rec.end = time.perf_counter()

    return send


def http_sender(client: httpx.AsyncClient, url: str, max_new: int) -> Sender:
    """POST /v1/completions, stream=true; ignore_eos is the server's vLLM-style extension."""
    body = {
        "max_tokens": max_new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def send(prompt: str, rec: Record) -> None:
        rec.start = time.perf_counter()
        times: list[float] = []
        usage: dict[str, Any] | None = None
        try:
            async with client.stream(
                "POST",
                f"{url}/v1/completions",
                json={**body, "prompt": prompt},
                timeout=REQUEST_TIMEOUT_S,
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.error = f"http {resp.status_code}: {text[:300]}"
                async for line in resp.aiter_lines():
                    if rec.error or not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = f"in-band: {obj['error'].get('message')}"
                    elif obj.get("choices") and obj["choices"][0].get("text"):
                        times.append(time.perf_counter())
                    if obj.get("usage"):
                        usage = obj["usage"]
        except (httpx.HTTPError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.end = time.perf_counter()
        rec.tokens = usage["completion_tokens"] if usage else len(times)
        rec.prompt_tokens = usage["prompt_tokens"] if usage else 0
        per_chunk = rec.tokens / len(times) if times else 0.0
        rec.events = [(t, per_chunk) for t in times]

    return send


# --- a run ------------------------------------------------------------------------------------
async def closed_loop(
    send: Sender,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    make_prompt: Callable[[], str],
) -> tuple[list[Record], float, float]:
    """`concurrency` clients each send one request after another until w1; (records, w0, w1)."""
    records: list[Record] = []
    w0 = time.perf_counter() + warmup_s
    w1 = w0 + duration_s

    async def client() -> None:
        while time.perf_counter() < w1:
            rec = Record()
            records.append(rec)
            await send(make_prompt(), rec)
            if rec.error:
                await asyncio.sleep(0.05)  # no hot loop against a failing server

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, w0, w1


def summarize(records: list[Record], w0: float, w1: float, max_new: int) -> dict[str, Any]:
    """Per-run numbers (see the module docstring); times in ms."""
    window = w1 - w0
    ok = [r for r in records if r.error is None]
    measured = [r for r in ok if w0 <= r.start < w1 and r.events]
    tokens = sum(n for r in records for t, n in r.events if w0 <= t < w1)
    # NOTE: an ITL sample is the gap before a chunk divided by that chunk's tokens.
    itl = [(t1 - t0) / n1 for r in measured for (t0, _), (t1, n1) in pairwise(r.events) if n1 > 0]
    errors = [r.error for r in records if r.error]
    chunks = sum(len(r.events) for r in ok)
    return {
        "window_s": window,
        "requests_started": len(records),
        "requests_done_in_window": sum(1 for r in ok if w0 <= r.end < w1),
        "requests_measured": len(measured),
        "out_tok_s": tokens / window,
        "req_s": sum(1 for r in ok if w0 <= r.end < w1) / window,
        "ttft_ms": summary([r.events[0][0] - r.start for r in measured], 1000.0),
        "itl_ms": summary(itl, 1000.0),
        "latency_ms": summary([r.end - r.start for r in measured], 1000.0),
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else None,
        "mean_tokens_per_chunk": sum(r.tokens for r in ok) / chunks if chunks else None,
        "short_requests": sum(1 for r in ok if r.tokens < max_new),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "drain_s": max((r.end for r in records), default=w1) - w1,
    }
