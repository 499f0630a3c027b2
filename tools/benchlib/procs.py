"""The subprocesses a benchmark, a check or a test runs (daemons, llama-server, the gateway): a
free port to put them on, a log file for their output, polling until they answer, and stopping
them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repo root


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_env(work_dir: Path, log_level: str = "warning") -> dict[str, str]:
    """The environment of a `hicache serve` a tool or test starts: this one without the user's
    HICACHE_* settings (they would change what is measured) but for the model cache (the
    converted GGUF), its default L3 under ``work_dir``/xdg, unbuffered logs, and this checkout
    first on the import path (it runs in a work dir of its own)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(
        XDG_CACHE_HOME=str(work_dir / "xdg"),
        HICACHE_LOG_LEVEL=log_level,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=path,
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


class Process:
    """A subprocess whose output goes to ``log``, a restarted one's appended (NOTE: never an
    unread pipe, which blocks the process once full)."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, argv: list[str], **popen_kw: Any) -> None:
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen_kw)

    def wait_ready(
        self,
        ready: Callable[[], bool],
        what: str,
        timeout_s: float,
        retry_on: tuple[type[BaseException], ...] = (OSError,),
        interval_s: float = 0.2,
    ) -> float:
        """``wait_until(ready)`` on this process: the seconds it took. RuntimeError with the
        log's tail when it exits or times out first."""
        try:
            return wait_until(ready, what, timeout_s, interval_s, self.proc, retry_on)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code (None: killed, or never
        started)."""
        return stop_process(self.proc, timeout_s)

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""
