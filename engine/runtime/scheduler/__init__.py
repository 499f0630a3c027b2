from engine.runtime.scheduler.scheduler import Scheduler, SchedulerCall

__all__ = ["Scheduler", "SchedulerCall"]
