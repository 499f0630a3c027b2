"""The soak's per-round figure (--plot): TTFT p50 / p99, calls by status code, daemon RSS,
with the faults injected in each round as the x tick labels.

    .venv/bin/python -m tools.soaklib.plot soak.json soak.png   # again from a soak's JSON
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from tools.benchlib import save_figure, subplots

CODE_COLORS = {
    "OK": "tab:green",
    "RESOURCE_EXHAUSTED": "tab:orange",
    "CANCELLED": "tab:gray",
    "DEADLINE_EXCEEDED": "tab:purple",
    "ALREADY_EXISTS": "tab:blue",
    "UNAVAILABLE": "tab:red",
    "FAILED_PRECONDITION": "tab:olive",
    "NOT_FOUND": "tab:cyan",
}


def round_labels(res: dict[str, Any]) -> list[str]:
    """Per round: its fault group ("clean" without one); skipped faults marked with '*'."""
    skipped = res.get("faults_skipped", {})
    return [
        "+".join(f + ("*" if f in skipped else "") for f in r["faults"]) or "clean"
        for r in res["rounds"]
    ]


def plot_rounds(res: dict[str, Any], path: str) -> None:
    rounds = res["rounds"]
    fig, ax = subplots(3, 1, figsize=(max(9.0, 0.4 * len(rounds) + 6), 9), sharex=True)
    _ttft(ax[0], rounds)
    _codes(ax[1], rounds)
    _rss(ax[2], rounds, res.get("config", {}))
    xs = list(range(len(rounds)))
    ax[2].set_xticks(
        xs, [f"{i}: {lab}" for i, lab in enumerate(round_labels(res))], rotation=40, ha="right"
    )
    ax[2].set_xlabel(
        "round: fault injected" + (" (* skipped)" if res.get("faults_skipped") else "")
    )
    for a in ax:
        a.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    verdict = "PASSED" if res.get("passed") else "FAILED"
    model = os.path.basename((res.get("config", {}).get("model") or "").rstrip("/"))
    fig.suptitle(
        f"hicache soak: {res['requests']} calls in {res['seconds']:.0f}s, "
        f"{len(rounds)} rounds, {model or 'SmolLM2-135M-Instruct'}: {verdict}"
    )
    save_figure(fig, path)


def _ttft(ax: Any, rounds: list[dict[str, Any]]) -> None:
    def ms(r: dict[str, Any], q: str) -> float:
        v = r.get("ttft_s", {}).get(q)
        return math.nan if v is None else v * 1000

    xs = list(range(len(rounds)))
    ax.plot(xs, [ms(r, "p50") for r in rounds], "o-", label="p50")
    ax.plot(xs, [ms(r, "p99") for r in rounds], "s--", label="p99")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT of plain Generate streams")


def _codes(ax: Any, rounds: list[dict[str, Any]]) -> None:
    """Stacked bars: OK at the bottom, then the other codes, most frequent first."""
    totals: dict[str, int] = {}
    for r in rounds:
        for code, n in r["codes"].items():
            totals[code] = totals.get(code, 0) + n
    xs = list(range(len(rounds)))
    bottom = [0] * len(rounds)
    for code in sorted(totals, key=lambda k: (k != "OK", -totals[k])):
        ns = [r["codes"].get(code, 0) for r in rounds]
        ax.bar(xs, ns, bottom=bottom, color=CODE_COLORS.get(code), label=f"{code} ({totals[code]})")
        bottom = [b + n for b, n in zip(bottom, ns)]
    ax.set_ylabel("calls")
    ax.set_title("calls by status code (all RPCs)")


def _rss(ax: Any, rounds: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    xs = list(range(len(rounds)))
    ax.plot(xs, [r["rss_kb"] / 1024 for r in rounds], "o-", color="tab:brown", label="RSS")
    if len(rounds) >= 2 and rounds[-1]["pid"] == rounds[-2]["pid"] and "rss_tolerance_mb" in cfg:
        # NOTE: the rule of checks.rss_verdict: the last round within this of the one before
        a = rounds[-2]["rss_kb"]
        tol = max(cfg["rss_tolerance_mb"] * 1024, cfg["rss_tolerance_frac"] * a)
        ax.fill_between(
            [xs[-2], xs[-1]],
            a / 1024,
            (a + tol) / 1024,
            color="tab:green",
            alpha=0.15,
            label=f"allowed growth, last round ({tol / 1024:.0f} MiB)",
        )
    restarts = [i - 0.5 for i in xs[1:] if rounds[i]["pid"] != rounds[i - 1]["pid"]]
    for k, x in enumerate(restarts):
        ax.axvline(
            x,
            color="gray",
            linestyle=":",
            linewidth=1,
            label="daemon restarted" if k == 0 else None,
        )
    ax.set_ylabel("daemon RSS (MiB)")
    ax.set_title("daemon RSS after the round")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot_rounds(json.load(f), sys.argv[2])
