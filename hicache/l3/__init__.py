"""The storage tier's parts of HiRadixCache: backup and repair, prefetch into L2, admission of waiting requests, the index of stored objects, and the tree operations they call."""
