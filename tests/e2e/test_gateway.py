"""hicache behind the real SMG gateway (PyPI `smg`): two `hicache serve` daemons (one pair for
the module) and `smg launch` in front of them, as HTTP workers; chat and completions, whole and
streamed, with the daemon's served name and a gateway alias, equal the daemons' own answers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
import openai
import pytest

from tests.gateway_process import (
    Proc,
    smg_binary,
    start_daemon,
    start_smg,
    wait_gateway_model,
    wait_http_ready,
)

pytestmark = pytest.mark.skipif(
    smg_binary() is None,
    reason="the SMG gateway is not installed (PyPI `smg`, in the `test` extra: "
    "pip install -e '.[test]')",
)

MODEL = "tiny"  # --served-model-name of both daemons
NO_EOS = {"ignore_eos": True}
MSGS = [{"role": "user", "content": "Hello world! How are you today?"}]
PROMPT = "A hierarchical KV cache keeps prefixes in device memory"


@pytest.fixture(scope="module")
def daemons(tiny_llama_dir, tmp_path_factory) -> Iterator[list[Proc]]:
    procs = [
        start_daemon(tiny_llama_dir, tmp_path_factory.mktemp(f"daemon{i}"),
                     "--served-model-name", MODEL)
        for i in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(wait_http_ready, procs))
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def http_gateway(daemons, tmp_path_factory) -> Iterator[Proc]:
    log = tmp_path_factory.mktemp("smg_http") / "smg.log"
    gw = start_smg([d.url for d in daemons], log, "--policy", "cache_aware",
                   "--model-alias", f"default={MODEL}")
    try:
        wait_gateway_model(gw, MODEL)
        yield gw
    finally:
        gw.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _requests_total(daemon: Proc) -> float:
    text = httpx2.get(f"{daemon.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^hicache_requests_total\{[^}]*\} (\S+)$", text,
                                            re.MULTILINE))


def _answers(client: openai.OpenAI, model: str) -> dict[str, Any]:
    """Greedy chat and completion, whole and streamed: their texts and finish reasons."""
    kw: dict[str, Any] = {"model": model, "max_tokens": 6, "temperature": 0.0,
                          "extra_body": NO_EOS}
    chat = client.chat.completions.create(messages=MSGS, **kw)
    chat_stream = client.chat.completions.create(messages=MSGS, stream=True, **kw)
    comp = client.completions.create(prompt=PROMPT, **kw)
    comp_stream = client.completions.create(prompt=PROMPT, stream=True, **kw)
    chat_parts = [c.choices[0] for c in chat_stream if c.choices]
    comp_parts = [c.choices[0] for c in comp_stream if c.choices]
    return {
        "chat": (chat.choices[0].message.content, chat.choices[0].finish_reason),
        "chat_stream": ("".join(p.delta.content or "" for p in chat_parts),
                        chat_parts[-1].finish_reason),
        "completion": (comp.choices[0].text, comp.choices[0].finish_reason),
        "completion_stream": ("".join(p.text for p in comp_parts), comp_parts[-1].finish_reason),
        "usage": (chat.usage.completion_tokens, comp.usage.completion_tokens),
    }


def test_daemon_lists_its_served_name(daemons):
    ids = [m["id"] for m in httpx2.get(f"{daemons[0].url}/v1/models", timeout=30).json()["data"]]
    assert ids[0] == MODEL and "default" in ids and "m" in ids


def test_http_workers_serve_chat_and_completions(daemons, http_gateway):
    with _client(daemons[0].url) as direct:
        want = _answers(direct, MODEL)
    assert want["chat"][0] and want["completion"][0]
    assert want["chat"] == want["chat_stream"] and want["completion"] == want["completion_stream"]
    before = sum(_requests_total(d) for d in daemons)
    with _client(http_gateway.url) as gw:
        assert [m.id for m in gw.models.list().data] == [MODEL]
        assert _answers(gw, MODEL) == want
        assert _answers(gw, "default") == want  # the gateway's alias for the served name
        with pytest.raises(openai.NotFoundError):
            gw.chat.completions.create(model="gpt-4", messages=MSGS, max_tokens=2)
    # every request through the gateway reached one of the two daemons
    assert sum(_requests_total(d) for d in daemons) == before + 8
