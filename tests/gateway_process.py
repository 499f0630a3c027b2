"""The real SMG gateway (PyPI `smg`, a Rust binary) and `hicache serve` daemons as subprocesses
for the gateway e2e tests: start, wait until ready (polling, with the process's output in the
failure), stop."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_binary() -> str | None:
    """The `smg` console script of this interpreter's environment, else one on PATH."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


@dataclass
class Proc:
    """A started process; its output goes to `log` (NOTE: never an unread pipe, which blocks the
    process once full)."""

    popen: subprocess.Popen
    log: Path
    url: str = ""  # its HTTP base URL
    port: int = 0  # its gRPC port (daemons)
    metrics_url: str = ""  # the gateway's Prometheus endpoint

    @classmethod
    def spawn(cls, argv: list[str], log: Path, **kw: object) -> Proc:
        """Starts ``argv``; its output is appended to ``log`` (a restarted process's too)."""
        with open(log, "a") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, **kw)
        return cls(popen, log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def failure(self, what: str) -> AssertionError:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        return AssertionError(f"{what} (exit {self.popen.returncode}):\n{self.output()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 30 s."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_daemon(model_dir: str, workdir: Path, *extra: str) -> Proc:
    """`hicache serve` with gRPC and HTTP on free ports, its XDG cache and log in `workdir`.
    The caller waits with wait_http_ready."""
    port, http = free_port(), free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    env.update(XDG_CACHE_HOME=str(workdir), HICACHE_LOG_LEVEL="warning")
    proc = Proc.spawn(
        [
            sys.executable,
            "-m",
            "engine.client.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--http-port",
            str(http),
            "--max-total-tokens",
            "4096",
            "--grace-period-s",
            "5",
            *extra,
        ],
        workdir / "daemon.log",
        cwd=ROOT,
        env=env,
    )
    proc.url, proc.port = f"http://127.0.0.1:{http}", port
    return proc


def wait_http_ready(proc: Proc, path: str = "/health", timeout: float = 180.0) -> None:
    """Polls `proc.url + path` until it answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None:
            raise proc.failure("exited while starting")
        try:
            if httpx2.get(proc.url + path, timeout=5).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise proc.failure(f"{proc.url}{path} not ready in {timeout:.0f}s")
        time.sleep(0.2)


def start_smg(worker_urls: list[str], log: Path, *extra: str, binary: str | None = None) -> Proc:
    """`smg launch` in front of the workers on a free port (``binary``: smg_binary())."""
    binary = binary or smg_binary()
    assert binary is not None, "smg is not installed"
    port, prom = free_port(), free_port()
    proc = Proc.spawn(
        [
            binary,
            "launch",
            "--worker-urls",
            *worker_urls,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(prom),
            "--log-level",
            "warn",
            *extra,
        ],
        log,
    )
    proc.url = f"http://127.0.0.1:{port}"
    proc.metrics_url = f"http://127.0.0.1:{prom}/metrics"
    return proc


def gateway_ready(url: str, model: str, workers: int) -> bool:
    """SMG's `/readiness` says 200 with every one of `workers` healthy, and `/v1/models` lists
    `model`. NOTE: a gRPC gateway lists the model as soon as a worker registers, but it fetches
    the worker's tokenizer afterwards (GetTokenizer) and answers 503 until then; `/readiness`
    holds back until every healthy gRPC worker's tokenizer is registered. It needs only one
    healthy worker, hence the count (`/health_generate` is not implemented for gRPC workers)."""
    r = httpx2.get(f"{url}/readiness", timeout=5)
    if r.status_code != 200 or r.json().get("healthy_workers") != workers:
        return False
    models = httpx2.get(f"{url}/v1/models", timeout=5)
    return models.status_code == 200 and model in [m["id"] for m in models.json()["data"]]


def wait_gateway_ready(proc: Proc, model: str, workers: int, timeout: float = 120.0) -> None:
    """Polls until gateway_ready: the gateway routes `model` to all its `workers`."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None:
            raise proc.failure("smg exited")
        try:
            if gateway_ready(proc.url, model, workers):
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise proc.failure(
                f"smg not ready for {model!r} on {workers} workers in {timeout:.0f}s"
            )
        time.sleep(0.2)
