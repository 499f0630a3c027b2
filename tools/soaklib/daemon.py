"""The daemon under test: `hicache serve` as a subprocess on a fixed port and L3 dir; start,
signal, wait, stop and restart it, its health, its RSS, and the problems in its logs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from engine.client import HicacheClient
from tools.benchlib import daemon_env, free_port
from tools.soaklib.config import SoakConfig


class DaemonProcess:
    """`hicache serve` as a subprocess on a fixed port and L3 dir; restartable."""

    def __init__(self, cfg: SoakConfig, work_dir: Path, l3_dir: Path, name: str = "daemon") -> None:
        self.cfg, self.work_dir, self.l3_dir, self.name = cfg, work_dir, l3_dir, name
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def argv(self) -> list[str]:
        c = self.cfg
        args = [
            sys.executable,
            "-m",
            "engine.client.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            "0",
            "--hicache-storage-dir",
            str(self.l3_dir),
            "--hicache-storage-size-gb",
            f"{c.l3_cap_mb / 1024:.6f}",
            "--hicache-storage-page-size",
            str(c.storage_object_tokens),
            "--hicache-prefetch-threshold",
            "0",
            "--hicache-ratio",
            str(c.hicache_ratio),
            "--max-total-tokens",
            str(c.max_total_tokens),
            "--page-size",
            str(c.page_size),
            "--max-queued-requests",
            str(c.max_queued_requests),
            "--grace-period-s",
            str(c.grace_period_s),
            "--debug-check-invariants",
        ]
        if c.model:
            args += ["--model", c.model]
        return args + list(c.extra_args)

    def start(self) -> None:
        env = daemon_env(self.work_dir, log_level="info")
        log = self.work_dir / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                self.argv(), cwd=self.work_dir, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_serving(self) -> float:
        """Seconds until health is SERVING; RuntimeError (with the log's tail) if it exits."""
        t0 = time.monotonic()
        with HicacheClient(self.addr, timeout=5) as c:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited: {self.log_tail()}")
                try:
                    if c.health() == "SERVING":
                        return time.monotonic() - t0
                except grpc.RpcError:
                    pass
                if time.monotonic() - t0 > self.cfg.startup_timeout_s:
                    raise RuntimeError(f"not SERVING after {self.cfg.startup_timeout_s:.0f}s")
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kb(self) -> int:
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

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGTERM)
        rc = self.wait(self.cfg.grace_period_s + 60)
        if rc is None:
            self.proc.kill()
            self.proc.wait()
        return rc

    def log_tail(self, n: int = 3000) -> str:
        return self.logs[-1].read_text(errors="replace")[-n:] if self.logs else ""

    def log_problems(self) -> list[str]:
        """Tracebacks and ERROR lines in every log of this daemon."""
        out = []
        for log in self.logs:
            lines = log.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if " ERROR " in line or line.startswith("Traceback"):
                    out.append(f"{log.name}:{i + 1}: {line[:200]}")
        return out
