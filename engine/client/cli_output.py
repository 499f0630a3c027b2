"""Output helpers for the `hicache` CLI: JSON for machines (stable field names, `--json`), aligned
tables and `key: value` lines for people."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from google.protobuf import json_format
from google.protobuf.message import Message

from engine.server.pb import admin_pb2, common_pb2, gen_pb2

Tier = common_pb2.Tier

_SI = ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki"))


def to_dict(msg: Message) -> dict[str, Any]:
    """Every field, proto names, enums by name, 64-bit ints as numbers."""
    return json_format.MessageToDict(
        msg,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
        unquote_int64_if_possible=True,
    )


def print_json(obj: Message | dict[str, Any] | list[Any], out: TextIO = sys.stdout) -> None:
    if isinstance(obj, Message):
        obj = to_dict(obj)
    out.write(json.dumps(obj, sort_keys=False) + "\n")
    out.flush()


def enum_short(name: str) -> str:
    """TIER_L1 -> l1, FINISH_REASON_STOP -> stop, CACHE_EVENT_KIND_STORED -> stored."""
    for prefix in ("TIER_", "FINISH_REASON_", "CACHE_EVENT_KIND_", "PREFETCH_STAGE_"):
        if name.startswith(prefix):
            return name[len(prefix) :].lower()
    return name.lower()


def human_bytes(n: float) -> str:
    for scale, unit in _SI:
        if n >= scale:
            return f"{n / scale:.1f}{unit}B"
    return f"{int(n)}B"


def table(rows: list[list[Any]], header: list[str], out: TextIO = sys.stdout) -> None:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, r in enumerate(cells):
        out.write(
            "  ".join(
                c.rjust(w) if n and _numeric(c) else c.ljust(w) for c, w in zip(r, widths)
            ).rstrip()
            + "\n"
        )
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def _numeric(s: str) -> bool:
    return s.replace(".", "", 1).replace("%", "").replace("-", "", 1).isdigit()


def fields(
    pairs: list[tuple[str, Any]], section: str | None = None, out: TextIO = sys.stdout
) -> None:
    """`# Section` then `field:value` lines (redis-cli INFO style)."""
    if section:
        out.write(f"# {section}\n")
    out.writelines(f"{k}:{v}\n" for k, v in pairs)


def number(v: float) -> str:
    """An integral value as an integer (``3``, not ``3.0``); others with 3 significant digits."""
    return str(int(v)) if float(v).is_integer() else f"{v:.3g}"


# TierStats fields as table rows, in order: (row name, field, format)
_STAT_ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("capacity_tokens", "capacity_tokens", number),
    ("used_tokens", "used_tokens", number),
    ("evictable_tokens", "evictable_tokens", number),
    ("pinned_tokens", "pinned_tokens", number),
    ("hit_tokens", "hit_tokens", number),
    ("evicted_tokens", "evicted_tokens", number),
    ("promoted_tokens", "promoted_tokens", number),
    ("demoted_tokens", "demoted_tokens", number),
    ("bytes_in", "bytes_in", human_bytes),
    ("bytes_out", "bytes_out", human_bytes),
    ("errors", "errors", number),
]


def stats_report(resp: admin_pb2.GetCacheStatsResponse, out: TextIO = sys.stdout) -> None:
    """GetCacheStatsResponse as one table: a row per figure, a column per tier (l1, l2, l3).
    Each tier's own figures (``extra``) and facts (``info``) follow, one row each; a tier
    without the figure shows ``-``, a disabled tier ``off``. The engine's counters follow the
    table."""
    tiers = list(resp.tiers)
    names = [enum_short(Tier.Name(t.tier)) for t in tiers]

    def row(label: str, cell: Callable[[admin_pb2.TierStats], str]) -> list[str]:
        return [label] + [cell(t) if t.enabled else "" for t in tiers]

    def figure(fld: str, fmt: Callable[[float], str]) -> Callable[[admin_pb2.TierStats], str]:
        return lambda t: fmt(getattr(t, fld))

    def extra(key: str) -> Callable[[admin_pb2.TierStats], str]:
        fmt = human_bytes if key == "bytes" or key.endswith("_bytes") else number
        return lambda t: fmt(t.extra[key]) if key in t.extra else "-"

    def info(key: str) -> Callable[[admin_pb2.TierStats], str]:
        return lambda t: t.info.get(key, "-")

    rows = [["enabled"] + ["yes" if t.enabled else "off" for t in tiers]]
    for label, fld, fmt in _STAT_ROWS:
        rows.append(row(label, figure(fld, fmt)))
    for key in sorted({k for t in tiers for k in t.extra}):
        rows.append(row(key, extra(key)))
    for key in sorted({k for t in tiers for k in t.info}):
        rows.append(row(key, info(key)))
    table(rows, ["stat", *names], out)
    hits = resp.prompt_tokens - resp.miss_tokens
    rate = f" ({hits / resp.prompt_tokens:.1%} hit)" if resp.prompt_tokens else ""
    out.write(
        f"\nprompt_tokens: {resp.prompt_tokens}{rate}\n"
        f"miss_tokens: {resp.miss_tokens}\n"
        f"requests: {resp.requests} ({resp.finished_requests} finished, "
        f"{resp.retractions} retractions; {resp.running_requests} running, "
        f"{resp.waiting_requests} waiting)\n"
        f"pins: {resp.num_pins} ({resp.admin_pinned_tokens} tokens)\n"
    )


def server_info_report(
    info: gen_pb2.GetServerInfoResponse, tiers: str | None, out: TextIO = sys.stdout
) -> None:
    """GetServerInfoResponse as ``key: value`` lines; ``config`` (JSON-encoded values) as an
    indented block with its values decoded."""
    out.write(f"version: {info.version}\n")
    out.write(f"features: {', '.join(info.features)}\n")
    out.write(f"uptime_s: {info.uptime_s:.1f}\n")
    out.write(f"active_requests: {info.active_requests}\n")
    out.write(f"draining: {'yes' if info.draining else 'no'}\n")
    if tiers is not None:
        out.write(f"tiers: {tiers}\n")
    if info.config:
        out.write("config:\n")
        out.writelines(f"  {k}: {_config_value(info.config[k])}\n" for k in sorted(info.config))


def _config_value(raw: str) -> str:
    """A config value (JSON) for people: strings bare, null as ``none``, lists and objects as
    compact JSON."""
    try:
        v = json.loads(raw)
    except ValueError:
        return raw
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        return number(v)
    if isinstance(v, int):
        return str(v)
    return json.dumps(v, separators=(", ", ": "))
