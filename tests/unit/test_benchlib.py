"""tools/benchlib: the percentiles against numpy, the markdown tables, the run header's fields,
a plot written to a file, the JSON writer, the option parser and the process helpers."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tools.benchlib import (
    Header,
    cell,
    daemon_env,
    describe_machine,
    free_port,
    markdown_table,
    median,
    parse_options,
    percentile,
    save_figure,
    stop_process,
    subplots,
    summary,
    wait_until,
    write_json,
)
from tools.benchlib.header import header_markdown


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentiles_equal_numpy(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert median(xs) == pytest.approx(float(np.median(xs)), rel=1e-12)
    s = summary(xs, scale=1000.0)
    a = np.asarray(xs) * 1000.0
    assert s == pytest.approx(
        {
            "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()),
        }
    )


def test_no_samples_and_nan_samples() -> None:
    assert math.isnan(percentile([], 50)) and math.isnan(median([]))
    assert summary([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert summary([], qs=(50, 99)) == {"p50": None, "p99": None, "mean": None}
    # a failed step's NaN is left out, not propagated
    assert median([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert math.isnan(median([math.nan]))
    assert median(x for x in (5, 1, 4)) == 4.0  # any iterable


def test_markdown_table() -> None:
    t = markdown_table(["a", "b", "c"], [[1, "x", 2.5], ["FAILED: boom"]])
    assert t.splitlines() == [
        "| a | b | c |",
        "|---|---|---|",
        "| 1 | x | 2.5 |",
        "| FAILED: boom |  |  |",
    ]
    assert markdown_table(["only"], []) == "| only |\n|---|"


def test_cell_formats() -> None:
    assert cell(1.2345) == "1.2"
    assert cell(0.0123, ".0f", 1e3) == "12"
    assert cell(0.5, ".0%") == "50%"
    assert cell(None) == "—" and cell(math.nan, missing="-") == "-"


def test_header_command_of_a_module_run(monkeypatch) -> None:
    """`python -m tools.bench_x ...` is recorded as typed, not as the module's file path."""
    import types

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="tools.bench_x")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/somewhere/tools/bench_x.py", "--flag", "a b"])
    assert Header.now().command.endswith(" -m tools.bench_x --flag 'a b'")


def test_header_fields() -> None:
    h = Header.now(["tools/bench_x.py", "--flag", "a b"])
    assert h.command.endswith("tools/bench_x.py --flag 'a b'")
    rec = h.record(["plot.png", None, ""])
    assert set(rec) == {"command", "date", "plots", "machine"}
    assert rec["plots"] == ["plot.png"]
    m = rec["machine"]
    for key in (
        "cpu_model",
        "cpu_count",
        "cpu_flags",
        "gpu",
        "platform",
        "python",
        "torch",
        "torch_threads",
        "grpcio",
        "git_commit",
        "git_dirty",
        "loadavg_start",
        "loadavg_end",
    ):
        assert key in m, key
    assert m["cpu_model"] and m["cpu_count"] >= 1
    assert isinstance(m["cpu_flags"], list) and len(m["loadavg_start"]) == 3
    assert len(m["loadavg_end"]) == 3 and len(m["git_commit"]) == 40  # this checkout's HEAD
    assert rec["date"].endswith("+00:00")
    json.dumps(rec)  # JSON as it is
    md = h.markdown(["plot.png"])
    for text in (
        "Command: `",
        "tools/bench_x.py --flag 'a b'`",
        "CPU flags:",
        "Load average (1/5/15 min):",
        " after",
        "Plot: `plot.png`",
        m["cpu_model"],
    ):
        assert text in md, text
    assert " after" not in h.markdown(end=False)
    assert header_markdown(rec) == md


def test_describe_machine() -> None:
    m = Header.now([]).record()["machine"]
    assert describe_machine(m).startswith(f"{m['cpu_count']} x {m['cpu_model']}, torch ")
    assert (
        describe_machine("x86_64, 2 cores, torch 2.13.0+cpu") == "x86_64, 2 cores, torch 2.13.0+cpu"
    )


def test_plot_written(tmp_path) -> None:
    fig, ax = subplots(1, 2, figsize=(4, 2))
    ax[0].bar(["a", "b"], [1, 2])
    path = save_figure(fig, tmp_path / "sub" / "p.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_write_json(tmp_path) -> None:
    out = tmp_path / "d" / "r.json"
    assert write_json(out, {"a": [1, 2.5], "p": tmp_path}) == str(out)
    assert json.loads(out.read_text()) == {"a": [1, 2.5], "p": str(tmp_path)}


def test_parse_options() -> None:
    assert parse_options(["page_size=16", "x=1.5", "on=true", "name=file", "l=[1, 2]", "e="]) == {
        "page_size": 16,
        "x": 1.5,
        "on": True,
        "name": "file",
        "l": [1, 2],
        "e": "",
    }
    with pytest.raises(ValueError):
        parse_options(["no_value"])


def test_free_port_wait_until_and_stop() -> None:
    port = free_port()
    assert 0 < port < 65536
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 3, "thing", interval_s=0.001) >= 0
    assert len(calls) == 3
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, "never", timeout_s=0.05, interval_s=0.01)

    def refused() -> bool:
        raise ConnectionRefusedError

    with pytest.raises(TimeoutError):  # an OSError counts as not ready yet
        wait_until(refused, "refusing", timeout_s=0.05, interval_s=0.01)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    with pytest.raises(RuntimeError, match="exited"):
        wait_until(lambda: False, "it", proc=done)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(sleeper, timeout_s=10) == -15  # SIGTERM ended it
    assert stop_process(sleeper) == -15 and stop_process(None) is None


def test_daemon_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HICACHE_PAGE_SIZE", "64")
    monkeypatch.setenv("HICACHE_MODEL_CACHE", "/models")
    env = daemon_env(tmp_path, "info")
    assert "HICACHE_PAGE_SIZE" not in env and env["HICACHE_MODEL_CACHE"] == "/models"
    assert env["XDG_CACHE_HOME"] == str(tmp_path / "xdg") and env["HICACHE_LOG_LEVEL"] == "info"
    assert env["PATH"] == os.environ["PATH"]
    from tools.benchlib.procs import ROOT

    # it runs in its work dir: this checkout's engine first on its import path
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_process_log_and_failure(tmp_path) -> None:
    """A process's output lands in its log, a restart's appended; a wait that ends because the
    process exited says so with the log's tail."""
    from tools.benchlib.procs import Process

    p = Process(tmp_path / "p.log")
    for word in ("first", "second"):
        p.spawn([sys.executable, "-c", f"print({word!r}); raise SystemExit(3)"])
        assert p.proc is not None and p.proc.wait(60) == 3
    assert p.log_tail().split() == ["first", "second"]
    with pytest.raises(RuntimeError, match=r"exited \(3\)[^\n]*:\nfirst\nsecond"):
        p.wait_ready(lambda: False, "it", timeout_s=60)
    assert p.stop() == 3


def test_daemon_command_line_and_log_problems(tmp_path) -> None:
    from tools.benchlib.daemon import Daemon

    d = Daemon(tmp_path / "w", ["--page-size", "16"], model="/m")
    serve = d.argv[d.argv.index("serve") :]
    assert serve == ["serve", "--port", str(d.port), "--http-port", str(d.http_port)] + [
        "--model",
        "/m",
        "--page-size",
        "16",
    ]
    assert d.port != d.http_port and d.url.endswith(f":{d.http_port}") and d.log.parent.is_dir()
    grpc_only = Daemon(tmp_path / "g", http=False, name="ref")
    assert "--http-port" not in grpc_only.argv and grpc_only.log.name == "ref.log"
    d.log.write_text(
        "2026 INFO x: fine\n2026 WARNING x: slow\n2026 ERROR x: bad\n"
        "Traceback (most recent call last):\n2026 CRITICAL x: worse\n"
    )
    assert d.log_problems() == [
        "daemon.log:3: 2026 ERROR x: bad",
        "daemon.log:4: Traceback (most recent call last):",
        "daemon.log:5: 2026 CRITICAL x: worse",
    ]
