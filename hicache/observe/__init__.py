"""What the cache shows: events, typed statistics, and the tree seen as KV blocks for routers. Torch-free: the API server process imports it."""
