"""In-process CPU decode step time: the model runner alone (no scheduler, no processes), on the
embedded model, per batch size and context length, for the fused decode stack (one C call per
step), the per-module path (same kernels, Python per layer) and optionally the dense reference.

    python tools/bench_cpu_decode.py [--batch 1,4,16] [--context 100,1000] [--steps 30]
        [--dense] [--out docs/bench_cpu_decode.json]

Each configuration fills its context with module-path steps first, checks that one fused step's
logits equal the module step's, then times ``--steps`` steps of each path alternately (twice, the
faster pass counts: this VM's speed drifts). Threads: torch's default (all cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# run as a script (python tools/bench_cpu_decode.py): the repo root is not on sys.path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine.config import ServerArgs
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.model_runner import ModelRunner
from tools.bench_serving import machine


def measure(runner: ModelRunner, bs: int, ctx: int, steps: int) -> dict[str, float]:
    rows = runner.req_to_token_pool.alloc(bs)
    slots = runner.allocator.alloc(bs * (ctx + 2 * steps + 2)).view(bs, -1)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.req_to_token[row, : slots.shape[1]] = slots[i].to(torch.int32)
    ids = torch.randint(100, 1000, (bs, slots.shape[1]), generator=torch.Generator().manual_seed(0))
    stack = runner.model.model
    fused = stack.fused_decode

    def fb(pos: int) -> ForwardBatch:
        return ForwardBatch(
            ForwardMode.DECODE, bs, ids[:, pos].contiguous(), torch.full((bs,), pos),
            slots[:, pos].contiguous(), torch.tensor(rows), torch.full((bs,), pos + 1), None,
            None, [pos + 1] * bs, None, None, runner.req_to_token_pool, runner.kv_pool,
            runner.attn_backend)  # fmt: skip

    out: dict[str, float] = {}
    with torch.inference_mode():
        stack.fused_decode = None
        for p in range(ctx):  # the context's KV, written by decode steps (any path would do)
            runner.forward(fb(p))
        ref = runner.forward(fb(ctx)).clone()
        if fused is not None:
            stack.fused_decode = fused
            out["fused_equals_module"] = float(torch.equal(runner.forward(fb(ctx)), ref))
        paths = [("module", None)] + ([("fused", fused)] if fused is not None else [])
        best: dict[str, float] = {}
        pos = ctx + 1
        for _ in range(2):
            for name, f in paths:
                stack.fused_decode = f
                t = time.perf_counter()
                for p in range(pos, pos + steps // 2):
                    runner.forward(fb(p))
                dt = (time.perf_counter() - t) / (steps // 2)
                best[name] = min(best.get(name, dt), dt)
            pos += steps // 2
        stack.fused_decode = fused
    runner.allocator.free(slots.reshape(-1))
    runner.req_to_token_pool.free(rows)
    for name, dt in best.items():
        out[f"{name}_ms"] = dt * 1e3
        out[f"{name}_tok_s"] = bs / dt
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--context", default="100,1000")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dense", action="store_true", help="also time quantization=none")
    p.add_argument("--out", default="")
    a = p.parse_args()
    batches = [int(x) for x in a.batch.split(",")]
    contexts = [int(x) for x in a.context.split(",")]
    need = max(batches) * (max(contexts) + 2 * a.steps + 4) + 64
    results = {"machine": machine(), "rows": []}
    for quant in ["int4"] + (["none"] if a.dense else []):
        runner = ModelRunner(ServerArgs(quantization=quant, max_total_tokens=need))
        info = runner.model_info()
        for ctx in contexts:
            for bs in batches:
                row = {"quantization": quant, "fused_decode": info["fused_decode"], "batch": bs,
                       "context": ctx, **measure(runner, bs, ctx, a.steps)}
                results["rows"].append(row)
                timing = "  ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_ms"))
                print(f"{quant} bs={bs} ctx={ctx}: {timing}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
