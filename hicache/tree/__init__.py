"""What is cached where: the tree node, the prefix-cache interface and its trees (radix, chunk, hiradix), eviction plans, and the request as the caches see it."""
