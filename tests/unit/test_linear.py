"""Linear backends: the C products' panels (``cpu``) and the oneDNN-prepacked path equal
``F.linear``; prepacking a whole model keeps its logits and frees dense copies except shared
(tied) ones; the engine runs every backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import create_backend
from engine.runtime.layers.cpu_kernels import KERNELS
from engine.runtime.layers.linear import (
    Linear,
    LMHead,
    MergedLinear,
    prepack_linears,
    resolve_linear_backend,
)
from engine.runtime.models.loader import load_model
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool
from tests.tiny_models import make_tiny_model_dir

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


needs_kernels = pytest.mark.skipif(KERNELS.get() is None, reason=f"no C kernels: {KERNELS.error}")


def _backends() -> list:
    return [pytest.param("onednn", marks=needs_onednn), pytest.param("cpu", marks=needs_kernels)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_f_linear(backend, rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 200, bias)
    merged = MergedLinear(96, {"a": 120, "b": 80}, bias)
    head = LMHead(96, 5000)  # > 2 chunks: the dense path is chunked_linear
    x = torch.randn(rows, 96, generator=g)
    for layer in (lin, merged, head):
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
        dense_w = layer.weight.detach().clone()
        ref = F.linear(x, dense_w, layer.bias)
        dense_out = layer(x)
        torch.testing.assert_close(dense_out, ref, rtol=1e-5, atol=1e-5)
        layer.prepack(backend)
        assert layer.weight.numel() == 0  # the dense copy is dropped
        out = layer(x)
        assert out.shape == (rows, dense_w.shape[0])
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # any leading dims, non-contiguous input
        x3 = torch.randn(96, 2, 3, generator=g).permute(1, 2, 0)
        torch.testing.assert_close(
            layer(x3), F.linear(x3, dense_w, layer.bias), rtol=1e-5, atol=1e-5
        )


def _decode_logits(model, config, tokens: list[int]) -> torch.Tensor:
    """Prefill ``tokens`` as one EXTEND batch through the torch-native backend: last-token
    logits ``[vocab]``."""
    n = len(tokens)
    pool = MHATokenToKVPool(
        64,
        1,
        torch.float32,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
        config.num_hidden_layers,
        "cpu",
    )
    r2t = ReqToTokenPool(2, 64, "cpu")
    slots = torch.arange(1, n + 1)
    r2t.req_to_token[0, :n] = slots.to(r2t.req_to_token.dtype)
    fb = ForwardBatch(
        ForwardMode.EXTEND,
        1,
        torch.tensor(tokens),
        torch.arange(n),
        slots,
        torch.tensor([0]),
        torch.tensor([n]),
        torch.tensor([0]),
        torch.tensor([n]),
        [n],
        [0],
        [n],
        r2t,
        pool,
        create_backend("torch_native", None),
    )
    with torch.inference_mode():
        fb.attn_backend.init_forward_metadata(fb)
        return model(fb)[0]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("tied", [False, True])
def test_prepack_model_keeps_logits_and_tied_weights(tmp_path, backend, tied):
    path = make_tiny_model_dir(str(tmp_path / "m"), "llama", tie_word_embeddings=tied)
    model, config, _ = load_model(path, "cpu")
    tokens = [5, 17, 99, 3, 250, 8, 41]
    ref = _decode_logits(model, config, tokens)
    embed = model.model.embed_tokens.weight.detach().clone()
    count = prepack_linears(model, backend)
    assert count == 4 * config.num_hidden_layers + 1
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0
    # a tied lm_head shares the embedding: its dense copy must survive (embedding lookups)
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert (model.lm_head.weight.numel() > 0) == tied
    torch.testing.assert_close(_decode_logits(model, config, tokens), ref, rtol=0, atol=1e-4)


def test_resolve_linear_backend():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="unknown linear_backend"):
        resolve_linear_backend("mkl", cpu, torch.float32)
    with pytest.raises(ValueError, match="onednn"):
        resolve_linear_backend("onednn", cpu, torch.float16)
    assert resolve_linear_backend("torch", cpu, torch.float32) == "torch"
    assert resolve_linear_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    if KERNELS.get() is not None:
        assert resolve_linear_backend("auto", cpu, torch.float32) == "cpu"
        with pytest.raises(ValueError, match="linear_backend 'cpu' needs float32"):
            resolve_linear_backend("cpu", cpu, torch.bfloat16)
    elif torch.backends.mkldnn.is_available():
        assert resolve_linear_backend("auto", cpu, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="linear_backend 'cpu' needs float32"):
        resolve_linear_backend("cpu", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="unknown linear_backend"):
        Engine(linear_backend="blas")


def test_engine_linear_backends_agree(tiny_llama_dir):
    prompts = [[5, 9, 33, 120, 7], list(range(3, 60))]
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "auto", "onednn"):
        with Engine(tiny_llama_dir, linear_backend=backend, max_total_tokens=1024) as eng:
            outs[backend] = [o.token_ids for o in eng.generate(prompts, sp)]
            expected = (
                backend
                if backend != "auto"
                else resolve_linear_backend("auto", torch.device("cpu"), torch.float32)
            )
            assert eng.model_info()["linear_backend"] == expected
    assert outs["torch"] == outs["auto"] == outs["onednn"]
