"""The Redis / Valkey L3 backend: its client, key format, health, reconcile sweep and URLs."""
