"""The one library of tools/ (its benchmarks and checks), which tests/ uses too; one concept a
module:

    header  the run's header: the command, the date and commit, the CPU and its flags, torch,
            the load average at the start and the end, the plots; as JSON and as markdown
    stats   percentiles and medians (NaN for no samples), as numpy computes them
    table   markdown tables and their cells
    plot    a matplotlib figure without a display, and saving it
    results writing a result's JSON
    procs   free ports, a daemon's environment, a subprocess with a log, polling until ready,
            stopping it
    options ``--opt KEY=VALUE`` engine options
    daemon  `hicache serve` as a subprocess: the one command line tools and tests start it with
    peers   llama.cpp's llama-server (built once) and the SMG gateway, as subprocesses
    valkey  Valkey / Redis servers on leased ports
    inproc  in-process Engine runs: timed requests, steps by tier, per-tier hit counters, the
            engine's warnings counted, the cache configurations, TTFT and hit-rate figures
    reference  transformers' greedy decode, the reference of tokens

This package imports only the light modules above ``options``; the others (which import the
engine, torch, httpx2, redis) are imported from their modules.

A benchmark's JSON carries ``Header.record()``'s keys at its top level: ``command``, ``date``,
``plots`` and ``machine`` (docs/benchmarks.md, "How each result is recorded").
"""

from __future__ import annotations

from tools.benchlib.header import Header, describe_machine
from tools.benchlib.options import parse_options
from tools.benchlib.plot import save_figure, subplots
from tools.benchlib.procs import daemon_env, free_port, stop_process, wait_until
from tools.benchlib.results import write_json
from tools.benchlib.stats import median, percentile, summary
from tools.benchlib.table import cell, markdown_table

__all__ = [
    "Header",
    "cell",
    "daemon_env",
    "describe_machine",
    "free_port",
    "markdown_table",
    "median",
    "parse_options",
    "percentile",
    "save_figure",
    "stop_process",
    "subplots",
    "summary",
    "wait_until",
    "write_json",
]
