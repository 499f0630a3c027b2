"""Bytes and free lists: the L1 slot allocator, the request -> slot table, the device KV pool and the host (L2) KV pool."""
