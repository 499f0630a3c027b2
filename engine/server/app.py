"""The daemon: grpc.aio server, health (NOT_SERVING until the model is loaded and warm),
reflection, auth, metrics, and graceful SIGTERM drain.

    daemon = Daemon(settings, server_args); asyncio.run(daemon.serve_forever())
    DaemonThread(settings, server_args).start()   # in-process (tests, embedding)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from engine.admin_records import TenantQuota
from engine.config import ServerArgs
from engine.front import EngineFront
from engine.server.admin import CacheAdminServicer
from engine.server.auth import AuthInterceptor
from engine.server.decode import DecodeGuard
from engine.server.gen.smg import sglang_scheduler_pb2_grpc as sglang_grpc
from engine.server.generation import GenerationServicer
from engine.server.kv_events import KvEventPublisher
from engine.server.kv_events_config import KvEventsConfig
from engine.server.kv_events_zmq import ZmqKvEvents
from engine.server.metrics import Metrics
from engine.server.openai_api import ABORT_ANSWER_S, HttpApi
from engine.server.pb import (
    CACHE_ADMIN_SERVICE,
    GENERATION_SERVICE,
    SGLANG_SERVICE,
    admin_grpc,
    gen_grpc,
)
from engine.server.settings import DaemonSettings, describe_tiers
from engine.server.sglang_worker import SglangWorkerServicer
from engine.server.state import DaemonState
from hicache.observe.stats import CacheStats
from hicache.tier import TIERS

log = logging.getLogger(__name__)
SERVICES = ("", GENERATION_SERVICE, CACHE_ADMIN_SERVICE, SGLANG_SERVICE)
GRPC_AIO_LOGGER = "grpc._cython.cygrpc"  # where grpc aio's server logs its handlers' failures
PEER_GONE = "ExecuteBatchError raised in core by servicer method"


class PeerGoneFilter(logging.Filter):
    """grpc aio logs PEER_GONE as an ERROR with a traceback when a handler's send fails on a
    call its client has left (a cancel, a deadline, a closed connection) before grpc's own
    completion for that cancel has run (its _handle_exceptions tests rpc_state.client_closed,
    which that completion sets; a loaded event loop may run it second). Nothing of the daemon's
    failed: the handler's `finally` has released the request. Logged at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.getMessage().startswith(PEER_GONE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_peer_gone() -> None:
    """Installs PeerGoneFilter once on grpc aio's logger."""
    grpc_log = logging.getLogger(GRPC_AIO_LOGGER)
    if not any(isinstance(f, PeerGoneFilter) for f in grpc_log.filters):
        grpc_log.addFilter(PeerGoneFilter())


FAILURE_LINGER_S = 2.0  # NOT_SERVING before exiting when a child process died


def default_engine_factory(args: ServerArgs) -> Callable[[], EngineFront]:
    def build() -> EngineFront:
        # NOTE: imported here: the split daemon's API server process never loads the runtime
        from engine.runtime.engine import Engine

        return Engine(**args.to_dict())

    return build


def split_engine_factory(
    args: ServerArgs, on_failure: Callable[[str], None], log_level: str
) -> Callable[[], EngineFront]:
    def build() -> EngineFront:
        from engine.server.split_engine import SplitEngine

        return SplitEngine(args, on_failure, log_level)

    return build


class Daemon:
    def __init__(
        self,
        settings: DaemonSettings,
        server_args: ServerArgs | None = None,
        engine_factory: Callable[[], EngineFront] | None = None,
    ):
        self.settings = settings
        self.server_args = server_args  # None with a custom engine_factory
        args = server_args or ServerArgs()
        self.factory = engine_factory or (
            split_engine_factory(args, self._engine_failed, settings.log_level)
            if settings.processes == "split"
            else default_engine_factory(args)
        )
        self.engine_error: str | None = None  # why the engine (a child process) died
        self.quotas = [  # the tenants' quotas, handed to the engine once it is loaded
            TenantQuota(t.name, frozenset(t.namespaces), {tier: t.quota(tier) for tier in TIERS})
            for t in settings.tenants
        ]
        self.state = DaemonState(
            settings, ThreadPoolExecutor(settings.bridge_threads, thread_name_prefix="hicache-rpc")
        )
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.metrics_port = 0
        # KV events for routers: starts with its first subscriber
        self.kv_events = KvEventPublisher(
            self.state, settings.kv_events_block_size, salt_key=settings.kv_events_salt()
        )
        zmq_config = (
            KvEventsConfig.parse(settings.kv_events_config) if settings.kv_events_config else None
        )
        # vLLM-format events over ZMQ (--kv-events-config), from the model's load on
        self.zmq_events = (
            ZmqKvEvents(zmq_config, self.kv_events)
            if zmq_config is not None and zmq_config.enabled
            else None
        )
        self.http: HttpApi | None = None  # the OpenAI-compatible API (--http-port)
        self.http_port = 0
        self.load_error: BaseException | None = None
        self._loaded = asyncio.Event()
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> int:
        """Binds and starts serving (health NOT_SERVING); the model loads in the background."""
        self._loop = asyncio.get_running_loop()
        s = self.settings
        quiet_peer_gone()
        mb = s.max_message_mb * 2**20
        options = [
            ("grpc.max_send_message_length", mb),
            ("grpc.max_receive_message_length", mb),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.so_reuseport", 0),
        ]
        interceptors: list[grpc.aio.ServerInterceptor] = (
            [AuthInterceptor(s.token, s.admin_token, self.state.tenants)] if s.auth_enabled else []
        )
        interceptors.append(DecodeGuard())
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        gen_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.state), self.server
        )
        admin_grpc.add_CacheAdminServiceServicer_to_server(
            CacheAdminServicer(self.state), self.server
        )
        # SMG's gRPC worker mode (`smg launch --worker-urls grpc://...`) on the same port
        sglang_grpc.add_SglangSchedulerServicer_to_server(
            SglangWorkerServicer(self.state, self.kv_events, s.served_model_name), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                GENERATION_SERVICE,
                CACHE_ADMIN_SERVICE,
                SGLANG_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        for name in SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        addr = f"{s.host}:{s.port}"
        if s.tls_cert and s.tls_key:  # NOTE: DaemonSettings checks they come together
            ca = Path(s.tls_client_ca).read_bytes() if s.tls_client_ca else None
            creds = grpc.ssl_server_credentials(
                [(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())],
                root_certificates=ca,
                require_client_auth=ca is not None,
            )
            self.port = self.server.add_secure_port(addr, creds)
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"cannot bind {addr}")
        await self.server.start()
        # NOTE: the HTTP port answers /metrics too, so the figures are kept with either port
        metrics = (
            Metrics(self._stats_for_metrics, self._tenants_for_metrics if self.quotas else None)
            if s.metrics_port or s.http_port
            else None
        )
        self.state.metrics = metrics
        if metrics is not None and s.metrics_port:
            self.metrics_port = metrics.serve(s.metrics_port, s.metrics_host)
        if s.http_port:
            self.http = HttpApi(self.state, s)
            self.http_port = await self.http.start()
        asyncio.get_running_loop().create_task(self._load())
        log.info("listening on %s:%d (%s)", s.host, self.port, "TLS" if s.tls_cert else "plaintext")
        if not s.auth_enabled:
            log.info(
                "no authentication (no --token, --admin-token or tenant): every client that "
                "reaches %s:%d is served as one user, with every admin RPC",
                s.host,
                self.port,
            )
        elif s.tenants:
            log.info(
                "tenants: %s",
                ", ".join(f"{t.name} (namespaces {'|'.join(t.namespaces)})" for t in s.tenants),
            )
        if self.server_args is not None:
            log.info("cache tiers: %s", describe_tiers(self.server_args.public_dict()))
        return self.port

    def _stats_for_metrics(self) -> CacheStats | None:
        engine = self.state.engine
        if engine is None or not self.state.ready:
            return None
        return engine.cache_stats()

    def _tenants_for_metrics(self) -> dict[str, dict[str, dict[str, int]]] | None:
        engine = self.state.engine
        if engine is None or not self.state.ready:
            return None
        return engine.tenant_figures(self.quotas)

    async def _load(self) -> None:
        st = self.state
        try:
            t0 = time.monotonic()
            engine = await st.run(self.factory)
            st.engine = engine
            st.event_log = await st.run(engine.event_log)
            if self.quotas:
                await st.run(engine.apply_quotas, self.quotas)
            if self.settings.warmup:
                await st.run(_warm_up, engine)
            st.ready = True
            if self.zmq_events is not None:
                await self.zmq_events.start()
            for name in SERVICES:
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("model ready in %.1fs: serving", time.monotonic() - t0)
        except BaseException as e:
            log.exception("failed to load the model")
            self.load_error = e
            self._stop.set()
        finally:
            self._loaded.set()

    def _engine_failed(self, reason: str) -> None:
        """From the split engine's monitor thread: a child process died. Its requests have
        ended with UNAVAILABLE; health goes NOT_SERVING and the daemon exits with status 1."""
        self.engine_error = reason
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: loop.create_task(self._on_engine_failure()))

    async def _on_engine_failure(self) -> None:
        for name in SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        # NOTE: still answering for a moment, so that health probes see NOT_SERVING and new
        # calls get UNAVAILABLE with the reason, rather than a refused connection only
        await asyncio.sleep(FAILURE_LINGER_S)
        self._stop.set()

    async def wait_loaded(self) -> None:
        await self._loaded.wait()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, refuse new work, let in-flight RPCs finish up to the grace period, then
        shut the engine down."""
        st = self.state
        grace = self.settings.grace_period_s if grace is None else grace
        st.draining = True
        await self.health.enter_graceful_shutdown()
        # Phase 1: still listening (health answers NOT_SERVING, new work gets UNAVAILABLE)
        # while the in-flight streams finish; phase 2: stop, cancelling what is left.
        deadline = time.monotonic() + grace
        while st.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Past the grace, open requests are aborted and still answered (gRPC: UNAVAILABLE, the
        # server is shutting down; HTTP: 503) instead of cut by the server's stop (CANCELLED,
        # which reads as the client's own doing); what has not answered by then is cut.
        if st.active and st.engine is not None:
            for rid in list(st.active):
                st.drain_aborted.add(rid)
                st.engine.abort(rid)
            answer_by = time.monotonic() + ABORT_ANSWER_S
            while st.active and time.monotonic() < answer_by:
                await asyncio.sleep(0.02)
            deadline = max(deadline, time.monotonic())
        if self.zmq_events is not None:
            await self.zmq_events.stop()
        await self.kv_events.stop()
        if self.server is not None:
            await self.server.stop(max(0.0, deadline - time.monotonic()))
        if self.http is not None:
            await self.http.stop(max(0.0, deadline - time.monotonic()))
        if st.metrics is not None:
            st.metrics.close()
        if st.engine is not None:
            await st.run(st.engine.shutdown)
        st.pool.shutdown(wait=False, cancel_futures=True)

    async def serve_forever(self) -> int:
        """Runs until SIGTERM / SIGINT (or a load failure); returns the exit code."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await self._stop.wait()
        log.info("draining (grace %.1fs)", self.settings.grace_period_s)
        await self.stop()
        return 1 if self.load_error is not None or self.engine_error is not None else 0


def _warm_up(engine: EngineFront) -> None:
    """One prefill + decode so the first request does not pay for lazy initialisation; the
    cache is emptied afterwards."""
    engine.generate([0, 0], {"max_new_tokens": 2, "temperature": 0.0}, namespace="warmup")
    engine.evict("l1")


class DaemonThread:
    """A daemon on its own event loop in a background thread."""

    def __init__(
        self,
        settings: DaemonSettings,
        server_args: ServerArgs | None = None,
        engine_factory: Callable[[], EngineFront] | None = None,
    ):
        self.settings = settings
        self._args = (server_args, engine_factory)
        self.daemon: Daemon | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-daemon", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.daemon = Daemon(self.settings, *self._args)
            self.loop.run_until_complete(self.daemon.start())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_until_complete(self.daemon._stop.wait())
        self.loop.run_until_complete(self.daemon.stop())
        self.loop.close()

    @property
    def port(self) -> int:
        return self.daemon.port if self.daemon else 0

    def start(self, wait_ready: bool = True, timeout: float = 300.0) -> DaemonThread:
        self._thread.start()
        self._started.wait(timeout)
        if self._error is not None:
            raise self._error
        daemon, loop = self.daemon, self.loop
        if daemon is None or loop is None:
            raise TimeoutError(f"the daemon did not start within {timeout:g}s")
        if wait_ready:
            asyncio.run_coroutine_threadsafe(daemon.wait_loaded(), loop).result(timeout)
            if daemon.load_error is not None:
                raise RuntimeError("model load failed") from daemon.load_error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self.loop is not None and self.daemon is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.daemon.request_stop)
        self._thread.join(timeout)
