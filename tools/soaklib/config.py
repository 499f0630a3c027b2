"""The soak's configuration: one frozen dataclass, the fault names, the client deadlines."""

from __future__ import annotations

from dataclasses import dataclass

ALL_FAULTS = ("corrupt", "delete", "readonly", "diskfull", "kill9", "sigterm")
RPC_TIMEOUT_S = 60.0  # unary calls; a DEADLINE_EXCEEDED at this deadline is a hang
STREAM_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class SoakConfig:
    model: str | None = None  # None: the daemon's embedded default (SmolLM2-135M-Instruct)
    duration_s: float = 180.0
    round_s: float = 30.0
    clients: int = 8
    seed: int = 0
    # fault groups, one per faulty round; "a+b" injects a and b in the same round
    faults: tuple[str, ...] = ALL_FAULTS
    fault_hold_s: float = 6.0  # how long readonly / diskfull last
    # the daemon: small pools for memory pressure
    max_total_tokens: int = 2048
    page_size: int = 16
    hicache_ratio: float = 2.0
    storage_object_tokens: int = 16
    l3_cap_mb: int = 512
    l3_fs_mb: int = 768  # the tmpfs (as root) holding L3: larger than the cap
    max_queued_requests: int = 6
    grace_period_s: float = 30.0
    extra_args: tuple[str, ...] = ()
    # the workload (tokens)
    prefix_tokens: tuple[int, int] = (64, 192)
    question_tokens: tuple[int, int] = (8, 48)
    max_new_tokens: int = 24
    max_prompt_tokens: int = 700
    check_prompts: int = 4
    check_new_tokens: int = 16
    # memory: last two rounds' RSS may differ by at most max(mb, frac x the first)
    rss_tolerance_mb: float = 48.0
    rss_tolerance_frac: float = 0.05
    startup_timeout_s: float = 600.0
    work_dir: str | None = None  # None: a fresh temp dir, removed at the end
