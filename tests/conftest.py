"""Shared fixtures: `tiny_llama_dir`, a tiny random Llama with an offline-trained tokenizer, and
a temporary XDG_CACHE_HOME so that no test (nor a `hicache serve` it spawns, which inherits the
environment) writes L3 pages into the real user cache."""

from __future__ import annotations

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
