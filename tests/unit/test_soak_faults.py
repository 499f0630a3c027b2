"""The soak's status bookkeeping and L3 faults (tools/soaklib/recorder.py, faults.py): which
codes count as an outage answer, and corrupt / delete hitting a file even when L3 is empty at
first."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tools.soaklib.config import SoakConfig
from tools.soaklib.faults import FaultInjector
from tools.soaklib.l3 import L3Dir
from tools.soaklib.recorder import SHUTDOWN_CANCEL, Call, Recorder


def _call(code: str, t: float, first: float | None = None) -> Call:
    return Call("Generate", "plain", code, t - 0.01, t, first=first)


def test_grpc_cancelling_an_untaken_call_at_the_server_stop_is_an_outage_answer():
    rec = Recorder()
    w = rec.open_window()
    t = time.monotonic()
    rec.record(_call("UNAVAILABLE", t), {"OK"})
    rec.record(_call("CANCELLED", t), {"OK"}, SHUTDOWN_CANCEL)  # no response: no handler took it
    assert not rec.violations
    assert rec.take_unavailable()  # the client reconnects, as after UNAVAILABLE
    # a stream that had a response was taken by a handler: the daemon cut it
    rec.record(_call("CANCELLED", t, first=t - 0.005), {"OK"}, SHUTDOWN_CANCEL)
    rec.record(_call("CANCELLED", t), {"OK"}, "Locally cancelled by application!")
    assert len(rec.violations["undocumented status"]) == 2
    rec.close_window(w)
    rec.violations.clear()
    later = time.monotonic() + 60  # past the window (and its margin)
    rec.record(_call("CANCELLED", later), {"OK"}, SHUTDOWN_CANCEL)
    rec.record(_call("UNAVAILABLE", later), {"OK"})
    assert len(rec.violations["undocumented status"]) == 1
    assert len(rec.violations["unexpected status"]) == 1


def _object(l3: L3Dir, name: str) -> Path:
    sub = l3.path / name[:2]
    sub.mkdir(exist_ok=True)
    p = sub / f"{name}.kv"
    p.write_bytes(b"x" * 64)
    return p


def test_corrupt_and_delete_wait_for_a_file_and_hit_one(tmp_path):
    l3 = L3Dir(tmp_path, mount=False)
    rec = Recorder()
    faults = FaultInjector(SoakConfig(), None, l3, rec, lambda msg: None)
    # L3 is empty (a flush) until the traffic stores objects again
    threading.Timer(0.5, lambda: [_object(l3, f"ab{i:02d}") for i in range(3)]).start()
    faults.inject("corrupt")
    assert faults.details["files_corrupted"] > 0
    for p in l3.files():
        p.unlink()
    threading.Timer(0.5, lambda: _object(l3, "cd00")).start()
    faults.inject("delete")
    assert faults.details["files_deleted"] > 0
    assert not rec.violations and faults.injected == {"corrupt": 1, "delete": 1}
