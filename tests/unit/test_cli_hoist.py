import subprocess
import sys
from pathlib import Path

from engine.client import cli
from engine.client.cli import _hoist_global_flags


def test_global_flags_before_the_command_are_moved_after_it():
    assert _hoist_global_flags(["--addr", "h:1", "stats", "--json"]) == [
        "stats",
        "--addr",
        "h:1",
        "--json",
    ]
    assert _hoist_global_flags(["--addr=h:1", "--tls", "tree"]) == ["tree", "--addr=h:1", "--tls"]
    assert _hoist_global_flags(["stats", "--addr", "h:1"]) == ["stats", "--addr", "h:1"]
    assert _hoist_global_flags(["--help"]) == ["--help"]


def test_tls_flags_before_the_command_are_moved_after_it():
    argv = ["--ca-cert", "ca.pem", "--client-cert=c.pem", "--client-key", "k.pem", "info"]
    assert _hoist_global_flags(argv) == ["info", *argv[:-1]]


def test_client_commands_do_not_import_torch():
    """`hicache health` is the daemon image's healthcheck: it must not spend seconds importing
    torch (through `serve`'s option definitions) on every run."""
    code = (
        "import sys\nfrom engine.client import cli\n"
        "rc = cli.main(['health', '--addr', '127.0.0.1:1', '--timeout', '0.1'])\n"
        "print(rc, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.split() == [str(cli.EXIT_UNREACHABLE), "False"], out.stderr


def test_serve_still_has_its_options(capsys):
    assert cli.main(["serve", "--port", "x"]) == cli.EXIT_USAGE  # parsed, then refused
    assert "--port" in capsys.readouterr().err
