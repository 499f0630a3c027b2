"""What other code hands the scheduler to run on its thread: step hooks (``fn(scheduler)`` at
the start of every step: pin expiry, tenant quotas; ``Scheduler.step_hooks``) and
``SchedulerCall`` (a call that pickles, for the split daemon's ``call_in_scheduler``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler

StepHook = Callable[["Scheduler"], object]  # runs at the start of every step; result unused


@dataclass(frozen=True)
class StepHookHandle:
    """A registered step hook (``StepHooks.add``); ``StepHooks.remove`` takes it."""

    hook_id: int


@dataclass(frozen=True)
class SchedulerCall:
    """fn(scheduler, *args, **kwargs) as a value: picklable when fn is a module-level function
    and the arguments are plain data, so the split daemon sends it to the scheduler process."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, scheduler: Scheduler) -> Any:
        return self.fn(scheduler, *self.args, **self.kwargs)


class StepHooks:
    """The scheduler's step hooks, run in registration order at the start of every step."""

    def __init__(self) -> None:
        self._hooks: dict[int, StepHook] = {}
        self._ids = itertools.count(1)

    def add(self, hook: StepHook) -> StepHookHandle:
        """Run ``hook(scheduler)`` at the start of every step from now on (scheduler thread)."""
        handle = StepHookHandle(next(self._ids))
        self._hooks[handle.hook_id] = hook
        return handle

    def remove(self, handle: StepHookHandle) -> None:
        """Stop running a hook ``add`` registered (KeyError: not registered)."""
        del self._hooks[handle.hook_id]

    def run(self, scheduler: Scheduler) -> None:
        for hook in list(self._hooks.values()):  # a hook may add or remove hooks
            hook(scheduler)
