"""What docker/compose.yaml promises, checked against a running stack through the ports it
publishes: the gateway serves chat and completions (whole and streamed, the daemons' own
answers); a conversation's next turn lands on the daemon holding its prefix; a prefix computed by
one daemon is served to the other from Valkey; the healthchecks pass; with a daemon stopped the
gateway serves from the other; with Valkey stopped the daemons serve from L1 / L2.

The daemons and the gateway are told apart by their images' commands: a daemon's command is
`serve ...`, the gateway's `launch ...`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai

from engine.server.gen.smg import common_pb2 as smg_common
from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sg_grpc
from tools.composelib.spec import Service
from tools.composelib.stack import Say, Stack

HICACHE = str(Path(sys.executable).with_name("hicache"))
TOPICS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "Radix trees share common prefixes between requests; eviction frees the least recently used.",
    "Prefill computes the prompt; decode produces one token at a time.",
]
MSGS = [{"role": "user", "content": "What is a KV cache? Answer in one sentence."}]
PROMPT = "A hierarchical KV cache keeps prefixes in device memory"


def flag(command: tuple[str, ...], name: str) -> str:
    return command[command.index(name) + 1]


@dataclass(frozen=True)
class Daemon:
    name: str
    worker: str  # the gateway's URL of it (its metrics label)
    grpc: str  # host:port as published
    http: str
    metrics: str


@dataclass
class Context:
    stack: Stack
    say: Say
    nonce: str
    daemons: list[Daemon]
    gateway: str  # base URL as published
    gateway_metrics: str
    model: str  # the daemons' --served-model-name
    alias: str  # the gateway's alias of it
    reference: dict[str, Any] | None = None  # greedy answers, for after Valkey stops


def _published(service: Service, container_port: int) -> str:
    for p in service.ports:
        if p.container_port == container_port:
            return f"{p.host_ip}:{p.host_port}"
    raise AssertionError(f"{service.name} does not publish {container_port}")


def context(stack: Stack, say: Say, nonce: str) -> Context:
    services = stack.project.services.values()
    gateway = next(s for s in services if s.command[:1] == ("launch",))
    urls = gateway.command[gateway.command.index("--worker-urls") + 1 :]
    urls = urls[: next((i for i, u in enumerate(urls) if u.startswith("--")), len(urls))]
    daemons = []
    for url in urls:
        host, port = url.removeprefix("grpc://").split(":")
        s = stack.project.services[host]
        assert flag(s.command, "--port") == port, (url, s.command)
        daemons.append(
            Daemon(
                host,
                url,
                _published(s, int(port)),
                _published(s, int(flag(s.command, "--http-port"))),
                _published(s, int(flag(s.command, "--metrics-port"))),
            )
        )
    alias, model = flag(gateway.command, "--model-alias").split("=")
    return Context(
        stack,
        say,
        nonce,
        daemons,
        f"http://{_published(gateway, int(flag(gateway.command, '--port')))}",
        f"http://{_published(gateway, int(flag(gateway.command, '--prometheus-port')))}/metrics",
        model,
        alias,
    )


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> float:
    """Polls cond until true (a connection error counts as false); returns the seconds."""
    start = time.monotonic()

    def true() -> bool:
        try:
            return cond()
        except OSError:
            return False

    while not true():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"still waiting for {what} after {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - start


def cli(ctx: Context, *argv: str) -> subprocess.CompletedProcess[str]:
    """The `hicache` client, as a user runs it from the host; its command line and output go to
    the transcript."""
    out = subprocess.run([HICACHE, *argv], capture_output=True, text=True, timeout=300, check=False)
    shown = " ".join(a if len(a) < 40 else f'"{a[:24]}..."' for a in argv)
    ctx.say(f"$ hicache {shown}\n{(out.stdout + out.stderr).strip()}")
    if out.returncode != 0:
        raise AssertionError(f"hicache {argv[:3]} exited {out.returncode}")
    return out


def _requests_total(d: Daemon) -> float:
    text = http_get(f"http://{d.metrics}/metrics")
    return sum(
        float(v) for v in re.findall(r"^hicache_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    )


def _landed(ctx: Context, msgs: list[dict[str, str]]) -> str:
    """The daemon a chat through the gateway ran on (one request at a time)."""
    before = [_requests_total(d) for d in ctx.daemons]
    with _client(ctx.gateway) as c:
        c.chat.completions.create(model=ctx.alias, messages=msgs, max_tokens=2, temperature=0.0)
    grew = [_requests_total(d) - b for d, b in zip(ctx.daemons, before, strict=True)]
    assert sorted(grew) == [0.0] * (len(grew) - 1) + [1.0], grew
    return ctx.daemons[grew.index(1.0)].name


def answers(base: str, model: str) -> dict[str, Any]:
    """Greedy chat and completion, whole and streamed. NOTE: without a trailing U+FFFD (half a
    UTF-8 character at the token limit: the daemon shows it as U+FFFD, SMG holds it back)."""
    kw: dict[str, Any] = {"model": model, "max_tokens": 16, "temperature": 0.0}
    with _client(base) as c:
        chat = c.chat.completions.create(messages=MSGS, **kw)
        chat_parts = [
            x.choices[0]
            for x in c.chat.completions.create(messages=MSGS, stream=True, **kw)
            if x.choices
        ]
        comp = c.completions.create(prompt=PROMPT, **kw)
        comp_parts = [
            x.choices[0]
            for x in c.completions.create(prompt=PROMPT, stream=True, **kw)
            if x.choices
        ]
    trim = lambda t: (t or "").rstrip("\ufffd")
    return {
        "chat": (trim(chat.choices[0].message.content), chat.choices[0].finish_reason),
        "chat_stream": (
            trim("".join(p.delta.content or "" for p in chat_parts)),
            chat_parts[-1].finish_reason,
        ),
        "completion": (trim(comp.choices[0].text), comp.choices[0].finish_reason),
        "completion_stream": (
            trim("".join(p.text for p in comp_parts)),
            comp_parts[-1].finish_reason,
        ),
    }


def wait_gateway(ctx: Context) -> None:
    """Until the gateway lists the daemons' model (it has registered a worker)."""
    took = wait_for(
        lambda: ctx.model in http_get(f"{ctx.gateway}/v1/models"), "the gateway to list the model"
    )
    ctx.say(f"gateway: lists {ctx.model!r} after {took:.0f} s")


def check_serving(ctx: Context) -> None:
    """The gateway lists the served name; chat and completions through it, by the name and by
    the alias, whole and streamed, equal a daemon's own HTTP answers."""
    models = json.loads(http_get(f"{ctx.gateway}/v1/models"))["data"]
    assert [m["id"] for m in models] == [ctx.model], models
    want = answers(f"http://{ctx.daemons[0].http}", ctx.model)
    assert want["chat"][0] and want["completion"][0], want
    assert want["chat"] == want["chat_stream"] and want["completion"] == want["completion_stream"]
    before = sum(_requests_total(d) for d in ctx.daemons)
    for model in (ctx.model, ctx.alias):
        got = answers(ctx.gateway, model)
        assert got == want, (model, got, want)
    assert sum(_requests_total(d) for d in ctx.daemons) == before + 8
    ctx.reference = want
    ctx.say(
        f"gateway {ctx.gateway}: chat {want['chat']!r}, completion {want['completion']!r} "
        f"(whole = streamed = {ctx.daemons[0].name}'s own answer; models {ctx.model!r} "
        f"and {ctx.alias!r})"
    )


def _conversation(ctx: Context, i: int) -> list[dict[str, str]]:
    system = f"Conversation {i} of run {ctx.nonce}. " + " ".join(
        TOPICS[(i + k) % 4] for k in range(6)
    )
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Tell me about number {i}."},
    ]


def _event_sequence(d: Daemon) -> int:
    """The sequence number of a fresh snapshot of the daemon's KV events."""
    with grpc.insecure_channel(d.grpc) as ch:
        stream = sg_grpc.SglangSchedulerStub(ch).SubscribeKvEvents(
            smg_common.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30
        )
        first = next(iter(stream))
        stream.cancel()
    return int(first.sequence_number)


def _gateway_metric(ctx: Context, name: str, worker: str, label: str) -> float:
    pattern = rf'^{name}\{{worker="{re.escape(worker)}",disposition="{label}"\}} (\S+)$'
    m = re.search(pattern, http_get(ctx.gateway_metrics), re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def check_next_turn(ctx: Context) -> None:
    """Conversations seeded on the daemons directly (the gateway never saw them): their next
    turns through the gateway land on the daemon that holds their prefix, which only the
    daemons' KV events can tell it."""
    homes = {}
    for i in range(4):
        d = ctx.daemons[i % len(ctx.daemons)]
        with _client(f"http://{d.http}") as c:
            r = c.chat.completions.create(
                model=ctx.model, messages=_conversation(ctx, i), max_tokens=3, temperature=0.0
            )
        homes[i] = (d.name, r.choices[0].message.content or "")
    for d in ctx.daemons:
        seq = _event_sequence(d)
        wait_for(
            lambda d=d, seq=seq: (
                1
                + _gateway_metric(  # type: ignore[misc]
                    ctx, "smg_kv_event_batches_total", d.worker, "applied"
                )
                >= seq
            ),
            f"the gateway to apply {d.name}'s KV events up to {seq}",
        )
    landed = []
    for i, (_, reply) in homes.items():
        msgs = [
            *_conversation(ctx, i),
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And then?"},
        ]
        landed.append(_landed(ctx, msgs))
    want = [home for home, _ in homes.values()]
    assert landed == want, (landed, want)
    ctx.say(
        f"4 conversations seeded on {want}; their next turns through the gateway ran on {landed}"
    )


def _usage(stderr: str) -> dict[str, int]:
    m = re.search(r"cached (\d+) \(l1 (\d+), l2 (\d+), l3 (\d+)\)", stderr)
    assert m, stderr
    return dict(zip(("cached", "l1", "l2", "l3"), map(int, m.groups()), strict=True))


def _l3(ctx: Context, d: Daemon) -> dict[str, Any]:
    stats = json.loads(cli(ctx, "--addr", d.grpc, "stats", "--json").stdout)
    tier: dict[str, Any] = next(t for t in stats["tiers"] if t["tier"] == "TIER_L3")
    return tier


def shared_prompt(ctx: Context) -> str:
    return f"Run {ctx.nonce}. " + " ".join(TOPICS[k % 4] for k in range(16))


def check_shared_l3(ctx: Context) -> None:
    """A prompt computed on the first daemon is served to the second from Valkey: same answer,
    cached tokens from L3, the second's L3 hit counter up."""
    a, b = ctx.daemons[0], ctx.daemons[1]
    prompt = shared_prompt(ctx)
    first = cli(ctx, "--addr", a.grpc, "generate", prompt, "-n", "8", "-t", "0")
    assert _usage(first.stderr)["cached"] == 0, first.stderr

    def stored() -> bool:
        out = subprocess.run(
            [HICACHE, "--addr", b.grpc, "match", prompt, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(json.loads(out.stdout)["matched_per_tier"].get("l3", 0)) > 0

    took = wait_for(stored, f"{a.name}'s L3 objects to show on {b.name}", timeout=60)
    ctx.say(f"{b.name} matches the prompt in L3 {took:.1f} s after {a.name} answered")
    second = cli(ctx, "--addr", b.grpc, "generate", prompt, "-n", "8", "-t", "0")
    usage = _usage(second.stderr)
    assert usage["l3"] > 0 and usage["l1"] == usage["l2"] == 0, usage
    assert second.stdout == first.stdout, (first.stdout, second.stdout)
    tier = _l3(ctx, b)
    assert int(tier.get("hit_tokens", 0)) == usage["l3"], tier


def check_healthchecks(ctx: Context) -> None:
    """Each service's healthcheck, run once more as compose runs it."""
    for name, svc in ctx.stack.project.services.items():
        if svc.healthcheck is None:
            continue
        ok, output = ctx.stack.running[name].healthcheck()
        ctx.say(f"{name}: {' '.join(svc.healthcheck.test)} -> {output!r}")
        assert ok, (name, output)


def check_stop_daemon(ctx: Context) -> None:
    """`docker compose stop` of the second daemon while requests stream through the gateway:
    none fails, and once it is gone every request runs on the first."""
    survivor, victim = ctx.daemons[0], ctx.daemons[1]
    results: list[tuple[float, str]] = []
    done = threading.Event()

    def load() -> None:
        with _client(ctx.gateway) as c:
            while not done.is_set():
                t = time.monotonic()
                try:
                    c.chat.completions.create(
                        model=ctx.alias, messages=MSGS, max_tokens=8, temperature=0.0
                    )
                    results.append((t, ""))
                except openai.APIError as e:
                    results.append((t, f"{type(e).__name__}: {str(e)[:160]}"))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        wait_for(lambda: len(results) >= 3, "requests through the gateway")
        sigterm = time.monotonic()
        secs, status = ctx.stack.stop(victim.name)
        gone = time.monotonic()
        wait_for(lambda: sum(t > gone for t, _ in results) >= 4, "requests after the stop")
    finally:
        done.set()
        thread.join()
    ctx.say(
        f"{victim.name}: SIGTERM, exited in {secs:.1f} s with status {status}; "
        f"{len(results)} requests through the gateway meanwhile, "
        f"{sum(t > sigterm for t, _ in results)} of them after the SIGTERM"
    )
    failed = [(round(t - sigterm, 1), e) for t, e in results if e]
    assert not failed, f"requests failed (seconds after SIGTERM, error): {failed}"
    assert status == 0, status
    before = _requests_total(survivor)
    for _ in range(4):
        with _client(ctx.gateway) as c:
            c.chat.completions.create(model=ctx.alias, messages=MSGS, max_tokens=2)
    assert _requests_total(survivor) == before + 4


def check_stop_valkey(ctx: Context) -> None:
    """`docker compose stop valkey`: the daemon left serves on from L1 / L2 (a repeated prompt
    from L1, the gateway's greedy answers unchanged) and counts the L3 failures."""
    valkey = next(n for n, s in ctx.stack.project.services.items() if s.image.startswith("valkey/"))
    secs, status = ctx.stack.stop(valkey)
    ctx.say(f"{valkey}: SIGTERM, exited in {secs:.1f} s with status {status}")
    a = ctx.daemons[0]
    again = cli(ctx, "--addr", a.grpc, "generate", shared_prompt(ctx), "-n", "8", "-t", "0")
    assert _usage(again.stderr)["l1"] > 0, again.stderr
    fresh = f"Run {ctx.nonce}, after Valkey stopped. " + " ".join(TOPICS * 4)
    cli(ctx, "--addr", a.grpc, "generate", fresh, "-n", "8", "-t", "0")
    assert ctx.reference is not None
    assert answers(ctx.gateway, ctx.alias) == ctx.reference

    def counted() -> bool:
        out = subprocess.run(
            [HICACHE, "--addr", a.grpc, "stats", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        l3 = next(t for t in json.loads(out.stdout)["tiers"] if t["tier"] == "TIER_L3")
        return int(l3.get("errors", 0)) > 0

    wait_for(counted, f"{a.name} to count its L3 errors", timeout=60)
    _l3(ctx, a)
