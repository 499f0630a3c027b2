"""Daemon settings: flags > HICACHE_* env vars > TOML file > daemon defaults > field defaults,
mapped in this one place onto DaemonSettings (the gRPC side) and engine.config.ServerArgs (the
engine side).

TOML (--config / HICACHE_CONFIG): keys at the top level or under [server] / [engine]; names are
the flag names with `_` or `-` (`page_size`, `max-total-tokens`, `port`, `token`, ...).

The daemon runs the whole hierarchy by default (DAEMON_ENGINE_DEFAULTS: L1 + L2 + file L3 under
$XDG_CACHE_HOME/hicache/kv); `Engine()` keeps ServerArgs' SGLang-compatible defaults (L1 only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ALIASES, SGLANG_EXTRA_CONFIG, ServerArgs, canonical
from engine.server import tenants as tenancy
from engine.server.kv_events_config import KvEventsConfig
from engine.server.kv_events_salt import salt_key
from engine.server.tenants import Tenant
from hicache.storage.redis.url import redact_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "HICACHE_"
_SECRET = ("token", "admin_token", "kv_events_salt_key")
# SGLang's names of daemon options that mean the same here (the engine's: config.ALIASES).
# NOTE: SGLang's `port` / `host` are its HTTP server's; ours are the gRPC server's (the HTTP API:
# http_port / http_host), so `grpc_port` is the alias that means ours.
DAEMON_ALIASES = {"grpc_port": "port", "api_key": "token", "admin_api_key": "admin_token"}
_ALIASES = {**ALIASES, **DAEMON_ALIASES}

# Engine options whose daemon default differs from ServerArgs' (= Engine()'s) default; they apply
# below TOML / env / flags. NOTE: the L3 entries apply only when the hierarchy resolves on (L3
# sits below L2), and hicache_storage_dir defaults to default_storage_dir() with a file backend.
DAEMON_ENGINE_DEFAULTS: dict[str, Any] = {
    "enable_hierarchical_cache": True,
    "hicache_storage_backend": "file",
}
_DAEMON_DEFAULT_HELP = {
    "enable_hierarchical_cache": "; daemon default: on (L1 + L2)",
    "hicache_storage_backend": "; daemon default: file with the hierarchy on; none = L3 off",
    "hicache_storage_dir": "; daemon default: $XDG_CACHE_HOME/hicache/kv or ~/.cache/hicache/kv",
    "hicache_storage_url": "; with --hicache-storage-backend redis",
}


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
    http_port: int = 0  # the OpenAI-compatible HTTP API; 0 = off
    http_host: str = "127.0.0.1"
    # the model's id in /v1/models and gateways (default: the model directory's name)
    served_model_name: str | None = None
    kv_events_block_size: int = 16  # tokens per block in the KV events routers subscribe to
    # vLLM-format KV events over ZMQ: vLLM's --kv-events-config JSON (engine/server/kv_events_zmq)
    kv_events_config: str | None = None
    # the HMAC key of namespaces' salts in KV events (engine/server/kv_events_salt): the key (a
    # secret) or a file holding it, the same for every daemon behind a gateway; neither: drawn
    # per process
    kv_events_salt_key: str | None = None
    kv_events_salt_key_file: str | None = None
    # "split": scheduler and detokenizer in their own processes (seed 002); "single": one process
    processes: str = "split"
    grace_period_s: float = 10.0
    max_message_mb: int = 64
    bridge_threads: int = 256
    warmup: bool = True
    log_level: str = "info"
    tenants: tuple[Tenant, ...] = ()  # [tenants.<name>] / --tenant / HICACHE_TENANTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tuple(self.tenants))
        tenancy.check_unique(self.tenants, (self.token, self.admin_token))
        if not all(0 <= p <= 65535 for p in (self.port, self.metrics_port, self.http_port)):
            raise ValueError("ports must be in [0, 65535]")
        if self.processes not in ("split", "single"):
            raise ValueError(f"processes must be 'split' or 'single', got {self.processes!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.grace_period_s < 0:
            raise ValueError("grace_period_s must be >= 0")
        if self.kv_events_block_size < 1:
            raise ValueError("kv_events_block_size must be >= 1")
        if self.kv_events_config:
            KvEventsConfig.parse(self.kv_events_config)
        self.kv_events_salt()  # a key that cannot be used fails here, at load

    def kv_events_salt(self) -> bytes | None:
        """The configured HMAC key of namespaces' salts (None: the publisher draws one)."""
        return salt_key(self.kv_events_salt_key, self.kv_events_salt_key_file)

    def public_dict(self) -> dict[str, Any]:
        """The settings without secrets (for GetServerInfo)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["tenants"] = [t.public_dict() for t in self.tenants]  # names and quotas, no tokens
        return {k: ("***" if k in _SECRET and v else v) for k, v in d.items()}

    @property
    def auth_enabled(self) -> bool:
        return bool(self.token or self.admin_token or self.tenants)


def _fields() -> dict[str, tuple[str, Any]]:
    """option name -> (owner, type string) for every daemon and engine option."""
    out = {
        f.name: ("daemon", f.type)
        for f in dataclasses.fields(DaemonSettings)
        if f.name != "tenants"  # structured: see _load_tenants
    }
    out.update({f.name: ("engine", f.type) for f in dataclasses.fields(ServerArgs)})
    return out


def _convert(name: str, typ: str, value: Any) -> Any:
    """Parses a string (env / flag) or checks a TOML value against the field's type."""
    parts = [t.strip() for t in str(typ).split("|")]
    optional = "None" in parts
    base = next(t for t in parts if t != "None")
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
            parse: Callable[[str], Any] = {"int": int, "float": float}.get(base, str)
            return parse(v)
        except ValueError:
            raise ValueError(f"{name}: expected {typ}, got {value!r}") from None
    ok = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[base]
    if value is None and optional:
        return None
    if not isinstance(value, ok) or (base != "bool" and isinstance(value, bool)):
        raise ValueError(f"{name}: expected {typ}, got {value!r}")
    if base == "float" and isinstance(value, (int, float)):  # checked above: a number
        return float(value)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per option; defaults are None so unset flags fall through to env / TOML."""
    parser.add_argument("--config", help="TOML file with daemon and engine options")
    parser.add_argument(
        "--tenant",
        dest="tenant",
        action="append",
        default=None,
        metavar="NAME:TOKEN[,key=value...]",
        help="(daemon) a tenant: its token, namespaces=a|b, quota_l1_tokens=N, quota_l2_tokens=N, "
        "quota_l3_tokens=N; repeatable (env HICACHE_TENANTS: entries separated by ';')",
    )
    parser.add_argument(
        "--" + SGLANG_EXTRA_CONFIG.replace("_", "-"),
        dest=SGLANG_EXTRA_CONFIG,
        default=None,
        metavar="JSON",
        help="(engine) SGLang's extra config: a JSON object with prefetch_threshold, "
        "prefetch_timeout_base, prefetch_timeout_per_ki_token (= the --hicache-prefetch-* flags)",
    )
    for name, (owner, typ) in _fields().items():
        flags = ["--" + n.replace("_", "-") for n in (name, *_aliases_of(name))]
        note = _DAEMON_DEFAULT_HELP.get(name, "")
        if name == "model_path":
            note = "; HF model dir or .gguf file (default: the embedded SmolLM2)"
        if str(typ) in ("bool", "bool | None"):  # --x / --no-x; neither: the default
            parser.add_argument(
                *flags,
                dest=name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=f"({owner}{note})",
            )
        else:
            parser.add_argument(
                *flags,
                dest=name,
                default=None,
                metavar=name.upper(),
                help=f"({owner}, {typ}{note})",
            )


def _aliases_of(name: str) -> list[str]:
    return [alias for alias, target in _ALIASES.items() if target == name]


def _typed(
    options: Mapping[str, Any], label: Callable[[str], str], source: str = ""
) -> dict[str, Any]:
    """One source's options (a TOML file, the environment, the flags), each value converted to
    its option's type, under our names (SGLang's spellings renamed, config.canonical); ValueError
    for a name that is no option, TypeError for one option given under two names."""
    fields = _fields()
    typed: dict[str, Any] = {}
    for name, value in options.items():
        target = _ALIASES.get(name, name)
        if name == SGLANG_EXTRA_CONFIG:  # checked where it is spread (config.extra_config)
            typed[name] = value
        elif target not in fields:
            raise ValueError(f"{source}: unknown option {name!r}")
        else:
            typed[name] = _convert(label(name), fields[target][1], value)
    return canonical(typed, _ALIASES)


def default_storage_dir(env: Mapping[str, str]) -> str:
    """$XDG_CACHE_HOME/hicache/kv, or ~/.cache/hicache/kv (a relative XDG_CACHE_HOME is ignored,
    as the XDG spec asks)."""
    xdg = env.get("XDG_CACHE_HOME", "")
    root = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "hicache", "kv")


def _apply_daemon_defaults(values: dict[str, Any], env: Mapping[str, str]) -> None:
    """Fills the engine options the user left unset (absent from `values`) with the daemon's
    defaults; an explicit L3 backend with the hierarchy off is an error."""
    if "enable_hierarchical_cache" not in values:
        # NOTE: with the radix cache off the tree is a ChunkCache, which has no lower tiers.
        on = DAEMON_ENGINE_DEFAULTS["enable_hierarchical_cache"]
        values["enable_hierarchical_cache"] = on and not values.get("disable_radix_cache", False)
    if not values["enable_hierarchical_cache"]:
        if values.get("hicache_storage_backend"):
            raise ValueError(
                f"hicache_storage_backend={values['hicache_storage_backend']!r} needs the "
                "hierarchical cache (L3 sits below L2): turn it on (--enable-hierarchical-cache) "
                "or L3 off (--hicache-storage-backend none)"
            )
        return
    values.setdefault("hicache_storage_backend", DAEMON_ENGINE_DEFAULTS["hicache_storage_backend"])
    if values["hicache_storage_backend"] == "file" and not values.get("hicache_storage_dir"):
        values["hicache_storage_dir"] = default_storage_dir(env)


def load(
    ns: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> tuple[DaemonSettings, ServerArgs]:
    """Resolves every option: flag > HICACHE_<NAME> env var > TOML > DAEMON_ENGINE_DEFAULTS >
    the dataclass defaults. Pure: creates nothing (see ensure_storage_dir)."""
    env = os.environ if env is None else env
    fields = _fields()
    names = [*fields, *_ALIASES, SGLANG_EXTRA_CONFIG]  # every name an option may be given by
    values: dict[str, Any] = {}
    tenants: tuple[Tenant, ...] = ()
    cfg = getattr(ns, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if cfg:
        data = tomllib.loads(Path(cfg).read_text())
        tables = data.pop("tenants", {})
        if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
            raise ValueError(f"{cfg}: tenants must be [tenants.<name>] tables")
        tenants = tuple(tenancy.from_table(name, t) for name, t in tables.items())
        flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
        for table in ("server", "engine"):
            flat.update(data.get(table, {}))
        toml = {key.replace("-", "_"): v for key, v in flat.items()}
        values.update(_typed(toml, lambda name: name, cfg))
    environ = {n: env[ENV_PREFIX + n.upper()] for n in names if ENV_PREFIX + n.upper() in env}
    values.update(_typed(environ, lambda name: ENV_PREFIX + name.upper()))
    given = {n: getattr(ns, n, None) for n in (*fields, SGLANG_EXTRA_CONFIG)} if ns else {}
    flags = {n: v for n, v in given.items() if v is not None}
    values.update(_typed(flags, lambda name: "--" + name.replace("_", "-")))
    # NOTE: the tenant list comes whole from the highest source that sets one.
    if env.get(ENV_PREFIX + "TENANTS") is not None:
        tenants = tenancy.parse_specs(env[ENV_PREFIX + "TENANTS"])
    if ns is not None and getattr(ns, "tenant", None):  # a Namespace may lack the flag
        tenants = tuple(tenancy.parse_spec(spec) for spec in ns.tenant)
    _apply_daemon_defaults(values, env)
    daemon = DaemonSettings(
        **{k: v for k, v in values.items() if fields[k][0] == "daemon"}, tenants=tenants
    )
    engine = ServerArgs.from_kwargs(**{k: v for k, v in values.items() if fields[k][0] == "engine"})
    return daemon, engine


def ensure_storage_dir(args: ServerArgs) -> str | None:
    """Creates the file L3 directory before the daemon starts (see ensure_dir); returns it, or
    None without a file L3."""
    if not (args.enable_hierarchical_cache and args.hicache_storage_backend == "file"):
        return None
    if not args.hicache_storage_dir:
        return None  # the engine's own default (engine/runtime/hicache_setup.py)
    return ensure_dir(args.hicache_storage_dir)


def ensure_dir(directory: str) -> str:
    """Creates a file L3 directory, the parts it creates user-only (0700); returns its path.
    Raises ValueError naming the option when it cannot be created or written."""
    if not directory:
        raise ValueError("no L3 directory given (and the daemon has none configured)")
    path = Path(os.path.expanduser(directory))
    try:
        for p in reversed([path, *path.parents]):
            if p.exists() and not p.is_dir():
                raise NotADirectoryError(20, f"{p} is not a directory")
            if not p.is_dir():
                p.mkdir(mode=0o700)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise ValueError(
            f"cannot use {path} as the L3 storage directory ({e.strerror or e}): set "
            "--hicache-storage-dir (HICACHE_HICACHE_STORAGE_DIR) to a writable directory, or turn "
            "L3 off with --hicache-storage-backend none"
        ) from None
    return str(path)


def describe_tiers(args: Mapping[str, Any]) -> str:
    """The active cache tiers in one line, from ServerArgs.to_dict() (or GetServerInfo's config)."""
    if args.get("disable_radix_cache"):
        return "l1 device (no prefix cache); l2, l3 off"
    if not args.get("enable_hierarchical_cache"):
        return "l1 device; l2, l3 off"
    size = float(args.get("hicache_size") or 0.0)
    l2 = f"{size:g} GB" if size > 0 else f"{float(args.get('hicache_ratio') or 0):g}x l1"
    out = f"l1 device + l2 host ({l2})"
    backend = args.get("hicache_storage_backend")
    if not backend:
        return out + "; l3 off"
    if backend == "redis":
        return out + f" + l3 redis {redact_url(args.get('hicache_storage_url') or '')}"
    where = f" {args['hicache_storage_dir']}" if args.get("hicache_storage_dir") else ""
    cap = float(args.get("hicache_storage_size_gb") or 0)
    return out + f" + l3 {backend}{where} (cap {cap:g} GB)"
