"""The HMAC key of namespaces' salts in the KV events (hicache.observe.blocks.namespace_salt).

Configured, every daemon given the same secret publishes a namespace's blocks under the same
hashes: behind one gateway, and across restarts, a tenant's prefix has one name everywhere.
The key itself (env HICACHE_KV_EVENTS_SALT_KEY, TOML kv_events_salt_key) or a file that holds it
(--kv-events-salt-key-file); neither: the publisher draws one per process (safe, but a tenant's
blocks then hash apart on every daemon and after every restart). It is a secret: whoever knows
it and sees the events can test guessed namespace names against their salts. It is never
logged, and GetServerInfo shows it as ***.
"""

from __future__ import annotations

from pathlib import Path

MIN_KEY_BYTES = 16  # e.g. `openssl rand -hex 32`


def salt_key(key: str | None, key_file: str | None) -> bytes | None:
    """The configured key (surrounding whitespace stripped), or None when none is; ValueError
    naming the option (never the key) when it cannot be used."""
    if key and key_file:
        raise ValueError("kv_events_salt_key and kv_events_salt_key_file: give one of them")
    if key_file:
        what = f"kv_events_salt_key_file {key_file}"
        try:
            raw = Path(key_file).expanduser().read_bytes().strip()
        except OSError as e:
            raise ValueError(f"{what}: cannot read it ({e.strerror or e})") from None
    elif key:
        what, raw = "kv_events_salt_key", key.strip().encode()
    else:
        return None
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(
            f"{what}: the key has {len(raw)} bytes, fewer than {MIN_KEY_BYTES} "
            "(make one with `openssl rand -hex 32`)"
        )
    return raw
