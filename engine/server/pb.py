"""The generated protobuf modules under short names, and enum <-> engine string mappings."""

from __future__ import annotations

from engine.server.gen.hicache.v1 import cache_admin_pb2 as admin_pb2
from engine.server.gen.hicache.v1 import cache_admin_pb2_grpc as admin_grpc
from engine.server.gen.hicache.v1 import common_pb2
from engine.server.gen.hicache.v1 import generation_pb2 as gen_pb2
from engine.server.gen.hicache.v1 import generation_pb2_grpc as gen_grpc
from engine.server.gen.smg import sglang_scheduler_pb2 as sglang_pb2

GENERATION_SERVICE = gen_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
CACHE_ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["CacheAdminService"].full_name
# SMG's gRPC worker protocol (engine/server/sglang_worker.py)
SGLANG_SERVICE = sglang_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name

TIER_TO_ENUM: dict[str, common_pb2.Tier] = {
    "l1": common_pb2.TIER_L1,
    "l2": common_pb2.TIER_L2,
    "l3": common_pb2.TIER_L3,
}
ENUM_TO_TIER: dict[int, str] = {v: k for k, v in TIER_TO_ENUM.items()}

FINISH_TO_ENUM = {
    "stop": gen_pb2.FINISH_REASON_STOP,
    "length": gen_pb2.FINISH_REASON_LENGTH,
    "abort": gen_pb2.FINISH_REASON_ABORT,
}

EVENT_TO_ENUM = {
    "stored": admin_pb2.CACHE_EVENT_KIND_STORED,
    "removed": admin_pb2.CACHE_EVENT_KIND_REMOVED,
    "demoted": admin_pb2.CACHE_EVENT_KIND_DEMOTED,
    "promoted": admin_pb2.CACHE_EVENT_KIND_PROMOTED,
    "cleared": admin_pb2.CACHE_EVENT_KIND_CLEARED,
}


def tier_tokens(d: dict[str, int] | None) -> common_pb2.TierTokens:
    d = d or {}
    return common_pb2.TierTokens(
        l1=int(d.get("l1", 0)), l2=int(d.get("l2", 0)), l3=int(d.get("l3", 0))
    )


__all__ = ["admin_grpc", "admin_pb2", "common_pb2", "gen_grpc", "gen_pb2", "tier_tokens"]
