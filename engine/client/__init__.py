"""Clients of the daemon, run by users (no torch): the gRPC client (`from engine.client import
HicacheClient`) and the `hicache` CLI (engine/client/cli.py)."""

from engine.client.grpc_client import AsyncHicacheClient, HicacheClient

__all__ = ["AsyncHicacheClient", "HicacheClient"]
