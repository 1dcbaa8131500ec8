"""A stop's hand-back: on a warm stop the jobs that made no token yet go back to the front of their queue, the rest
run to their ends within the drain timeout; a cold stop (a second signal, or past that timeout) hands back what
is still running, each job resuming elsewhere from what it streamed. A job a client ended meanwhile is not put
back.

A part of ``BatchWorker`` (a mixin, as ``success_path``); it uses the worker's ``in_flight``, ``pump``, ``puller``,
``sender`` and ``settings``."""

from __future__ import annotations

import contextlib
import logging
import time

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus

from producer.connection import REDIS_UNAVAILABLE, redis_waits
from producer.protocol import OWNER_FIELD
from worker.end_records import read_entry
from worker.in_flight import InFlight
from worker.puller import Arrival
from worker.pump import JobEvent

log = logging.getLogger("roseinfer.worker")
HAND_BACK_PATIENCE_S = 5.0  # after a second stop signal, writes Redis refuses are tried again this long
# A job's status when a client ended it while it ran here (None: its hash deleted): it ends so, not back in the queue.
_ENDED_BY_OTHERS = (None, JobStatus.CANCELED.value.encode(), JobStatus.STOPPED.value.encode())


class HandBack:
    """The stop's hand-back of ``BatchWorker``'s jobs (see the module's docstring)."""

    def _hand_back_cold(self, only: list[str] | None = None) -> bool:
        """``_hand_back_all``, tried again through a blip of Redis until the sender gives up too
        (``HAND_BACK_PATIENCE_S`` after the signal), not longer: a cold stop does not wait for Redis. What is left is
        RQ's clean-up's once this worker's heartbeat lapses (requeued where retries are left, failed otherwise).
        Whether every job went back."""
        deadline, backoff = self.sender.give_up_at or time.monotonic() + HAND_BACK_PATIENCE_S, 0.1
        while True:
            try:
                self._hand_back_all(only)
                return True
            except (*REDIS_UNAVAILABLE, redis.exceptions.ResponseError) as exc:
                if not redis_waits(exc):
                    raise
                if time.monotonic() >= deadline:
                    log.error(
                        "Redis unavailable (%s): %d jobs not handed back; RQ's clean-up takes them once this "
                        "worker's heartbeat lapses", exc, len(self.in_flight),
                    )  # fmt: skip
                    return False
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _drain_check(self) -> None:
        """A stop drains what is generating: the jobs taken that have made no token yet (waiting for the engine, or
        in their prompt) go back to their queue at once, for another worker, as RQ's warm stop leaves queued jobs;
        past ``--drain-timeout`` the rest go back too, before the orchestrator's kill."""
        if not self._unstarted_handed_back:
            with contextlib.suppress(*REDIS_UNAVAILABLE, redis.exceptions.ResponseError):  # (a record: not waited for)
                self.set_shutdown_requested_date()  # RQ's of a warm stop while busy (rq-dashboard, Worker.all show it)
            self.puller.stop()  # (a pull under way hands over what it took: those go back too)
            self._apply_arrivals()
            waiting = [job_id for job_id, job in self.in_flight.items() if job.first_token_at is None]
            if waiting and not self._hand_back_cold(only=waiting):
                self._force_stop = True  # (canceled in the engine, not requeued: nothing runs them here now)
            self._unstarted_handed_back = True  # (after: Redis failing the try above, the loop's retry does it again)
        timeout = self.settings.drain_timeout
        if timeout is not None and self._stop_at is not None and time.monotonic() - self._stop_at >= timeout:
            log.warning("drain timeout (%g s) reached: handing %d jobs back to the queue", timeout, len(self.in_flight))
            self.sender.give_up_at = time.monotonic() + HAND_BACK_PATIENCE_S
            self._force_stop = True

    def _hand_back_unstarted(self) -> None:
        """Suspended (``rq suspend``): the jobs taken that made no token yet go back to their queue, as queued jobs
        stay queued under RQ's suspension (they all started, one after another, as the running ones ended); those
        generating run to their ends."""
        waiting = [job_id for job_id, job in self.in_flight.items() if job.first_token_at is None]
        if not waiting or self._heartbeat.failing:  # (Redis away: they go on here, not back, until it answers)
            return
        log.warning("suspended: %d jobs that made no token yet go back to their queues", len(waiting))
        if not self._hand_back_cold(only=waiting):  # canceled in the engine, not requeued: nothing runs them here
            self._force_stop = True  # (the stop hands back what it can; RQ's clean-up the rest)

    def _hand_back_all(self, only: list[str] | None = None) -> None:
        """Second stop signal: every job in flight goes back to the front of its queue, retries untouched; ``only``:
        those jobs (the first signal's, not generating yet), the others running on."""
        give_up_at = self.sender.give_up_at  # (a pull retrying through an outage is waited for this long, no more)
        if only is None:
            self.puller.stop(120.0 if give_up_at is None else max(0.1, give_up_at - time.monotonic()))
            self._apply_arrivals()  # taken already: they go back with the rest
        self._apply_reports()  # cancels and deletions the sender read: those jobs end as such, not back in the queue
        self._apply_stop_requests()  # and stop-job commands heard meanwhile (another worker would run the job)
        ids = [job_id for job_id in (self.in_flight if only is None else only) if job_id in self.in_flight]
        aborted = self.pump.cancel_many(ids)  # their last events: a job found canceled below ends with them
        # Those an engine process ended before the cancel reached it end as they ended, not back in the queue.
        self._route(self.pump.pending_events())
        ids = [job_id for job_id in ids if job_id in self.in_flight]

        def send_all() -> None:  # (a cold stop waits for the sender no longer than its patience)
            self._hand_over(force=True)
            self.sender.drain(30.0 if give_up_at is None else max(0.1, give_up_at - time.monotonic()))

        send_all()  # the events already produced land first
        held = [self.in_flight[job_id] for job_id in reversed(ids)]  # each to the front: the first taken ends up first
        if self._requeue(held, aborted):
            send_all()  # the ends of those found canceled, stopped or deleted

    def _requeue(self, held: list[InFlight] | list[Arrival], aborted: dict[str, list[JobEvent]]) -> bool:
        """Each of ``held`` still running as this attempt out of this worker's registries and to the front of its
        queue, one after another, and out of ``in_flight`` once done (a try again after Redis failed midway skips
        it). Whether any ended here instead, one a client ended meanwhile with its events in ``aborted`` (its end is
        the sender's now)."""
        handed, ended_here = 0, False
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.hexists(self.key, "birth")  # (registration's alone: a heartbeat after a restart makes the hash)
            for job in held:
                pipe.hmget(job.job.key, OWNER_FIELD, "status")
                read_entry(pipe, job)
            registered, *now_as = pipe.execute()
        for job, (owner, status), entry in zip(held, now_as[::2], now_as[1::2]):
            # Only a job still running as this attempt goes back: one canceled, stopped, deleted or another
            # attempt's since the sender's last look (a client's cancel of a moment ago) keeps what was done to it.
            if status is None and not registered:
                fresh = job.job  # Redis lost its data (this worker's registration too): the copy here is all there is
            elif self._runs_here(job, owner, status, entered=entry is not None):
                fresh = self._reread(job.job)
            elif status in _ENDED_BY_OTHERS and job.job.id in aborted and self._is_ours(job, owner, status):
                # Canceled, stopped or deleted after the sender's last look: it ends so here (its abort event, its
                # partial result, its TTL), not with its execution cleaned up and nothing more.
                stopped = status == JobStatus.STOPPED.value.encode()
                self._canceled(job, aborted[job.job.id], stopped=stopped, deleted=status is None)
                ended_here = True
                continue
            else:
                fresh = None
            with self.connection.pipeline() as pipe:  # MULTI: out of our registries and back in the queue, or neither
                if self.sender.lease_key:  # (the sender's events of it still to go are checked, not sent under it)
                    pipe.delete(self.sender.lease_key)
                self.cleanup_execution(job.job, pipe, job.execution)
                if fresh is not None and not getattr(fresh, "has_rate_limit", False):
                    job.queue._enqueue_job(fresh, pipeline=pipe, at_front=True)  # (as RQ's own requeues: no WATCH)
                pipe.execute()
            if fresh is not None and getattr(fresh, "has_rate_limit", False):  # (RQ enqueues these on its own)
                job.queue.enqueue_job(fresh, at_front=True)
            self.in_flight.pop(job.job.id, None)  # done: if Redis fails on a later one, the next try skips this one
            handed += fresh is not None
        log.warning("%d jobs handed back", handed)
        return ended_here

    def _hand_back_as_they_are(self) -> None:
        """The jobs held (in flight, and those the puller started that the loop has yet to take in) back to their
        queues with Redis's writes alone, for a worker dying of an error its usual hand-back met again (a job that
        fails to go into the engine, a sender thread gone): nothing of the engine or the sender is trusted."""
        self.puller.stop(5.0)
        held: dict[str, InFlight | Arrival] = {a.job.id: a for a in self.puller.unapplied()}
        held.update(self.in_flight)
        self._requeue(list(reversed(held.values())), {})

    def _reread(self, job: Job) -> Job | None:
        """The job as Redis holds it now (its meta, retries and TTLs as others may have changed them), to be queued
        again: the copy taken at the pull would write its old fields back. None: deleted meanwhile."""
        try:
            return self.job_class.fetch(job.id, connection=self.connection, serializer=self.serializer)
        except NoSuchJobError:
            return None
        except (ValueError, TypeError):  # a field written over by hand since: the copy taken at the pull, not nothing
            return job
