"""Output helpers for the `hicache` CLI: JSON (stable field names), aligned tables on a TTY,
redis-style `field:value` lines when piped."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from google.protobuf import json_format
from google.protobuf.message import Message

from engine.server.pb import common_pb2

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


def stats_report(resp: Message, tty: bool, out: TextIO = sys.stdout) -> None:
    cols = [
        "capacity_tokens",
        "used_tokens",
        "evictable_tokens",
        "pinned_tokens",
        "hit_tokens",
        "evicted_tokens",
        "promoted_tokens",
        "demoted_tokens",
    ]
    if tty:
        rows = []
        for t in resp.tiers:
            name = enum_short(Tier.Name(t.tier))
            if not t.enabled:
                rows.append([name, "disabled"] + [""] * (len(cols) - 1))
                continue
            used = (
                f"{t.used_tokens} ({100 * t.used_tokens / t.capacity_tokens:.0f}%)"
                if t.capacity_tokens
                else str(t.used_tokens)
            )
            rows.append([name, t.capacity_tokens, used] + [getattr(t, c) for c in cols[2:]])
        table(rows, ["tier"] + [c.replace("_tokens", "") for c in cols], out)
        out.write(
            f"\nmiss tokens: {resp.miss_tokens}   pins: {resp.num_pins} "
            f"({resp.admin_pinned_tokens} tokens)\n"
        )
        for t in resp.tiers:
            if t.info.get("backend"):
                out.write(f"{enum_short(Tier.Name(t.tier))}: {t.info['backend']} "
                          f"{t.info.get('address', '')}\n")
        return
    for t in resp.tiers:
        name = enum_short(Tier.Name(t.tier))
        pairs = [("enabled", int(t.enabled))] + [(c, getattr(t, c)) for c in cols]
        pairs += [("bytes_in", t.bytes_in), ("bytes_out", t.bytes_out)]
        pairs += sorted(t.extra.items()) + sorted(t.info.items())
        fields(pairs, f"Tier {name}", out)
    fields(
        [
            ("miss_tokens", resp.miss_tokens),
            ("num_pins", resp.num_pins),
            ("admin_pinned_tokens", resp.admin_pinned_tokens),
        ],
        "Totals",
        out,
    )
