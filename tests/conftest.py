"""Shared fixtures: `tiny_llama_dir`, a tiny random Llama with an offline-trained tokenizer, and
a temporary XDG_CACHE_HOME so that no test (nor a `hicache serve` it spawns, which inherits the
environment) writes L3 pages into the real user cache."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session", autouse=True)
def _tmp_xdg_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """NOTE: the daemon's default L3 dir is $XDG_CACHE_HOME/hicache/kv; the model cache
    (HICACHE_MODEL_CACHE, ~/.cache/hicache/models) does not follow XDG_CACHE_HOME and stays."""
    with pytest.MonkeyPatch.context() as mp:
        path = str(tmp_path_factory.mktemp("xdg_cache"))
        mp.setenv("XDG_CACHE_HOME", path)
        yield path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An HF directory (config, safetensors, tokenizer with a chat template); no downloads."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama") / "m"), "llama")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The machine the suite ran on, so a red run on a new kind of VM says so at once: the CPU,
    the SIMD flags that choose the C kernels' build, and that build (the first line of pytest's
    output)."""
    from engine.runtime.layers import cpu_kernels
    from tools.benchlib.header import cpu_info

    model, flags = cpu_info()
    forced = os.environ.get("HICACHE_CPU_ISA")
    return [
        f"cpu: {model}; simd: {' '.join(flags) or 'none'}",
        f"cpu kernels: {cpu_kernels.build_description()}"
        + (f" (HICACHE_CPU_ISA={forced})" if forced else ""),
    ]
