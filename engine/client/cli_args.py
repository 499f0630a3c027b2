"""Argument definitions of the `hicache` client commands (handlers live in engine/client/cli.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

# NOTE: hicache.tier.TIERS, copied: importing the hicache package loads torch, which the client
# does not need (tests/unit/test_stats.py keeps the two equal)
TIERS = ("l1", "l2", "l3")
EVENT_KINDS = ("stored", "removed", "demoted", "promoted", "cleared")


def _connection(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--addr", help="host:port of the daemon (env HICACHE_ADDR; 127.0.0.1:50051)")
    g.add_argument("--token", help="bearer token (env HICACHE_TOKEN)")
    g.add_argument(
        "--admin-token",
        help="admin bearer token for mutations (env HICACHE_ADMIN_TOKEN; defaults to --token)",
    )
    g.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    g.add_argument(
        "--ca-cert", help="PEM CA bundle to verify the server (env HICACHE_CA_CERT; implies --tls)"
    )
    g.add_argument(
        "--client-cert",
        help="PEM client certificate for an mTLS daemon (env HICACHE_CLIENT_CERT; implies --tls; "
        "with --client-key)",
    )
    g.add_argument("--client-key", help="PEM key of --client-cert (env HICACHE_CLIENT_KEY)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds per unary RPC")
    g.add_argument("--json", action="store_true", help="machine-readable JSON output")


def _prompt(p: argparse.ArgumentParser, chat: bool = True) -> None:
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    if chat:
        p.add_argument(
            "--chat", action="store_true", help="render as a user message with the chat template"
        )
    p.add_argument("--ids", action="store_true", help="the prompt is token ids ('1,2,3')")
    p.add_argument("--namespace", default="", help="cache namespace ([A-Za-z0-9_.-]{1,64})")


def add_client_commands(sub: Any, handlers: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _connection(p)
        p.set_defaults(func=handlers[name])
        return p

    p = cmd("generate", "stream a completion to the terminal")
    _prompt(p)
    p.add_argument("-n", "--max-new-tokens", type=int)
    p.add_argument("-t", "--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="print the final usage as JSON")

    p = cmd("stats", "per-tier cache statistics")
    p.add_argument(
        "-i", "--interval", "--watch", type=float, default=0.0, help="repeat every N seconds"
    )
    p.add_argument("-c", "--count", type=int, default=0, help="stop after N reports")

    p = cmd("tree", "list the radix tree's nodes")
    p.add_argument("--limit", type=int, default=200, help="at most N nodes (0 = all)")
    p.add_argument("--preview", type=int, default=16, help="tokens decoded per node")

    p = cmd("match", "how much of a prompt is cached, per tier (no side effects)")
    _prompt(p)

    p = cmd("prefetch", "warm the cache for a prompt (optionally pin it)")
    _prompt(p)
    p.add_argument("--pin", action="store_true")
    p.add_argument("--ttl", type=float, default=0.0, help="pin TTL in seconds (0 = until unpin)")

    p = cmd("evict", "evict cached tokens from a tier")
    p.add_argument("--tier", choices=TIERS, default="l1")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--tokens", type=int, help="at least N tokens, least valuable first")
    target.add_argument("--prefix", help="every cached sequence starting with this text")
    target.add_argument("--all", action="store_true", help="everything evictable")
    p.add_argument("--chat", action="store_true", help="--prefix is a chat user message")
    p.add_argument("--namespace", default="")
    p.add_argument("--dry-run", action="store_true")

    p = cmd("pin", "protect a prompt's cached prefix from eviction")
    _prompt(p)
    p.add_argument("--ttl", type=float, default=0.0, help="seconds (0 = until unpin)")

    p = cmd("unpin", "release a pin")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("pin_id", nargs="?")
    target.add_argument("--all", action="store_true")

    p = cmd("flush", "empty cache tiers (waits for the engine to be idle)")
    p.add_argument("--tier", action="append", choices=TIERS, help="repeatable; default all")
    p.add_argument("--wait", type=float, default=None, help="seconds to wait for idle (10)")

    p = cmd("storage", "show, attach or detach the daemon's L3 backend")
    p.add_argument("action", nargs="?", choices=("show", "attach", "detach"), default="show")
    p.add_argument("--backend", choices=("file", "redis"), help="attach: the backend")
    p.add_argument(
        "--url",
        default="",
        help="attach redis: redis://host:port/db, rediss://..., redis-cluster://h:p,h:p",
    )
    p.add_argument("--dir", default="", help="attach file: the directory (default: the daemon's)")
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        help="detach: seconds to wait for in-flight L3 work (30)",
    )

    p = cmd("events", "follow cache events")
    p.add_argument(
        "--after",
        type=int,
        default=None,
        help="resume after this sequence number (0 = all retained)",
    )
    p.add_argument("--kind", action="append", choices=EVENT_KINDS)
    p.add_argument("--tier", action="append", choices=TIERS)
    p.add_argument("-c", "--count", type=int, default=0, help="exit after N events")

    cmd("info", "server version, features and configuration")
    cmd("model", "model information")
    p = cmd("health", "the standard gRPC health check (exit 0 when SERVING)")
    p.add_argument("--service", default="", help="service name ('' = the whole server)")
