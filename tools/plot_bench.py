"""Plots tools/bench_offline.py's JSON into a PNG for docs/benchmarks.md."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, out: str) -> None:
    with open(src) as f:
        res = json.load(f)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    a = res["a"]
    names = ["hicache", "transformers", "F.linear\nmatmul floor"]
    values = [a["engine_tok_s"], a["hf_tok_s"], a["floor_tok_s"]]
    if "onednn_floor_step_ms" in a:
        names.append("oneDNN\nmatmul floor")
        values.append(a["floor_tok_s"] * a["floor_step_ms"] / a["onednn_floor_step_ms"])
    axes[0].bar(names, values, color=["tab:blue", "tab:gray", "tab:green", "tab:olive"][: len(names)])
    axes[0].set_title("(a) 16 prompts x 64 new tokens (tok/s)")
    b = res["b"]
    axes[1].bar(["hicache", "transformers"], [b["engine_s"], b["hf_s"]],
                color=["tab:blue", "tab:gray"])
    axes[1].set_title(f"(b) 16 x shared {b['prompt_tokens']}-token prompt (s, lower is better)")
    fig.suptitle(f"SmolLM2-135M fp32 on {res['machine']}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
