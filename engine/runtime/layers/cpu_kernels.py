"""The engine's C kernels for CPU serving (``csrc/``): the matrix products on packed weights
(``packed.PackedWeight``: q4_1, q8_0 and float32, every row count one numeric path), attention
over the paged KV pool for prefill, extend and decode alike (``attention/cpu_backend.py``),
fused residual + RMSNorm, RoPE in place, SiLU x up, and a Llama decode stack in one call
(``models/llama_cpu_decode.py``). Each computes a token row's values with a fixed sequence of
roundings whatever the batch around it (``csrc/common.h``): the CPU path is batch-invariant.

Built on first use with the system C compiler (``gcc -O3 -mavx2 -mfma -pthread``) into
``~/.cache/hicache/kernels/`` (or ``$HICACHE_KERNEL_CACHE``), keyed by the sources' hash, and
loaded with ctypes (calls release the GIL). The kernels run on their own thread pool
(``csrc/thread_pool.h``: why not OpenMP is said there), with the thread count passed per call
(``torch.get_num_threads()``). Without a compiler or AVX2
(or with ``HICACHE_NO_CPU_KERNEL=1``) ``KERNELS.get()`` is None and callers use torch ops,
which are not batch-invariant (the engine logs a warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-ffp-contract=off", "-shared", "-fPIC"]
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class PackedLinearC(ctypes.Structure):
    """``PackedLinear`` of csrc/products.h."""

    _fields_ = [("kind", ctypes.c_int32), ("w", _P), ("bias", _P), ("n", _I64), ("k", _I64)]


class AttnBatchC(ctypes.Structure):
    """``AttnBatch`` of csrc/attention.h."""

    _fields_ = [
        ("q", _P),
        ("q_stride", _I64),
        ("out", _P),
        ("k", _P),
        ("v", _P),
        ("hk", _P),
        ("hv", _P),
        ("h_stride", _I64),
        ("host_row", _P),
        ("req_to_token", _P),
        ("r2t_stride", _I64),
        ("rows", _P),
        ("q_first", _P),
        ("q_len", _P),
        ("kv_len", _P),
        ("bs", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("hd", _I64),
        ("scale", _F32),
    ]


_SIGNATURES: dict[str, tuple[list, type | None]] = {
    "linear_packed": ([_P, _P, _I64, _P, _I32], _I32),
    "rms_norm_residual": ([_P, _P, _P, _F32, _I64, _I64, _P, _P, _I32], None),
    "rope_neox_inplace": ([_P, _I64, _I64, _I64, _I64, _P, _P, _I32], None),
    "silu_mul": ([_P, _I64, _I64, _P, _I32], None),
    "attention": ([_P, _I32], _I32),
    "decode_layers": ([_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I32], _I32),
}


class _Kernels:
    """The compiled library (ctypes), built once per process; ``error`` says why it is not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        if self._tried:  # NOTE: the hot path; set once under the lock
            return self._lib
        with self._lock:
            if not self._tried:
                try:
                    self._lib = _load(_build())
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    self.error = str(exc)
                    log.warning("CPU kernels unavailable (%s); using torch ops", exc)
                self._tried = True
            return self._lib


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


ISAS = ("avx2", "avx-vnni", "avx512-vnni")
_ISA_CPU_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx-vnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx512-vnni": {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl", "avx512bw"},
}


def supported_isas() -> list[str]:
    """The builds this CPU can run, plainest first."""
    flags = cpu_flags()
    return [name for name in ISAS if _ISA_CPU_FLAGS[name] <= flags]


def isa() -> str:
    """The instruction set the kernels are built for: ``avx512-vnni`` where the CPU has
    AVX512-VNNI + VL + BW (the u8 x s8 dot in one instruction, and 32 vector registers for the
    products' tiles; still 256-bit vectors), else ``avx-vnni`` (the same dot, VEX form), else
    ``avx2``. Every build gives the same bits (``csrc/common.h``; tests/unit/test_cpu_isa_bits.py
    checks it across builds and machines); ``HICACHE_CPU_ISA=<one of ISAS>`` forces one (a build
    the CPU cannot run is refused when the kernels load)."""
    forced = os.environ.get("HICACHE_CPU_ISA")
    if forced:
        if forced not in ISAS:
            raise RuntimeError(f"HICACHE_CPU_ISA={forced!r}: expected one of {list(ISAS)}")
        return forced
    supported = supported_isas()
    return supported[-1] if supported else "avx2"


# NOTE: 256-bit vectors as with AVX2 (the kernels are written for them; no zmm frequency drop)
_ISA_FLAGS = {
    "avx-vnni": ["-mavxvnni"],
    "avx512-vnni": [
        "-mavx512f",
        "-mavx512vl",
        "-mavx512bw",
        "-mavx512vnni",
        "-mprefer-vector-width=256",
    ],
    "avx2": [],
}


def _cflags() -> list[str]:
    return _CFLAGS + _ISA_FLAGS[isa()]


def cached_path() -> Path:
    """Where the build for these sources and flags is kept: ``$HICACHE_KERNEL_CACHE`` (else
    ``~/.cache/hicache``) ``/kernels/cpu_kernels-<hash of sources + flags>.so``."""
    sources = b"".join(p.read_bytes() for p in sorted(_SOURCE.parent.glob("*.[ch]")))
    digest = hashlib.sha256(sources + " ".join(_cflags()).encode()).hexdigest()[:16]
    root = Path(os.environ.get("HICACHE_KERNEL_CACHE") or Path.home() / ".cache" / "hicache")
    return root / "kernels" / f"cpu_kernels-{digest}.so"


def _build() -> Path:
    """Compile the source once per sources + flags into the user cache (atomic rename).
    NOTE: a cached build needs no compiler: the daemon image compiles at build time and ships
    without one (docker/Dockerfile)."""
    if os.environ.get("HICACHE_NO_CPU_KERNEL"):
        raise RuntimeError("HICACHE_NO_CPU_KERNEL is set")
    name = isa()
    if name not in supported_isas():
        missing = sorted(_ISA_CPU_FLAGS[name] - cpu_flags())
        raise RuntimeError(f"the CPU lacks {', '.join(missing)} for the {name} build")
    target = cached_path()
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    flags = _cflags()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, "-o", tmp, str(_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (args, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, restype
    return lib


KERNELS = _Kernels()


def kernel_status() -> str:
    """``"c (<isa>)"`` when the compiled kernels are in use, else ``"torch (<why>)"``."""
    return f"c ({isa()})" if KERNELS.get() is not None else f"torch ({KERNELS.error})"


def build_description() -> str:
    """What runs and which build: ``"c (avx2) cpu_kernels-<hash>.so"``, or ``"torch (<why>)"``."""
    if KERNELS.get() is None:
        return kernel_status()
    return f"{kernel_status()} {cached_path().name}"


def threads() -> int:
    return torch.get_num_threads()


def enable_cpu_kernels(model: torch.nn.Module, max_context_len: int) -> list[str]:
    """Route the model's modules that have a ``kernel`` hook (RMSNorm, RoPE, the MLP's SiLU)
    through the C kernels; returns the names of those left on torch ops (and why)."""
    from engine.runtime.layers.norm import RMSNorm
    from engine.runtime.layers.rotary import RotaryEmbedding

    lib = KERNELS.get()
    left = []
    for name, module in model.named_modules():
        if not hasattr(module, "kernel"):
            continue
        if isinstance(module, RMSNorm) and module.weight.dtype != torch.float32:
            left.append(f"{name} ({module.weight.dtype} weight)")
            continue
        # NOTE: the RoPE kernel does not bound-check positions: only when its cache covers all
        if isinstance(module, RotaryEmbedding) and module.max_position < max_context_len:
            left.append(f"{name} (positions past {module.max_position})")
            continue
        module.kernel = lib
    return left
