"""An L2 -> L1 load and the forward that needs it.

Layer-wise overlap (the CUDA path; on a CPU with ``reads_host_kv`` off): attention of layer 0
starts before the last layer's KV has landed, yet every layer i attends only after layer i's load
finished. Host reads (the CPU default): the prefill reads the loading KV from host memory and the
copy runs after it. Either way the output is exactly the first run's (and transformers') greedy
tokens, and the decode steps after it read the landed device copy."""

from __future__ import annotations

import random
import threading
import time

import torch

from engine import Engine
from engine.runtime.layers.radix_attention import RadixAttention
from tests.tiny_models import hf_greedy, make_tiny_model_dir

NUM_LAYERS = 4
MAX_NEW = 4
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
LAYER_DELAY_S = 0.05


def _push_to_l2(s, reads_host_kv: bool):
    s.cache_manager.reads_host_kv = reads_host_kv
    tree = s.tree_cache
    tree.host.controller.wait_idle()  # backups acked: the nodes can be demoted
    tree.host.check()
    tree.evict(tree.evictable_size())
    # NaN into every free device slot: a read of a slot before its load landed shows
    alloc, pool = s.runner.allocator, s.runner.kv_pool
    pages = torch.cat((alloc.free_pages, alloc.released))
    slots = (pages[:, None] * alloc.page_size + torch.arange(alloc.page_size)).flatten()
    for buf in pool.k_buffer + pool.v_buffer:
        buf[slots] = float("nan")
    return tree.host.controller


def _slow_loads(controller, monkeypatch, lock):
    """Delay each layer's host->device copy; returns {layer: start}, {layer: end} of copies."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    orig_load = controller.host_pool.load_to_device_per_layer

    def slow_load(device_pool, host_indices, device_indices, layer_id, io_backend):
        with lock:
            start[layer_id] = time.perf_counter()
        time.sleep(LAYER_DELAY_S)
        orig_load(device_pool, host_indices, device_indices, layer_id, io_backend)
        with lock:
            end[layer_id] = time.perf_counter()

    monkeypatch.setattr(controller.host_pool, "load_to_device_per_layer", slow_load)
    return start, end


def _engine(tmp_path, seed: int) -> tuple[str, list[int], Engine]:
    """A tiny model, a 60-token prompt and an engine with L2 and a small device pool."""
    model_dir = make_tiny_model_dir(str(tmp_path / "m"), "llama", num_hidden_layers=NUM_LAYERS)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 380) for _ in range(60)]
    eng = Engine(
        model_dir, enable_hierarchical_cache=True, max_total_tokens=256, debug_check_invariants=True
    )
    return model_dir, prompt, eng


def test_forward_overlaps_layerwise_load(tmp_path, monkeypatch):
    model_dir, prompt, eng = _engine(tmp_path, seed=7)
    with eng:
        first = eng.generate(prompt, GREEDY)
        controller = eng.call_in_scheduler(lambda s: _push_to_l2(s, reads_host_kv=False))
        lock = threading.Lock()
        attn_start: dict[int, float] = {}  # layer -> first attention start after arming

        backend = eng.call_in_scheduler(lambda s: s.runner.attn_backend)
        orig_forward, orig_backend_forward = RadixAttention.forward, backend.forward

        def traced_forward(self, q, k, v, fb):  # layer entry: before any wait_layer
            if load_end or fb.wait_layer is not None:
                with lock:
                    attn_start.setdefault(self.layer_id, time.perf_counter())
            return orig_forward(self, q, k, v, fb)

        def traced_backend(q, k, v, layer, fb):  # the first touch of the layer's KV pool
            if load_end or fb.wait_layer is not None:
                with lock:
                    kv_start.setdefault(layer.layer_id, time.perf_counter())
            return orig_backend_forward(q, k, v, layer, fb)

        kv_start: dict[int, float] = {}  # layer -> when the backend first read/wrote the pool
        _, load_end = _slow_loads(controller, monkeypatch, lock)  # layer -> its copy's end
        monkeypatch.setattr(RadixAttention, "forward", traced_forward)
        monkeypatch.setattr(backend, "forward", traced_backend)
        second = eng.generate(prompt, GREEDY)
        stats = eng.cache_stats()

    assert sorted(load_end) == list(range(NUM_LAYERS))
    assert sorted(attn_start) == list(range(NUM_LAYERS))
    # Real overlap: layer 0's attention began before the last layer's load finished ...
    assert attn_start[0] < load_end[NUM_LAYERS - 1]
    # ... layer 0's attention kernel itself ran while later layers were still loading ...
    assert kv_start[0] < load_end[NUM_LAYERS - 1]
    # ... and never ahead of its own layer's KV (the invariant wait_layer enforces).
    for layer in range(NUM_LAYERS):
        assert kv_start[layer] >= load_end[layer], layer
    assert second.token_ids == first.token_ids
    assert first.token_ids == hf_greedy(model_dir, [prompt], MAX_NEW)[0]
    assert stats.l2.hit_tokens > 0
    assert second.cached_tokens_per_tier.get("l2", 0) > 0
    assert stats.l1.held_by_requests_tokens == 0


def test_cpu_prefill_reads_loading_kv_from_host(tmp_path, monkeypatch):
    model_dir, prompt, eng = _engine(tmp_path, seed=8)
    with eng:
        assert eng.call_in_scheduler(lambda s: s.cache_manager.reads_host_kv)  # the CPU default
        first = eng.generate(prompt, GREEDY)
        controller = eng.call_in_scheduler(lambda s: _push_to_l2(s, reads_host_kv=True))
        lock = threading.Lock()
        prefill_reads: dict[int, float] = {}  # layer -> when the prefill's attention ran

        backend = eng.call_in_scheduler(lambda s: s.runner.attn_backend)
        orig_backend_forward = backend.forward

        def traced_backend(q, k, v, layer, fb):
            if fb.host_reads is not None:
                assert fb.wait_layer is None
                with lock:
                    prefill_reads.setdefault(layer.layer_id, time.perf_counter())
            return orig_backend_forward(q, k, v, layer, fb)

        load_start, load_end = _slow_loads(controller, monkeypatch, lock)
        monkeypatch.setattr(backend, "forward", traced_backend)
        second = eng.generate(prompt, GREEDY)  # L2 hit: read from host, then decode from L1
        monkeypatch.undo()
        third = eng.generate(prompt, GREEDY)  # L1 hit: the bytes the held copy landed
        stats = eng.cache_stats()

    assert sorted(prefill_reads) == list(range(NUM_LAYERS))
    assert sorted(load_end) == list(range(NUM_LAYERS))
    # the held copy began only after the prefill read every layer from host
    assert min(load_start.values()) > max(prefill_reads.values())
    assert second.cached_tokens_per_tier.get("l2", 0) > 0
    assert third.cached_tokens_per_tier.get("l1", 0) > 0
    assert first.token_ids == hf_greedy(model_dir, [prompt], MAX_NEW)[0]
    assert second.token_ids == first.token_ids
    assert third.token_ids == first.token_ids
    assert stats.l1.held_by_requests_tokens == 0


def test_failed_load_back_leaves_the_prefix_in_l2(tmp_path, monkeypatch):
    """A load-back whose copy could not be started fails its request and leaves the tree as it
    was: the prefix is still an L2 hit (not an L1 hit on slots nothing wrote), its device slots
    and host protections are back, and the next request is served the right KV."""
    model_dir, prompt, eng = _engine(tmp_path, seed=9)
    with eng:
        first = eng.generate(prompt, GREEDY)
        controller = eng.call_in_scheduler(lambda s: _push_to_l2(s, reads_host_kv=True))
        free_before = eng.call_in_scheduler(lambda s: s.runner.allocator.available_size())
        calls = []

        def broken_start_loading(hold: bool = False):
            calls.append(hold)
            raise RuntimeError("copy stream lost")

        monkeypatch.setattr(controller, "start_loading", broken_start_loading)
        failed = eng.generate(prompt, GREEDY)
        monkeypatch.undo()
        after = eng.call_in_scheduler(
            lambda s: (
                s.runner.allocator.available_size(),
                s.tree_cache.host.pool.protected_size(),
                s.tree_cache.match_prefix(prompt, touch=False).tier_tokens,
            )
        )
        second = eng.generate(prompt, GREEDY)
        stats = eng.cache_stats()

    assert calls and failed.finish_reason == "abort" and failed.error
    free_after, host_protected, tiers = after
    assert free_after == free_before and host_protected == 0
    assert tiers["l1"] == 0 and tiers["l2"] > 0
    assert second.cached_tokens_per_tier.get("l2", 0) > 0
    assert second.token_ids == first.token_ids == hf_greedy(model_dir, [prompt], MAX_NEW)[0]
    assert stats.l1.held_by_requests_tokens == 0
