"""Tenants: a name with its own bearer token(s), the cache namespaces it may use, and quotas on
the tokens it keeps cached per tier (docs/daemon.md "Tenants").

    Tenant("acme", tokens=("s1",), namespaces=("acme", "acme-rag"), quota_l1_tokens=4096)
    parse_spec("acme:s1,namespaces=acme|acme-rag,quota_l1_tokens=4096")   # flag / env form

A request made with a tenant's token is confined to its namespaces; `Principal` is who made a
call: a tenant, or None for the admin / shared token (or no auth), who see everything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # the namespace rule (engine/server/validate.py)
QUOTA_KEYS = ("quota_l1_tokens", "quota_l2_tokens", "quota_l3_tokens")


@dataclass(frozen=True)
class Tenant:
    name: str
    tokens: tuple[str, ...]
    namespaces: tuple[str, ...] = ()  # () -> (name,)
    quota_l1_tokens: int = 0  # 0 = no quota
    quota_l2_tokens: int = 0
    quota_l3_tokens: int = 0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r} must match {_NAME.pattern}")
        if not self.tokens or not all(isinstance(t, str) and t for t in self.tokens):
            raise ValueError(f"tenant {self.name!r}: needs at least one non-empty token")
        if not self.namespaces:
            object.__setattr__(self, "namespaces", (self.name,))
        for ns in self.namespaces:
            if not isinstance(ns, str) or not _NAME.match(ns):
                raise ValueError(
                    f"tenant {self.name!r}: namespace {ns!r} must match {_NAME.pattern}"
                )
        for k in QUOTA_KEYS:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"tenant {self.name!r}: {k} must be an integer >= 0, got {v!r}")

    @property
    def default_namespace(self) -> str:
        return self.namespaces[0]

    def quota(self, tier: str) -> int:
        return int(getattr(self, f"quota_{tier}_tokens"))

    def public_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespaces": list(self.namespaces),
            **{k: getattr(self, k) for k in QUOTA_KEYS},
        }


class PermissionDeniedError(PermissionError):
    """A tenant asked for what is not its own (mapped to PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Principal:
    """Who made a call. tenant None: the admin token, the shared token, or no auth at all."""

    tenant: Tenant | None = None
    admin: bool = False

    @property
    def name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None

    def namespaces(self) -> frozenset[str] | None:
        """The namespaces this caller may see; None = all."""
        return None if self.tenant is None else frozenset(self.tenant.namespaces)

    def namespace(self, requested: str | None) -> str | None:
        """The cache namespace a call works in: a tenant's own (its default when none is
        named); anyone else's request as given."""
        if self.tenant is None:
            return requested
        if not requested:
            return self.tenant.default_namespace
        if requested not in self.tenant.namespaces:
            raise PermissionDeniedError(
                f"cache_namespace {requested!r} is not one of tenant {self.tenant.name!r}'s"
            )
        return requested

    def request_id(self, rid: str) -> str:
        """The engine's id of a request: a tenant's ids are its own ('/' never occurs in a
        client's id), so two tenants may use one id and Abort reaches only the caller's."""
        return rid if self.tenant is None else f"{self.tenant.name}/{rid}"


def from_table(name: str, table: Mapping[str, Any]) -> Tenant:
    """One `[tenants.<name>]` TOML table."""
    known = {"token", "tokens", "namespaces", *QUOTA_KEYS}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"tenant {name!r}: unknown key(s) {', '.join(unknown)}")
    tokens = list(table.get("tokens", []))
    if "token" in table:
        tokens.insert(0, table["token"])
    return Tenant(
        name,
        tuple(tokens),
        tuple(table.get("namespaces", ())),
        **{k: table[k] for k in QUOTA_KEYS if k in table},
    )


def parse_spec(spec: str) -> Tenant:
    """`NAME:TOKEN[,key=value...]` (flags and HICACHE_TENANTS)."""
    head, *pairs = [p.strip() for p in spec.strip().split(",")]
    name, sep, token = head.partition(":")
    if not sep or not name or not token:
        raise ValueError(f"tenant spec {spec!r}: expected NAME:TOKEN[,key=value...]")
    table: dict[str, Any] = {"tokens": [token]}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"tenant spec {spec!r}: {pair!r} is not key=value")
        if key == "namespaces":
            table[key] = [v for v in value.split("|") if v]
        elif key in QUOTA_KEYS:
            try:
                table[key] = int(value)
            except ValueError:
                raise ValueError(f"tenant spec {spec!r}: {key} must be an integer") from None
        else:
            raise ValueError(f"tenant spec {spec!r}: unknown key {key!r}")
    return from_table(name.strip(), table)


def parse_specs(text: str) -> tuple[Tenant, ...]:
    """HICACHE_TENANTS: specs separated by ';'."""
    return tuple(parse_spec(s) for s in text.split(";") if s.strip())


def check_unique(tenants: Iterable[Tenant], other_tokens: Iterable[str | None]) -> None:
    """Names, tokens and namespaces belong to one tenant each; no tenant token equals the shared
    or admin token (a token must say who is calling)."""
    names: set[str] = set()
    owner: dict[str, str] = {}
    ns_owner: dict[str, str] = {}
    others = {t for t in other_tokens if t}
    for t in tenants:
        if t.name in names:
            raise ValueError(f"tenant {t.name!r} is defined twice")
        names.add(t.name)
        for tok in t.tokens:
            if tok in others or tok in owner:
                raise ValueError(f"tenant {t.name!r}: its token is already another's")
            owner[tok] = t.name
        for ns in t.namespaces:
            if ns in ns_owner:
                raise ValueError(
                    f"namespace {ns!r} belongs to tenants {ns_owner[ns]!r} and {t.name!r}"
                )
            ns_owner[ns] = t.name


@dataclass
class TenantTable:
    """token -> tenant, namespace -> tenant, for the auth path and quota enforcement."""

    tenants: tuple[Tenant, ...] = ()
    by_token: dict[str, Tenant] = field(default_factory=dict)
    by_namespace: dict[str, Tenant] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.tenants:
            self.by_token.update(dict.fromkeys(t.tokens, t))
            self.by_namespace.update(dict.fromkeys(t.namespaces, t))
