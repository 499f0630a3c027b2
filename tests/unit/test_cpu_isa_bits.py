"""The C kernels give the same bits on every build and every machine: the products (q4_1, q8_0,
float32 panels), attention (extend and decode over the paged pool), RMSNorm with its residual,
RoPE and SiLU x up, on fixed inputs.

That is the product's own invariance across machines: an L3 object written by a daemon on a Zen 4
(the AVX512-VNNI build) and read by one on a Zen 3 (AVX2) must give the same answer. Two checks:
- every build this CPU can run (``cpu_kernels.supported_isas()``) against the AVX2 build, here;
- every build against the digests in ``cpu_isa_bits.json``, written by a run elsewhere, so a
  machine with one build still meets the others' bits. Inputs are integers scaled by powers of
  two (``torch.randint``: the same on every CPU), and so are the weights the quantizers read.

A change to the kernels' numerics on purpose rewrites the digests:
``python -m tests.unit.test_cpu_isa_bits --write`` (then say why in the commit).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.runtime.layers import cpu_kernels
from engine.runtime.layers.norm import RMSNorm
from engine.runtime.layers.packed import PackedWeight
from engine.runtime.layers.quant import QuantLinear
from engine.runtime.layers.rotary import RotaryEmbedding
from tests.attention_worlds import AttentionWorld

DIGESTS = Path(__file__).with_name("cpu_isa_bits.json")
pytestmark = pytest.mark.skipif(
    cpu_kernels.KERNELS.get() is None, reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}"
)


def _exact(gen: torch.Generator, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """Values in [-scale, scale) on a grid of scale / 4096: the same floats on every CPU."""
    return torch.randint(-4096, 4096, shape, generator=gen).float() * (scale / 4096)


def _products(lib: ctypes.CDLL) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n, k = 200, 256
    w = _exact(gen, (n, k), 0.125)
    bias = _exact(gen, (n,), 1.0)
    for kind in ("q4_1", "q8_0", "f32"):
        layer = PackedWeight.dense(w, bias) if kind == "f32" else QuantLinear(w, bias, kind).panels
        for rows in (1, 3, 16, 77):
            x = _exact(gen, (rows, k), 4.0)
            x[0, 7] = 32.0  # a block whose other activations round to small integers
            y = torch.empty(rows, n)
            rc = lib.linear_packed(ctypes.byref(layer.desc), x.data_ptr(), rows, y.data_ptr(), 2)
            assert rc == 0
            yield f"linear {kind} rows {rows}", y


def _attention(lib: ctypes.CDLL) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    for geom in ((4, 4, 64), (12, 4, 64), (6, 2, 72)):  # MHA, GQA 3, a head_dim off 8s
        heads, kv_heads, hd = geom
        lens = {"a": 300, "b": 41, "c": 130}
        seqs = {
            rid: tuple(_exact(gen, (n, h * hd), 2.0) for h in (heads, kv_heads, kv_heads))
            for rid, n in lens.items()
        }
        world = AttentionWorld(seqs, geom, "cpu", seed=3, num_slots=1024, table_width=512)
        world.backend.lib = lib
        world.cached("a", 200)
        world.extend([("a", 90), ("b", 41), ("c", 120)])
        world.decode(["a", "c"], 10)
        keys = sorted(world.out)
        yield f"attention {geom}", torch.stack([world.out[key] for key in keys])
        yield f"kv {geom}", torch.cat([world.pool.k_buffer[0], world.pool.v_buffer[0]])


def _row_ops(lib: ctypes.CDLL) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    for rows, hidden in ((1, 576), (7, 100)):
        norm = RMSNorm(hidden, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(_exact(gen, (hidden,), 2.0))
        norm.kernel = lib
        x, res = _exact(gen, (rows, hidden), 4.0), _exact(gen, (rows, hidden), 4.0)
        out, summed = norm(x, res)
        yield f"rms_norm {rows}x{hidden}", torch.cat([norm(x), out, summed])
    rope = RotaryEmbedding(64, 512, 10000.0)
    rope.kernel = lib
    qk = _exact(gen, (9, 12, 64), 2.0)
    yield "rope", rope(torch.tensor([0, 1, 5, 100, 511, 3, 3, 64, 65]), qk)
    for rows, inter in ((1, 1536), (40, 200)):
        gate_up = _exact(gen, (rows, 2 * inter), 32.0)
        act = torch.empty(rows, inter)
        lib.silu_mul(gate_up.data_ptr(), rows, inter, act.data_ptr(), 2)
        yield f"silu_mul {rows}x{inter}", act


CASES: list[Callable[[ctypes.CDLL], Iterator[tuple[str, torch.Tensor]]]] = [
    _products,
    _attention,
    _row_ops,
]


def digests(lib: ctypes.CDLL) -> dict[str, str]:
    """Every case's output bits, as sha256 prefixes."""
    out = {}
    for case in CASES:
        for name, tensor in case(lib):
            data = tensor.detach().contiguous().numpy().tobytes()
            out[name] = hashlib.sha256(data).hexdigest()[:16]
    return out


def _build(isa: str, cache: Path) -> ctypes.CDLL:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_CPU_ISA", isa)
        mp.setenv("HICACHE_KERNEL_CACHE", str(cache))
        return cpu_kernels._load(cpu_kernels._build())


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """isa -> its digests, for every build this CPU runs."""
    return {
        isa: digests(_build(isa, tmp_path_factory.mktemp(isa)))
        for isa in cpu_kernels.supported_isas()
    }


def test_every_build_here_gives_the_avx2_bits(builds):
    assert "avx2" in builds
    for isa, got in builds.items():
        differ = [name for name, d in got.items() if d != builds["avx2"][name]]
        assert not differ, f"{isa} differs from avx2 in {differ}"


def test_every_build_gives_the_bits_recorded_on_other_machines(builds):
    recorded = json.loads(DIGESTS.read_text())
    assert set(recorded["digests"]) == set(builds["avx2"]), "cases changed: rewrite the digests"
    for isa, got in builds.items():
        differ = [name for name, d in got.items() if d != recorded["digests"][name]]
        assert not differ, (
            f"the {isa} build here differs from the bits recorded on {recorded['machine']} "
            f"({recorded['isa']} build) in {differ}"
        )


def test_a_build_the_cpu_cannot_run_is_refused(monkeypatch, tmp_path):
    missing = [isa for isa in cpu_kernels.ISAS if isa not in cpu_kernels.supported_isas()]
    monkeypatch.setenv("HICACHE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("HICACHE_CPU_ISA", "avx1024")
    with pytest.raises(RuntimeError, match="expected one of"):
        cpu_kernels._build()
    for isa in missing:
        monkeypatch.setenv("HICACHE_CPU_ISA", isa)
        with pytest.raises(RuntimeError, match=f"the CPU lacks .* for the {isa} build"):
            cpu_kernels._build()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    from tools.benchlib.header import cpu_info

    lib = cpu_kernels.KERNELS.get()
    assert lib is not None, cpu_kernels.KERNELS.error
    record = {
        "machine": cpu_info()[0],
        "isa": cpu_kernels.isa(),
        "digests": digests(lib),
        "note": "written by python -m tests.unit.test_cpu_isa_bits --write",
    }
    DIGESTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{DIGESTS}: {len(record['digests'])} digests from the {record['isa']} build")
    os._exit(0)
