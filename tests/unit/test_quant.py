"""Block-quantized weights (q4_1, q8_0): the formats' round trips, the requantization that
recovers the embedded GGUF's own codes bit for bit, packing into panels, the C products against
the exact integer reference and the dense product, their row invariance (a row's output never
depends on how many rows share the call), the torch fallback, the option's resolution."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.runtime.layers import cpu_kernels
from engine.runtime.layers.packed import (
    PackedWeight,
    pack_f32,
    pack_q4_1,
    pack_q8_0,
    unpack_f32,
    unpack_q4_1,
    unpack_q8_0,
)
from engine.runtime.layers.quant import (
    QuantLinear,
    dequantize_q4_1,
    dequantize_q8_0,
    quantize_linears,
    quantize_q4_1,
    quantize_q8_0,
    resolve_quantization,
)
from engine.runtime.models.loader import load_model

needs_kernels = pytest.mark.skipif(
    cpu_kernels.KERNELS.get() is None, reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}"
)


def _weights(seed: int, n: int, k: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * scale


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 40),
    blocks=st.integers(1, 6),
    scale=st.sampled_from([1e-3, 0.05, 3.0]),
)
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
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 40),
    blocks=st.integers(1, 6),
    scale=st.sampled_from([1e-3, 0.05, 3.0]),
)
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
    qs, d, m = layer.codes()
    if m is None:  # q8_0: signed codes
        q = qs.reshape(qs.shape[0], nb, 32).double()
    else:
        packed = qs.reshape(qs.shape[0], nb, 16)
        q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).double()  # [N, nb, 32]
    dots = torch.einsum("rbj,nbj->rnb", xq, q)  # [rows, N, nb] integers
    scale = d.double()[None] * xd[:, None]  # [rows, N, nb]
    out = dots * scale
    if m is not None:
        out = out + m.double()[None] * (xd * xq.sum(-1))[:, None]
    return out.sum(-1).float()


@needs_kernels
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 40, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_products(scheme, rows, bias):
    """Every row count: equal to the int8-activation reference (llama.cpp's scheme: exact
    integer block dots, the scales in float64) up to float32 rounding, and within 2% (norm per
    row) of the dense product."""
    w = _weights(rows, 200, 96, 0.05)
    b = torch.randn(200) if bias else None
    layer = QuantLinear(w, b, scheme)
    x = torch.randn(rows, 96)
    x[0, 5] = 40.0  # an outlier, as LLM activations have: its block's others round coarsely
    ref = F.linear(x, layer.dequantize(), b)
    out = layer(x)
    assert out.shape == (rows, 200)
    exact = _int8_activation_reference(x, layer) + (b if bias else 0)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-4)
    rel = (out - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max().item() < 0.02, rel
    # leading dims are kept
    assert torch.equal(layer(x.view(1, rows, 96)).view(rows, 200), out)


def _layer(kind: str, n: int, k: int, seed: int, bias: bool) -> QuantLinear | PackedWeight:
    w = _weights(seed, n, k, 0.05)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed)) if bias else None
    return PackedWeight.dense(w, b) if kind == "f32" else QuantLinear(w, b, kind)


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["q4_1", "q8_0", "f32"]),
    n=st.integers(1, 70),
    kb=st.integers(1, 6),
    rows=st.integers(1, 70),
    bias=st.booleans(),
    data=st.data(),
)
def test_products_are_row_invariant(kind, n, kb, rows, bias, data):
    """A row's outputs are the same bits whatever rows share the call: alone, in any slice of
    the batch, at any position (the C products' one numeric path for every row count)."""
    k = 32 * kb + (data.draw(st.integers(0, 31)) if kind == "f32" else 0)
    layer = _layer(kind, n, k, seed=n * 7 + kb, bias=bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    full = layer(x)
    i = data.draw(st.integers(0, rows - 1))
    assert torch.equal(layer(x[i : i + 1]), full[i : i + 1])
    a = data.draw(st.integers(0, rows - 1))
    b = data.draw(st.integers(a + 1, rows))
    assert torch.equal(layer(x[a:b]), full[a:b])
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(kb))
    assert torch.equal(layer(x[perm]), full[perm])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), blocks=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_packing_round_trips(n, blocks, seed):
    """Packing permutes codes and fp16 scales into panels: unpacking gives them back exactly
    (the zero-padded columns past n dropped)."""
    w = _weights(seed, n, 32 * blocks, 0.1)
    qs, d, m = quantize_q4_1(w)
    assert all(torch.equal(a, b) for a, b in zip(unpack_q4_1(pack_q4_1(qs, d, m), n), (qs, d, m)))
    qs8, d8 = quantize_q8_0(w)
    assert all(torch.equal(a, b) for a, b in zip(unpack_q8_0(pack_q8_0(qs8, d8), n), (qs8, d8)))
    assert torch.equal(unpack_f32(pack_f32(w), n), w)
    supers = -(-n // 32)  # 4 panels of 8 columns, interleaved block by block
    assert pack_q4_1(qs, d, m).shape == (supers, blocks, 4, 160)
    assert pack_q8_0(qs8, d8).shape == (supers, blocks, 4, 272)
    assert pack_f32(w).shape == (supers, 32 * blocks, 4, 8)


def test_torch_fallback_without_kernels(monkeypatch):
    """No compiler / no AVX2: the layer keeps its codes and runs on torch ops (dense float32
    on the dequantized weight), close to the kernels' int8-activation products."""
    w = _weights(5, 64, 64, 0.05)
    x = torch.randn(3, 64)
    fast = QuantLinear(w, None, "q4_1") if cpu_kernels.KERNELS.get() is not None else None
    monkeypatch.setattr(cpu_kernels.KERNELS, "_lib", None)
    monkeypatch.setattr(cpu_kernels.KERNELS, "_tried", True)
    layer = QuantLinear(w, None, "q4_1")
    assert layer.panels is None
    assert torch.equal(layer(x), F.linear(x, dequantize_q4_1(layer.qs, layer.d, layer.m)))
    if fast is not None:
        assert all(torch.equal(a, b) for a, b in zip(fast.codes(), layer.codes()))
        torch.testing.assert_close(fast(x), layer(x), rtol=0.05, atol=0.05)


@needs_kernels
def test_kernel_builds_into_a_fresh_cache(monkeypatch, tmp_path):
    """A clean machine: the source compiles into the cache dir once, then is reused."""
    monkeypatch.setenv("HICACHE_KERNEL_CACHE", str(tmp_path))
    path = cpu_kernels._build()
    assert path.parent == tmp_path / "kernels" and path.is_file()
    assert cpu_kernels._build() == path
    assert cpu_kernels._load(path).linear_packed is not None


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory):
    """The kernels built for plain AVX2 (16 registers, two-step integer dots)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_CPU_ISA", "avx2")
        mp.setenv("HICACHE_KERNEL_CACHE", str(tmp_path_factory.mktemp("avx2")))
        return cpu_kernels._load(cpu_kernels._build())


@needs_kernels
@pytest.mark.skipif(cpu_kernels.isa() == "avx2", reason="the CPU has no AVX-VNNI / AVX512-VNNI")
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f32"])
@pytest.mark.parametrize("rows", [1, 5, 16, 77])
def test_vnni_and_avx2_builds_give_the_same_products(avx2_lib, kind, rows):
    """The products' integer dots in one VNNI instruction or three AVX2 ones, 32 registers or
    16 (other tiles): the same bits."""
    layer = _layer(kind, 200, 256, seed=rows, bias=True)
    packed = layer if isinstance(layer, PackedWeight) else layer.panels
    x = torch.randn(rows, 256)
    x[0, 7] = 30.0  # a block whose other weights round to small integers
    vnni = layer(x)
    lib = avx2_lib
    y = torch.empty(rows, 200)
    assert lib.linear_packed(ctypes.byref(packed.desc), x.data_ptr(), rows, y.data_ptr(), 2) == 0
    assert torch.equal(y, vnni)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_q8_0_products_take_every_code(rows):
    """Codes -128 and 127 (a file may hold -128; our quantizer never writes it) and 0: the
    offset codes (VNNI) and |w| times x carrying w's sign (AVX2) give the exact integer dots."""
    w = _weights(rows, 40, 64, 0.05)
    qs, d = quantize_q8_0(w)
    qs[:, :32] = torch.tensor([-128, 127, 0, -1] * 8, dtype=torch.int8)
    layer = QuantLinear(w, None, "q8_0")
    layer.panels = PackedWeight("q8_0", pack_q8_0(qs, d), 40, 64, None)
    x = torch.randn(rows, 64)
    x[:, 0] = -5.0  # the block's largest: rounded to -127, times -128
    torch.testing.assert_close(layer(x), _int8_activation_reference(x, layer), rtol=1e-5, atol=1e-4)


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
    assert model.model.embed_tokens.weight is embed  # the lookup keeps the dense weight


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_engine_quantized_runs_and_reports(tiny_llama_dir, quantization):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 9]
    with Engine(
        tiny_llama_dir,
        quantization=quantization,
        max_total_tokens=1024,
        debug_check_invariants=True,
    ) as eng:
        info = eng.model_info()
        assert info["quantization"] == quantization
        outs = eng.generate(prompts, sp)
        again = eng.generate(prompts, sp)  # prefix-cache hits: same tokens
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        assert all(len(o.token_ids) == 12 for o in outs)
    with Engine(tiny_llama_dir, max_total_tokens=1024) as eng:
        assert eng.model_info()["quantization"] == "none"  # auto: an HF dir stays dense
