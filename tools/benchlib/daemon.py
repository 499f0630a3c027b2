"""`hicache serve` as a subprocess: the one command line every tool and test starts a daemon
with (gRPC and, unless told otherwise, HTTP on free ports; the model; the caller's flags), in
the environment of ``daemon_env``, in its own work dir (which a restart keeps); ready when gRPC
health says SERVING (``wait_serving``) or HTTP /health answers (``wait_http``); its resident
memory, and the errors and tracebacks in its log."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx2

from engine.client import HicacheClient
from tools.benchlib.procs import Process, daemon_env, free_port, wait_until


def wait_serving(
    proc: subprocess.Popen,
    addr: str,
    timeout_s: float = 120.0,
    output: Callable[[], str] | None = None,
) -> float:
    """Seconds until the daemon ``proc`` answers gRPC health SERVING on ``addr``; RuntimeError
    if it exits or times out first, with ``output()`` (default: its piped output, once it
    exited)."""
    with HicacheClient(addr, timeout=5) as c:
        try:
            return wait_until(
                lambda: c.health() == "SERVING",
                f"the daemon on {addr}",
                timeout_s,
                0.1,
                proc,
                (grpc.RpcError,),
            )
        except (RuntimeError, TimeoutError) as e:
            if output is None:
                exited = proc.poll() is not None and proc.stdout is not None
                output = proc.stdout.read if exited else str  # type: ignore[union-attr]
            raise RuntimeError(f"{e}:\n{output()}") from None


class Daemon(Process):
    """``hicache serve --port P [--http-port H] [--model M] *args``; its XDG cache (the default
    L3) and its log (``<name>.log``) in ``work_dir``, which is also its working directory."""

    def __init__(
        self,
        work_dir: Path,
        args: Sequence[str] = (),
        *,
        model: str | None = None,
        http: bool = True,
        name: str = "daemon",
        log_level: str = "warning",
    ) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(work_dir / f"{name}.log")
        self.work_dir, self.log_level = work_dir, log_level
        self.port, self.http_port = free_port(), free_port() if http else 0
        self.addr = f"127.0.0.1:{self.port}"
        self.url = f"http://127.0.0.1:{self.http_port}"  # the OpenAI-compatible API
        self.argv = [sys.executable, "-m", "engine.client.cli", "serve", "--port", str(self.port)]
        self.argv += ["--http-port", str(self.http_port)] if http else []
        self.argv += [*(["--model", model] if model else []), *args]

    def start(self) -> Daemon:
        """Starts it (again, on the same ports, after a stop or a kill)."""
        self.spawn(self.argv, cwd=self.work_dir, env=daemon_env(self.work_dir, self.log_level))
        return self

    def wait_serving(self, timeout_s: float = 600.0) -> float:
        """Seconds until gRPC health says SERVING; RuntimeError (with the log's tail) if it
        exits or times out first."""
        assert self.proc is not None
        return wait_serving(self.proc, self.addr, timeout_s, self.log_tail)

    def wait_http(self, timeout_s: float = 300.0) -> float:
        """Seconds until HTTP /health answers 200 (the model is loaded)."""
        return self.wait_ready(
            lambda: httpx2.get(f"{self.url}/health", timeout=5).status_code == 200,
            f"the daemon on {self.url}",
            timeout_s,
            retry_on=(httpx2.HTTPError,),
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kb(self) -> int:
        """The API server process's resident memory (0 when it is gone)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        """Its exit status; None when it still runs after ``timeout_s``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the daemon drains), SIGKILL after ``timeout_s``; the exit status (None:
        killed, or never started)."""
        return super().stop(timeout_s)

    def log_problems(self) -> list[str]:
        """ "<log>:<line>: <text>" of each ERROR / CRITICAL line and traceback in its log
        (warnings are expected under load)."""
        if not self.log.exists():
            return []
        lines = self.log.read_text(errors="replace").splitlines()
        return [
            f"{self.log.name}:{i + 1}: {line[:200]}"
            for i, line in enumerate(lines)
            if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
        ]

    def facts(self) -> dict[str, Any]:
        """What it says it runs: version, features, its config (JSON values decoded), model."""
        with HicacheClient(self.addr, timeout=30) as c:
            info, model = c.server_info(), c.model_info()
        config = {}
        for k, v in info.config.items():
            try:
                config[k] = json.loads(v)
            except ValueError:
                config[k] = v
        return {
            "version": info.version,
            "features": list(info.features),
            "config": config,
            "model_path": model.model_path,
            "architecture": model.architecture,
            "dtype": model.dtype,
            "max_context_len": model.max_context_len,
        }
