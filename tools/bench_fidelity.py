"""How far hicache's greedy output follows transformers' fp32 greedy output, next to llama.cpp's
llama-server on the same GGUF (the embedded SmolLM2-135M-Instruct Q4_1) and the same prompts.

    python -m tools.bench_fidelity [--new-tokens 128] [--threads 2] [--llama-server PATH]
        [--hicache-args '{"quantization": "int8"}'] [--llama-args "-ctk f32 -ctv f32"]
        [--out docs/bench_fidelity.json] [--plot docs/bench_fidelity.png]

Three sides get the same token ids (12 prompts: chat questions, a ~400-token document with a
question, code, a list, a multi-turn chat) and decode greedily, one prompt at a time:

    reference     transformers, the GGUF dequantized to float32 (the engine's converted copy)
    hicache       Engine() in process at its defaults (quantization "auto": int4 on a CPU)
    llama-server  the same .gguf, temperature 0 and top_k 1, 1 slot, no prompt cache, otherwise
                  its defaults (a f16 KV cache, flash attention "auto")

Each side stops at its own end-of-generation tokens (the reference runs all --new-tokens);
every output is then cut after its first token in the union of hicache's EOS ids and
llama.cpp's EOG tokens, so a side that stops where the reference stops agrees fully. (Not
``ignore_eos``: llama-server implements it by banning the EOG tokens, which changes the argmax.)
The score of a side on a prompt is the number of its tokens equal to the reference's before the
first difference, out of the reference's cut length N. Issue 27: hicache's total must be at
least llama-server's. "gap" is the reference's logit margin of its own token over the side's at
the divergence: a small gap is a near-tie that any rounding can flip.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import httpx2
import torch

from engine.runtime.models.loader import default_model_path, resolve_model_dir
from tools.benchlib import Header, markdown_table, median, save_figure, subplots, write_json
from tools.benchlib.header import header_markdown
from tools.benchlib.peers import LlamaServer, build_llama_server
from tools.benchlib.reference import greedy_reference

REPORT = """\
Incident report INC-2291, payments service, 14 March.
At 09:12 UTC the payments API began returning HTTP 503 for roughly a third of card
authorisations. The on-call engineer was paged at 09:15 by the error-rate alert, which fires
when more than 5% of requests fail over five minutes. Dashboards showed that the connection pool
of the ledger database was exhausted: all 200 connections were held, and new requests waited
for the 2-second pool timeout before failing. The database itself was healthy; CPU stayed
under 40% and no slow queries were logged. At 09:31 the team found that a deployment at 09:05
had changed the retry policy of the fraud-check client from three retries with exponential
back-off to ten immediate retries. When the fraud-check service slowed down under its normal
morning peak, every payment request held its ledger connection while it retried, so the pool
drained within minutes. The deployment was rolled back at 09:38, the pool recovered by 09:41,
and the error rate returned to its baseline of 0.02% at 09:44. About 18,400 authorisations
failed in total; customers could retry, and no payment was charged twice. Follow-up actions:
the ledger connection is now taken only after the fraud check returns; retry policies move
into a shared configuration file that requires a second reviewer; and a new alert fires when
the pool is more than 80% used for two minutes. The fraud-check team will also publish the
latency it guarantees at peak, so that clients can set their time-outs from it."""

CODE = """def merge(intervals):
    intervals.sort(key=lambda x: x[0])
    out = []
    for start, end in intervals:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out"""


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# name -> chat messages (rendered with the model's chat template) or raw text
PROMPTS: dict[str, list[dict[str, str]] | str] = {
    "capital": user("What is the capital of France, and what is it known for?"),
    "hash_table": user("Explain how a hash table works, step by step."),
    "python_fn": user(
        "Write a Python function that returns the n-th Fibonacci number "
        "iteratively, with a docstring."
    ),
    "fruit_list": user("List ten fruits, one per line, each with its usual colour."),
    "doc_summary": user(REPORT + "\n\nSummarise the report above in three sentences."),
    "doc_question": user(
        REPORT + "\n\nAccording to the report, what caused the outage, and how was it fixed?"
    ),
    "multiturn": [
        {"role": "system", "content": "You are a concise travel assistant."},
        {"role": "user", "content": "I have two days in Rome. What should I see?"},
        {
            "role": "assistant",
            "content": "Day one: the Colosseum, the Roman Forum and the "
            "Pantheon. Day two: the Vatican Museums and St. "
            "Peter's Basilica.",
        },
        {"role": "user", "content": "Where should I eat near the Pantheon, and what?"},
    ],
    "translate": user(
        "Translate into French: The weather is nice today, so we will walk to "
        "the market and buy fresh bread and some cheese."
    ),
    "math": user(
        "A train travels 120 km in 1.5 hours. What is its average speed? Show your reasoning."
    ),
    "code_explain": user("What does this function do? Give an example.\n\n" + CODE),
    "email": user(
        "Write a short, polite email to a colleague asking to move our Tuesday "
        "meeting to Thursday afternoon."
    ),
    "raw_code": 'import json\n\n\ndef load_config(path):\n    """Read a JSON configuration '
    'file and return it as a dict, with defaults for missing keys."""\n',
}


class Side(NamedTuple):
    outputs: list[list[int]]  # per prompt, the generated ids including a final stop token
    stop_ids: set[int]  # the tokens this side stops at
    facts: dict[str, Any]


def render(tokenizer: Any) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                p, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        if isinstance(p, list)
        else tokenizer.encode(p)
        for p in PROMPTS.values()
    ]


def hicache(prompts: list[list[int]], new_tokens: int, engine_args: dict[str, Any]) -> Side:
    from engine import Engine

    sp = {"max_new_tokens": new_tokens, "temperature": 0}
    with Engine(**engine_args) as eng:
        outs = [eng.generate(ids, sp).token_ids for ids in prompts]
        return Side(
            outs,
            set(eng.eos_token_ids),
            {"engine_args": engine_args, "model_info": eng.model_info()},
        )


def llama_server(
    binary: Path, prompts: list[list[int]], new_tokens: int, threads: int, extra_args: list[str]
) -> Side:
    work = Path(tempfile.mkdtemp(prefix="bench-fidelity-"))
    server = LlamaServer(binary, default_model_path(), threads, work, slots=1, ctx=4096)
    server.argv += ["-lv", "4", *extra_args]  # verbosity 4 logs the model's EOG tokens
    outs: list[list[int]] = []
    stopped_at: set[int] = set()
    try:
        server.start()
        for ids in prompts:
            body = {
                "prompt": ids,
                "n_predict": new_tokens,
                "temperature": 0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
                "stream": False,
            }
            r = httpx2.post(f"{server.url}/completion", json=body, timeout=600)
            r.raise_for_status()
            res = r.json()
            # NOTE: a BOS added or a prompt truncated would compare different inputs
            if res["tokens_evaluated"] != len(ids) or res.get("truncated"):
                raise RuntimeError(
                    f"llama-server evaluated {res['tokens_evaluated']} prompt "
                    f"tokens of {len(ids)} (truncated: {res.get('truncated')})"
                )
            outs.append([int(t) for t in res["tokens"]])
            if res["stop_type"] == "eos":
                stopped_at.add(outs[-1][-1])
        log = server.log.read_text()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    # the load log lists its end-of-generation set ("print_info: EOG token        = 2 '...'");
    # a token it stopped at is one in any case
    eog = {int(m) for m in re.findall(r"EOG token\s+= (\d+) '", log)} | stopped_at
    return Side(outs, eog, {"binary": str(binary), "argv": server.argv, "eog_tokens": sorted(eog)})


def cut(ids: list[int], stops: set[int]) -> list[int]:
    """ids up to and including the first stop token."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


def agreement(ref: list[int], out: list[int]) -> int:
    n = 0
    for a, b in zip(ref, out, strict=False):
        if a != b:
            break
        n += 1
    return n


def gap(model: Any, prompt: list[int], ref: list[int], out: list[int], n: int) -> float | None:
    """The reference's logit of its token minus that of the side's at the first difference."""
    if n >= len(ref) or n >= len(out):
        return None
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:n]])).logits[0, -1]  # [vocab]
    return float(logits[ref[n]] - logits[out[n]])


def table(result: dict[str, Any]) -> str:
    rows = []
    for row in result["prompts"]:
        cells: list[str] = [
            row["name"],
            str(row["prompt_tokens"]),
            f"{row['n']}{' (eos)' if row['ref_stopped'] else ''}",
        ]
        for side in ("hicache", "llama_server"):
            s, g = row[side], row[side]["gap"]
            cells += [
                f"{s['agree']}{' (full)' if s['full'] else ''}",
                "" if g is None else f"{g:.2f}",
            ]
        rows.append(cells)
    t, n = result["totals"], len(result["prompts"])
    rows += [
        ["**total**", "", t["n"], f"**{t['hicache']}**", "", f"**{t['llama_server']}**", ""],
        ["median", "", "", f"{t['hicache_median']:g}", "", f"{t['llama_server_median']:g}", ""],
        [
            "full agreement",
            "",
            "",
            f"{t['hicache_full']}/{n}",
            "",
            f"{t['llama_server_full']}/{n}",
            "",
        ],
    ]
    return markdown_table(
        ["prompt", "prompt tokens", "N (ref)", "hicache", "gap", "llama-server", "gap"], rows
    )


def report(result: dict[str, Any]) -> str:
    """The markdown: the run's header, how each side ran, the table, the verdict."""
    t, hi = result["totals"], result["hicache"]
    lines = [
        header_markdown(result),
        "",
        f"- hicache: Engine({hi['engine_args'] or ''}), quantization "
        + f"{hi['model_info'].get('quantization')}",
        f"- llama-server: `{' '.join(result['llama_server']['argv'])}`",
        f"- greedy, {result['config']['new_tokens']} new tokens; every output cut after its "
        + f"first token of {result['stop_ids']}",
        "",
        table(result),
        "",
        "hicache >= llama-server (total tokens before the first difference): "
        + f"**{result['verdict']}** ({t['hicache']} vs {t['llama_server']} of {t['n']})",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    rows = result["prompts"]
    x = range(len(rows))
    fig, ax = subplots(figsize=(10, 4.5))
    ax.bar([i - 0.2 for i in x], [r["hicache"]["agree"] for r in rows], 0.4, label="hicache")
    ax.bar(
        [i + 0.2 for i in x], [r["llama_server"]["agree"] for r in rows], 0.4, label="llama-server"
    )
    ax.scatter(
        list(x),
        [r["n"] for r in rows],
        marker="_",
        s=600,
        color="black",
        zorder=3,
        label="N (reference length)",
    )
    ax.set_xticks(list(x), [r["name"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("tokens before the first difference\nfrom transformers fp32")
    ax.set_ylim(0, max(r["n"] for r in rows) * 1.25)
    t, m = result["totals"], result["machine"]
    ax.set_title(
        f"SmolLM2-135M Q4_1 GGUF, greedy: total hicache {t['hicache']} vs "
        f"llama-server {t['llama_server']} of {t['n']}; {m['cpu_model']}",
        fontsize=9,
    )
    ax.legend(fontsize=8, ncols=3, loc="upper center")
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-server", help="a llama-server binary (default: build once)")
    p.add_argument("--hicache-args", default="{}", help="Engine keyword arguments, as JSON")
    p.add_argument(
        "--llama-args",
        default="",
        help='extra llama-server flags, e.g. "-ctk f32 -ctv f32" (its KV cache is f16 by default)',
    )
    p.add_argument("--out", default="docs/bench_fidelity.json")
    p.add_argument("--plot", default="docs/bench_fidelity.png")
    a = p.parse_args()
    binary = Path(a.llama_server) if a.llama_server else build_llama_server()
    header = Header.now()
    result: dict[str, Any] = {
        "config": {
            "new_tokens": a.new_tokens,
            "threads": a.threads,
            "gguf": Path(default_model_path()).name,
        }
    }
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(resolve_model_dir(None))  # the GGUF dequantized to float32, cached
    prompts = render(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print("transformers fp32 ...", flush=True)
    ref = greedy_reference(model, prompts, a.new_tokens)
    print("hicache Engine ...", flush=True)
    hi = hicache(prompts, a.new_tokens, json.loads(a.hicache_args))
    print("llama-server ...", flush=True)
    ll = llama_server(binary, prompts, a.new_tokens, a.threads, a.llama_args.split())
    stops = hi.stop_ids | ll.stop_ids
    result.update(stop_ids=sorted(stops), hicache=hi.facts, llama_server=ll.facts, prompts=[])
    for i, name in enumerate(PROMPTS):
        r = cut(ref[i], stops)
        row: dict[str, Any] = {
            "name": name,
            "prompt_tokens": len(prompts[i]),
            "n": len(r),
            "ref_stopped": r[-1] in stops,
            "reference": r,
        }
        for side, out in (("hicache", hi.outputs[i]), ("llama_server", ll.outputs[i])):
            o = cut(out, stops)
            n = agreement(r, o)
            row[side] = {
                "agree": n,
                "full": o == r,
                "gap": gap(model, prompts[i], r, o, n),
                "tokens": o,
            }
        result["prompts"].append(row)
    rows = result["prompts"]
    result["totals"] = {
        "n": sum(r["n"] for r in rows),
        **{s: sum(r[s]["agree"] for r in rows) for s in ("hicache", "llama_server")},
        **{f"{s}_median": median(r[s]["agree"] for r in rows) for s in ("hicache", "llama_server")},
        **{f"{s}_full": sum(r[s]["full"] for r in rows) for s in ("hicache", "llama_server")},
    }
    t = result["totals"]
    result["verdict"] = "met" if t["hicache"] >= t["llama_server"] else "not met"
    result.update(header.record([a.plot]))
    if a.plot:
        plot(result, a.plot)
    write_json(a.out, result)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
