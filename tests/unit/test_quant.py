"""Block-quantized weights (q4_1, q8_0): the formats' round trips, the requantization that
recovers the embedded GGUF's own codes bit for bit, the C products against the torch reference
on the dequantized weight, the torch fallback, the option's resolution, and the engine's greedy
tokens on the quantized path against the dense one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.runtime.layers import cpu_kernels
from engine.runtime.layers.quant import (
    DECODE_MAX_ROWS,
    QuantLinear,
    dequantize_q4_1,
    dequantize_q8_0,
    quantize_linears,
    quantize_q4_1,
    quantize_q8_0,
    resolve_prefill_dtype,
    resolve_quantization,
    set_prefill_dtype,
)
from engine.runtime.models.loader import load_model

needs_kernels = pytest.mark.skipif(cpu_kernels.KERNELS.get() is None,
                                   reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}")


def _weights(seed: int, n: int, k: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * scale


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), blocks=st.integers(1, 6),
       scale=st.sampled_from([1e-3, 0.05, 3.0]))
def test_q4_1_round_trip_and_requantization_is_exact(seed, n, blocks, scale):
    """Dequantized values are within half a step of the input, and requantizing them gives back
    the same floats (the property that recovers a GGUF's Q4_1 codes from dense weights)."""
    w = _weights(seed, n, 32 * blocks, scale)
    qs, d, m = quantize_q4_1(w)
    back = dequantize_q4_1(qs, d, m)
    step = d.repeat_interleave(32, dim=1)
    # NOTE: fp16-rounded scales and min stretch the grid by at most an fp16 ulp each
    assert ((back - w).abs() <= step * 0.51 + w.abs().amax() * 2e-3 + 1e-7).all()
    assert torch.equal(dequantize_q4_1(*quantize_q4_1(back)), back)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), blocks=st.integers(1, 6),
       scale=st.sampled_from([1e-3, 0.05, 3.0]))
def test_q8_0_round_trip_and_requantization_is_exact(seed, n, blocks, scale):
    w = _weights(seed, n, 32 * blocks, scale)
    qs, d = quantize_q8_0(w)
    back = dequantize_q8_0(qs, d)
    step = d.repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step * 0.51 + w.abs().amax() * 2e-3 + 1e-7).all()
    assert torch.equal(dequantize_q8_0(*quantize_q8_0(back)), back)


def test_constant_and_zero_blocks():
    """A constant block is exact in q4_1 (its min); zeros are exact in both (no 0/0)."""
    w = torch.zeros(3, 64)
    w[1] = 0.25
    qs, d, m = quantize_q4_1(w)
    assert torch.equal(dequantize_q4_1(qs, d, m), w)
    back = dequantize_q8_0(*quantize_q8_0(w))
    assert torch.equal(back[0], w[0]) and torch.equal(back[2], w[2])
    torch.testing.assert_close(back[1], w[1], rtol=1e-3, atol=0)


def test_embedded_gguf_weights_are_recovered_bit_for_bit():
    """Every matrix of the embedded SmolLM2 (Q4_1 layers, Q8_0 embedding) requantizes to
    exactly the dense weights the converter dequantized: the int4 path runs the file's weights."""
    model, _, _ = load_model(None, "cpu")
    checked = 0
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        w = p.detach()
        if "embed_tokens" in name:
            back = dequantize_q8_0(*quantize_q8_0(w))
        else:
            back = dequantize_q4_1(*quantize_q4_1(w))
        assert torch.equal(back, w), name
        checked += 1
    assert checked == 30 * 4 + 1  # qkv, o, gate_up, down per layer + the (tied) embedding


def _int8_activation_reference(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """The kernels' arithmetic in torch: x's blocks rounded to int8 (scale max|x| / 127, half to
    even as cvtps2dq), exact integer block dots with the weight codes, the scales (and q4_1's
    mins) applied in float64."""
    rows, k = x.shape
    nb = k // 32
    xb = x.reshape(rows, nb, 32)
    amax = xb.abs().amax(-1)  # [rows, nb]
    xq = (xb * torch.where(amax > 0, 127 / amax, 0.0)[..., None]).round().double()
    xd = (amax / 127).double()
    if layer.m is None:  # q8_0: signed codes
        q = layer.qs.reshape(layer.qs.shape[0], nb, 32).double()
    else:
        packed = layer.qs.reshape(layer.qs.shape[0], nb, 16)
        q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).double()  # [N, nb, 32]
    dots = torch.einsum("rbj,nbj->rnb", xq, q)  # [rows, N, nb] integers
    scale = layer.d.double()[None] * xd[:, None]  # [rows, N, nb]
    out = dots * scale
    if layer.m is not None:
        out = out + layer.m.double()[None] * (xd * xq.sum(-1))[:, None]
    return out.sum(-1).float()


@needs_kernels
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_products(scheme, rows, bias):
    """<= DECODE_MAX_ROWS rows: equal to the int8-activation reference (llama.cpp's scheme) and
    within 2% (norm per row) of the dense product. More rows: dequantize + GEMM, bit-equal."""
    w = _weights(rows, 200, 96, 0.05)
    b = torch.randn(200) if bias else None
    layer = QuantLinear(w, b, scheme)
    x = torch.randn(rows, 96)
    x[0, 5] = 40.0  # an outlier, as LLM activations have: its block's others round coarsely
    ref = F.linear(x, layer.dequantize(), b)
    out = layer(x)
    assert out.shape == (rows, 200)
    if rows > DECODE_MAX_ROWS:
        assert torch.equal(out, ref)
    else:
        exact = _int8_activation_reference(x, layer) + (b if bias else 0)
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-4)
        rel = (out - ref).norm(dim=1) / ref.norm(dim=1)
        assert rel.max().item() < 0.02, rel
    # leading dims are kept
    assert torch.equal(layer(x.view(1, rows, 96)).view(rows, 200), out)


@needs_kernels
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
def test_bf16_prefill_products(scheme):
    """A prefill GEMM in bfloat16: the dequantized weight and the rows rounded to bf16, one GEMM
    accumulated in float32; within 1% of the float32 product. Decode rows are not affected."""
    rows = DECODE_MAX_ROWS + 24
    w = _weights(rows, 200, 96, 0.05)
    b = torch.randn(200)
    layer = QuantLinear(w, b, scheme)
    x = torch.randn(rows, 96)
    fp32 = layer(x)
    decode = layer(x[:3])
    layer.prefill_dtype = torch.bfloat16
    out = layer(x)
    bf = torch.bfloat16
    assert torch.equal(out, F.linear(x.to(bf), layer.dequantize().to(bf)).float() + b)
    rel = (out - fp32).norm(dim=1) / fp32.norm(dim=1)
    assert rel.max().item() < 0.01, rel
    assert torch.equal(layer(x[:3]), decode)


def test_resolve_prefill_dtype(monkeypatch):
    from engine.runtime.layers import quant

    assert resolve_prefill_dtype("bfloat16", "none") == torch.float32  # dense: the reference
    assert resolve_prefill_dtype("bfloat16", "int4") == torch.bfloat16
    assert resolve_prefill_dtype("float32", "int4") == torch.float32
    monkeypatch.setattr(quant, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    want = torch.bfloat16 if cpu_kernels.KERNELS.get() is not None else torch.float32
    assert resolve_prefill_dtype("auto", "int4") == want
    monkeypatch.setattr(quant, "cpu_flags", lambda: {"avx2", "fma"})
    assert resolve_prefill_dtype("auto", "int4") == torch.float32
    with pytest.raises(ValueError, match="unknown prefill_matmul_dtype"):
        resolve_prefill_dtype("fp8", "int4")
    with pytest.raises(ValueError, match="unknown prefill_matmul_dtype"):
        Engine(prefill_matmul_dtype="half")


def test_set_prefill_dtype_leaves_dense_heads_float32():
    head = QuantLinear(torch.randn(64, 64), None, "q8_0", dense=torch.randn(64, 64))
    model = torch.nn.Sequential(QuantLinear(torch.randn(64, 64), None, "q4_1"), head)
    assert set_prefill_dtype(model, torch.bfloat16) == 1
    assert model[0].prefill_dtype == torch.bfloat16 and head.prefill_dtype == torch.float32


@needs_kernels
def test_dequantize_kernel_equals_torch():
    w = _weights(3, 130, 160, 0.1)
    for scheme, ref in (("q4_1", lambda L: dequantize_q4_1(L.qs, L.d, L.m)),
                        ("q8_0", lambda L: dequantize_q8_0(L.qs, L.d))):
        layer = QuantLinear(w, None, scheme)
        assert torch.equal(layer.dequantize(), ref(layer))
        # rounded in the same pass as torch rounds (to nearest, ties to even)
        assert torch.equal(layer.dequantize(torch.bfloat16), ref(layer).to(torch.bfloat16))
    # k * (1 + 3 * 2^-8): halfway between two bf16 numbers for k a power of two (the lower one
    # odd, so ties-to-even rounds up), past halfway for k = 5
    k = torch.tensor([127.0, 1, 2, -1, 4, 64, -32, 5] * 4)
    tie = QuantLinear((k * (1 + 3 * 2**-8)).repeat(2, 1), None, "q8_0")
    assert torch.equal(tie.dequantize(torch.bfloat16), tie.dequantize().to(torch.bfloat16))
    assert tie.dequantize(torch.bfloat16)[0, 1].item() == 1 + 2**-6
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer.dequantize(torch.float16)


def test_torch_fallback_without_kernels(monkeypatch):
    """No compiler / no AVX2: the same layer runs on torch ops with the same results."""
    w = _weights(5, 64, 64, 0.05)
    x = torch.randn(3, 64)
    layer = QuantLinear(w, None, "q4_1")
    monkeypatch.setattr(cpu_kernels.KERNELS, "_lib", None)
    monkeypatch.setattr(cpu_kernels.KERNELS, "_tried", True)
    torch.testing.assert_close(layer(x), F.linear(x, dequantize_q4_1(layer.qs, layer.d, layer.m)))


@needs_kernels
def test_kernel_builds_into_a_fresh_cache(monkeypatch, tmp_path):
    """A clean machine: the source compiles into the cache dir once, then is reused."""
    monkeypatch.setenv("HICACHE_KERNEL_CACHE", str(tmp_path))
    path = cpu_kernels._build()
    assert path.parent == tmp_path / "kernels" and path.is_file()
    assert cpu_kernels._build() == path
    assert cpu_kernels._load(path).linear_q4_1_q8 is not None


@needs_kernels
@pytest.mark.skipif(cpu_kernels.isa() == "avx2", reason="the CPU has no AVX-VNNI / AVX512-VNNI")
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_vnni_and_avx2_builds_give_the_same_products(monkeypatch, tmp_path, scheme, rows):
    """The products' integer dots in one VNNI instruction or two AVX2 ones: same bits."""
    w = _weights(rows, 200, 256, 0.05)
    layer = QuantLinear(w, None, scheme)
    x = torch.randn(rows, 256)
    x[0, 7] = 30.0  # a block whose other weights round to small integers
    vnni = layer(x)
    monkeypatch.setenv("HICACHE_CPU_ISA", "avx2")
    monkeypatch.setenv("HICACHE_KERNEL_CACHE", str(tmp_path))
    lib = cpu_kernels._load(cpu_kernels._build())
    y = torch.empty(rows, 200)
    p = torch.Tensor.data_ptr
    if scheme == "q4_1":
        rc = lib.linear_q4_1_q8(p(x), rows, 256, p(layer.qs), p(layer.d), p(layer.m), 200, p(y), 2)
    else:
        rc = lib.linear_q8_0_q8(p(x), rows, 256, p(layer.qs), p(layer.d), 200, p(y), 2)
    assert rc == 0
    assert torch.equal(y, vnni)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_q8_0_products_take_every_code(rows):
    """Codes -128 and 127 (a file may hold -128; our quantizer never writes it) and 0: |w| as
    u8 and x carrying w's sign still give the exact integer dots."""
    layer = QuantLinear(_weights(rows, 40, 64, 0.05), None, "q8_0")
    layer.qs[:, :32] = torch.tensor([-128, 127, 0, -1] * 8, dtype=torch.int8)
    x = torch.randn(rows, 64)
    x[:, 0] = -5.0  # the block's largest: rounded to -127, times -128
    torch.testing.assert_close(layer(x), _int8_activation_reference(x, layer), rtol=1e-5,
                               atol=1e-4)


def test_kernel_build_failure_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("HICACHE_NO_CPU_KERNEL", "1")
    fresh = cpu_kernels._Kernels()
    assert fresh.get() is None and "HICACHE_NO_CPU_KERNEL" in fresh.error
    monkeypatch.delenv("HICACHE_NO_CPU_KERNEL")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HICACHE_KERNEL_CACHE", str(tmp_path / "cache"))
    fresh = cpu_kernels._Kernels()
    assert fresh.get() is None and fresh.error


def test_bad_layers_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantLinear(torch.randn(8, 40), None, "q4_1")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        QuantLinear(torch.randn(8, 64), None, "q3_k")
    with pytest.raises(ValueError, match="float32"):
        QuantLinear(torch.randn(8, 64).half(), None, "q4_1")


def test_resolve_quantization():
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_quantization("auto", cpu, f32, {"Q4_1"}) == "int4"
    assert resolve_quantization("auto", cpu, f32, {"Q4_K", "Q6_K"}) == "int4"
    assert resolve_quantization("auto", cpu, f32, {"Q8_0"}) == "int8"
    assert resolve_quantization("auto", cpu, f32, {"F16"}) == "none"
    assert resolve_quantization("auto", cpu, f32, None) == "none"  # safetensors
    assert resolve_quantization("auto", cpu, torch.bfloat16, {"Q4_1"}) == "none"
    assert resolve_quantization("auto", torch.device("cuda"), torch.bfloat16, {"Q4_1"}) == "none"
    assert resolve_quantization("int8", cpu, f32, None) == "int8"
    with pytest.raises(ValueError, match="runs on CPU"):
        resolve_quantization("int4", torch.device("cuda"), torch.bfloat16, None)
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quantization("int3", cpu, f32, None)
    with pytest.raises(ValueError, match="unknown quantization"):
        Engine(quantization="fp4")


def test_quantize_linears_keeps_tied_embedding(tiny_llama_dir):
    model, _, _ = load_model(tiny_llama_dir, "cpu")
    embed = model.model.embed_tokens.weight
    count = quantize_linears(model, "int4")
    assert count == 2 * 4 + 1
    assert model.lm_head.scheme == "q8_0"
    assert model.model.layers[0].mlp.down_proj.scheme == "q4_1"
    if model.tie_word_embeddings:
        assert model.lm_head.dense is embed


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_engine_quantized_runs_and_reports(tiny_llama_dir, quantization):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 9]
    with Engine(tiny_llama_dir, quantization=quantization, max_total_tokens=1024,
                debug_check_invariants=True) as eng:
        info = eng.model_info()
        assert info["quantization"] == quantization
        outs = eng.generate(prompts, sp)
        again = eng.generate(prompts, sp)  # prefix-cache hits: same tokens
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert all(len(o.token_ids) == 12 for o in outs)
    with Engine(tiny_llama_dir, max_total_tokens=1024) as eng:
        assert eng.model_info()["quantization"] == "none"  # auto: an HF dir stays dense
