"""A script that builds an Engine, generates and exits without ``shutdown()`` (issue 12): it
exits cleanly (no "terminate called without an active exception" abort) and every object the
engine had queued for L3 is on disk afterwards, also with a slow store."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys

from hicache.storage.file.backend import FileStorageBackend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = 2  # in parallel: each is a fresh interpreter (torch import included)

SCRIPT = r"""
import json, random, sys

from engine import Engine
from tests.storage_fakes import delay_writes

model, kv, out, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
eng = Engine(model, enable_hierarchical_cache=True, max_total_tokens=512, page_size=16,
             hicache_storage_backend="file", hicache_storage_dir=kv,
             hicache_storage_page_size=16, hicache_prefetch_threshold=0)
tree = eng.scheduler.tree_cache
delay_writes(tree.l3.storage, 0.05)  # a slow store: backups are still queued at exit
rng = random.Random(seed)
prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(60, 140))] for _ in range(8)]
res = eng.generate(prompts, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
# the KV of every token but the last is cached, and backed up in whole objects
keys = [tree.l3.storage_io.keys((p + r.token_ids)[:-1], None) for p, r in zip(prompts, res)]
with open(out, "w") as f:
    json.dump(keys, f)
# exits without eng.shutdown()
"""


def test_exit_without_shutdown_is_clean_and_stores_every_queued_object(tiny_llama_dir, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = []
    for i in range(RUNS):
        kv, out = tmp_path / f"kv{i}", tmp_path / f"keys{i}.json"
        proc = subprocess.Popen(
            [sys.executable, str(script), tiny_llama_dir, str(kv), str(out), str(i)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        runs.append((proc, kv, out))
    results = []
    for proc, kv, out in runs:
        try:
            _, err = proc.communicate(timeout=300)  # a hang guard, not a timing assertion
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        keys = json.loads(out.read_text()) if out.exists() else []
        store = FileStorageBackend(kv, reconcile_interval_s=None)
        stored = sum(sum(store.exists_mask(chain)) for chain in keys)
        results.append(
            (proc.returncode, "terminate called" in err, stored, sum(map(len, keys)), err[-2000:])
        )
    for rc, aborted, stored, queued, err in results:
        assert rc == 0 and not aborted, err
        assert queued > 0 and stored == queued, (stored, queued, err)


def test_shutdown_logs_the_objects_a_hung_store_did_not_take(
    tiny_llama_dir, tmp_path, caplog, monkeypatch
):
    """Shutdown waits for queued L3 backups a bounded time; what a hung store did not take is
    logged (never lost silently) and the backup thread takes no more jobs."""
    from engine import Engine
    from engine.runtime import tree_factory
    from tests.storage_fakes import gate_writes

    monkeypatch.setattr(tree_factory, "L3_DRAIN_S", 0.5)  # how long stop_tree_cache waits
    eng = Engine(
        tiny_llama_dir,
        enable_hierarchical_cache=True,
        max_total_tokens=512,
        page_size=16,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "kv"),
        hicache_storage_page_size=16,
        hicache_prefetch_threshold=0,
    )
    tree = eng.scheduler.tree_cache
    io, gate = tree.l3.storage_io, gate_writes(tree.l3.storage)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 380) for _ in range(100)] for _ in range(6)]
    try:
        res = eng.generate(prompts, {"max_new_tokens": 4, "temperature": 0})
        queued = sum(len(io.keys((p + r.token_ids)[:-1], None)) for p, r in zip(prompts, res))
        with caplog.at_level(logging.WARNING, logger="engine.runtime.engine"):
            eng.shutdown()
    finally:
        gate.open()
    assert io.wait_idle(30)  # the call the store held returns; the queued jobs are skipped
    lost = [r.getMessage() for r in caplog.records if "not stored at shutdown" in r.getMessage()]
    assert len(lost) == 1 and lost[0].startswith(f"L3: {queued} objects not stored"), lost
    assert gate.passed == 1 and tree.l3.storage.stats()["objects"] <= queued
