"""How a job ends other than finished: canceled or stopped (its partial result kept), failed by a step or refused by
the engine (retried where RQ would retry it), refused before it ran, or unreadable. Ends are written on the
sender's thread after the step's events (``_end_later``), or on a callback thread where the job names an allowed
callback (``_end_on_callback_thread``), and the job is beaten until its end is written.

A part of ``BatchWorker`` (a mixin, as ``success_path``); it uses the worker's ``in_flight``, ``_ending``,
``_tasks``, ``_callback_ends``, ``sender``, ``publisher``, ``metrics`` and ``settings``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.rate_limit import RateLimitRegistry
from rq.results import Result
from rq.utils import now

from producer.protocol import (
    canceled_result,
    failure_result,
    queue_stream_check,
    result_entry,
    stream_check,
    usage_of,
)
from producer.schema import job_ending
from worker.end_records import failure_ttl
from worker.in_flight import NO_USAGE, InFlight, ended_timings
from worker.intake import Unreadable, quarantine, shown_id
from worker.jobs import JobRejected, JobStopped, JobTimedOut, StepFailed, build_result, run_limit, usage
from worker.publisher import JobStream
from worker.puller import Arrival
from worker.pump import JobEvent

log = logging.getLogger("roseinfer.worker")


class JobEnds:
    """The other ends of ``BatchWorker``'s jobs (see the module's docstring)."""

    def _ends_elsewhere(self, job_id: str) -> bool:
        """Whether the job's end waits on a callback thread (``_end_with_callback``)."""
        return getattr(self._ending.get(job_id), "ended_elsewhere", False)

    def _end_on_callback_thread(self, job: InFlight | Arrival, end: Callable[[], None]) -> None:
        """``end`` of a job that runs its allowed callback (success, failure or stopped), on a callback thread: on the
        sender's, a callback held up every job's tokens and results (ten of 0.2 s stopped another job's stream 2 s).
        Its last event is held until its end is written, and it is beaten until then. On the sender's thread, after
        the events of its step (a retried job's next attempt resumes from them)."""
        job_id, owner = job.job.id, job.execution.id
        job.ended_elsewhere = True
        self._ending[job_id] = job
        self.sender.hold(job_id, owner)

        def run() -> None:
            try:
                try:
                    self.sender.retrying(end, "while ending a job after its callback")
                except Exception:
                    log.exception("ending job %s failed", job_id)
                finally:  # (apart: a callback's late timeout landing in the clean-up above must not keep its events)
                    self.sender.release_held(job_id, owner)
            finally:  # (after: a lost-event report read meanwhile leaves its held events to this thread)
                if self._ending.get(job_id) is job:  # (a next attempt of it may have come here since)
                    self._ending.pop(job_id, None)

        try:
            self._callback_ends.submit(run)
        except RuntimeError:  # the pool shut down: a cold stop starts no callback (RQ's clean-up takes the job, as a
            if self._force_stop:  # killed worker's), and its last event (held, or in this round trip) would end a job
                self.sender.discard_held(job_id, owner)  # not ended
                self.sender.drop_final(job_id, owner)
                return
            run()  # (a warm stop ends what the sender still held, here)

    def _end_later(
        self, jobs: list[InFlight] | list[Arrival], end: Callable[[], None], callback: str | None = None
    ) -> None:
        """``end`` of ``jobs``, taken out of ``in_flight``, on the sender's thread after this step's events; of a job
        whose end runs its allowed ``callback`` (its name), on a callback thread from there. Until it ran they are
        beaten as jobs in flight are: a Redis stall can hold the sender past their heartbeat TTL, and RQ's clean-up
        took them for abandoned (run again, their ends here dropped)."""
        for job in jobs:
            self._ending[job.job.id] = job
        if callback:
            [job] = jobs
            self._tasks.append(lambda: self._end_on_callback_thread(job, end))
            return

        def ending() -> None:
            try:
                end()
            finally:  # (a try Redis failed is tried again, or given up: no beat would reach Redis meanwhile either)
                for job in jobs:
                    if self._ending.get(job.job.id) is job and not job.ended_elsewhere:
                        self._ending.pop(job.job.id, None)  # (a callback thread may take it out meanwhile)

        self._tasks.append(ending)

    def _canceled(self, job: InFlight, events: list[JobEvent], stopped: bool = False, deleted: bool = False) -> None:
        """Canceled (RQ's cancel, a deleted hash) or stopped (stop-job): the partial result is kept, but for a job
        deleted (RQ's ``job.delete()``): nothing of it is left in Redis but its stream's last event."""
        del self.in_flight[job.job.id]
        wall = time.time()
        for e in events:
            self._took(job, e, wall)
        *pieces, event = events
        for piece in pieces:  # each sample's text not sent yet; an engine process's step events, met on the way
            self._piece(job, piece)
        out = event.output  # None: the engine had not taken it yet (its prompt still tokenizing), or it is gone
        reason = JobStopped("job stopped by a stop-job command" if stopped else "job canceled by request")
        if out is not None:
            self.publisher.add(
                job.stream, event.text, event.token_ids, "abort", usage(out), index=event.index, logprobs=event.logprobs
            )
            result = self._result(job, out, canceled=True)
        else:  # it ends as every canceled job does, with a last event and a result, of nothing made
            self.publisher.add(job.stream, "", [], "abort", dict(NO_USAGE))
            result = canceled_result(job.job.id, job.request, str(reason))

        def end() -> None:
            mine = self._owned([job], (b"stopped",) if stopped else ())[0]
            if mine is False:
                self._lost_at_end(job)
                return
            if stopped and mine:  # RQ's record of the stop holds the partial result
                kept = None if deleted else result
                self._record_stop(job.job, job.queue, job.execution, str(reason), kept, job.request.notify)
            # A stop whose status was written without RQ's end of it (by hand, while this worker stalled and its
            # execution lapsed): ended here as RQ would (its record, its failed registry entry, its hash's expiry), or
            # the job kept no result and its hash, prompt and all, for good. A cancel's end tried again after a lost
            # reply: written once.
            unrecorded = (not stopped or mine is None) and not deleted and not self._recorded(job)
            with self.connection.pipeline() as pipe:
                if not stopped or unrecorded:
                    self.cleanup_execution(job.job, pipe, job.execution)
                if not stopped and not deleted:
                    # RQ's job.cancel() put it there already; a raw `HSET status canceled` did not.
                    job.queue.canceled_job_registry.add(job.job, self.settings.result_ttl, pipeline=pipe)
                    # (the start made it last for good; RQ's cleanup: its dependency sets with it, not left for good)
                    job.job.cleanup(self.settings.result_ttl, pipeline=pipe)
                if stopped and unrecorded:  # (the registry's add saves the job: its status as it stands)
                    job.job._status, job.job.ended_at = JobStatus.STOPPED, now()
                    # (the add expires it by RQ's rule, -1 kept for good: an EXPIRE of -1 deleted it)
                    job.queue.failed_job_registry.add(job.job, failure_ttl(job.job), str(reason), pipeline=pipe)
                if unrecorded:  # the partial result
                    entry = result_entry(result, Result.Type.STOPPED, self.name, error=str(reason),
                                         execution=job.execution, ended=now())  # fmt: skip
                    ttl = failure_ttl(job.job) if stopped else self.settings.result_ttl  # (a stop is RQ's failure)
                    self.publisher.write_result(pipe, job.job.id, entry, ttl, job.request.notify)
                pipe.execute()
            if not stopped or unrecorded:  # (a stop through RQ's failure path was freed there)
                self._free_slot(job.job)
            log.info("job %s: %s", job.job.id, reason)
            self.metrics.job_ended("stopped" if stopped else "canceled", ended_timings(job))

        self._end_later([job], end, job.job._stopped_callback_name if stopped else None)

    def _errored(self, job: InFlight, event: JobEvent) -> None:
        """A failed step (retryable) or a job the engine refused or timed out (not)."""
        del self.in_flight[job.job.id]
        # A failure RQ will retry is not the end of the job: its stream goes on with the next attempt. A timeout is
        # retried too, as RQ retries its own (the next attempt resumes from what this one streamed).
        may_retry = event.retryable or event.timed_out
        retrying = may_retry and (job.job.retries_left or 0) > 0  # as RQ's should_retry: -1 is none left
        if event.retryable:
            error: Exception = StepFailed(event.error)
        elif event.timed_out:
            error = JobTimedOut(f"job exceeded its timeout of {run_limit(job.job, self.queue_class.DEFAULT_TIMEOUT)} s")
        else:
            error = JobRejected(event.error)
        # Whose fault: a job the engine refused is the job's own unless the event says otherwise.
        error_type = event.error_type or ("server_error" if event.retryable else "invalid_request")
        if not retrying:
            end_usage = usage(event.output) if event.output else {}
            self.publisher.add(
                job.stream, event.text, event.token_ids, "error", end_usage, str(error), error_type=error_type,
                logprobs=event.logprobs, error_code=event.error_code, index=event.index,
            )  # fmt: skip
        else:  # what it streamed so far lands before RQ requeues it (the next attempt resumes from there)
            self.publisher.expedite(job.stream)

        def end() -> None:
            mine = self._owned([job], (b"scheduled",) if retrying else (b"failed",))[0]
            if mine is False:
                self._lost_at_end(job)
                return
            result = None
            if not retrying:
                job.job.retries_left = None  # the same job would fail the same way again
                result = failure_result(
                    job.job.id, job.request, str(error), error_type=error_type, error_code=event.error_code
                )
                if end_usage:  # (a job that made tokens, a timeout's: a sum of its results' usage missed them)
                    result["usage"] = end_usage
            if mine:
                self._record_failure(job.job, job.queue, job.execution, error, result, job.request.notify)
            elif result is not None and not self._recorded(job):  # (None: its status there already, as this end
                self._write_failure(job.job, result, error, job.request.notify, job.execution)  # writes it)
            # Refused by the engine before it made anything (a prompt past the context): the job's own, as a payload
            # refused at the pull is (the same error type had two labels).
            refused = error_type == "invalid_request" and event.output is None
            status = "retried" if retrying else "rejected" if refused else "failed"
            self.metrics.job_ended(status, ended_timings(job) if status == "failed" else None)

        self._end_later([job], end, job.job._failure_callback_name)

    def _fail(self, a: Arrival) -> None:
        """A job that can never run (``a.error``): fails alone, with its reason in RQ's failed registry, no retry.
        Started already: beaten until its end is written, as any job's end (``_end_later``)."""
        job, queue, execution, req, error = a.job, a.queue, a.execution, a.request, a.error or ""
        a.stream.start(can_resume=False)  # (an earlier attempt's end, requeued since: this end follows a reset)
        self.publisher.add(a.stream, "", [], "error", {}, error, error_type="invalid_request")
        tries: list[bool] = []

        def end() -> None:
            if not self._written_before(  # (an earlier try's record: its failure callback ran with it)
                tries, job.id, b"execution_id", execution.id
            ):
                job.retries_left = None
                ending = req if req is not None else job_ending(job)  # (refused: its id and list, as one that ran)
                result = failure_result(job.id, ending, error, error_type="invalid_request")
                self._record_failure(job, queue, execution, JobRejected(error), result, ending.notify)
            self.metrics.job_ended("rejected", None)

        self._end_later([a], end, job._failure_callback_name)

    def _never_ran(self, job: Job, queue: Queue, stream: JobStream) -> None:
        """A job canceled while it was queued (``HSET rq:job:<id> status canceled``, from any language): it does
        not run; it ends as RQ's cancel ends a job, in the canceled registry, with a result and a last event. One
        that waited for its next attempt keeps what the earlier ones streamed as its partial output (as a client's
        cancel of it keeps it, and a canceled running job's)."""
        status = JobStatus(job.get_status(refresh=False)).value  # "canceled", not "JobStatus.CANCELED"
        log.info("job %s was %s while queued: not run", job.id, status)
        made = stream.resume_output if not (stream.resume_output and self._earlier_jobs_stream(job)) else {}
        spent = usage_of(stream.resume_prompt_tokens, sum(len(ids) for _text, ids in made.values()))
        if not made:
            stream.start(can_resume=False)  # what an earlier attempt streamed (its end, too) is void: a reset first
        self.publisher.add(stream, "", [], "abort", spent if made else dict(NO_USAGE))
        ended, tries = now(), []
        reason = f"job {status} while it waited for its next attempt" if made else f"job {status} before it ran"

        def end() -> None:
            if not self._written_before(tries, job.id, b"execution_ended_at", str(ended.timestamp())):
                ending = job_ending(job)
                result = canceled_result(job.id, ending, reason, made)
                if made:
                    result["usage"] = spent
                with self.connection.pipeline() as pipe:
                    entry = result_entry(result, Result.Type.STOPPED, self.name, ended=ended)
                    self.publisher.write_result(pipe, job.id, entry, self.settings.result_ttl, ending.notify)
                    pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                    queue.canceled_job_registry.add(job, self.settings.result_ttl, pipeline=pipe)
                    job.cleanup(self.settings.result_ttl, pipeline=pipe)  # (its dependency sets too, as RQ's)
                    pipe.execute()
            self._free_slot(job)
            self.metrics.job_ended("canceled", None)

        self._tasks.append(end)

    def _earlier_jobs_stream(self, job: Job) -> bool:
        """Whether the job's stream is an earlier job's of its id (a stock enqueue reused it), as a start reads it:
        none of its output is this job's."""
        with self.connection.pipeline(transaction=False) as pipe:
            queue_stream_check(pipe, job)
            return stream_check(job.created_at, *pipe.execute(raise_on_error=False))[0]

    def _free_slot(self, job: Job) -> None:
        """A canceled job's RQ rate-limit slot, freed as RQ's own ends free one: the next job of its limit runs now,
        not at RQ's maintenance (RQ's cancel frees only a slot no execution holds)."""
        if job.has_rate_limit:
            try:
                RateLimitRegistry.from_job(job).release_and_enqueue(job.id)
            except redis.RedisError:  # RQ's maintenance frees it later
                log.exception("the rate-limit slot of job %s was not freed", job.id)

    def _reject_unreadable(self, item: Unreadable, stream: JobStream | None) -> None:
        """A job hash RQ cannot read: moved aside (never built into a Job), its reason in its result and stream
        (an id that is not text has neither: it is only moved aside)."""
        log.error("job %s cannot be read (%s): moved to roseinfer:rejected", shown_id(item.job_id), item.reason)
        if stream is not None:
            stream.start(can_resume=False)  # (as a job canceled before it ran)
            self.publisher.add(stream, "", [], "error", {}, item.reason, error_type="invalid_request")

        ended, tries = now(), []

        def end() -> None:
            with self.connection.pipeline(transaction=False) as pipe:
                # (an id that is not text: never a result)
                if stream is not None and not self._written_before(
                    tries, item.job_id, b"execution_ended_at", str(ended.timestamp())
                ):
                    result = failure_result(item.job_id, item.ending, item.reason, error_type="invalid_request")
                    entry = result_entry(result, Result.Type.FAILED, self.name, error=item.reason, ended=ended)
                    self.publisher.write_result(pipe, item.job_id, entry, self.settings.result_ttl, item.ending.notify)
                quarantine(pipe, item, self.settings.result_ttl)  # (all of it as good again as once)
                pipe.execute()
            self.metrics.job_ended("rejected", None)

        self._tasks.append(end)

    def _result(self, job: InFlight, out: Any, canceled: bool = False) -> dict[str, Any]:
        return build_result(
            job.job, job.request, out, model=self.settings.model_name, started_at=job.started_at,
            first_token_at=job.first_token_at, finished_at=job.finished_at, canceled=canceled,
            fingerprint=self.fingerprint,
        )  # fmt: skip
