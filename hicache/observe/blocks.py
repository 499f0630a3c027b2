"""The radix tree seen as fixed-size KV blocks per tier, for routers' KV events.

A router (SMG, llm-d, Dynamo) indexes a worker's cache as chains of blocks: `block_size`
tokens each, aligned at multiples of `block_size` from the start of the sequence, every block
named by a hash chained on its parent's. `BlockView.snapshot(tree)` lists, for each tier, the
blocks whose every token has its KV in that tier (L1, L2) now; publishers diff two snapshots into
stored / removed events (engine/server/kv_events.py). L3's blocks come from the objects the cache
knows are stored (hicache.l3.index), cut with ``chain_blocks`` as here.

    positions   0 ........ 16 ........ 32 ...... 40
    path        [ node A (0-20)    ][ node B (20-40)      ]
    blocks      [ block 0 ][ block 1 ]   (32-40: not full, no block)
    block 1 is in L1 iff A and B are both on device; in L2 iff both are on host.

Hash of a block: xxh3-64 over (parent hash, cache salt, token ids) as a signed int64 (the proto's
type). A cache namespace (tenant) enters as the salt, an HMAC of its name under a key the caller
holds: the name never leaves the daemon, and two namespaces' identical prompts are different
blocks. Token ids are the request's (the namespace bits of tree keys removed).

NOTE: the view reads node fields only (value, host_value, host_pending, key, children) on the
scheduler thread; it caches each node's block hashes by node identity and the chain state it was
reached with, so a snapshot hashes only what changed since the last one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import xxhash

from hicache.tier import MEMORY_TIERS

if TYPE_CHECKING:  # the records here cross to the API server process, which has no torch
    from hicache.tree.radix import RadixCache

# The tiers of KV events: the tree's two (TREE_TIERS, this module) and L3's, named by where its
# objects live (L3_TIERS, hicache.l3.index: L3 objects outlive the tree's nodes)
TREE_TIERS = MEMORY_TIERS
L3_TIERS = ("disk", "external")  # a file L3 on this machine; a server other daemons may share
TIERS = TREE_TIERS + L3_TIERS


@dataclass(frozen=True)
class Block:
    """One full block: its hash, its parent's (None: the first block of a sequence), its
    tokens and the salt of its namespace (None: the shared namespace)."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    salt: str | None


def _signed64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def block_hash(parent: int | None, salt: str | None, token_ids: tuple[int, ...]) -> int:
    head = struct.pack("<q", parent) if parent is not None else b"root"
    data = head + (salt or "").encode() + b"|" + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return _signed64(xxhash.xxh3_64_intdigest(data))


def namespace_salt(key: bytes, namespace: str | None) -> str | None:
    if not namespace:
        return None
    return hmac.new(key, namespace.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class Chain:
    """What a walk carries into a node (or an L3 object): the tokens before it, the last full
    block's hash, the tokens since that block (fewer than block_size)."""

    pos: int
    last_hash: int | None
    pending: tuple[int, ...]


ROOT = Chain(0, None, ())


def chain_blocks(
    chain: Chain, salt: str | None, tokens: Iterable[int], block_size: int
) -> tuple[list[Block], Chain]:
    """The blocks that ``tokens`` (following ``chain``) complete, and the chain after them."""
    blocks: list[Block] = []
    pending, last, n = list(chain.pending), chain.last_hash, 0
    for t in tokens:
        n += 1
        pending.append(t)
        if len(pending) == block_size:
            ids = tuple(pending)
            h = block_hash(last, salt, ids)
            blocks.append(Block(h, last, ids, salt))
            pending, last = [], h
    return blocks, Chain(chain.pos + n, last, tuple(pending))


class BlockChanges(NamedTuple):
    """What changed since the view's last changes() call, per tier; `full`: `stored` is the
    whole state (the first call, or reset)."""

    stored: dict[str, list[Block]]
    removed: dict[str, list[int]]
    full: bool


class BlockView:
    def __init__(self, block_size: int, salt_key: bytes):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.salt_key = salt_key
        # node -> (chain in, key length, blocks completed inside the node, chain out)
        self._cache: weakref.WeakKeyDictionary[Any, tuple[Chain, int, list[Block], Chain]] = (
            weakref.WeakKeyDictionary()
        )
        self._salts: dict[str | None, str | None] = {}
        self._published: dict[str, set[int]] | None = None  # the block hashes changes() gave

    @property
    def fresh(self) -> bool:
        """Has changes() not been called yet (its first call gives the whole state)?"""
        return self._published is None

    def changes(self, tree: RadixCache | Any, reset: bool = False) -> BlockChanges:
        """The blocks stored and removed per tier since the last call. NOTE: the diff is made
        here, next to the tree: a look moves only what changed, never the whole state."""
        now = self.snapshot(tree)
        full = reset or self._published is None
        before = {t: set() for t in TREE_TIERS} if full else self._published
        assert before is not None
        stored = {t: [b for b in now[t] if b.block_hash not in before[t]] for t in TREE_TIERS}
        hashes = {t: {b.block_hash for b in now[t]} for t in TREE_TIERS}
        removed = {t: [h for h in before[t] if h not in hashes[t]] for t in TREE_TIERS}
        self._published = hashes
        return BlockChanges(stored, removed, full)

    def _salt(self, namespace: str | None) -> str | None:
        if namespace not in self._salts:
            self._salts[namespace] = namespace_salt(self.salt_key, namespace)
        return self._salts[namespace]

    def _blocks_in(self, tree: Any, node: Any, chain: Chain) -> tuple[list[Block], Chain]:
        hit = self._cache.get(node)
        if hit is not None and hit[0] == chain and hit[1] == len(node.key):
            return hit[2], hit[3]
        namespace, tokens = tree.keys.split_key(node.key)
        blocks, out = chain_blocks(chain, self._salt(namespace), tokens, self.block_size)
        self._cache[node] = (chain, len(node.key), blocks, out)
        return blocks, out

    def snapshot(self, tree: RadixCache | Any) -> dict[str, list[Block]]:
        """tier -> its blocks, every parent before its children. `tree`: a RadixCache or
        HiRadixCache (a tree without nodes, e.g. ChunkCache, has no blocks)."""
        out: dict[str, list[Block]] = {t: [] for t in TREE_TIERS}
        if tree.disable:  # a ChunkCache keeps no prefixes
            return out
        root = tree.root_node
        start = ROOT
        # (node, chain into it, per tier: where the run of nodes in the tier that ends at its
        # parent began, None when the parent is not in the tier); the root is in every tier
        stack: list[tuple[Any, Chain, dict[str, int | None]]] = [
            (child, start, {t: 0 for t in TREE_TIERS}) for child in root.children.values()
        ]
        while stack:
            node, chain, since_in = stack.pop()
            blocks, chain_out = self._blocks_in(tree, node, chain)
            since = {
                t: (chain.pos if since_in[t] is None else since_in[t])
                if _in_tier(node, t)
                else None
                for t in TREE_TIERS
            }
            first = chain.pos - len(chain.pending)  # where the node's first block starts
            for k, b in enumerate(blocks):
                begin = first + k * self.block_size
                for t in TREE_TIERS:
                    run = since[t]
                    if run is not None and run <= begin:
                        out[t].append(b)
            stack.extend((c, chain_out, since) for c in node.children.values())
        return out


def _in_tier(node: Any, tier: str) -> bool:
    if tier == "l1":
        return node.value is not None
    # L2: host slots assigned and their bytes landed (no device->host write still filling them)
    return node.host_value is not None and node.host_pending is None
