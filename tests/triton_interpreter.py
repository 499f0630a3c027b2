"""Triton kernel modules under ``TRITON_INTERPRET=1``, for the CPU tests.

Triton chooses the interpreter when it decorates a kernel, i.e. at the kernel module's import,
and a process may have imported the module before (another test module, the engine): so the
environment variable is set and the modules reloaded, ``tile_dot`` first since the
deterministic kernels call it (a kernel decorated for the GPU does not run in the interpreter).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

_TILE_DOT = "engine.runtime.layers.tile_dot"


def interpreted(*names: str) -> list[ModuleType]:
    """The modules ``names`` (re)imported with their kernels interpreted, in order."""
    os.environ["TRITON_INTERPRET"] = "1"
    modules = []
    for name in (_TILE_DOT, *names):
        module = sys.modules.get(name)
        modules.append(importlib.reload(module) if module else importlib.import_module(name))
    return modules[1:]
