"""The reference check: every answer the soak was served, compared with the same prompt computed
alone on a fresh daemon at the same settings. A cache never changes the answer: whether the
prefix was computed now, came from L1, L2, L3 or a restart, and whichever requests shared the
forward, the tokens are those of the prompt computed alone.

Which answers: greedy ones (temperature 0) and sampled ones with a seed, whole or partial.
Sampled answers without a seed are counted, not checked. One reference per distinct (prompt,
sampling params but max_new_tokens), computed at the longest max_new_tokens asked for it, since
max_new_tokens only cuts an answer short (greedy; a seeded request draws once per token from its
own generator):

    reference  r0 r1 r2 r3 r4 r5 r6 r7            (max over the answers: 8)
    whole      r0 r1 r2 r3 r4                     (finished STOP / LENGTH, max_new_tokens 5)
    partial    r0 r1                              (cancelled / deadline / aborted / killed: a
                                                   prefix as long as what arrived)

The reference daemon (ReferenceDaemon) is the soaked daemon's own command line and environment
with an empty L3 dir of its own; it serves one request at a time, each in a namespace of its own
so that no reference reuses another's prefix (its cached_tokens must be 0). Its ServerArgs, as
GetServerInfo reports them, must equal the soaked daemon's but for the L3 dir.
"""

from __future__ import annotations

import collections
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.client import HicacheClient
from tools.soaklib.calls import FINISH
from tools.soaklib.config import RPC_TIMEOUT_S, STREAM_TIMEOUT_S, SoakConfig
from tools.soaklib.daemon import DaemonProcess
from tools.soaklib.recorder import Answer, FaultEvent, Recorder

AROUND_S = 10.0  # a fault this long before an answer started is "around" it
Key = tuple[tuple[int, ...], tuple[tuple[str, Any], ...]]  # (prompt, sampling but max_new)
# (prompt token ids, sampling params with max_new_tokens) -> the answer's token ids
Compute = Callable[[list[int], dict[str, Any]], list[int]]


def reference_key(a: Answer) -> Key | None:
    """What determines the answer's tokens; None for a sampled answer without a seed."""
    sp = dict(a.sampling)
    if "max_new_tokens" not in sp:
        raise ValueError(
            f"answer #{a.seq} ({a.variant}) has no max_new_tokens: the reference "
            "check needs it to know where a whole answer ends"
        )
    temperature = sp.get("temperature")  # unset: the engine's default, 1.0 (sampled)
    if (temperature is None or temperature > 0) and sp.get("seed") is None:
        return None
    return a.prompt, tuple((k, v) for k, v in a.sampling if k != "max_new_tokens")


def served_from(a: Answer) -> list[str]:
    """The tiers the answer's cached prefix came from; ["none"] for none, ["unknown"] without
    usage (a stream cut short)."""
    if a.cached is None:
        return ["unknown"]
    return [t for t, k in zip(("l1", "l2", "l3"), a.cached) if k] or ["none"]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter's length if one is a
    prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass(frozen=True)
class Mismatch:
    """One answer that differs from its prompt computed alone."""

    prompt_id: str  # "p<k> crc32 <hex>": stable within a run; the tokens are in to_dict()
    answer: Answer
    expected: tuple[int, ...]  # the reference, cut as the answer should be
    position: int  # the first differing token
    faults: tuple[str, ...]  # the faults injected around it

    def mode(self) -> str:
        sp = dict(self.answer.sampling)
        if not sp.get("temperature"):
            return "greedy"
        return "sampled " + " ".join(
            f"{k}={sp[k]}" for k in ("temperature", "top_p", "top_k", "min_p", "seed") if k in sp
        )

    def describe(self) -> str:
        a, i = self.answer, self.position
        how = "whole" if a.whole else f"partial: {a.code} {a.finish or 'no complete'}"
        cached = (
            "no usage"
            if a.cached is None
            else f"l1={a.cached[0]} l2={a.cached[1]} l3={a.cached[2]} of {a.cached[3]}"
        )
        return (
            f"{a.phase or 'soak'}: prompt {self.prompt_id} ({len(a.prompt)} tokens, "
            f"namespace {a.namespace or 'default'}), answer #{a.seq} {a.variant}"
            f"{' ' + a.rid if a.rid else ''} ({how}, {self.mode()}, "
            f"{dict(a.sampling)['max_new_tokens']} new tokens asked): first difference at "
            f"token {i}: served {list(a.ids[max(0, i - 2) : i + 3])} vs alone "
            f"{list(self.expected[max(0, i - 2) : i + 3])} (from token {max(0, i - 2)}; "
            f"{len(a.ids)} served, {len(self.expected)} expected); served cached {cached}; "
            f"faults around it: {', '.join(self.faults) or 'none'}"
        )

    def to_dict(self) -> dict[str, Any]:
        a = self.answer
        return {
            "prompt_id": self.prompt_id,
            "answer": a.seq,
            "variant": a.variant,
            "rid": a.rid,
            "namespace": a.namespace,
            "phase": a.phase,
            "whole": a.whole,
            "code": a.code,
            "finish": a.finish,
            "sampling": dict(a.sampling),
            "cached_l1_l2_l3_of": a.cached,
            "position": self.position,
            "faults": list(self.faults),
            "served": list(a.ids),
            "expected": list(self.expected),
            "prompt": list(a.prompt),
            "describe": self.describe(),
        }


@dataclass
class ReferenceReport:
    answers: int = 0  # recorded
    checked: int = 0  # compared with a reference
    whole: int = 0
    partial: int = 0
    greedy: int = 0
    seeded: int = 0
    unseeded: int = 0  # sampled without a seed: not checked
    empty: int = 0  # partial with no token (refused, cancelled first): nothing to compare
    references: int = 0  # computed, one per distinct (prompt, sampling params)
    # checked answers by where their prefix came from (an answer counts for each tier it used)
    served_from: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)

    def to_dict(self, max_mismatches: int = 200) -> dict[str, Any]:
        """The counts, the mismatches counted by "variant mode tiers" (e.g. "plain greedy
        l1+l3"), and the first ``max_mismatches`` in full."""
        out = {
            k: getattr(self, k)
            for k in (
                "answers",
                "checked",
                "whole",
                "partial",
                "greedy",
                "seeded",
                "unseeded",
                "empty",
                "references",
            )
        }
        kinds = collections.Counter(
            f"{m.answer.variant} {m.mode().split()[0]} {'+'.join(served_from(m.answer))}"
            for m in self.mismatches
        )
        out.update(
            served_from=dict(self.served_from),
            seconds=round(self.seconds, 1),
            mismatch_count=len(self.mismatches),
            mismatch_kinds=dict(kinds.most_common()),
            mismatches=[m.to_dict() for m in self.mismatches[:max_mismatches]],
        )
        return out


def faults_around(
    a: Answer, faults: Sequence[FaultEvent], around_s: float = AROUND_S
) -> tuple[str, ...]:
    """The faults injected from ``around_s`` before the answer started until it ended."""
    out = []
    for f in faults:
        if f.t1 < a.t0 - around_s or f.t0 > a.t1:
            continue
        if f.t1 < a.t0:
            out.append(f"{f.name} (ended {a.t0 - f.t1:.1f}s before it started)")
        elif f.t0 <= a.t0:
            out.append(f"{f.name} (under way when it started)")
        else:
            out.append(f"{f.name} (began {f.t0 - a.t0:.1f}s after it started)")
    return tuple(out)


def check_answers(
    answers: Sequence[Answer],
    compute: Compute,
    faults: Sequence[FaultEvent] = (),
    progress: Callable[[int, int], None] | None = None,
) -> ReferenceReport:
    """Compares every checkable answer with its reference, ``compute(prompt, sampling)``,
    called once per distinct (prompt, sampling params but max_new_tokens) in the order the
    answers arrived. ``progress(done, total)`` after each reference."""
    t_start = time.monotonic()
    rep = ReferenceReport(answers=len(answers))
    groups: dict[Key, list[Answer]] = {}
    for a in answers:
        key = reference_key(a)
        if key is None:
            rep.unseeded += 1
        elif not a.whole and not a.ids:
            rep.empty += 1
        else:
            groups.setdefault(key, []).append(a)
    prompt_ids: dict[tuple[int, ...], str] = {}
    for n, ((prompt, params), group) in enumerate(groups.items()):
        pid = prompt_ids.setdefault(
            prompt, f"p{len(prompt_ids)} crc32 {zlib.crc32(repr(prompt).encode()):08x}"
        )
        longest = max(dict(a.sampling)["max_new_tokens"] for a in group)
        ref = list(compute(list(prompt), {**dict(params), "max_new_tokens": longest}))
        rep.references += 1
        for a in group:
            rep.checked += 1
            rep.whole += a.whole
            rep.partial += not a.whole
            sampled = bool(dict(a.sampling).get("temperature"))
            rep.greedy += not sampled
            rep.seeded += sampled
            rep.served_from.update(served_from(a))
            expected = ref[: dict(a.sampling)["max_new_tokens"]] if a.whole else ref[: len(a.ids)]
            if list(a.ids) != expected:
                rep.mismatches.append(
                    Mismatch(
                        pid,
                        a,
                        tuple(expected),
                        first_difference(a.ids, expected),
                        faults_around(a, faults),
                    )
                )
        if progress is not None:
            progress(n + 1, len(groups))
    rep.seconds = time.monotonic() - t_start
    return rep


def flag_mismatches(rec: Recorder, report: ReferenceReport) -> None:
    """Each mismatch is a violation: the soak fails (exit status 1)."""
    for m in report.mismatches:
        rec.violate("reference mismatch", m.describe())


def engine_config(info: Any) -> dict[str, str]:
    """A GetServerInfo response's ServerArgs (JSON-encoded values), but the L3 dir."""
    return {
        k: v
        for k, v in info.config.items()
        if not k.startswith(("daemon.", "process.")) and k != "hicache_storage_dir"
    }


class ReferenceDaemon:
    """A fresh `hicache serve` started as the soaked one is (its argv and environment, the
    same XDG cache, so the same converted model and kernels) but on its own port and an empty
    L3 dir; ``compute`` asks it one request at a time, each in a namespace of its own."""

    def __init__(self, cfg: SoakConfig, work_dir: Path) -> None:
        self.l3_dir = work_dir / "reference-l3"
        self.daemon = DaemonProcess(cfg, work_dir, self.l3_dir, name="reference")
        self._client: HicacheClient | None = None
        self._n = 0

    def start(self) -> float:
        """Seconds until SERVING."""
        shutil.rmtree(self.l3_dir, ignore_errors=True)  # a kept --work-dir's last run
        self.l3_dir.mkdir(parents=True)
        self.daemon.start()
        took = self.daemon.wait_serving()
        self._client = HicacheClient(self.daemon.addr, timeout=RPC_TIMEOUT_S)
        return took

    def engine_config(self) -> dict[str, str]:
        assert self._client is not None
        return engine_config(self._client.server_info())

    def compute(self, prompt: list[int], sampling: dict[str, Any]) -> list[int]:
        """The prompt's answer computed alone (RuntimeError if any of it came from a cache or
        the answer did not finish)."""
        assert self._client is not None
        self._n += 1
        _, ids, done = self._client.generate_text(
            prompt, namespace=f"reference-{self._n}", timeout=STREAM_TIMEOUT_S, **sampling
        )
        finish = FINISH.get(done.finish_reason, "?")
        if done.usage.cached_tokens or finish not in ("STOP", "LENGTH"):
            raise RuntimeError(
                f"reference {self._n} not computed alone and whole: cached "
                f"{done.usage.cached_tokens} tokens, finish {finish} "
                f"{done.abort_message!r}"
            )
        return ids

    def stop(self) -> int | None:
        """The daemon's exit status (None if it had to be killed)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        return self.daemon.stop()

    def log_problems(self) -> list[str]:
        return self.daemon.log_problems()
