"""Layer-wise overlap of an L2 -> L1 load with the forward: attention of layer 0 starts before
the last layer's KV has landed, yet every layer i attends only after layer i's load finished, and
the output is exactly the first run's (and transformers') greedy tokens."""

from __future__ import annotations

import random
import threading
import time

from engine import Engine
from engine.runtime.layers.radix_attention import RadixAttention
from tests.tiny_models import hf_greedy, make_tiny_model_dir

NUM_LAYERS = 4
MAX_NEW = 4
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
LAYER_DELAY_S = 0.05


def test_forward_overlaps_layerwise_load(tmp_path, monkeypatch):
    model_dir = make_tiny_model_dir(str(tmp_path / "m"), "llama", num_hidden_layers=NUM_LAYERS)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 380) for _ in range(60)]
    with Engine(model_dir, enable_hierarchical_cache=True, max_total_tokens=256,
                debug_check_invariants=True) as eng:
        first = eng.generate(prompt, GREEDY)

        def push_to_l2(s):
            tree = s.tree_cache
            tree.controller.wait_idle()  # backups acked: the nodes can be demoted
            tree.check()
            tree.evict(tree.evictable_size())
            return tree.controller

        controller = eng.call_in_scheduler(push_to_l2)
        lock = threading.Lock()
        load_end: dict[int, float] = {}  # layer -> when its host->device copy finished
        attn_start: dict[int, float] = {}  # layer -> first attention start after arming
        orig_load = controller.host_pool.load_to_device_per_layer

        def slow_load(device_pool, host_indices, device_indices, layer_id, io_backend):
            time.sleep(LAYER_DELAY_S)
            orig_load(device_pool, host_indices, device_indices, layer_id, io_backend)
            with lock:
                load_end[layer_id] = time.perf_counter()

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
        monkeypatch.setattr(controller.host_pool, "load_to_device_per_layer", slow_load)
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
    assert stats["l2"]["hit_tokens"] > 0
    assert second.cached_tokens_per_tier.get("l2", 0) > 0
    assert stats["l1"]["held_by_requests_tokens"] == 0
