"""Daemon settings: flags > HICACHE_* env vars > TOML file > defaults, mapped in this one place
onto DaemonSettings (the gRPC side) and engine.config.ServerArgs (the engine side).

TOML (--config / HICACHE_CONFIG): keys at the top level or under [server] / [engine]; names are
the flag names with `_` or `-` (`page_size`, `max-total-tokens`, `port`, `token`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ServerArgs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "HICACHE_"
_SECRET = ("token", "admin_token")


@dataclass(frozen=True)
class DaemonSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    token: str | None = None
    admin_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)
    metrics_port: int = 0  # 0 = off
    metrics_host: str = "127.0.0.1"
    grace_period_s: float = 10.0
    max_message_mb: int = 64
    bridge_threads: int = 256
    warmup: bool = True
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ValueError("ports must be in [0, 65535]")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.grace_period_s < 0:
            raise ValueError("grace_period_s must be >= 0")

    def public_dict(self) -> dict[str, Any]:
        """The settings without secrets (for GetServerInfo)."""
        d = dataclasses.asdict(self)
        return {k: ("***" if k in _SECRET and v else v) for k, v in d.items()}


def _fields() -> dict[str, tuple[str, Any]]:
    """option name -> (owner, type string) for every daemon and engine option."""
    out = {f.name: ("daemon", f.type) for f in dataclasses.fields(DaemonSettings)}
    out.update({f.name: ("engine", f.type) for f in dataclasses.fields(ServerArgs)})
    return out


def _convert(name: str, typ: str, value: Any) -> Any:
    """Parses a string (env / flag) or checks a TOML value against the field's type."""
    base = [t.strip() for t in str(typ).split("|")]
    optional = "None" in base
    base = next(t for t in base if t != "None")
    if isinstance(value, str):
        v = value.strip()
        if optional and v.lower() in ("", "none", "null"):
            return None
        try:
            if base == "bool":
                if v.lower() in ("1", "true", "yes", "on"):
                    return True
                if v.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            return {"int": int, "float": float}.get(base, str)(v)
        except ValueError:
            raise ValueError(f"{name}: expected {typ}, got {value!r}") from None
    ok = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[base]
    if value is None and optional:
        return None
    if not isinstance(value, ok) or (base != "bool" and isinstance(value, bool)):
        raise ValueError(f"{name}: expected {typ}, got {value!r}")
    return float(value) if base == "float" else value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per option; defaults are None so unset flags fall through to env / TOML."""
    parser.add_argument("--config", help="TOML file with daemon and engine options")
    parser.add_argument(
        "--model",
        dest="model_path",
        default=None,
        help="HF model dir or .gguf file (default: the embedded SmolLM2)",
    )
    for name, (owner, typ) in _fields().items():
        if name == "model_path":
            continue
        flag = "--" + name.replace("_", "-")
        if str(typ) == "bool":
            parser.add_argument(
                flag,
                dest=name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=f"({owner})",
            )
        else:
            parser.add_argument(
                flag, dest=name, default=None, metavar=name.upper(), help=f"({owner}, {typ})"
            )


def load(
    ns: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> tuple[DaemonSettings, ServerArgs]:
    """Resolves every option: flag > HICACHE_<NAME> env var > TOML > default."""
    env = os.environ if env is None else env
    fields = _fields()
    values: dict[str, Any] = {}
    cfg = getattr(ns, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if cfg:
        data = tomllib.loads(Path(cfg).read_text())
        flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
        for table in ("server", "engine"):
            flat.update(data.get(table, {}))
        for key, v in flat.items():
            name = key.replace("-", "_")
            if name == "model":
                name = "model_path"
            if name not in fields:
                raise ValueError(f"{cfg}: unknown option {key!r}")
            values[name] = _convert(name, fields[name][1], v)
    for name, (_, typ) in fields.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _convert(ENV_PREFIX + name.upper(), typ, raw)
    if ENV_PREFIX + "MODEL" in env:
        values["model_path"] = env[ENV_PREFIX + "MODEL"] or None
    for name, (_, typ) in fields.items():
        v = getattr(ns, name, None) if ns is not None else None
        if v is not None:
            values[name] = _convert("--" + name.replace("_", "-"), typ, v)
    daemon = DaemonSettings(**{k: v for k, v in values.items() if fields[k][0] == "daemon"})
    engine = ServerArgs.from_kwargs(**{k: v for k, v in values.items() if fields[k][0] == "engine"})
    return daemon, engine
