"""The engine boundary (engine/front.py): both engines implement all of EngineFront with its
signatures, and the boundary module loads neither torch nor the runtime."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from engine.front import EngineFront
from engine.runtime.engine import Engine
from engine.server.split_engine import SplitEngine

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, inspect.Signature]:
    """EngineFront's public methods and their signatures."""
    return {name: inspect.signature(fn) for name, fn in vars(EngineFront).items()
            if callable(fn) and not name.startswith("_")}


@pytest.mark.parametrize("engine_cls", [Engine, SplitEngine])
def test_engines_implement_every_declared_method(engine_cls):
    # NOTE: what instantiating them checks (an ABC with an abstract method left refuses)
    assert not inspect.isabstract(engine_cls), engine_cls.__abstractmethods__
    assert EngineFront.__abstractmethods__ >= {"submit", "abort", "match_prefix", "flush",
                                                "kv_block_changes", "shutdown"}
    for name, declared in _declared().items():
        got = inspect.signature(getattr(engine_cls, name))
        # callers pass arguments by name: the same names, in the same order, same defaults
        assert [(p.name, p.default) for p in got.parameters.values()] == [
            (p.name, p.default) for p in declared.parameters.values()], (engine_cls, name)


def _loaded_after(code: str) -> set[str]:
    """The modules of interest a fresh interpreter has loaded after running `code`."""
    probe = (f"import sys\n{code}\n"
             "print(' '.join(m for m in sys.modules if m == 'torch' "
             "or m.startswith(('engine.runtime', 'torch.'))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_boundary_loads_neither_torch_nor_the_runtime():
    assert _loaded_after("import engine.front, engine.admin_records, engine.ipc, "
                         "engine.tokenizer, engine.server.split_engine") == set()
