"""The host tier's parts of HiRadixCache: the L1 <-> L2 copies, the eviction from both memory tiers, and the tree operations they call."""
