"""How a finished job ends: RQ's success path. Plain jobs (no dependents, callback, webhook, repeat or rate limit)
get the writes of RQ's ``handle_job_success`` in one script call for a step's batch (a WATCHed transaction where
Redis runs no Lua); the others go through RQ's own code, a success callback on a callback thread. Each write
takes effect only while this attempt still owns the job: one another attempt owns now is dropped.

A part of ``BatchWorker`` (a mixin: it calls RQ's ``BaseWorker`` and the worker's other ends, and tests reach its
methods on the worker); it uses the worker's ``connection``, ``sender``, ``publisher``, ``metrics`` and
``executions``."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import redis
from rq.callbacks import execute_success_callback
from rq.executions import ExecutionRegistry
from rq.job import JobStatus
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.utils import current_timestamp, now, utcformat

from producer.connection import redis_waits
from producer.protocol import OWNER_FIELD, encode_result, failure_result, result_entry
from worker.end_records import read_entry
from worker.in_flight import InFlight, ended_timings, jobs_named
from worker.job_finish import finish_jobs
from worker.job_finish import register as register_finish_script

log = logging.getLogger("roseinfer.worker")
WRITE_BYTES = 64 * 2**20  # the results one call writes at most (about), but for a single larger one


class SuccessPath:
    """The success path of ``BatchWorker`` (see the module's docstring)."""

    def _succeed(self, done: list[tuple[InFlight, Any]]) -> None:
        """The jobs a step finished, through RQ's success path: for plain jobs (no dependents, repeats, allowed
        callback, webhook, rate limit or result_ttl 0) the same writes as RQ's ``handle_job_success``, for all of
        them in one script call, each taking effect only while this attempt still owns the job; the others one by
        one through RQ's own code. A job another attempt owns now is dropped without a write."""
        plain, through_rq, sizes = [], [], []
        for job, out in done:
            result = self._result(job, out)
            j = job.job
            special = j._success_callback_name or j.webhooks or j.repeats_left or j.has_rate_limit  # RQ frees its slot
            if special or j.get_result_ttl(self.default_result_ttl) == 0:
                through_rq.append((job, result))
            else:
                plain.append((job, result))
                sizes.append(job.result_size)  # (measured as it finished: ``_too_large``)
        finished: list[tuple[InFlight, dict[str, Any]]] = []
        for part in _parts(plain, sizes, WRITE_BYTES):  # (one script call's arguments: not past Redis's 512 MB)
            while True:
                try:
                    written, with_dependents = self._succeed_plain(part)
                except redis.WatchError:
                    continue  # a job hash changed meanwhile (a heartbeat, a cancel): check ownership again
                finished += written
                through_rq += with_dependents
                break
        # A retry of this end (Redis failed on a later job) writes again none that it wrote: RQ's path deletes a
        # result_ttl 0 job, whose missing hash then read as a Redis that lost it (reopened, its callback run twice).
        # (one handed to a callback thread is that thread's to end and count)
        through_rq = [(job, result) for job, result in through_rq if not job.ended_elsewhere]
        written_before = [(job, result) for job, result in through_rq if job.success_written]
        through_rq = [(job, result) for job, result in through_rq if not job.success_written]
        if through_rq:
            for (job, result), mine in zip(through_rq, self._owned([job for job, _ in through_rq], (b"finished",))):
                if mine is False:
                    self._lost_at_end(job)
                    continue
                if mine and job.job._success_callback_name:
                    self._end_with_callback(job, result)  # (its end, and its last event, after its callback)
                    continue
                if mine and not self._through_rq_success(job, result):
                    continue  # the jobs ended beside it go on: it stalled every one after it
                finished.append((job, result))
        for job, _ in (*written_before, *finished):
            if job.success_written:
                self._notify(job)
        finished += written_before
        for job, result in finished:
            self._count_finished(job, result)
        if finished:
            log.info("%s finished", jobs_named([job.job.id for job, _ in finished]))

    def _through_rq_success(self, job: InFlight, result: dict[str, Any]) -> bool:
        """RQ's success path for a job this attempt owns (``_finalize_success``'s steps: its callback, then its
        result, dependents and webhooks); False where its success callback raised, or outlived its timeout: then it
        failed, as RQ fails it. Only this worker's own writes are waited out when Redis fails them (a raise from
        here): a callback's error, a Redis error of its own included, is the job's (retried, it ran the callback
        again at every try, for good), and a callback that ran is not run again by a retry of the writes after it."""
        j = job.job
        self._reclaim(job)
        j._result, j._status = result, JobStatus.FINISHED  # (as RQ's callback and its write read them)
        if not job.called_back:
            self.handle_execution_ended(j, job.queue, j.success_callback_timeout)
            try:
                execute_success_callback(j, self.death_penalty_class, result)
            except Exception as exc:
                job.callback_error = exc
            job.called_back = True
        if job.callback_error is not None:
            self._success_failed(job, job.callback_error, made=result)
            return False
        try:
            self.handle_job_success(job=j, queue=job.queue, started_job_registry=job.queue.started_job_registry,
                                    execution=job.execution)  # fmt: skip  # RQ stores the result
            j.send_webhooks(JobStatus.FINISHED)
        except Exception as exc:
            if redis_waits(exc):  # (down, or refusing writes for now: OOM, READONLY, MISCONF) waited out
                raise
            # Another error (a key of another type, a refused command) fails this job alone, as RQ's perform_job
            # fails it; the jobs ended beside it go on (raised, it left them all unended).
            self._success_failed(job, exc, "its success could not be written", made=result)
            return False
        job.success_written = True
        return True

    def _count_finished(self, job: InFlight, result: dict[str, Any]) -> None:
        """A finished job counted, with the tokens this attempt made of its longest sample (for its time per token)."""
        made = max(len(sample["token_ids"]) for sample in result.get("choices") or [result]) - job.resumed_tokens
        self.metrics.job_ended("finished", result["timings"], made)

    def _notify(self, job: InFlight) -> None:
        """The job's id onto its completion list, once."""
        if not job.notified:
            try:
                self.publisher.notify(self.connection, job.job.id, job.request.notify)
            except redis.exceptions.ResponseError as exc:  # a list it names that holds another type
                log.warning("job %s: its completion list was not written (%s)", job.job.id, exc)
            job.notified = True

    def _end_with_callback(self, job: InFlight, result: dict[str, Any]) -> None:
        """A finished job's end through RQ's path with its allowed success callback, on a callback thread
        (``_end_on_callback_thread``): as RQ, the callback, then the result."""
        tries: list[bool] = []

        def end() -> None:
            if tries and not job.success_written:  # a try after Redis failed it: the job may be another's by now
                [mine] = self._owned([job], (b"finished",))
                if mine is False:
                    self._lost_at_end(job)
                    return
                job.success_written = mine is None  # (an earlier try's end landed, its reply lost)
            tries.append(True)
            if not job.success_written and not self._through_rq_success(job, result):
                return
            self._notify(job)
            self._count_finished(job, result)
            log.info("%s finished", job.job.id)

        self._end_on_callback_thread(job, end)

    def _reclaim(self, job: InFlight) -> None:
        """A job this attempt still owns that RQ failed, put off for a retry or that was canceled while it ran here
        (a stall past its heartbeat; a cancel as it ended): started again and out of those registries before RQ's
        success path reads it. That path read it failed and left its dependents deferred for good, and a retry put
        off ran it again after it finished."""
        with self.connection.pipeline() as pipe:
            pipe.hset(job.job.key, "status", JobStatus.STARTED.value)
            for registry in (job.queue.failed_job_registry, job.queue.canceled_job_registry,
                             job.queue.scheduled_job_registry):  # fmt: skip
                registry.remove(job.job.id, pipeline=pipe)
            pipe.execute()

    def _success_failed(
        self, job: InFlight, exc: Exception, why: str = "its success callback failed", made: dict | None = None
    ) -> None:
        """RQ fails a job whose success callback raised, with that error (retried while it has retries left): so does
        this worker. Its last event, held until now, says so (it went out as "stop" on a failed job); a job RQ
        retries gets none (its next attempt goes on from what this one streamed)."""
        log.error("job %s: %s (%s): the job fails, as RQ fails it", job.job.id, why, exc)
        error = f"the job's {why.removeprefix('its ')}: {exc}"
        result = failure_result(job.job.id, job.request, error, error_type="server_error")
        if made and made.get("usage"):  # (what it made: its last event says it too)
            result["usage"] = made["usage"]
        self._record_failure(job.job, job.queue, job.execution, exc, result, job.request.notify)
        failed = job.job.get_status(refresh=False) == JobStatus.FAILED
        ending = {"finish_reason": "error", "error": error, "error_type": "server_error", "stop_reason": None}
        self.sender.amend_final(job.job.id, job.execution.id, ending if failed else None)
        self.metrics.job_ended("failed" if failed else "retried", ended_timings(job) if failed else None)

    def _succeed_plain(
        self, plain: list[tuple[InFlight, dict[str, Any]]], ended: datetime | None = None
    ) -> tuple[list, list]:
        """RQ's success writes for every job, in one script call that skips the jobs another attempt owns now
        (dropped) and those that got dependents (returned second, for RQ's path, which enqueues them); the jobs
        written come first. The writes to registries and to this worker's counters are one command for the batch.
        Without Lua (a Redis that refuses scripts): in one transaction under WATCH of their hashes (a hash that changed
        meanwhile, a heartbeat or a cancel, makes the caller try again)."""
        ended = ended or now()
        if self.sender.finish_script is not None:
            try:
                lost, held, deleted = self._finish_by_script(plain, ended)
            except redis.exceptions.NoScriptError:  # Redis restarted and forgot it: load it, write again
                self.sender.finish_script = register_finish_script(self.connection)
                lost, held, deleted = self._finish_by_script(plain, ended)
            written, with_dependents = [], []
            for i, (job, result) in enumerate(plain):
                if i in lost:
                    self._lost_at_end(job)
                elif i in deleted:
                    self._lost_at_end(job, deleted=True)
                elif i in held:
                    with_dependents.append((job, result))
                else:
                    self.executions.pop(job.execution.id, None)
                    written.append((job, result))
            return written, with_dependents
        written, with_dependents, lost = [], [], []
        with self.connection.pipeline() as pipe:
            pipe.watch(*[job.job.key for job, _ in plain], *[job.job.dependents_key for job, _ in plain])
            owners = [pipe.hmget(job.job.key, OWNER_FIELD, "status") for job, _ in plain]
            dependents = [pipe.exists(job.job.dependents_key) for job, _ in plain]
            entries = [read_entry(pipe, job) for job, _ in plain]
            pipe.multi()
            for (job, result), (owner, status), has_dependents, entry in zip(plain, owners, dependents, entries):
                mine = self._is_ours(job, owner, status, (b"finished",), entered=entry is not None)
                if mine is False:
                    lost.append(job)  # (once the transaction landed: a WatchError tries all of it again)
                elif mine is None:
                    written.append((job, result))  # by the try whose reply was lost
                elif has_dependents:
                    with_dependents.append((job, result))
                else:
                    self._write_success(pipe, job, result, ended, status)
                    self._count_success(pipe, job, ended)
                    written.append((job, result))
            pipe.execute()
        for job in lost:  # (counted, logged and cleaned up once: before, again at each WatchError's try)
            self._lost_at_end(job)
        for job, _ in written:
            job.job._status = JobStatus.FINISHED
            self.executions.pop(job.execution.id, None)
        return written, with_dependents

    def _finish_by_script(
        self, plain: list[tuple[InFlight, dict[str, Any]]], ended: datetime
    ) -> tuple[list, list, list]:
        jobs = []
        for job, result in plain:
            ttl = job.job.get_result_ttl(self.default_result_ttl)  # not 0 (``_succeed``)
            jobs.append((job.job, job.execution, encode_result(result), ttl, job.request.notify))
        return finish_jobs(
            self.sender.finish_script, self.connection, jobs, self.name, self.key, ended, self.publisher.result_ttl,
            OWNER_FIELD,
        )  # fmt: skip

    def _count_success(self, pipe, job: InFlight, ended: datetime) -> None:
        """This worker's counters in RQ (``rq info``): a job done, its working time."""
        self.increment_successful_job_count(pipeline=pipe)
        self.increment_total_working_time(ended - job.job.started_at, pipe)

    def _write_success(
        self, pipe, job: InFlight, result: dict[str, Any], ended: datetime, status: bytes | None = None
    ) -> None:
        """A finished job's writes: what RQ's ``handle_job_success`` writes, made here without RQ's objects (a
        registry object a write, the result serialized three times, the job's data compressed again: 0.2 ms a
        job). The same keys, fields and values (a test holds them to RQ's own): the job hash's status, end and
        heartbeat (RQ rewrites every field; the others have not changed since the start), the result in RQ's
        result stream (its one copy), the finished registry, the keys' TTLs, the execution's records gone."""
        j, execution = job.job, job.execution
        stamp = utcformat(ended)
        pipe.hset(j.key, mapping={"last_heartbeat": stamp, "status": JobStatus.FINISHED.value, "ended_at": stamp})
        result_ttl = j.get_result_ttl(self.default_result_ttl)  # not 0 (``_succeed``)
        entry = result_entry(result, Result.Type.SUCCESSFUL, self.name, execution=execution, ended=ended)
        self.publisher.write_result(pipe, j.id, entry, result_ttl, job.request.notify)
        expires = "+inf" if result_ttl == -1 else current_timestamp() + result_ttl
        pipe.zadd(FinishedJobRegistry.key_template.format(j.origin), {j.id: expires})
        if status == b"failed":  # abandoned while this worker stalled, and still ours: finished, in one registry
            pipe.zrem(FailedJobRegistry.key_template.format(j.origin), j.id)
        if status == b"canceled":  # canceled as it finished: finished, in one registry
            pipe.zrem(CanceledJobRegistry.key_template.format(j.origin), j.id)
        if status == b"scheduled":  # put off for a retry while this worker stalled: its retry would run it again
            pipe.zrem(ScheduledJobRegistry.key_template.format(j.origin), j.id)
        if result_ttl > 0:  # (the dependents key does not exist: ``_succeed_plain`` checks; RQ expires it too)
            for key in (j.key, j.dependencies_key) if j._dependency_ids else (j.key,):
                pipe.expire(key, result_ttl)
        pipe.delete(execution.key)  # RQ's cleanup_execution
        pipe.zrem(StartedJobRegistry.key_template.format(j.origin), execution.composite_key)
        pipe.zrem(ExecutionRegistry.key_template.format(j.id), execution.id)
        if execution.worker_name:
            pipe.srem(execution.worker_executions_key, execution.composite_key)

    def _lost_at_end(self, job: InFlight, deleted: bool = False) -> None:
        """A job that ended here but belongs to another attempt now, or was ``deleted`` as it ended (RQ's
        ``job.delete()``: it stays so, as one deleted while it ran): only our execution's record goes."""
        if deleted:
            log.info("job %s: deleted as it finished, its result not kept", job.job.id)
        else:
            log.warning("job %s belongs to another attempt now, or RQ failed it (this worker stalled): its end here "
                        "is dropped", job.job.id)  # fmt: skip
            self.sender.drop_final(job.job.id, job.execution.id)  # (its last event would end it a second time)
            if job.ended_elsewhere:  # (a callback thread's end: its last event is held, not in this round trip)
                self.sender.discard_held(job.job.id, job.execution.id)
        self.metrics.job_ended("canceled" if deleted else "lost", None)
        with self.connection.pipeline() as pipe:
            self.cleanup_execution(job.job, pipe, job.execution)
            pipe.execute()


def _parts(items: list, sizes: list[int], budget: int) -> list[list]:
    """``items`` in order, in runs whose ``sizes`` add up to ``budget`` at most (an item larger alone by itself)."""
    parts: list[list] = []
    total = budget + 1
    for item, size in zip(items, sizes):
        if total + size > budget:
            parts.append([])
            total = 0
        parts[-1].append(item)
        total += size
    return parts
