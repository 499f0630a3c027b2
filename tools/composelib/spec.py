"""The services of a compose file as records: what `docker compose` would run for each (image,
build, command, environment, mounts, published ports, healthcheck, start order), paths resolved
against the file's folder. Only the parts docker/compose.yaml uses are read; anything else in a
service is refused, so that a new key cannot be silently left out of a check."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"

# NOTE: `restart` and `build` are read for what they say about the service, not acted on here
_KEYS = {
    "image",
    "build",
    "command",
    "environment",
    "volumes",
    "secrets",
    "ports",
    "healthcheck",
    "depends_on",
    "restart",
    "stop_grace_period",
}
_DURATION = re.compile(r"^(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$")


@dataclass(frozen=True)
class Build:
    context: Path
    dockerfile: Path  # absolute


@dataclass(frozen=True)
class Mount:
    source: Path  # on the host
    target: str  # in the container
    read_only: bool


@dataclass(frozen=True)
class Port:
    host_ip: str
    host_port: int
    container_port: int


@dataclass(frozen=True)
class Healthcheck:
    test: tuple[str, ...]  # the argv of a CMD test
    interval_s: float
    timeout_s: float
    start_period_s: float
    retries: int


@dataclass(frozen=True)
class Service:
    name: str
    image: str
    build: Build | None
    command: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]  # volumes, then secrets (at /run/secrets/<name>, read-only)
    ports: tuple[Port, ...]
    healthcheck: Healthcheck | None
    depends_on: tuple[tuple[str, str], ...]  # (service, condition)
    stop_grace_s: float = 10.0  # stop_grace_period: SIGTERM, then SIGKILL this much later

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


@dataclass(frozen=True)
class Project:
    name: str
    path: Path
    services: Mapping[str, Service]

    def start_order(self) -> list[list[str]]:
        """The services in waves: each wave's dependencies are all in earlier waves."""
        waves: list[list[str]] = []
        done: set[str] = set()
        while len(done) < len(self.services):
            wave = sorted(
                n
                for n, s in self.services.items()
                if n not in done and all(d in done for d, _ in s.depends_on)
            )
            if not wave:
                raise ValueError(
                    f"{self.path}: a depends_on cycle among {sorted(set(self.services) - done)}"
                )
            waves.append(wave)
            done.update(wave)
        return waves


def seconds(text: str | float) -> float:
    """A compose duration ('15s', '1m30s', '2.5s') in seconds."""
    if isinstance(text, int | float):
        return float(text)
    m = _DURATION.match(text.strip())
    if not m or not any(m.groups()):
        raise ValueError(f"unsupported duration {text!r}")
    return 60.0 * int(m.group(1) or 0) + float(m.group(2) or 0)


def _port(text: str) -> Port:
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"ports: {text!r}: expected HOST_IP:HOST_PORT:CONTAINER_PORT")
    return Port(parts[0], int(parts[1]), int(parts[2]))


def _mount(base: Path, text: str) -> Mount:
    source, target, *mode = text.split(":")
    if mode not in ([], ["ro"], ["rw"]):
        raise ValueError(f"volumes: {text!r}: unsupported mode")
    return Mount((base / source).resolve(), target, mode == ["ro"])


def _healthcheck(raw: Mapping[str, Any]) -> Healthcheck:
    test = list(raw["test"])
    if test[0] != "CMD":
        raise ValueError(f"healthcheck: only the CMD form is supported, not {test[0]!r}")
    # compose's defaults where a key is absent
    return Healthcheck(
        tuple(test[1:]),
        seconds(raw.get("interval", "30s")),
        seconds(raw.get("timeout", "30s")),
        seconds(raw.get("start_period", "0s")),
        int(raw.get("retries", 3)),
    )


def _environment(raw: Mapping[str, Any] | list[str] | None) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if isinstance(raw, list):
        return tuple((k, v) for k, _, v in (item.partition("=") for item in raw))
    return tuple((k, "" if v is None else str(v)) for k, v in raw.items())


def _service(name: str, raw: Mapping[str, Any], base: Path, secrets: Mapping[str, Path]) -> Service:
    unknown = set(raw) - _KEYS
    if unknown:
        raise ValueError(f"service {name}: keys this reader does not know: {sorted(unknown)}")
    build = None
    if "build" in raw:
        context = (base / raw["build"]["context"]).resolve()
        build = Build(context, (context / raw["build"].get("dockerfile", "Dockerfile")).resolve())
    mounts = [_mount(base, v) for v in raw.get("volumes", [])]
    mounts += [Mount(secrets[s], f"/run/secrets/{s}", True) for s in raw.get("secrets", [])]
    depends = raw.get("depends_on", {})
    if isinstance(depends, list):
        depends = {d: {"condition": "service_started"} for d in depends}
    return Service(
        name=name,
        image=raw["image"],
        build=build,
        command=tuple(str(a) for a in raw.get("command", [])),
        environment=_environment(raw.get("environment")),
        mounts=tuple(mounts),
        ports=tuple(_port(p) for p in raw.get("ports", [])),
        healthcheck=_healthcheck(raw["healthcheck"]) if "healthcheck" in raw else None,
        depends_on=tuple(
            sorted((d, c.get("condition", "service_started")) for d, c in depends.items())
        ),
        stop_grace_s=seconds(raw.get("stop_grace_period", "10s")),
    )


def load(path: Path = COMPOSE_FILE) -> Project:
    """Reads a compose file (YAML anchors and `<<` merges resolved by the YAML loader)."""
    data = yaml.safe_load(path.read_text())
    base = path.parent
    secrets = {n: (base / s["file"]).resolve() for n, s in data.get("secrets", {}).items()}
    services = {n: _service(n, s, base, secrets) for n, s in data["services"].items()}
    return Project(data.get("name", base.name), path, services)
