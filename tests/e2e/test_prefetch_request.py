"""A Prefetch that computes runs as an engine request, as Generate's do (EngineRequest): while
it runs the daemon counts it among its active requests (what the drain waits for) and its open
streams, the request metrics count it when it ends, and past the drain's grace it is aborted
and answered UNAVAILABLE, the server shutting down."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.runtime.scheduler import Scheduler
from engine.server.app import DaemonThread
from engine.server.pb import admin_pb2
from engine.server.settings import DaemonSettings

PROMPT = "Prefill computes the prompt; a prefetch computes it once for the requests to come. " * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HoldPrefetch:
    """A scheduler step hook: holds the scheduler thread while a prefetch's request waits, until
    released (so the request is in flight for as long as the test needs); then takes what came
    meanwhile (an abort) before the step schedules the request, as the loop's next pass would."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()

    def __call__(self, s: Scheduler) -> None:
        if not self.release.is_set() and any("prefetch-" in r.rid for r in s.waiting):
            self.held.set()
            self.release.wait(120)
            s.take_inbox()


def _daemon(tiny_llama_dir: str, **settings) -> DaemonThread:
    args = ServerArgs(model_path=tiny_llama_dir, max_total_tokens=4096, debug_check_invariants=True)
    return DaemonThread(
        DaemonSettings(port=0, warmup=False, processes="single", **settings), args
    ).start()


def _hold(dt: DaemonThread) -> HoldPrefetch:
    hook = HoldPrefetch()
    dt.daemon.state.engine.call_in_scheduler(lambda s: s.step_hooks.add(hook))
    return hook


def _running(stream: Iterator[admin_pb2.PrefetchResponse], hook: HoldPrefetch) -> None:
    """Reads the stream up to RUNNING; returns once the prefetch's request is held."""
    assert next(stream).stage == admin_pb2.PREFETCH_STAGE_MATCHED
    assert next(stream).stage == admin_pb2.PREFETCH_STAGE_RUNNING
    assert hook.held.wait(60), "the prefetch's request never reached the scheduler"


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_a_computing_prefetch_is_counted_like_a_request(tiny_llama_dir):
    dt = _daemon(tiny_llama_dir, grace_period_s=2, metrics_port=_free_port())
    finished = ("hicache_requests_total", (("finish_reason", "length"),))
    streams = ("hicache_active_streams", ())
    try:
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
            before = _metrics(dt.daemon.metrics_port).get(finished, 0.0)
            hook = _hold(dt)
            stream = iter(c.prefetch(PROMPT))
            try:
                _running(stream, hook)
                # NOTE: /metrics reads the cache's figures on the scheduler thread: not now
                assert c.server_info().active_requests == 1  # what the drain waits for
            finally:
                hook.release.set()
            done = list(stream)[-1]
            assert done.stage == admin_pb2.PREFETCH_STAGE_DONE and done.computed_tokens > 0
            assert c.server_info().active_requests == 0
            after = _metrics(dt.daemon.metrics_port)
            assert after[finished] == before + 1 and after[streams] == 0
    finally:
        dt.stop()


def test_a_prefetch_past_the_drains_grace_ends_unavailable(tiny_llama_dir):
    """The stop aborts it (its KV freed) and answers UNAVAILABLE, the server shutting down: not
    CANCELLED, which reads as the client's doing, nor ABORTED, an abort of its own."""
    dt = _daemon(tiny_llama_dir, grace_period_s=0.2)
    state = dt.daemon.state
    stopper = threading.Thread(target=dt.stop)
    hook = _hold(dt)
    try:
        with HicacheClient(f"127.0.0.1:{dt.port}", timeout=60) as c:
            stream = iter(c.prefetch(PROMPT))
            _running(stream, hook)
            stopper.start()
            deadline = time.monotonic() + 60
            while not state.drain_aborted:  # the stop, past the grace, aborts what is active
                assert time.monotonic() < deadline, "the drain never aborted the prefetch"
                time.sleep(0.02)
            hook.release.set()
            with pytest.raises(grpc.RpcError) as e:
                list(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "shutting down" in e.value.details()
    finally:
        hook.release.set()
        if stopper.ident is None:  # failed before the stop began
            dt.stop()
        else:
            stopper.join(60)
