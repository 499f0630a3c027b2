"""Value codec shared by the L3 backends: a StorageValue as a payload view plus its layout,
the payload's xxh3-64 checksum, and the checks a stored payload must pass to be returned.

Each backend keeps its own framing (the file backend's binary header, the redis backend's JSON
metadata); this module owns what both frame: which values can be stored, how a value becomes
bytes without a copy, and when bytes read back are a value again. A check that fails raises
``Corrupt``: the caller counts the object corrupt and never returns it.

    encode(value) -> Encoded(is_tensor, dtype, shape, payload)     payload: a view, no copy
    checksum(payload)                                              xxh3-64 (~25 GB/s)
    tensor_dtype(dtype, shape, nbytes)                             the dtype, or Corrupt
    decode(is_tensor, dtype, shape, data, nbytes, checksum)        the value, or Corrupt
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from xxhash import xxh3_64_intdigest

from hicache.storage.base import StorageValue


class Corrupt(Exception):
    """Stored bytes that must not be returned (bad framing, length, layout or checksum)."""


class Encoded(NamedTuple):
    """A value ready to store: its layout and a view of its bytes (the view keeps a tensor's
    storage alive)."""

    is_tensor: bool  # False: bytes, stored as a flat uint8 payload
    dtype: str  # torch dtype name without "torch." ("uint8" for bytes)
    shape: tuple[int, ...]
    payload: memoryview  # format "B", payload.nbytes bytes


def encode(value: StorageValue) -> Encoded:
    """The layout and a payload view of ``value`` (no copy of a contiguous CPU tensor; a device
    or strided tensor is copied once). Raises TypeError for what cannot be stored."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        payload = memoryview(value).cast("B")
        return Encoded(False, "uint8", (payload.nbytes,), payload)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        # viewed as uint8 first: numpy has no bfloat16; the view keeps ``t`` alive
        return Encoded(
            True,
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            t.reshape(-1).view(torch.uint8).numpy().data,
        )
    raise TypeError(f"cannot store a {type(value).__name__}")


def checksum(payload: bytes | memoryview) -> int:
    """The checksum both backends record: xxh3-64 of the payload."""
    return xxh3_64_intdigest(payload)


def tensor_dtype(dtype: str, shape: tuple[int, ...], nbytes: int) -> torch.dtype:
    """The torch dtype named ``dtype``, when ``shape`` of it takes exactly ``nbytes``."""
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise Corrupt(f"unknown dtype {dtype}")
    if math.prod(shape) * resolved.itemsize != nbytes:
        raise Corrupt("shape and length disagree")
    return resolved


def decode(
    is_tensor: bool,
    dtype: str,
    shape: tuple[int, ...],
    data: bytes,
    nbytes: int,
    expected_checksum: int,
) -> StorageValue:
    """The value of ``data`` read back, checked against the recorded length, checksum and
    layout; a tensor shares ``data``'s memory (read-only: copy before writing)."""
    if len(data) != nbytes:
        raise Corrupt(f"{len(data)} payload bytes, metadata says {nbytes}")
    if checksum(data) != expected_checksum:
        raise Corrupt("checksum mismatch")
    if not is_tensor:
        return data
    resolved = tensor_dtype(dtype, shape, nbytes)
    if nbytes == 0:
        return torch.empty(shape, dtype=resolved)
    return _frombuffer(data, resolved).reshape(shape)


_frombuffer_quiet = False


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``data`` (no copy). torch warns that such a buffer is not writable, once
    per process (a C++ once-flag): our values are read-only by contract (the caller copies them
    into the host pool), so the first call silences it; later calls cannot warn."""
    global _frombuffer_quiet
    if _frombuffer_quiet:
        return torch.frombuffer(data, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        t = torch.frombuffer(data, dtype=dtype)
    _frombuffer_quiet = True
    return t
