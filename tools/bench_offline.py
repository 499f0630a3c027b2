"""Offline throughput on the embedded default model (SmolLM2-135M-Instruct, fp32, CPU).

(a) identical work: 16 short prompts x 64 new tokens, batched -- engine vs transformers
    `generate` vs the fp32 matmul floor of the model's decode step;
(b) 16 requests sharing a ~1,000-token system prompt, sent together -- engine (prefix cache +
    in-batch prefix dedup) vs transformers' batched generate.

Usage: python tools/bench_offline.py [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import Engine
from engine.models.loader import resolve_model_dir

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How do bees make honey?",
    "Why is the sky blue?", "What is 12 times 12?", "Describe a cat in one sentence.",
    "What is photosynthesis?", "Who wrote Hamlet?", "What is a prime number?",
    "How far is the Moon?", "What does a CPU do?", "Name a famous painting.",
    "What is gravity?", "How many legs does a spider have?", "What is rain?",
    "Why do we sleep?",
]


def hf_model_and_tok():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(resolve_model_dir(None))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return model, tok


def hf_generate(model, tok, prompts: list[list[int]], max_new: int) -> float:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t0


def matmul_floor(cfg, batch: int, steps: int, packed: bool = False) -> float:
    """A bare fp32 matmul chain with the model's decode shapes: time per step.

    ``packed=False`` is the issue's floor (``F.linear`` on ``[out, in]`` weights, as models call
    it); ``packed=True`` is the same chain on oneDNN-prepacked weights, the kernels the engine
    uses on CPU (``--linear-backend onednn``), i.e. the floor for the engine's own matmuls."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    qkv = h + 2 * cfg.num_key_value_heads * hd
    # weights stored [out, in] as in a checkpoint; F.linear is the matmul models call
    ws = [(torch.randn(qkv, h), torch.randn(h, h), torch.randn(2 * inter, h),
           torch.randn(h, inter)) for _ in range(layers)]
    head = torch.randn(cfg.vocab_size, h)
    lin = torch.nn.functional.linear
    if packed:
        ws = [tuple(torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer)
              for layer in ws]
        head = torch.ops.mkldnn._reorder_linear_weight(head, 16)

        def lin(x, w):  # same call shape as F.linear
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    x = torch.randn(batch, h)
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(steps):
                for wqkv, wo, wgu, wd in ws:
                    _ = lin(x, wqkv)
                    y = lin(x, wo)
                    g = lin(y, wgu)
                    x = lin(g[:, :inter], wd) * 1e-3 + x
                _ = lin(x, head)
            best = min(best, (time.perf_counter() - t0) / steps)
    return best


def _flush(s) -> None:
    """Empties the prefix cache (the scheduler is idle between runs)."""
    s.tree_cache.evict(s.tree_cache.evictable_size())


def chat_ids(tok, system: str, q: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "system", "content": system},
                                         {"role": "user", "content": q}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write results JSON here")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    eng = Engine(max_running_requests=32)
    model, tok = hf_model_and_tok()
    n_new = args.new_tokens
    res: dict = {"machine": f"{platform.processor() or platform.machine()}, "
                            f"{os.cpu_count()} cores, torch {torch.__version__}"}

    # (a) identical work
    prompts = [chat_ids(tok, "You are a helpful assistant.", q) for q in QUESTIONS]
    sp = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
    eng.generate(prompts[:2], dict(sp, max_new_tokens=4))  # warm-up
    # Best of 2 runs each (the machine is shared; the prefix cache is flushed before each run
    # so both sides compute every prompt).
    t_eng = float("inf")
    for _ in range(2):
        eng.call_in_scheduler(_flush)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp)
        t_eng = min(t_eng, time.perf_counter() - t0)
        assert all(len(o.token_ids) == n_new for o in outs)
    hf_generate(model, tok, prompts[:2], 4)  # warm-up
    t_hf = min(hf_generate(model, tok, prompts, n_new) for _ in range(2))
    floor_step = matmul_floor(model.config, len(prompts), 20)
    t_floor = floor_step * n_new
    packed_step = matmul_floor(model.config, len(prompts), 20, packed=True)
    total = len(prompts) * n_new
    res["a"] = {"engine_s": t_eng, "hf_s": t_hf, "floor_s": t_floor,
                "engine_tok_s": total / t_eng, "hf_tok_s": total / t_hf,
                "floor_tok_s": total / t_floor, "speedup_vs_hf": t_hf / t_eng,
                "vs_floor": t_floor / t_eng, "floor_step_ms": floor_step * 1e3,
                "engine_step_ms": t_eng / n_new * 1e3,
                "onednn_floor_step_ms": packed_step * 1e3,
                "vs_onednn_floor": packed_step * n_new / t_eng}

    # (b) shared ~1,000-token system prompt
    system = ("You are the support assistant of a cache-aware inference service. " * 80).strip()
    shared = [chat_ids(tok, system, q) for q in QUESTIONS]
    sp_b = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    eng.call_in_scheduler(_flush)
    t0 = time.perf_counter()
    outs = eng.generate(shared, sp_b)
    t_eng_b = time.perf_counter() - t0
    cached = sum(o.cached_tokens for o in outs)
    t_hf_b = hf_generate(model, tok, shared, 16)
    res["b"] = {"prompt_tokens": len(shared[0]), "engine_s": t_eng_b, "hf_s": t_hf_b,
                "speedup_vs_hf": t_hf_b / t_eng_b, "cached_tokens": cached}
    eng.shutdown()
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
