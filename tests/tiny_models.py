"""Tiny random-weight models (Llama, Qwen2, Qwen3) with an offline-trained tokenizer, saved as
HF directories: the engine loads them like any checkpoint; transformers is the reference."""

from __future__ import annotations

import os

import torch

from tools.benchlib.reference import greedy_reference

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "Radix trees share common prefixes between requests; eviction frees the least recently used.",
    "Hello world! How are you today? I am fine, thank you.",
    "Prefill computes the prompt; decode produces one token at a time.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ?",
]


def make_tokenizer(vocab_size: int = 384):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS * 4,
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def make_config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 0,
        "bos_token_id": 1,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(rope_theta=10000.0, **common)
    if arch == "qwen2":
        return Qwen2Config(rope_theta=10000.0, **common)
    if arch == "qwen3":
        return Qwen3Config(rope_theta=10000.0, head_dim=16, **common)
    raise ValueError(arch)


def make_tiny_model_dir(path: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Writes config.json + model.safetensors + tokenizer files into path (once)."""
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer()
    cfg = make_config(arch, len(tok), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger random weights than the default init make greedy choices less tie-prone.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_reference(model, prompts, max_new_tokens)
