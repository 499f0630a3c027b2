"""One attention layer's forwards scheduled by hand, recording each token's output: the same
tokens prefilled alone, in batches, after a cached prefix, in chunks, or decoded, so a test can
ask whether a token's output depends on any of that (deterministic inference). The CPU tests
(interpreter) and the GPU tests share it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import create_backend
from engine.runtime.layers.radix_attention import RadixAttention
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

Geometry = tuple[int, int, int]  # (heads, kv_heads, head_dim)


def make_seqs(
    geom: Geometry,
    lens: dict[str, int],
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """rid -> (q, k, v) of each position: [n, heads * head_dim], [n, kv_heads * head_dim] x2."""
    heads, kv_heads, head_dim = geom
    gen = torch.Generator().manual_seed(seed)
    return {
        rid: tuple(
            torch.randn(n, h * head_dim, generator=gen).to(device, dtype)
            for h in (heads, kv_heads, kv_heads)
        )
        for rid, n in lens.items()
    }


class AttentionWorld:
    """Fresh pools with shuffled slots and one backend (``name``; ``deterministic``: its
    fixed-split mode); each request's q/k/v per position come from ``seqs``; ``out[rid, pos]``
    is a token's output [heads * head_dim] once computed."""

    def __init__(
        self,
        seqs: dict,
        geom: Geometry,
        name: str,
        seed: int,
        *,
        deterministic: bool = True,
        split: int | None = None,
        num_slots: int = 1024,
        table_width: int = 320,
    ) -> None:
        heads, kv_heads, head_dim = geom
        q0 = next(iter(seqs.values()))[0]
        self.device, self.dtype = q0.device, q0.dtype
        self.seqs = seqs
        self.layer = RadixAttention(0, heads, kv_heads, head_dim)
        self.req_pool = ReqToTokenPool(8, table_width, self.device)
        self.pool = MHATokenToKVPool(num_slots, 1, self.dtype, kv_heads, head_dim, 1, self.device)
        config = SimpleNamespace(enable_deterministic_inference=deterministic)
        self.backend = create_backend(name, config)
        if split is not None:
            self.backend.split_size = split
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_slots, generator=gen) + 1).tolist()
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}
        self.out: dict[tuple[str, int], torch.Tensor] = {}

    def _grow(self, rid: str, n: int) -> torch.Tensor:
        if rid not in self.rows:
            self.rows[rid] = self.req_pool.alloc(1)[0]
            self.lens[rid] = 0
        p = self.lens[rid]
        loc = torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.int64)
        loc = loc.to(self.device)
        self.req_pool.write((self.rows[rid], slice(p, p + n)), loc)
        self.lens[rid] = p + n
        return loc

    def cached(self, rid: str, n: int) -> None:
        """The first ``n`` tokens of ``rid`` are a cache hit: their K/V sit in the pool."""
        loc = self._grow(rid, n)
        _, k, v = self.seqs[rid]
        self.pool.set_kv_buffer(0, loc, k[:n], v[:n])

    def step(self, mode: ForwardMode, batch: list[tuple[str, int]]) -> None:
        """One forward: request rid gets its next n tokens (n == 1 for DECODE)."""
        prefix = [self.lens.get(rid, 0) for rid, _ in batch]
        keys = [(rid, pos) for (rid, n), p in zip(batch, prefix) for pos in range(p, p + n)]
        locs = torch.cat([self._grow(rid, n) for rid, n in batch])
        seq = [self.lens[rid] for rid, _ in batch]
        ext = [n for _, n in batch]
        q, k, v = (torch.stack([self.seqs[rid][i][pos] for rid, pos in keys]) for i in range(3))
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)
        is_extend = mode == ForwardMode.EXTEND
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(batch),
            input_ids=i64([0] * len(keys)),
            positions=i64([pos for _, pos in keys]),
            out_cache_loc=locs,
            req_pool_indices=i64([self.rows[rid] for rid, _ in batch]),
            seq_lens=i64(seq),
            extend_prefix_lens=i64(prefix) if is_extend else None,
            extend_seq_lens=i64(ext) if is_extend else None,
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix if is_extend else None,
            extend_seq_lens_cpu=ext if is_extend else None,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool,
            attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(fb)
        out = self.backend.forward(q, k, v, self.layer, fb)  # [num_tokens, heads * head_dim]
        for key, row in zip(keys, out):
            self.out[key] = row

    def extend(self, batch: list[tuple[str, int]]) -> None:
        self.step(ForwardMode.EXTEND, batch)

    def decode(self, rids: list[str], steps: int) -> None:
        """``steps`` DECODE steps of ``rids`` together, their order rotating every step."""
        for turn in range(steps):
            k = turn % len(rids)
            self.step(ForwardMode.DECODE, [(rid, 1) for rid in rids[k:] + rids[:k]])


def assert_same_bits(ref: AttentionWorld, others: list[AttentionWorld]) -> int:
    """Every token computed in ``others`` has the same output bits in ``ref``; returns how many
    tokens were compared."""
    compared = 0
    for world in others:
        assert set(world.out) <= set(ref.out)
        for key, got in world.out.items():
            assert torch.equal(got, ref.out[key]), key
            compared += 1
    return compared
