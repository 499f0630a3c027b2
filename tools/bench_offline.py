"""Offline throughput, engine vs transformers on the same weights, device and dtype (default:
the embedded SmolLM2-135M-Instruct, fp32, CPU).

(a) identical work: 16 short prompts x 64 new tokens, batched -- engine vs transformers
    `generate` vs the fp32 matmul floor of the model's decode step (the floors are CPU-only:
    skipped on CUDA);
(b) 16 requests sharing a ~1,000-token system prompt, sent together -- engine (prefix cache +
    in-batch prefix dedup) vs transformers' batched generate.

Weights: ``--load-format auto`` loads the checkpoint on both sides (the default model: its GGUF
converted once to an HF directory, which both read); ``dummy`` builds the engine's model with
seeded random weights (``engine/runtime/models/loader.py``) and copies the same tensors, q/k/v and
gate/up split back to HF names, into a transformers model built from the same config.json. A
directory without a tokenizer (e.g. tools/configs/llama3-8b) gets seeded random token-id
prompts of similar lengths. On CUDA every clock read follows ``torch.cuda.synchronize()``.

Usage: python -m tools.bench_offline [--out docs/bench_offline.json] [--plot docs/bench_offline.png]
       python -m tools.bench_offline --device cuda --dtype bfloat16 \\
           [--model tools/configs/llama3-8b --load-format dummy] --out docs/bench_offline_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from engine import Engine
from engine.runtime.layers.attention import default_backend
from engine.runtime.layers.linear import MergedLinear
from engine.runtime.model_runner import resolve_dtype
from engine.runtime.models.llama import FUSED_SHARDS
from engine.runtime.models.loader import LOAD_FORMATS, load_model, load_tokenizer, resolve_model_dir
from tools.benchlib import Header, write_json
from tools.plot_bench import plot

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How do bees make honey?",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
    "What is photosynthesis?",
    "Who wrote Hamlet?",
    "What is a prime number?",
    "How far is the Moon?",
    "What does a CPU do?",
    "Name a famous painting.",
    "What is gravity?",
    "How many legs does a spider have?",
    "What is rain?",
    "Why do we sleep?",
]


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a clock read after it counts it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's weights under HF names (views, no copies): fused q|k|v and gate|up split
    back into their shards, the inverse of ``load_weights``. A tied lm_head is left out (HF
    ties it to the embedding)."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module = modules[name.rsplit(".", 1)[0]]
        if not isinstance(module, MergedLinear):
            out[name] = param.detach()
            continue
        for fragment, (fused, shard) in FUSED_SHARDS.items():
            if fused in name and shard in module.shard_offsets:
                start, size = module.shard_offsets[shard]
                out[name.replace(fused, fragment)] = param.detach()[start : start + size]
    return out


def hf_model(
    model_path: str | None, load_format: str, device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    """The transformers model on ``device`` / ``dtype`` with the weights the engine loads:
    the checkpoint (``auto``), or the engine loader's seeded random weights (``dummy``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(resolve_model_dir(model_path))
    if load_format == "auto":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    # NOTE: the same call the engine's ModelRunner makes (same seed, device, dtype): the same
    # weights; built here, copied into HF, and freed before the engine sizes its KV pool
    ours, _, _ = load_model(model_path, device, dtype, "dummy", seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    missing, unexpected = model.load_state_dict(hf_state_dict(ours), strict=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise RuntimeError(
            f"weights do not map onto transformers: missing {missing}, unexpected {unexpected}"
        )
    del ours
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model.eval()


def check_same_weights(eng: Engine, model: torch.nn.Module) -> str:
    """Raise unless every weight the engine holds densely equals transformers' bit for bit;
    returns what was compared (oneDNN-packed linears, on CPU, hold no dense copy)."""
    theirs = model.state_dict()
    ours = hf_state_dict(eng.runner.model)
    dense = {n: t for n, t in ours.items() if t.numel()}
    differ = [n for n, t in dense.items() if not torch.equal(t, theirs[n].to(t.device))]
    if differ:
        raise RuntimeError(f"engine and transformers weights differ: {differ[:5]}")
    return f"{len(dense)} of {len(ours)} tensors bit-equal" + (
        f"; {len(ours) - len(dense)} oneDNN-packed, not compared" if len(dense) < len(ours) else ""
    )


def hf_generate(
    model, pad: int, prompts: list[list[int]], max_new: int, device: torch.device
) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
        )
    sync(device)
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
    ws = [
        (torch.randn(qkv, h), torch.randn(h, h), torch.randn(2 * inter, h), torch.randn(h, inter))
        for _ in range(layers)
    ]
    head = torch.randn(cfg.vocab_size, h)
    lin = torch.nn.functional.linear
    if packed:
        ws = [tuple(torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer) for layer in ws]
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
    return list(
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids for a model without a tokenizer (low ids skipped: often special)."""
    return [rng.randrange(3, min(vocab, 32000)) for _ in range(n)]


def timed_generate(eng: Engine, prompts: list[list[int]], sp: dict, device: torch.device):
    """(seconds, outputs) of one ``Engine.generate``, clocks read after a device sync."""
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    sync(device)
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None, help="write results JSON here")
    ap.add_argument("--plot", default=None, help="and its figure here (tools/plot_bench.py)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto = float32 on CPU, bfloat16 on CUDA (as the engine)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="HF dir / .gguf (default: the embedded SmolLM2); with --load-format "
        "dummy a dir with only config.json, e.g. tools/configs/llama3-8b",
    )
    ap.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS))
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="engine attention backend (default: torch_native on CPU; flashinfer "
        "if installed, else triton, on CUDA)",
    )
    ap.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="engine KV pool size (default: the engine's)",
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(
            f"--device cuda: no CUDA device here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False)"
        )
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = args.attention_backend or default_backend(device, dtype)
    header = Header.now()
    torch.set_num_threads(os.cpu_count() or 2)
    # transformers first: with dummy weights it briefly holds a second copy of the model,
    # and on CUDA the engine sizes its KV pool from the memory left
    model = hf_model(args.model, args.load_format, device, dtype, seed=0)
    eng = Engine(
        args.model,
        args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        random_seed=0,
        attention_backend=backend,
        kv_cache_memory_gb=args.kv_cache_gb,
        max_running_requests=32,
    )
    same = check_same_weights(eng, model)
    tok = load_tokenizer(resolve_model_dir(args.model))
    if tok is not None:
        tok.padding_side = "left"
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    else:
        eos = model.config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    n_new = args.new_tokens
    res: dict = {
        "device": args.device,
        "dtype": str(dtype).split(".")[-1],
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "load_format": args.load_format,
        "attention_backend": backend,
        "weights": same,
        "prompts": "chat template" if tok is not None else "seeded random token ids",
    }
    rng = random.Random(0)
    vocab = model.config.vocab_size

    # (a) identical work
    if tok is not None:
        prompts = [chat_ids(tok, "You are a helpful assistant.", q) for q in QUESTIONS]
    else:  # about the chat prompts' lengths
        prompts = [random_ids(rng, rng.randrange(24, 40), vocab) for _ in QUESTIONS]
    sp = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
    eng.generate(prompts[:2], dict(sp, max_new_tokens=4))  # warm-up
    # Best of 2 runs each (the machine is shared; the prefix cache is flushed before each run
    # so both sides compute every prompt).
    t_eng = float("inf")
    for _ in range(2):
        eng.call_in_scheduler(_flush)
        seconds, outs = timed_generate(eng, prompts, sp, device)
        t_eng = min(t_eng, seconds)
        assert all(len(o.token_ids) == n_new for o in outs)
    hf_generate(model, pad, prompts[:2], 4, device)  # warm-up
    t_hf = min(hf_generate(model, pad, prompts, n_new, device) for _ in range(2))
    total = len(prompts) * n_new
    res["a"] = {
        "engine_s": t_eng,
        "hf_s": t_hf,
        "engine_tok_s": total / t_eng,
        "hf_tok_s": total / t_hf,
        "speedup_vs_hf": t_hf / t_eng,
        "engine_step_ms": t_eng / n_new * 1e3,
        "hf_step_ms": t_hf / n_new * 1e3,
    }
    if device.type == "cpu":
        floor_step = matmul_floor(model.config, len(prompts), 20)
        t_floor = floor_step * n_new
        packed_step = matmul_floor(model.config, len(prompts), 20, packed=True)
        res["a"].update(
            {
                "floor_s": t_floor,
                "floor_tok_s": total / t_floor,
                "vs_floor": t_floor / t_eng,
                "floor_step_ms": floor_step * 1e3,
                "onednn_floor_step_ms": packed_step * 1e3,
                "vs_onednn_floor": packed_step * n_new / t_eng,
            }
        )
    else:
        res["a"]["floor"] = "skipped: the F.linear / oneDNN matmul floors are CPU-only"
        print("(a) matmul floors skipped: CPU-only (F.linear / oneDNN)", file=sys.stderr)

    # (b) shared ~1,000-token system prompt
    if tok is not None:
        system = ("You are the support assistant of a cache-aware inference service. " * 80).strip()
        shared = [chat_ids(tok, system, q) for q in QUESTIONS]
    else:
        prefix = random_ids(rng, 1000, vocab)
        shared = [prefix + random_ids(rng, rng.randrange(8, 16), vocab) for _ in QUESTIONS]
    sp_b = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    eng.call_in_scheduler(_flush)
    t_eng_b, outs = timed_generate(eng, shared, sp_b, device)
    cached = sum(o.cached_tokens for o in outs)
    t_hf_b = hf_generate(model, pad, shared, 16, device)
    res["b"] = {
        "prompt_tokens": len(shared[0]),
        "engine_s": t_eng_b,
        "hf_s": t_hf_b,
        "speedup_vs_hf": t_hf_b / t_eng_b,
        "cached_tokens": cached,
    }
    eng.shutdown()
    res.update(header.record([args.plot]))
    if args.plot:
        plot(res, args.plot)
    print(json.dumps(res, indent=2))
    if args.out:
        write_json(args.out, res, indent=2)
    print(header.markdown(res["plots"]))


if __name__ == "__main__":
    main()
