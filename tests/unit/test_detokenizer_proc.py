"""The split daemon's text: a request's chunks, sent by a scheduler-process Req (no text unless
it has stop strings) and filled in by the detokenizer process' Detokenizer, carry the same text
and finish as the in-process Req's chunks, for random outputs, stop tokens and stop strings."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer.process import Detokenizer
from engine.front import StreamChunk
from engine.ipc import messages
from engine.runtime.request import Req
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _run(tok, params: SamplingParams, outputs: list[int], steps: list[int], sink=None):
    """Decodes `outputs` in steps of the given sizes, as the scheduler does; returns the chunks."""
    req = Req.new("r", [5, 6, 7], params, tok, {EOS}, 4096, torch.device("cpu"), sink=sink)
    chunks: list[StreamChunk] = []
    if sink is None:
        req.stream.sink = chunks.append
    i = 0
    for n in steps:
        for t in outputs[i : i + n]:
            if req.finished():
                break
            req.output_ids.append(t)
            req.check_finished(4096)
        i += n
        req.emit()
        if req.finished():
            break
    return chunks, req


@settings(max_examples=60, deadline=None)
@given(
    outputs=st.lists(st.integers(0, 383), min_size=1, max_size=40),
    steps=st.lists(st.integers(1, 4), min_size=40, max_size=40),
    stop_at=st.integers(0, 30),
    stop_len=st.integers(1, 4),
    use_stop=st.booleans(),
    skip_special=st.booleans(),
)
def test_split_text_equals_in_process(
    tok, outputs, steps, stop_at, stop_len, use_stop, skip_special
):
    free = tok.decode(outputs, skip_special_tokens=skip_special)
    stop = [free[stop_at : stop_at + stop_len]] if use_stop and free[stop_at : stop_at + 1] else []
    params = SamplingParams(
        max_new_tokens=len(outputs), stop=stop, skip_special_tokens=skip_special
    )
    want, _ = _run(tok, params, outputs, steps)

    sent: list[messages.TokenOut] = []
    start = (skip_special, stop)

    def sink(chunk: StreamChunk) -> None:  # what the scheduler process sends
        nonlocal start
        sent.append(pickle.loads(pickle.dumps(messages.TokenOut("r", chunk, start))))
        start = None

    _run(tok, params, outputs, steps, sink)
    detok = Detokenizer(tok)
    got = [detok.step(m).chunk for m in sent]
    assert [(c.token_ids, c.text, c.finished, c.finish_reason, c.matched_stop) for c in got] == [
        (c.token_ids, c.text, c.finished, c.finish_reason, c.matched_stop) for c in want
    ]
    assert detok.streams == {}  # a finished request leaves nothing behind


def test_scheduler_side_req_without_stop_strings_does_not_detokenize(tok):
    """In the split daemon, text is the detokenizer's job: the scheduler only decodes for
    stop strings."""
    sent: list[StreamChunk] = []
    chunks, _ = _run(
        tok, SamplingParams(max_new_tokens=8), list(range(10, 18)), [1] * 8, sent.append
    )
    assert chunks == [] and len(sent) == 8 and all(c.text == "" for c in sent)
    assert [t for c in sent for t in c.token_ids] == list(range(10, 18))
