"""Settings precedence (flag > env > TOML > default) and the auth rules."""

from __future__ import annotations

import argparse

import grpc
import pytest

from engine.server import auth, settings


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p.parse_args(list(argv))


def test_precedence_flag_env_toml(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text('port = 7000\n[engine]\npage_size = 8\nmax-total-tokens = 999\n'
                   '[server]\ntoken = "t"\n')
    env = {"HICACHE_PAGE_SIZE": "4", "HICACHE_ENABLE_HIERARCHICAL_CACHE": "true"}
    d, e = settings.load(_parse("--config", str(cfg), "--port", "7001"), env)
    assert d.port == 7001 and d.token == "t"  # flag beats TOML
    assert e.page_size == 4 and e.max_total_tokens == 999  # env beats TOML
    assert e.enable_hierarchical_cache is True
    d, e = settings.load(_parse("--model", "/m", "--no-warmup"), {"HICACHE_METRICS_PORT": "9"})
    assert e.model_path == "/m" and d.warmup is False and d.metrics_port == 9
    assert d.public_dict()["token"] is None


@pytest.mark.parametrize("argv,env,match", [
    (["--port", "x"], {}, "expected int"),
    ([], {"HICACHE_WARMUP": "maybe"}, "expected bool"),
    (["--page-size", "0"], {}, "page_size"),
    (["--tls-cert", "c.pem"], {}, "go together"),
    ([], {"HICACHE_SCHEDULE_POLICY": "nope"}, "schedule_policy"),
])
def test_bad_settings_raise(argv, env, match):
    with pytest.raises(ValueError, match=match):
        settings.load(_parse(*argv), env)


def test_unknown_toml_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("pag_size = 4\n")
    with pytest.raises(ValueError, match="unknown option 'pag_size'"):
        settings.load(_parse("--config", str(cfg)), {})


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


def test_bearer_parsing():
    assert auth.bearer([("authorization", "Bearer abc ")]) == "abc"
    assert auth.bearer([("authorization", "Basic abc")]) == ""
    assert auth.bearer([("x-other", "1")]) is None
