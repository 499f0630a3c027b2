"""The fused CPU decode stack (engine/runtime/models/llama_cpu_decode.py): installed where it
can run, and a decode step through it equals the per-module path bit for bit (logits and the
KV it writes), on ragged batches at scattered slots; it steps aside where it cannot run."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers import cpu_kernels
from tests.tiny_models import make_tiny_model_dir

needs_kernels = pytest.mark.skipif(
    cpu_kernels.KERNELS.get() is None, reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}"
)


def _decode_step(runner, seq_lens: list[int], seed: int):
    """A DECODE batch whose request b has seq_lens[b] - 1 tokens of random KV at shuffled
    slots; returns ``step(fused) -> (logits, k of layer 0 at the new slots)``."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.allocator.alloc(sum(seq_lens))
    slots = slots[torch.randperm(len(slots), generator=g)]
    start, out_loc = 0, []
    for row, n in zip(rows, seq_lens, strict=True):
        runner.req_to_token_pool.req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
        out_loc.append(int(slots[start + n - 1]))
        start += n
    pool = runner.kv_pool
    for layer in range(runner.num_layers):
        k, v = pool.get_kv_buffer(layer)
        k[slots] = torch.randn(k[slots].shape, generator=g)
        v[slots] = torch.randn(v[slots].shape, generator=g)
    ids = torch.randint(10, 200, (bs,), generator=g)
    stack = runner.model.model
    fused = stack.fused_decode

    def step(use_fused: bool):
        stack.fused_decode = fused if use_fused else None
        try:
            fb = ForwardBatch(
                ForwardMode.DECODE,
                bs,
                ids,
                torch.tensor(seq_lens) - 1,
                torch.tensor(out_loc),
                torch.tensor(rows),
                torch.tensor(seq_lens),
                None,
                None,
                list(seq_lens),
                None,
                None,
                runner.req_to_token_pool,
                pool,
                runner.attn_backend,
            )
            with torch.inference_mode():
                logits = runner.forward(fb).clone()
            return logits, pool.get_kv_buffer(0)[0][torch.tensor(out_loc)].clone()
        finally:
            stack.fused_decode = fused

    return step


@needs_kernels
@pytest.mark.parametrize(
    "arch,quantization",
    [("llama", "int4"), ("qwen2", "int4"), ("llama", "int8"), ("llama", "none")],
)
@pytest.mark.parametrize("seq_lens", [[1], [7], [300, 2, 41], [5] * 16, [3, 600] * 12])
def test_fused_decode_equals_the_module_path(tmp_path_factory, arch, quantization, seq_lens):
    path = make_tiny_model_dir(str(tmp_path_factory.mktemp(arch) / "m"), arch)
    with Engine(path, quantization=quantization, max_total_tokens=16384) as eng:
        assert eng.model_info()["fused_decode"] is True

        def run(s):
            step = _decode_step(s.runner, seq_lens, seed=len(seq_lens))
            module = step(False)
            fused = step(True)  # rewrites the same new-token slots
            return module, fused

        (ref, ref_k), (out, out_k) = eng.call_in_scheduler(run)
    assert torch.equal(out, ref)
    assert torch.equal(out_k, ref_k)  # the new token's K went to the same place


@needs_kernels
def test_fused_decode_generates_what_the_module_path_generates(tiny_llama_dir):
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 9, [40, 41]]
    runs = []
    for use_fused in (True, False):
        with Engine(
            tiny_llama_dir, quantization="int4", max_total_tokens=2048, debug_check_invariants=True
        ) as eng:
            if not use_fused:
                eng.call_in_scheduler(lambda s: setattr(s.runner.model.model, "fused_decode", None))
            runs.append([o.token_ids for o in eng.generate(prompts, sp)])
    assert runs[0] == runs[1]


@needs_kernels
def test_fused_decode_is_not_installed_where_it_cannot_run(tmp_path_factory, tiny_llama_dir):
    qwen3 = make_tiny_model_dir(str(tmp_path_factory.mktemp("qwen3") / "m"), "qwen3")
    for path, kwargs in [
        (qwen3, {"quantization": "int4"}),  # q/k norms before RoPE
        (
            tiny_llama_dir,
            {
                "quantization": "none",  # not on packed panels
                "linear_backend": "onednn",
            },
        ),
        (tiny_llama_dir, {"quantization": "int4", "attention_backend": "torch_native"}),
    ]:
        with Engine(path, max_total_tokens=1024, **kwargs) as eng:
            assert eng.model_info()["fused_decode"] is False
            out = eng.generate(
                [5, 6, 7], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
            )
            assert len(out.token_ids) == 4


@needs_kernels
def test_fused_decode_refuses_a_released_pool(tiny_llama_dir):
    with Engine(tiny_llama_dir, quantization="int4", max_total_tokens=1024) as eng:

        def run(s):
            step = _decode_step(s.runner, [3], seed=0)
            s.runner.kv_pool.k_buffer, saved = [], s.runner.kv_pool.k_buffer
            try:
                with pytest.raises(RuntimeError, match="released"):
                    step(True)
            finally:
                s.runner.kv_pool.k_buffer = saved
            return True

        assert eng.call_in_scheduler(run)
