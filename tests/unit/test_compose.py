"""docker/compose.yaml checked without containers: each daemon's command parses with the real
`hicache serve` parser and its settings (the image's env + the service's env + the mounted
docker/hicache.toml + the salt key secret) load with the real loader; the gateway's command is
accepted by the real `smg launch` parser and its worker URLs are the daemons' gRPC ports, its
model alias their served name; the healthchecks are commands the images run against the right
ports; the published ports collide nowhere and reach ports the services listen on.
tools/compose_check.py runs the file for real (buildah)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest

from engine.client import cli
from engine.server import settings
from tools.composelib import spec

ROOT = Path(__file__).resolve().parents[2]
PROJECT = spec.load()
DAEMON_DOCKERFILE = ROOT / "docker" / "Dockerfile"
GATEWAY_DOCKERFILE = ROOT / "docker" / "smg.Dockerfile"
DAEMONS = [
    s
    for s in PROJECT.services.values()
    if s.build is not None and s.build.dockerfile == DAEMON_DOCKERFILE
]
[GATEWAY] = [
    s
    for s in PROJECT.services.values()
    if s.build is not None and s.build.dockerfile == GATEWAY_DOCKERFILE
]
[VALKEY] = [s for s in PROJECT.services.values() if s.image.startswith("valkey/valkey:")]
VALKEY_PORT = 6379  # valkey-server's default: its command sets no --port
KEY = "0123456789abcdef" * 4


def _runtime_stage(dockerfile: Path) -> list[str]:
    """The last stage's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    last = max(i for i, ln in enumerate(lines) if ln.upper().startswith("FROM "))
    return lines[last:]


def _image_env(dockerfile: Path) -> dict[str, str]:
    env = {}
    for ln in _runtime_stage(dockerfile):
        if ln.upper().startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(ln[4:]))
    return env


def _entrypoint(dockerfile: Path) -> list[str]:
    [ln] = [ln for ln in _runtime_stage(dockerfile) if ln.upper().startswith("ENTRYPOINT ")]
    return re.findall(r'"([^"]*)"', ln)


def _load(service: spec.Service, tmp_path: Path):
    """The daemon's settings as the container resolves them, with the container's paths read
    from the host files mounted there (the secret from a key made here: docker/kv-salt.key is
    made per deployment)."""
    assert _entrypoint(DAEMON_DOCKERFILE) == ["hicache"]
    ns = cli.build_parser().parse_args(list(service.command))
    assert ns.command == "serve"
    key = tmp_path / "kv-salt.key"
    key.write_text(KEY + "\n")
    mounted = {
        m.target: key if m.target.startswith("/run/secrets/") else m.source for m in service.mounts
    }
    env = {
        k: str(mounted.get(v, v))
        for k, v in {**_image_env(DAEMON_DOCKERFILE), **service.env}.items()
    }
    assert all(Path(env[k]).exists() for k in ("HICACHE_CONFIG", "HICACHE_KV_EVENTS_SALT_KEY_FILE"))
    return settings.load(ns, env)


def test_two_daemons_and_their_settings_as_the_containers_load_them(tmp_path):
    assert len(DAEMONS) >= 2
    for s in DAEMONS:
        d, e = _load(s, tmp_path)
        assert d.host == d.http_host == d.metrics_host == "0.0.0.0"  # reachable when published
        assert d.http_port and d.metrics_port and d.served_model_name
        assert d.kv_events_salt() == KEY.encode()
        assert e.enable_hierarchical_cache and e.hicache_storage_backend == "redis"
        url = urlparse(e.hicache_storage_url)
        assert (url.scheme, url.hostname, url.port) == ("redis", VALKEY.name, VALKEY_PORT)
        assert s.depends_on == ((VALKEY.name, "service_healthy"),)
        assert s.stop_grace_s > d.grace_period_s  # SIGKILL only after the drain
    names = {_load(s, tmp_path)[0].served_model_name for s in DAEMONS}
    assert len(names) == 1  # one name behind one gateway (docs/gateway.md, "Names")


def test_both_daemons_get_the_salt_key_the_same_way():
    secrets = [
        {
            (m.source, m.target, m.read_only)
            for m in s.mounts
            if m.target.startswith("/run/secrets/")
        }
        for s in DAEMONS
    ]
    [[(source, target, read_only)]] = {frozenset(x) for x in secrets}
    assert read_only and source == ROOT / "docker" / "kv-salt.key"
    assert {s.env["HICACHE_KV_EVENTS_SALT_KEY_FILE"] for s in DAEMONS} == {target}
    assert "docker/kv-salt.key" in (ROOT / ".gitignore").read_text().split()  # a secret


def test_gateway_command_is_accepted_by_smg_and_points_at_the_daemons(tmp_path):
    launch = pytest.importorskip(
        "smg.launch_router",
        reason="smg is not installed (the test extra: pip install -e '.[test]')",
    )
    from smg.router import Router

    assert _entrypoint(GATEWAY_DOCKERFILE) == ["smg"]
    assert GATEWAY.command[0] == "launch"
    args = launch.parse_router_args(list(GATEWAY.command[1:]))
    args._validate_router_args()  # what `smg launch` checks before it starts
    Router.from_args(args)  # and the Rust router's own config (nothing starts)
    grpc_ports = {}
    for s in DAEMONS:
        d, _ = _load(s, tmp_path)
        grpc_ports[s.name] = d.port
        assert args.model_aliases == {"default": d.served_model_name}
    workers = {
        (urlparse(u).scheme, urlparse(u).hostname, urlparse(u).port) for u in args.worker_urls
    }
    assert workers == {("grpc", name, port) for name, port in grpc_ports.items()}
    assert GATEWAY.depends_on == tuple((s.name, "service_healthy") for s in DAEMONS)
    published = {p.container_port for p in GATEWAY.ports}
    assert published == {args.port, args.prometheus_port} and args.host == "0.0.0.0"


def test_healthchecks_run_the_images_commands_against_their_ports(tmp_path):
    for s in DAEMONS:
        assert s.healthcheck is not None
        assert s.healthcheck.test[0] == "hicache"
        ns = cli.build_parser().parse_args(list(s.healthcheck.test[1:]))
        assert ns.command == "health" and ns.addr is None and ns.timeout < s.healthcheck.timeout_s
        # `hicache health` asks HICACHE_ADDR, else 127.0.0.1:50051: the daemon's gRPC port
        addr = s.env.get("HICACHE_ADDR", "127.0.0.1:50051")
        assert int(addr.rsplit(":", 1)[1]) == _load(s, tmp_path)[0].port
    assert VALKEY.healthcheck is not None and VALKEY.healthcheck.test == ("valkey-cli", "ping")
    awaited = {
        d for s in PROJECT.services.values() for d, c in s.depends_on if c == "service_healthy"
    }
    assert all(PROJECT.services[n].healthcheck is not None for n in awaited)
    assert PROJECT.start_order() == [[VALKEY.name], sorted(s.name for s in DAEMONS), [GATEWAY.name]]


def test_published_ports_collide_nowhere_and_reach_listening_ports(tmp_path):
    bound = [(p.host_ip, p.host_port) for s in PROJECT.services.values() for p in s.ports]
    assert len(bound) == len(set(bound)), bound
    assert {ip for ip, _ in bound} == {"127.0.0.1"}  # docs/docker.md: bound to the host only
    for s in DAEMONS:
        d, _ = _load(s, tmp_path)
        assert sorted(p.container_port for p in s.ports) == sorted(
            [d.port, d.http_port, d.metrics_port]
        )
    assert [p.container_port for p in VALKEY.ports] == [VALKEY_PORT]


def test_compose_reader_resolves_merges_and_refuses_what_it_does_not_know(tmp_path):
    assert PROJECT.services[DAEMONS[0].name].command == DAEMONS[1].command  # the `<<` merge
    assert spec.seconds("15s") == 15.0 and spec.seconds("1m30s") == 90.0
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  x:\n    image: a\n    network_mode: host\n")
    with pytest.raises(ValueError, match="network_mode"):
        spec.load(bad)
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text(
        "services:\n  x: {image: a, depends_on: [y]}\n  y: {image: a, depends_on: [x]}\n"
    )
    with pytest.raises(ValueError, match="cycle"):
        spec.load(cycle).start_order()
