"""Tenant settings (docs/daemon.md "Tenants"): the `NAME:TOKEN[,key=value...]` spec of
--tenant / HICACHE_TENANTS, the [tenants.<name>] TOML tables, the cross-tenant rules (a token,
a namespace belongs to one tenant; no tenant token is the shared or admin token), precedence
flags > env > TOML with the list taken whole, and no tenant token in public_dict()."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.server import settings
from engine.server.settings import DaemonSettings
from engine.server.tenants import Tenant, check_unique, from_table, parse_spec, parse_specs


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p.parse_args(list(argv))


def _by_name(tenants: tuple[Tenant, ...]) -> dict[str, Tenant]:
    return {t.name: t for t in tenants}


# --- the spec string ----------------------------------------------------------------------------
def test_parse_spec_every_key():
    t = parse_spec(
        "acme:s1,namespaces=acme|acme-rag,quota_l1_tokens=4096,quota_l2_tokens=16384,"
        "quota_l3_tokens=65536"
    )
    assert t == Tenant("acme", ("s1",), ("acme", "acme-rag"), 4096, 16384, 65536)
    assert t.default_namespace == "acme"
    assert [t.quota(x) for x in ("l1", "l2", "l3")] == [4096, 16384, 65536]


def test_parse_spec_defaults_namespace_to_name_and_no_quota():
    t = parse_spec("beta:beta-secret")
    assert t.tokens == ("beta-secret",) and t.namespaces == ("beta",)
    assert t.default_namespace == "beta"
    assert (t.quota_l1_tokens, t.quota_l2_tokens, t.quota_l3_tokens) == (0, 0, 0)


def test_parse_specs_separated_by_semicolons():
    ts = parse_specs(" acme:a1,quota_l1_tokens=64 ; beta:b1;")
    assert [t.name for t in ts] == ["acme", "beta"]
    assert ts[0].quota_l1_tokens == 64 and ts[1].tokens == ("b1",)
    assert parse_specs("") == ()


@pytest.mark.parametrize(
    "spec,match",
    [
        ("acme", "NAME:TOKEN"),  # no token at all
        ("acme:", "NAME:TOKEN"),  # empty token
        (":tok", "NAME:TOKEN"),  # empty name
        ("bad name:tok", "tenant name"),
        ("a/b:tok", "tenant name"),
        ("n" * 65 + ":tok", "tenant name"),
        ("acme:tok,color=red", "unknown key"),
        ("acme:tok,quota_l1_tokens", "key=value"),
        ("acme:tok,quota_l1_tokens=lots", "quota_l1_tokens must be an integer"),
        ("acme:tok,quota_l2_tokens=1.5", "quota_l2_tokens must be an integer"),
        ("acme:tok,quota_l3_tokens=-1", "quota_l3_tokens"),
        ("acme:tok,namespaces=good|bad ns", "namespace"),
    ],
)
def test_parse_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_parse_specs_error_names_the_bad_entry():
    with pytest.raises(ValueError, match="color"):
        parse_specs("acme:a1;beta:b1,color=red")


# --- the TOML table -----------------------------------------------------------------------------
def test_from_table_token_and_tokens_combine():
    t = from_table(
        "acme",
        {
            "token": "t0",
            "tokens": ["t1", "t2"],
            "namespaces": ["acme", "rag"],
            "quota_l2_tokens": 128,
        },
    )
    assert set(t.tokens) == {"t0", "t1", "t2"}
    assert t.namespaces == ("acme", "rag") and t.quota_l2_tokens == 128


@pytest.mark.parametrize(
    "name,table,match",
    [
        ("bad name", {"token": "t"}, "tenant name"),
        ("acme", {}, "token"),  # no token
        ("acme", {"token": ""}, "token"),
        ("acme", {"tokens": []}, "token"),
        ("acme", {"tokens": ["ok", ""]}, "token"),
        ("acme", {"token": "t", "colour": "red"}, "unknown key"),
        ("acme", {"token": "t", "quota_l1_tokens": "4096"}, "quota_l1_tokens"),
        ("acme", {"token": "t", "quota_l1_tokens": 1.5}, "quota_l1_tokens"),
        ("acme", {"token": "t", "quota_l2_tokens": True}, "quota_l2_tokens"),
        ("acme", {"token": "t", "quota_l3_tokens": -5}, "quota_l3_tokens"),
        ("acme", {"token": "t", "namespaces": ["a b"]}, "namespace"),
    ],
)
def test_from_table_errors(name, table, match):
    with pytest.raises(ValueError, match=match):
        from_table(name, table)


# --- rules across tenants -----------------------------------------------------------------------
CROSS_CASES = [
    ("duplicate token", [Tenant("a", ("same",)), Tenant("b", ("same",))], None, None),
    (
        "namespace owned twice",
        [Tenant("a", ("ta",), ("shared",)), Tenant("b", ("tb",), ("shared",))],
        None,
        None,
    ),
    (
        "namespace = other's name",
        [Tenant("a", ("ta",), ("a", "b")), Tenant("b", ("tb",))],
        None,
        None,
    ),
    ("tenant defined twice", [Tenant("a", ("t1",)), Tenant("a", ("t2",), ("other",))], None, None),
    ("token = admin token", [Tenant("a", ("A",))], None, "A"),
    ("token = shared token", [Tenant("a", ("U",))], "U", None),
]


@pytest.mark.parametrize("name,tenants,token,admin", CROSS_CASES, ids=[c[0] for c in CROSS_CASES])
def test_cross_tenant_rules(name, tenants, token, admin):
    with pytest.raises(ValueError):
        check_unique(tenants, (token, admin))
    with pytest.raises(ValueError):
        DaemonSettings(token=token, admin_token=admin, tenants=tuple(tenants))


def test_distinct_tenants_are_accepted():
    ts = (Tenant("a", ("ta",), ("a", "a-rag")), Tenant("b", ("tb", "tb2")))
    check_unique(ts, ("U", "A"))
    assert DaemonSettings(token="U", admin_token="A", tenants=ts).tenants == ts


@pytest.mark.parametrize(
    "argv",
    [
        ["--tenant", "a:same", "--tenant", "b:same"],
        ["--tenant", "a:ta,namespaces=x", "--tenant", "b:tb,namespaces=x"],
        ["--admin-token", "A", "--tenant", "a:A"],
        ["--token", "U", "--tenant", "a:U"],
    ],
)
def test_load_rejects_cross_tenant_conflicts(argv):
    with pytest.raises(ValueError):
        settings.load(_parse(*argv), {})


def test_load_rejects_a_tenant_token_equal_to_the_admin_token_from_env():
    with pytest.raises(ValueError):
        settings.load(_parse(), {"HICACHE_ADMIN_TOKEN": "A", "HICACHE_TENANTS": "a:A"})


# --- precedence: flags > env > TOML, the list taken whole ----------------------------------------
TOML = """
port = 7000
[server]
admin_token = "A"
[tenants.acme]
tokens = ["acme-1", "acme-2"]
namespaces = ["acme", "acme-rag"]
quota_l1_tokens = 4096
quota_l2_tokens = 16384
quota_l3_tokens = 65536
[tenants.beta]
token = "beta-1"
"""


def test_toml_tenant_tables(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(TOML)
    d, _ = settings.load(_parse("--config", str(cfg)), {})
    assert d.port == 7000 and d.admin_token == "A"  # the other options still load
    ts = _by_name(d.tenants)
    assert set(ts) == {"acme", "beta"}
    assert ts["acme"] == Tenant(
        "acme", ("acme-1", "acme-2"), ("acme", "acme-rag"), 4096, 16384, 65536
    )
    assert ts["beta"] == Tenant("beta", ("beta-1",))
    assert isinstance(d.tenants, tuple)


def test_env_replaces_the_toml_list_whole(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(TOML)
    env = {"HICACHE_TENANTS": "gamma:g1,quota_l1_tokens=64;delta:d1,namespaces=d|d2"}
    d, _ = settings.load(_parse("--config", str(cfg)), env)
    ts = _by_name(d.tenants)
    assert set(ts) == {"gamma", "delta"}  # acme and beta are gone, not merged
    assert ts["gamma"].quota_l1_tokens == 64 and ts["delta"].namespaces == ("d", "d2")


def test_flags_replace_the_env_list_whole(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(TOML)
    env = {"HICACHE_TENANTS": "gamma:g1;delta:d1", "HICACHE_CONFIG": str(cfg)}
    d, _ = settings.load(
        _parse("--tenant", "x:tx,quota_l2_tokens=8", "--tenant", "y:ty,namespaces=y|y2"), env
    )
    ts = _by_name(d.tenants)
    assert set(ts) == {"x", "y"}
    assert ts["x"].quota_l2_tokens == 8 and ts["y"].namespaces == ("y", "y2")


def test_no_tenants_by_default():
    d, _ = settings.load(_parse(), {})
    assert d.tenants == ()
    assert DaemonSettings().tenants == ()


def test_bad_tenant_spec_in_flag_or_env_is_an_error():
    with pytest.raises(ValueError, match="unknown key"):
        settings.load(_parse("--tenant", "x:tx,colour=red"), {})
    with pytest.raises(ValueError, match="quota_l1_tokens"):
        settings.load(_parse(), {"HICACHE_TENANTS": "x:tx,quota_l1_tokens=many"})


def test_bad_toml_tenant_table_is_an_error(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tenants.acme]\ntoken = "t"\nquota_l1_tokens = "4096"\n')
    with pytest.raises(ValueError, match="quota_l1_tokens"):
        settings.load(_parse("--config", str(cfg)), {})
    cfg.write_text('[tenants.acme]\ntoken = "t"\nflavour = 1\n')
    with pytest.raises(ValueError, match="flavour"):
        settings.load(_parse("--config", str(cfg)), {})


# --- no secrets in public_dict ------------------------------------------------------------------
def test_public_dict_never_contains_a_tenant_token():
    d = DaemonSettings(
        token="shared-sekrit",
        admin_token="admin-sekrit",
        tenants=(
            Tenant("acme", ("acme-sekrit-1", "acme-sekrit-2"), ("acme", "acme-rag"), 64),
            Tenant("beta", ("beta-sekrit",)),
        ),
    )
    text = json.dumps(d.public_dict(), default=repr)
    assert "sekrit" not in text, text


def test_public_dict_of_loaded_settings_has_no_tenant_token(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(TOML)
    for env in ({}, {"HICACHE_TENANTS": "gamma:gamma-tok"}):
        d, _ = settings.load(_parse("--config", str(cfg)), env)
        text = json.dumps(d.public_dict(), default=repr)
        for tok in ("acme-1", "acme-2", "beta-1", "gamma-tok"):
            assert tok not in text, (tok, text)
