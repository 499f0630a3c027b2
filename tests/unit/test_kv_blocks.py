"""hicache.observe.blocks: the radix tree as chained fixed-size blocks per tier (for KV events)."""

from __future__ import annotations

from hicache import RadixCache, TokenToKVPoolAllocator
from hicache.observe.blocks import BlockView, block_hash, namespace_salt

B = 4
KEY = b"k" * 16


def _tree(page_size: int = 1) -> RadixCache:
    alloc = TokenToKVPoolAllocator(512, page_size, "cpu")
    return RadixCache(None, alloc, page_size)


def _insert(tree: RadixCache, tokens: list[int], namespace: str | None = None) -> None:
    key = tree.keys.key_of(tokens, namespace)
    slots = tree.token_to_kv_pool_allocator.alloc(len(key))
    dup = tree.insert(key, slots)
    tree.token_to_kv_pool_allocator.free(slots[:dup])


def _chain(tokens: list[int], salt: str | None = None) -> list[int]:
    """The block hashes of a sequence, computed from the whole sequence (the reference)."""
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % B, B):
        parent = block_hash(parent, salt, tuple(tokens[i : i + B]))
        out.append(parent)
    return out


def test_blocks_follow_sequences_across_node_splits():
    tree = _tree()
    a = list(range(10, 21))  # 11 tokens: 2 full blocks
    b = a[:6] + [90, 91, 92, 93, 94, 95]  # splits a's node inside its second block
    _insert(tree, a)
    view = BlockView(B, KEY)
    first = view.snapshot(tree)["l1"]
    assert [x.block_hash for x in first] == _chain(a)
    _insert(tree, b)
    got = view.snapshot(tree)  # cached hashes of the old node must not survive its split
    fresh = BlockView(B, KEY).snapshot(tree)
    assert got == fresh
    hashes = {x.block_hash for x in got["l1"]}
    assert hashes == set(_chain(a)) | set(_chain(b)) and len(hashes) == 4  # block 0 shared
    for blk in got["l1"]:  # chained: every parent is listed before its child
        seen = [x.block_hash for x in got["l1"][: got["l1"].index(blk)]]
        assert blk.parent_hash is None or blk.parent_hash in seen
    assert got["l2"] == []  # a plain radix tree has no host tier


def test_evicted_blocks_leave_the_tier():
    tree = _tree()
    _insert(tree, list(range(8)))
    view = BlockView(B, KEY)
    assert len(view.snapshot(tree)["l1"]) == 2
    tree.evict(1 << 20)
    assert view.snapshot(tree) == {"l1": [], "l2": []}


def test_namespaces_are_salted_never_named():
    tree = _tree()
    tokens = list(range(30, 38))
    _insert(tree, tokens)
    _insert(tree, tokens, namespace="acme")
    blocks = BlockView(B, KEY).snapshot(tree)["l1"]
    salt = namespace_salt(KEY, "acme")
    assert salt and "acme" not in salt
    shared = [x.block_hash for x in blocks if x.salt is None]
    salted = [x.block_hash for x in blocks if x.salt == salt]
    assert shared == _chain(tokens) and salted == _chain(tokens, salt)
    assert not set(shared) & set(salted)  # the same prompt, different blocks
    assert all(
        x.token_ids == tuple(tokens[i * B : (i + 1) * B])
        for i, x in enumerate(x for x in blocks if x.salt == salt)
    )
    assert namespace_salt(b"other key", "acme") != salt


def test_pages_larger_than_one_token():
    tree = _tree(page_size=2)
    _insert(tree, list(range(100, 110)))
    assert [x.block_hash for x in BlockView(B, KEY).snapshot(tree)["l1"]] == _chain(
        list(range(100, 110))
    )


def test_publisher_diff_and_chains():
    from engine.server.kv_events import Cleared, Removed, Stored, chains, diff

    tree = _tree()
    _insert(tree, list(range(12)))
    _insert(tree, list(range(8)) + [50, 51, 52, 53])
    now = BlockView(B, KEY).snapshot(tree)
    empty: dict = {"l1": {}, "l2": {}}
    events = diff(empty, now)
    assert all(isinstance(e, Stored) and e.tier == "l1" for e in events)
    stored = [b for e in events for b in e.blocks]
    assert sorted(b.block_hash for b in stored) == sorted(b.block_hash for b in now["l1"])
    for e in events:  # each event is a chain hanging from its parent_hash
        parents = [e.parent_hash] + [b.block_hash for b in e.blocks[:-1]]
        assert [b.parent_hash for b in e.blocks] == parents
    published = {t: {b.block_hash: b for b in now[t]} for t in now}
    assert diff(published, now) == []
    tree.evict(1 << 20)
    assert diff(published, {"l1": [], "l2": []}) == [Cleared()]
    fewer = {"l1": now["l1"][:1], "l2": []}
    (removed,) = diff(published, fewer)
    assert isinstance(removed, Removed) and len(removed.block_hashes) == len(now["l1"]) - 1
    assert chains("l1", []) == []


def test_changes_are_the_diff_between_looks():
    tree = _tree()
    view = BlockView(B, KEY)
    _insert(tree, list(range(8)))
    first = view.changes(tree)
    assert first.full and len(first.stored["l1"]) == 2 and first.removed["l1"] == []
    assert view.changes(tree) == ({"l1": [], "l2": []}, {"l1": [], "l2": []}, False)
    _insert(tree, list(range(4)) + [70, 71, 72, 73])
    grown = view.changes(tree)
    assert [b.token_ids for b in grown.stored["l1"]] == [(70, 71, 72, 73)]
    tree.evict(1 << 20)
    gone = view.changes(tree)
    assert sorted(gone.removed["l1"]) == sorted(
        b.block_hash for b in first.stored["l1"] + grown.stored["l1"]
    )
    again = view.changes(tree, reset=True)
    assert again.full and again.stored == {"l1": [], "l2": []}
