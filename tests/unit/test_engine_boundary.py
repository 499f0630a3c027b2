"""The engine boundary (engine/front.py): both engines implement all of EngineFront with its
signatures, its named operations are written once for both, and neither the boundary nor the
API server's modules load torch or the runtime
(tests/e2e/test_daemon_process.py checks the running API server process)."""

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
    return {
        name: inspect.signature(fn)
        for name, fn in vars(EngineFront).items()
        if callable(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize("engine_cls", [Engine, SplitEngine])
def test_engines_implement_every_declared_method(engine_cls):
    # NOTE: what instantiating them checks (an ABC with an abstract method left refuses)
    assert not inspect.isabstract(engine_cls), engine_cls.__abstractmethods__
    # what differs between the engines: requests, how an operation travels, the event log
    assert EngineFront.__abstractmethods__ == {"submit", "abort", "call", "event_log", "shutdown"}
    for name, declared in _declared().items():
        got = inspect.signature(getattr(engine_cls, name))
        # callers pass arguments by name: the same names, in the same order, same defaults
        assert [(p.name, p.default) for p in got.parameters.values()] == [
            (p.name, p.default) for p in declared.parameters.values()
        ], (engine_cls, name)


@pytest.mark.parametrize("engine_cls", [Engine, SplitEngine])
def test_named_operations_are_written_once(engine_cls):
    """Every admin method is EngineFront's own: `call` of one operation, the same code for
    both engines (engine/operations.py); neither engine spells one out again."""
    for name in (
        "cache_stats",
        "model_info",
        "kv_block_changes",
        "match_prefix",
        "evict",
        "pin",
        "unpin",
        "pin_summary",
        "flush",
        "flush_namespaces",
        "inspect_tree",
        "apply_quotas",
        "tenant_view",
        "tenant_figures",
        "storage_info",
        "attach_storage",
        "detach_storage",
    ):
        assert getattr(engine_cls, name) is getattr(EngineFront, name), (engine_cls, name)


def _loaded_after(code: str) -> set[str]:
    """The modules of interest a fresh interpreter has loaded after running `code`."""
    probe = (
        f"import sys\n{code}\n"
        "print(' '.join(m for m in sys.modules if m == 'torch' "
        "or m.startswith(('engine.runtime', 'torch.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(out.stdout.split())


def test_the_boundary_loads_neither_torch_nor_the_runtime():
    assert (
        _loaded_after(
            "import engine.front, engine.admin_records, engine.operations, "
            "engine.sampling_params, engine.ipc.messages, engine.ipc.transport, "
            "engine.tokenizer, engine.server.split_engine"
        )
        == set()
    )


def test_the_api_server_loads_neither_torch_nor_the_runtime():
    """What the split daemon's API server process imports: the daemon, every servicer, the
    HTTP API, the settings; the runtime only ever in the scheduler process."""
    assert (
        _loaded_after(
            "import engine.server.app, engine.server.settings, "
            "engine.server.split_engine\n"
            "from engine.server.settings import load\n"
            "load(env={})"
        )
        == set()
    )


def test_the_probe_sees_torch_when_it_is_loaded():
    assert {"torch", "engine.runtime"} <= _loaded_after("import engine.runtime.engine")
