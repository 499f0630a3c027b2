from engine.runtime.scheduler.hooks import SchedulerCall, StepHook, StepHookHandle
from engine.runtime.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerCall", "StepHook", "StepHookHandle"]
