"""The daemon under test: `hicache serve` (tools/benchlib/daemon.py) with the soak's small pools
and its L3 dir, checking its invariants, restartable on the same port and L3 dir."""

from __future__ import annotations

from pathlib import Path

from tools.benchlib.daemon import Daemon
from tools.soaklib.config import SoakConfig


class DaemonProcess(Daemon):
    """`hicache serve` of ``cfg`` on a free port (gRPC only), its L3 in ``l3_dir``, its log and
    working directory ``work_dir``."""

    def __init__(self, cfg: SoakConfig, work_dir: Path, l3_dir: Path, name: str = "daemon") -> None:
        args = ["--hicache-storage-dir", str(l3_dir), "--hicache-prefetch-threshold", "0"]
        args += ["--hicache-storage-size-gb", f"{cfg.l3_cap_mb / 1024:.6f}"]
        args += ["--hicache-storage-page-size", str(cfg.storage_object_tokens)]
        args += ["--hicache-ratio", str(cfg.hicache_ratio), "--page-size", str(cfg.page_size)]
        args += ["--max-total-tokens", str(cfg.max_total_tokens)]
        args += ["--max-queued-requests", str(cfg.max_queued_requests)]
        args += ["--grace-period-s", str(cfg.grace_period_s), "--debug-check-invariants"]
        super().__init__(
            work_dir,
            [*args, *cfg.extra_args],
            model=cfg.model,
            http=False,
            name=name,
            log_level="info",
        )
        self.cfg = cfg

    def wait_serving(self, timeout_s: float | None = None) -> float:
        return super().wait_serving(timeout_s or self.cfg.startup_timeout_s)

    def stop(self, timeout_s: float | None = None) -> int | None:
        return super().stop(timeout_s or self.cfg.grace_period_s + 60)
