"""Engine with the hierarchical cache: prefixes evicted from L1 are served from L2 (and after a
restart from L3) with exactly transformers' greedy tokens. Every scheduler step checks the KV
accounting invariant."""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine import Engine
from tests.tiny_models import hf_greedy

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def _prompts(n: int, seed: int, length: int = 60, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize(
    "page_size,layout,policy,chunk",
    [
        (1, "layer_first", "write_through", -1),
        (16, "page_first", "write_through_selective", -1),
        (16, "layer_first", "write_back", -1),
        (1, "page_first", "write_back", 16),  # chunked prefill over L2-served prefixes
        (16, "page_first", "write_through", 32),
    ],
)
def test_multiturn_served_from_l2(tiny_llama_dir, page_size, layout, policy, chunk):
    convs = _prompts(2, seed=page_size)
    fillers = _prompts(4, seed=99, length=70)
    with Engine(
        tiny_llama_dir,
        enable_hierarchical_cache=True,
        max_total_tokens=256,
        page_size=page_size,
        hicache_mem_layout=layout,
        hicache_write_policy=policy,
        chunked_prefill_size=chunk,
        debug_check_invariants=True,
    ) as eng:
        first = [eng.generate(p, GREEDY) for p in convs]
        again = [eng.generate(p, GREEDY) for p in convs]  # second hit: selective backs up
        assert [a.token_ids for a in again] == [f.token_ids for f in first]
        for p in fillers:  # push the conversations out of the 256-token L1
            eng.generate(p, GREEDY)
        turn2 = [p + f.token_ids + [5, 6, 7] for p, f in zip(convs, first)]
        second = [eng.generate(p, GREEDY) for p in turn2]
        stats = eng.cache_stats()
    ref = hf_greedy(tiny_llama_dir, convs + turn2, MAX_NEW)
    assert [f.token_ids for f in first] == ref[:2]
    assert [s.token_ids for s in second] == ref[2:]
    assert stats.l2.hit_tokens > 0
    assert stats.l1.demoted_tokens > 0 and stats.l1.promoted_tokens > 0
    assert any(s.cached_tokens_per_tier.get("l2", 0) > 0 for s in second)
    assert stats.l1.held_by_requests_tokens == 0


def test_restart_hits_l3(tiny_llama_dir, tmp_path):
    prompt = _prompts(1, seed=5, length=50)[0]
    opts = {
        "enable_hierarchical_cache": True,
        "max_total_tokens": 256,
        "page_size": 16,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "kv"),
        "hicache_storage_page_size": 16,
        "hicache_prefetch_threshold": 0,
        "debug_check_invariants": True,
    }
    with Engine(tiny_llama_dir, **opts) as eng:
        first = eng.generate(prompt, GREEDY)
    with Engine(tiny_llama_dir, **opts) as eng:  # a fresh process-level cache, same L3 dir
        second = eng.generate(prompt, GREEDY)
        stats = eng.cache_stats()
    assert first.token_ids == second.token_ids == hf_greedy(tiny_llama_dir, [prompt], MAX_NEW)[0]
    assert stats.l3.hit_tokens > 0
    assert second.cached_tokens_per_tier.get("l3", 0) == 48  # (50 - 1) // 16 * 16
    assert stats.l3.errors == 0


@pytest.mark.parametrize(
    "layout,quantization", [("layer_first", "none"), ("page_first", "none"), ("page_first", "int4")]
)
def test_prefill_logits_bit_identical_from_l2(tiny_llama_dir, layout, quantization):
    """The second turn's prefill logits are bit-identical whether its prefix is served from a
    huge L1 or loaded back from L2 after eviction (dense or int4 weights: the KV cache does not
    care how the weights are stored)."""
    conv = _prompts(1, seed=11)[0]
    fillers = _prompts(4, seed=98, length=70)
    big_logits, big, _ = _second_turn_logits(
        tiny_llama_dir,
        conv,
        fillers,
        page_size=16,
        max_total_tokens=8192,
        quantization=quantization,
    )
    l2_logits, l2, _ = _second_turn_logits(
        tiny_llama_dir,
        conv,
        fillers,
        page_size=16,
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_mem_layout=layout,
        quantization=quantization,
    )
    assert big.cached_tokens == l2.cached_tokens > 0
    assert l2.cached_tokens_per_tier.get("l2", 0) > 0 and big.cached_tokens_per_tier["l1"] > 0
    assert torch.equal(big_logits, l2_logits)


def _wait_in_l3(eng: Engine, ids: list[int], timeout: float = 60.0) -> None:
    """Until L3 holds ``ids``' prefix that has KV (all but the last token), whole objects."""
    S = eng.server_args.hicache_storage_page_size
    want = (len(ids) - 1) // S * S
    deadline = time.monotonic() + timeout
    while (got := eng.call_in_scheduler(lambda s: s.tree_cache.l3.storage_prefix_len(ids))) < want:
        assert time.monotonic() < deadline, f"L3 holds {got} of {want} tokens"
        time.sleep(0.02)


def _wait_backups_landed(eng: Engine, timeout: float = 60.0) -> None:
    """Until no L3 backup is queued, running or waiting for room."""

    def busy(s) -> bool:
        s.tree_cache.host.check()
        return s.tree_cache.l3.storage_busy() or bool(s.tree_cache.l3.backup.deferred_backups)

    deadline = time.monotonic() + timeout
    while eng.call_in_scheduler(busy):
        assert time.monotonic() < deadline, "L3 backups still pending"
        time.sleep(0.02)


def _second_turn_logits(
    model_dir: str, conv: list[int], fillers: list[list[int]], restart: bool = False, **opts
):
    """Prefill logits of ``conv``'s second turn (the first extend forward of that request).
    ``restart``: the first turn and fillers run in one engine, the second turn in a fresh one
    with the same options (only what reached L3 survives)."""

    def capture(eng: Engine) -> list[torch.Tensor]:
        captured: list[torch.Tensor] = []
        real = eng.runner.forward

        def forward(fb):
            out = real(fb)
            if fb.forward_mode.is_extend():
                captured.append(out.clone())
            return out

        eng.runner.forward = forward
        return captured

    with Engine(model_dir, debug_check_invariants=True, **opts) as eng:
        first = eng.generate(conv, GREEDY)
        if opts.get("hicache_storage_backend"):
            # NOTE: the fillers push the conversation out of L2; its L3 backup must have landed
            # first (a backup still waiting when its node leaves L2 is dropped, by design), which
            # on a loaded machine it may not have by itself
            _wait_in_l3(eng, conv + first.token_ids)
        for p in fillers:
            eng.generate(p, GREEDY)
        if opts.get("hicache_storage_backend"):
            # NOTE: the prefetch of turn 2 needs L2 room that the fillers' own backups may still
            # hold (an evicted page is freed once its backup ran); with less room it reads only
            # the leading objects, and this test is about the bits of what it reads
            _wait_backups_landed(eng)
        turn2 = conv + first.token_ids + [5, 6, 7]
        if not restart:
            captured = capture(eng)
            second = eng.generate(turn2, dict(GREEDY, max_new_tokens=1))
            return captured[0], second, eng.cache_stats()
    with Engine(model_dir, debug_check_invariants=True, **opts) as eng:
        captured = capture(eng)
        second = eng.generate(turn2, dict(GREEDY, max_new_tokens=1))
        return captured[0], second, eng.cache_stats()


@pytest.mark.parametrize(
    "layout,page_size,restart,quantization",
    [
        *(
            (lay, ps, rs, "none")
            for lay in ("layer_first", "page_first")
            for ps in (1, 16, 64)
            for rs in (True, False)
        ),
        ("layer_first", 16, True, "int4"),
        ("page_first", 1, True, "int4"),
    ],
)
def test_prefill_logits_bit_identical_from_l3(
    tiny_llama_dir, tmp_path, layout, page_size, restart, quantization
):
    """The second turn's prefill logits are bit-identical whether its prefix is served from a
    huge L1 or read back from L3 files: after a restart on the same storage dir, or live, with
    L1 and L2 both too small to keep it; dense or int4 weights."""
    conv = _prompts(1, seed=11)[0]
    # NOTE: 8 fillers push the conversation out of L1 (256 tokens) and L2 (512, the default
    # hicache_ratio 2; L2 mirrors L1 under write_through), so the live run reads it from L3
    fillers = _prompts(8, seed=98, length=70)
    big_logits, big, _ = _second_turn_logits(
        tiny_llama_dir,
        conv,
        fillers,
        max_total_tokens=8192,
        page_size=page_size,
        quantization=quantization,
    )
    l3_logits, l3, stats = _second_turn_logits(
        tiny_llama_dir,
        conv,
        fillers,
        restart=restart,
        page_size=page_size,
        quantization=quantization,
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_mem_layout=layout,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "kv"),
        hicache_storage_prefetch_policy="wait_complete",
        # objects of one page: L3 then holds exactly what a huge L1 caches (page-aligned)
        hicache_storage_page_size=page_size,
        hicache_prefetch_threshold=0,
    )
    assert stats.l3.hit_tokens > 0 and stats.l3.errors == 0
    assert big.cached_tokens == l3.cached_tokens > 0
    assert l3.cached_tokens_per_tier.get("l3", 0) == l3.cached_tokens  # none left in L1 or L2
    assert big.cached_tokens_per_tier["l1"] == big.cached_tokens
    assert torch.equal(big_logits, l3_logits)
