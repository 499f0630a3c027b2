"""Shared fixtures: `tiny_llama_dir`, a tiny random Llama with an offline-trained tokenizer."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An HF directory (config, safetensors, tokenizer with a chat template); no downloads."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama") / "m"), "llama")
