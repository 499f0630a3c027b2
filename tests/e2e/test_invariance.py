"""A cache never changes the answer. At the defaults a user gets (the embedded SmolLM2,
``quantization="auto"`` = int4) and with ``int8`` and ``none``: a prompt's generated tokens and
the logits of every step (its prefill's and each decode step's) are bitwise the same

    - alone, on an empty cache (the reference);
    - at random places in batches of 1-16 other prompts;
    - with its document cached in L1 by another question;
    - with its prefix loaded back from L2, read from L3, and from L3 after a restart;
    - with chunked prefill of 64, 256 and 2,048 tokens, and page sizes 1, 16 and 64.

Every step's logits are recorded where the scheduler samples them (the runner's ``sample``),
keyed by the request's prompt and the position they predict."""

from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest
import torch

from engine import Engine
from engine.runtime import cache_admin

pytestmark = pytest.mark.slow
NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}

DOC = (
    "The hierarchical cache keeps the key and value tensors of every prompt it has seen in "
    "three tiers. The first tier lives in device memory and serves a hit at once. The second "
    "tier is pinned host memory, several times larger, from which a prefix is copied back "
    "layer by layer while the model already computes the first layers. The third tier is "
    "storage: files on a local disk, or a Redis or Valkey server that many daemons share, so "
    "a restarted daemon or a neighbour finds what another one computed. A radix tree maps token "
    "sequences to the slots that hold their tensors, and a controller moves pages between the "
    "tiers with write and load queues. When memory is short, the least recently used prefixes "
    "move down a tier instead of being dropped, and a request whose prefix sits in storage is "
    "admitted once the prefetch has landed. "
)
QUESTIONS = [
    "What are the three tiers? Answer in one sentence.",
    "How does a restarted daemon find earlier work?",
    "What happens when memory is short?",
    "Summarise the text in five words.",
]
OTHERS = [
    (
        "Write a short poem about the sea. It should have four lines, mention the tide, the wind and "
        "a lighthouse, and end on a hopeful note. Avoid rhyming the first and last lines, and keep "
        "each line under ten words so that it reads well aloud to a child at bedtime."
    ),
    (
        "List four prime numbers between ten and fifty, and for each one explain in a sentence why "
        "it has no divisors other than one and itself. Then say which of them is the sum of two "
        "other primes from your list, if any, and show the addition step by step."
    ),
]


def _prompts(eng: Engine) -> list[list[int]]:
    return [eng.tokenize(f"{DOC}\n\n{q}", chat=True) for q in QUESTIONS] + [
        eng.tokenize(o, chat=True) for o in OTHERS
    ]


def _fillers(rng: random.Random, n: int) -> list[list[int]]:
    """Unrelated prompts of random lengths (plain tokens of SmolLM2's vocabulary)."""
    return [[rng.randrange(200, 49000) for _ in range(rng.randrange(5, 300))] for _ in range(n)]


class Recorder:
    """Every logits row the scheduler samples from: ``steps[prompt][position]`` is the logits
    predicting token ``position`` of the sequence (prompt + output so far)."""

    def __init__(self, eng: Engine) -> None:
        self.steps: dict[tuple[int, ...], dict[int, torch.Tensor]] = defaultdict(dict)
        runner = eng.runner
        real = runner.sample

        def sample(logits: torch.Tensor, reqs: list) -> torch.Tensor:
            for i, req in enumerate(reqs):
                self.steps[tuple(req.origin_input_ids)][req.kv.kv_alloc] = logits[i].clone()
            return real(logits, reqs)

        eng.call_in_scheduler(lambda s: setattr(runner, "sample", sample))


def _run(eng: Engine, rec: Recorder, prompts: list[list[int]]) -> list:
    """The prompts submitted together (one batch as far as the scheduler allows)."""
    for p in prompts:
        rec.steps.pop(tuple(p), None)
    return eng.generate(prompts, GREEDY)


def _check(ref: dict, rec: Recorder, prompt: list[int], out, where: str) -> None:
    tokens, logits = ref[tuple(prompt)]
    assert out.token_ids == tokens, where
    got = rec.steps[tuple(prompt)]
    n = len(prompt)
    for pos in range(n, n + NEW):  # the prefill's last row, then each decode step
        assert pos in got, (where, pos)
        assert torch.equal(got[pos], logits[pos]), (
            where,
            pos - n,
            (got[pos] - logits[pos]).abs().max().item(),
        )


def _flush(eng: Engine) -> None:
    eng.call_in_scheduler(lambda s: cache_admin.flush(s))


def _wait_in_l3(eng: Engine, prompts: list[list[int]]) -> None:
    """Until L3 holds every prompt's prefix that has KV, whole objects (the backups run on their
    own thread; L2 may only be flushed once they landed)."""
    size = eng.server_args.hicache_storage_page_size
    for p in prompts:
        want = (len(p) - 1) // size * size
        eng.call_in_scheduler(lambda s: cache_admin.settle(s.tree_cache))
        deadline = time.monotonic() + 60
        while eng.call_in_scheduler(lambda s, p=p: s.tree_cache.l3.storage_prefix_len(p)) < want:
            assert time.monotonic() < deadline, "the L3 backups did not land"
            time.sleep(0.02)


def _alone_batched_l1(quantization: str) -> tuple[list[list[int]], dict]:
    """The references (each prompt alone on an empty cache, every other option at its
    default), then the same engine with company: batches of 1-16 at random places, and the
    document cached in L1 by another question."""
    with Engine(quantization=quantization, max_total_tokens=16384) as eng:
        assert eng.model_info()["batch_invariant"] is True
        rec = Recorder(eng)
        prompts = _prompts(eng)
        ref = {}
        for p in prompts:
            _flush(eng)
            out = _run(eng, rec, [p])[0]
            assert out.cached_tokens == 0
            ref[tuple(p)] = (out.token_ids, dict(rec.steps[tuple(p)]))
        rng = random.Random(quantization)
        for trial in range(3):
            _flush(eng)
            batch = _fillers(rng, rng.randrange(0, 14))
            for p in rng.sample(prompts, 3):
                batch.insert(rng.randrange(len(batch) + 1), p)
            outs = _run(eng, rec, batch)
            for p, o in zip(batch, outs):
                if tuple(p) in ref:
                    _check(ref, rec, p, o, f"in a batch of {len(batch)}, trial {trial}")
        _flush(eng)
        _run(eng, rec, [prompts[0]])
        for p in prompts[1:4]:
            out = _run(eng, rec, [p])[0]
            assert out.cached_tokens_per_tier.get("l1", 0) > 100
            _check(ref, rec, p, out, "document in L1")
    return prompts, ref


# page size, chunked prefill size, L2 layout per quantization: each of the page sizes and chunk
# sizes appears at the defaults (auto = int4; page 1 and chunk 2048 are the references' own)
TIER_CASES = {
    "auto": [(16, 256, "layer_first"), (64, 64, "page_first")],
    "int8": [(64, 256, "layer_first")],
    "none": [(16, 64, "page_first")],
}


@pytest.mark.parametrize("quantization", ["auto", "int8", "none"])
def test_same_answer_alone_batched_and_from_every_tier(quantization, tmp_path):
    prompts, ref = _alone_batched_l1(quantization)
    for page_size, chunk, layout in TIER_CASES[quantization]:
        opts = {
            "quantization": quantization,
            "page_size": page_size,
            "chunked_prefill_size": chunk,
            "max_total_tokens": 8192,
            "enable_hierarchical_cache": True,
            "hicache_mem_layout": layout,
            "hicache_storage_backend": "file",
            "hicache_storage_dir": str(tmp_path / f"kv{page_size}"),
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_prefetch_threshold": 0,
            "debug_check_invariants": True,
        }
        where = f"page {page_size}, chunk {chunk}, {layout}"
        with Engine(**opts) as eng:
            rec = Recorder(eng)
            cold = _run(eng, rec, prompts)  # one batch, prefilled in chunks
            for p, o in zip(prompts, cold):
                _check(ref, rec, p, o, f"{where}: cold batch")
            for p in prompts:  # each with nothing in L1: its prefix from L2
                _wait_in_l3(eng, prompts)
                eng.call_in_scheduler(lambda s: cache_admin.evict(s, "l1"))
                out = _run(eng, rec, [p])[0]
                assert out.cached_tokens_per_tier.get("l2", 0) > 0, (where, out)
                _check(ref, rec, p, out, f"{where}: prefix from L2")
            for p in prompts:  # each with nothing in L1 or L2: its prefix from L3
                _wait_in_l3(eng, prompts)
                eng.call_in_scheduler(lambda s: cache_admin.flush(s, ["l1", "l2"]))
                out = _run(eng, rec, [p])[0]
                assert out.cached_tokens_per_tier.get("l3", 0) > 0, (where, out)
                _check(ref, rec, p, out, f"{where}: prefix from L3")
        with Engine(**opts) as eng:  # a restart: only L3 survives
            rec = Recorder(eng)
            outs = _run(eng, rec, prompts)
            # the first of the document's questions reads it from L3, the others share it
            assert all(o.cached_tokens > 0 for o in outs), where
            assert sum(o.cached_tokens_per_tier.get("l3", 0) > 0 for o in outs) >= 3, where
            for p, o in zip(prompts, outs):
                _check(ref, rec, p, o, f"{where}: prefix from L3 after a restart")
