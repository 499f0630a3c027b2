"""``load_format="dummy"``: a model from config.json alone with seeded random weights (benchmarks
of model shapes without a checkpoint, e.g. a Llama-3-8B-shaped model)."""

from __future__ import annotations

import json
import os

import pytest

from engine import Engine
from engine.runtime.models.loader import load_model
from tests.tiny_models import make_config


def _config_only_dir(path, arch: str = "llama") -> str:
    os.makedirs(path, exist_ok=True)
    cfg = make_config(arch, 400)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dummy_weights_serve_and_are_seeded(tmp_path, arch):
    path = _config_only_dir(tmp_path / "cfg", arch)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path, "cpu")  # auto needs a checkpoint
    model, _, _ = load_model(path, "cpu", load_format="dummy", seed=3)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            assert 0.01 < float(p.std()) < 0.03, name  # initialised, not torch.empty garbage
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = []
    for _ in range(2):
        with Engine(path, load_format="dummy", random_seed=3, max_total_tokens=512) as eng:
            outs.append(eng.generate([5, 6, 7, 8, 9], sp).token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 6  # same seed, same weights, same tokens


def test_load_format_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown load_format"):
        Engine(str(tmp_path), load_format="pt")
    with pytest.raises(ValueError, match="unknown load_format"):
        load_model(str(tmp_path), "cpu", load_format="npz")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), "cpu", load_format="dummy")


def test_model_without_tokenizer_serves_token_ids(tmp_path):
    path = _config_only_dir(tmp_path / "cfg")
    with Engine(path, load_format="dummy", max_total_tokens=512) as eng:
        with pytest.raises(ValueError, match="no tokenizer"):
            eng.generate("hello", {"max_new_tokens": 3})
        with pytest.raises(ValueError, match="no tokenizer"):
            eng.generate([{"role": "user", "content": "hi"}], {"max_new_tokens": 3})
        out = eng.generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})
        assert len(out.token_ids) == 3 and out.text == "" and out.finish_reason == "length"
