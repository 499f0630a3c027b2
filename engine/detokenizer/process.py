"""The detokenizer process: token ids from the scheduler to text increments for the API server
(incremental detokenization with stop strings, TextStream: the same code the in-process engine
runs, so a stream's text is the same in both)."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

import zmq

from engine.detokenizer.text import TextStream
from engine.ipc import messages, transport

log = logging.getLogger(__name__)


class Detokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.streams: dict[str, tuple[TextStream, list[int]]] = {}  # rid -> (text, output ids)

    def step(self, m: messages.TokenOut) -> messages.TokenOut:
        """The chunk with its text filled in."""
        chunk = m.chunk
        state = self.streams.get(m.rid)
        if state is None:
            skip, stop = m.start or (True, [])
            state = self.streams[m.rid] = (TextStream(self.tokenizer, skip, stop), [])
        text, ids = state
        ids += chunk.token_ids
        by_stop_string = chunk.finish_reason == "stop" and isinstance(chunk.matched_stop, str)
        by_stop_token = (
            chunk.finish_reason == "stop"
            and isinstance(chunk.matched_stop, int)
            and not isinstance(chunk.matched_stop, bool)
        )
        try:
            chunk.text, _ = text.step(ids, chunk.finished and not by_stop_string, by_stop_token)
        except Exception:  # the ids still go out (as in-process)
            log.exception("detokenizing request %s failed; sending token ids only", m.rid)
            chunk.text = ""
        if chunk.finished:
            del self.streams[m.rid]
        return m


def detokenizer_main(
    tokenizer: Any, addrs: transport.Addresses, conn: Connection, log_level: str
) -> None:
    transport.child_setup("detokenizer", log_level)
    ctx = zmq.Context()
    inbox = transport.pull(ctx, addrs.detok_in)
    out = transport.push(ctx, addrs.api_chunks)
    detok = Detokenizer(tokenizer)
    conn.send(("ready", None))
    while True:
        batch = transport.recv(inbox, 1000)
        if batch is None:
            continue
        done = [detok.step(m) for m in batch if isinstance(m, messages.TokenOut)]
        if done:
            transport.send(out, done)
        if any(isinstance(m, messages.DetokStop) for m in batch):
            break
    out.close(linger=5000)
    inbox.close()
    ctx.term()
