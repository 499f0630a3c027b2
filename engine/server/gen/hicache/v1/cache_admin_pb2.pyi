from engine.server.gen.hicache.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STAGE_UNSPECIFIED: _ClassVar[PrefetchStage]
    PREFETCH_STAGE_MATCHED: _ClassVar[PrefetchStage]
    PREFETCH_STAGE_RUNNING: _ClassVar[PrefetchStage]
    PREFETCH_STAGE_DONE: _ClassVar[PrefetchStage]

class CacheEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_EVENT_KIND_UNSPECIFIED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_STORED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_REMOVED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_DEMOTED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_PROMOTED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_CLEARED: _ClassVar[CacheEventKind]
PREFETCH_STAGE_UNSPECIFIED: PrefetchStage
PREFETCH_STAGE_MATCHED: PrefetchStage
PREFETCH_STAGE_RUNNING: PrefetchStage
PREFETCH_STAGE_DONE: PrefetchStage
CACHE_EVENT_KIND_UNSPECIFIED: CacheEventKind
CACHE_EVENT_KIND_STORED: CacheEventKind
CACHE_EVENT_KIND_REMOVED: CacheEventKind
CACHE_EVENT_KIND_DEMOTED: CacheEventKind
CACHE_EVENT_KIND_PROMOTED: CacheEventKind
CACHE_EVENT_KIND_CLEARED: CacheEventKind

class GetCacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "enabled", "capacity_tokens", "used_tokens", "evictable_tokens", "pinned_tokens", "hit_tokens", "evicted_tokens", "promoted_tokens", "demoted_tokens", "bytes_in", "bytes_out", "extra", "info", "errors")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    enabled: bool
    capacity_tokens: int
    used_tokens: int
    evictable_tokens: int
    pinned_tokens: int
    hit_tokens: int
    evicted_tokens: int
    promoted_tokens: int
    demoted_tokens: int
    bytes_in: int
    bytes_out: int
    extra: _containers.ScalarMap[str, float]
    info: _containers.ScalarMap[str, str]
    errors: int
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., enabled: _Optional[bool] = ..., capacity_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., evictable_tokens: _Optional[int] = ..., pinned_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evicted_tokens: _Optional[int] = ..., promoted_tokens: _Optional[int] = ..., demoted_tokens: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., extra: _Optional[_Mapping[str, float]] = ..., info: _Optional[_Mapping[str, str]] = ..., errors: _Optional[int] = ...) -> None: ...

class GetCacheStatsResponse(_message.Message):
    __slots__ = ("tiers", "miss_tokens", "admin_pinned_tokens", "num_pins", "timestamp", "prompt_tokens", "requests", "finished_requests", "retractions", "running_requests", "waiting_requests")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    miss_tokens: int
    admin_pinned_tokens: int
    num_pins: int
    timestamp: float
    prompt_tokens: int
    requests: int
    finished_requests: int
    retractions: int
    running_requests: int
    waiting_requests: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., miss_tokens: _Optional[int] = ..., admin_pinned_tokens: _Optional[int] = ..., num_pins: _Optional[int] = ..., timestamp: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., requests: _Optional[int] = ..., finished_requests: _Optional[int] = ..., retractions: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("prompt", "cache_namespace")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    prompt: _common_pb2.Prompt
    cache_namespace: str
    def __init__(self, prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("prompt_tokens", "matched_tokens", "matched_per_tier", "page_size")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PER_TIER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    matched_tokens: int
    matched_per_tier: _common_pb2.TierTokens
    page_size: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., matched_per_tier: _Optional[_Union[_common_pb2.TierTokens, _Mapping]] = ..., page_size: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("prompt", "cache_namespace", "pin", "pin_ttl_s")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    prompt: _common_pb2.Prompt
    cache_namespace: str
    pin: bool
    pin_ttl_s: float
    def __init__(self, prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., cache_namespace: _Optional[str] = ..., pin: _Optional[bool] = ..., pin_ttl_s: _Optional[float] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("stage", "prompt_tokens", "cached_per_tier", "computed_tokens", "pin_id", "elapsed_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PER_TIER_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    stage: PrefetchStage
    prompt_tokens: int
    cached_per_tier: _common_pb2.TierTokens
    computed_tokens: int
    pin_id: str
    elapsed_s: float
    def __init__(self, stage: _Optional[_Union[PrefetchStage, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_per_tier: _Optional[_Union[_common_pb2.TierTokens, _Mapping]] = ..., computed_tokens: _Optional[int] = ..., pin_id: _Optional[str] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("tier", "num_tokens", "prefix", "all", "cache_namespace", "dry_run")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    num_tokens: int
    prefix: _common_pb2.Prompt
    all: bool
    cache_namespace: str
    dry_run: bool
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., num_tokens: _Optional[int] = ..., prefix: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., all: _Optional[bool] = ..., cache_namespace: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("tier", "evicted_tokens", "evicted_nodes", "dry_run")
    TIER_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_NODES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    evicted_tokens: int
    evicted_nodes: int
    dry_run: bool
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., evicted_tokens: _Optional[int] = ..., evicted_nodes: _Optional[int] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("prompt", "cache_namespace", "ttl_s")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    prompt: _common_pb2.Prompt
    cache_namespace: str
    ttl_s: float
    def __init__(self, prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., cache_namespace: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pin_id", "pinned_tokens", "expires_in_s")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    pinned_tokens: int
    expires_in_s: float
    def __init__(self, pin_id: _Optional[str] = ..., pinned_tokens: _Optional[int] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin_id", "all")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    all: bool
    def __init__(self, pin_id: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("unpinned", "unpinned_tokens")
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    unpinned: int
    unpinned_tokens: int
    def __init__(self, unpinned: _Optional[int] = ..., unpinned_tokens: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("tiers", "timeout_s")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    timeout_s: float
    def __init__(self, tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("flushed", "freed_tokens", "unpinned")
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    FREED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    flushed: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    freed_tokens: int
    unpinned: int
    def __init__(self, flushed: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., freed_tokens: _Optional[int] = ..., unpinned: _Optional[int] = ...) -> None: ...

class InspectTreeRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "preview_tokens")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    preview_tokens: int
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., preview_tokens: _Optional[int] = ...) -> None: ...

class TreeNodeInfo(_message.Message):
    __slots__ = ("node_id", "parent_id", "depth", "token_length", "prefix_length", "preview", "residency", "lock_ref", "pinned", "hit_count", "last_access_time", "num_children")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    LOCK_REF_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    HIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    parent_id: int
    depth: int
    token_length: int
    prefix_length: int
    preview: str
    residency: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    lock_ref: int
    pinned: bool
    hit_count: int
    last_access_time: float
    num_children: int
    def __init__(self, node_id: _Optional[int] = ..., parent_id: _Optional[int] = ..., depth: _Optional[int] = ..., token_length: _Optional[int] = ..., prefix_length: _Optional[int] = ..., preview: _Optional[str] = ..., residency: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., lock_ref: _Optional[int] = ..., pinned: _Optional[bool] = ..., hit_count: _Optional[int] = ..., last_access_time: _Optional[float] = ..., num_children: _Optional[int] = ...) -> None: ...

class InspectTreeResponse(_message.Message):
    __slots__ = ("nodes", "next_page_token", "total_nodes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[TreeNodeInfo]
    next_page_token: str
    total_nodes: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[TreeNodeInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total_nodes: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("seq", "kind", "tier", "num_tokens", "node_id", "cache_namespace", "time")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: CacheEventKind
    tier: _common_pb2.Tier
    num_tokens: int
    node_id: int
    cache_namespace: str
    time: float
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[CacheEventKind, str]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., num_tokens: _Optional[int] = ..., node_id: _Optional[int] = ..., cache_namespace: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class WatchCacheEventsRequest(_message.Message):
    __slots__ = ("after_seq", "kinds", "tiers")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    kinds: _containers.RepeatedScalarFieldContainer[CacheEventKind]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, after_seq: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[CacheEventKind, str]]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class WatchCacheEventsResponse(_message.Message):
    __slots__ = ("event", "missed")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    event: CacheEvent
    missed: int
    def __init__(self, event: _Optional[_Union[CacheEvent, _Mapping]] = ..., missed: _Optional[int] = ...) -> None: ...

class GetStorageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStorageResponse(_message.Message):
    __slots__ = ("storage",)
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    storage: StorageInfo
    def __init__(self, storage: _Optional[_Union[StorageInfo, _Mapping]] = ...) -> None: ...

class AttachStorageRequest(_message.Message):
    __slots__ = ("backend", "url", "directory")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    backend: str
    url: str
    directory: str
    def __init__(self, backend: _Optional[str] = ..., url: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class AttachStorageResponse(_message.Message):
    __slots__ = ("storage",)
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    storage: StorageInfo
    def __init__(self, storage: _Optional[_Union[StorageInfo, _Mapping]] = ...) -> None: ...

class DetachStorageRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DetachStorageResponse(_message.Message):
    __slots__ = ("detached",)
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    detached: StorageInfo
    def __init__(self, detached: _Optional[_Union[StorageInfo, _Mapping]] = ...) -> None: ...

class StorageInfo(_message.Message):
    __slots__ = ("attached", "backend", "address", "object_tokens", "pending", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    attached: bool
    backend: str
    address: str
    object_tokens: int
    pending: int
    details: _containers.ScalarMap[str, str]
    def __init__(self, attached: _Optional[bool] = ..., backend: _Optional[str] = ..., address: _Optional[str] = ..., object_tokens: _Optional[int] = ..., pending: _Optional[int] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...
