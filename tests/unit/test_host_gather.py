"""torch_native's host gather (``_HostGather``): for a batch whose slots are partly still loading,
the KV rows it gathers (those slots from the host pool, the rest from the device pool) equal the
device pool's rows once the load landed, bit for bit, whatever the mix and order of slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.layers.attention import torch_native
from engine.runtime.layers.attention.torch_native import _HostGather
from hicache.l2.tier import HostReads

SLOTS, HOST, HEADS, DIM = 40, 64, 2, 4


@st.composite
def batches(draw):
    """A flat kv_indices (slot 0 = padding) and a set of its slots still loading."""
    kv = draw(st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=80))
    used = sorted(set(kv) - {0})
    loading = draw(st.lists(st.sampled_from(used), unique=True)) if used else []
    host_rows = draw(st.permutations(range(HOST)))[: len(loading)]
    return kv, loading, host_rows


@pytest.mark.parametrize("max_runs", [torch_native.MAX_GATHER_RUNS, 0])  # 0: the two-pass path
def test_host_gather_equals_the_landed_device_rows(max_runs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_native, "MAX_GATHER_RUNS", max_runs)
        check_host_gather()


@settings(max_examples=60, deadline=None)
@given(batch=batches(), layout=st.sampled_from(["layer_first", "page_first"]))
def check_host_gather(batch, layout):
    kv, loading, host_rows = batch
    gen = torch.Generator().manual_seed(len(kv))
    landed = [torch.randn(SLOTS, HEADS, DIM, generator=gen) for _ in range(2)]  # K, V
    if layout == "layer_first":  # [2, L=1, size, H, D]
        host = torch.full((2, 1, HOST, HEADS, DIM), float("nan"))
        layer_kv = lambda _layer: (host[0, 0], host[1, 0])
    else:  # [2, size, L=2, H, D]: the layer's rows are strided
        host = torch.full((2, HOST, 2, HEADS, DIM), float("nan"))
        layer_kv = lambda _layer: (host[0][:, 1], host[1][:, 1])
    dev = torch.tensor(loading, dtype=torch.int64)
    rows = torch.tensor(host_rows, dtype=torch.int64)
    device = [t.clone() for t in landed]
    for i, (h, d) in enumerate(zip(layer_kv(0), device)):
        h[rows] = landed[i][dev]
        d[dev] = float("nan")  # not landed yet: a read of it would show
    kv_indices = torch.tensor(kv, dtype=torch.int64)
    gather = _HostGather.build(kv_indices, HostReads(dev, rows, layer_kv), SLOTS)
    if not set(loading) & set(kv):
        assert gather is None
        return
    assert gather is not None
    k, v = gather.gather(0, device[0], device[1], kv_indices)
    assert torch.equal(k, landed[0][kv_indices])
    assert torch.equal(v, landed[1][kv_indices])
