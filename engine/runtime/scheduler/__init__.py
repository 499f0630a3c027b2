from engine.runtime.scheduler.scheduler import (
    Scheduler,
    SchedulerCall,
    StepHook,
    StepHookHandle,
)

__all__ = ["Scheduler", "SchedulerCall", "StepHook", "StepHookHandle"]
