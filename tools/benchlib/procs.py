"""The subprocesses a benchmark runs (daemons, llama-server, the gateway): a free port to put
them on, polling until they answer, and stopping them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_env(work_dir: Path, log_level: str = "warning") -> dict[str, str]:
    """The environment of a `hicache serve` a benchmark starts: this one without the user's
    HICACHE_* settings (they would change what is measured) but for the model cache (the
    converted GGUF), its default L3 under ``work_dir``/xdg, unbuffered logs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    env.update(
        XDG_CACHE_HOME=str(work_dir / "xdg"), HICACHE_LOG_LEVEL=log_level, PYTHONUNBUFFERED="1"
    )
    return env


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout_s: float = 300.0,
    interval_s: float = 0.3,
    proc: subprocess.Popen | None = None,
    retry_on: tuple[type[BaseException], ...] = (OSError,),
) -> float:
    """Calls ``ready`` every ``interval_s`` until it returns True; the seconds that took.
    An exception of ``retry_on`` counts as not ready yet. RuntimeError when ``proc`` exits
    first; TimeoutError after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready")
        try:
            if ready():
                return time.monotonic() - t0
        except retry_on:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not ready in {timeout_s:.0f}s")
        time.sleep(interval_s)


def stop_process(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> int | None:
    """SIGTERM (a daemon drains), then wait; killed after ``timeout_s``. The exit code, None
    when it had to be killed or never started."""
    if proc is None:
        return None
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
