"""Multi-turn conversations through the SMG gateway in front of several `hicache serve` daemons:
how much of each prompt the daemons serve from cache, by gateway mode and policy, with the
gateway restarted half-way (what it knows of the daemons' caches is then only what they tell it).

    python tools/bench_gateway.py --model PATH --daemons 3 --conversations 12 --turns 6 \\
        --out docs/bench_gateway.json

Every turn visits the conversations in a new (seeded) order. Modes: HTTP workers with
round_robin, HTTP with cache_aware (the gateway's own tree of request text), gRPC with
cache_aware (the daemons' KV events). Per mode: prompt tokens, cached prompt
tokens (the OpenAI usage's prompt_tokens_details.cached_tokens), hit rate before and after the
restart, mean latency. Needs `smg` (PyPI) on PATH or beside this interpreter, and the `bench`
extra (its HTTP client).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[1]
TOPICS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "Radix trees share common prefixes between requests; eviction frees the least recently used.",
    "Prefill computes the prompt; decode produces one token at a time.",
]
MODES = (("http", "round_robin"), ("http", "cache_aware"), ("grpc", "cache_aware"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(fn: object, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if fn():  # type: ignore[operator]
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout:.0f}s")
        time.sleep(0.3)


@dataclass
class Daemon:
    proc: subprocess.Popen
    grpc_port: int
    http_port: int


def start_daemons(model: str, n: int, work: Path) -> list[Daemon]:
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        port, http = free_port(), free_port()
        env = {**os.environ, "XDG_CACHE_HOME": str(work / f"d{i}"), "HICACHE_LOG_LEVEL": "warning"}
        log = open(work / f"daemon{i}.log", "w")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.client.cli", "serve", "--model", model, "--port",
             str(port), "--http-port", str(http), "--served-model-name", "bench",
             "--hicache-storage-backend", "none"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        out.append(Daemon(proc, port, http))
    for d in out:
        wait_until(lambda d=d: httpx2.get(f"http://127.0.0.1:{d.http_port}/health").is_success,
                   "daemon")
    return out


def start_gateway(smg: str, urls: list[str], policy: str, log: Path) -> tuple[subprocess.Popen,
                                                                            str]:
    port = free_port()
    out = open(log, "a")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [smg, "launch", "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"],
        stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: "bench" in httpx2.get(f"{url}/v1/models").text, "gateway")
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Result:
    mode: str
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    halves: list[dict[str, float]] = field(default_factory=list)  # before / after the restart
    mean_latency_s: float = 0.0


def run_mode(smg: str, daemons: list[Daemon], mode: str, policy: str, conversations: int,
             turns: int, work: Path, tag: int) -> Result:
    urls = [f"{mode}://127.0.0.1:{d.grpc_port if mode == 'grpc' else d.http_port}"
            for d in daemons]
    log = work / f"smg_{mode}_{policy}.log"
    proc, url = start_gateway(smg, urls, policy, log)
    res = Result(mode, policy)
    history = [[{"role": "system", "content": f"Run {tag}, conversation {c}. "
                 + " ".join(TOPICS[(c + k) % 4] for k in range(8))}] for c in range(conversations)]
    latencies: list[float] = []
    try:
        with httpx2.Client(timeout=300) as client:
            for turn in range(turns):
                if turn == turns // 2:  # the gateway forgets; the daemons' caches stay
                    stop(proc)
                    proc, url = start_gateway(smg, urls, policy, log)
                    res.halves.append({"prompt": res.prompt_tokens, "cached": res.cached_tokens})
                # NOTE: a new order every turn: a fixed one would make round_robin sticky
                for c in random.Random(turn).sample(range(conversations), conversations):
                    history[c].append({"role": "user", "content": f"Turn {turn}: tell me more."})
                    t0 = time.monotonic()
                    r = client.post(f"{url}/v1/chat/completions", json={
                        "model": "bench", "messages": history[c], "max_tokens": 16,
                        "temperature": 0.0, "ignore_eos": True})
                    r.raise_for_status()
                    latencies.append(time.monotonic() - t0)
                    body = r.json()
                    usage = body["usage"]
                    res.requests += 1
                    res.prompt_tokens += usage["prompt_tokens"]
                    res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
                    history[c].append({"role": "assistant",
                                       "content": body["choices"][0]["message"]["content"]})
    finally:
        stop(proc)
    before = res.halves[0] if res.halves else {"prompt": 0, "cached": 0}
    res.halves = [
        {"hit_rate": before["cached"] / max(1, before["prompt"])},
        {"hit_rate": (res.cached_tokens - before["cached"])
         / max(1, res.prompt_tokens - before["prompt"])},
    ]
    res.mean_latency_s = sum(latencies) / max(1, len(latencies))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args(argv)
    smg = str(Path(sys.executable).with_name("smg")) if Path(sys.executable).with_name(
        "smg").exists() else shutil.which("smg")
    if smg is None:
        print("smg is not installed (pip install smg)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    results = []
    for tag, (mode, policy) in enumerate(MODES):
        # fresh daemons per mode: no mode starts with another's cache
        daemons = start_daemons(ns.model, ns.daemons, work / f"m{tag}")
        try:
            r = run_mode(smg, daemons, mode, policy, ns.conversations, ns.turns, work, tag)
        finally:
            for d in daemons:
                stop(d.proc)
        results.append(r)
        print(f"{mode:4} {policy:11} requests={r.requests} prompt={r.prompt_tokens} "
              f"cached={r.cached_tokens} hit={r.cached_tokens / max(1, r.prompt_tokens):.3f} "
              f"(before restart {r.halves[0]['hit_rate']:.3f}, after {r.halves[1]['hit_rate']:.3f})"
              f" latency={r.mean_latency_s * 1e3:.0f} ms")
    if ns.out:
        ns.out.write_text(json.dumps({
            "config": {"model": ns.model, "daemons": ns.daemons,
                       "conversations": ns.conversations, "turns": ns.turns},
            "results": [asdict(r) for r in results]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
