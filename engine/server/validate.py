"""Request validation at the gRPC edge: every error names the field and the rule it broke."""

from __future__ import annotations

import math
import re
from typing import Any

from engine.server.pb import ENUM_TO_TIER, common_pb2, gen_pb2

NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 32
MAX_STOP_LEN = 512
MAX_TEXT_CHARS = 4_000_000


class ValidationError(ValueError):
    """An invalid request field (maps to INVALID_ARGUMENT)."""


def shown(value: object, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters, for an error message: a status message that
    echoed a long request value would pass gRPC's metadata limit (the client would then get
    RESOURCE_EXHAUSTED instead of our code)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def namespace(value: str, field: str = "cache_namespace") -> str | None:
    if value == "":
        return None
    if not NAMESPACE_RE.match(value):
        raise ValidationError(f"{field} must match [A-Za-z0-9_.-]{{1,64}}, got {value[:80]!r}")
    return value


def request_id(value: str, field: str = "request_id") -> str:
    if not REQUEST_ID_RE.match(value):
        raise ValidationError(f"{field} must match [A-Za-z0-9_.:-]{{1,128}}, got {value[:80]!r}")
    return value


def prompt(
    p: common_pb2.Prompt, present: bool, vocab_size: int, field: str = "prompt"
) -> str | list[int] | list[dict[str, str]]:
    """The engine-side prompt: text, token ids, or chat messages."""
    kind = p.WhichOneof("input") if present else None
    if kind is None:
        raise ValidationError(f"{field} is required (one of text, chat, token_ids)")
    if kind == "text":
        if not p.text:
            raise ValidationError(f"{field}.text is empty")
        if len(p.text) > MAX_TEXT_CHARS:
            raise ValidationError(
                f"{field}.text has {len(p.text)} characters; the limit is {MAX_TEXT_CHARS}"
            )
        return p.text
    if kind == "token_ids":
        ids = list(p.token_ids.ids)
        if not ids:
            raise ValidationError(f"{field}.token_ids.ids is empty")
        bad = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
        if bad is not None:
            raise ValidationError(
                f"{field}.token_ids.ids[{bad}] = {ids[bad]} is out of the "
                f"vocabulary [0, {vocab_size})"
            )
        return ids
    msgs = list(p.chat.messages)
    if not msgs:
        raise ValidationError(f"{field}.chat.messages is empty")
    out = []
    for i, m in enumerate(msgs):
        if m.role not in CHAT_ROLES:
            raise ValidationError(
                f"{field}.chat.messages[{i}].role must be one of "
                f"{', '.join(CHAT_ROLES)}, got {shown(m.role)}"
            )
        out.append({"role": m.role, "content": m.content})
    return out


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise ValidationError(f"sampling_params.{name} must be a finite number, got {v}")
    return v


def sampling(sp: gen_pb2.SamplingParams, vocab_size: int) -> dict[str, Any]:
    """The set fields as an engine sampling_params dict, range-checked."""
    out: dict[str, Any] = {}
    if sp.HasField("max_new_tokens"):
        if sp.max_new_tokens < 1:
            raise ValidationError(
                f"sampling_params.max_new_tokens must be >= 1, got {sp.max_new_tokens}"
            )
        out["max_new_tokens"] = sp.max_new_tokens
    if sp.HasField("temperature"):
        if _finite("temperature", sp.temperature) < 0:
            raise ValidationError(
                f"sampling_params.temperature must be >= 0, got {sp.temperature:g}"
            )
        out["temperature"] = sp.temperature
    if sp.HasField("top_p"):
        if not 0 < _finite("top_p", sp.top_p) <= 1:
            raise ValidationError(f"sampling_params.top_p must be in (0, 1], got {sp.top_p:g}")
        out["top_p"] = sp.top_p
    if sp.HasField("top_k"):
        if sp.top_k < 1 and sp.top_k != -1:
            raise ValidationError(f"sampling_params.top_k must be -1 (off) or >= 1, got {sp.top_k}")
        out["top_k"] = sp.top_k
    if sp.HasField("min_p"):
        if not 0 <= _finite("min_p", sp.min_p) <= 1:
            raise ValidationError(f"sampling_params.min_p must be in [0, 1], got {sp.min_p:g}")
        out["min_p"] = sp.min_p
    if sp.HasField("seed"):
        if sp.seed < 0:
            raise ValidationError(f"sampling_params.seed must be >= 0, got {sp.seed}")
        out["seed"] = sp.seed
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise ValidationError(
            f"sampling_params.stop has {len(sp.stop)} strings; the limit is {MAX_STOP_STRINGS}"
        )
    for i, s in enumerate(sp.stop):
        if not s or len(s) > MAX_STOP_LEN:
            raise ValidationError(
                f"sampling_params.stop[{i}] must have 1..{MAX_STOP_LEN} characters, got {len(s)}"
            )
    if sp.stop:
        out["stop"] = list(sp.stop)
    for i, t in enumerate(sp.stop_token_ids):
        if t >= vocab_size:
            raise ValidationError(
                f"sampling_params.stop_token_ids[{i}] = {t} is out of the "
                f"vocabulary [0, {vocab_size})"
            )
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        out["ignore_eos"] = True
    if sp.HasField("skip_special_tokens"):
        out["skip_special_tokens"] = sp.skip_special_tokens
    return out


def tier(value: int, field: str = "tier", default: str | None = "l1") -> str:
    if value == common_pb2.TIER_UNSPECIFIED and default is not None:
        return default
    if value not in ENUM_TO_TIER:
        raise ValidationError(f"{field} must be TIER_L1, TIER_L2 or TIER_L3, got {value}")
    return ENUM_TO_TIER[value]


def seconds(value: float, field: str, max_s: float = 7 * 24 * 3600.0) -> float:
    if not math.isfinite(value) or value < 0 or value > max_s:
        raise ValidationError(f"{field} must be a number of seconds in [0, {max_s:g}], got {value}")
    return value
