"""KV transfer bandwidth: the CPU torch path vs a plain contiguous copy of the same bytes, or
(``--device cuda``) the io backends' H2D / D2H vs pinned cudaMemcpyAsync.

Default geometry, SmolLM2-135M KV shapes: 30 layers, 3 kv heads x 64, fp32, 2,048 tokens moved
(K and V, all layers = 94 MB), host pool 8,192 tokens, device pool 8,192 (+ padding page);
``--geometry llama3-8b``: 32 layers, 8 kv heads x 128, bf16 (2,048 tokens = 268 MB). Every
copy runs on three index patterns (the same device and host slots for every path of one
pattern):

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

    python -m tools.bench_transfer [--tokens 2048] [--reps 7] [--rounds 1]
        [--threads 1] [--page-sizes 1,16] [--io-backends kernel,direct]
        [--geometry smollm2-135m|llama3-8b] [--json PATH] [--png PATH]

``--device cuda`` (issue 5 (a)): the device pool (``MHATokenToKVPool``) on the GPU, the host pool
pinned (``MHATokenToKVPoolHost`` pins when CUDA is available); per io backend, the per-layer load
H2D (``load_to_device_per_layer`` over all layers, as the controller's load worker calls it) and
the all-layer backup D2H (``backup_from_device_all_layer``), timed with CUDA events (2 warm-up
calls, then the median of --reps) against the pinned-memcpy peak: one contiguous pinned tensor
``copy_(non_blocking=True)`` of the same bytes (cudaMemcpyAsync), H2D or D2H to match, timed
alternately with every cell. Target: kernel H2D >= 0.9x that peak.

    python -m tools.bench_transfer --device cuda --geometry llama3-8b \\
        --page-sizes 1,16,64 --json docs/bench_transfer_gpu.json --png docs/bench_transfer_gpu.png
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.transfer.kernels import transfer_all_layer
from hicache.transfer.kernels.transfer import IO_BACKENDS, LAYOUTS
from tools.benchlib import Header, markdown_table, median, save_figure, subplots, write_json


class Geometry(NamedTuple):
    """KV shape of one model: per layer, K and V of ``[tokens, heads, head_dim]``."""

    name: str
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def token_bytes(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        return (
            f"{self.layers} layers x {self.heads} kv heads x {self.head_dim}, "
            f"{short.get(self.dtype, str(self.dtype))}"
        )


GEOMETRIES = {
    "smollm2-135m": Geometry("smollm2-135m", 30, 3, 64, torch.float32),
    "llama3-8b": Geometry("llama3-8b", 32, 8, 128, torch.bfloat16),
}
POOL_TOKENS = 8192
PATTERNS = ("random", "allocator", "fresh")
TARGET = {"cpu": 0.7, "cuda": 0.9}  # x the reference copy (CPU: plain copy; CUDA: pinned memcpy)


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cuda_once(fn: Callable[[], object]) -> float:
    """Seconds between two events around ``fn`` on the current stream (host-side launch work
    included: the start event fires while the GPU waits for the first launch)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def paired_seconds(
    fn: Callable[[], object], ref: Callable[[], object], reps: int, device: torch.device
) -> tuple[float, float]:
    """(``fn``'s, the reference copy's) seconds: ``reps`` runs of each, alternately, so that both
    see the same moments of a shared machine, after two warm-up calls of each (page faults, the
    allocator, the first Triton call's compile). CPU: the best of the reps; CUDA: the median,
    timed with CUDA events."""
    cuda = device.type == "cuda"
    for _ in range(2):
        fn()
        ref()
    if cuda:
        torch.cuda.synchronize(device)
    once = _cuda_once if cuda else _once
    t_fn, t_ref = [], []
    for _ in range(reps):
        t_ref.append(once(ref))
        t_fn.append(once(fn))
    pick = median if cuda else min
    return pick(t_fn), pick(t_ref)


def scattered_slots(num_tokens: int, page_size: int, first_page: int, g: torch.Generator):
    """[num_tokens] int64 slots: whole pages in random order."""
    pages = torch.randperm(POOL_TOKENS // page_size, generator=g)[: num_tokens // page_size]
    pages = pages + first_page
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def churned_requests(
    alloc, free, page_size: int, rng: random.Random, rounds: int = 40, batch: int = 8
) -> list[torch.Tensor]:
    """Slot lists of the live requests after ``rounds`` of batched prefill + decode, freeing
    half of the requests at random after each round (and whenever an alloc fails)."""
    live: list[list[torch.Tensor]] = []

    def take(n: int) -> torch.Tensor:
        while (slots := alloc(n)) is None:
            free(torch.cat(live.pop(rng.randrange(len(live)))))
        return slots

    for _ in range(rounds):
        reqs = [
            [take(max(rng.randrange(32, 512) // page_size, 1) * page_size)] for _ in range(batch)
        ]
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
    # only its allocator is used: a 1 x 1 x 1 byte buffer, never pinned
    host = MHATokenToKVPoolHost(POOL_TOKENS, page_size, torch.float32, 1, 1, 1, pin_memory=False)
    live = churned_requests(host.alloc, host.free, page_size, rng)
    while host.available_size() < num_tokens:
        host.free(live.pop(rng.randrange(len(live))))
    host_idx = host.alloc(num_tokens)
    assert dev_idx.numel() == num_tokens and host_idx is not None
    return dev_idx, host_idx


def make_slots(pattern: str, num_tokens: int, page_size: int, seed: int):
    """(device slots, host slots) of ``pattern``, on CPU."""
    if pattern == "random":
        g = torch.Generator().manual_seed(seed)
        return (
            scattered_slots(num_tokens, page_size, 1, g),
            scattered_slots(num_tokens, page_size, 0, g),
        )
    if pattern == "allocator":
        return allocator_slots(num_tokens, page_size, random.Random(seed))
    return torch.arange(page_size, page_size + num_tokens), torch.arange(num_tokens)


def mean_run(dev_idx: torch.Tensor, host_idx: torch.Tensor, page_size: int) -> float:
    """Mean length in tokens of the runs where both sides' pages step by +1."""
    dev_p, host_p = dev_idx[::page_size] // page_size, host_idx[::page_size] // page_size
    breaks = ((dev_p[1:] - dev_p[:-1]) != 1) | ((host_p[1:] - host_p[:-1]) != 1)
    return dev_idx.numel() / (int(breaks.sum()) + 1)


def make_pools(
    geom: Geometry, layout: str, page_size: int, device: torch.device
) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    """Device pool on ``device`` and host pool (pinned when CUDA is available) of ``geom``."""
    dev = MHATokenToKVPool(
        POOL_TOKENS, page_size, geom.dtype, geom.heads, geom.head_dim, geom.layers, device
    )
    host = MHATokenToKVPoolHost(
        POOL_TOKENS, page_size, geom.dtype, geom.heads, geom.head_dim, geom.layers, layout=layout
    )
    return dev, host


def cpu_cases(
    geom: Geometry,
    dev: MHATokenToKVPool,
    host: MHATokenToKVPoolHost,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    backends: tuple[str, ...],
) -> list[tuple[str, str, Callable[[], object]]]:
    """(path, "plain", copy): the timed CPU copies for one host layout, page size and index
    pattern, each against the plain copy."""
    layout, page_size = host.layout, host.page_size
    flat = host.get_flat_data(host_idx)

    def load_all_layers() -> None:
        for layer in range(geom.layers):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, layer)

    def backup_direct() -> None:
        transfer_all_layer(
            dev.k_buffer,
            dev.v_buffer,
            host.kv_buffer,
            dev_idx,
            host_idx,
            layout,
            page_size,
            "direct",
        )

    cases: list[tuple[str, Callable[[], object]]] = [
        ("whole-token gather (get_flat_data)", lambda: host.get_flat_data(host_idx, out=flat)),
        (
            "whole-token scatter (set_from_flat_data)",
            lambda: host.set_from_flat_data(host_idx, flat),
        ),
    ]
    if "kernel" in backends:
        backup = lambda: host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        cases.append(("backup device->host, all layers", backup))
    if "direct" in backends:
        cases.append(("backup, direct (run merge)", backup_direct))
    if "kernel" in backends:
        cases.append((f"load host->device, per layer x{geom.layers}", load_all_layers))
    return [(name, "plain", fn) for name, fn in cases]


def device_cases(
    geom: Geometry,
    dev: MHATokenToKVPool,
    host: MHATokenToKVPoolHost,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    backend: str,
) -> list[tuple[str, str, Callable[[], object]]]:
    """(path, direction "h2d" / "d2h", copy) of one io backend, as the controller calls them."""
    # NOTE: the Triton kernels read page ids from device memory, so "kernel" gets both index
    # tensors on the device (moved once, untimed); "direct" gets them as the allocators hand
    # them out (host slots on CPU, device slots on the device) and plans its runs on CPU.
    device_idx = dev_idx.to(dev.device)
    host_side = host_idx.to(dev.device) if backend == "kernel" else host_idx

    def load_all_layers() -> None:
        for layer in range(geom.layers):
            host.load_to_device_per_layer(dev, host_side, device_idx, layer, backend)

    def backup_all_layers() -> None:
        host.backup_from_device_all_layer(dev, host_side, device_idx, backend)

    return [
        (f"load host->device, per layer x{geom.layers} ({backend})", "h2d", load_all_layers),
        (f"backup device->host, all layers ({backend})", "d2h", backup_all_layers),
    ]


Cell = tuple[str, str, int, str]  # (path, host layout, page size, pattern)


def run(
    num_tokens: int,
    reps: int,
    page_sizes: tuple[int, ...],
    geom: Geometry,
    backends: tuple[str, ...],
    device: torch.device,
) -> tuple[dict[Cell, tuple[float, float]], dict, dict[str, list[float]]]:
    """({cell: (GB/s, x the reference copy)}, {(pattern, page size): mean joint run in tokens},
    {reference: its GB/s of every cell}). The reference: on CPU the plain copy of the same
    bytes ("plain"); on CUDA a contiguous pinned ``copy_(non_blocking=True)`` of the same bytes
    in the same direction ("h2d" / "d2h"); each cell's is timed alternately with it."""
    nbytes = num_tokens * geom.token_bytes()
    cuda = device.type == "cuda"
    if cuda:
        host_ref = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # [bytes] pinned
        dev_ref = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [bytes] on device
        refs: dict[str, Callable[[], object]] = {
            "h2d": lambda: dev_ref.copy_(host_ref, non_blocking=True),
            "d2h": lambda: host_ref.copy_(dev_ref, non_blocking=True),
        }
    else:
        src = torch.randn(nbytes // 4)  # fp32 elements of the same byte count
        dst = torch.empty_like(src)
        refs = {"plain": lambda: dst.copy_(src)}
    cells, runs = {}, {}
    peaks: dict[str, list[float]] = {way: [] for way in refs}
    for page_size in page_sizes:
        slots = {p: make_slots(p, num_tokens, page_size, seed=page_size) for p in PATTERNS}
        runs.update({(p, page_size): mean_run(*s, page_size) for p, s in slots.items()})
        for layout in LAYOUTS:
            dev, host = make_pools(geom, layout, page_size, device)
            assert host.kv_buffer.is_pinned() or not cuda, "host pool not pinned"
            host.kv_buffer.view(torch.uint8).fill_(1)  # values do not matter; bytes resident
            for pattern, (dev_idx, host_idx) in slots.items():
                if cuda:
                    cases = [
                        case
                        for b in backends
                        for case in device_cases(geom, dev, host, dev_idx, host_idx, b)
                    ]
                else:
                    cases = cpu_cases(geom, dev, host, dev_idx, host_idx, backends)
                for name, way, fn in cases:
                    seconds, ref_seconds = paired_seconds(fn, refs[way], reps, device)
                    peaks[way].append(nbytes / ref_seconds / 1e9)
                    cells[(name, layout, page_size, pattern)] = (
                        nbytes / seconds / 1e9,
                        ref_seconds / seconds,
                    )
            del dev, host
    return cells, runs, peaks


def print_table(cells: dict[Cell, tuple[float, float]], ratio: str) -> None:
    header = ["path", "host layout", "page size"]
    for p in PATTERNS:
        header += [f"{p} GB/s", ratio]
    rows = []
    for name, layout, page_size in dict.fromkeys(k[:3] for k in cells):  # in run order
        by = [cells[(name, layout, page_size, p)] for p in PATTERNS]
        rows.append(
            [
                name,
                layout,
                page_size,
                *(f"{v:.{d}f}" for gbps, r in by for v, d in ((gbps, 1), (r, 2))),
            ]
        )
    print("\n" + markdown_table(header, rows))


def save_json(path: str, meta: dict, cells: dict[Cell, tuple[float, float]], runs: dict) -> None:
    res = dict(meta)
    res["mean_joint_run_tokens"] = [
        {"pattern": p, "page_size": ps, "tokens": r} for (p, ps), r in runs.items()
    ]
    res["cells"] = [
        {"path": n, "layout": lay, "page_size": ps, "pattern": pat, "gbps": g, "x_ref": r}
        for (n, lay, ps, pat), (g, r) in cells.items()
    ]
    print(f"wrote {write_json(path, res, indent=2)}")


def plot(
    path: str, cells: dict[Cell, tuple[float, float]], title: str, ref: str, target: float
) -> bool:
    """The ratios per cell and pattern; False (and a line said) without matplotlib, which a
    GPU machine's python may lack."""
    rows = list(dict.fromkeys(k[:3] for k in cells))
    height = 0.8 / len(PATTERNS)
    try:
        fig, ax = subplots(figsize=(10, 1.5 + 0.3 * len(rows)))
    except ImportError:
        print(f"matplotlib is not installed: no {path}")
        return False
    for i, pattern in enumerate(PATTERNS):
        ax.barh(
            [r + i * height for r in range(len(rows))],
            [cells[(*row, pattern)][1] for row in rows],
            height=height,
            label=pattern,
        )
    ax.axvline(target, color="k", ls="--", lw=1, label=f"target {target}x")
    ax.set_yticks([r + height for r in range(len(rows))])
    ax.set_yticklabels([f"{n} | {lay} | page {ps}" for n, lay, ps in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"x {ref}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    print(f"wrote {save_figure(fig, path)}")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--geometry", default="smollm2-135m", choices=sorted(GEOMETRIES))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="passes over the table; each cell reports its median-ratio pass",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--page-sizes", default="1,16", help="comma list, e.g. 1,16,64")
    ap.add_argument(
        "--io-backends",
        default="kernel,direct",
        help="comma list of device<->host io backends to time (kernel, direct)",
    )
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--png", default=None, help="also plot the ratios here (needs matplotlib)")
    args = ap.parse_args()
    page_sizes = tuple(int(p) for p in args.page_sizes.split(","))
    backends = tuple(b for b in args.io_backends.split(",") if b)
    if not backends or any(b not in IO_BACKENDS for b in backends):
        ap.error(f"--io-backends {args.io_backends!r}: a comma list of {', '.join(IO_BACKENDS)}")
    if not 0 < args.tokens <= POOL_TOKENS // 2 or any(args.tokens % p for p in page_sizes):
        ap.error(f"--tokens must be in 1..{POOL_TOKENS // 2} and a multiple of every page size")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(
            f"--device cuda: no CUDA device here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False)"
        )
    geom = GEOMETRIES[args.geometry]
    header = Header.now()
    if args.threads:
        # NOTE: on a busy 2-core machine, intra-op threads that wait on each other can be 10x slower
        torch.set_num_threads(args.threads)
    nbytes = args.tokens * geom.token_bytes()
    meta = {
        "device": args.device,
        "geometry": geom.name,
        "layers": geom.layers,
        "kv_heads": geom.heads,
        "head_dim": geom.head_dim,
        "dtype": str(geom.dtype),
        "tokens": args.tokens,
        "bytes_per_op": nbytes,
        "page_sizes": list(page_sizes),
        "io_backends": list(backends),
        "reps": args.reps,
        "rounds": args.rounds,
        "target_x_ref": TARGET[args.device],
    }
    device = torch.device(args.device)
    passes = [
        run(args.tokens, args.reps, page_sizes, geom, backends, device) for _ in range(args.rounds)
    ]
    runs = passes[0][1]
    cells = {
        k: sorted((p[0][k] for p in passes), key=lambda c: c[1])[len(passes) // 2]
        for k in passes[0][0]
    }
    peaks = {way: sorted(g for p in passes for g in p[2][way]) for way in passes[0][2]}
    peak = {way: v[len(v) // 2] for way, v in peaks.items()}
    if args.device == "cuda":
        name = torch.cuda.get_device_name(device)
        ref, ratio = "pinned memcpy (cudaMemcpyAsync, same direction)", "x memcpy"
        print(
            f"{args.tokens} tokens ({nbytes / 1e6:.0f} MB per copy), {geom.describe()}, {name}, "
            f"torch {torch.__version__}, CUDA events, median of {args.reps} after 2 warm-ups, "
            f"median of {args.rounds} passes; pinned memcpy peak H2D {peak['h2d']:.1f} GB/s "
            f"({peaks['h2d'][0]:.1f}..{peaks['h2d'][-1]:.1f}), D2H {peak['d2h']:.1f} GB/s "
            f"({peaks['d2h'][0]:.1f}..{peaks['d2h'][-1]:.1f}); target: kernel H2D >= "
            f"{TARGET['cuda']}x memcpy"
        )
        meta.update(
            {
                "device_name": name,
                "reference": ref,
                "timing": f"CUDA events, median of {args.reps} after 2 warm-ups",
                "peak_gbps": peak,
                "index_placement": "kernel: host and device slots on the GPU; direct: "
                "host slots on CPU, device slots on the GPU",
            }
        )
    else:
        ref, ratio = "plain contiguous copy", "x"
        meta.update(
            {
                "reference": "dst.copy_(src) of the same bytes",
                "timing": f"best of {args.reps}",
                "threads": torch.get_num_threads(),
            }
        )
        plain = peaks["plain"]
        print(
            f"{args.tokens} tokens, {geom.describe()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.reps}, "
            f"median of {args.rounds} passes, load average {os.getloadavg()[0]:.1f}; plain "
            f"contiguous copy {peak['plain']:.1f} GB/s (median; "
            f"{plain[0]:.1f}..{plain[-1]:.1f})"
        )
    by_page = sorted(runs.items(), key=lambda item: item[0][1])
    print(
        "mean joint run (tokens): " + ", ".join(f"{p} page {ps}: {r:.1f}" for (p, ps), r in by_page)
    )
    print_table(cells, ratio)
    plotted = bool(args.png) and plot(
        args.png,
        cells,
        f"{geom.name}, {args.tokens} tokens, {args.device}",
        ref,
        TARGET[args.device],
    )
    meta.update(header.record([args.png] if plotted else []))
    if args.json:
        save_json(args.json, meta, cells, runs)
    print("\n" + header.markdown(meta["plots"]))


if __name__ == "__main__":
    main()
