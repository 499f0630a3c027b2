"""The services as processes: an image's service in a buildah container (`buildah run`, chroot
isolation, inside the service's network namespace), or a stand-in process for an image this
machine cannot pull; started with the service's command, environment and mounts, checked with its
healthcheck the way compose runs it, stopped the way `docker stop` does (SIGTERM, then SIGKILL
after the grace period)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.composelib.net import Network
from tools.composelib.spec import Service

BUILDAH = ["buildah", "--storage-driver", "vfs"]


@dataclass(frozen=True)
class Image:
    name: str
    entrypoint: tuple[str, ...]
    size: str  # as `buildah images` shows it


def inspect_image(name: str) -> Image | None:
    out = subprocess.run(
        [*BUILDAH, "inspect", "--type", "image", name], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        return None
    info = json.loads(out.stdout)
    entrypoint = info["Docker"]["config"].get("Entrypoint") or []
    size = subprocess.run(
        [*BUILDAH, "images", "--json", name], capture_output=True, text=True, check=True
    )
    return Image(name, tuple(entrypoint), str(json.loads(size.stdout)[0]["size"]))


def build(service: Service, flags: Sequence[str], log: Path) -> float:
    """`docker compose build` for one service; returns the seconds it took."""
    assert service.build is not None
    argv = [
        *BUILDAH,
        "bud",
        "--isolation",
        "chroot",
        "--format",
        "docker",
        *flags,
        "-t",
        service.image,
        "-f",
        str(service.build.dockerfile),
        str(service.build.context),
    ]
    start = time.monotonic()
    with open(log, "w") as out:
        subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - start


def _tree(pid: int) -> list[int]:
    """pid and its descendants, parents first. NOTE: a child is listed under the thread that
    forked it, and buildah (Go) forks from any of its threads."""
    found, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        found.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    queue += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return found


def _kill_tree(pid: int) -> None:
    for p in reversed(_tree(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


class Running(ABC):
    """A started service: `main_pid` is what Docker would call the container's PID 1."""

    def __init__(self, service: Service, net: Network, log: Path) -> None:
        self.service, self.net, self.log = service, net, log
        self.popen: subprocess.Popen[str] | None = None

    @abstractmethod
    def argv(self) -> list[str]: ...

    @abstractmethod
    def healthcheck_argv(self) -> list[str]: ...

    @abstractmethod
    def main_pid(self) -> int: ...

    def start(self) -> None:
        with open(self.log, "w") as out:
            self.popen = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )

    def exited(self) -> int | None:
        assert self.popen is not None
        return self.popen.poll()

    def healthcheck(self) -> tuple[bool, str]:
        """One run of the service's healthcheck test, bounded by its timeout."""
        hc = self.service.healthcheck
        assert hc is not None
        with subprocess.Popen(
            self.healthcheck_argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as check:
            try:
                output, _ = check.communicate(timeout=hc.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_tree(check.pid)  # Docker kills a check past its timeout
                check.communicate()
                return False, f"timed out after {hc.timeout_s:g}s"
        return check.returncode == 0, output.strip()

    def stop(self) -> tuple[float, int | None]:
        """`docker stop`: SIGTERM to the main process, SIGKILL to everything after the service's
        stop_grace_period. Returns (seconds until it exited, the main process's exit status as the wrapper saw
        it)."""
        if self.popen is None or self.popen.poll() is not None:
            return 0.0, None if self.popen is None else self.popen.returncode
        start = time.monotonic()
        with contextlib.suppress(ProcessLookupError, RuntimeError):  # gone already
            os.kill(self.main_pid(), signal.SIGTERM)
        try:
            self.popen.wait(timeout=self.service.stop_grace_s)
        except subprocess.TimeoutExpired:
            _kill_tree(self.popen.pid)
            self.popen.wait()
        return time.monotonic() - start, self.popen.returncode

    def rss_bytes(self) -> int:
        """The resident memory of the service's processes, together."""
        assert self.popen is not None
        total = 0
        for pid in _tree(self.main_pid()):
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += sum(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
            except OSError:
                pass
        return total

    def output(self, last: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-last:] if self.log.exists() else ""


class ContainerService(Running):
    """A service of an image built here, in a buildah working container."""

    def __init__(self, service: Service, net: Network, log: Path, image: Image) -> None:
        super().__init__(service, net, log)
        self.image = image
        add_hosts = [f"--add-host={h}" for h in net.hosts()]
        self.container = (
            subprocess.run(
                [*BUILDAH, "from", "--pull-never", *add_hosts, image.name],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )

    def _run(self, command: Sequence[str]) -> list[str]:
        opts = [f"--env={k}={v}" for k, v in self.service.environment]
        for m in self.service.mounts:
            opts.append(f"--volume={m.source}:{m.target}:{'ro' if m.read_only else 'rw'}")
        return [
            *self.net.exec_prefix(self.service.name),
            *BUILDAH,
            "run",
            "--isolation",
            "chroot",
            *opts,
            self.container,
            "--",
            *command,
        ]

    def argv(self) -> list[str]:
        return self._run([*self.image.entrypoint, *self.service.command])

    def healthcheck_argv(self) -> list[str]:
        # `docker exec`: the same container (rootfs, environment, mounts, network)
        assert self.service.healthcheck is not None
        return self._run(self.service.healthcheck.test)

    def main_pid(self) -> int:
        """The container's first process: the first process below `buildah run` that is not
        buildah (which runs its chroot helpers from memfds in between). NOTE: by the
        executable, not the command line, which a process may rewrite (smg calls
        setproctitle)."""
        assert self.popen is not None
        buildah = os.path.realpath(f"/proc/{self.popen.pid}/exe")
        for pid in _tree(self.popen.pid)[1:]:
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if exe != buildah and not exe.startswith("/memfd:buildah"):
                return pid
        raise RuntimeError(f"{self.service.name}: no process under buildah run")

    def remove(self) -> None:
        subprocess.run([*BUILDAH, "rm", self.container], capture_output=True, check=False)


class StandInService(Running):
    """A service whose image cannot be pulled here, run from a local binary in its namespace:
    `binary` replaces the command's argv[0], `extra` follows the command (the image's built-in
    defaults), `healthcheck_stand_in` replaces the healthcheck test's."""

    def __init__(
        self,
        service: Service,
        net: Network,
        log: Path,
        binary: str,
        extra: Sequence[str],
        healthcheck_stand_in: Sequence[str],
    ) -> None:
        super().__init__(service, net, log)
        self.binary, self.extra, self.check = binary, list(extra), list(healthcheck_stand_in)

    def argv(self) -> list[str]:
        return [
            *self.net.exec_prefix(self.service.name),
            self.binary,
            *self.service.command[1:],
            *self.extra,
        ]

    def healthcheck_argv(self) -> list[str]:
        return [*self.net.exec_prefix(self.service.name), *self.check]

    def main_pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid  # `ip netns exec` execs the binary in place
