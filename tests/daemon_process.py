"""`hicache serve` subprocesses in tests: wait until one answers SERVING (or fail with its log)."""

from __future__ import annotations

import subprocess
import time

import grpc

from engine.client import HicacheClient


def wait_serving(proc: subprocess.Popen, addr: str, timeout: float = 120.0) -> None:
    """Poll health until SERVING; the daemon's output in the failure when it exits first."""
    with HicacheClient(addr, timeout=5) as c:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
            try:
                if c.health() == "SERVING":
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "daemon did not become SERVING"
            time.sleep(0.2)
