"""Models + torch_native attention vs transformers: prefill, extend after a cached prefix, decode.

Tiny random Llama / Qwen2 / Qwen3 checkpoints are saved as safetensors and loaded through
``engine.runtime.models.loader``; pools and ForwardBatches are built by hand (``_Harness``), with KV
slots handed out in a shuffled order so the gather through req_to_token is exercised.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import create_backend
from engine.runtime.models.loader import load_model
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

ATOL = 1e-4
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # large enough that attention is far from uniform
}


def _configs() -> dict[str, transformers.PretrainedConfig]:
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 5000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return {
        "llama": transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
        "llama3_rope": transformers.LlamaConfig(**TINY, rope_parameters=llama3_rope),
        "qwen2": transformers.Qwen2Config(**TINY, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    }


@pytest.fixture(scope="module", params=list(_configs()))
def models(request, tmp_path_factory):
    torch.manual_seed(0)
    config = _configs()[request.param]
    config.architectures = [
        transformers.AutoModelForCausalLM.from_config(config).__class__.__name__
    ]
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, hf_config, tokenizer = load_model(str(path), "cpu", torch.float32)
    assert tokenizer is None and hf_config.architectures == config.architectures
    return model, hf


class _Harness:
    """Pools + a tiny per-request bookkeeping that builds ForwardBatches like a model runner."""

    def __init__(self, model, num_slots: int = 512) -> None:
        cfg = model.config
        self.model = model
        self.req_pool = ReqToTokenPool(8, 256, "cpu")
        self.kv_pool = MHATokenToKVPool(
            num_slots,
            1,
            torch.float32,
            model.num_kv_heads,
            model.head_dim,
            cfg.num_hidden_layers,
            "cpu",
        )
        gen = torch.Generator().manual_seed(1)
        self.free_slots = (torch.randperm(num_slots, generator=gen) + 1).tolist()  # page 0 = pad
        self.backend = create_backend("torch_native", None)
        self.rows: dict[int, int] = {}  # request id -> req_to_token row
        self.lens: dict[int, int] = {}  # request id -> tokens with KV in the pool

    def _batch(self, mode: ForwardMode, rids: list[int], chunks: list[list[int]], all_logits: bool):
        prefix = [self.lens.get(r, 0) for r in rids]
        ext = [len(c) for c in chunks]
        seq = [p + n for p, n in zip(prefix, ext)]
        locs, positions = [], []
        for rid, p, n in zip(rids, prefix, ext):
            if rid not in self.rows:
                self.rows[rid] = self.req_pool.alloc(1)[0]
            loc = torch.tensor([self.free_slots.pop() for _ in range(n)], dtype=torch.int64)
            self.req_pool.write((self.rows[rid], slice(p, p + n)), loc)
            self.lens[rid] = p + n
            locs.append(loc)
            positions.append(torch.arange(p, p + n))
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
        is_extend = mode == ForwardMode.EXTEND
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rids),
            input_ids=i64([t for c in chunks for t in c]),
            positions=torch.cat(positions),
            out_cache_loc=torch.cat(locs),
            req_pool_indices=i64([self.rows[r] for r in rids]),
            seq_lens=i64(seq),
            extend_prefix_lens=i64(prefix) if is_extend else None,
            extend_seq_lens=i64(ext) if is_extend else None,
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix if is_extend else None,
            extend_seq_lens_cpu=ext if is_extend else None,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
            return_all_logits=all_logits,
        )
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            return self.model(fb)

    def extend(self, rids: list[int], chunks: list[list[int]], all_logits: bool = True):
        return self._batch(ForwardMode.EXTEND, rids, chunks, all_logits)

    def decode(self, rids: list[int], tokens: list[int]):
        return self._batch(ForwardMode.DECODE, rids, [[t] for t in tokens], False)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]  # [len(ids), vocab]


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


def test_prefill_mixed_lengths(models):
    model, hf = models
    prompts = _prompts([5, 11, 1, 8])
    logits = _Harness(model).extend(list(range(4)), prompts)
    assert logits.shape == (sum(map(len, prompts)), 128)
    for got, ids in zip(logits.split([len(p) for p in prompts]), prompts):
        torch.testing.assert_close(got, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_last_token_logits(models):
    model, hf = models
    prompts = _prompts([3, 9, 6], seed=1)
    logits = _Harness(model).extend([0, 1, 2], prompts, all_logits=False)
    assert logits.shape == (3, 128)
    for got, ids in zip(logits, prompts):
        torch.testing.assert_close(got, _hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_extend_with_prefix_then_decode(models):
    model, hf = models
    prompts = _prompts([12, 7, 9, 4], seed=2)
    split = [5, 0, 8, 4]  # tokens prefilled first; request 1 has no prefix, request 3 no extension
    harness = _Harness(model)
    first = [(r, p[:s]) for r, (p, s) in enumerate(zip(prompts, split)) if s > 0]
    harness.extend([r for r, _ in first], [c for _, c in first])
    rest = [(r, p[s:]) for r, (p, s) in enumerate(zip(prompts, split)) if s < len(p)]
    logits = harness.extend([r for r, _ in rest], [c for _, c in rest])
    for got, (rid, chunk) in zip(logits.split([len(c) for _, c in rest]), rest):
        want = _hf_logits(hf, prompts[rid])[split[rid] :]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)

    seqs = [list(p) for p in prompts]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(0, 128, (4,), generator=gen).tolist()
        logits = harness.decode([0, 1, 2, 3], tokens)
        assert logits.shape == (4, 128)
        for rid, tok in enumerate(tokens):
            seqs[rid].append(tok)
            torch.testing.assert_close(
                logits[rid], _hf_logits(hf, seqs[rid])[-1], atol=ATOL, rtol=0
            )


def test_registry_and_backend_errors():
    from engine.runtime.models.registry import get_model_class

    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("nope", None)
    with pytest.raises(ValueError, match="unsupported architecture"):
        get_model_class(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_MODEL_CACHE", str(tmp_path))
    model, config, tokenizer = load_model(None, "cpu")
    (model_dir,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert config.architectures == ["LlamaForCausalLM"] and tokenizer.chat_template
    ids = tokenizer("The capital of France is")["input_ids"]
    logits = _Harness(model).extend([0], [ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-3, rtol=1e-4)
    again, _, tokenizer2 = load_model(None, "cpu")  # cached: no second conversion
    assert tokenizer2.encode("hello") == tokenizer.encode("hello")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
