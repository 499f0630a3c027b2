"""In-process CPU step time: the model runner alone (no scheduler, no processes), on the
embedded model. Decode per batch size and context length, for the fused decode stack (one C call
per step), the per-module path (same kernels, Python per layer) and optionally the dense path;
against the step's physical floor (the bytes of weights one step reads over this machine's
measured read bandwidth); and a cold prefill of ``--prefill`` tokens.

    python -m tools.bench_cpu_decode [--batch 1,4,16] [--context 100,1000] [--steps 30]
        [--dense] [--prefill 2048] [--arg name=value ...] [--out docs/bench_cpu_decode.json]
        [--plot docs/bench_cpu_decode.png [--baseline other.json --baseline-label TEXT]]

Each configuration fills its context with module-path steps first, checks that one fused step's
logits equal the module step's, then times ``--steps`` steps of each path alternately (twice, the
faster pass counts: this VM's speed drifts). Threads: torch's default (all cores). ``--arg``
passes an engine option (ServerArgs) to every runner, e.g. to time an older commit's options.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import ServerArgs
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.model_runner import ModelRunner
from tools.benchlib import Header, parse_options, save_figure, subplots, write_json


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
            ForwardMode.DECODE,
            bs,
            ids[:, pos].contiguous(),
            torch.full((bs,), pos),
            slots[:, pos].contiguous(),
            torch.tensor(rows),
            torch.full((bs,), pos + 1),
            None,
            None,
            [pos + 1] * bs,
            None,
            None,
            runner.req_to_token_pool,
            runner.kv_pool,
            runner.attn_backend,
        )

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


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """This machine's read bandwidth in GB/s: the best of ``reps`` sums of a ``gib`` buffer
    (all threads; larger than any cache)."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights a decode step reads: every product's weights (packed panels, or the
    dense / quantized tensors) once; the embedding lookup reads one row per token, not counted."""
    seen: set[int] = set()
    total = 0
    for module in runner.model.modules():
        panels = getattr(module, "panels", None)
        tensors = (
            [panels.data]
            if panels is not None
            else [
                t
                for name, t in list(module.named_parameters(recurse=False))
                + list(module.named_buffers(recurse=False))
                if t is not None and name != "cos_sin_cache"
            ]
        )
        if type(module).__name__ == "Embedding":
            continue
        for t in tensors:
            if t.data_ptr() not in seen and t.numel():
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def prefill(runner: ModelRunner, n: int, reps: int = 3) -> float:
    """Seconds of the best of ``reps`` cold prefills of ``n`` tokens (one EXTEND forward)."""
    ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n))
    best = float("inf")
    for _ in range(reps):
        row = runner.req_to_token_pool.alloc(1)[0]
        slots = runner.allocator.alloc(n)
        runner.req_to_token_pool.req_to_token[row, :n] = slots.to(torch.int32)
        fb = ForwardBatch(
            ForwardMode.EXTEND,
            1,
            ids,
            torch.arange(n),
            slots,
            torch.tensor([row]),
            torch.tensor([n]),
            torch.tensor([0]),
            torch.tensor([n]),
            [n],
            [0],
            [n],
            runner.req_to_token_pool,
            runner.kv_pool,
            runner.attn_backend,
        )
        with torch.inference_mode():
            t = time.perf_counter()
            runner.forward(fb)
            best = min(best, time.perf_counter() - t)
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--context", default="100,1000")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dense", action="store_true", help="also time quantization=none")
    p.add_argument("--prefill", type=int, default=0, help="also time a cold prefill of N tokens")
    p.add_argument("--arg", action="append", default=[], help="engine option name=value")
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="", help="PNG: fused step ms per batch/context + floor")
    p.add_argument("--baseline", default="", help="an earlier --out JSON to plot beside")
    p.add_argument("--baseline-label", default="baseline")
    a = p.parse_args()
    batches = [int(x) for x in a.batch.split(",")] if a.batch else []
    contexts = [int(x) for x in a.context.split(",")] if a.context else []
    need = max(batches, default=1) * (max(contexts, default=0) + 2 * a.steps + 4) + 64
    need = max(need, a.prefill + 64)
    extra = parse_options(a.arg)
    header = Header.now()
    bw = read_bandwidth()
    results: dict[str, Any] = {"read_bandwidth_gb_s": bw, "rows": []}
    print(f"read bandwidth {bw:.1f} GB/s", flush=True)
    for quant in ["int4"] + (["none"] if a.dense else []):
        runner = ModelRunner(ServerArgs(quantization=quant, max_total_tokens=need, **extra))
        info = runner.model_info()
        wb = weight_bytes(runner)
        floor_ms = wb / (bw * 1e9) * 1e3
        results.setdefault("floor", {})[quant] = {"weight_bytes": wb, "floor_ms": floor_ms}
        print(
            f"{quant}: {wb / 1e6:.1f} MB of weights a decode step: floor {floor_ms:.2f} ms "
            f"({1e3 / floor_ms:.0f} steps/s)",
            flush=True,
        )
        if a.prefill:
            sec = prefill(runner, a.prefill)
            results.setdefault("prefill", {})[quant] = {"tokens": a.prefill, "seconds": sec}
            print(
                f"{quant}: cold prefill of {a.prefill} tokens {sec * 1e3:.0f} ms "
                f"({a.prefill / sec:.0f} tok/s)",
                flush=True,
            )
        for ctx in contexts:
            for bs in batches:
                row = {
                    "quantization": quant,
                    "fused_decode": info["fused_decode"],
                    "batch": bs,
                    "context": ctx,
                    **measure(runner, bs, ctx, a.steps),
                }
                results["rows"].append(row)
                timing = "  ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_ms"))
                print(f"{quant} bs={bs} ctx={ctx}: {timing}", flush=True)
    results.update(header.record([a.plot]))
    if a.plot:
        base = json.loads(Path(a.baseline).read_text()) if a.baseline else None
        plot(results, a.plot, base, a.baseline_label)
    if a.out:
        write_json(a.out, results)
    print(header.markdown(results["plots"]))


def plot(results: dict, path: str, base: dict | None, base_label: str) -> None:
    """Fused decode step ms per (batch, context), this run beside ``base``, with this run's
    floor (weights over read bandwidth); the cold prefill in the title."""
    rows = [r for r in results["rows"] if r["quantization"] == "int4"]
    labels = [f"bs {r['batch']}\nctx {r['context']}" for r in rows]
    x = range(len(rows))
    fig, ax = subplots(figsize=(8, 4))
    width = 0.4 if base else 0.8
    ax.bar(
        [i - width / 2 if base else i for i in x],
        [r["fused_ms"] for r in rows],
        width,
        label=f"this run ({results['machine'].get('git_commit', '')[:7]})",
    )
    if base:
        by = {(r["batch"], r["context"]): r for r in base["rows"] if r["quantization"] == "int4"}
        ax.bar(
            [i + width / 2 for i in x],
            [by.get((r["batch"], r["context"]), {}).get("fused_ms", 0) for r in rows],
            width,
            label=base_label,
        )
    floor = results.get("floor", {}).get("int4", {}).get("floor_ms")
    if floor:
        ax.axhline(
            floor,
            color="tab:red",
            ls="--",
            lw=1,
            label=f"one row's floor {floor:.1f} ms (weights / read bandwidth)",
        )
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode step, ms (lower is better)")
    title = "CPU decode step, embedded SmolLM2 int4"
    pre = results.get("prefill", {}).get("int4")
    if pre:
        title += f"\ncold {pre['tokens']}-token prefill {pre['seconds'] * 1e3:.0f} ms"
        if base and base.get("prefill", {}).get("int4"):
            title += f" ({base_label}: {base['prefill']['int4']['seconds'] * 1e3:.0f} ms)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
