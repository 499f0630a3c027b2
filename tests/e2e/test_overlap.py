"""Overlap scheduling: the forward runs on its own thread while the scheduler builds the next
batch with placeholders for tokens still being sampled. Outputs equal transformers' and the
sequential loop's; requests that finish while a later step already runs them (a stop token,
an abort) lose nothing and leak no KV; a failing forward frees everything."""

from __future__ import annotations

import random
import threading

import pytest

from engine import Engine
from engine.runtime.scheduler import invariants
from tests.tiny_models import hf_greedy, make_tiny_model_dir

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("llama") / "m"), "llama")


def _prompts(n: int, seed: int, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def _settled(eng: Engine) -> None:
    """Every KV page is free or in the tree, nothing is launched or waits for a release."""

    def check(s):
        invariants.check(s)
        held = invariants.scheduler_held_slots(s)
        return s.is_idle(), len(held), len(s.deferred), len(s.launched)

    assert eng.call_in_scheduler(check) == (True, 0, 0, 0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_outputs_equal_transformers_and_the_sequential_loop(llama_dir, page_size):
    prompts = _prompts(8, seed=page_size)
    ref = hf_greedy(llama_dir, prompts, 10)
    # max_new_tokens 1 and 2 end on the first tokens; stop tokens end requests mid-stream,
    # at a step the next batch was already built with them (their extra token is dropped)
    params = []
    for i, want in enumerate(ref):
        p = dict(GREEDY, max_new_tokens=10)
        if i in (0, 1):
            p["max_new_tokens"] = i + 1
        elif i % 2 == 0:
            p["stop_token_ids"] = [want[3]]
        params.append(p)
    expected = []
    for p, want in zip(params, ref):
        stop = p.get("stop_token_ids")
        n = want.index(stop[0]) + 1 if stop else p["max_new_tokens"]
        expected.append(want[:n])
    outs = {}
    for overlap in (True, False):
        with Engine(
            llama_dir,
            page_size=page_size,
            max_total_tokens=4096,
            disable_overlap=not overlap,
            debug_check_invariants=True,
        ) as eng:
            assert (eng.scheduler.worker is not None) == overlap
            outs[overlap] = [o.token_ids for o in eng.generate(prompts, params)]
            again = eng.generate(prompts, params)  # every prompt cached now
            assert [o.token_ids for o in again] == outs[overlap]
            _settled(eng)
    assert outs[True] == expected
    assert outs[False] == expected


def test_decode_is_built_before_the_previous_token_is_known(llama_dir):
    """With overlap the forward runs on the worker thread and a decode batch is built while
    the previous one runs (placeholders for its tokens); without, on the scheduler thread."""
    seen: list[tuple[str, bool]] = []
    with Engine(llama_dir, max_total_tokens=4096, disable_overlap=False) as eng:
        worker = eng.scheduler.worker
        real = worker.run

        def run(fb, reqs, slot):
            placeholders = bool((fb.input_ids < 0).any()) if fb.forward_mode.is_decode() else False
            seen.append((threading.current_thread().name, placeholders))
            return real(fb, reqs, slot)

        worker.run = run
        out = eng.generate(_prompts(3, seed=5), dict(GREEDY, max_new_tokens=6))
        assert all(len(o.token_ids) == 6 for o in out)
    assert {name for name, _ in seen} == {"hicache-forward"}
    assert any(p for _, p in seen)

    names: list[str] = []
    with Engine(llama_dir, max_total_tokens=4096, disable_overlap=True) as eng:
        real_forward = eng.runner.forward

        def forward(fb):
            names.append(threading.current_thread().name)
            return real_forward(fb)

        eng.runner.forward = forward
        eng.generate([5, 6, 7], dict(GREEDY, max_new_tokens=4))
    assert set(names) == {"hicache-scheduler"}


def test_abort_while_a_later_step_runs_the_request(llama_dir):
    """An abort arriving mid-stream ends the stream; the request's KV (still being written by
    a launched step) reaches the tree or the free list once that step is handled."""
    with Engine(
        llama_dir, max_total_tokens=4096, disable_overlap=False, debug_check_invariants=True
    ) as eng:
        handle = eng.submit([9, 8, 7, 6, 5], dict(GREEDY, max_new_tokens=400))
        got = 0
        for chunk in handle:
            got += len(chunk.token_ids)
            if got >= 3 and not chunk.finished:
                eng.abort(handle.rid)
            if chunk.finished:
                assert chunk.finish_reason == "abort"
        assert 3 <= got < 400
        _settled(eng)
        # the engine goes on, and the aborted prefix is served from the cache
        ref = hf_greedy(llama_dir, [[9, 8, 7, 6, 5]], 5)[0]
        assert eng.generate([9, 8, 7, 6, 5], dict(GREEDY, max_new_tokens=5)).token_ids == ref


def test_a_failing_forward_on_the_worker_frees_everything(llama_dir):
    with Engine(
        llama_dir, max_total_tokens=4096, disable_overlap=False, debug_check_invariants=True
    ) as eng:
        real = eng.runner.forward
        calls = {"n": 0}

        def forward(fb):
            calls["n"] += 1
            if calls["n"] == 4:  # a decode step of the batch below
                raise RuntimeError("forward exploded")
            return real(fb)

        eng.runner.forward = forward
        outs = eng.generate(_prompts(3, seed=9), dict(GREEDY, max_new_tokens=8))
        assert all(o.finish_reason == "abort" and "internal error" in o.error for o in outs)
        _settled(eng)
        eng.runner.forward = real
        prompt = _prompts(1, seed=10)[0]
        ref = hf_greedy(llama_dir, [prompt], 6)[0]
        assert eng.generate(prompt, dict(GREEDY, max_new_tokens=6)).token_ids == ref


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_with_the_hierarchy_under_pressure(llama_dir, tmp_path, page_size):
    """Overlap with L2 load-backs, L3 prefetches and retractions in a 256-token L1: batches of
    conversations whose prefixes were pushed out still get transformers' greedy tokens, and
    every KV page is accounted for after every step."""
    convs = _prompts(4, seed=40 + page_size)
    fillers = _prompts(6, seed=60 + page_size)
    params = dict(GREEDY, max_new_tokens=8)
    opts = {
        "enable_hierarchical_cache": True,
        "max_total_tokens": 256,
        "page_size": page_size,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "kv"),
        "hicache_storage_page_size": 16,
        "hicache_prefetch_threshold": 0,
        "disable_overlap": False,
        "debug_check_invariants": True,
    }
    with Engine(llama_dir, **opts) as eng:
        assert eng.scheduler.worker is not None
        first = [o.token_ids for o in eng.generate(convs, params)]
        eng.generate(fillers, params)  # the conversations leave L1
        turn2 = [p + f + [5, 6, 7] for p, f in zip(convs, first)]
        second = [o.token_ids for o in eng.generate(turn2, params)]
        stats = eng.cache_stats()
        _settled(eng)
    with Engine(llama_dir, **opts) as eng:  # L3 after a restart
        third = [o.token_ids for o in eng.generate(turn2, params)]
        l3 = eng.cache_stats().l3.hit_tokens
        _settled(eng)
    ref = hf_greedy(llama_dir, convs + turn2, 8)
    assert first == ref[:4]
    assert second == third == ref[4:]
    assert stats.l2.hit_tokens + stats.l3.hit_tokens > 0
    assert l3 > 0


def test_overlap_is_off_on_the_cpu_by_default():
    from engine.config import ServerArgs

    assert not ServerArgs(model_path="m").overlap_enabled()
    assert ServerArgs(model_path="m", device="cuda").overlap_enabled()
    assert ServerArgs(model_path="m", disable_overlap=False).overlap_enabled()
    assert not ServerArgs(model_path="m", device="cuda", disable_overlap=True).overlap_enabled()
