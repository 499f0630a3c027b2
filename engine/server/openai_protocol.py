"""The OpenAI API's shapes at the HTTP edge: a JSON body is checked into an engine prompt and a
sampling dict (every error names its `param`), and stream chunks are built back into
completions, chunks, usage and errors.

    req = parse_chat(body, vocab_size)        # or parse_completion(body, vocab_size)
    chat_response(rid, model, created, text, final_chunk)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.server import validate
from engine.server.validate import MAX_STOP_LEN, MAX_STOP_STRINGS, MAX_TEXT_CHARS, shown

# OpenAI's "developer" role is the newer name of "system"; chat templates know only the latter.
ROLE_ALIASES = {"developer": "system"}

# Fields we do not implement, and the values that mean "not used" (anything else is a 400, not
# a silently different answer).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),  # "auto" with no tools is "none"
    "response_format": (None, {"type": "text"}),
}


class InvalidRequestError(validate.ValidationError):
    """A bad request body (HTTP 400, type invalid_request_error); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    """A checked /v1/completions or /v1/chat/completions body."""

    model: str | None  # None: the one model
    prompt: str | list[int] | list[dict[str, str]]  # chat: messages for the chat template
    params: dict[str, Any]  # engine sampling_params (engine.runtime.sampling.SamplingParams keys)
    stream: bool
    include_usage: bool  # stream_options.include_usage
    namespace: str | None  # cache_namespace as asked (the tenant rules apply later)


# --- request fields ---------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise InvalidRequestError(f"{key} must be a finite number, got {shown(v)}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, low: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v < low:
        raise InvalidRequestError(f"{key} must be an integer >= {low}, got {shown(v)}", key)
    return int(v)


def _bool(body: dict[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise InvalidRequestError(f"{key} must be a boolean, got {shown(v)}", key)
    return v


def _token_ids(ids: list[Any], vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise InvalidRequestError(f"{param} is empty", param)
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"{param}[{i}] = {shown(t)} is not a token id in [0, {vocab_size})", param
            )
    return list(ids)


def _stop(v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list):
        raise InvalidRequestError("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"stop has {len(stops)} strings; the limit is {MAX_STOP_STRINGS}", "stop"
        )
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise InvalidRequestError(
                f"stop[{i}] must be a string of 1..{MAX_STOP_LEN} characters, got {shown(s)}",
                "stop",
            )
    return stops


def sampling(body: dict[str, Any], vocab_size: int, max_context_len: int) -> dict[str, Any]:
    """The engine's sampling_params from OpenAI's fields (and vLLM's extensions top_k, min_p,
    ignore_eos, skip_special_tokens, stop_token_ids), range-checked as the gRPC edge does."""
    out: dict[str, Any] = {}
    budget = _int(body, "max_completion_tokens", 1)
    budget = budget if budget is not None else _int(body, "max_tokens", 1)
    # NOTE: without a budget a request may fill the context (the engine clips the budget to
    # the room its prompt leaves), as OpenAI's chat API does; the engine's own default is 128.
    out["max_new_tokens"] = budget if budget is not None else max_context_len
    temperature = _number(body, "temperature")
    if temperature is not None:
        if temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {temperature:g}", "temperature"
            )
        out["temperature"] = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p:g}", "top_p")
        out["top_p"] = top_p
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or (top_k < 1 and top_k != -1):
            raise InvalidRequestError(
                f"top_k must be -1 (off) or >= 1, got {shown(top_k)}", "top_k"
            )
        out["top_k"] = top_k
    min_p = _number(body, "min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {min_p:g}", "min_p")
        out["min_p"] = min_p
    seed = _int(body, "seed", 0)
    if seed is not None:
        out["seed"] = seed
    if body.get("stop") is not None:
        stops = _stop(body["stop"])
        if stops:
            out["stop"] = stops
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list):
            raise InvalidRequestError(
                "stop_token_ids must be a list of token ids", "stop_token_ids"
            )
        if ids:
            out["stop_token_ids"] = _token_ids(ids, vocab_size, "stop_token_ids")
    for key in ("ignore_eos", "skip_special_tokens"):
        flag = _bool(body, key)
        if flag is not None:
            out[key] = flag
    return out


def _common(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"model must be a string, got {shown(model)}", "model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise InvalidRequestError(f"only n=1 is supported, got n={shown(n)}", "n")
    for key, unused in UNSUPPORTED.items():
        if body.get(key, None) not in unused:
            raise InvalidRequestError(f"{key} is not supported by this server", key)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequestError(f"user must be a string, got {shown(user)}", "user")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", "stream_options")
    include_usage = _bool(options or {}, "include_usage") or False
    ns = body.get("cache_namespace")
    if ns is not None and not isinstance(ns, str):
        raise InvalidRequestError(
            f"cache_namespace must be a string, got {shown(ns)}", "cache_namespace"
        )
    try:
        namespace = validate.namespace(ns or "")
    except validate.ValidationError as e:
        raise InvalidRequestError(str(e), "cache_namespace") from None
    return {
        "model": model,
        "stream": _bool(body, "stream") or False,
        "include_usage": include_usage,
        "namespace": namespace,
    }


def _content(content: Any, role: str, param: str) -> str:
    """A message's text: a string, or the text parts of a list joined by newlines."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of text parts", param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else part
            raise InvalidRequestError(
                f"{param}[{i}]: only text parts are supported, got {shown(kind)}", param
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{param}[{i}].text must be a string", param)
        texts.append(part["text"])
    return "\n".join(texts)


def parse_chat(body: Any, vocab_size: int, max_context_len: int) -> ParsedRequest:
    common = _common(body)
    msgs = body.get("messages")
    if msgs is None:
        raise InvalidRequestError("messages is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequestError("messages must be a non-empty list of messages", "messages")
    out: list[dict[str, str]] = []
    chars = 0
    for i, m in enumerate(msgs):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{param} must be an object with role and content", param)
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in validate.CHAT_ROLES:
            raise InvalidRequestError(
                f"{param}.role must be one of {', '.join(validate.CHAT_ROLES)} or developer, "
                f"got {shown(m.get('role'))}",
                f"{param}.role",
            )
        text = _content(m.get("content"), role, f"{param}.content")
        chars += len(text)
        out.append({"role": role, "content": text})
    if chars > MAX_TEXT_CHARS:
        raise InvalidRequestError(
            f"messages have {chars} characters; the limit is {MAX_TEXT_CHARS}", "messages"
        )
    return ParsedRequest(prompt=out, params=sampling(body, vocab_size, max_context_len), **common)


def parse_completion(body: Any, vocab_size: int, max_context_len: int) -> ParsedRequest:
    common = _common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequestError("prompt is required", "prompt")
    # OpenAI's prompt may be a batch (a list of strings or of token lists): one item only here.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError(
                "batched prompts are not supported: send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(prompt) > MAX_TEXT_CHARS:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} characters; the limit is {MAX_TEXT_CHARS}", "prompt"
            )
    elif isinstance(prompt, list):
        prompt = _token_ids(prompt, vocab_size, "prompt")
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
    return ParsedRequest(
        prompt=prompt, params=sampling(body, vocab_size, max_context_len), **common
    )


# --- responses --------------------------------------------------------------------------------
def usage(chunk: Any) -> dict[str, Any]:
    """OpenAI's usage from a StreamChunk; the per-tier split of the cache hit is our addition."""
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": chunk.cached_tokens,
            "cached_tokens_per_tier": dict(chunk.cached_tokens_per_tier),
        },
    }


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def chat_response(rid: str, model: str, created: int, text: str, last: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }
        ],
        "usage": usage(last),
    }


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def completion_response(rid: str, model: str, created: int, text: str, last: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        ],
        "usage": usage(last),
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish_reason: str | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(first: dict[str, Any], last: Any) -> dict[str, Any]:
    """stream_options.include_usage: a last chunk with no choices and the usage."""
    return {**first, "choices": [], "usage": usage(last)}
