"""The soak's reference check (tools/soaklib/reference.py) on recorded answers and a fake model:
it passes on answers equal to the prompt computed alone, flags one changed token with what is
needed to debug it, computes each (prompt, sampling params) once at the longest length asked,
checks seeded sampled answers and partial ones, and leaves unseeded sampled answers alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tools.soaklib.recorder import Answer, Recorder
from tools.soaklib.reference import check_answers, first_difference, flag_mismatches

STOP_AT = 6  # the fake model's EOS: the 6th token, unless ignore_eos
PROMPT_A = [11, 12, 13, 14, 15]
PROMPT_B = [11, 12, 13, 99]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "ignore_eos": True}


def fake_model(prompt: list[int], sampling: dict[str, Any]) -> list[int]:
    """Deterministic in (prompt, seed); max_new_tokens only cuts the answer."""
    seed = sampling.get("seed", 0) if sampling.get("temperature") else 0
    ids = [(sum(prompt) * 31 + seed * 7 + i * 13) % 1000 for i in range(sampling["max_new_tokens"])]
    return ids if sampling.get("ignore_eos") else ids[:STOP_AT]


class CountingModel:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict[str, Any]]] = []

    def __call__(self, prompt: list[int], sampling: dict[str, Any]) -> list[int]:
        self.calls.append((prompt, sampling))
        return fake_model(prompt, sampling)


def served(
    rec: Recorder,
    variant: str,
    prompt: list[int],
    sampling: dict[str, Any],
    n: int,
    *,
    got: int | None = None,
    code: str = "OK",
    finish: str = "LENGTH",
    t0: float = 100.0,
    cached: tuple[int, int, int, int] | None = None,
) -> Answer:
    """Records the answer the fake model gives (``got``: only its first ``got`` tokens, as a
    stream cut short receives)."""
    sp = {**sampling, "max_new_tokens": n}
    ids = fake_model(prompt, sp)
    return rec.answer(
        variant,
        prompt,
        sp,
        ids if got is None else ids[:got],
        code=code,
        finish=finish,
        rid=f"r{len(rec.answers)}",
        namespace="soak-a",
        cached=cached or (16, 0, 0, len(prompt)),
        t0=t0,
        t1=t0 + 1.0,
    )


def soak_answers() -> Recorder:
    rec = Recorder()
    rec.phase = "round 2 (kill9)"
    served(rec, "plain", PROMPT_A, GREEDY, 4)
    served(rec, "plain", PROMPT_A, GREEDY, 9, cached=(0, 16, 0, 5))  # the longest: 9
    served(rec, "cancel", PROMPT_A, GREEDY, 9, got=2, code="CANCELLED", finish="")
    served(rec, "abort", PROMPT_A, GREEDY, 9, got=3, finish="ABORT")
    served(rec, "plain", PROMPT_A, {"temperature": 0.0, "ignore_eos": False}, 12, finish="STOP")
    served(rec, "plain", PROMPT_B, GREEDY, 3, cached=(0, 0, 16, 4))
    served(rec, "plain", PROMPT_B, SEEDED, 5)
    served(rec, "deadline", PROMPT_B, GREEDY, 5, got=0, code="DEADLINE_EXCEEDED", finish="")
    unseeded = {"temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
    a = served(rec, "plain", PROMPT_B, unseeded, 5)
    # no reference exists for an unseeded draw: even a changed one is not checked
    rec.answers[a.seq] = dataclasses.replace(a, ids=(a.ids[0] + 1, *a.ids[1:]))
    rec.fault("kill9", 95.0, 99.5)  # ended 0.5 s before the answers started
    rec.fault("corrupt", 300.0, 301.0)  # long after: not around them
    return rec


def with_token_changed(rec: Recorder, seq: int, pos: int) -> None:
    a = rec.answers[seq]
    ids = list(a.ids)
    ids[pos] = (ids[pos] + 1) % 1000
    rec.answers[seq] = dataclasses.replace(a, ids=tuple(ids))


def test_equal_answers_pass_with_one_reference_per_prompt_and_params():
    rec = soak_answers()
    model = CountingModel()
    rep = check_answers(rec.answers, model, rec.faults)
    assert rep.mismatches == []
    # A greedy at the longest asked (9), A with EOS, B greedy (the empty answer adds nothing),
    # B seeded
    assert [(p, sp["max_new_tokens"]) for p, sp in model.calls] == [
        (PROMPT_A, 9),
        (PROMPT_A, 12),
        (PROMPT_B, 3),
        (PROMPT_B, 5),
    ]
    assert rep.references == 4 and rep.answers == 9
    assert (rep.checked, rep.whole, rep.partial) == (7, 5, 2)
    assert (rep.greedy, rep.seeded, rep.unseeded, rep.empty) == (6, 1, 1, 1)
    assert rep.served_from == {"l1": 5, "l2": 1, "l3": 1}
    flag_mismatches(rec, rep)
    assert not rec.violations


@pytest.mark.parametrize(
    "seq, pos, whole, kind",
    [
        (1, 3, True, "plain greedy l2"),
        (0, 0, True, "plain greedy l1"),
        (3, 2, False, "abort greedy l1"),
        (6, 4, True, "plain sampled l1"),
    ],
)
def test_one_changed_token_is_a_mismatch_with_its_details(seq, pos, whole, kind):
    rec = soak_answers()
    with_token_changed(rec, seq, pos)
    rep = check_answers(rec.answers, fake_model, rec.faults)
    assert len(rep.mismatches) == 1
    m = rep.mismatches[0]
    a = rec.answers[seq]
    assert m.answer == a and m.position == pos and a.whole is whole
    assert m.expected[pos] != a.ids[pos] and m.expected[:pos] == a.ids[:pos]
    text = m.describe()
    assert f"answer #{seq} {a.variant} r{seq}" in text
    assert f"prompt p{0 if a.prompt == tuple(PROMPT_A) else 1} crc32 " in text
    assert f"first difference at token {pos}" in text
    assert "l1=" in text and f"of {len(a.prompt)}" in text
    assert "round 2 (kill9)" in text and "kill9 (ended 0.5s before it started)" in text
    assert "corrupt" not in text
    assert ("sampled temperature=0.8 top_p=0.9 seed=1234" in text) == (seq == 6)
    flag_mismatches(rec, rep)
    assert rec.violations["reference mismatch"] == [text]
    d = m.to_dict()
    assert d["served"] == list(a.ids) and d["prompt"] == list(a.prompt)
    out = rep.to_dict()
    assert out["mismatch_count"] == 1 and out["mismatch_kinds"] == {kind: 1}


def test_answer_stopped_early_or_running_past_the_reference_is_a_mismatch():
    rec = Recorder()
    a = served(rec, "plain", PROMPT_A, GREEDY, 8)
    rec.answers[0] = dataclasses.replace(a, ids=a.ids[:5], finish="STOP")  # an EOS too early
    b = served(
        rec,
        "cancel",
        PROMPT_A,
        {"temperature": 0.0, "ignore_eos": False},
        12,
        got=STOP_AT,
        code="CANCELLED",
        finish="",
    )
    rec.answers[1] = dataclasses.replace(b, ids=(*b.ids, 7))  # went on past the EOS
    rep = check_answers(rec.answers, fake_model)
    assert [(m.answer.seq, m.position) for m in rep.mismatches] == [(0, 5), (1, STOP_AT)]


def test_an_answer_without_max_new_tokens_is_refused():
    rec = Recorder()
    rec.answer(
        "plain", PROMPT_A, {"temperature": 0.0}, [1, 2], code="OK", finish="LENGTH", t0=0.0, t1=1.0
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_answers(rec.answers, fake_model)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [4]) == 0
