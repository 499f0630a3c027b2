"""What an installed (non-editable) copy of the project needs besides Python modules is in the
package data: the CPU kernels' C source and every header it includes, which the daemon image
compiles at build time (docker/Dockerfile) and a wheel install at first use."""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "engine" / "runtime" / "layers" / "csrc"


def _local_includes(path: Path) -> set[Path]:
    """``path`` and every file it includes with ``#include "..."``, transitively."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo += [
            p.parent / name
            for name in re.findall(r'^\s*#include\s+"([^"]+)"', p.read_text(), re.MULTILINE)
        ]
    return seen


def test_cpu_kernel_sources_and_headers_are_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["engine"]
    needed = _local_includes(CSRC / "cpu_kernels.c")
    assert len(needed) > 1  # the source includes headers
    for path in sorted(needed):
        assert path.exists(), path
        rel = path.relative_to(ROOT / "engine").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in package-data"
