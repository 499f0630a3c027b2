"""CPU bandwidth of the torch reference KV transfers vs a plain contiguous copy of the same bytes.

SmolLM2-135M KV shapes: 30 layers, 3 kv heads x 64, fp32, 2,048 tokens moved (K and V, all
layers = 94 MB), host pool 8,192 tokens, device pool 8,192 (+ padding page). Pages are scattered
at random on both sides (the fragmented case). Prints a markdown table; time = best of --reps.

    PYTHONPATH=. python tools/bench_transfer.py [--tokens 2048] [--reps 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from hicache.host_pool import MHATokenToKVPoolHost
from hicache.kernels import transfer_all_layer
from hicache.kv_pool import MHATokenToKVPool

LAYERS, HEADS, HEAD_DIM, DTYPE = 30, 3, 64, torch.float32
POOL_TOKENS = 8192


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up: page faults, allocator
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def scattered_slots(num_tokens: int, page_size: int, first_page: int, g: torch.Generator):
    """[num_tokens] int64 slots: whole pages in random order."""
    pages = torch.randperm(POOL_TOKENS // page_size, generator=g)[: num_tokens // page_size]
    pages = pages + first_page
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def make_cases(
    layout: str, page_size: int, num_tokens: int, g: torch.Generator
) -> dict[str, Callable[[], object]]:
    """The timed copies for one host layout and page size (2,048 tokens each)."""
    dev = MHATokenToKVPool(POOL_TOKENS, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = MHATokenToKVPoolHost(
        POOL_TOKENS, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, layout=layout
    )
    host.kv_buffer.normal_()
    dev_idx = scattered_slots(num_tokens, page_size, 1, g)  # [n] int64 device slots
    host_idx = scattered_slots(num_tokens, page_size, 0, g)  # [n] int64 host slots
    flat = host.get_flat_data(host_idx)

    def load_all_layers() -> None:
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)

    def backup_direct() -> None:
        transfer_all_layer(
            dev.k_buffer, dev.v_buffer, host.kv_buffer, dev_idx, host_idx, layout, page_size,
            "direct",
        )  # fmt: skip

    return {
        "whole-token gather (get_flat_data)": lambda: host.get_flat_data(host_idx, out=flat),
        "whole-token scatter (set_from_flat_data)": lambda: host.set_from_flat_data(host_idx, flat),
        "backup device->host, all layers": lambda: host.backup_from_device_all_layer(
            dev, host_idx, dev_idx
        ),
        "backup, direct (run merge)": backup_direct,
        "load host->device, per layer x30": load_all_layers,
    }


def run(num_tokens: int, reps: int) -> list[tuple[str, str, int, float, float]]:
    g = torch.Generator().manual_seed(0)
    nbytes = 2 * LAYERS * num_tokens * HEADS * HEAD_DIM * DTYPE.itemsize
    src = torch.randn(nbytes // DTYPE.itemsize)
    dst = torch.empty_like(src)
    plain = nbytes / best_seconds(lambda: dst.copy_(src), reps) / 1e9
    rows = [("plain contiguous copy", "-", 0, plain, 1.0)]
    for layout in ("layer_first", "page_first"):
        for page_size in (1, 16):
            for name, fn in make_cases(layout, page_size, num_tokens, g).items():
                gbps = nbytes / best_seconds(fn, reps) / 1e9
                rows.append((name, layout, page_size, gbps, gbps / plain))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        # NOTE: on a busy 2-core machine, intra-op threads that wait on each other can be 10x slower
        torch.set_num_threads(args.threads)
    rows = run(args.tokens, args.reps)
    print(f"{args.tokens} tokens, {LAYERS} layers x {HEADS} kv heads x {HEAD_DIM}, fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("\n| path | host layout | page size | GB/s | x plain copy |\n|---|---|---|---|---|")
    for name, layout, page_size, gbps, ratio in rows:
        print(f"| {name} | {layout} | {page_size or '-'} | {gbps:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
