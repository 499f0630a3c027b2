"""Settings precedence (flag > env > TOML > daemon default > default), the daemon's default
tiers (L1 + L2 + file L3) and how each is turned off, and the auth rules."""

from __future__ import annotations

import argparse
import os
import stat

import grpc
import pytest

from engine.client import cli
from engine.config import ServerArgs
from engine.server import auth, settings


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p.parse_args(list(argv))


def test_precedence_flag_env_toml(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(
        'port = 7000\n[engine]\npage_size = 8\nmax-total-tokens = 999\n[server]\ntoken = "t"\n'
    )
    env = {"HICACHE_PAGE_SIZE": "4", "HICACHE_ENABLE_HIERARCHICAL_CACHE": "true"}
    d, e = settings.load(_parse("--config", str(cfg), "--port", "7001"), env)
    assert d.port == 7001 and d.token == "t"  # flag beats TOML
    assert e.page_size == 4 and e.max_total_tokens == 999  # env beats TOML
    assert e.enable_hierarchical_cache is True
    d, e = settings.load(_parse("--model", "/m", "--no-warmup"), {"HICACHE_METRICS_PORT": "9"})
    assert e.model_path == "/m" and d.warmup is False and d.metrics_port == 9
    assert d.public_dict()["token"] is None


@pytest.mark.parametrize(
    "argv,env,match",
    [
        (["--port", "x"], {}, "expected int"),
        ([], {"HICACHE_WARMUP": "maybe"}, "expected bool"),
        (["--page-size", "0"], {}, "page_size"),
        (["--tls-cert", "c.pem"], {}, "go together"),
        ([], {"HICACHE_SCHEDULE_POLICY": "nope"}, "schedule_policy"),
    ],
)
def test_bad_settings_raise(argv, env, match):
    with pytest.raises(ValueError, match=match):
        settings.load(_parse(*argv), env)


def test_unknown_toml_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("pag_size = 4\n")
    with pytest.raises(ValueError, match="unknown option 'pag_size'"):
        settings.load(_parse("--config", str(cfg)), {})


def _tiers(e: ServerArgs) -> tuple[bool, str | None, str | None]:
    return e.enable_hierarchical_cache, e.hicache_storage_backend, e.hicache_storage_dir


def test_daemon_defaults_every_tier_engine_keeps_l1_only(tmp_path):
    _, e = settings.load(_parse(), {"XDG_CACHE_HOME": str(tmp_path)})
    assert _tiers(e) == (True, "file", str(tmp_path / "hicache" / "kv"))
    assert e.hicache_storage_size_gb == ServerArgs().hicache_storage_size_gb  # the cap stays
    assert _tiers(ServerArgs()) == (False, None, None)  # Engine(): SGLang's defaults


@pytest.mark.parametrize("xdg", [None, "", "relative/cache"])
def test_default_l3_dir_falls_back_to_home_cache(xdg, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    env = {} if xdg is None else {"XDG_CACHE_HOME": xdg}
    _, e = settings.load(_parse(), env)
    assert e.hicache_storage_dir == str(tmp_path / ".cache" / "hicache" / "kv")


L2_OFF = (False, None, None)
L3_OFF = (True, None, None)


@pytest.mark.parametrize(
    "argv,env,toml,want",
    [
        (["--no-enable-hierarchical-cache"], {}, "", L2_OFF),
        ([], {"HICACHE_ENABLE_HIERARCHICAL_CACHE": "false"}, "", L2_OFF),
        ([], {}, "[engine]\nenable_hierarchical_cache = false\n", L2_OFF),
        (["--hicache-storage-backend", "none"], {}, "", L3_OFF),
        ([], {"HICACHE_HICACHE_STORAGE_BACKEND": "none"}, "", L3_OFF),
        ([], {}, 'hicache-storage-backend = "none"\n', L3_OFF),
        (["--disable-radix-cache"], {}, "", L2_OFF),  # no radix tree, no lower tiers
    ],
)
def test_each_tier_turns_off_by_flag_env_or_toml(argv, env, toml, want, tmp_path):
    if toml:
        (tmp_path / "c.toml").write_text(toml)
        argv = [*argv, "--config", str(tmp_path / "c.toml")]
    _, e = settings.load(_parse(*argv), {"XDG_CACHE_HOME": str(tmp_path), **env})
    assert _tiers(e) == want


def test_tier_precedence_flag_env_toml_daemon_default(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[engine]\nenable_hierarchical_cache = false\nhicache_storage_dir = "/toml"\n')
    xdg = {"XDG_CACHE_HOME": str(tmp_path)}
    assert _tiers(settings.load(_parse("--config", str(cfg)), xdg)[1]) == (False, None, "/toml")
    env = {**xdg, "HICACHE_ENABLE_HIERARCHICAL_CACHE": "1", "HICACHE_HICACHE_STORAGE_DIR": "/env"}
    assert _tiers(settings.load(_parse("--config", str(cfg)), env)[1]) == (True, "file", "/env")
    ns = _parse("--config", str(cfg), "--hicache-storage-dir", "/flag")
    assert _tiers(settings.load(ns, env)[1]) == (True, "file", "/flag")
    ns = _parse("--config", str(cfg), "--no-enable-hierarchical-cache")
    assert _tiers(settings.load(ns, env)[1]) == (False, None, "/env")
    env["HICACHE_HICACHE_STORAGE_BACKEND"] = "none"  # env beats the daemon default
    ns = _parse("--hicache-storage-backend", "file")  # and the flag beats env
    assert _tiers(settings.load(_parse(), env)[1])[:2] == (True, None)
    assert _tiers(settings.load(ns, env)[1])[:2] == (True, "file")


def test_docker_storage_dir_env_wins_and_is_harmless_with_l2_off():
    env = {"HICACHE_HICACHE_STORAGE_DIR": "/var/cache/hicache", "XDG_CACHE_HOME": "/xdg"}
    _, e = settings.load(_parse(), env)
    assert _tiers(e) == (True, "file", "/var/cache/hicache")
    _, e = settings.load(_parse("--no-enable-hierarchical-cache"), env)
    assert e.enable_hierarchical_cache is False and e.hicache_storage_backend is None


@pytest.mark.parametrize(
    "argv,env",
    [
        (["--no-enable-hierarchical-cache", "--hicache-storage-backend", "file"], {}),
        ([], {"HICACHE_ENABLE_HIERARCHICAL_CACHE": "0", "HICACHE_HICACHE_STORAGE_BACKEND": "file"}),
    ],
)
def test_storage_without_hierarchy_is_an_error(argv, env):
    with pytest.raises(ValueError, match="hicache_storage_backend='file' needs the hierarchical"):
        settings.load(_parse(*argv), env)


def test_ensure_storage_dir_creates_it_user_only(tmp_path):
    _, e = settings.load(_parse(), {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    path = settings.ensure_storage_dir(e)
    assert path == str(tmp_path / "xdg" / "hicache" / "kv")
    for d in (tmp_path / "xdg", tmp_path / "xdg" / "hicache", tmp_path / "xdg" / "hicache" / "kv"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert settings.ensure_storage_dir(e) == path  # an existing dir is fine
    _, off = settings.load(_parse("--hicache-storage-backend", "none"), {})
    assert settings.ensure_storage_dir(off) is None


def test_uncreatable_storage_dir_fails_serve_naming_the_option(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    e = ServerArgs(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(blocker / "kv"),
    )
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        settings.ensure_storage_dir(e)
    # `hicache serve` stops before loading anything: usage error, the message names the option.
    assert cli.main(["serve", "--hicache-storage-dir", str(blocker / "kv")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "not a directory" in err and "--hicache-storage-dir" in err and "none" in err
    assert (
        cli.main(["serve", "--no-enable-hierarchical-cache", "--hicache-storage-backend", "file"])
        == cli.EXIT_USAGE
    )
    assert "needs the hierarchical cache" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_storage_dir_is_an_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    e = ServerArgs(
        enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(ro)
    )
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        settings.ensure_storage_dir(e)


def test_describe_tiers():
    assert settings.describe_tiers(ServerArgs().to_dict()) == "l1 device; l2, l3 off"
    on = ServerArgs(enable_hierarchical_cache=True, hicache_size=4.0)
    assert settings.describe_tiers(on.to_dict()) == "l1 device + l2 host (4 GB); l3 off"
    l3 = ServerArgs(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir="/kv",
        hicache_storage_size_gb=8,
    )
    assert settings.describe_tiers(l3.to_dict()) == (
        f"l1 device + l2 host ({l3.hicache_ratio:g}x l1) + l3 file /kv (cap 8 GB)"
    )


ADMIN = "/hicache.v1.CacheAdminService/Flush"
READ = "/hicache.v1.CacheAdminService/GetCacheStats"
HEALTH = "/grpc.health.v1.Health/Check"


def test_auth_rules():
    U, P, ok = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, None
    code = lambda m, t, tok, adm: (auth.check(m, t, tok, adm) or (None,))[0]
    assert code(HEALTH, None, "u", "a") is ok
    assert code(READ, None, None, None) is ok
    assert code(READ, None, "u", "a") == U and code(READ, "x", "u", "a") == U
    assert code(READ, "u", "u", "a") is ok and code(READ, "a", "u", "a") is ok
    assert code(ADMIN, None, "u", "a") == U
    assert code(ADMIN, "u", "u", "a") == P and code(ADMIN, "x", None, "a") == P
    assert code(ADMIN, "a", "u", "a") is ok
    assert code(ADMIN, "u", "u", None) is ok  # no admin token: the user token suffices
    assert code(READ, None, None, "a") is ok  # reads stay open without --token
    # SMG's worker protocol: its HealthCheck is a probe, FlushCache an admin mutation
    smg = "/sglang.grpc.scheduler.SglangScheduler/"
    assert code(smg + "HealthCheck", None, "u", "a") is ok
    assert (
        code(smg + "Generate", None, "u", "a") == U and code(smg + "Generate", "u", "u", "a") is ok
    )
    assert (
        code(smg + "FlushCache", "u", "u", "a") == P
        and code(smg + "FlushCache", "a", "u", "a") is ok
    )


def test_bearer_parsing():
    assert auth.bearer([("authorization", "Bearer abc ")]) == "abc"
    assert auth.bearer([("authorization", "Basic abc")]) == ""
    assert auth.bearer([("x-other", "1")]) is None


def test_redis_l3_settings_from_the_compose_toml_and_errors(tmp_path):
    toml = os.path.join(os.path.dirname(__file__), "..", "..", "docker", "hicache.toml")
    _, e = settings.load(_parse("--config", toml), {})
    assert (e.hicache_storage_backend, e.hicache_storage_url) == ("redis", "redis://valkey:6379/0")
    assert e.hicache_storage_key_prefix == "hicache"
    _, e = settings.load(
        _parse("--hicache-storage-backend", "redis"),
        {"HICACHE_HICACHE_STORAGE_URL": "redis://u:s3cret@h:6379/0"},
    )
    shown = e.public_dict()["hicache_storage_url"]
    assert "s3cret" not in shown and shown == "redis://u@h:6379/0"
    assert "s3cret" not in settings.describe_tiers(e.public_dict())
    with pytest.raises(ValueError, match="needs hicache_storage_url"):
        settings.load(_parse("--hicache-storage-backend", "redis"), {})
    with pytest.raises(ValueError, match="unknown scheme 'http'"):
        settings.load(
            _parse("--hicache-storage-backend", "redis", "--hicache-storage-url", "http://h:1"), {}
        )
    with pytest.raises(ValueError, match="unknown hicache_storage_backend 's3'"):
        settings.load(_parse("--hicache-storage-backend", "s3"), {})


def test_storage_admin_rpcs_are_admin_mutations():
    for m in ("AttachStorage", "DetachStorage"):
        method = f"/{auth.CACHE_ADMIN_SERVICE}/{m}"
        assert auth.check(method, "user", "user", "admin")[0] == grpc.StatusCode.PERMISSION_DENIED
    get = f"/{auth.CACHE_ADMIN_SERVICE}/GetStorage"
    assert auth.check(get, "user", "user", "admin") is None


@pytest.mark.parametrize(
    "argv,env,want",
    [
        ([], {}, None),  # auto: off on the CPU, on on an accelerator
        (["--disable-overlap"], {}, True),
        (["--no-disable-overlap"], {}, False),
        ([], {"HICACHE_DISABLE_OVERLAP": "false"}, False),
        ([], {"HICACHE_DISABLE_OVERLAP": "none"}, None),
    ],
)
def test_disable_overlap_is_auto_unless_set(argv, env, want):
    _, e = settings.load(_parse(*argv), env)
    assert e.disable_overlap is want


def test_kv_events_salt_key_from_env_toml_or_file_never_shown(tmp_path, capsys):
    key = "a1b2c3d4e5f60718293a4b5c6d7e8f90"
    d, _ = settings.load(_parse(), {"HICACHE_KV_EVENTS_SALT_KEY": key})
    assert d.kv_events_salt() == key.encode()
    assert d.public_dict()["kv_events_salt_key"] == "***"
    assert key not in repr(d.public_dict())
    keyfile = tmp_path / "salt.key"
    keyfile.write_text(f"{key}\n")
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(f'kv_events_salt_key_file = "{keyfile}"\n')
    d, _ = settings.load(_parse("--config", str(cfg)), {})
    assert d.kv_events_salt() == key.encode()  # the file's key, its newline stripped
    assert d.public_dict()["kv_events_salt_key_file"] == str(keyfile)
    d, _ = settings.load(_parse(), {})
    assert d.kv_events_salt() is None  # none configured: the publisher draws one
    for argv, env, match in (
        ([], {"HICACHE_KV_EVENTS_SALT_KEY": "short"}, "fewer than 16"),
        (["--kv-events-salt-key-file", str(tmp_path / "missing")], {}, "cannot read"),
        (
            ["--kv-events-salt-key-file", str(keyfile)],
            {"HICACHE_KV_EVENTS_SALT_KEY": key},
            "give one",
        ),
    ):
        with pytest.raises(ValueError, match=match) as e:
            settings.load(_parse(*argv), env)
        assert key not in str(e.value)
    # `hicache serve` stops before loading anything, naming the option, never the key
    assert cli.main(["serve", "--kv-events-salt-key", "0123456789"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "kv_events_salt_key" in err and "0123456789" not in err


@pytest.mark.parametrize(
    "argv,device,want",
    [
        ([], "cpu", 0),  # auto: every L3 hit is read on the CPU
        ([], "cuda", 256),  # SGLang's default on CUDA
        ([], "cuda:1", 256),
        (["--hicache-prefetch-threshold", "256"], "cpu", 256),
        (["--hicache-prefetch-threshold", "0"], "cuda", 0),
    ],
)
def test_prefetch_threshold_is_auto_by_device_unless_set(argv, device, want):
    _, e = settings.load(_parse(*argv, "--device", device), {})
    assert e.hicache_prefetch_threshold == want
