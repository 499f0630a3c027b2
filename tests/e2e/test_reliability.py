"""The reliability soak (tools/soak.py) in CI size, on the tiny model: randomized concurrent
clients (multi-turn prompts over shared prefixes, cancels, short deadlines, Abort, duplicate
request ids) with admin RPCs alongside, and faults: L3 files corrupted and deleted, the L3
filesystem read-only and full, kill -9 and restart on the same L3 dir, SIGTERM drain. After each
round: only documented status codes, SERVING, exact KV accounting per tier, greedy outputs equal
to the fresh daemon's; RSS flat over the last two rounds; at the end, every greedy or seeded
answer (whole or cut short) equal to its prompt computed alone on a fresh daemon at the same
settings (tools/soaklib/reference.py).

A storage backend that stalls cannot be chosen in a daemon subprocess (backends are named: file,
redis), so that fault runs in an in-process daemon whose file L3 sits behind
tests/storage_fakes.GatedStorage."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings
from hicache.storage.file.backend import FileStorageBackend
from tests.storage_fakes import GatedStorage
from tools.soak import (
    CLIENT_SIDE,
    DOCUMENTED,
    L3Dir,
    Recorder,
    SoakConfig,
    Traffic,
    Workload,
    check_round,
    format_summary,
    greedy_outputs,
    run_soak,
    wait_idle,
)

TINY = {
    "max_total_tokens": 512,
    "page_size": 16,
    "storage_object_tokens": 16,
    "l3_cap_mb": 16,
    "l3_fs_mb": 32,
    "prefix_tokens": (32, 96),
    "question_tokens": (4, 24),
    "max_new_tokens": 12,
    "max_prompt_tokens": 400,
    "check_prompts": 4,
    "check_new_tokens": 8,
}


def _violations(res_or_rec) -> str:
    v = (
        res_or_rec["violations"]
        if isinstance(res_or_rec, dict)
        else {k: {"count": len(x), "examples": x[:5]} for k, x in res_or_rec.violations.items()}
    )
    return "\n".join(f"{k} x{x['count']}: {x['examples']}" for k, x in v.items())


def test_soak_with_faults(tiny_llama_dir, tmp_path):
    cfg = SoakConfig(
        model=tiny_llama_dir,
        duration_s=35,
        round_s=5,
        clients=3,
        seed=1,
        faults=("corrupt+delete", "readonly+diskfull", "kill9", "sigterm"),
        fault_hold_s=1.5,
        grace_period_s=15,
        work_dir=str(tmp_path / "soak"),
        **TINY,
    )
    res = run_soak(cfg, log=lambda msg: None)
    assert res["passed"], format_summary(res) + "\n" + _violations(res)
    # every call ended with OK or a documented status (client-side ones provoked by the tool)
    assert set(res["codes"]) <= DOCUMENTED | CLIENT_SIDE, res["codes"]
    assert res["codes"].get("OK", 0) > 100 and res["codes"].get("ALREADY_EXISTS", 0) > 0
    done = res["faults_injected"]
    assert {k: done.get(k) for k in ("corrupt", "delete", "kill9", "sigterm")} == {
        "corrupt": 1,
        "delete": 1,
        "kill9": 1,
        "sigterm": 1,
    }, done
    assert res["fault_details"]["files_corrupted"] > 0 and res["fault_details"]["files_deleted"] > 0
    for fault in ("readonly", "diskfull"):  # done, or skipped with the reason
        assert done.get(fault) == 1 or fault in res["faults_skipped"], res["faults_skipped"]
    assert all(r["leaks"] == {"l1": 0, "l2": 0, "l3": 0} for r in res["rounds"])
    assert res["greedy_mismatches"] == 0
    ref = res["reference_check"]
    assert ref["mismatch_count"] == 0 and res["reference_mismatches"] == 0
    # the workload's sampled requests all carry a seed: every answer with a token is checked
    assert ref["unseeded"] == 0 and ref["checked"] + ref["empty"] == ref["answers"]
    assert ref["checked"] > 100 and ref["seeded"] > 0 and ref["partial"] > 0
    assert ref["references"] <= ref["checked"]
    # answers whose prefix came from the lower tiers were among them
    assert ref["served_from"].get("l1", 0) > 0, ref["served_from"]
    assert ref["served_from"].get("l2", 0) + ref["served_from"].get("l3", 0) > 0
    assert res["rss"]["flat"] is True, res["rss"]
    assert len(res["rounds"]) == 7


@pytest.fixture
def stalling_daemon(tiny_llama_dir, tmp_path, monkeypatch):
    """An in-process daemon whose file L3 is a GatedStorage (its reads and writes stall while
    the test holds the gates)."""
    stores: list[GatedStorage] = []

    def build(args, scope, **_):
        store = GatedStorage(
            FileStorageBackend(args.hicache_storage_dir, 1 << 30, reconcile_interval_s=None)
        )
        stores.append(store)
        return store

    monkeypatch.setattr("engine.runtime.hicache_setup.build_storage", build)
    l3 = L3Dir(tmp_path, mount=False)
    args = ServerArgs(
        model_path=tiny_llama_dir,
        max_total_tokens=512,
        page_size=16,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(l3.path),
        hicache_storage_page_size=16,
        hicache_prefetch_threshold=0,
        max_queued_requests=4,
        debug_check_invariants=True,
    )
    # NOTE: one process: the gated backend is patched into this interpreter's engine
    dt = DaemonThread(DaemonSettings(port=0, grace_period_s=2, processes="single"), args).start()
    try:
        yield f"127.0.0.1:{dt.port}", stores[0], l3
    finally:
        stores[0].release_all()
        dt.stop()


def test_stalling_storage_never_stops_serving(tiny_llama_dir, stalling_daemon):
    addr, store, l3 = stalling_daemon
    cfg = SoakConfig(model=tiny_llama_dir, clients=3, seed=2, **TINY)
    rec = Recorder()
    with HicacheClient(addr, timeout=60) as c:
        wl = Workload(c.model_info().vocab_size, cfg)
        reference = greedy_outputs(c, wl.check_prompts, cfg.check_new_tokens)
        wait_idle(c)  # their prefixes are in L3 now; out of L1 / L2 they must come from there
        c.flush(["l1", "l2"])
        assert c.match_prefix(wl.prefixes[0]).matched_per_tier.l3 > 0
        store.writes.close()
        store.reads.close()
        # NOTE: Flush is left out while L3 stalls: test_flush_while_storage_stalls
        traffic = Traffic(addr, cfg, wl, rec, skip_admin=("flush",)).start()
        try:
            assert store.reads.wait_blocked(1, timeout=30) and store.writes.wait_blocked(1, 30)
            ok_before = rec.count("Generate")
            deadline = time.monotonic() + 60
            while rec.count("Generate") < ok_before + 20 and time.monotonic() < deadline:
                time.sleep(0.1)
            served_while_stalled = rec.count("Generate") - ok_before
            stalled = store.reads.waiting + store.writes.waiting
            store.release_all()
            time.sleep(1.0)
        finally:
            store.release_all()
            traffic.pause()
        info = check_round(c, rec, wl, reference, l3)
        traffic.stop()
    assert served_while_stalled >= 20 and stalled >= 1
    assert not rec.violations, _violations(rec)
    assert info["leaks"] == {"l1": 0, "l2": 0, "l3": 0} and info["greedy_mismatches"] == 0
    assert store.get_calls > 0 and store.set_calls > 0


def test_flush_while_storage_stalls(stalling_daemon):
    addr, store, _ = stalling_daemon
    with HicacheClient(addr, timeout=60) as c:
        store.writes.close()
        c.generate_text(list(range(10, 90)), max_new_tokens=4, temperature=0.0)
        assert store.writes.wait_blocked(1)  # a backup is stuck in the store
        got: dict[str, str] = {}

        def flush() -> None:
            try:
                c.flush(["l3"], timeout_s=1.0)
                got["flush"] = "OK"
            except grpc.RpcError as e:
                got["flush"] = e.code().name

        t = threading.Thread(target=flush)
        t.start()
        t.join(8)  # timeout_s is 1 s: the answer comes long before (the scheduler is not held)
        store.release_all()
        t.join(60)
    assert got.get("flush") == "FAILED_PRECONDITION", got


def test_files_not_removed_while_read_only(tmp_path):
    l3 = L3Dir(tmp_path, fs_mb=16)
    if l3.unsupported("readonly"):
        pytest.skip(l3.unsupported("readonly"))
    try:
        store = FileStorageBackend(l3.path, 1 << 24, reconcile_interval_s=None)
        keys = ["obj-a", "obj-b", "obj-c"]
        assert store.batch_set(keys, [torch.ones(8)] * 3) == [True] * 3
        l3.set_readonly(True)
        store.clear()  # what Flush(l3) does
        l3.set_readonly(False)
        store.reconcile()
        on_disk = l3.usage()[0]
        assert store.stats()["objects"] == on_disk  # the index tells the truth about the disk
        assert not any(FileStorageBackend(l3.path, 1 << 24).exists_mask(keys))  # stays flushed
    finally:
        l3.set_readonly(False)
        l3.cleanup()


def test_tool_runs_as_a_script():
    """`python -m tools.soak --help`: the CLI parses and names every fault."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "tools.soak", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    for word in (
        "--duration-s",
        "--clients",
        "--seed",
        "--model",
        "--out",
        "--faults",
        "--daemon-arg",
        "kill9",
        "diskfull",
    ):
        assert word in r.stdout
