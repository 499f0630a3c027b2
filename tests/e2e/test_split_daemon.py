"""The split daemon (API server, scheduler and detokenizer processes): streams equal the
in-process engine's, and a child that dies is seen, ends the in-flight requests with
UNAVAILABLE (HTTP: 503), takes the daemon down with status 1 and leaves no process behind; a killed API
server leaves no children either."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx2
import pytest

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.runtime.engine import Engine
from engine.runtime.scheduler import SchedulerCall
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings
from tools.benchlib.daemon import wait_serving

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "The quick brown fox",
    "Once upon a time, in a land far away,",
]


def _args(model: str) -> ServerArgs:
    return ServerArgs(
        model_path=model, max_total_tokens=4096, max_running_requests=8, debug_check_invariants=True
    )


def test_split_streams_equal_the_in_process_engine(tiny_llama_dir):
    kw = _args(tiny_llama_dir).to_dict()
    ref = Engine(model=kw.pop("model_path"), device=kw.pop("device"), **kw)
    try:
        want = [ref.generate(p, {"max_new_tokens": 24, **GREEDY}) for p in PROMPTS]
        # a stop string taken from the free text: the cut must land in the same place
        stop = want[0].text.strip()[3:6]
        want_stop = ref.generate(PROMPTS[0], {"max_new_tokens": 24, "stop": [stop], **GREEDY})
        want_chat = ref.generate(
            [{"role": "user", "content": "hi"}], {"max_new_tokens": 8, **GREEDY}
        )
        # the operations on the cache those requests left (the same sequences in both)
        want_match = [ref.match_prefix(ref.tokenize(p)) for p in PROMPTS]
        want_evictable = ref.evict("l1", dry_run=True).evicted_tokens
    finally:
        ref.shutdown()
    dt = DaemonThread(DaemonSettings(port=0, processes="split"), _args(tiny_llama_dir)).start()
    try:
        assert set(dt.daemon.state.engine.child_pids()) == {"scheduler", "detokenizer"}
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
            results = [None] * len(PROMPTS)

            def one(i: int) -> None:  # concurrent: one batch in the scheduler process
                results[i] = c.generate_text(PROMPTS[i], max_new_tokens=24, **GREEDY)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for (text, ids, _), w in zip(results, want):
                assert ids == w.token_ids and text == w.text
            text, ids, done = c.generate_text(PROMPTS[0], max_new_tokens=24, stop=[stop], **GREEDY)
            assert (ids, text) == (want_stop.token_ids, want_stop.text)
            assert done.matched_stop_string == want_stop.matched_stop
            text, ids, _ = c.generate_text("hi", chat=True, max_new_tokens=8, **GREEDY)
            assert (ids, text) == (want_chat.token_ids, want_chat.text)
            info = c.server_info()
            assert json.loads(info.config["process.scheduler"]) != os.getpid()
            # operations answered in the scheduler process equal the in-process engine's
            for p, want in zip(PROMPTS, want_match):
                got = c.match_prefix(p)
                assert got.matched_tokens == want.matched_tokens > 0
                assert got.matched_per_tier.l1 == want.per_tier["l1"]
            assert c.evict("l1", all=True, dry_run=True).evicted_tokens == want_evictable > 0
        # one loop in the scheduler process: the scheduler runs on its main thread, no other
        main, names = dt.daemon.state.engine.call_in_scheduler(SchedulerCall(_loop_thread))
        assert main and "hicache-scheduler" not in names
    finally:
        dt.stop()


def _loop_thread(scheduler: object) -> tuple[bool, list[str]]:
    """Where a scheduler call runs: (on its process' main thread, that process' threads)."""
    on_main = threading.current_thread() is threading.main_thread()
    return on_main, sorted(t.name for t in threading.enumerate())


# --- process faults, on `hicache serve` ----------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tiny_llama_dir, tmp_path):
    port, http_port = _free_port(), _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    env.update(
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        HICACHE_LOG_LEVEL="warning",
        HICACHE_MAX_TOTAL_TOKENS="4096",
        HICACHE_WARMUP="false",
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
            "--http-port",
            str(http_port),
            "--grace-period-s",
            "5",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    addr = f"127.0.0.1:{port}"
    wait_serving(proc, addr)
    with HicacheClient(addr, timeout=10) as c:
        config = c.server_info().config
    pids = {name: json.loads(config[f"process.{name}"]) for name in ("scheduler", "detokenizer")}
    yield proc, addr, pids, f"http://127.0.0.1:{http_port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_a_killed_child_ends_requests_and_the_daemon(serve, victim):
    proc, addr, pids, http = serve
    statuses: list[int] = []

    def http_request() -> None:  # a non-streamed completion, in flight when the child dies
        body = {
            "model": "default",
            "prompt": "and over HTTP",
            "max_tokens": 3000,
            "ignore_eos": True,
            "temperature": 0,
        }
        statuses.append(httpx2.post(f"{http}/v1/completions", json=body, timeout=60).status_code)

    with HicacheClient(addr, timeout=60) as c:
        stream = iter(c.generate("keep going", max_new_tokens=3000, **GREEDY))
        next(stream)  # the request runs in the scheduler process
        over_http = threading.Thread(target=http_request)
        over_http.start()
        _wait_running(c, 2)
        seen: list[str] = []
        watcher = threading.Thread(target=_watch_health, args=(addr, proc, seen), daemon=True)
        watcher.start()
        os.kill(pids[victim], signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert victim in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # new work too, while it is going down
            c.generate_text("hello", max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert proc.wait(timeout=60) == 1
    over_http.join(10)
    assert statuses == [503]
    watcher.join(10)
    assert "SERVING" not in seen[1:] and "NOT_SERVING" in seen, seen
    assert _wait_gone(list(pids.values())) == []
    assert f"the {victim} process exited unexpectedly" in proc.stdout.read()


def _wait_running(c: HicacheClient, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while c.server_info().active_requests < n:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.05)


def _watch_health(addr: str, proc: subprocess.Popen, seen: list[str]) -> None:
    """Health as seen every 50 ms until the daemon exits (the first entry is before the kill)."""
    with HicacheClient(addr, timeout=2) as c:
        while proc.poll() is None:
            try:
                state = c.health()
            except grpc.RpcError:
                state = "DOWN"
            if not seen or seen[-1] != state:
                seen.append(state)
            time.sleep(0.05)


def test_a_killed_api_server_leaves_no_children(serve):
    proc, _, pids, _ = serve
    proc.kill()
    proc.wait()
    assert _wait_gone(list(pids.values())) == []


def test_sigterm_lets_every_child_exit_by_itself(serve):
    """SIGTERM: the scheduler lands its work, answers the Shutdown and exits, then the
    detokenizer; the API server kills none of them (it would log "did not exit")."""
    proc, _, pids, _ = serve
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "did not exit" not in out, out[-3000:]
    assert _wait_gone(list(pids.values())) == []
