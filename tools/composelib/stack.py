"""`docker compose up` / `down` for a Project, by hand: services started in depends_on order,
each dependency's condition awaited first (service_healthy: its healthcheck run the way Docker
runs it: every `interval`, the first one `interval` after the start, failures inside
`start_period` not counted, unhealthy after `retries` failures in a row), and stopped in reverse
order the way `docker compose down` does."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tools.composelib.containers import ContainerService, Running
from tools.composelib.net import Network, kill_inside
from tools.composelib.spec import Project, Service

Say = Callable[[str], None]


@dataclass(frozen=True)
class Health:
    healthy: bool
    seconds: float  # from the service's start to the verdict
    checks: int  # healthcheck runs
    output: str  # the last run's output


class Unhealthy(RuntimeError):
    pass


class Stack:
    """The services of one `up`, by name; `make` turns a Service into a Running (a container,
    or a stand-in for an image that cannot be pulled)."""

    def __init__(
        self,
        project: Project,
        net: Network,
        workdir: Path,
        make: Callable[[Service, Path], Running],
        say: Say,
    ) -> None:
        self.project, self.net, self.workdir, self.say = project, net, workdir, say
        self._make = make
        self.running: dict[str, Running] = {}
        self.started_at: dict[str, float] = {}
        self.health: dict[str, Health] = {}

    def up(self) -> None:
        """Every service's container created first (compose's create phase), then the services
        started in waves, each dependency's condition met before its dependents start."""
        for name, service in self.project.services.items():
            self.running[name] = self._make(service, self.workdir / f"{name}.log")
        self.say("created: " + ", ".join(self.running))
        for wave in self.project.start_order():
            for name in wave:
                for dep, condition in self.project.services[name].depends_on:
                    if condition == "service_healthy" and dep not in self.health:
                        raise AssertionError(f"{name} waits on {dep}, which was not awaited")
            for name in wave:
                self._start(name)
            awaited = sorted(
                {
                    d
                    for n, s in self.project.services.items()
                    for d, c in s.depends_on
                    if c == "service_healthy"
                }
                & set(wave)
            )
            with ThreadPoolExecutor(max(1, len(awaited))) as pool:
                for name, health in zip(awaited, pool.map(self.wait_healthy, awaited), strict=True):
                    self.health[name] = health
                    self.say(
                        f"{name}: {'healthy' if health.healthy else 'UNHEALTHY'} "
                        f"{health.seconds:.0f} s after its start ({health.checks} "
                        f"healthcheck runs; last: {health.output!r})"
                    )
                    if not health.healthy:
                        raise Unhealthy(
                            f"dependency failed to start: {name} is unhealthy\n"
                            f"{self.running[name].output()}"
                        )

    def _start(self, name: str) -> None:
        service = self.project.services[name]
        run = self.running[name]
        run.start()
        self.started_at[name] = time.monotonic()
        self.say(f"{name}: started: {shlex.join(service.command)}")

    def wait_healthy(self, name: str) -> Health:
        run = self.running[name]
        hc = self.project.services[name].healthcheck
        assert hc is not None, f"{name} has no healthcheck"
        start = self.started_at[name]
        failures, checks, output = 0, 0, ""
        while True:
            time.sleep(max(0.0, start + (checks + 1) * hc.interval_s - time.monotonic()))
            if run.exited() is not None:
                return Health(
                    False, time.monotonic() - start, checks, f"exited with status {run.exited()}"
                )
            ok, output = run.healthcheck()
            checks += 1
            if ok:
                return Health(True, time.monotonic() - start, checks, output)
            if time.monotonic() - start > hc.start_period_s:
                failures += 1
                if failures >= hc.retries:
                    return Health(False, time.monotonic() - start, checks, output)

    def stop(self, name: str) -> tuple[float, int | None]:
        """`docker compose stop NAME`."""
        return self.running[name].stop()

    def down(self) -> dict[str, int | None]:
        """Every service stopped (dependents first) and its container removed; returns each
        started service's exit status (-9: SIGKILLed after its stop_grace_period)."""
        statuses: dict[str, int | None] = {}
        for wave in reversed(self.project.start_order()):
            for name in wave:
                run = self.running.get(name)
                if run is None:
                    continue
                if run.popen is not None:  # else created, never started
                    secs, status = run.stop()
                    statuses[name] = status
                    self.say(f"{name}: stopped in {secs:.1f} s, status {status}")
                left = kill_inside(self.net.netns(name))
                if left:
                    self.say(f"{name}: killed processes left in its namespace: {left}")
                if isinstance(run, ContainerService):
                    run.remove()
        return statuses
