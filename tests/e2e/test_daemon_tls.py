"""TLS: the daemon serves over TLS with a certificate it is given; a client that trusts the CA
generates, a plaintext client cannot. mTLS (`tls_client_ca`): the Python clients and the CLI
present a client certificate signed by that CA; without one (or with another CA's) the handshake
fails -> UNAVAILABLE (CLI exit 3)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from engine.client import AsyncHicacheClient, HicacheClient, cli
from engine.config import ServerArgs
from engine.server.app import DaemonThread
from engine.server.settings import DaemonSettings

ROOT = Path(__file__).resolve().parents[2]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "server.key", d / "server.crt"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=localhost",
        "-addext",
        "subjectAltName=DNS:localhost",
        "-keyout",
        str(key),
        "-out",
        str(crt),
    )
    return str(crt), str(key)


def test_generate_over_tls(tiny_llama_dir, cert):
    crt, key = cert
    dt = DaemonThread(
        DaemonSettings(port=0, tls_cert=crt, tls_key=key, grace_period_s=1),
        ServerArgs(model_path=tiny_llama_dir, max_total_tokens=2048),
    ).start()
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


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA; a server and a client certificate it signs; a self-signed client ("rogue")."""
    d = tmp_path_factory.mktemp("pki")
    p = {
        n: str(d / n)
        for n in (
            "ca.crt",
            "ca.key",
            "server.crt",
            "server.key",
            "client.crt",
            "client.key",
            "rogue.crt",
            "rogue.key",
        )
    }
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        p["ca.key"],
        "-out",
        p["ca.crt"],
    )
    for name, ext in (
        ("server", "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        csr, extfile = d / f"{name}.csr", d / f"{name}.ext"
        extfile.write_text(ext)
        _openssl(
            "req",
            "-new",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            p[f"{name}.key"],
            "-out",
            str(csr),
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            p["ca.crt"],
            "-CAkey",
            p["ca.key"],
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            str(extfile),
            "-out",
            p[f"{name}.crt"],
        )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=rogue",
        "-keyout",
        p["rogue.key"],
        "-out",
        p["rogue.crt"],
    )
    return p


@pytest.fixture(scope="module")
def mtls_addr(tiny_llama_dir, pki):
    settings = DaemonSettings(
        port=0,
        tls_cert=pki["server.crt"],
        tls_key=pki["server.key"],
        tls_client_ca=pki["ca.crt"],
        grace_period_s=1,
    )
    dt = DaemonThread(settings, ServerArgs(model_path=tiny_llama_dir, max_total_tokens=2048))
    dt.start()
    yield f"localhost:{dt.port}"
    dt.stop()


def test_mtls_client_certificate(mtls_addr, pki):
    mine = {"client_cert": pki["client.crt"], "client_key": pki["client.key"]}
    with HicacheClient(mtls_addr, ca_cert=pki["ca.crt"], timeout=30, **mine) as c:
        assert c.server_info().version
        _, ids, done = c.generate_text("hello world", max_new_tokens=3, temperature=0.0)
        assert len(ids) == 3 and done.usage.completion_tokens == 3

    async def run() -> str:
        async with AsyncHicacheClient(mtls_addr, ca_cert=pki["ca.crt"], timeout=30, **mine) as ac:
            return (await ac.server_info()).version

    assert asyncio.run(run())
    rogue = {"client_cert": pki["rogue.crt"], "client_key": pki["rogue.key"]}
    for kw in ({}, rogue):  # no client certificate; one the daemon's CA did not sign
        with HicacheClient(mtls_addr, ca_cert=pki["ca.crt"], timeout=5, **kw) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.server_info()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_options_are_checked(pki, tmp_path):
    with pytest.raises(ValueError, match="client_cert and client_key"):
        HicacheClient("localhost:1", client_cert=pki["client.crt"])
    with pytest.raises(ValueError, match="client_cert and client_key"):
        AsyncHicacheClient("localhost:1", client_key=pki["client.key"])
    with pytest.raises(FileNotFoundError):
        HicacheClient(
            "localhost:1", client_cert=str(tmp_path / "nope.crt"), client_key=pki["client.key"]
        )


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"
    }
    return {**env, **extra}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.client.cli", *args],
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_mtls(mtls_addr, pki):
    ca = ["--ca-cert", pki["ca.crt"]]
    mine = ["--client-cert", pki["client.crt"], "--client-key", pki["client.key"]]
    r = _cli("info", "--addr", mtls_addr, *ca, *mine)
    assert r.returncode == cli.EXIT_OK, r.stderr
    assert "version:" in r.stdout
    r = _cli(*ca, *mine, "generate", "hello", "-n", "2", "-t", "0", "--addr", mtls_addr)
    assert r.returncode == cli.EXIT_OK, r.stderr  # the global flags before the command
    env = _env(
        HICACHE_ADDR=mtls_addr,
        HICACHE_CA_CERT=pki["ca.crt"],
        HICACHE_CLIENT_CERT=pki["client.crt"],
        HICACHE_CLIENT_KEY=pki["client.key"],
    )
    r = _cli("info", env=env)
    assert r.returncode == cli.EXIT_OK, r.stderr
    r = _cli("info", "--addr", mtls_addr, *ca)
    assert r.returncode == cli.EXIT_UNREACHABLE, r.stderr
    assert "UNAVAILABLE" in r.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--client-cert", "@client.crt"], {}, "--client-cert and --client-key go together"),
        (["--client-key", "@client.key"], {}, "--client-cert and --client-key go together"),
        ([], {"HICACHE_CLIENT_CERT": "@client.crt"}, "--client-cert and --client-key go"),
        (["--client-cert", "@missing", "--client-key", "@client.key"], {}, "--client-cert"),
        (["--ca-cert", "@missing"], {}, "--ca-cert"),
    ],
)
def test_cli_client_certificate_usage_errors(
    pki, tmp_path, monkeypatch, capsys, args, env, message
):
    paths = {**pki, "missing": str(tmp_path / "missing.pem")}

    def path(a: str) -> str:  # "@name" -> the file's path
        return paths[a[1:]] if a.startswith("@") else a

    for k in [k for k in os.environ if k.startswith("HICACHE_") and k != "HICACHE_MODEL_CACHE"]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, path(v))
    argv = ["info", "--addr", "localhost:1", *map(path, args)]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    if "@missing" in args:
        assert paths["missing"] in err
