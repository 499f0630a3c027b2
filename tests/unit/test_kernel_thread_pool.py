"""The C kernels' thread pool (csrc/thread_pool.h): a product's result does not depend on how many
threads ran it or which Python threads called at once (jobs queue, none is lost or mixed up), and a
forked child, which has no workers, still runs kernels."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading

import pytest
import torch

from engine.runtime.layers import cpu_kernels
from engine.runtime.layers.quant import QuantLinear

LIB = cpu_kernels.KERNELS.get()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}")


def _product(layer: QuantLinear, x: torch.Tensor, nthreads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], layer.out_features)
    assert (
        LIB.linear_packed(
            ctypes.byref(layer.panels.desc), x.data_ptr(), x.shape[0], y.data_ptr(), nthreads
        )
        == 0
    )
    return y


@pytest.fixture(scope="module")
def layer() -> QuantLinear:
    g = torch.Generator().manual_seed(0)
    return QuantLinear(torch.randn(301, 256, generator=g), None, "q4_1")  # 301: uneven shares


@pytest.mark.parametrize("nthreads", [2, 3, 8])
def test_result_is_the_same_on_any_thread_count(layer, nthreads):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_product(layer, x, nthreads), _product(layer, x, 1))


def test_concurrent_callers_each_get_their_own_result(layer):
    xs = [torch.randn(3, 256, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    want = [_product(layer, x, 1) for x in xs]
    got: dict[tuple[int, int], torch.Tensor] = {}

    def caller(i: int) -> None:
        for rep in range(40):
            got[i, rep] = _product(layer, xs[i], 2 + i % 3)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert len(got) == len(xs) * 40
    for (i, _), y in got.items():
        assert torch.equal(y, want[i])


def test_a_forked_child_runs_kernels(layer):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    want = _product(layer, x, 2)  # the parent's workers exist now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no workers were forked with it
        ok = torch.equal(_product(layer, x, 2), want)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    # without its reset the child would wait forever for workers it does not have
    ready, _, _ = select.select([r], [], [], 60)
    answer = os.read(r, 1) if ready else b""
    os.close(r)
    if not answer:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert answer == b"1" and status == 0, "the forked child hung or got a wrong product"


def test_no_more_threads_than_cpus(layer):
    """Asking for 64 threads on a machine with fewer CPUs starts no more workers than CPUs - 1
    (extra ones would only spin against each other); the result is the same."""
    cpus = len(os.sched_getaffinity(0))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    before = len(os.listdir("/proc/self/task"))
    y = _product(layer, x, 64)
    after = len(os.listdir("/proc/self/task"))
    assert after - before <= max(0, cpus - 1)
    assert torch.equal(y, _product(layer, x, 1))
