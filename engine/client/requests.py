"""The request messages of the daemon's RPCs, built from plain Python values (prompts as text,
token ids or chat messages; tiers by name): what HicacheClient and AsyncHicacheClient send, for
callers that use the stubs themselves too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.server.pb import EVENT_TO_ENUM, TIER_TO_ENUM, admin_pb2, common_pb2, gen_pb2

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PromptLike = str | list[int] | list[dict[str, str]]
_SAMPLING = {f.name for f in gen_pb2.SamplingParams.DESCRIPTOR.fields}


def _is_chat(prompt: list[int] | list[dict[str, str]]) -> TypeIs[list[dict[str, str]]]:
    return bool(prompt) and all(isinstance(m, dict) for m in prompt)


def make_prompt(prompt: PromptLike, chat: bool = False) -> common_pb2.Prompt:
    """text, token ids, or chat messages ([{"role", "content"}]); chat=True wraps a text as one
    user message."""
    if isinstance(prompt, str):
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        else:
            return common_pb2.Prompt(text=prompt)
    if _is_chat(prompt):
        return common_pb2.Prompt(
            chat=common_pb2.ChatMessages(
                messages=[
                    common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt
                ]
            )
        )
    return common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=list(prompt)))


def generate_request(
    prompt: PromptLike,
    chat: bool = False,
    namespace: str = "",
    request_id: str = "",
    **sampling: Any,
) -> gen_pb2.GenerateRequest:
    unknown = sorted(set(sampling) - _SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return gen_pb2.GenerateRequest(
        prompt=make_prompt(prompt, chat),
        cache_namespace=namespace,
        request_id=request_id,
        sampling_params=gen_pb2.SamplingParams(
            **{k: v for k, v in sampling.items() if v is not None}
        ),
    )


def evict_request(
    tier: str = "l1",
    num_tokens: int | None = None,
    prefix: PromptLike | None = None,
    all: bool = False,
    namespace: str = "",
    dry_run: bool = False,
    chat: bool = False,
) -> admin_pb2.EvictRequest:
    req = admin_pb2.EvictRequest(
        tier=TIER_TO_ENUM[tier], cache_namespace=namespace, dry_run=dry_run
    )
    if num_tokens is not None:
        req.num_tokens = num_tokens
    elif prefix is not None:
        req.prefix.CopyFrom(make_prompt(prefix, chat))
    else:
        req.all = True
    return req


def flush_request(
    tiers: list[str] | None = None, timeout_s: float | None = None
) -> admin_pb2.FlushRequest:
    req = admin_pb2.FlushRequest(tiers=[TIER_TO_ENUM[t] for t in tiers or []])
    if timeout_s is not None:
        req.timeout_s = timeout_s
    return req


def detach_request(timeout_s: float | None = None) -> admin_pb2.DetachStorageRequest:
    req = admin_pb2.DetachStorageRequest()
    if timeout_s is not None:
        req.timeout_s = timeout_s
    return req


def unpin_request(pin_id: str | None = None) -> admin_pb2.UnpinRequest:
    return admin_pb2.UnpinRequest(pin_id=pin_id) if pin_id else admin_pb2.UnpinRequest(all=True)


def watch_request(
    after_seq: int | None = None, kinds: list[str] | None = None, tiers: list[str] | None = None
) -> admin_pb2.WatchCacheEventsRequest:
    req = admin_pb2.WatchCacheEventsRequest(
        kinds=[EVENT_TO_ENUM[k] for k in kinds or []], tiers=[TIER_TO_ENUM[t] for t in tiers or []]
    )
    if after_seq is not None:
        req.after_seq = after_seq
    return req
