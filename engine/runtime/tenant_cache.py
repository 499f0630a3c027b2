"""A tenant's share of the cache: what its namespaces hold per tier, its quotas (enforced on the
scheduler thread after its requests are cached), and a flush of its namespaces only.

Runs on the scheduler thread (step hooks, the Engine's tenant methods). Knows namespaces, not
tokens: the daemon maps tokens to tenants (engine/server/tenants.py) and hands the engine their
quotas (``TenantQuota``, engine/admin_records.py), which become a QuotaEnforcer (``apply_quotas``
-> ``set_quota_enforcer``; a later one replaces it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.admin_records import TenantQuota, TenantView, TierUsage
from engine.runtime import cache_admin
from hicache.tier import MEMORY_TIERS
from hicache.tree.base import BasePrefixCache
from hicache.tree.node import TreeNode
from hicache.tree.ops import namespace_nodes, namespace_roots, radix_tree
from hicache.tree.radix import RadixCache

if TYPE_CHECKING:
    from engine.runtime.scheduler import Scheduler

TIERS = cache_admin.TIERS
RETRY_S = 0.25  # how often a tenant still over a quota (its nodes locked) is looked at again


def usage(cache: BasePrefixCache, namespaces: frozenset[str]) -> dict[str, TierUsage]:
    """Tokens the nodes of `namespaces` hold in each tier. L3: the whole objects ending inside
    nodes this tree knows are stored (objects of `l3.object_size` tokens)."""
    totals = {tier: [0, 0, 0] for tier in TIERS}  # used, evictable, pinned
    tree = radix_tree(cache)
    if tree is None:
        return {tier: TierUsage(*t) for tier, t in totals.items()}
    per_object = tree.l3.object_size if tree.l3 is not None else 0
    roots = namespace_roots(tree, namespaces)
    stack = [(c, 0) for c in roots]  # (node, tokens before it)
    while stack:
        n, start = stack.pop()
        end = start + len(n.key)
        stack.extend((c, end) for c in n.children.values())
        for tier in TIERS:
            if tier == "l3":
                held = (
                    (end // per_object - start // per_object) * per_object
                    if (per_object and n.in_storage)
                    else 0
                )
            else:
                held = len(n.key) if tree.holds(n, tier) else 0
            if held:
                t = totals[tier]
                t[0] += held
                t[2 if n.lock_ref > 0 else 1] += held
    return {tier: TierUsage(*t) for tier, t in totals.items()}


class QuotaEnforcer:
    """A scheduler step hook (``set_quota_enforcer``): after requests finish (and are
    cached), each tenant over a quota has its least valuable unlocked nodes evicted from that
    tier until it is within quota; and the L3 backup gate that stops backups of a tenant at its
    L3 quota."""

    def __init__(self, quotas: Sequence[TenantQuota]):
        self.quotas = [q for q in quotas if any(q.quota_tokens.values())]
        self.by_namespace = {ns: q for q in self.quotas for ns in q.namespaces}
        self.by_name = {q.name: q for q in self.quotas}
        self._seen_finished = -1
        self._over: set[str] = set()  # tenants still over a quota (locked nodes): retried
        self._next_retry = 0.0
        self.tree: RadixCache | None = None

    def backup_gate(self, cache: BasePrefixCache) -> Callable[[TreeNode], bool] | None:
        """The gate for ``cache.l3.backup.gate`` (None: no tenant has an L3 quota)."""
        self.tree = radix_tree(cache)
        return self.allow_backup if any(q.quota_tokens.get("l3") for q in self.quotas) else None

    def carry_over(self, previous: QuotaEnforcer) -> None:
        """Keep the quota evictions counted so far by the enforcer this one replaces (they
        are cumulative figures)."""
        for q in self.quotas:
            old = previous.by_name.get(q.name)
            if old is not None:
                q.evicted_tokens = dict(old.evicted_tokens)

    def __call__(self, scheduler: Scheduler) -> None:
        finished = scheduler.counters.finished
        now = time.monotonic()
        if finished != self._seen_finished:  # requests were cached: check everyone
            self._seen_finished = finished
            todo = self.quotas
        elif self._over and now >= self._next_retry:
            todo = [q for q in self.quotas if q.name in self._over]
        else:
            return
        self._next_retry = now + RETRY_S
        for q in todo:
            if self.enforce(scheduler, q):
                self._over.discard(q.name)
            else:
                self._over.add(q.name)

    def enforce(self, scheduler: Scheduler, q: TenantQuota) -> bool:
        """Evicts what is over; True when the tenant is within its L1 / L2 quotas."""
        tree = scheduler.tree_cache
        within = True
        for tier in MEMORY_TIERS:
            quota = q.quota_tokens.get(tier, 0)
            if not quota or (tier == "l2" and tree.host is None):
                continue
            over = usage(tree, q.namespaces)[tier].used_tokens - quota
            if over > 0:
                # NOTE: no settle: the scheduler thread must not wait for copies here; nodes
                # still locked (by a backup, a request, a pin) are retried every RETRY_S.
                info = cache_admin.evict(
                    scheduler, tier, num_tokens=over, namespaces=q.namespaces, settle_first=False
                )
                q.evicted_tokens[tier] += info.evicted_tokens
                within = within and info.evicted_tokens >= over
        return within

    def allow_backup(self, node: TreeNode) -> bool:
        """The tree's backup gate: False while the node's tenant is at its L3 quota, counting
        what the tree knows is stored and the backups in flight."""
        tree = self.tree
        if tree is None or tree.l3 is None:
            return True  # no tree, no tenant: nothing to gate
        ns = tree.keys.split_key(tuple(node.key[:1]))[0]
        q = self.by_namespace.get(ns) if ns is not None else None
        quota = q.quota_tokens.get("l3", 0) if q is not None else 0
        if q is None or not quota:
            return True
        in_flight = tree.l3.backup.in_flight_tokens(q.namespaces)
        return usage(tree, q.namespaces)["l3"].used_tokens + in_flight < quota


def apply_quotas(scheduler: Scheduler, quotas: Sequence[TenantQuota]) -> None:
    """Give the scheduler a QuotaEnforcer for these tenants' quotas, replacing the one it has
    (its cumulative evictions carry over by tenant name)."""
    enforcer = QuotaEnforcer(quotas)
    if scheduler.quota_enforcer is not None:
        enforcer.carry_over(scheduler.quota_enforcer)
    set_quota_enforcer(scheduler, enforcer)


def set_quota_enforcer(scheduler: Scheduler, enforcer: QuotaEnforcer | None) -> None:
    """``enforcer`` replaces the scheduler's (None: no quotas), as its step hook and as the
    tree's L3 backup gate; read back as ``scheduler.quota_enforcer``."""
    if scheduler.quota_hook is not None:
        scheduler.step_hooks.remove(scheduler.quota_hook)
        scheduler.quota_hook = None
    scheduler.quota_enforcer = enforcer
    l3 = scheduler.tree_cache.l3
    if l3 is not None:
        l3.backup.gate = None if enforcer is None else enforcer.backup_gate(scheduler.tree_cache)
    if enforcer is not None:
        scheduler.quota_hook = scheduler.step_hooks.add(enforcer)


def flush(
    scheduler: cache_admin.AdminScheduler,
    namespaces: frozenset[str],
    tiers: list[str] | None,
    owner: str | None,
) -> cache_admin.FlushInfo:
    """Empties the chosen tiers of `namespaces` only (None = every enabled tier): the owner's
    pins are released, unlocked L1 / L2 nodes evicted, and the L3 objects of the nodes this tree
    knows deleted. Other namespaces' requests may keep running."""
    wanted = cache_admin.flush_tiers(scheduler.tree_cache, tiers)
    tree = radix_tree(scheduler.tree_cache)
    if tree is None:
        return cache_admin.FlushInfo(wanted, 0, 0)
    cache_admin.check_storage_idle(tree, wanted)
    unpinned, _ = cache_admin.unpin(scheduler, None, owner)
    freed = 0
    if "l3" in wanted and tree.l3 is not None:  # before L1 / L2 drop the nodes naming objects
        tree.l3.delete_from_storage([n for n in namespace_nodes(tree, namespaces) if n.in_storage])
    for t in MEMORY_TIERS:
        if t in wanted:
            freed += cache_admin.evict(scheduler, t, namespaces=namespaces).evicted_tokens
    return cache_admin.FlushInfo(wanted, freed, unpinned)


def tenant_figures(
    scheduler: Scheduler, tenants: Sequence[TenantQuota]
) -> dict[str, dict[str, dict[str, int]]]:
    """{tenant: {"cached" | "quota" | "evicted": {tier: tokens}}} for /metrics; the evictions
    are the enforcer's (`tenants` give the names, namespaces and quotas)."""
    enforcer = scheduler.quota_enforcer
    out = {}
    for t in tenants:
        use = usage(scheduler.tree_cache, frozenset(t.namespaces))
        q = enforcer.by_name.get(t.name) if enforcer is not None else None
        out[t.name] = {
            "cached": {tier: u.used_tokens for tier, u in use.items()},
            "quota": {tier: t.quota_tokens.get(tier, 0) for tier in TIERS},
            "evicted": dict(q.evicted_tokens) if q is not None else dict.fromkeys(TIERS, 0),
        }
    return out


def tenant_view(
    scheduler: Scheduler, tenant: str, namespaces: frozenset[str] | set[str]
) -> TenantView:
    """A tenant's usage per tier, its pins and its quota evictions (GetCacheStats)."""
    pins = scheduler.admin_pins.owned_by(tenant)
    enforcer = scheduler.quota_enforcer
    q = enforcer.by_name.get(tenant) if enforcer is not None else None
    evicted = dict(q.evicted_tokens) if q is not None else {}
    return TenantView(usage(scheduler.tree_cache, frozenset(namespaces)), pins, evicted)
