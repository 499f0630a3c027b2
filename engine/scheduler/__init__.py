from engine.scheduler.scheduler import Scheduler, SchedulerCall

__all__ = ["Scheduler", "SchedulerCall"]
