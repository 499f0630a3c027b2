"""The redis backend's redis-py clients: how one is built for a single node or a cluster, and
the per-node calls (SCAN, INFO) that walk every primary the same way on both.

A node is ``None`` on a single server, a ``ClusterNode`` on a cluster; ``on`` sends a call to
it (``target_nodes``) so that the code that walks the primaries does not care which it is.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from hicache.storage.redis.url import RedisTarget

SCAN_COUNT = 1000


def make_client(
    target: RedisTarget, socket_timeout_s: float, connect_timeout_s: float, max_connections: int
) -> Any:
    """A single node's client (no I/O: redis-py connects on first use) or a cluster's (reads the
    topology: I/O, so the backend makes it inside a call). ValueError for unknown or bad URL
    query options."""
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "max_connections": max_connections,
        "client_name": "hicache",
    }
    if target.cluster:
        # one retry after a topology refresh (failover); the outage logic does the rest.
        # The URL's own options (?socket_timeout=...) win, as redis-py's from_url does below.
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
            retry=Retry(NoBackoff(), 1),
            **{**common, **target.options},
        )
    # one immediate retry on a broken pooled connection (the server restarted while we were
    # idle); a timeout is not retried: a hung server costs one socket timeout
    client = redis.Redis.from_url(
        target.url, retry=Retry(NoBackoff(), 1, (redis.ConnectionError,)), **common
    )
    pool = client.connection_pool
    try:  # unknown or bad query options fail here, not on first use
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"L3 redis URL {target.address!r}: {e}") from None
    return client


def primaries(client: Any, cluster: bool) -> list[Any]:
    """The nodes that hold the data: a cluster's primaries, or [None] for a single server."""
    return list(client.get_primaries()) if cluster else [None]


def on(client: Any, node: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``client.method(*args, **kwargs)`` sent to ``node`` (None: the single server)."""
    if node is not None:
        kwargs["target_nodes"] = node
    return getattr(client, method)(*args, **kwargs)


def scan(client: Any, node: Any, cursor: int, match: str) -> tuple[int, list[bytes]]:
    """One SCAN page of ``node``: (next cursor, 0 when done; the key names found)."""
    cur, found = on(client, node, "scan", cursor, match=match, count=SCAN_COUNT)
    if isinstance(cur, dict):  # a cluster answers {node name: cursor}
        cur = next(iter(cur.values()))
    return int(cur), list(found)
