"""What a job's end leaves in RQ's records: failures and stops through RQ's own paths (its failed registry, its retry
policy, the failure and stopped callbacks), a failure's result where its status was written without it, and
whether a job still belongs to this attempt when its end is written (``_owned``): another attempt's job, or one RQ
failed while this worker stalled, is not written over.

A part of ``BatchWorker`` (a mixin, as ``success_path``: ``handle_exception`` overrides RQ's); it uses the worker's
``connection``, ``publisher`` and RQ's ``BaseWorker``."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import redis
from rq.callbacks import execute_stopped_callback
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import call_exception_handlers
from rq.queue import Queue
from rq.results import Result
from rq.utils import now

from producer.connection import wrong_type
from producer.protocol import OWNER_FIELD, result_entry, result_key
from worker.in_flight import InFlight
from worker.jobs import JobRejected, JobTimedOut, StepFailed

log = logging.getLogger("roseinfer.worker")


class EndRecords:
    """RQ's records of ``BatchWorker``'s job ends (see the module's docstring)."""

    def _write_failure(
        self, job: Job, result: dict[str, Any], error: Exception, notify: str | None, execution: Execution | None
    ) -> None:
        """A failed job's result alone, where its status was written without it (an earlier try of this end
        landed it with the status, else the status was someone else's: RQ's clean-up of a stalled job's)."""
        entry = result_entry(result, Result.Type.FAILED, self.name, error=_one_line(error), execution=execution,
                             ended=now())  # fmt: skip
        self.publisher.write_result(self.connection, job.id, entry, failure_ttl(job), notify)

    def _recorded(self, job: InFlight) -> bool:
        """Whether the job's latest result is this attempt's (an earlier try of its end wrote it with the status)."""
        return self._latest_result_has(job.job.id, b"execution_id", job.execution.id)

    def _written_before(self, tries: list[bool], job_id: str, field: bytes, value: str) -> bool:
        """For an end the sender may run again: whether an earlier try of it wrote its record already (it landed,
        and its reply was lost), known by ``value`` in ``field`` of the job's latest record. Counts this try."""
        earlier = bool(tries) and self._latest_result_has(job_id, field, value)
        tries.append(True)
        return earlier

    def _latest_result_has(self, job_id: str, field: bytes, value: str) -> bool:
        """Whether the latest entry of the job's result stream holds ``value`` in ``field``."""
        try:
            latest = self.connection.xrevrange(result_key(job_id), count=1)
        except redis.ResponseError as exc:
            if wrong_type(exc):  # (written by hand since the start deleted it: nothing can be written there)
                return True
            raise
        return bool(latest) and latest[0][1].get(field) == value.encode()

    @contextlib.contextmanager
    def _results_in_failure(
        self, job: Job, execution: Execution, result: dict[str, Any] | None, notify: str | None, kind: Result.Type,
        error: str,
    ) -> Iterator[None]:  # fmt: skip
        """RQ's record of a job's failure or stop, made to hold ``result``: its entry in the result stream is
        written in the transaction that sets the status, as RQ writes its own (a reader that saw the status failed
        read RQ's bare record, then a second entry a round trip later). None: RQ's own record."""
        if result is None:
            yield
            return

        def handle_failure(exc_string: str, pipeline: Any, worker_name: str = "", **_times: Any) -> None:
            job.failed_job_registry.add(job, ttl=job.failure_ttl, exc_string=exc_string, pipeline=pipeline)  # RQ's
            # A failure callback that raised is what RQ records instead (its registry entry says so too).
            words = error if exc_string.rstrip().endswith(error.strip()) else exc_string
            entry = result_entry(result, kind, worker_name, error=words, execution=execution, ended=now())
            self.publisher.write_result(pipeline, job.id, entry, failure_ttl(job), notify)

        job._handle_failure = handle_failure  # type: ignore[method-assign]  # (RQ calls it only for a job it fails)
        try:
            yield
        finally:
            del job._handle_failure

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """RQ logs every failed job with a traceback. A failure this worker names itself (a job refused for what
        it holds, a timeout, a failed step) is one line: its traceback would show only where it was recorded, three
        lines a job for every prompt too long. The exception handlers still get it, as from RQ."""
        error = exc_info[1]
        if not isinstance(error, (JobRejected, JobTimedOut, StepFailed)):
            super().handle_exception(job, *exc_info)
            return
        level = logging.ERROR if isinstance(error, StepFailed) else logging.WARNING  # the worker's fault, or the job's
        # A retry said so (a line of "failed" alone was counted as a failure); RQ spends the retry after this line.
        left = job.retries_left or 0
        retry = f" (retried: {left - 1} retries left after this one)" if left > 0 else ""
        log.log(level, "job %s failed: %s%s", job.id, error, retry)
        call_exception_handlers(self._exc_handlers, job, *exc_info)

    def _record_failure(
        self, job: Job, queue: Queue, execution: Execution, error: Exception, result: dict[str, Any] | None = None,
        notify: str | None = None,
    ) -> None:  # fmt: skip
        """RQ's end of a failed job (its failure callback, a retry while it has retries left, else FAILED); where it
        fails, RQ's record of it holds ``result``."""
        with self._results_in_failure(job, execution, result, notify, Result.Type.FAILED, _one_line(error)):
            try:
                raise error
            except Exception:
                self._finalize_failure(job, queue, execution, sys.exc_info())
        self._check_end_landed(job, execution)

    def _record_stop(
        self, job: Job, queue: Queue, execution: Execution, reason: str, result: dict[str, Any] | None,
        notify: str | None,
    ) -> None:  # fmt: skip
        """RQ's end of a job its stop-job command stopped (``_handle_stopped_job``): the job's stopped callback (an
        error of it logged), never its failure callback; then STOPPED, in the failed registry, never retried; its
        record holds ``result`` (the output made until the stop)."""
        job.ended_at = now()
        try:
            execute_stopped_callback(job, self.death_penalty_class)
        except Exception:
            log.exception("job %s: its stopped callback raised", job.id)
        # RQ then marks it STOPPED, not FAILED, and never retries it. One field of the worker says which job that is:
        # two stops on two callback threads read each other's (one ended failed, and was retried).
        with self._stop_record_lock:
            self._stopped_job_id = job.id
            with self._results_in_failure(job, execution, result, notify, Result.Type.STOPPED, reason):
                self.handle_job_failure(job, queue=queue, exc_string=reason, execution=execution)
        self._check_end_landed(job, execution)

    def _check_end_landed(self, job: Job, execution: Execution) -> None:
        """RQ logs an error of its last write and goes on: read it back, so the sender tries this end again. (Started
        by another worker since, a retry of it: it landed.)"""
        owner, status = self.connection.hmget(job.key, OWNER_FIELD, "status")
        if status == JobStatus.STARTED.value.encode() and owner in (None, execution.id.encode()):
            raise redis.exceptions.ConnectionError(f"RQ's record of the failure of job {job.id} did not land")

    def _owned(self, held: list[InFlight], ends_as: tuple[bytes, ...] = ()) -> list[bool | None]:
        """Whether each job is still this attempt's to end (``_is_ours``), in one round trip. Its status alone
        does not say an earlier try of this end wrote it (someone may have set it: RQ's clean-up failing it as
        abandoned, a hand-written stop): that try also removed our execution's hash."""
        with self.connection.pipeline(transaction=False) as pipe:
            for job in held:
                pipe.hmget(job.job.key, OWNER_FIELD, "status")
                pipe.exists(job.execution.key)
                read_entry(pipe, job)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not wrong_type(reply):
                raise reply
        return [
            False
            if isinstance(found, Exception)
            else self._is_ours(job, *found, ends_as if not alive else (), entered=entry is not None)
            for job, found, alive, entry in zip(held, replies[::3], replies[1::3], replies[2::3])
        ]

    @staticmethod
    def _is_ours(
        job: InFlight,
        owner: bytes | None,
        status: bytes | None,
        ends_as: tuple[bytes, ...] = (),
        entered: bool = False,
    ) -> bool | None:
        """True: its owner field names our execution (or the hash is gone: Redis lost data) and it was not requeued.
        None: ours, but its status is one ``ends_as`` names, the status this end writes: an earlier try of it (whose
        reply was lost) wrote it, and RQ's writes (counters, a retry, dependents) are not made again. False: another
        attempt's now, or failed by RQ's clean-up (this worker stalled past its heartbeat, the job had no retry
        left): that end stands, its client told, its failure callbacks run; a success over it gave two results.
        ``entered``: our execution's started-registry entry is there, so a status "queued" is no requeue (RQ's
        requeues take the entry out with it) but a stale copy of the job saved over it (``job.save()`` of the
        object ``enqueue`` returned): still ours."""
        if owner is not None and (owner.decode() != job.execution.id or (status == b"queued" and not entered)):
            return False
        if status == b"failed" and b"failed" not in ends_as:
            return False
        return None if status in ends_as else True

    def _runs_here(self, job: InFlight, owner: bytes | None, status: bytes | None, entered: bool = False) -> bool:
        """Its hash (``owner``, ``status``, as read) says it still runs as this attempt: ours, and started (or
        "queued" by a stale copy saved over it, ``entered``: see ``_is_ours``)."""
        running = status == JobStatus.STARTED.value.encode() or (status == b"queued" and entered)
        return running and self._is_ours(job, owner, status, entered=entered) is True


def read_entry(pipe: Any, job: InFlight) -> Any:
    """Queue the read of ``job``'s execution's entry in its started registry (its score, or None) on ``pipe``."""
    return pipe.zscore(job.job.started_job_registry.key, job.execution.composite_key)


def failure_ttl(job: Job) -> int:
    """How long RQ keeps a failed job, and so its record: its ``failure_ttl``, or RQ's default (a year)."""
    return job.failure_ttl if job.failure_ttl is not None else DEFAULT_FAILURE_TTL


def _one_line(error: Exception) -> str:
    """A failure's words for its record: the exception alone, not where the worker recorded it."""
    return "".join(traceback.format_exception_only(type(error), error))
