from engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
