"""CPU bandwidth of the torch KV transfers vs a plain contiguous copy of the same bytes.

SmolLM2-135M KV shapes: 30 layers, 3 kv heads x 64, fp32, 2,048 tokens moved (K and V, all
layers = 94 MB), host pool 8,192 tokens, device pool 8,192 (+ padding page). Every copy runs
on three index patterns (the same device and host slots for every path of one pattern):

  random     whole pages in random order on both sides (the fully fragmented case)
  allocator  slots as the real allocators hand them out after churn: rounds of 8 requests
             (prefill 32..511 tokens, then 8..127 decode steps of one token per request per
             step, so decode slots interleave), half of them freed at random after each round;
             device slots = live requests' slots, host slots = a fresh host-pool alloc
  fresh      a fresh pool: both sides consecutive (the best case)

Prints a markdown table (GB/s and x plain copy per pattern) and the mean joint run length of
each pattern. Time = best of --reps; the plain copy (``dst.copy_(src)`` of the same bytes) is
timed alternately with every cell, so each ratio compares two timings taken at the same moments
of a shared machine; with --rounds N each cell reports its pass of median ratio.

    PYTHONPATH=. python tools/bench_transfer.py [--tokens 2048] [--reps 7] [--rounds 1]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

import torch

from hicache.allocator import TokenToKVPoolAllocator
from hicache.host_pool import MHATokenToKVPoolHost
from hicache.kernels import transfer_all_layer
from hicache.kv_pool import MHATokenToKVPool

LAYERS, HEADS, HEAD_DIM, DTYPE = 30, 3, 64, torch.float32
POOL_TOKENS = 8192
PATTERNS = ("random", "allocator", "fresh")


def paired_best_seconds(
    fn: Callable[[], object], plain: Callable[[], object], reps: int
) -> tuple[float, float]:
    """Best of ``reps`` for ``fn`` and for the plain copy, run alternately, so that both see the
    same moments of a shared machine."""
    fn()  # warm up: page faults, allocator
    plain()
    best_fn = best_plain = float("inf")
    for _ in range(reps):
        best_plain = min(best_plain, _once(plain))
        best_fn = min(best_fn, _once(fn))
    return best_fn, best_plain


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def scattered_slots(num_tokens: int, page_size: int, first_page: int, g: torch.Generator):
    """[num_tokens] int64 slots: whole pages in random order."""
    pages = torch.randperm(POOL_TOKENS // page_size, generator=g)[: num_tokens // page_size]
    pages = pages + first_page
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def churned_requests(alloc, free, page_size: int, rng: random.Random, rounds: int = 40,
                     batch: int = 8) -> list[torch.Tensor]:
    """Slot lists of the live requests after ``rounds`` of batched prefill + decode, freeing
    half of the requests at random after each round (and whenever an alloc fails)."""
    live: list[list[torch.Tensor]] = []

    def take(n: int) -> torch.Tensor:
        while (slots := alloc(n)) is None:
            free(torch.cat(live.pop(rng.randrange(len(live)))))
        return slots

    for _ in range(rounds):
        reqs = [[take(max(rng.randrange(32, 512) // page_size, 1) * page_size)]
                for _ in range(batch)]  # fmt: skip
        used = [0] * batch
        for _ in range(rng.randrange(8, 128)):  # decode: one token per request per step
            for i, req in enumerate(reqs):
                if used[i] % page_size == 0:
                    req.append(take(page_size))
                used[i] += 1
        live += reqs
        for _ in range(batch // 2):
            free(torch.cat(live.pop(rng.randrange(len(live)))))
    return [torch.cat(r) for r in live]


def allocator_slots(num_tokens: int, page_size: int, rng: random.Random):
    """(device slots, host slots), [num_tokens] int64 each, as the allocators hand them out."""
    dev = TokenToKVPoolAllocator(POOL_TOKENS, page_size, "cpu")
    dev_idx = torch.cat(churned_requests(dev.alloc, dev.free, page_size, rng))[:num_tokens]
    host = MHATokenToKVPoolHost(POOL_TOKENS, page_size, DTYPE, 1, 1, 1)
    live = churned_requests(host.alloc, host.free, page_size, rng)
    while host.available_size() < num_tokens:
        host.free(live.pop(rng.randrange(len(live))))
    host_idx = host.alloc(num_tokens)
    assert dev_idx.numel() == num_tokens and host_idx is not None
    return dev_idx, host_idx


def make_slots(pattern: str, num_tokens: int, page_size: int, seed: int):
    """(device slots, host slots) of ``pattern``."""
    if pattern == "random":
        g = torch.Generator().manual_seed(seed)
        return (scattered_slots(num_tokens, page_size, 1, g),
                scattered_slots(num_tokens, page_size, 0, g))  # fmt: skip
    if pattern == "allocator":
        return allocator_slots(num_tokens, page_size, random.Random(seed))
    return torch.arange(page_size, page_size + num_tokens), torch.arange(num_tokens)


def mean_run(dev_idx: torch.Tensor, host_idx: torch.Tensor, page_size: int) -> float:
    """Mean length in tokens of the runs where both sides' pages step by +1."""
    dev_p, host_p = dev_idx[::page_size] // page_size, host_idx[::page_size] // page_size
    breaks = ((dev_p[1:] - dev_p[:-1]) != 1) | ((host_p[1:] - host_p[:-1]) != 1)
    return dev_idx.numel() / (int(breaks.sum()) + 1)


def make_cases(
    layout: str, page_size: int, dev_idx: torch.Tensor, host_idx: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """The timed copies for one host layout, page size and index pattern."""
    dev = MHATokenToKVPool(POOL_TOKENS, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = MHATokenToKVPoolHost(
        POOL_TOKENS, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, layout=layout
    )
    host.kv_buffer.normal_()
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


Cell = tuple[str, str, int, str]  # (path, host layout, page size, pattern)


def run(
    num_tokens: int, reps: int, page_sizes: tuple[int, ...] = (1, 16)
) -> tuple[dict[Cell, tuple[float, float]], dict]:
    """({cell: (GB/s, x plain copy)}, {(pattern, page size): mean joint run in tokens}); each
    cell's plain copy is timed alternately with it."""
    nbytes = 2 * LAYERS * num_tokens * HEADS * HEAD_DIM * DTYPE.itemsize
    src = torch.randn(nbytes // DTYPE.itemsize)
    dst = torch.empty_like(src)

    def plain() -> None:
        dst.copy_(src)

    cells, runs = {}, {}
    for page_size in page_sizes:
        slots = {p: make_slots(p, num_tokens, page_size, seed=page_size) for p in PATTERNS}
        runs.update({(p, page_size): mean_run(*s, page_size) for p, s in slots.items()})
        for layout in ("layer_first", "page_first"):
            for pattern, (dev_idx, host_idx) in slots.items():
                for name, fn in make_cases(layout, page_size, dev_idx, host_idx).items():
                    seconds, plain_seconds = paired_best_seconds(fn, plain, reps)
                    cells[(name, layout, page_size, pattern)] = (
                        nbytes / seconds / 1e9, plain_seconds / seconds)
    return cells, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over the table; each cell reports its median-ratio pass")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--page-sizes", default="1,16", help="comma list, e.g. 1,16,64")
    args = ap.parse_args()
    page_sizes = tuple(int(p) for p in args.page_sizes.split(","))
    if args.threads:
        # NOTE: on a busy 2-core machine, intra-op threads that wait on each other can be 10x slower
        torch.set_num_threads(args.threads)
    passes = [run(args.tokens, args.reps, page_sizes) for _ in range(args.rounds)]
    runs = passes[0][1]
    cells = {k: sorted((p[0][k] for p in passes), key=lambda c: c[1])[len(passes) // 2]
             for k in passes[0][0]}  # fmt: skip
    plain = sorted(gbps / ratio for gbps, ratio in cells.values())
    print(f"{args.tokens} tokens, {LAYERS} layers x {HEADS} kv heads x {HEAD_DIM}, fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.reps}, "
          f"median of {args.rounds} passes, load average {os.getloadavg()[0]:.1f}; plain "
          f"contiguous copy {plain[len(plain) // 2]:.1f} GB/s (median; "
          f"{plain[0]:.1f}..{plain[-1]:.1f})")  # fmt: skip
    by_page = sorted(runs.items(), key=lambda item: item[0][1])
    print("mean joint run (tokens): "
          + ", ".join(f"{p} page {ps}: {r:.1f}" for (p, ps), r in by_page))
    head = " | ".join(f"{p} GB/s | x" for p in PATTERNS)
    print(f"\n| path | host layout | page size | {head} |\n|---|---|---|" + "---|---|" * 3)
    for name, layout, page_size in dict.fromkeys(k[:3] for k in cells):  # in run order
        by = [cells[(name, layout, page_size, p)] for p in PATTERNS]
        print(f"| {name} | {layout} | {page_size} | "
              + " | ".join(f"{gbps:.1f} | {ratio:.2f}" for gbps, ratio in by) + " |")


if __name__ == "__main__":
    main()
