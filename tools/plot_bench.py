"""Plots tools/bench_offline.py's JSON into a PNG for docs/benchmarks.md (bench_offline.py
--plot draws the same figure).

    python -m tools.plot_bench docs/bench_offline.json docs/bench_offline.png
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tools.benchlib import describe_machine, save_figure, subplots


def plot(res: dict[str, Any], out: str) -> None:
    fig, axes = subplots(1, 2, figsize=(10, 4))
    a = res["a"]
    names = ["hicache", "transformers"]
    values = [a["engine_tok_s"], a["hf_tok_s"]]
    if "floor_tok_s" in a:  # the matmul floors are CPU-only
        names.append("F.linear\nmatmul floor")
        values.append(a["floor_tok_s"])
    if "onednn_floor_step_ms" in a:
        names.append("oneDNN\nmatmul floor")
        values.append(a["floor_tok_s"] * a["floor_step_ms"] / a["onednn_floor_step_ms"])
    axes[0].bar(
        names, values, color=["tab:blue", "tab:gray", "tab:green", "tab:olive"][: len(names)]
    )
    axes[0].set_title("(a) 16 prompts x 64 new tokens (tok/s)")
    b = res["b"]
    axes[1].bar(
        ["hicache", "transformers"], [b["engine_s"], b["hf_s"]], color=["tab:blue", "tab:gray"]
    )
    axes[1].set_title(f"(b) 16 x shared {b['prompt_tokens']}-token prompt (s, lower is better)")
    model = f"{res.get('model', 'SmolLM2-135M')} {res.get('dtype', 'fp32')}"  # older JSON: neither
    fig.suptitle(f"{model} on {describe_machine(res['machine'])}")
    save_figure(fig, out)


def main(src: str, out: str) -> None:
    with open(src) as f:
        plot(json.load(f), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
