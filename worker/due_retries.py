"""Retries RQ put off: a job that fails with retry intervals left (``Retry(max, interval=...)``, or a hash's
``retry_intervals``) goes to RQ's scheduled registry, and only RQ's scheduler moves it back to its queue when due.
A batching worker runs no ``rq worker --with-scheduler``, so it does that part itself, with RQ's own scheduler
class: one worker of the fleet at a time per queue (RQ's scheduler lock), on the heartbeat thread (off the step
loop), never in a forked process (the worker holds torch's threads)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.registry import BaseRegistry, DeferredJobRegistry, ScheduledJobRegistry
from rq.scheduler import RQScheduler
from rq.utils import current_timestamp

from producer.connection import REDIS_DOWN
from producer.protocol import queue_of_lane
from worker.intake import Unreadable, quarantine, shown_id

if TYPE_CHECKING:
    from redis import Redis

    from worker.batch_worker import BatchWorker

log = logging.getLogger("roseinfer.worker")


# How often due jobs are looked for: RQ's scheduler's default interval (a job due in 2 s ran 10 s late, at the
# next heartbeat). A look is a lock refresh and a ZRANGEBYSCORE per queue.
DUE_JOBS_EVERY_S = 1  # an int: RQ adds 60 for its lock TTL, which Redis wants whole
WAITING_WALK = 1_000  # ids of a scheduled or deferred registry whose statuses a look reads (each maintenance interval)


def end_canceled_unrun(
    connection: Redis, queue: Queue, job_id: str, taken_from: str | None = None, its_worker_died: bool = False
) -> bool:
    """The ending a client's cancel writes for a job no worker will run (``GenerationJob._end_unrun``: one writer of
    it), for a job canceled where no client wrote it; False where the job is gone meanwhile or unreadable (RQ's
    clean-up, and the set-aside of unreadable jobs, take those), or, given ``taken_from`` (a registry's key), not
    in that registry any more: whoever took it out ends it."""
    from producer import Client

    try:
        job = queue.job_class.fetch(job_id, connection=connection, serializer=queue.serializer)
    except REDIS_DOWN:
        raise
    except Exception:
        return False
    if taken_from is not None and not connection.zrem(taken_from, job_id):
        return False
    # (the client of the lane's queue: a lane's own name is no queue's, and the client refuses it)
    client = Client(connection=connection, queue=queue_of_lane(queue.name))
    client.job(job_id)._end_unrun(job, its_worker_died=its_worker_died)
    return True


class DueRetries:
    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker
        self._scheduler: RQScheduler | None = None
        self._names: list[str] = []
        self._next_walk = 0.0  # (monotonic) when the walk of the scheduled and deferred registries goes on
        self._walked: dict[str, int] = {}  # registry key -> where its walk goes on

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
            self._end_canceled_waiting()
            try:
                self._scheduler.enqueue_scheduled_jobs()
            except REDIS_DOWN:
                raise
            except Exception:  # RQ reads every due job at once: one it cannot read held back all the others
                if self._set_aside_unreadable():
                    self._scheduler.enqueue_scheduled_jobs()
                else:
                    raise

    def _end_canceled_waiting(self) -> None:
        """Jobs canceled (or stopped) by hand, the protocol's cancel from any language, while they waited in RQ's
        scheduled registry (a retry's wait, ``enqueue_in``) or its deferred one (``depends_on``), of the queues whose
        scheduler lock this worker holds: RQ's scheduler queued a due one again as if never canceled, and it ran;
        RQ enqueues no canceled dependent, which kept no ending at all. They end as a client's cancel ends them:
        the due ones at each look, before the scheduler moves them; the rest ``WAITING_WALK`` at a time, every
        maintenance interval. A failure here is logged: it must not hold back the due jobs' enqueue."""
        w, now = self.worker, time.monotonic()
        whole = now >= self._next_walk
        if whole:
            self._next_walk = now + w.settings.maintenance_interval
        held = self._scheduler.acquired_locks if self._scheduler is not None else set()
        for queue in [q for _, q, _ in w.lane_depths() if q.name in held]:
            scheduled = ScheduledJobRegistry(queue.name, connection=w.connection, serializer=w.serializer)
            deferred = DeferredJobRegistry(queue.name, connection=w.connection, serializer=w.serializer)
            for registry in (scheduled, deferred) if whole else (scheduled,):
                try:  # (a registry key of another type, one this Redis user may not read: said, and passed over)
                    due = registry.get_jobs_to_schedule() if registry is scheduled else []
                    walked = self._walk_on(registry) if whole else []
                    self._end_canceled(queue, registry, list(dict.fromkeys(due + walked)))
                except REDIS_DOWN:
                    raise
                except Exception:
                    log.exception("ending the canceled jobs of %s failed; carrying on", registry.key)

    def _walk_on(self, registry: BaseRegistry) -> list[str]:
        """The next ``WAITING_WALK`` ids of ``registry``, from where the last look left off (from the start again
        once it reached the end)."""
        start = self._walked.get(registry.key, 0)
        job_ids = registry.get_job_ids(start, start + WAITING_WALK - 1, cleanup=False)
        self._walked[registry.key] = start + len(job_ids) if len(job_ids) == WAITING_WALK else 0
        return job_ids

    def _end_canceled(self, queue: Queue, registry: BaseRegistry, job_ids: list[str]) -> None:
        if not job_ids:
            return
        w = self.worker
        with w.connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(Job.key_for(job_id), "status")
            statuses = pipe.execute(raise_on_error=False)
        for job_id, status in zip(job_ids, statuses):
            # Ended by whoever takes it out of the registry: a client's cancel meanwhile (RQ's takes it out, and the
            # client ends it), or a due id the walk read too, was ended twice (two last events, two pushes).
            if status in (b"canceled", b"stopped") and end_canceled_unrun(w.connection, queue, job_id, registry.key):
                log.warning("job %s was %s while in %s: ended", shown_id(job_id), status.decode(), registry.key)

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
                    log.error("due retry %s cannot be read (%s): moved to roseinfer:rejected", shown_id(job_id), exc)
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
