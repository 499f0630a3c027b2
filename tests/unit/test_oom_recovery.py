"""OomRecovery: decode while requests run; otherwise settle, then one request at a time, then
fail a lone request; a batch that fits ends it."""

from __future__ import annotations

from engine.runtime.scheduler.oom import OomAction, OomRecovery


def test_recovery_sequence():
    oom = OomRecovery()
    assert oom.on_oom(3, running=True) is OomAction.DECODE
    assert oom.on_oom(3, running=False) is OomAction.ONE_AT_A_TIME  # second miss in a row
    assert oom.prefill_cap == 1
    assert oom.on_oom(1, running=False) is OomAction.FAIL
    assert oom.streak == 0 and oom.prefill_cap == 1  # still one at a time until a batch fits
    assert oom.on_oom(1, running=False) is OomAction.SETTLE
    oom.fitted()
    assert (oom.streak, oom.prefill_cap) == (0, None)
    assert oom.on_oom(2, running=False) is OomAction.SETTLE
