"""--kv-events-config: vLLM's KVEventsConfig JSON, checked when the settings load (the
publisher itself is engine/server/kv_events_zmq.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig fields (the ones that apply here)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null" (none)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """From --kv-events-config's JSON; ValueError naming the bad key."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            # NOTE: bad input is a ValueError everywhere in the settings
            raise ValueError("kv_events_config must be a JSON object")  # noqa: TRY004
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        types: dict[str, type | tuple[type, ...]] = {
            "enable_kv_cache_events": bool,
            "publisher": str,
            "endpoint": str,
            "replay_endpoint": (str, type(None)),
            "buffer_steps": int,
            "hwm": int,
            "topic": str,
        }
        for k, v in raw.items():
            if not isinstance(v, types[k]) or (types[k] is int and isinstance(v, bool)):
                raise ValueError(f"kv_events_config.{k}: wrong type {type(v).__name__}")
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(
                f"kv_events_config.publisher must be 'zmq' or 'null', got {cfg.publisher!r}"
            )
        if cfg.buffer_steps < 1 or cfg.hwm < 0:
            raise ValueError("kv_events_config: buffer_steps must be >= 1 and hwm >= 0")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"
