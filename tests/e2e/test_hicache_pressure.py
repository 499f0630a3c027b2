"""The hierarchy under pressure, end to end on the tiny model: an L3 that blocks never stops
serving, the scheduler sleeps while a request waits on its prefetch, the prefetch policies
differ, load-backs fit the admission budget (no requeue loop), and the L3 index repairs itself
after objects were deleted or damaged behind the daemon's back. Outputs always equal
transformers' greedy tokens."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from contextlib import contextmanager

import pytest

from engine import Engine
from engine.config import ServerArgs
from hicache.observe.stats import L3Stats
from hicache.storage.file.backend import FileStorageBackend
from tests.storage_fakes import GatedStorage
from tests.tiny_models import hf_greedy

MAX_NEW = 4
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
S = 16  # tokens per L3 object in these tests


def _prompts(n: int, seed: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for _ in range(n)]


def _opts(tmp_path, **kw) -> dict:
    opts = {
        "enable_hierarchical_cache": True,
        "max_total_tokens": 256,
        "page_size": 16,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "kv"),
        "hicache_storage_page_size": S,
        "hicache_prefetch_threshold": 0,
        "debug_check_invariants": True,
    }
    opts.update(kw)
    return opts


@pytest.fixture
def gated(monkeypatch, tmp_path):
    """Engines built inside the test get their file L3 behind a GatedStorage."""
    stores: list[GatedStorage] = []

    def build(args, scope, **_):
        store = GatedStorage(FileStorageBackend(args.hicache_storage_dir, 1 << 30))
        stores.append(store)
        return store

    monkeypatch.setattr("engine.runtime.hicache_setup.build_storage", build)
    yield stores
    for s in stores:
        s.release_all()


def _l3_stats(eng: Engine) -> L3Stats:
    l3 = eng.cache_stats().l3
    assert l3 is not None
    return l3


def test_blocked_storage_never_stops_eviction_decode_or_admission(tiny_llama_dir, tmp_path, gated):
    prompts = _prompts(10, seed=1, length=70)
    with Engine(tiny_llama_dir, **_opts(tmp_path, hicache_ratio=6.0)) as eng:
        store = gated[0]
        store.writes.close()
        store.reads.close()
        seq = [eng.generate(p, GREEDY) for p in prompts[:6]]  # 6 x 70 tokens > the 256 of L1
        handles = [eng.submit(p, GREEDY) for p in prompts[6:]]
        conc = [h.result() for h in handles]
        again = eng.generate(prompts[0], GREEDY)  # demoted: served from L2
        stats = eng.cache_stats()
        # the backup thread is blocked in the store, and the engine kept serving meanwhile
        assert stats.l3.pending_backups > 0 and store.writes.wait_blocked(1, 60)
        store.release_all()
    ref = hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    assert [r.token_ids for r in seq + conc] == ref
    assert again.token_ids == ref[0] and again.cached_tokens_per_tier["l2"] > 0
    assert stats.l1.demoted_tokens > 0
    assert stats.l1.held_by_requests_tokens == 0


def _write_to_l3(model_dir: str, tmp_path, prompt: list[int]) -> list[int]:
    with Engine(model_dir, **_opts(tmp_path)) as eng:
        return eng.generate(prompt, GREEDY).token_ids  # shutdown flushes the L3 backups


@contextmanager
def _waiting_on_l3(model_dir: str, tmp_path, gated: list[GatedStorage], prompt: list[int]):
    """A restarted engine (``wait_complete``) whose one request waits on an L3 read that the
    store holds back: yields (engine, store, handle)."""
    opts = _opts(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    with Engine(model_dir, **opts) as eng:
        store = gated[-1]
        store.reads.close()
        handle = eng.submit(prompt, GREEDY)
        assert store.reads.wait_blocked(1)
        yield eng, store, handle


def test_scheduler_sleeps_while_a_request_waits_on_its_prefetch(tiny_llama_dir, tmp_path, gated):
    prompt = _prompts(1, seed=2, length=200)[0]
    first = _write_to_l3(tiny_llama_dir, tmp_path, prompt)
    with _waiting_on_l3(tiny_llama_dir, tmp_path, gated, prompt) as (eng, store, handle):
        before = eng.scheduler.loop_iterations
        time.sleep(1.0)
        iterations = eng.scheduler.loop_iterations - before
        assert handle.chunks.empty()  # still waiting for L3
        store.reads.open()
        out = handle.result()
    assert iterations <= 10, f"the scheduler looped {iterations} times in 1 s while waiting"
    assert out.token_ids == first
    assert out.cached_tokens_per_tier["l3"] == (200 - 1) // S * S


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_differ(tiny_llama_dir, tmp_path, gated, policy):
    """12 objects in L3, read 4 per batch: the first batch may land at once, the rest hang
    until the test opens the store. best_effort admits with nothing, wait_complete with all,
    timeout with the first batch once its deadline passed."""
    prompt = _prompts(1, seed=3, length=200)[0]
    first = _write_to_l3(tiny_llama_dir, tmp_path, prompt)
    opts = _opts(
        tmp_path,
        hicache_storage_prefetch_policy=policy,
        hicache_prefetch_timeout_base=1.0,
        hicache_prefetch_timeout_per_ki_token=0.0,
    )
    with Engine(tiny_llama_dir, **opts) as eng:
        store = gated[-1]
        store.reads.close()
        if policy != "best_effort":
            store.reads.allow(1)
        handle = eng.submit(prompt, GREEDY)
        if policy == "wait_complete":
            assert store.reads.wait_blocked(1)
            time.sleep(1.5)  # past any timeout: wait_complete still waits
            assert handle.chunks.empty()
            store.reads.open()
        out = handle.result()
        store.reads.open()
        stats = eng.cache_stats()
    assert out.token_ids == first
    want = {"best_effort": 0, "wait_complete": 192, "timeout": 64}[policy]
    assert out.cached_tokens_per_tier["l3"] == want
    assert out.cached_tokens == want  # nothing else was cached
    assert stats.l3.prefetch_started == 1


def test_load_backs_are_in_the_admission_budget(tiny_llama_dir, tmp_path, caplog):
    """Follow-up turns whose prefixes sit in L2 arrive together: the scheduler admits what
    fits (load-back included) and never requeues a batch that did not fit."""
    convs = _prompts(6, seed=4, length=60)
    opts = _opts(tmp_path, hicache_storage_backend=None, hicache_ratio=4.0)
    with Engine(tiny_llama_dir, **opts) as eng:
        firsts = [eng.generate(p, GREEDY) for p in convs]
        turn2 = [p + f.token_ids + [7, 8, 9] for p, f in zip(convs, firsts)]
        with caplog.at_level(logging.WARNING, logger="engine.runtime.scheduler.scheduler"):
            handles = [eng.submit(p, GREEDY) for p in turn2]
            seconds = [h.result() for h in handles]
        stats = eng.cache_stats()
    assert not [r for r in caplog.records if "did not fit" in r.getMessage()]
    ref = hf_greedy(tiny_llama_dir, convs + turn2, MAX_NEW)
    assert [f.token_ids for f in firsts] == ref[:6]
    assert [s.token_ids for s in seconds] == ref[6:]
    assert stats.l1.promoted_tokens > 0
    assert sum(s.cached_tokens_per_tier["l2"] for s in seconds) > 0


def _object_files(eng: Engine, prompt: list[int]) -> list[str]:
    tree = eng.scheduler.tree_cache
    key = tuple(prompt[: (len(prompt) - 1) // 16 * 16])
    return [tree.l3.storage._path(k) for k in tree.l3.storage_keys(key)]


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_l3_index_repairs_itself(tiny_llama_dir, tmp_path, damage):
    prompt = _prompts(1, seed=5, length=200)[0]
    with Engine(tiny_llama_dir, **_opts(tmp_path)) as eng:
        first = eng.generate(prompt, GREEDY)
        files = _object_files(eng, prompt)
    assert len(files) == 12 and all(os.path.exists(f) for f in files)
    if damage == "delete":
        os.remove(files[3])
    else:
        with open(files[3], "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(b"\x00\xff" * 4)
    with Engine(tiny_llama_dir, **_opts(tmp_path)) as eng:
        time.sleep(1.1)  # the index re-checks the disk at most once a second
        l3 = _l3_stats(eng)
        on_disk = sum(os.path.exists(f) for f in files)
        if damage == "delete":
            # the lost object and everything chained after it left the index
            assert l3.used_tokens == on_disk * l3.object_tokens and on_disk == 3
        second = eng.generate(prompt, GREEDY)
    assert second.token_ids == first.token_ids
    assert second.cached_tokens_per_tier["l3"] == 48  # objects 0..2; the rest recomputed
    assert all(os.path.exists(f) for f in files)  # the recompute stored them again
    with Engine(tiny_llama_dir, **_opts(tmp_path)) as eng:
        third = eng.generate(prompt, GREEDY)
        assert _l3_stats(eng).used_tokens == 12 * S  # 12 objects
    assert third.token_ids == first.token_ids
    assert third.cached_tokens_per_tier["l3"] == 192


def test_default_object_size_and_threshold(tiny_llama_dir, tmp_path):
    """Defaults on the CPU: 16-token objects, the timeout policy, and a prefetch of any L3 hit
    beyond the L1 + L2 match; with SGLang's threshold (256, CUDA's default) a hit of fewer
    tokens is recomputed. On CUDA objects default to 64 tokens."""
    prompt = _prompts(1, seed=6, length=400)[0]
    opts = _opts(tmp_path, max_total_tokens=1024)
    for k in ("hicache_storage_page_size", "hicache_prefetch_threshold"):
        opts.pop(k)
    with Engine(tiny_llama_dir, **opts) as eng:
        first = eng.generate(prompt, GREEDY)
        short = eng.generate(prompt[:250], GREEDY)
    with Engine(tiny_llama_dir, **opts) as eng:
        assert eng.server_args.hicache_prefetch_threshold == 0
        short2 = eng.generate(prompt[:250], GREEDY)  # 15 objects (240 tokens) in L3
    with Engine(tiny_llama_dir, **opts, hicache_prefetch_threshold=256) as eng:
        short3 = eng.generate(prompt[:250], GREEDY)  # too few for this threshold
    with Engine(tiny_llama_dir, **opts) as eng:
        assert eng.server_args.hicache_storage_prefetch_policy == "timeout"
        again = eng.generate(prompt, GREEDY)
        l3 = _l3_stats(eng)
    assert short2.token_ids == short.token_ids and short2.cached_tokens_per_tier["l3"] == 240
    assert short3.token_ids == short.token_ids and short3.cached_tokens == 0
    assert again.token_ids == first.token_ids
    assert again.cached_tokens_per_tier["l3"] == 384  # (400 - 1) // 16 * 16
    assert l3.object_tokens == 16 and l3.used_tokens == 400  # the 25 objects of 400 tokens
    cuda = ServerArgs(model_path=tiny_llama_dir, device="cuda", page_size=1)
    assert cuda.hicache_storage_page_size == 64


def test_default_threshold_reads_l3_beyond_a_shared_header(tiny_llama_dir, tmp_path):
    """A conversation's next turn whose own history is in L3 and whose first tokens (a chat
    template's header, a system prompt) another conversation keeps in L1: with the default
    threshold on the CPU its L3 hit is read, not recomputed, however few tokens it adds beyond
    that header (here 224: under SGLang's threshold of 256)."""
    header, a_own, b_own = _prompts(3, seed=9, length=240)
    a, b = header[:32] + a_own, header[:32] + b_own[:100]  # 272 tokens: 4 objects in L3
    # (wait_complete: what is read does not depend on how fast the read thread runs)
    opts = _opts(tmp_path, max_total_tokens=1024, hicache_storage_prefetch_policy="wait_complete")
    for k in ("hicache_storage_page_size", "hicache_prefetch_threshold"):
        opts.pop(k)
    with Engine(tiny_llama_dir, **opts) as eng:
        first = eng.generate(a, GREEDY)  # shutdown stores its objects
    with Engine(tiny_llama_dir, **opts) as eng:
        eng.generate(b, GREEDY)  # the shared header is in L1 now
        again = eng.generate(a, GREEDY)
    assert again.token_ids == first.token_ids
    assert again.cached_tokens_per_tier == {"l1": 32, "l2": 0, "l3": 256 - 32}


def test_abort_while_prefetching_frees_everything(tiny_llama_dir, tmp_path, gated):
    prompt = _prompts(1, seed=7, length=200)[0]
    _write_to_l3(tiny_llama_dir, tmp_path, prompt)
    with _waiting_on_l3(tiny_llama_dir, tmp_path, gated, prompt) as (eng, store, handle):
        eng.abort(handle.rid)
        out = handle.result()
        store.reads.open()
        eng.call_in_scheduler(
            lambda s: (
                s.tree_cache.host.controller.wait_storage_idle(10),
                s.tree_cache.host.check(),
            )
        )
        stats = eng.cache_stats()
    assert out.finish_reason == "abort"
    assert stats.l3.prefetch_cancelled == 1 and stats.l3.pending_prefetches == 0
    assert stats.l2.used_tokens == stats.l2.cached_tokens  # no host slot leaked


def test_prefetch_of_a_later_request_gives_its_l2_room(tiny_llama_dir, tmp_path, gated):
    """L2 is full of the landed prefetch of B, which the cache order puts after A: at A's
    turn B's prefetch yields its room and A is served from L3 instead of recomputing what L3
    holds. B prefetches again at its own turn (here L2 has no room left: it recomputes)."""
    b_prompt, a_prompt = _prompts(2, seed=8, length=420)
    b_prompt = b_prompt[:300]  # L3: 288 tokens; A: 416 (lpm: A goes first)
    opts = _opts(
        tmp_path,
        max_total_tokens=448,
        hicache_ratio=1.2,  # L2: 528 tokens
        hicache_prefetch_threshold=256,
        schedule_policy="lpm",
        hicache_storage_prefetch_policy="wait_complete",
    )
    with Engine(tiny_llama_dir, **opts) as eng:
        eng.generate(b_prompt, GREEDY)
        eng.generate(a_prompt, GREEDY)  # shutdown flushes both to L3
    with Engine(tiny_llama_dir, **opts) as eng:
        gate = threading.Event()
        eng.scheduler.inbox.put_call(lambda s: gate.wait(30))  # B and A arrive in one inbox drain
        b = eng.submit(b_prompt, GREEDY)
        # B's prefetch lands (288 of L2's 528) before A arrives: A's 416 do not fit
        eng.scheduler.inbox.put_call(
            lambda s: (
                s.tree_cache.host.controller.wait_storage_idle(10),
                s.tree_cache.host.check(),
            )
        )
        a = eng.submit(a_prompt, GREEDY)
        gate.set()
        out_a, out_b = a.result(), b.result()
        stats = eng.cache_stats()
    ref = hf_greedy(tiny_llama_dir, [a_prompt, b_prompt], MAX_NEW)
    assert [out_a.token_ids, out_b.token_ids] == ref
    assert out_a.cached_tokens_per_tier["l3"] == 416
    assert stats.l3.prefetch_yielded == 1
    assert stats.l2.used_tokens == stats.l2.cached_tokens  # no host slot leaked
