"""`make run` before the daemon exists: a short chat generation on the embedded model, twice,
so the second request shows a prefix-cache hit."""

from __future__ import annotations

import time

from engine import Engine


def main() -> None:
    print(
        "loading the embedded SmolLM2-135M-Instruct (first start converts the GGUF) ...", flush=True
    )
    t0 = time.perf_counter()
    engine = Engine()
    print(f"loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    try:
        system = (
            "You are a concise assistant for a cache-aware LLM server. Answer in two sentences."
        )
        for question in ("What is a KV cache?", "Why does prefix caching reduce latency?"):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            t0 = time.perf_counter()
            res = engine.generate(msgs, {"max_new_tokens": 64, "temperature": 0.0})
            dt = time.perf_counter() - t0
            print(f"\n> {question}\n{res.text.strip()}")
            print(
                f"[{len(res.token_ids)} tokens in {dt:.2f}s = {len(res.token_ids) / dt:.1f} "
                f"tok/s; prompt {res.prompt_tokens} tokens, prefix-cache hit "
                f"{res.cached_tokens} tokens; finish: {res.finish_reason}]"
            )
        stats = engine.cache_stats()
        print(
            f"\ncache: {stats.l1.hit_tokens} hit tokens, {stats.miss_tokens} computed, "
            f"hit rate {stats.hit_rate:.1%}"
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
