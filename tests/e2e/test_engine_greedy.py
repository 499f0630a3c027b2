"""The engine's greedy tokens equal transformers' generate for tiny Llama / Qwen2 / Qwen3,
single and batched, chunked prefill, page sizes 1 and 16, and on prefix-cache hits. Every
scheduler step checks the KV accounting invariant."""

from __future__ import annotations

import random

import pytest

from engine import Engine
from tests.tiny_models import hf_greedy, make_tiny_model_dir

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp(request.param) / "m"), request.param)


def _prompts(n: int, seed: int, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


@pytest.mark.parametrize("page_size,chunk", [(1, -1), (16, -1), (1, 16), (16, 32)])
def test_batched_greedy_matches_transformers(model_dir, page_size, chunk):
    prompts = _prompts(6, seed=page_size + chunk)
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    with Engine(
        model_dir,
        page_size=page_size,
        chunked_prefill_size=chunk,
        max_total_tokens=8192,
        debug_check_invariants=True,
    ) as eng:
        single = eng.generate(
            prompts[0], {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        )
        assert single.token_ids == ref[0]
        outs = eng.generate(
            prompts, {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        )
        assert [o.token_ids for o in outs] == ref
        assert all(o.finish_reason == "length" for o in outs)
        # Second pass: every prompt is now cached (up to page alignment), same tokens.
        again = eng.generate(
            prompts, {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        )
        assert [o.token_ids for o in again] == ref
        for p, o in zip(prompts, again):
            assert o.cached_tokens == (len(p) - 1) // page_size * page_size
        stats = eng.cache_stats()
        assert stats.l1.hit_tokens > 0
        assert stats.l1.held_by_requests_tokens == 0


def test_multiturn_prefix_hit(model_dir):
    base = _prompts(1, seed=7)[0]
    with Engine(model_dir, max_total_tokens=8192, debug_check_invariants=True) as eng:
        first = eng.generate(base, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        turn2 = base + first.token_ids + [5, 6, 7]
        second = eng.generate(turn2, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        # The first turn's prompt and all but its last output token are cached.
        assert second.cached_tokens >= len(base) + len(first.token_ids) - 1
        assert second.token_ids == hf_greedy(model_dir, [turn2], 8)[0]
