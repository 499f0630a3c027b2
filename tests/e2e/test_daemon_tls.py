"""TLS: the daemon serves over TLS with a certificate it is given; a client that trusts the CA
generates, a plaintext client cannot."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from engine.client import HicacheClient
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "server.key", d / "server.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    return str(crt), str(key)


def test_generate_over_tls(tiny_llama_dir, cert):
    crt, key = cert
    dt = DaemonThread(DaemonSettings(port=0, tls_cert=crt, tls_key=key, grace_period_s=1),
                      ServerArgs(model_path=tiny_llama_dir, max_total_tokens=2048)).start()
    try:
        with HicacheClient(f"localhost:{dt.port}", ca_cert=crt, timeout=30) as c:
            assert c.health() == "SERVING"
            _, ids, done = c.generate_text("hello world", max_new_tokens=4, temperature=0.0)
            assert len(ids) == 4 and done.usage.completion_tokens == 4
        with HicacheClient(f"localhost:{dt.port}", timeout=5) as plain:
            with pytest.raises(grpc.RpcError) as e:
                plain.cache_stats()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        dt.stop()
