"""Deterministic inference (``enable_deterministic_inference``; SGLang's
``--enable-deterministic-inference``): a prompt's tokens do not depend on which requests shared
its forwards, nor on whether its prefix was computed now or came from the cache.

The CPU path has this property always (its kernels fix their reduction order by the row, never
by the batch), so there the flag changes nothing. On CUDA, where torch's kernels pick their
reduction order by the batch's shape, the flag takes:

- every Linear (the logits projection included) through ``batch_invariant.linear`` and every
  RMSNorm through ``batch_invariant.rms_norm`` (``install``);
- attention with fixed KV split sizes: ``triton`` (the default under the flag) runs its
  fixed-split kernels, with which a token's output is the same bits in a prefill, after a
  prefix hit and at decode; ``flashinfer`` plans with fixed splits (flashinfer >= 0.4.0), meant
  to keep its rows batch-invariant, but it runs prefill and decode on different kernels and
  picks its query tile by the batch (flashinfer issue #2424): triton is built for the whole
  property;
- the sampler's softmax and top-p running sum one row per program, its sort stable.

The model runner calls ``enabled``, ``install``, ``attention_backend``; the attention backends
read the runner's resolved ``deterministic`` themselves (``attention.deterministic_of``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ServerArgs
from engine.runtime.layers.linear import Linear
from engine.runtime.layers.norm import RMSNorm

ATTENTION_BACKENDS = ("triton", "flashinfer")  # the ones with a fixed-split mode


def enabled(args: ServerArgs, device: torch.device) -> bool:
    """Whether the forward runs the deterministic path: the flag, on CUDA."""
    return args.enable_deterministic_inference and device.type == "cuda"


def attention_backend(requested: str | None) -> str:
    """The attention backend under the flag: ``requested``, or triton when none was asked for."""
    if requested is None:
        return "triton"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"enable_deterministic_inference needs an attention backend with fixed KV split "
            f"sizes: one of {ATTENTION_BACKENDS} (triton: every property), got {requested!r}"
        )
    return requested


def install(model: nn.Module) -> int:
    """Routes every Linear and RMSNorm of ``model`` through the batch-invariant ops; returns
    how many modules it routed."""
    from engine.runtime.layers import batch_invariant  # Triton: imported only when used

    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.matmul = batch_invariant.linear
            count += 1
        elif isinstance(module, RMSNorm):
            module.invariant = batch_invariant.rms_norm
            count += 1
    return count
