"""An RQ worker that keeps many jobs in flight in one engine: continuous batching behind a Redis queue.

It is the RQ adapter over the Redis-free ``Pump``: each loop takes the cancels and stop requests that came in,
runs maintenance when due, pulls jobs while the engine has room (blocking briefly only when idle), runs one pump
step, and hands what the step produced to the ``Sender`` thread, which writes it to Redis off the step loop
(events, then results and RQ's success or failure path, in order) and reads the statuses of the jobs in flight in
the same round trip (a cancel lands within a step or two). Heartbeats come from a thread of their own, so a long
step never makes the worker look dead. Finished jobs go through RQ's own success path, so registries, results and
``job.return_value()`` behave as RQ users expect.

Whatever one job does fails that job alone: an unreadable hash, a payload the engine refuses, a callback it names,
an exception inside a step (then the jobs of that step fail, through RQ's retry policy). The process keeps serving.

This file holds the loop, the jobs' intake and start, and the routing of a step's events. The jobs' ends are
mixins of their own files, since they call RQ's ``BaseWorker`` and the worker's state alike: ``success_path``,
``job_ends`` (cancels, failures, refusals), ``end_records`` (RQ's failure and stop records, ownership),
``reports`` (what comes back between steps) and ``hand_back`` (a stop's); ``maintenance`` is RQ's housekeeping.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue as queue_mod
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from rq import worker_registration
from rq.command import parse_payload
from rq.defaults import DEFAULT_WORKER_TTL
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.timeouts import TimerDeathPenalty
from rq.utils import now, utcformat
from rq.worker import BaseWorker, WorkerStatus

from producer.connection import REDIS_UNAVAILABLE, redis_waits
from producer.protocol import (
    BULK_PRIORITY,
    LEASE_KEY,
    MODEL_FIELD,
    OWNER_FIELD,
    RESUMED_FROM_FIELD,
    START_FIELD,
    STATS_KEY,
    STREAM_OF_FIELD,
    TEMPLATE_KEY,
    TOKENIZER_KEY,
    lane_name,
    lane_priority,
    lanes,
    mixed_models,
    model_identity,
    queue_stream_check,
    stream_check,
    stream_key,
    tokenizer_digest,
)
from roseinfer.config import ConfigError, quantization_name
from worker.end_records import EndRecords
from worker.engine_process import EngineProcessDied
from worker.hand_back import HAND_BACK_PATIENCE_S, HandBack
from worker.heartbeat import Heartbeat
from worker.in_flight import InFlight, enqueued_at, jobs_named
from worker.intake import HookPolicy
from worker.job_ends import JobEnds
from worker.job_start import queue_start, start_jobs
from worker.job_start import register as register_start_script
from worker.jobs import (
    piece_bytes,
    result_bytes,
    run_limit,
    system_fingerprint,
    usage,
)
from worker.maintenance import Maintenance
from worker.metrics import WorkerMetrics
from worker.publisher import JobStream, Publisher
from worker.puller import Arrival, NeverRan, Puller, Rejected, RunningCopy
from worker.pump import JobEvent, Pump
from worker.reports import Reports
from worker.sender import Batch, Sender
from worker.settings import WorkerSettings
from worker.success_path import SuccessPath
from worker.watchdog import StepWatchdog

log = logging.getLogger("roseinfer.worker")
CALLBACK_THREADS = 8  # jobs' allowed callbacks run at once, off the thread that writes every job's tokens
LEAVE_PATIENCE_S = 3.0  # and then the way out (threads, unsent writes, unregistering) waits on Redis this long
SENDER_DRAIN_S = 30.0  # a warm stop waits this long for the sender before the callback threads shut down
START_RETRY_S = 30.0  # a start whose reply was lost is sent again this long at most (and within half its TTL)


def name_in_use(connection: redis.Redis, name: str, beat_ttl: int, worker_ttl: int = DEFAULT_WORKER_TTL) -> str | None:
    """Why a worker cannot register in RQ as ``name`` (one of that name is, alive, and has not registered its death),
    or None. A worker that died without a word (killed) is taken for dead once ``lapsed_registration`` says so."""
    key = f"{BaseWorker.redis_worker_namespace_prefix}{name}"
    if not connection.exists(key) or connection.hexists(key, "death"):
        return None
    if lapsed_registration(connection, name, beat_ttl, worker_ttl) is not None:
        return None
    return (
        f"a worker named {name!r} is registered on this Redis already, and beats (if it is gone, its name is free "
        f"{beat_ttl} s after its last heartbeat): give this one another --name"
    )


def lapsed_registration(connection: redis.Redis, name: str, beat_ttl: int, worker_ttl: int) -> int | None:
    """Seconds since a worker registered as ``name`` last beat, if it is dead: its statistics lapsed (they last one
    heartbeat TTL of its own) and its registration was last written at least ``beat_ttl`` ago (Redis's clock: the
    TTL this worker's beats set, less what is left of it), so not a worker starting this moment. None: alive, or
    written with other TTLs than these (left to lapse). A killed worker with a fixed ``--name`` held it ~8 minutes
    (RQ's ``worker_ttl`` plus 60 s), its restarts refused while its GPU idled."""
    key = f"{BaseWorker.redis_worker_namespace_prefix}{name}"
    with connection.pipeline(transaction=False) as pipe:
        pipe.exists(STATS_KEY.format(worker=name))
        pipe.ttl(key)
        stats, left = pipe.execute()
    since = max(beat_ttl, worker_ttl) + 60 - left
    return since if not stats and left > 0 and since >= beat_ttl else None


class BatchWorker(Reports, HandBack, SuccessPath, JobEnds, EndRecords, BaseWorker):
    def __init__(self, engine: Any, settings: WorkerSettings, connection: redis.Redis, pump: Any = None) -> None:
        self.hooks = HookPolicy(frozenset(settings.allow_callback), frozenset(settings.allow_webhook_host))
        self.settings = settings  # (read by ``connection_timeout`` as RQ's __init__ sets the connection up)
        super().__init__(
            settings.queue,
            name=settings.name,
            connection=connection,
            serializer=JSONSerializer,
            job_class=self.hooks.job_class(),  # (RQ's maintenance reads jobs through it too)
            maintenance_interval=settings.maintenance_interval,
            job_monitoring_interval=settings.heartbeat_interval,
        )
        # An allowed callback's time limit by a timer thread, not SIGALRM: the loop may run off the main thread.
        self.death_penalty_class = TimerDeathPenalty
        # A job written without result_ttl (another language, say) keeps its result and status this long.
        self.default_result_ttl = settings.result_ttl
        self.engine = engine
        self.settings = settings
        self.pump = pump if pump is not None else Pump(engine)  # an EngineProcess when the engine runs apart
        self.publisher = Publisher.from_settings(settings)
        self.sender = Sender(connection, self.publisher, self._on_statuses, self._reports_lost)
        self.in_flight: dict[str, InFlight] = {}
        self._tasks: list = []  # job endings of this step, for the sender, after its events
        # Jobs out of in_flight (or failed as they came) whose endings wait in the sender: still beaten.
        self._ending: dict[str, InFlight | Arrival] = {}
        self._callback_ends = ThreadPoolExecutor(CALLBACK_THREADS, thread_name_prefix="roseinfer-callback")
        self._stop_record_lock = threading.Lock()  # (RQ's record of a stop reads the worker's _stopped_job_id)
        # (job id, its execution to stop or None: any, when asked) from the pub/sub thread; those of jobs still on
        # their way in wait for them here.
        self._stop_jobs: queue_mod.SimpleQueue[tuple[str, str | None, float]] = queue_mod.SimpleQueue()
        # Arrivals a Redis error left unapplied (a stack, with whether each came from the puller): applied first next.
        self._arrivals_left: list[tuple[Any, bool]] = []
        self._stops_waiting: list[tuple[str, str | None, float]] = []
        self._reports: queue_mod.SimpleQueue = queue_mod.SimpleQueue()  # statuses read by the sender thread
        self._lost: queue_mod.SimpleQueue[str] = queue_mod.SimpleQueue()  # jobs another attempt owns now
        self._force_stop = False
        self._stop_at: float | None = None  # when the first stop signal came (monotonic): the drain's start
        self._unstarted_handed_back = False  # at the first stop: the jobs not generating yet went back
        self._next_suspension_check = 0.0
        self._suspended = False
        self._next_hand_over = 0.0
        self._pubsub_log_after = 0.0  # the command listener's next line about Redis being unavailable
        # In every result (OpenAI's system_fingerprint):
        self.fingerprint = system_fingerprint(self.settings, getattr(self.pump, "numerics", ""))
        self.start_token = uuid.uuid4().hex  # this start's, in its registration (``START_FIELD``) and lease key
        self.name_taken = False  # another start registered under this worker's name (this one taken for dead)
        self.tokenizer_digest = ""  # of the tokenizer this worker wrote to Redis (TOKENIZER_KEY)
        # What its starts write in a job's MODEL_FIELD: a job an attempt of another model streamed starts over here
        self.model_identity = model_identity(settings.model, getattr(engine, "tokenizer_json", lambda: None)())
        self.template_digest = ""  # of its chat template (TEMPLATE_KEY)
        self._step_s = 0.0  # how long the last engine step took
        # An engine in this process: a hung step ends the process (an engine process has a watchdog of its own).
        # Its death registered on the way out: a supervisor's restart under a fixed --name is not refused for the
        # registration's TTL (its jobs are still recovered as a dead worker's: their heartbeats stop).
        self._watchdog = StepWatchdog(
            settings.engine_step_timeout if isinstance(self.pump, Pump) else 0, last_words=self.register_death
        )
        if isinstance(self.pump, Pump):
            self.pump.on_admitted = self._watchdog.began
        self._next_maintenance = 0.0
        self._watching = False
        self.tokens = 0  # generated so far (read by the heartbeat thread for tokens/s)
        self._heartbeat = Heartbeat(self)
        self.maintenance = Maintenance(
            self.connection, self._heartbeat, settings, self.hooks, self._callback_ends.submit
        )
        self.puller = Puller(self)
        self.sender.on_jobs_waiting = self.puller.wake
        self.sender.on_idle = self._on_sender_idle
        # (priority, queue) of the lanes served, first-served first: the default ones now, more found each second.
        self._lanes: list[tuple[int, Queue]] = [(0, self.queues[0])]
        self._set_lanes([(0, settings.queue), (BULK_PRIORITY, lane_name(settings.queue, BULK_PRIORITY))])
        self._odd_lanes_said: set[str] = set()  # names in rq:queues that look like lanes but are none, said once
        self.metrics = WorkerMetrics()
        self.metrics.watch(self)
        self.sender.on_round_trip = self.metrics.redis_rtt.observe

    # ----- RQ hooks ----------------------------------------------------------------------------------
    def _on_sender_idle(self) -> None:
        """Everything sent: with nothing in flight the puller blocks on the queues now, rather than look again
        ``LOOK_AGAIN_S`` later (the pull after the last job's end could not block while its results went out)."""
        if not self.in_flight:
            self.puller.wake()

    def _set_ip_address(self, connection: redis.Redis) -> None:
        try:
            super()._set_ip_address(connection)
        except (ValueError, redis.exceptions.ResponseError):  # servers without a parseable CLIENT INFO
            self.ip_address = "unknown"

    @property
    def connection_timeout(self) -> int:
        """The socket timeout RQ gives the worker's connection unless it has a longer one (the worker's own)."""
        return self.settings.socket_timeout

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
            # (the patience first: a stop from another thread's command may be seen by the loop between the two; a
            # third signal keeps the second's, else each one put it off)
            if not (self._force_stop and self.sender.give_up_at is not None):
                self.sender.give_up_at = time.monotonic() + HAND_BACK_PATIENCE_S  # a blip is waited out, no more
            self._force_stop = True
        else:
            if self.in_flight:
                log.warning(
                    "stop signal: no new jobs; finishing the %d in flight (a second signal hands them back)",
                    len(self.in_flight),
                )
            else:  # (idle: "finishing the 0 in flight")
                log.warning("stop signal: no job in flight; stopping")
            self._stop_requested = True
            self._stop_at = time.monotonic()
            self._shutdown_requested_date = now()
            if self.settings.drain_timeout is not None:  # what the drain check sets at the timeout, set now: a loop
                # held in the sender's put by an outage never reached that check, and the worker never left
                self.sender.give_up_at = self._stop_at + self.settings.drain_timeout + HAND_BACK_PATIENCE_S

    @property
    def stop_requested(self) -> bool:
        """A stop signal (or ``request_stop``) came: ``work`` returned for it, not for a burst's end."""
        return self._stop_requested

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
            execution = payload.get("execution_id") if command == "stop-execution" else None
            self._stop_jobs.put((payload["job_id"], execution or None, time.monotonic()))
        elif command == "shutdown":
            self.request_stop()
        else:
            log.info("command %r ignored by the batching worker", command)

    def _pubsub_exception_handler(self, exc: Exception, pubsub: Any, pubsub_thread: Any) -> None:
        """The command listener (stop-job, shutdown) waits out every Redis outage and tries again: RQ's own waits
        out a refused connection only, and one reconnect that timed out (a partition, a host that answers nothing)
        ended the thread for good, the worker deaf to commands from then on."""
        if isinstance(exc, redis.exceptions.NoPermissionError):  # (no outage: it would be refused for good)
            log.error(
                "this Redis user may not subscribe to RQ's command channel (%s): stop-job and shutdown commands do "
                "not reach this worker (grant it &rq:pubsub:*); SIGTERM still stops it", exc
            )  # fmt: skip
            pubsub_thread.stop()
            return
        mono = time.monotonic()
        if mono >= self._pubsub_log_after:  # one line a minute through an outage, not one every two seconds
            log.warning("worker commands: Redis unavailable (%s: %s); listening again in 2 s", type(exc).__name__, exc)
            self._pubsub_log_after = mono + 60
        time.sleep(2.0)

    def clean_registries(self) -> None:
        """RQ's registry clean-up, made safe (``Maintenance.clean``)."""
        if self.maintenance.clean(self.queues, self._exc_handlers):
            self.last_cleaned_at = now()

    def clean_group_registries(self) -> None:
        self.maintenance.clean_groups()

    # ----- the loop ----------------------------------------------------------------------------------
    def work(
        self, burst: bool = False, logging_level: str | None = "INFO", max_jobs: int | None = None,
        max_idle_time: int | None = None, with_scheduler: bool = True, **_formats: Any,
    ) -> bool:  # fmt: skip
        """RQ's ``Worker.work``: ``burst`` ends once the queues are empty (or suspended). Due scheduled jobs and
        retries are moved to their queues always (``with_scheduler`` is taken, and cannot be turned off). RQ's
        ``max_jobs`` and ``max_idle_time`` have no meaning for a worker that holds many jobs at once: refused, not
        dropped without a word (``work(max_jobs=1)`` ran every job and never stopped)."""
        if max_jobs is not None or max_idle_time is not None or not with_scheduler:
            given = "max_jobs" if max_jobs is not None else "max_idle_time" if max_idle_time is not None else None
            raise ValueError(
                f"the batching worker takes no {given}: it holds many jobs at once (use burst=True to stop once the "
                "queues are empty)"
                if given
                else "the batching worker always moves due scheduled jobs to their queues"
            )
        unknown = set(_formats) - {"date_format", "log_format", "dequeue_strategy"}
        if unknown:
            raise TypeError(f"work() got unexpected arguments {sorted(unknown)}")
        try:
            self._start(burst, logging_level)
        except BaseException:  # (a name in use, a metrics port taken): an engine process must not outlive it
            self.pump.close()
            self.metrics.close()
            raise
        worked = False
        backoff = 0.5
        try:
            while True:
                try:
                    if self._stop_requested and not self._force_stop:
                        self._drain_check()
                    if self._force_stop:
                        self._hand_back_cold()  # (fenced: a job another attempt owns now is not touched)
                        break
                    if self._loop_once():
                        worked = True
                    elif self._done(burst):
                        self.puller.stop()  # a pull under way hands over what it took: those jobs run first
                        if self.puller.quiet:
                            break
                    elif not self.in_flight:
                        self.puller.wait(0.05)  # nothing to run: until jobs arrive
                    backoff = 0.5
                except (*REDIS_UNAVAILABLE, redis.exceptions.ResponseError) as exc:
                    if not redis_waits(exc):
                        raise
                    log.error("Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
        except Exception:
            # The worker dies of an error it does not know: its jobs go back to their queues for another worker
            # now (they sat "started" until its heartbeat lapsed, then RQ's clean-up spent a retry or failed them).
            # Those the puller started and the loop has not taken in yet go back too (a maintenance comes first).
            if (self.in_flight or self.puller.unapplied() or not self.puller.quiet) and not self._force_stop:
                try:
                    self._hand_back_cold()
                except Exception as exc:
                    log.error("handing jobs back met the error again (%s): handed back with Redis's writes alone", exc)
                    try:
                        self._hand_back_as_they_are()
                    except Exception as exc:
                        held = len(self.in_flight)
                        log.error("could not hand back %d jobs (%s): RQ's clean-up takes them", held, exc)
            raise
        finally:
            self._watchdog.stop()
            try:
                if self._force_stop:  # a cold stop does not wait for Redis (what it leaves undone, RQ's clean-up does)
                    leaving = threading.Thread(target=self._leave, name="roseinfer-leaving", daemon=True)
                    leaving.start()
                    leaving.join(max(LEAVE_PATIENCE_S, (self.sender.give_up_at or 0) - time.monotonic()))
                    if leaving.is_alive():
                        log.error("Redis does not answer: the worker leaves without unregistering (it lapses with "
                                  "its heartbeat, as a killed worker's)")  # fmt: skip
                else:
                    self._leave()
            finally:  # the engine and the metrics port are let go whatever Redis said on the way out
                self.pump.close()
                self.metrics.close()
        log.info("worker %s stopped", self.name)
        return worked

    def _leave(self) -> None:
        """The threads stopped, what is unsent sent, the registration removed. Each stop whatever the one before
        raised (a Redis refusal in the sender's last writes left the heartbeat beating for a stopped worker)."""
        try:
            self.puller.stop()
            if not self._force_stop:  # the ends the sender has yet to hand to the callback threads go there first
                self.sender.drain(SENDER_DRAIN_S)
            # (callbacks have their time limits; their ends still write. A cold stop starts none still queued: RQ's
            # clean-up takes those jobs, as a worker killed mid-callback leaves them)
            self._callback_ends.shutdown(wait=not self._force_stop, cancel_futures=self._force_stop)
            self.sender.stop()
        finally:
            self._heartbeat.stop()
        if self.name_taken:  # (the registration is the other start's: its channel let go, nothing written)
            with contextlib.suppress(*REDIS_UNAVAILABLE):
                self.unsubscribe()
            return
        try:
            self.teardown()
        except REDIS_UNAVAILABLE as exc:
            log.error("could not unregister (Redis unavailable: %s); the registration lapses with its heartbeat", exc)

    def _start(self, burst: bool, logging_level: str | None) -> None:
        if self.settings.metrics_port:  # first: a port taken stops the worker before it takes any job
            self.metrics.serve(self.settings.metrics_port)
            log.info("metrics on :%d/metrics", self.settings.metrics_port)
        try:
            self.bootstrap(logging_level)
        except ValueError as exc:  # RQ's "There exists an active worker named ..."
            beat_ttl = self.get_heartbeat_ttl(None)  # type: ignore[arg-type]
            since = lapsed_registration(self.connection, self.name, beat_ttl, self.worker_ttl)
            if since is None:
                taken = name_in_use(self.connection, self.name, beat_ttl, self.worker_ttl)
                if taken is None:
                    raise
                raise ConfigError(taken) from exc
            # Its death written as RQ's own leaving writes it; its jobs are RQ's clean-up's, as any dead worker's.
            log.warning("worker name %r was held by a dead worker (no beat for %d s): taken over", self.name, since)
            self.connection.hset(self.key, "death", utcformat(now()))
            self.bootstrap(logging_level)
        self._install_signal_handlers()
        self._publish_tokenizer()
        self._warn_of_other_models()
        self.sender.worker_key = self.key
        self.sender.status_list = f"roseinfer:statuses:{self.name}"
        self.sender.queue_keys = [queue.key for queue in self.queues]
        self.sender.canceled_keys = [queue.canceled_job_registry.key for queue in self.queues]
        self.sender.start()
        if self.sender.runs_scripts:  # fencing needs the scripts; so does the lease that makes it cheap
            # (per start: a worker thawed after another took its name over must not keep, or delete, the other's)
            self.sender.lease_key = LEASE_KEY.format(worker=f"{self.name}:{self.start_token}")
        self.puller.burst = burst
        if burst:  # due scheduled jobs run in this burst, as RQ's burst with its scheduler moves them before its loop
            try:
                self._heartbeat.due_retries.enqueue()
            except REDIS_UNAVAILABLE as exc:
                log.error("due scheduled jobs not moved to their queues: Redis unavailable (%s)", exc)
        self.puller.start()
        self._heartbeat.start()
        self._watchdog.start()

    def _publish_tokenizer(self) -> None:
        """The engine's tokenizer and chat template into Redis once (their digests in this worker's statistics), for
        the server to name logprobs' tokens by and to tokenize chats; a worker that cannot write them serves all the
        same."""
        for attr, key, method in (("tokenizer_digest", TOKENIZER_KEY, "tokenizer_json"),
                                  ("template_digest", TEMPLATE_KEY, "chat_template_doc")):  # fmt: skip
            text = getattr(self.engine, method, lambda: None)()
            if not text:
                continue
            digest = tokenizer_digest(text)
            try:
                if not self.connection.exists(key.format(digest=digest)):
                    self.connection.set(key.format(digest=digest), text)
            except redis.exceptions.RedisError as exc:
                log.warning("%s could not be written to Redis (%s): the server goes without it", key, exc)
                return
            setattr(self, attr, digest)

    def _warn_of_other_models(self) -> None:
        """Live workers of this queue serving another model (a rollout, a mistake): said as it starts, as the server
        and ``roseinfer status`` say it (a job runs on whichever worker takes it); it serves all the same."""
        from producer import Client

        try:
            rows = Client(connection=self.connection, queue=self.settings.queue).workers()
        except Exception:  # (a look, never a reason not to start: Redis away, a statistics hash written by hand)
            log.debug("the workers of queue %s not read", self.settings.queue, exc_info=True)
            return
        served = {row["model"] for row in rows if row["name"] != self.name and row["model"]}
        if served - {self.settings.model_name}:
            log.warning(mixed_models(self.settings.queue, sorted(served | {self.settings.model_name})))

    def _done(self, burst: bool) -> bool:
        """Nothing in flight or on its way, and the worker stops (or, in burst mode, found the queues empty)."""
        if self.in_flight or self._arrivals_left or self.sender.busy or not self.puller.quiet:
            return False
        if not self._lost.empty() or self.sender.holds_events:  # (events held for a word on their job: said next)
            return False
        # Burst: the queues found empty, or suspended (as RQ's burst exits then). Or a burst's puller stopped
        # already, its last pull having taken a job that came at that moment: that pull left ``dry`` False, and no
        # pull could set it again.
        if burst and self._suspended:
            log.warning("queues suspended (`rq suspend`) in burst mode: exiting")
            return True
        return self._stop_requested or (burst and (self.puller.stopped or (self.puller.dry and not self.sender.queued)))

    def _loop_once(self) -> bool:
        """One iteration; False when there was nothing to do."""
        self._apply_reports()
        mono = time.monotonic()
        if mono >= self._next_maintenance:  # RQ's own check builds datetimes: too dear for every step
            self._next_maintenance = mono + self.settings.maintenance_interval
            try:
                self.run_maintenance_tasks()
            except REDIS_UNAVAILABLE as exc:  # the jobs in flight go on; maintenance runs again later
                log.error("maintenance skipped: Redis unavailable (%s)", exc)
        self._apply_arrivals()
        self._apply_stop_requests()  # after the arrivals: a job just taken can be stopped
        if self._suspended and not self._stop_requested:
            self._hand_back_unstarted()
        if self.pump.has_work():
            started = time.perf_counter()
            # Running jobs' new text is only wanted when the hand-over after this step sends it: when the hand-over
            # is due by the time a step like the last one ends (a step longer than the interval flushes each time).
            flush = time.monotonic() + self._step_s >= self._next_hand_over
            self._watchdog.began()  # (and again after each admission: ``pump.on_admitted``)
            try:
                events = self.pump.step(flush=flush)
            finally:
                self._watchdog.ended()
            self._step_s = time.perf_counter() - started
            for seconds in self.pump.take_step_times():  # the engine's own (an engine process: its child's)
                self.metrics.step.observe(seconds)
            if any(e.retryable for e in events):  # a failed step (or a dead engine process) failed its jobs to be
                # run again: a job stopped (stop-job) or canceled by a client meanwhile still ends so
                events = self._apply_cancels(self._apply_stop_requests(events))
            if self._route(events):
                self.puller.wake()  # room for more jobs
            if not self.engine.has_unfinished_requests():
                time.sleep(0.001)  # only prompts being tokenized: no step to run yet
        if self.pump.failure:  # an engine process died
            self._engine_died()
        self._hand_over()
        self._set_busy(bool(self.in_flight))
        return bool(self.in_flight)

    def _hand_over(self, force: bool = False) -> None:
        """Give the sender what the steps produced: every job's new text once the event interval has passed, so
        the steps in between share one event per job (a fast engine's steps would otherwise each cost Redis a
        write per job); sooner only a job's first piece, a job's end, and the job endings. The interval is
        ``event_interval_ms``, longer with many jobs in flight so that events stay within ``max_events_per_s``."""
        mono = time.monotonic()
        due = force or mono >= self._next_hand_over
        if not (due or self._tasks or self.publisher.urgent):
            return
        if due:
            interval = max(self.settings.event_interval_ms / 1000, len(self.in_flight) / self.settings.max_events_per_s)
            self._next_hand_over = mono + interval
        tasks, self._tasks = self._tasks, []
        events, finals = self.publisher.take(urgent_only=not due)
        if events or tasks or finals or self.in_flight or self._watching:
            watch = [(job_id, job.job.key) for job_id, job in self.in_flight.items()]
            self._watching = bool(watch)
            self.sender.put(Batch(events, tasks, finals, watch))

    def _refresh_lanes(self) -> None:
        """The queue's priority lanes RQ knows, first-served first: pulled in that order, watched and maintained."""
        odd: list[str] = []
        found = lanes(self.connection, self.settings.queue, odd)
        for name in set(odd) - self._odd_lanes_said:  # (its jobs waited for good, said nowhere)
            self._odd_lanes_said.add(name)
            log.warning(
                "queue %s looks like a lane of %s but is none (lanes are %s:p<priority>, -100 to 100, no zero, sign "
                "or leading zero): its jobs are not served here", name, self.settings.queue, self.settings.queue,
            )  # fmt: skip
        if [p for p, _ in found] != [p for p, _ in self._lanes]:
            before, had = set(self.queue_names()), [(p, q.name) for p, q in self._lanes]
            self._set_lanes(found)
            try:
                with self.connection.pipeline() as pipe:  # RQ's record of what it serves (`rq info`), as at its start
                    pipe.hset(self.key, "queues", ",".join(self.queue_names()))
                    for name in before - set(self.queue_names()):
                        pipe.srem(worker_registration.WORKERS_BY_QUEUE_KEY % name, self.key)
                    worker_registration.register(self, pipe)
                    pipe.execute()
            except redis.RedisError:
                self._set_lanes(had)  # the next check finds the change again, and records it then
                raise
            log.info("serving lanes %s", ", ".join(f"{q.name} (priority {p})" for p, q in self._lanes))

    def _set_lanes(self, found: list[tuple[int, str]]) -> None:
        by_name = {q.name: q for q in self.queues}
        queues = [
            by_name.get(name)
            or Queue(name, connection=self.connection, serializer=self.serializer, job_class=self.job_class)
            for _, name in found
        ]  # (the policy's job class: RQ's maintenance reads every lane's jobs through it)
        self._lanes = [(p, q) for (p, _), q in zip(found, queues)]
        self.queues = self._ordered_queues = queues
        self.sender.queue_keys = [q.key for q in queues]
        self.sender.canceled_keys = [q.canceled_job_registry.key for q in queues]

    def idle_wait_arg(self) -> float | int:
        """How long an idle pull blocks (``MULTI_LANE_WAIT_S`` at most, taken there), as BLMOVE takes it: whole
        seconds as an integer."""
        seconds = self.settings.idle_wait
        return int(seconds) if float(seconds).is_integer() else seconds

    def _is_suspended(self, mono: float) -> bool:
        # is_suspended also refreshes our worker key's TTL: checked once a second, not every step.
        if mono >= self._next_suspension_check:
            self._next_suspension_check = mono + 1.0
            self._refresh_lanes()
            suspended = bool(is_suspended(self.connection, self))
            if suspended != self._suspended:
                log.warning(
                    "queue %s by `rq %s`", "suspended" if suspended else "resumed", "suspend" if suspended else "resume"
                )
            self._suspended = suspended
        return self._suspended

    # ----- jobs in ------------------------------------------------------------------------------------
    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's recommended sampling settings, for the fields a job leaves unset (its engine's, also one in
        a process of its own)."""
        return getattr(self.engine, "sampling_defaults", None) or {}

    def lane_depths(self) -> list[tuple[int, Queue, int | None]]:
        """(priority, queue, jobs waiting in it as the sender last read; None: not read yet) of each lane."""
        depths = self.sender.queued_by_key
        return [(p, q, depths.get(q.key)) for p, q in self._lanes]

    def _keep_running_copy(self, job: Job, queue: Queue) -> None:
        """A job RQ requeued while this worker still runs it (a stall outlived its heartbeat; another worker that
        took it since may have handed it back): the running copy goes on, the pulled one is dropped, and the job is
        marked ours again, its hash naming this attempt (the pull made it ours: no one else can start this copy)."""
        log.warning("job %s came back to the queue while it runs here; the running copy carries on", job.id)
        held = self.in_flight[job.id]
        ttl = self.get_heartbeat_ttl(job)
        with self.connection.pipeline() as pipe:
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            self._register_execution(held, ttl, pipe)  # RQ's requeue took it out of every registry
            held.job.set_status(JobStatus.STARTED, pipeline=pipe)
            pipe.hset(held.job.key, OWNER_FIELD, held.execution.id)
            held.job.heartbeat(now(), ttl, pipeline=pipe)
            pipe.execute()

    def _drop_started_copy(self, a: Arrival) -> None:
        """A copy of a job running here, started by the puller under an execution of its own (three copies of one id
        in the queues): that execution's records go, and the running copy carries on, the job its own again (the
        engine refused a second run of an id, and the worker died of it)."""
        with self.connection.pipeline() as pipe:
            a.execution.delete(a.job, pipe)
            pipe.execute()
        self._keep_running_copy(a.job, a.queue)

    def _register_execution(self, held: InFlight, ttl: int, pipe: redis.client.Pipeline) -> None:
        """Every record of a running job's execution, written again where it is gone (RQ's requeue of a stalled job,
        Redis restarted empty): the started registry, the job's executions, this worker's, the execution's hash.
        RQ's ``Execution.heartbeat`` only refreshes entries that exist, and a job in no registry is never recovered
        if this worker dies."""
        execution = held.execution
        execution.last_heartbeat = now()
        execution.save(ttl, pipeline=pipe)
        ExecutionRegistry(job_id=execution.job_id, connection=pipe).add(execution=execution, ttl=ttl, pipeline=pipe)
        held.job.started_job_registry.add_execution(execution, pipeline=pipe, ttl=ttl, xx=False)
        pipe.sadd(execution.worker_executions_key, execution.composite_key)
        pipe.expire(execution.worker_executions_key, ttl + 60)

    def _apply_arrivals(self) -> None:
        """What the puller took off the queues, into the engine (or failed, for jobs that can never run)."""
        wall = time.time()
        started: list[str] = []
        todo = [(a, True) for a in reversed(self.puller.take())] + self._arrivals_left
        self._arrivals_left, applied = [], []
        try:
            while todo:
                a, from_puller = todo.pop()
                try:
                    todo += self._apply_arrival(a, wall, started)
                except BaseException:  # Redis away, say (a running copy's records): this one and the rest next time
                    todo.append((a, from_puller))
                    self._arrivals_left = todo
                    raise
                if from_puller:
                    applied.append(a)
        finally:
            if started:  # one line for the batch: a line a job cost the step loop 6 ms for a burst of 256
                log.info("%s started (%d in flight)", jobs_named(started), len(self.in_flight))
            self.puller.applied(applied)  # (those left stay the puller's: beaten, and counted against the room)

    def _apply_arrival(self, a: Any, wall: float, started: list[str]) -> list[tuple[Any, bool]]:
        """One arrival into the engine (or ended); the arrivals it turned into, if any, to apply next."""
        if isinstance(a, Rejected):
            self._reject_unreadable(a.item, a.stream)
        elif isinstance(a, NeverRan):
            self._never_ran(a.job, a.queue, a.stream)
        elif isinstance(a, RunningCopy):
            if a.job.id in self.in_flight:
                self._keep_running_copy(a.job, a.queue)
            else:  # it ended here meanwhile (its end is fenced off): this copy runs like any other job
                return [(b, False) for b in reversed(self.puller.read_again(a.job, a.queue))]
        elif a.error is not None:
            self._fail(a)
        elif a.job.id in self.in_flight:  # a copy the puller started while a read-again of another was on its way
            self._drop_started_copy(a)
        else:
            job, req = a.job, a.request
            lane = lane_priority(self.settings.queue, a.queue.name)
            if lane is not None and lane != req.priority:  # (pushed by hand to another lane than its payload says)
                # One priority: the lane's, which the pull went by (the engine's order, preemption and the puller's
                # room went by the payload's, and a bulk payload in the interactive list let a worker hold twice).
                log.warning("job %s: its payload's priority %d is not its lane's, %s (%d): it runs at its lane's",
                            job.id, req.priority, a.queue.name, lane)  # fmt: skip
                req = req.model_copy(update={"priority": lane})
            timeout = run_limit(job, self.queue_class.DEFAULT_TIMEOUT)
            self.pump.submit(
                job.id, a.prompt, a.params, timeout, a.prefix, req.priority, a.tokenized,
                prefix_logprobs=a.prefix_logprobs,
            )  # fmt: skip
            a.stream.usage_each_event = req.usage_each_event
            held = InFlight(job, a.queue, a.execution, req, a.stream, wall, beat_at=a.beat_at)
            held.resumed_tokens = len(a.prefix or ())
            self.metrics.job_started(wall - enqueued_at(held))
            self.in_flight[job.id] = held
            started.append(job.id)
        return []

    def mark_started(
        self, pulled: list[tuple[Job, Queue]], stream_ids: Sequence[str] = ()
    ) -> tuple[list[Execution], dict[str, JobStream]]:
        """RQ's prepare_execution + prepare_job_execution for every pulled job (without touching the job's data,
        which may be unreadable: that job then fails properly), and the streams of ``stream_ids`` read after those
        writes, all in one round trip. The streams come after the start: until then an earlier attempt may still
        append to them (the job names it as owner), after it none can."""
        ttl = self.get_heartbeat_ttl(None)  # type: ignore[arg-type]
        if self.sender.start_script is not None:  # one script writes what RQ's objects would
            try:
                return self._start_by_script(pulled, stream_ids, ttl)
            except redis.exceptions.NoScriptError:  # Redis restarted and forgot it: load it, start again
                self.sender.start_script = register_start_script(self.connection)
                return self._start_by_script(pulled, stream_ids, ttl)
        keys = [job.key for job, _ in pulled]
        tried: list[list[Execution]] = []  # each try's executions: a lost EXEC reply may hide a start that landed
        with self.connection.pipeline() as pipe:  # Redis without Lua: RQ's own writes, in one transaction
            while True:
                try:
                    executions, replies, other = self._start_in_transaction(pipe, pulled, keys, stream_ids, ttl, tried)
                    break
                except redis.WatchError:  # a job hash changed since the look at the statuses (or the reply was
                    continue  # lost, which redis-py says so while watching): look again
        self.executions.update((execution.id, execution) for execution in executions)
        streams = self.publisher.streams_from(stream_ids, replies[len(replies) - len(stream_ids) :])
        return executions, _start_over(streams, other)

    def _start_in_transaction(
        self,
        pipe: redis.client.Pipeline,
        pulled: list[tuple[Job, Queue]],
        keys: list[str],
        stream_ids: Sequence[str],
        ttl: int,
        tried: list[list[Execution]],
    ) -> tuple[list[Execution], list]:
        """The start script's writes as RQ's objects make them, under WATCH: a cancel that landed since the pull
        keeps its status, as the script keeps it (RQ's own HSET of status started overwrote it; the job ran).
        ``tried``: the executions of the tries before this one; one whose start landed is this start (its reply was
        lost: a second start made a second execution, whose first lapsed and RQ's clean-up failed the job)."""
        pipe.watch(*keys)
        with self.connection.pipeline(transaction=False) as look:
            for (job, _queue), key in zip(pulled, keys):
                look.hmget(key, "status", OWNER_FIELD, MODEL_FIELD)
                queue_stream_check(look, job)
                look.xrevrange(stream_key(job.id), count=1)  # (its last entry: ``RESUMED_FROM_FIELD``)
            found = look.execute(raise_on_error=False)  # (a stream key of another type: read as none)
        for reply in found[::4] + found[1::4]:
            if isinstance(reply, Exception):
                raise reply
        owners = [owner.decode() if owner else None for _status, owner, _ran_on in found[::4]]
        for earlier in tried:  # (one transaction: where a job's owner is that try's, the whole of it landed)
            if any(owner == execution.id for owner, execution in zip(owners, earlier)):
                pipe.unwatch()
                with self.connection.pipeline(transaction=False) as reads:
                    self.publisher.queue_stream_reads(reads, stream_ids)
                    return earlier, reads.execute(raise_on_error=False), []
        pipe.multi()
        executions: list[Execution] = []
        tried.append(executions)
        statuses = [status for status, _owner, _ran_on in found[::4]]
        mine = self.model_identity.encode()
        other = [job.id for (job, _), (_, _, ran_on) in zip(pulled, found[::4]) if ran_on not in (None, mine)]
        for (job, queue), status, fields, first, last in zip(pulled, statuses, found[1::4], found[2::4], found[3::4]):
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            executions.append(execution)
            if status is not None:  # (deleted since the pull: stays so, as the start script leaves it)
                job.prepare_for_execution(self.name, pipeline=pipe)  # its heartbeat too
                args, options = pipe.command_stack[-1]  # this attempt owns the job from now on: in RQ's own HSET
                pipe.command_stack[-1] = ((*args, OWNER_FIELD, execution.id, MODEL_FIELD, self.model_identity), options)
                earlier, mark = stream_check(job.created_at, fields, first)  # (the start script's rule)
                if earlier:
                    pipe.delete(stream_key(job.id))
                if mark is not None:
                    pipe.hset(job.key, STREAM_OF_FIELD, mark)
                if last and not earlier and not isinstance(last, Exception):
                    pipe.hset(job.key, RESUMED_FROM_FIELD, last[0][0])
                else:
                    pipe.hdel(job.key, RESUMED_FROM_FIELD)
                if status in (b"canceled", b"stopped"):  # the worker reads it and stops the job within a step
                    pipe.hset(job.key, "status", status)
                pipe.persist(job.key)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.delete(queue.intermediate_queue.get_first_seen_key(job.id))  # (as the start script: why there)
        self.heartbeat(max(ttl, self.worker_ttl) + 60, pipeline=pipe)
        self.publisher.queue_stream_reads(pipe, stream_ids)
        return executions, _checked(pipe.execute(raise_on_error=False), len(stream_ids)), other

    def _out_of_patience(self) -> bool:
        """A cold stop whose patience with Redis is spent: a start still tried again held the first signal's drain
        (it waits for the pull under way) past it, and the cold stop took 34 s where a stop takes 15."""
        give_up_at = self.sender.give_up_at
        return self._force_stop and give_up_at is not None and time.monotonic() >= give_up_at

    def _start_by_script(
        self, pulled: list[tuple[Job, Queue]], stream_ids: Sequence[str], ttl: int
    ) -> tuple[list[Execution], dict[str, JobStream]]:
        executions, args = start_jobs(pulled, self.name, ttl, OWNER_FIELD, STREAM_OF_FIELD, self.model_identity)
        # Within half the started entries' life: a start landing later would find them taken for abandoned.
        give_up_at, backoff = time.monotonic() + min(START_RETRY_S, ttl / 2), 0.1
        while True:
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    queue_start(self.sender.start_script, pipe, args)
                    self.heartbeat(max(ttl, self.worker_ttl) + 60, pipeline=pipe)
                    self.publisher.queue_stream_reads(pipe, stream_ids)
                    replies = _checked(pipe.execute(raise_on_error=False), len(stream_ids))
                break
            except REDIS_UNAVAILABLE as exc:
                # The writes may have landed and only the reply been lost: the jobs are then started by nobody who
                # runs them, failed as abandoned a heartbeat later. The same start again is harmless.
                if time.monotonic() + backoff > give_up_at or self._out_of_patience():
                    raise
                log.warning("starting %d jobs: Redis unavailable (%s); the same start again", len(pulled), exc)
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
        repaired, stale, other = replies[0]
        for job_id in dict.fromkeys(repaired):
            log.warning("job %s: its token or result stream key held another type (written by hand?): deleted",
                        job_id.decode())  # fmt: skip
        for job_id in stale:
            log.info("job %s: the token stream of an earlier job of this id deleted, not resumed", job_id.decode())
        self.executions.update((execution.id, execution) for execution in executions)
        streams = self.publisher.streams_from(stream_ids, replies[len(replies) - len(stream_ids) :])
        return executions, _start_over(streams, [job_id.decode() for job_id in other])

    # ----- what a step produced -------------------------------------------------------------------------
    def _route(self, events: list[JobEvent]) -> bool:
        """Each event to its job's stream (its end to the sender's tasks); whether some job ended."""
        wall = time.time()
        held = len(self.in_flight)
        done: list[tuple[InFlight, Any]] = []
        for event in events:
            job = self.in_flight.get(event.job_id)
            if job is None:
                continue
            if event.finish_reason is not None:
                job.finished_at = wall
            if event.finish_reason != "abort":  # (``_canceled`` takes a cancel's in, whoever ends the job)
                self._took(job, event, wall)
            if event.finish_reason is None:
                self._piece(job, event)
                if job.made_bytes > self.settings.max_result_bytes:  # (its end would be refused: ended now, before
                    self._outgrown(job)  # n = 64 samples with 20 logprobs each held gigabytes in the engine)
            elif event.finish_reason in ("stop", "length") and self._too_large(job, event):
                self._errored(job, event)  # (it fails alone: its result would not fit one Redis write)
            elif event.finish_reason in ("stop", "length"):
                del self.in_flight[event.job_id]
                out = event.output
                self.publisher.add(
                    job.stream, event.text, event.token_ids, event.finish_reason, usage(out), index=event.index,
                    logprobs=event.logprobs, stop_reason=event.stop_reason,
                )  # fmt: skip
                done.append((job, out))
            elif event.finish_reason == "abort":
                self._canceled(job, [event])
            else:
                self._errored(job, event)
        if done:
            self._end_later([job for job, _ in done], lambda: self._succeed(done))
        return len(self.in_flight) < held

    def _too_large(self, job: InFlight, event: JobEvent) -> bool:
        """Whether the finished job's result is past ``--max-result-bytes``: then ``event`` says so, as the job's
        own failure (not retried: it would make the same again). Its size is kept for its write (``_succeed``)."""
        size = result_bytes(event.output)
        if job.request.metadata is not None:  # (echoed in the result: up to --max-job-bytes of each job's)
            size += len(json.dumps(job.request.metadata)) * 4 // 3
        job.result_size = size
        if size <= self.settings.max_result_bytes:
            return False
        event.finish_reason, event.error_type = "error", "invalid_request"  # (no error code: v3 has only one)
        event.error = (
            f"the job's result would take about {size / 2**20:.0f} MB, past this worker's --max-result-bytes "
            f"({self.settings.max_result_bytes / 2**20:.0f} MB): ask for fewer tokens, samples or logprobs"
        )
        return True

    def _outgrown(self, job: InFlight) -> None:
        """A running job whose output already passes ``--max-result-bytes``: failed now, as its end would be."""
        reason = (
            f"the job's result would take more than this worker's --max-result-bytes "
            f"({self.settings.max_result_bytes / 2**20:.0f} MB): ask for fewer tokens, samples or logprobs"
        )
        ended = self.pump.cancel(job.job.id, reason)
        if not ended:  # (its end is in this batch already, a sample's last piece before it: the end's check decides)
            return
        *pieces, last = ended
        for piece in pieces:
            self._piece(job, piece)
        last.error_type = "invalid_request"  # (not retried: it would make the same again)
        self._errored(job, last)

    def _took(self, job: InFlight, event: JobEvent, wall: float) -> None:
        """What an event of ``job`` says besides its text: its first token, its tokens, a restart, its size."""
        if job.first_token_at is None and event.token_ids:
            job.first_token_at = wall
            if not job.resumed_tokens:  # (a resumed job's first token was an earlier attempt's)
                self.metrics.first_token(wall - enqueued_at(job))
        self.tokens += len(event.token_ids)
        if event.restarted:  # the engine refused the prefix: the output (and its timing) starts over
            job.stream.restart()
            job.resumed_tokens = job.made_bytes = 0
        job.made_bytes += piece_bytes(event.text, event.token_ids, event.logprobs)

    def _piece(self, job: InFlight, event: JobEvent) -> None:
        """A running job's piece of output (not its end) to its stream."""
        self.publisher.add(
            job.stream, event.text, event.token_ids, None, None, None, event.index, logprobs=event.logprobs,
            sample_end=event.sample_end, prompt_tokens=event.prompt_tokens, stop_reason=event.stop_reason,
        )  # fmt: skip

    def _engine_died(self) -> None:
        """The engine's process is gone: no more pulls; every job here, the ones a pull under way took too, fails
        retryably (RQ retries it elsewhere, as after a failed step); then the worker stops."""
        self.puller.stop()  # first: a job requeued by its failure must not come back to this worker
        self._apply_arrivals()
        self._apply_stop_requests()  # those waiting for their job to arrive: stopped, not run again elsewhere
        # Those that never reached the engine (taken by the last pulls) go back to their queues, retries untouched:
        # failed with the rest, each spent a retry (with none left, failed for good) for a death not theirs.
        if unsent := self.pump.unsent():
            self._hand_back_cold(only=unsent)
        self._route(self._apply_cancels(self.pump.step()))
        self._hand_over(force=True)
        raise EngineProcessDied(self.pump.failure)

    # ----- the rest --------------------------------------------------------------------------------------
    def _set_busy(self, busy: bool) -> None:
        # Suspended (`rq suspend`) once its jobs are done, as RQ's worker shows itself in `rq info`.
        state = WorkerStatus.BUSY if busy else WorkerStatus.SUSPENDED if self._suspended else WorkerStatus.IDLE
        if self._state != state:
            with self.connection.pipeline(transaction=False) as pipe:
                self.set_state(state, pipeline=pipe)
                # With it, the count `roseinfer status` shows beside it (else the beat's, up to a beat old: "idle,
                # 1 in flight"); the beat's TTL, as the beat sets it.
                pipe.hset(self.stats_key(), "in_flight", len(self.in_flight))
                pipe.expire(self.stats_key(), self.get_heartbeat_ttl(None))  # type: ignore[arg-type]
                pipe.execute()

    def serialize(self) -> dict[str, Any]:
        """RQ's registration, with this start's token (``START_FIELD``)."""
        return {**super().serialize(), START_FIELD: self.start_token}

    def name_taken_over(self) -> None:
        """Another start registered under this worker's name: this one was taken for dead (frozen, cut off past its
        heartbeat) and its jobs went to RQ's clean-up. It stops at once (the jobs still its own go back to their
        queues, fenced) and writes nothing of the other's (registration, statistics): two workers of one name ran on,
        and either's stop unregistered both."""
        if not self.name_taken:
            log.error("worker name %r was taken over by another start (this one was taken for dead): stopping",
                      self.name)  # fmt: skip
        self.name_taken = True
        self.sender.give_up_at = time.monotonic()
        self._stop_requested = self._force_stop = True

    def stats(self) -> dict[str, Any]:
        """What `roseinfer status` shows of this worker (read by the heartbeat thread)."""
        return {
            "in_flight": len(self.in_flight),
            "queue": self.settings.queue,
            "model": self.settings.model_name,
            "redis": self.sender.refusing or "ok",
            "tokenizer": self.tokenizer_digest,  # ("": none in Redis)
            "template": self.template_digest,
            "max_model_len": getattr(self.engine, "max_model_len", None) or "",
            "dtype": self.settings.dtype,
            "quantization": quantization_name(self.settings),
        }

    def stats_key(self) -> str:
        return STATS_KEY.format(worker=self.name)


def _start_over(streams: dict[str, JobStream], job_ids: list[str]) -> dict[str, JobStream]:
    """``streams`` with those of ``job_ids`` (their last attempt ran on another model) marked to start over: their
    next event a reset, nothing of them resumed."""
    for job_id in job_ids:
        if job_id in streams:
            log.warning("job %s: its last attempt ran on another model (%s): it starts over", job_id, MODEL_FIELD)
            streams[job_id].whole = False
    return streams


def _checked(replies: list, num_streams: int) -> list:
    """A start's replies, read with ``raise_on_error=False``: an error of the start itself is raised; those of the
    last ``num_streams`` (the stream reads) are each left to its job (``Publisher.streams_from``)."""
    for reply in replies[: len(replies) - num_streams]:
        if isinstance(reply, Exception):
            raise reply
    return replies
