from engine.client.cli import _hoist_global_flags


def test_global_flags_before_the_command_are_moved_after_it():
    assert _hoist_global_flags(["--addr", "h:1", "stats", "--json"]) == \
        ["stats", "--addr", "h:1", "--json"]
    assert _hoist_global_flags(["--addr=h:1", "--tls", "tree"]) == ["tree", "--addr=h:1", "--tls"]
    assert _hoist_global_flags(["stats", "--addr", "h:1"]) == ["stats", "--addr", "h:1"]
    assert _hoist_global_flags(["--help"]) == ["--help"]


def test_tls_flags_before_the_command_are_moved_after_it():
    argv = ["--ca-cert", "ca.pem", "--client-cert=c.pem", "--client-key", "k.pem", "info"]
    assert _hoist_global_flags(argv) == ["info", *argv[:-1]]
