"""Compiles protos/hicache/v1/*.proto into engine/server/gen with the pinned grpcio-tools, and
the vendored SMG worker protocol (protos/smg/*.proto) into engine/server/gen/smg.

    python -m tools.gen_protos            # regenerate in place
    python -m tools.gen_protos --check    # exit 1 when the committed code drifts

The proto package `hicache.v1` would make protoc emit `from hicache.v1 import ...`, which clashes
with our `hicache` library package, so imports are rewritten to `engine.server.gen.hicache.v1`.
SMG's files import each other by bare name (`import "common.proto"`), which protoc turns into a
top-level `import common_pb2`; those become `from engine.server.gen.smg import common_pb2`.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "engine" / "server" / "gen"
GEN_PACKAGE = "engine.server.gen"
_IMPORT_RE = re.compile(r"^from hicache\.v1 import ", re.MULTILINE)
SMG_PROTO_ROOT = PROTO_ROOT / "smg"
_SMG_IMPORT_RE = re.compile(r"^import (\w+_pb2) as ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "hicache" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc into out_dir; returns the generated files (relative to out_dir)."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    args += [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    files: list[Path] = []
    for pkg in (out_dir, out_dir / "hicache", out_dir / "hicache" / "v1"):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
        files.append(init.relative_to(out_dir))
    for path in sorted((out_dir / "hicache" / "v1").glob("*_pb2*.py*")):
        text = path.read_text()
        text = _IMPORT_RE.sub(f"from {GEN_PACKAGE}.hicache.v1 import ", text)
        path.write_text(text)
        files.append(path.relative_to(out_dir))
    return files + _generate_smg(out_dir, include)


def _generate_smg(out_dir: Path, include: Path) -> list[Path]:
    from grpc_tools import protoc

    smg_dir = out_dir / "smg"
    smg_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{SMG_PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={smg_dir}",
        f"--pyi_out={smg_dir}",
        f"--grpc_python_out={smg_dir}",
    ]
    args += [p.name for p in sorted(SMG_PROTO_ROOT.glob("*.proto"))]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    init = smg_dir / "__init__.py"
    if not init.exists():
        init.write_text("")
    files = [init.relative_to(out_dir)]
    for path in sorted(smg_dir.glob("*_pb2*.py*")):
        text = _SMG_IMPORT_RE.sub(rf"from {GEN_PACKAGE}.smg import \1 as ", path.read_text())
        path.write_text(text)
        files.append(path.relative_to(out_dir))
    return files


def check(out_dir: Path = OUT_DIR) -> list[str]:
    """Regenerates into a temp dir; returns the files that differ from out_dir."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        files = generate(fresh)
        drift = [
            str(f)
            for f in files
            if not (out_dir / f).exists() or not filecmp.cmp(fresh / f, out_dir / f, shallow=False)
        ]
        committed = {
            p.relative_to(out_dir)
            for p in out_dir.rglob("*_pb2*.py*")
            if "__pycache__" not in p.parts
        }
        drift += [f"{f} (stale)" for f in sorted(committed - set(files))]
    return drift


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when the committed code drifts")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ns = ap.parse_args(argv)
    if ns.check:
        drift = check(ns.out)
        for f in drift:
            print(f"drift: {f}", file=sys.stderr)
        return 1 if drift else 0
    for f in generate(ns.out):
        print(ns.out / f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
