"""SGLang's option names (docs/daemon.md "Option names and SGLang's"): each one SGLang and we
both have means the same here, and where SGLang spells one of ours differently its name is
accepted wherever options are given (Engine / ServerArgs.from_kwargs, flags, HICACHE_* env vars,
TOML) and stored under ours; one option given under two names is an error, never a silent pick."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.config import ServerArgs
from engine.server import settings


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    return p.parse_args(list(argv))


def _engine(
    argv: tuple[str, ...] = (), env: dict[str, str] | None = None, toml: str = "", tmp=None
):
    if toml:
        cfg = tmp / "hicache.toml"
        cfg.write_text(toml)
        argv = ("--config", str(cfg), *argv)
    return settings.load(_parse(*argv), env or {})


@pytest.mark.parametrize(
    "argv,env,toml",
    [
        (("--model-path", "/m"), {}, ""),  # SGLang's flag
        (("--model", "/m"), {}, ""),  # its alias, and ours
        ((), {"HICACHE_MODEL_PATH": "/m"}, ""),
        ((), {"HICACHE_MODEL": "/m"}, ""),
        ((), {}, 'model_path = "/m"\n'),
        ((), {}, 'model = "/m"\n'),
    ],
)
def test_the_model_path_by_either_name(tmp_path, argv, env, toml):
    _, e = _engine(argv, env, toml, tmp_path)
    assert e.model_path == "/m"


def test_server_args_take_sglang_names():
    assert ServerArgs.from_kwargs(model="/m").model_path == "/m"
    assert ServerArgs.from_kwargs(model_path="/m").model_path == "/m"
    args = ServerArgs.from_kwargs(disable_overlap_schedule=True)
    assert args.disable_overlap is True and not args.overlap_enabled()
    args = ServerArgs.from_kwargs(disable_overlap_schedule=False, device="cpu")
    assert args.disable_overlap is False and args.overlap_enabled()  # on, as asked
    assert ServerArgs.from_kwargs(dtype="half").dtype == "float16"  # SGLang's spellings
    assert ServerArgs.from_kwargs(dtype="float").dtype == "float32"
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ServerArgs.from_kwargs(dtype="fp8")


@pytest.mark.parametrize(
    "kw",
    [
        {"model": "/a", "model_path": "/b"},
        {"disable_overlap": True, "disable_overlap_schedule": False},
        {
            "hicache_prefetch_threshold": 8,
            "hicache_storage_backend_extra_config": {"prefetch_threshold": 9},
        },
    ],
)
def test_one_option_under_two_names_is_refused(kw):
    with pytest.raises(TypeError, match="are the same option"):
        ServerArgs.from_kwargs(**kw)


def test_sglang_extra_config_sets_our_prefetch_options(tmp_path):
    extra = {
        "prefetch_threshold": 64,
        "prefetch_timeout_base": 0.5,
        "prefetch_timeout_per_ki_token": 2,
    }
    want = (64, 0.5, 2.0)

    def got(e: ServerArgs) -> tuple:
        return (
            e.hicache_prefetch_threshold,
            e.hicache_prefetch_timeout_base,
            e.hicache_prefetch_timeout_per_ki_token,
        )

    assert (
        got(ServerArgs.from_kwargs(hicache_storage_backend_extra_config=json.dumps(extra))) == want
    )
    assert got(ServerArgs.from_kwargs(hicache_storage_backend_extra_config=extra)) == want
    _, e = _engine(("--hicache-storage-backend-extra-config", json.dumps(extra)))
    assert got(e) == want
    _, e = _engine(env={"HICACHE_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": json.dumps(extra)})
    assert got(e) == want
    # flag > env, whichever name each uses
    _, e = _engine(
        ("--hicache-prefetch-threshold", "7"),
        {"HICACHE_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": '{"prefetch_threshold": 9}'},
    )
    assert e.hicache_prefetch_threshold == 7


@pytest.mark.parametrize(
    "value,match",
    [
        ('{"hicache_storage_pass_prefix_keys": true}', "unsupported key"),
        ("[1, 2]", "expected a JSON object"),
        ("{not json", "not a JSON object"),
        ('{"prefetch_threshold": 1.5}', "must be an integer"),
        ('{"prefetch_timeout_base": "1"}', "must be a number"),
        ('{"prefetch_threshold": -1}', "hicache_prefetch_threshold must be >= 0"),
    ],
)
def test_bad_extra_config_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs.from_kwargs(hicache_storage_backend_extra_config=value)
    with pytest.raises(ValueError, match=match):
        settings.load(_parse("--hicache-storage-backend-extra-config", value), {})


def test_sglang_flags_and_env_names(tmp_path):
    _, e = _engine(("--disable-overlap-schedule",))
    assert e.disable_overlap is True
    _, e = _engine(("--no-disable-overlap-schedule",))
    assert e.disable_overlap is False
    _, e = _engine(env={"HICACHE_DISABLE_OVERLAP_SCHEDULE": "true"})
    assert e.disable_overlap is True
    d, _ = _engine(("--grpc-port", "7001", "--api-key", "k", "--admin-api-key", "a"))
    assert (d.port, d.token, d.admin_token) == (7001, "k", "a")
    d, _ = _engine(env={"HICACHE_GRPC_PORT": "7002", "HICACHE_API_KEY": "k"})
    assert (d.port, d.token) == (7002, "k")
    assert d.public_dict()["token"] == "***"  # an alias is no way around the redaction
    d, _ = _engine(toml="grpc_port = 7003\n", tmp=tmp_path)
    assert d.port == 7003


def test_two_names_of_one_option_in_one_source_are_refused(tmp_path):
    with pytest.raises(TypeError, match="same option"):
        _engine(env={"HICACHE_MODEL": "/a", "HICACHE_MODEL_PATH": "/b"})
    with pytest.raises(TypeError, match="same option"):
        _engine(toml="port = 1\ngrpc_port = 2\n", tmp=tmp_path)
    # across sources the usual order decides: flag > env > TOML
    d, e = _engine(("--grpc-port", "5"), {"HICACHE_PORT": "6", "HICACHE_MODEL": "/env"})
    assert d.port == 5 and e.model_path == "/env"
