"""The header every benchmark result carries: the command that produced it, when and at which
commit, the CPU and its SIMD flags, torch, the load average at the start and at the end, and the
plots it wrote. In a result's JSON (``Header.record()``, merged into its top level):

    command   "python -m tools.bench_x --flag value" (the interpreter as the user typed it,
              relative to the working directory when under it)
    date      UTC, ISO 8601 to the second, when the run started
    plots     the PNG paths the run wrote ([] for none)
    machine   cpu_model, cpu_count, cpu_flags (the SIMD ones present), gpu (CUDA device names
              when torch was imported and sees one, else null), platform, python, torch,
              torch_threads (null when the benchmark did not import torch), grpcio,
              git_commit, git_dirty, loadavg_start, loadavg_end (1, 5, 15 min)
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tools.benchlib.procs import ROOT

# the flags that decide which CPU kernels run (x86: /proc/cpuinfo "flags"; Arm: "Features")
SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


def cpu_info() -> tuple[str, list[str]]:
    """(model name with x86 family / model when given, the SIMD flags present)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in fields:  # the first processor's
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']} model {fields['model']})"
    present = set((fields.get("flags") or fields.get("Features") or "").split())
    return model, [f for f in SIMD_FLAGS if f in present]


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _command(argv: list[str] | None) -> str:
    """The command line as typed: ``python -m tools.bench_x ...`` for this process's own argv
    when it runs as a module (sys.argv[0] is then the module's file)."""
    exe = os.path.relpath(sys.executable)
    if exe.startswith(".."):
        exe = os.path.basename(sys.executable)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if argv is None:
        argv = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return " ".join(shlex.quote(x) for x in [exe, *argv])


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _torch_facts() -> tuple[int | None, list[str] | None]:
    """(torch's intra-op threads, CUDA device names) when the benchmark imported torch: a
    client-side benchmark should not pay torch's import (nor touch CUDA) for its header."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else None
    )
    return torch.get_num_threads(), gpus


@dataclass(frozen=True)
class Header:
    """A run's header, taken when the run starts (``Header.now()``); the load average at the
    end and the torch facts are read when the record is made."""

    command: str
    date: str
    cpu_model: str
    cpu_count: int
    cpu_flags: tuple[str, ...]
    loadavg_start: tuple[float, ...]
    git_commit: str
    git_dirty: bool

    @classmethod
    def now(cls, argv: list[str] | None = None) -> Header:
        model, flags = cpu_info()
        return cls(
            command=_command(argv),
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            cpu_model=model,
            cpu_count=os.cpu_count() or 1,
            cpu_flags=tuple(flags),
            loadavg_start=tuple(_loadavg()),
            git_commit=_git("rev-parse", "HEAD"),
            git_dirty=bool(_git("status", "--porcelain", "--untracked-files=no")),
        )

    def machine(self) -> dict[str, Any]:
        threads, gpus = _torch_facts()
        return {
            "cpu_model": self.cpu_model,
            "cpu_count": self.cpu_count,
            "cpu_flags": list(self.cpu_flags),
            "gpu": gpus,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "torch_threads": threads,
            "grpcio": _version("grpcio"),
            "git_commit": self.git_commit,
            "git_dirty": self.git_dirty,
            "loadavg_start": list(self.loadavg_start),
            "loadavg_end": _loadavg(),
        }

    def record(self, plots: list[str | None] | None = None) -> dict[str, Any]:
        """The keys a result's JSON carries at its top level; the plots not written (None or
        "") are left out."""
        return {
            "command": self.command,
            "date": self.date,
            "plots": [str(p) for p in plots or [] if p],
            "machine": self.machine(),
        }

    def markdown(self, plots: list[str | None] | None = None, end: bool = True) -> str:
        """The header as the lines above a result's table in docs/benchmarks.md; ``end=False``
        (printed as the run starts) leaves out the load average at the end."""
        record = self.record(plots)
        if not end:
            record["machine"]["loadavg_end"] = None
        return header_markdown(record)


def describe_machine(machine: dict[str, Any] | str) -> str:
    """One line for a plot's title: "2 x AMD EPYC (...), torch 2.13.0" (an older result's
    machine, a string, as it is)."""
    if isinstance(machine, str):
        return machine
    gpu = f"{', '.join(machine['gpu'])}; " if machine.get("gpu") else ""
    return f"{gpu}{machine['cpu_count']} x {machine['cpu_model']}, torch {machine['torch']}"


def header_markdown(record: dict[str, Any]) -> str:
    """Command; date and commit; the machine and its flags; the load average before and after;
    the plots: from a ``Header.record()`` (as a result's JSON holds it)."""
    m = record["machine"]
    dirty = " (uncommitted changes)" if m["git_dirty"] else ""
    threads = f" ({m['torch_threads']} threads)" if m.get("torch_threads") else ""

    def la(xs: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in xs)

    lines = [
        f"Command: `{record['command']}`",
        f"Date: {record['date']}, commit {m['git_commit'][:10]}{dirty}",
        (
            f"Machine: {describe_machine(m)}{threads}; CPU flags: "
            f"{', '.join(m['cpu_flags']) or 'none of the SIMD ones'}"
        ),
        f"Load average (1/5/15 min): {la(m['loadavg_start'])} before"
        + (f", {la(m['loadavg_end'])} after" if m.get("loadavg_end") else ""),
    ]
    if record["plots"]:
        lines.append("Plot: " + ", ".join(f"`{p}`" for p in record["plots"]))
    return "  \n".join(lines)
