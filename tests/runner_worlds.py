"""Forwards of a ModelRunner scheduled by hand, recording each token's logits: the same tokens
prefilled alone, in batches, after a cached prefix, in chunks, or decoded, so a test can ask
whether a token's logits depend on any of that (deterministic inference).

A world starts from empty pools (``clear``), so worlds on one runner never share KV; within a
world a request's tokens [0, n) go through whatever forwards the test asks for, each built as
the scheduler builds it (slots from the runner's allocator, req_to_token written first).
"""

from __future__ import annotations

import torch

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.model_runner import ModelRunner


class RunnerWorld:
    """``tokens``: each request's whole token list (prompt, then the inputs of its decode
    steps); ``logits[rid, pos]`` [vocab] (on the host) once position ``pos`` was computed."""

    def __init__(self, runner: ModelRunner, tokens: dict[str, list[int]]) -> None:
        self.runner = runner
        self.tokens = tokens
        runner.req_to_token_pool.clear()
        runner.allocator.clear()
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}
        self.logits: dict[tuple[str, int], torch.Tensor] = {}

    def _grow(self, rid: str, n: int) -> torch.Tensor:
        r = self.runner
        if rid not in self.rows:
            self.rows[rid] = r.req_to_token_pool.alloc(1)[0]
            self.lens[rid] = 0
        p = self.lens[rid]
        locs = r.allocator.alloc(n)
        assert locs is not None, "the runner's pool is too small for this world"
        r.req_to_token_pool.write((self.rows[rid], slice(p, p + n)), locs)
        self.lens[rid] = p + n
        return locs

    def _forward(self, mode: ForwardMode, batch: list[tuple[str, int]]) -> None:
        r = self.runner
        prefix = [self.lens.get(rid, 0) for rid, _ in batch]
        keys = [(rid, pos) for (rid, n), p in zip(batch, prefix) for pos in range(p, p + n)]
        locs = torch.cat([self._grow(rid, n) for rid, n in batch])
        seq = [self.lens[rid] for rid, _ in batch]
        ext = [n for _, n in batch]
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=r.device)
        is_extend = mode == ForwardMode.EXTEND
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(batch),
            input_ids=i64([self.tokens[rid][pos] for rid, pos in keys]),
            positions=i64([pos for _, pos in keys]),
            out_cache_loc=locs.to(r.device),
            req_pool_indices=i64([self.rows[rid] for rid, _ in batch]),
            seq_lens=i64(seq),
            extend_prefix_lens=i64(prefix) if is_extend else None,
            extend_seq_lens=i64(ext) if is_extend else None,
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix if is_extend else None,
            extend_seq_lens_cpu=ext if is_extend else None,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
            return_all_logits=is_extend,
        )
        logits = r.forward(fb).float().cpu()  # [num_tokens, vocab]: one row per key
        assert logits.shape[0] == len(keys)
        for key, row in zip(keys, logits):
            self.logits[key] = row

    def extend(self, batch: list[tuple[str, int]]) -> None:
        """One EXTEND: request rid gets its next n tokens."""
        self._forward(ForwardMode.EXTEND, batch)

    def decode(self, rids: list[str], steps: int = 1) -> None:
        """``steps`` DECODE steps of ``rids`` together (their next token each), the batch's
        order rotating every step."""
        for turn in range(steps):
            k = turn % len(rids)
            self._forward(ForwardMode.DECODE, [(rid, 1) for rid in rids[k:] + rids[:k]])


def assert_same_logits(ref: RunnerWorld, others: list[RunnerWorld]) -> int:
    """Every token computed in ``others`` has bit-identical logits in ``ref``; returns how many
    tokens were compared."""
    compared = 0
    for world in others:
        assert set(world.logits) <= set(ref.logits)
        for key, got in world.logits.items():
            assert torch.equal(got, ref.logits[key]), key
            compared += 1
    return compared
