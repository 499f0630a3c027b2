"""The embedded SmolLM2-135M-Instruct: the engine's greedy tokens equal transformers' generate
on the same converted weights, single and batched, page sizes 1 and 16, chunked prefill, and on a
prefix-cache hit: on the dense path and on the int4 path (the GGUF's Q4_1 weights, which
requantize to exactly the converted ones, run by the C kernels: decode products differ from
the dense ones only by float reassociation)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.runtime.models.loader import resolve_model_dir

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three colors.",
             "Why is the sky blue? Answer briefly.", "Write a haiku about caches."]
NEW = 24


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(resolve_model_dir(None))  # converts the GGUF once, then cached
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for q in QUESTIONS]
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0]  # [seq, vocab]
    return prompts, outs, logits


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("page_size,chunk", [(1, -1), (16, 32)])
def test_smollm2_greedy_matches_transformers(reference, page_size, chunk, quantization):
    prompts, ref, _ = reference
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with Engine(page_size=page_size, chunked_prefill_size=chunk, max_total_tokens=8192,
                quantization=quantization, debug_check_invariants=True) as eng:
        assert eng.model_info()["quantization"] == quantization
        assert eng.generate(prompts[0], sp).token_ids == ref[0]
        outs = eng.generate(prompts, sp)
        assert [o.token_ids for o in outs] == ref
        again = eng.generate(prompts, sp)  # every prompt is now a prefix-cache hit
        assert [o.token_ids for o in again] == ref
        assert all(o.cached_tokens > 0 for o in again)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_smollm2_prefill_logits_close(reference, quantization):
    """Prefill logits agree with transformers' forward within 1e-3 (fp32), dense or int4 (a
    prefill dequantizes each layer's weight to exactly the converted floats)."""
    from engine.runtime.forward_batch import ForwardBatch, ForwardMode

    prompts, _, ref_logits = reference
    ids = prompts[0]
    with Engine(max_total_tokens=4096, quantization=quantization) as eng:
        def run(s):
            r = s.runner
            row = r.req_to_token_pool.alloc(1)[0]
            slots = r.allocator.alloc(len(ids))
            r.req_to_token_pool.req_to_token[row, :len(ids)] = slots.to(torch.int32)
            n = len(ids)
            fb = ForwardBatch(
                forward_mode=ForwardMode.EXTEND, batch_size=1,
                input_ids=torch.tensor(ids), positions=torch.arange(n), out_cache_loc=slots,
                req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([n]),
                extend_prefix_lens=torch.tensor([0]), extend_seq_lens=torch.tensor([n]),
                seq_lens_cpu=[n], extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n],
                req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.kv_pool,
                attn_backend=r.attn_backend, return_all_logits=True)
            out = r.forward(fb)
            r.allocator.free(slots)
            r.req_to_token_pool.free(row)
            return out
        logits = eng.call_in_scheduler(run)
    assert torch.allclose(logits, ref_logits, atol=1e-3, rtol=0)
