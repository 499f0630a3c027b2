"""Deterministic inference through a whole model under TRITON_INTERPRET=1 (float32): with the
batch-invariant ops installed and the triton backend's fixed-split kernels, a token's logits
are the same bits alone, in a batch, after a cached prefix, in chunked prefills, at decode, and
in the CUDA-graph runner's padded decode batch. Also: the option, its flag, and that on CPU it
changes nothing.

NOTE: the engine runs this path on CUDA only (on CPU the flag changes nothing); here it is
installed by hand so the interpreter checks the ops and their wiring; tests/gpu runs the
engine's own. TRITON_INTERPRET is set and the kernel modules reloaded
(tests/triton_interpreter.py).
"""

from __future__ import annotations

import argparse

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
from tests.triton_interpreter import interpreted

interpreted(
    "engine.runtime.layers.batch_invariant",
    "engine.runtime.layers.attention.triton_fixed_split",
)

from engine.config import ServerArgs
from engine.runtime import deterministic
from engine.runtime.cuda_graph_runner import CudaGraphRunner
from engine.runtime.layers import Linear, RMSNorm
from engine.runtime.layers.attention import create_backend
from engine.runtime.model_runner import ModelRunner
from engine.server import settings
from tests.runner_worlds import RunnerWorld, assert_same_logits
from tests.tiny_models import make_tiny_model_dir

LENS = {"p": 45, "q": 30, "r": 20}  # prompt tokens; each request then decodes DECODE_STEPS
DECODE_STEPS = 3


def _args(path: str, **kw) -> ServerArgs:
    return ServerArgs(
        model_path=path, max_running_requests=4, max_total_tokens=512, context_length=128, **kw
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # one layer: the interpreter runs every kernel program in Python
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("det") / "m"), num_hidden_layers=1)


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    runner = ModelRunner(_args(model_dir, attention_backend="triton", linear_backend="torch"))
    runner.deterministic = True  # what enabled() answers on CUDA
    # the layer's 4 linears and 2 norms, the final norm, lm_head
    assert deterministic.install(runner.model) == 6 + 2
    runner.attn_backend = create_backend("triton", runner)
    runner.attn_backend.split_size = 32  # NOTE: shrunk from 256 so the prompts span chunks
    return runner


@pytest.fixture(scope="module")
def tokens(runner) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        rid: torch.randint(3, runner.vocab_size, (n + DECODE_STEPS,), generator=gen).tolist()
        for rid, n in LENS.items()
    }


@pytest.fixture(scope="module")
def alone(runner, tokens) -> RunnerWorld:
    """Each request's prompt and decode inputs in one extend, alone: the reference."""
    world = RunnerWorld(runner, tokens)
    for rid, toks in tokens.items():
        world.extend([(rid, len(toks))])
    return world


def test_logits_do_not_depend_on_batch_prefix_chunks_or_decode(runner, tokens, alone):
    batched = RunnerWorld(runner, tokens)
    batched.extend([("q", 30), ("p", 45), ("r", 20)])
    batched.decode(["p", "q", "r"], DECODE_STEPS)
    prefixed = RunnerWorld(runner, tokens)  # p's first 24 tokens are a prefix hit later
    prefixed.extend([("p", 24)])
    prefixed.extend([("r", 20), ("p", 21)])
    prefixed.decode(["p"], DECODE_STEPS)
    chunked = RunnerWorld(runner, tokens)  # chunk edges off the attention chunks' (32)
    chunked.extend([("p", 10), ("q", 7)])
    chunked.extend([("q", 23), ("p", 17), ("r", 20)])
    chunked.extend([("p", 18)])
    prompts = sum(LENS.values())
    compared = assert_same_logits(alone, [batched, prefixed, chunked])
    assert compared == (prompts + 3 * DECODE_STEPS) + (45 + 20 + DECODE_STEPS) + prompts


def test_padded_graph_decode_equals_a_prefill(runner, tokens, alone):
    cg = CudaGraphRunner(runner, capture=False)  # the graph runner's static, padded batches
    assert cg.padded_batch_size(3) == 4
    world = RunnerWorld(runner, tokens)
    world.extend([(rid, n) for rid, n in LENS.items()])
    runner.cuda_graph_runner = cg
    try:
        world.decode(["p", "q", "r"], DECODE_STEPS)
    finally:
        runner.cuda_graph_runner = None
    assert_same_logits(alone, [world])


def test_on_cpu_the_flag_changes_nothing(model_dir):
    runner = ModelRunner(_args(model_dir, enable_deterministic_inference=True))
    plain = ModelRunner(_args(model_dir))
    assert runner.deterministic is False and runner.model_info()["deterministic_inference"] is False
    assert type(runner.attn_backend) is type(plain.attn_backend)
    assert not getattr(runner.attn_backend, "deterministic", False)
    assert runner.sampler.row_ops is None
    modules = list(runner.model.modules())
    assert all(m.matmul is None for m in modules if isinstance(m, Linear))
    assert all(m.invariant is None for m in modules if isinstance(m, RMSNorm))


def test_enabled_only_on_cuda_and_its_attention_backends():
    on = ServerArgs(enable_deterministic_inference=True)
    assert deterministic.enabled(on, torch.device("cuda"))
    assert not deterministic.enabled(on, torch.device("cpu"))
    assert not deterministic.enabled(ServerArgs(), torch.device("cuda"))
    assert deterministic.attention_backend(None) == "triton"
    assert deterministic.attention_backend("flashinfer") == "flashinfer"
    with pytest.raises(ValueError, match="fixed KV split"):
        deterministic.attention_backend("torch_native")


def test_option_flag_and_env():
    assert ServerArgs().enable_deterministic_inference is False
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    _, args = settings.load(parser.parse_args(["--enable-deterministic-inference"]), {})
    assert args.enable_deterministic_inference is True
    _, args = settings.load(parser.parse_args([]), {"HICACHE_ENABLE_DETERMINISTIC_INFERENCE": "1"})
    assert args.enable_deterministic_inference is True
    _, args = settings.load(parser.parse_args([]), {})
    assert args.enable_deterministic_inference is False
