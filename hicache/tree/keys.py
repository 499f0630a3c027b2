"""TreeKeys: how token ids become radix-tree keys: whole pages, and a namespace folded into
every token.

    key_of(ids, ns)    token + (ns_id << 32) for each token (ns None: the ids as they are), so
                       tenants never share a node while sharing one pool and one eviction order
    split_key(key)     (namespace, token ids) of a tree key
    align / page_key   keys are cut to whole pages; children are keyed by their first page
    match_len          the common prefix of two keys, rounded down to a page

NOTE: a namespace's id never changes for the life of the tree (``RadixCache.reset`` keeps them).
"""

from __future__ import annotations

NS_SHIFT = 32  # a namespaced token is token + (ns_id << NS_SHIFT); token ids fit below it
TOKEN_MASK = (1 << NS_SHIFT) - 1


class TreeKeys:
    """The key arithmetic of one tree (``RadixCache.keys``)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ns_ids: dict[str, int] = {}
        self._ns_names: dict[int, str] = {}

    def key_of(
        self, token_ids: list[int] | tuple[int, ...], namespace: str | None = None
    ) -> tuple[int, ...]:
        """The key the tree stores for ``token_ids`` of ``namespace`` (not page-aligned)."""
        if not namespace:
            return tuple(token_ids)
        ns_id = self._ns_ids.get(namespace)
        if ns_id is None:
            ns_id = self._ns_ids[namespace] = len(self._ns_ids) + 1
            self._ns_names[ns_id] = namespace
        off = ns_id << NS_SHIFT
        return tuple(t + off for t in token_ids)

    def tree_key(
        self, token_ids: list[int] | tuple[int, ...], namespace: str | None
    ) -> tuple[int, ...]:
        """The page-aligned, namespaced key the tree matches for ``token_ids``."""
        return self.align(self.key_of(token_ids, namespace))

    def split_key(self, key: tuple[int, ...]) -> tuple[str | None, list[int]]:
        """(namespace, token ids) of a tree key."""
        if not key or key[0] < (1 << NS_SHIFT):
            return None, list(key)
        ns = self._ns_names.get(key[0] >> NS_SHIFT)
        return ns, [t & TOKEN_MASK for t in key]

    def align(self, key: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        return tuple(key[: len(key) // self.page_size * self.page_size])

    def page_key(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """A child's key in its parent's ``children``: its first page."""
        return tuple(key[: self.page_size])

    def match_len(self, node_key: tuple[int, ...], key: tuple[int, ...]) -> int:
        """Length of the common prefix, rounded down to a page."""
        n = min(len(node_key), len(key))
        if node_key[:n] == key[:n]:
            return n
        i = 0
        while node_key[i] == key[i]:
            i += 1
        return i // self.page_size * self.page_size
