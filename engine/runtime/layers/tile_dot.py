"""``tile_dot``: the tile product of the deterministic Triton kernels (``batch_invariant.linear``,
``attention/triton_fixed_split``). Their batch invariance rests on one property of it: a row's
dot products depend on that row and the other operand only, never on the tile's other rows nor
on the row's place among them.

On a GPU ``tile_dot`` is ``tl.dot``: a tensor-core MMA computes each output from its own row and
column in a fixed order (tests/gpu/test_deterministic_gpu.py checks it on the device).

Under ``TRITON_INTERPRET=1`` (the CPU tests) ``tl.dot`` would be numpy's ``matmul``, i.e. the host
BLAS's sgemm, which lacks the property: OpenBLAS's AVX2 kernels (Haswell, Zen) compute rows 0-5
and 6-11 of each 12-row panel with different instruction sequences, a tile's tail rows with edge
kernels and a 1-row product with gemv, so a row's bits change with its place in the tile (its
AVX-512 and SSE kernels happen not to). So the interpreter gets the product as its definition:
the exact float32 products of ``a[m, k] * b[k, n]`` summed over k by ``tl.reduce`` (numpy's
``add.reduce`` along k, the same computation for every row). What the CPU tests then check bit
for bit is the kernels' own structure — tiles, masks, the order of k blocks, key chunks and
merges — which is where a batch-dependent order would come from.

NOTE: the interpreter is chosen when triton decorates a kernel (this module's import): tests set
``TRITON_INTERPRET`` and reload this module before the kernel modules (tests/triton_interpreter.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_SUM = tl.standard._sum_combine  # NOTE: tl.sum is a @jit of triton's import (batch_invariant.py)


@triton.jit
def _probe():
    pass


INTERPRETED: bool = isinstance(_probe, InterpretedFunction)
_PER_ROW: tl.constexpr = tl.constexpr(INTERPRETED)


@triton.jit
def tile_dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b``: a [BLOCK_M, K], b [K, BLOCK_N], acc [BLOCK_M, BLOCK_N] float32."""
    if _PER_ROW:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [BLOCK_M, K, BLOCK_N]
        return acc + tl.reduce(prod, 1, _SUM)
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
