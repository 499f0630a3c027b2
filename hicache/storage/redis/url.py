"""Addresses of the Redis / Valkey L3: the URLs ``hicache_storage_url`` accepts, parsed into what
builds a client, and the same URLs with their secrets removed (for stats, logs and server info).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis.cluster import REDIS_ALLOWED_KEYS
from redis.connection import parse_url

_SECRET_QUERY = re.compile(r"pass|secret|token", re.IGNORECASE)


@dataclass(frozen=True)
class RedisTarget:
    """A parsed URL: how to build the client, and what may be shown (no password)."""

    cluster: bool
    url: str
    address: str
    nodes: tuple[tuple[str, int], ...] = ()  # cluster startup nodes
    options: dict[str, Any] = field(default_factory=dict)  # cluster client options


def parse_target(url: str) -> RedisTarget:
    """``redis://``, ``rediss://``, ``unix://`` (redis-py's own URLs, query options allowed) or
    ``redis-cluster://[user:pass@]host:port[,host:port...]`` (``rediss-cluster://``: TLS).
    Raises ValueError for anything else."""
    if not isinstance(url, str) or "://" not in url:
        shown = redact_url(url) if isinstance(url, str) else type(url).__name__
        raise ValueError(
            f"L3 redis URL {shown!r}: expected redis://, rediss://, unix://, "
            "redis-cluster:// or rediss-cluster://"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        try:
            parse_url(url)
        except ValueError as e:
            raise ValueError(f"L3 redis URL {redact_url(url)!r}: {e}") from None
        return RedisTarget(cluster=False, url=url, address=redact_url(url))
    if scheme not in ("redis-cluster", "rediss-cluster"):
        raise ValueError(
            f"L3 redis URL {redact_url(url)!r}: unknown scheme {scheme!r}; "
            "expected redis, rediss, unix, redis-cluster or rediss-cluster"
        )
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = tuple(_host_port(h, url) for h in hosts.split(","))
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"L3 redis URL {redact_url(url)!r}: a cluster has only database 0")
    # reuse redis-py's parsing of credentials and query options on a one-node URL
    one = (
        f"{scheme.removesuffix('-cluster')}://{userinfo + '@' if userinfo else ''}"
        f"{hosts.split(',')[0]}" + (f"?{parts.query}" if parts.query else "")
    )
    try:
        options = parse_url(one)
    except ValueError as e:
        raise ValueError(f"L3 redis URL {redact_url(url)!r}: {e}") from None
    for k in ("host", "port", "db"):
        options.pop(k, None)
    unknown = sorted(set(options) - set(REDIS_ALLOWED_KEYS) - {"connection_class"})
    if unknown:
        raise ValueError(f"L3 redis URL {redact_url(url)!r}: unknown options {unknown}")
    if options.pop("connection_class", None) is not None:  # rediss: SSLConnection
        options["ssl"] = True
    return RedisTarget(cluster=True, url=url, address=redact_url(url), nodes=nodes, options=options)


def _host_port(text: str, url: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", text)
    port = int(m.group(2) or m.group(4) or 6379) if m else 0
    if m is None or not 0 < port < 65536:
        raise ValueError(f"L3 redis URL {redact_url(url)!r}: bad host:port {text!r}")
    return unquote(m.group(1) or m.group(3)), port


def redact_url(url: str) -> str:
    """``url`` without its password (in the userinfo or in query options)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}@{hosts}" if at and user else hosts
    query = urlencode(
        [
            (k, v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
            if not _SECRET_QUERY.search(k)
        ]
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
