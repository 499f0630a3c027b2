"""ScheduleBatch: the CPU-side batch; allocates KV slots and builds the ForwardBatch.

Slots of one request row (page_size = 4, kv_len = 6, extending 5 tokens):

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11
    owner       tree    | req(kept tail) | new page
                         ^kv_len=6: positions 6,7 continue the request's partial page
                         (slot = previous slot + 1), positions 8..10 get a fresh page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import AttentionBackend
from engine.runtime.request import Req
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.tree.base import BasePrefixCache


class OutOfKVError(RuntimeError):
    pass


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    mode: ForwardMode


class BatchBuilder:
    """Owns the pools' bookkeeping for building forward batches."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        kv_pool: MHATokenToKVPool,
        tree_cache: BasePrefixCache,
        attn_backend: AttentionBackend,
        page_size: int,
        device: torch.device,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.tree_cache = tree_cache
        self.attn_backend = attn_backend
        self.page_size = page_size
        self.device = device

    def _alloc_pages(self, num_pages: int) -> torch.Tensor:
        if num_pages == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        need = num_pages * self.page_size
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        pages = self.allocator.alloc_pages(num_pages)
        if pages is None:
            raise OutOfKVError(f"cannot allocate {num_pages} KV pages")
        return pages

    def _slots_for_range(self, req: Req, start: int, end: int) -> torch.Tensor:
        """Slots for positions [start, end) of req, continuing its partial last page."""
        ps = self.page_size
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        partial = min(end, -(-start // ps) * ps) - start if start % ps else 0
        parts = []
        if partial > 0:
            last = row[start - 1].to(torch.int64)
            parts.append(last + 1 + torch.arange(partial, device=self.device))
        rest = end - start - partial
        if rest > 0:
            pages = self._alloc_pages(-(-rest // ps))
            offs = torch.arange(ps, device=self.device)
            parts.append((pages[:, None] * ps + offs[None, :]).reshape(-1)[:rest])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def extend_pages_needed(self, reqs: list[Req]) -> int:
        ps, total = self.page_size, 0
        for req in reqs:
            kv = req.kv
            start = kv.kv_alloc if kv.req_pool_idx is not None else len(kv.prefix_indices)
            end = start + kv.extend_len
            first_new = -(-start // ps) * ps  # the partial page continues in place
            total += -(-(end - first_new) // ps) if end > first_new else 0
        return total

    def reserve(self, num_pages: int, reqs_: Sequence[Req] = ()) -> None:
        """Evicts until num_pages are free, or raises OutOfKVError before anything changes."""
        need = num_pages * self.page_size
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        if self.allocator.available_size() < need:
            raise OutOfKVError(
                f"need {num_pages} KV pages, "
                f"{self.allocator.available_size() // self.page_size} free"
            )
        if self.req_to_token_pool.available_size() < sum(r.kv.req_pool_idx is None for r in reqs_):
            raise OutOfKVError("no free request slot")

    def prepare_extend(self, reqs: list[Req]) -> ForwardBatch:
        """NOTE: checks the whole batch's KV first, so a failure leaves every pool unchanged."""
        self.reserve(self.extend_pages_needed(reqs), reqs)
        r2t = self.req_to_token_pool.req_to_token
        input_ids, positions, locs = [], [], []
        prefix_lens, extend_lens, seq_lens = [], [], []
        for req in reqs:
            kv = req.kv
            if kv.req_pool_idx is None:
                idx = self.req_to_token_pool.alloc(1)
                if idx is None:
                    raise OutOfKVError("no free request slot")
                kv.req_pool_idx = idx[0]
                n = len(kv.prefix_indices)
                if n:
                    r2t[kv.req_pool_idx, :n] = kv.prefix_indices.to(r2t.dtype)
                kv.kv_len = kv.kv_alloc = n
            start, end = kv.kv_alloc, kv.kv_alloc + kv.extend_len
            slots = self._slots_for_range(req, start, end)
            r2t[kv.req_pool_idx, start:end] = slots.to(r2t.dtype)
            input_ids.extend(kv.fill_ids[start:end])
            positions.append(torch.arange(start, end, device=self.device))
            locs.append(slots)
            prefix_lens.append(start)
            extend_lens.append(end - start)
            seq_lens.append(end)
            kv.kv_alloc = end  # kv.kv_len follows when the forward's results are handled
        dev = self.device
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions),
            out_cache_loc=torch.cat(locs),
            req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs], device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            extend_prefix_lens=torch.tensor(prefix_lens, device=dev),
            extend_seq_lens=torch.tensor(extend_lens, device=dev),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )

    def decode_pages_needed(self, reqs: list[Req]) -> int:
        return sum(1 for r in reqs if r.kv.kv_alloc % self.page_size == 0)

    def prepare_decode(self, reqs: list[Req]) -> ForwardBatch:
        dev, ps = self.device, self.page_size
        r2t = self.req_to_token_pool.req_to_token
        kv_lens = [r.kv.kv_alloc for r in reqs]
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], device=dev)
        kv = torch.tensor(kv_lens, device=dev)
        new_page = [k % ps == 0 for k in kv_lens]
        num_pages = sum(new_page)
        # Continue each partial page (previous slot + 1); the rest start a fresh page.
        prev = r2t[rows, (kv - 1).clamp(min=0)].to(torch.int64) + 1
        if num_pages:
            pages = self._alloc_pages(num_pages)
            mask = torch.tensor(new_page, device=dev)
            fresh = torch.zeros_like(prev)
            fresh[mask] = pages * ps
            locs = torch.where(mask, fresh, prev)
        else:
            locs = prev
        r2t[rows, kv] = locs.to(r2t.dtype)
        seq_lens = [k + 1 for k in kv_lens]
        # NOTE: a token still being sampled by a launched forward goes in as -slot (overlap)
        ids = [-r.kv.future_slot if r.kv.num_pending else r.output_ids[-1] for r in reqs]
        for r in reqs:
            r.kv.kv_alloc += 1
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=kv,
            out_cache_loc=locs,
            req_pool_indices=rows,
            seq_lens=torch.tensor(seq_lens, device=dev),
            extend_prefix_lens=None,
            extend_seq_lens=None,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=None,
            extend_seq_lens_cpu=None,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
