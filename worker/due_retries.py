"""Retries RQ put off: a job that fails with retry intervals left (``Retry(max, interval=...)``, or a hash's
``retry_intervals``) goes to RQ's scheduled registry, and only RQ's scheduler moves it back to its queue when due.
A batching worker runs no ``rq worker --with-scheduler``, so it does that part itself, with RQ's own scheduler
class: one worker of the fleet at a time per queue (RQ's scheduler lock), on the heartbeat thread (off the step
loop), never in a forked process (the worker holds torch's threads)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import ScheduledJobRegistry
from rq.scheduler import RQScheduler
from rq.utils import current_timestamp

from producer.connection import REDIS_DOWN
from worker.intake import Unreadable, quarantine

if TYPE_CHECKING:
    from worker.batch_worker import BatchWorker

log = logging.getLogger("roseinfer.worker")


# How often due jobs are looked for: RQ's scheduler's default interval (a job due in 2 s ran 10 s late, at the
# next heartbeat). A look is a lock refresh and a ZRANGEBYSCORE per queue.
DUE_JOBS_EVERY_S = 1  # an int: RQ adds 60 for its lock TTL, which Redis wants whole


class DueRetries:
    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker
        self._scheduler: RQScheduler | None = None
        self._names: list[str] = []

    def enqueue(self) -> None:
        """The due jobs of the scheduled registries of this worker's queues and lanes, back on their queues (where
        this worker holds, or now takes, RQ's scheduler lock of that queue)."""
        w = self.worker
        if not w.sender.runs_scripts:  # RQ's lock is a script: a Redis without Lua leaves them scheduled
            return
        names = sorted(q.name for _, q, _ in w.lane_depths())
        if self._scheduler is None or names != self._names:
            self._release()
            self._scheduler = RQScheduler(
                names,
                connection=w.connection,
                serializer=w.serializer,
                interval=DUE_JOBS_EVERY_S,
                logging_level=w.log.getEffectiveLevel(),  # the worker's RQ log level, as RQ's own worker passes it
            )
            self._names = names
        if self._scheduler.acquire_locks():
            try:
                self._scheduler.enqueue_scheduled_jobs()
            except REDIS_DOWN:
                raise
            except Exception:  # RQ reads every due job at once: one it cannot read held back all the others
                if self._set_aside_unreadable():
                    self._scheduler.enqueue_scheduled_jobs()
                else:
                    raise

    def _set_aside_unreadable(self) -> bool:
        """The due jobs RQ cannot read (a hash written by hand), out of the scheduled registries and into
        ``roseinfer:rejected:<queue>``, as an unreadable queued job is; whether there was one."""
        w, found = self.worker, False
        for queue in [q for _, q, _ in w.lane_depths()]:
            registry = ScheduledJobRegistry(queue.name, connection=w.connection, serializer=w.serializer)
            for job_id in registry.get_jobs_to_schedule(current_timestamp()):
                try:
                    Job.fetch(job_id, connection=w.connection, serializer=w.serializer)
                except NoSuchJobError:
                    continue  # RQ skips those itself
                except REDIS_DOWN:
                    raise
                except Exception as exc:
                    log.error("due retry %s cannot be read (%s): moved to roseinfer:rejected", job_id, exc)
                    with w.connection.pipeline() as pipe:
                        pipe.zrem(registry.key, job_id)
                        quarantine(pipe, Unreadable(job_id, queue, str(exc)), w.settings.result_ttl)
                        pipe.execute()
                    found = True
        return found

    def _release(self) -> None:
        if self._scheduler is not None:
            self._scheduler.release_locks()

    def stop(self) -> None:
        try:
            self._release()
        except Exception:  # Redis gone: the locks lapse on their own
            log.debug("scheduler locks not released", exc_info=True)
