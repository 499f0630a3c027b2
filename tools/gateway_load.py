"""The load of tools/bench_gateway.py: multi-turn chat conversations from closed-loop clients,
streamed OpenAI chat completions with the usage chunk, one record per turn.

Conversation c has a system prompt of its own whose words every conversation shares in part;
every turn adds a user message and the reply. C clients each own the conversations c with
c % C == client and visit them in a new seeded order every turn, one request at a time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx2

TOPICS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "Radix trees share common prefixes between requests; eviction frees the least recently used.",
    "Prefill computes the prompt; decode produces one token at a time.",
]
# the share of the previous turn's prompt a next turn must find cached to count as landed
# where its prefix is (tokenizing the reply again can move the boundary by a token or two)
LANDED_SHARE = 0.9


@dataclass(frozen=True)
class Record:
    conv: int
    turn: int
    prompt: int
    cached: int
    completion: int
    ttft_s: float


async def one_turn(
    client: httpx2.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    conv: int,
    turn: int,
    max_tokens: int,
) -> tuple[Record, str]:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "model": "bench",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(ch["delta"]["content"])
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    rec = Record(
        conv,
        turn,
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        usage["completion_tokens"],
        ttft if ttft is not None else time.perf_counter() - t0,
    )
    return rec, "".join(text)


async def drive(
    url_of: list[str],
    restart: Callable[[], str] | None,
    conversations: int,
    turns: int,
    clients: int,
    max_tokens: int,
    tag: str,
) -> tuple[list[Record], float]:
    """The closed-loop load; ``restart()`` (returning the new URL) runs between the halves when
    given. ``url_of[0]`` is the current gateway (or daemon) URL."""
    history = [
        [
            {
                "role": "system",
                "content": f"Run {tag}, conversation {c}. "
                + " ".join(TOPICS[(c + k) % 4] for k in range(8)),
            }
        ]
        for c in range(conversations)
    ]
    records: list[Record] = []

    async def client_loop(k: int, lo: int, hi: int, http: httpx2.AsyncClient) -> None:
        mine = [c for c in range(conversations) if c % clients == k]
        for turn in range(lo, hi):
            for c in random.Random(turn * 1000 + k).sample(mine, len(mine)):
                history[c].append({"role": "user", "content": f"Turn {turn}: tell me more."})
                rec, reply = await one_turn(http, url_of[0], history[c], c, turn, max_tokens)
                records.append(rec)
                history[c].append({"role": "assistant", "content": reply})

    t0 = time.perf_counter()
    halves = [(0, turns // 2), (turns // 2, turns)] if restart else [(0, turns)]
    async with httpx2.AsyncClient(timeout=600) as http:
        for i, (lo, hi) in enumerate(halves):
            if i and restart is not None:
                url_of[0] = await asyncio.to_thread(restart)
            await asyncio.gather(*(client_loop(k, lo, hi, http) for k in range(clients)))
    return records, time.perf_counter() - t0


def rate(rs: list[Record]) -> float:
    return sum(r.cached for r in rs) / max(1, sum(r.prompt for r in rs))
