"""An RQ worker that keeps many jobs in flight in one engine: continuous batching behind a Redis queue.

Each loop: take commands from the pub/sub thread, run maintenance when due, pull jobs while the engine has room
(blocking briefly only when idle), run one engine step, then one pipelined round trip that publishes every job's
new text and reads their statuses (a cancel lands within one step). Finished jobs go through RQ's own success
path, so registries, results and ``job.return_value()`` behave as RQ users expect. Heartbeats come from a thread
of their own, so a long step never makes the worker look dead.

Whatever one job does fails that job alone: an unreadable hash, a payload the engine refuses, a callback it names,
an exception inside a step (then the jobs of that step fail, through RQ's retry policy). The process keeps serving.
"""

from __future__ import annotations

import logging
import queue as queue_mod
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from rq import worker_registration
from rq.command import parse_payload
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import clean_registries
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.timeouts import JobTimeoutException, TimerDeathPenalty
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from producer.protocol import STATS_KEY
from producer.schema import JobRequest
from worker.heartbeat import Heartbeat
from worker.intake import REDIS_DOWN, HookPolicy, Unreadable, pull, quarantine
from worker.jobs import JobRejected, JobStopped, add_to_engine, build_result, failure_result, parse_request, usage
from worker.publisher import JobStream, Publisher
from worker.settings import WorkerSettings

log = logging.getLogger("roseinfer.worker")


class StepFailed(Exception):
    """An engine step raised: the jobs it ran fail (and are retried where their policy allows)."""


@dataclass
class InFlight:
    job: Job
    queue: Queue
    execution: Execution
    request: JobRequest
    stream: JobStream
    started_at: float
    deadline: float | None
    first_token_at: float | None = None


class BatchWorker(BaseWorker):
    def __init__(self, engine: Any, settings: WorkerSettings, connection: redis.Redis) -> None:
        super().__init__(
            settings.queue,
            name=settings.name,
            connection=connection,
            serializer=JSONSerializer,
            maintenance_interval=settings.maintenance_interval,
            job_monitoring_interval=settings.heartbeat_interval,
        )
        # An allowed callback's time limit by a timer thread, not SIGALRM: the loop may run off the main thread.
        self.death_penalty_class = TimerDeathPenalty
        self.engine = engine
        self.settings = settings
        self.hooks = HookPolicy(frozenset(settings.allow_callback), frozenset(settings.allow_webhook_host))
        self.publisher = Publisher(settings.stream_maxlen, settings.stream_ttl, settings.result_ttl)
        self.in_flight: dict[str, InFlight] = {}
        self._stop_jobs: queue_mod.SimpleQueue[str] = queue_mod.SimpleQueue()  # from the pub/sub thread
        self._force_stop = False
        self._next_suspension_check = 0.0
        self._suspended = False
        self.tokens = 0  # generated so far (read by the heartbeat thread for tokens/s)
        self._finishing: list[tuple[InFlight, Any]] = []  # finished in the engine, not yet recorded in Redis
        self._heartbeat = Heartbeat(self)

    # ----- RQ hooks ----------------------------------------------------------------------------------
    def _set_ip_address(self, connection: redis.Redis) -> None:
        try:
            super()._set_ip_address(connection)
        except (ValueError, redis.exceptions.ResponseError):  # servers without a parseable CLIENT INFO
            self.ip_address = "unknown"

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # RQ adds a fixed 60 s; a shorter grace makes a dead worker's jobs come back sooner.
        return self.settings.heartbeat_interval + self.settings.heartbeat_grace

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_stop_signal)
            signal.signal(signal.SIGTERM, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        # Flags only: raising here could strand a job between dequeue and start.
        if self._stop_requested:
            log.warning("second stop signal: handing %d jobs back to the queue", len(self.in_flight))
            self._force_stop = True
        else:
            log.warning(
                "stop signal: no new jobs; finishing the %d in flight (again to hand them back)", len(self.in_flight)
            )
            self._stop_requested = True
            self._shutdown_requested_date = now()

    def request_stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        self._on_stop_signal(signum, frame)

    def handle_payload(self, message: dict) -> None:
        """Commands on the worker's channel (pub/sub thread): stop-job for any job in flight, shutdown."""
        try:
            payload = parse_payload(message)
        except Exception:
            log.warning("unreadable worker command %r", message)
            return
        command = payload.get("command")
        if command in ("stop-job", "stop-execution") and payload.get("job_id"):
            self._stop_jobs.put(payload["job_id"])
        elif command == "shutdown":
            self.request_stop()
        else:
            log.info("command %r ignored by the batching worker", command)

    def clean_registries(self) -> None:
        """RQ's registry clean-up (as BaseWorker does it), which raises on job hashes it cannot read: here an
        error is logged, never fatal, and the queue's maintenance lock is always released."""
        for queue in self.queues:
            if not queue.acquire_maintenance_lock():
                continue
            try:
                clean_registries(queue, self._exc_handlers)
                worker_registration.clean_worker_registry(queue)
                queue.intermediate_queue.cleanup(self, queue)
            except REDIS_DOWN:
                raise
            except Exception:
                log.exception("maintenance of queue %s failed (a job hash RQ cannot read?); carrying on", queue.name)
            finally:
                queue.release_maintenance_lock()
        self.last_cleaned_at = now()

    # ----- the loop ----------------------------------------------------------------------------------
    def work(self, burst: bool = False, logging_level: str | None = "INFO", **_: Any) -> bool:
        self.bootstrap(logging_level)
        self._install_signal_handlers()
        self._heartbeat.start()
        worked = False
        backoff = 0.5
        try:
            while True:
                try:
                    if self._force_stop:
                        self._hand_back_all()
                        break
                    if self._loop_once(burst):
                        worked = True
                    elif not self.in_flight and not self._finishing and (self._stop_requested or burst):
                        break
                    backoff = 0.5
                except REDIS_DOWN as exc:
                    log.error("Redis unreachable (%s); the engine waits, retrying in %.1f s", exc, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
        finally:
            self._heartbeat.stop()
            self.teardown()
        log.info("worker %s stopped", self.name)
        return worked

    def _loop_once(self, burst: bool) -> bool:
        """One iteration; False when there was nothing to do."""
        self._settle()
        self._apply_stop_requests()
        mono = time.monotonic()
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        if not self._stop_requested and not self._is_suspended(mono):
            self._pull(block=not self.in_flight and not burst)
        if not self.in_flight:
            if self.publisher.outbox:  # the last events of jobs that just ended early
                self._flush()
            return False
        if not self.publisher.outbox:  # a step's events still unsent: hold the engine until Redis takes them
            self._step()
        self._flush()
        self._settle()
        return True

    def _is_suspended(self, mono: float) -> bool:
        # is_suspended also refreshes our worker key's TTL: checked once a second, not every step.
        if mono >= self._next_suspension_check:
            self._next_suspension_check = mono + 1.0
            suspended = bool(is_suspended(self.connection, self))
            if suspended != self._suspended:
                log.warning(
                    "queue %s by `rq %s`", "suspended" if suspended else "resumed", "suspend" if suspended else "resume"
                )
            self._suspended = suspended
        return self._suspended

    # ----- jobs in ------------------------------------------------------------------------------------
    def _pull(self, block: bool) -> None:
        room = min(self.settings.in_flight_limit - len(self.in_flight), 64)
        if room <= 0:
            return
        pulled, unreadable = pull(
            self._ordered_queues,
            room,
            self.settings.idle_wait if block else None,
            self.connection,
            self.job_class,
            self.serializer,
        )
        for item in unreadable:
            self._reject_unreadable(item)
        fresh = []
        for job, queue in pulled:
            if job.id in self.in_flight:
                self._keep_running_copy(job, queue)
            else:
                fresh.append((job, queue))
        if fresh:
            self._start(fresh)

    def _keep_running_copy(self, job: Job, queue: Queue) -> None:
        """A job RQ requeued while this worker still runs it (a stall outlived its heartbeat): the running copy
        goes on, the pulled one is dropped, and the job is marked ours again."""
        log.warning("job %s came back to the queue while it runs here; the running copy carries on", job.id)
        held = self.in_flight[job.id]
        ttl = self.get_heartbeat_ttl(job)
        with self.connection.pipeline() as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            held.execution.heartbeat(held.job.started_job_registry, ttl, pipe)
            held.job.set_status(JobStatus.STARTED, pipeline=pipe)
            held.job.heartbeat(now(), ttl, pipeline=pipe)
            pipe.execute()

    def _start(self, pulled: list[tuple[Job, Queue]]) -> None:
        executions = self._mark_started(pulled)
        requests: list[tuple[Job, Queue, Execution, JobRequest | None, Exception | None]] = []
        for (job, queue), execution in zip(pulled, executions):
            try:
                refused = self.hooks.refuse(job)
                if refused:
                    raise JobRejected(refused)
                requests.append((job, queue, execution, parse_request(job, self.settings.max_job_bytes), None))
            except JobRejected as exc:
                requests.append((job, queue, execution, None, exc))
            except Exception as exc:  # anything else about one job stays with that job
                log.exception("job %s could not be read", job.id)
                requests.append((job, queue, execution, None, JobRejected(f"unreadable job: {exc}")))
        streams = self.publisher.resume(self.connection, [job.id for job, *_ in requests])
        wall = time.time()
        for job, queue, execution, req, error in requests:
            stream = streams[job.id]
            if error is None:
                try:
                    add_to_engine(self.engine, job.id, req)
                except JobRejected as exc:
                    error = exc
                except Exception as exc:  # an engine bug on this one job: it fails, the rest go on
                    log.exception("job %s: the engine could not take it", job.id)
                    error = JobRejected(f"the engine could not take this job: {type(exc).__name__}: {exc}")
            if error is not None:
                self._fail(job, queue, execution, req, stream, error)
                continue
            timeout = job.timeout if job.timeout and job.timeout > 0 else None
            self.in_flight[job.id] = InFlight(
                job, queue, execution, req, stream, wall, wall + timeout if timeout else None
            )
            log.info("job %s started (%d in flight)", job.id, len(self.in_flight))
        self._set_busy(bool(self.in_flight))

    def _mark_started(self, pulled: list[tuple[Job, Queue]]) -> list[Execution]:
        """RQ's prepare_execution + prepare_job_execution for every pulled job, in one pipeline (and without
        touching the job's data, which may be unreadable: that job then fails properly)."""
        ttl = self.get_heartbeat_ttl(None)  # type: ignore[arg-type]
        executions = []
        with self.connection.pipeline() as pipe:
            for job, queue in pulled:
                execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
                self.executions[execution.id] = execution
                executions.append(execution)
                job.heartbeat(now(), ttl, pipeline=pipe)
                job.prepare_for_execution(self.name, pipeline=pipe)
                pipe.persist(job.key)
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            self.heartbeat(max(ttl, self.worker_ttl) + 60, pipeline=pipe)
            self._state = WorkerStatus.BUSY
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            pipe.execute()
        return executions

    # ----- the step -----------------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        wall = time.time()
        for out in outputs:
            job = self.in_flight.get(out.request_id)
            if job is None:
                continue
            if job.first_token_at is None and out.delta_token_ids:
                job.first_token_at = wall
            self.tokens += len(out.delta_token_ids)
            reason = out.outputs[0].finish_reason
            self.publisher.add(
                job.stream, out.delta_text, out.delta_token_ids, reason, usage(out) if out.finished else None
            )
            if out.finished:
                del self.in_flight[out.request_id]
                self._finishing.append((job, out))
        for job in list(self.in_flight.values()):
            if job.deadline is not None and wall > job.deadline:
                self._end_early(job, JobTimeoutException(f"job exceeded its timeout of {job.job.timeout} s"))

    def _step_failed(self, exc: Exception) -> None:
        """The step raised and its culprit cannot be named: every job the engine was running fails (through RQ's
        retry policy, so the innocent ones run again); waiting jobs and the process carry on."""
        running = [seq.request_id for seq in self.engine.scheduler.running()]
        log.error("an engine step failed (%s: %s); failing its %d jobs", type(exc).__name__, exc, len(running))
        for job_id in running:
            job = self.in_flight.get(job_id)
            if job is None:
                self.engine.abort_request(job_id)
            else:
                reason = f"the engine step running this job failed: {type(exc).__name__}: {exc}"
                self._end_early(job, StepFailed(reason))

    def _flush(self) -> None:
        """Send the step's events and read every job's status, in one round trip."""
        jobs = list(self.in_flight.values())
        with self.connection.pipeline(transaction=False) as pipe:
            self.publisher.flush(pipe)
            for job in jobs:
                pipe.hget(job.job.key, "status")
            # `birth` is written only by registration (heartbeats recreate the key without it): gone, Redis lost data.
            pipe.hexists(self.key, "birth")
            replies = pipe.execute()
        self.publisher.sent()
        worker_known = bool(replies[-1])
        statuses = replies[len(replies) - len(jobs) - 1 : -1]
        if not worker_known:
            self._redis_lost_data()
        for job, status in zip(jobs, statuses):
            if status is None and not worker_known:
                continue  # not deleted by anyone: Redis restarted empty; the job finishes and its result is written
            if status in (b"canceled", b"stopped", None) and job.job.id in self.in_flight:
                self._end_early(job, JobStopped(f"job {status.decode() if status else 'deleted'} by request"))

    def _redis_lost_data(self) -> None:
        """Our registration is gone: Redis restarted without its data (no AOF). Register again; the jobs in flight
        carry on and write their results (their hashes come back with them)."""
        log.error("Redis lost its data (restarted without persistence?): registering again, jobs in flight go on")
        self.connection.delete(self.key)  # what heartbeats recreated since, so registration does not see a twin
        self.register_birth()
        self.set_state(WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE)
        ttl = self.get_heartbeat_ttl(None)  # type: ignore[arg-type]
        with self.connection.pipeline() as pipe:
            for held in self.in_flight.values():  # written back from memory, so they read as started, not deleted
                held.job.save(pipeline=pipe)
                held.job.set_status(JobStatus.STARTED, pipeline=pipe)
                held.execution.heartbeat(held.job.started_job_registry, ttl, pipe)
            pipe.execute()

    def _apply_stop_requests(self) -> None:
        while not self._stop_jobs.empty():
            job_id = self._stop_jobs.get()
            job = self.in_flight.get(job_id)
            if job is None:
                log.info("stop-job %s: not in flight here, ignored", job_id)
                continue
            self._stopped_job_id = job_id  # RQ then marks it STOPPED, not FAILED, and never retries it
            self._end_early(job, JobStopped("job stopped by a stop-job command"))

    # ----- jobs out -----------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Record finished jobs in Redis (RQ result, result key); kept for later if Redis is down."""
        while self._finishing:
            job, out = self._finishing[0]
            try:
                self._succeed(job, out)
            except REDIS_DOWN:
                raise
            except Exception:
                log.exception("job %s: could not record its result", job.job.id)
            self._finishing.pop(0)
        self._set_busy(bool(self.in_flight))

    def _set_busy(self, busy: bool) -> None:
        state = WorkerStatus.BUSY if busy else WorkerStatus.IDLE
        if self._state != state:
            self.set_state(state)

    def _result(self, job: InFlight, out: Any) -> dict[str, Any]:
        return build_result(
            job.job,
            job.request,
            out,
            model=self.settings.model,
            started_at=job.started_at,
            first_token_at=job.first_token_at,
        )

    def _succeed(self, job: InFlight, out: Any) -> None:
        result = self._result(job, out)
        self.publisher.write_result(self.connection, job.job.id, result)
        self._finalize_success(job.job, job.queue, job.execution, result)

    def _end_early(self, job: InFlight, reason: Exception) -> None:
        """Cancel, stop-job, timeout or a failed step: the engine frees the job's blocks now; the stream gets a
        last event."""
        out = self.engine.abort_request(job.job.id)
        self.in_flight.pop(job.job.id, None)
        canceled = isinstance(reason, JobStopped)
        # A failure RQ will retry is not the end of the job: its stream goes on with the next attempt.
        retrying = not canceled and bool(job.job.retries_left)
        finish = "abort" if canceled else "error"
        if out is not None and not retrying:
            self.publisher.add(job.stream, out.delta_text, [], finish, usage(out), None if canceled else str(reason))
            self._flush_outbox()  # the last event lands before the status that tells followers to stop
        if canceled:
            result = self._result(job, out) if out is not None else None
            with self.connection.pipeline() as pipe:
                if result is not None:
                    self.publisher.write_result(pipe, job.job.id, result)
                if self._stopped_job_id == job.job.id:
                    pipe.execute()
                    self._record_failure(job.job, job.queue, job.execution, reason)
                else:
                    self.cleanup_execution(job.job, pipe, job.execution)
                    pipe.execute()
            log.info("job %s %s", job.job.id, reason)
        else:
            if not retrying:
                self.publisher.write_result(
                    self.connection, job.job.id, failure_result(job.job.id, job.request, str(reason))
                )
            self._record_failure(job.job, job.queue, job.execution, reason)

    def _fail(
        self, job: Job, queue: Queue, execution: Execution, req: JobRequest | None, stream: JobStream, error: Exception
    ) -> None:
        """A job that can never run: fails alone, with its reason in RQ's failed registry, no retry."""
        log.warning("job %s rejected: %s", job.id, error)
        self.publisher.add(stream, "", [], "error", {}, str(error))
        self._flush_outbox()
        self.publisher.write_result(self.connection, job.id, failure_result(job.id, req, str(error)))
        job.retries_left = None
        self._record_failure(job, queue, execution, error)

    def _reject_unreadable(self, item: Unreadable) -> None:
        """A job hash RQ cannot read: moved aside (never built into a Job), its reason in its result and stream."""
        log.error("job %r cannot be read (%s): moved to %s", item.job_id, item.reason, "roseinfer:rejected")
        stream = self.publisher.resume(self.connection, [item.job_id])[item.job_id]
        self.publisher.add(stream, "", [], "error", {}, item.reason)
        with self.connection.pipeline(transaction=False) as pipe:
            self.publisher.flush(pipe)
            self.publisher.write_result(pipe, item.job_id, failure_result(item.job_id, None, item.reason))
            quarantine(pipe, item, self.settings.result_ttl)
            pipe.execute()
        self.publisher.sent()

    def _record_failure(self, job: Job, queue: Queue, execution: Execution, error: Exception) -> None:
        try:
            raise error
        except Exception:
            self._finalize_failure(job, queue, execution, sys.exc_info())

    def _flush_outbox(self) -> None:
        with self.connection.pipeline(transaction=False) as pipe:
            self.publisher.flush(pipe)
            pipe.execute()
        self.publisher.sent()

    def _hand_back_all(self) -> None:
        """Second stop signal: every job in flight goes back to the front of its queue, retries untouched."""
        for job in self.in_flight.values():
            self.engine.abort_request(job.job.id)
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job.job, pipe, job.execution)
                pipe.execute()
            job.queue.enqueue_job(job.job, at_front=True)
        log.warning("%d jobs handed back", len(self.in_flight))
        self.in_flight.clear()

    def stats(self) -> dict[str, Any]:
        """What `roseinfer status` shows of this worker (read by the heartbeat thread)."""
        return {"in_flight": len(self.in_flight), "queue": self.settings.queue, "model": self.settings.model}

    def stats_key(self) -> str:
        return STATS_KEY.format(worker=self.name)
