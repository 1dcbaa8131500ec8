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
"""

from __future__ import annotations

import logging
import queue as queue_mod
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import redis
from rq import worker_registration
from rq.command import parse_payload
from rq.defaults import DEFAULT_WORKER_TTL
from rq.exceptions import NoSuchJobError
from rq.executions import Execution, ExecutionRegistry
from rq.group import Group
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import (
    clean_registries,
)
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.timeouts import TimerDeathPenalty
from rq.utils import now, utcformat
from rq.worker import BaseWorker, WorkerStatus

from producer.connection import REDIS_DOWN, REDIS_UNAVAILABLE, redis_waits
from producer.protocol import (
    BULK_PRIORITY,
    LEASE_KEY,
    OWNER_FIELD,
    STATS_KEY,
    STREAM_OF_FIELD,
    TEMPLATE_KEY,
    TOKENIZER_KEY,
    lane_name,
    lanes,
    queue_stream_check,
    stream_check,
    stream_key,
    tokenizer_digest,
)
from roseinfer.config import ConfigError, quantization_name
from worker.end_records import EndRecords
from worker.engine_process import EngineProcessDied
from worker.heartbeat import LEASE_SLACK_S, Heartbeat
from worker.in_flight import InFlight, jobs_named
from worker.intake import HookPolicy
from worker.job_ends import JobEnds
from worker.job_start import queue_start, start_jobs
from worker.job_start import register as register_start_script
from worker.jobs import (
    run_limit,
    system_fingerprint,
    usage,
)
from worker.metrics import WorkerMetrics
from worker.publisher import JobStream, Publisher
from worker.puller import Arrival, NeverRan, Puller, Rejected, RunningCopy
from worker.pump import JobEvent, Pump
from worker.sender import Batch, Sender
from worker.settings import WorkerSettings
from worker.success_path import SuccessPath
from worker.watchdog import StepWatchdog

log = logging.getLogger("roseinfer.worker")
CALLBACK_THREADS = 8  # jobs' allowed callbacks run at once, off the thread that writes every job's tokens
HAND_BACK_PATIENCE_S = 5.0  # after a second stop signal, writes Redis refuses are tried again this long
LEAVE_PATIENCE_S = 3.0  # and then the way out (threads, unsent writes, unregistering) waits on Redis this long
SENDER_DRAIN_S = 30.0  # a warm stop waits this long for the sender before the callback threads shut down
START_RETRY_S = 30.0  # a start whose reply was lost is sent again this long at most (and within half its TTL)
STOP_WAIT_S = 5.0  # a stop-job command for a job this worker is taking in waits for it this long at most


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


# A job's status when a client ended it while it ran here (None: its hash deleted): it ends so, not back in the queue.
_ENDED_BY_OTHERS = (None, JobStatus.CANCELED.value.encode(), JobStatus.STOPPED.value.encode())


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


class BatchWorker(SuccessPath, JobEnds, EndRecords, BaseWorker):
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
        self._canceled_scan: dict[str, int] = {}  # per queue, where the walk of its canceled registry goes on
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
        self.fingerprint = system_fingerprint(self.settings)  # in every result (OpenAI's system_fingerprint)
        self.tokenizer_digest = ""  # of the tokenizer this worker wrote to Redis (TOKENIZER_KEY)
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
        self.puller = Puller(self)
        self.sender.on_jobs_waiting = self.puller.wake
        self.sender.on_idle = self._on_sender_idle
        # (priority, queue) of the lanes served, first-served first: the default ones now, more found each second.
        self._lanes: list[tuple[int, Queue]] = [(0, self.queues[0])]
        self._set_lanes([(0, settings.queue), (BULK_PRIORITY, lane_name(settings.queue, BULK_PRIORITY))])
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
            # (the patience first: a stop from another thread's command may be seen by the loop between the two)
            self.sender.give_up_at = time.monotonic() + HAND_BACK_PATIENCE_S  # a blip is waited out, no more
            self._force_stop = True
        else:
            log.warning(
                "stop signal: no new jobs; finishing the %d in flight (again to hand them back)", len(self.in_flight)
            )
            self._stop_requested = True
            self._stop_at = time.monotonic()
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
        """RQ's registry clean-up (as BaseWorker does it), which raises on job hashes it cannot read: here an
        error is logged, never fatal, and the queue's maintenance lock is always released. Not while Redis is just
        back from an outage this worker's heartbeat saw: the registry entries of jobs live workers run lapsed
        meanwhile, and are theirs again once they beat (within ``_redis_back_s`` of its return)."""
        back_at = self._heartbeat.back_at
        if self._heartbeat.failing or (back_at is not None and time.monotonic() - back_at < self._redis_back_s):
            return
        for queue in self.queues:
            if not self._maintenance_lock(queue):
                continue
            try:
                self._drop_unreadable_started(queue)
                clean_registries(queue, self._exc_handlers)
                worker_registration.clean_worker_registry(queue)
                self._requeue_stranded(queue)
                self._prune_canceled(queue)
            except REDIS_DOWN:
                raise
            except Exception:
                log.exception("maintenance of queue %s failed (a job hash RQ cannot read?); carrying on", queue.name)
            finally:
                queue.release_maintenance_lock()
        self.last_cleaned_at = now()

    @property
    def _redis_back_s(self) -> float:
        """How long after an outage clean-ups wait: every live worker beats within a heartbeat interval of Redis's
        return (a second, once a beat failed), plus slack for a beat a step held up."""
        return self.settings.heartbeat_interval + LEASE_SLACK_S

    def _drop_unreadable_started(self, queue: Queue) -> None:
        """Lapsed entries of the started registry whose job key holds another type (set by hand): RQ's clean-up of
        the queue failed on the first of them at every pass, and cleaned nothing behind it (a dead worker's jobs
        stayed started for good). There is no job to fail: the entry goes, said once."""
        key = queue.started_job_registry.key
        lapsed = self.connection.zrangebyscore(key, 0, time.time())
        if not lapsed:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for member in lapsed:
                pipe.type(Job.key_for(member.decode(errors="replace").rsplit(":", 1)[0]))
            kinds = pipe.execute()
        bad = [member for member, kind in zip(lapsed, kinds) if kind not in (b"hash", b"none", "hash", "none")]
        if bad:
            self.connection.zrem(key, *bad)
            log.warning("%d lapsed jobs of queue %s whose key holds no job hash (set by hand?) left its started "
                        "registry", len(bad), queue.name)  # fmt: skip

    def _maintenance_lock(self, queue: Queue) -> bool:
        """RQ's lock on a queue's clean-up (its key, so RQ's own workers take turns with these), held about a
        maintenance interval, not RQ's 899 s: a worker killed mid-pass (or whose release met Redis away) left no
        worker cleaning that queue, its dead workers' jobs stranded, for 15 minutes."""
        return bool(self.connection.set(queue.registry_cleaning_key, 1, nx=True, ex=self._maintenance_ttl))

    @property
    def _maintenance_ttl(self) -> int:
        return max(int(self.maintenance_interval) - 1, 1)

    def _prune_canceled(self, queue: Queue) -> None:
        """A step of a walk over the queue's canceled registry, taking out the ids whose job hash is gone (a canceled
        job's hash expires, RQ's own never cleans that registry): they piled up there, counted by ``rq info``, for
        good. A ZSCAN cursor (no entry missed, whatever its score), 500 entries a maintenance pass."""
        key = queue.canceled_job_registry.key
        cursor, entries = self.connection.zscan(key, self._canceled_scan.get(queue.name, 0), count=500)
        self._canceled_scan[queue.name] = cursor
        ids = [member for member, _score in entries]
        if not ids:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.exists(queue.job_class.redis_job_namespace_prefix.encode() + job_id)
            gone = [job_id for job_id, there in zip(ids, pipe.execute()) if not there]
        if gone:
            self.connection.zrem(key, *gone)

    def clean_group_registries(self) -> None:
        """RQ's clean-up of its job groups (one lock for every worker), which raises on a group key it cannot read (a
        key of another type): here an error is logged, never fatal. It stopped every worker on that Redis."""
        if not Group.acquire_maintenance_lock(self.connection, self._maintenance_ttl):
            return
        try:
            Group.clean_registries(connection=self.connection)
        except REDIS_DOWN:
            raise
        except Exception:
            log.exception("maintenance of RQ's job groups failed (a group key RQ cannot read?); carrying on")

    def _requeue_stranded(self, queue: Queue) -> None:
        """RQ's clean-up of the intermediate list, but a job no worker started within a minute of its move there (a
        pull whose reply a timeout lost, a worker killed between the move and the start) goes back to the front of
        its queue: it never ran. RQ's fails it ("stuck in intermediate queue"), a retry spent or the job lost."""
        stranded = queue.intermediate_queue
        job_ids = stranded.get_job_ids()
        # Read once: ``job_id in registry`` reads the whole registry each time (0.68 s a pass, 64 ids against 20,000
        # jobs started, on the step loop).
        started = set(queue.started_job_registry.get_job_ids(cleanup=False)) if job_ids else set()
        for job_id in job_ids:
            if job_id in started:
                continue
            if not self.connection.exists(Job.key_for(job_id)):  # deleted meanwhile: its mark goes with it
                with self.connection.pipeline() as pipe:
                    pipe.lrem(stranded.key, 1, job_id)
                    pipe.delete(stranded.get_first_seen_key(job_id))
                    pipe.execute()
            elif stranded.set_first_seen(job_id):
                # Set after a start took the job out of the list (and deleted its mark): the mark outlived the job,
                # a day, for nothing. Looked at after the SET, so a start that comes later still deletes it.
                if self.connection.lpos(stranded.key, job_id) is None:
                    self.connection.delete(stranded.get_first_seen_key(job_id))
            elif stranded.should_be_cleaned_up(job_id):
                with self.connection.pipeline() as pipe:  # MULTI: in one list or the other, never both or none
                    pipe.lrem(stranded.key, 1, job_id)
                    pipe.lpush(queue.key, job_id)
                    # Seen afresh if a pull leaves it there again (its next move and start take milliseconds).
                    pipe.delete(stranded.get_first_seen_key(job_id))
                    pipe.execute()
                log.warning("job %s was left by a pull in RQ's intermediate list: back at the front of its queue",
                            job_id)  # fmt: skip

    # ----- the loop ----------------------------------------------------------------------------------
    def work(self, burst: bool = False, logging_level: str | None = "INFO", **_: Any) -> bool:
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
                        self._hand_back_cold()
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
        self.sender.worker_key = self.key
        self.sender.status_list = f"roseinfer:statuses:{self.name}"
        self.sender.queue_keys = [queue.key for queue in self.queues]
        self.sender.canceled_keys = [queue.canceled_job_registry.key for queue in self.queues]
        self.sender.start()
        if self.sender.runs_scripts:  # fencing needs the scripts; so does the lease that makes it cheap
            self.sender.lease_key = LEASE_KEY.format(worker=self.name)
        self.puller.burst = burst
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

    def _done(self, burst: bool) -> bool:
        """Nothing in flight or on its way, and the worker stops (or, in burst mode, found the queues empty)."""
        if self.in_flight or self._arrivals_left or self.sender.busy or not self.puller.quiet:
            return False
        if not self._lost.empty() or self.sender.holds_events:  # (events held for a word on their job: said next)
            return False
        # Burst: the queues found empty. Or a burst's puller stopped already, its last pull having taken a job that
        # came at that moment: that pull left ``dry`` False, and no pull could set it again.
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
                events = self._apply_stop_requests(events)  # run again: a stop-job heard meanwhile still stops
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
        found = lanes(self.connection, self.settings.queue)
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
        """How long an idle pull blocks, as BLMOVE takes it: whole seconds as an integer, which every Redis takes
        (fractions need Redis 6)."""
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
            timeout = run_limit(job, self.queue_class.DEFAULT_TIMEOUT)
            self.pump.submit(
                job.id, a.prompt, a.params, timeout, a.prefix, req.priority, a.tokenized,
                prefix_logprobs=a.prefix_logprobs,
            )  # fmt: skip
            a.stream.usage_each_event = req.usage_each_event
            held = InFlight(job, a.queue, a.execution, req, a.stream, wall, beat_at=a.beat_at)
            held.resumed_tokens = len(a.prefix or ())
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
        with self.connection.pipeline() as pipe:  # Redis without Lua: RQ's own writes, in one transaction
            while True:
                try:
                    executions, replies = self._start_in_transaction(pipe, pulled, keys, stream_ids, ttl)
                    break
                except redis.WatchError:  # a job hash changed since the look at the statuses: look again
                    continue
        self.executions.update((execution.id, execution) for execution in executions)
        return executions, self.publisher.streams_from(stream_ids, replies[len(replies) - len(stream_ids) :])

    def _start_in_transaction(
        self,
        pipe: redis.client.Pipeline,
        pulled: list[tuple[Job, Queue]],
        keys: list[str],
        stream_ids: Sequence[str],
        ttl: int,
    ) -> tuple[list[Execution], list]:
        """The start script's writes as RQ's objects make them, under WATCH: a cancel that landed since the pull
        keeps its status, as the script keeps it (RQ's own HSET of status started overwrote it; the job ran)."""
        pipe.watch(*keys)
        with self.connection.pipeline(transaction=False) as look:
            for (job, _queue), key in zip(pulled, keys):
                look.hget(key, "status")
                queue_stream_check(look, job)
            found = look.execute(raise_on_error=False)  # (a stream key of another type: read as none)
        for reply in found[::3] + found[1::3]:
            if isinstance(reply, Exception):
                raise reply
        pipe.multi()
        executions = []
        for (job, queue), status, fields, first in zip(pulled, found[::3], found[1::3], found[2::3]):
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            executions.append(execution)
            if status is not None:  # (deleted since the pull: stays so, as the start script leaves it)
                job.prepare_for_execution(self.name, pipeline=pipe)  # its heartbeat too
                args, options = pipe.command_stack[-1]  # this attempt owns the job from now on: in RQ's own HSET
                pipe.command_stack[-1] = ((*args, OWNER_FIELD, execution.id), options)
                earlier, mark = stream_check(job.created_at, fields, first)  # (the start script's rule)
                if earlier:
                    pipe.delete(stream_key(job.id))
                if mark is not None:
                    pipe.hset(job.key, STREAM_OF_FIELD, mark)
                if status in (b"canceled", b"stopped"):  # the worker reads it and stops the job within a step
                    pipe.hset(job.key, "status", status)
                pipe.persist(job.key)
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.delete(queue.intermediate_queue.get_first_seen_key(job.id))  # (as the start script: why there)
        self.heartbeat(max(ttl, self.worker_ttl) + 60, pipeline=pipe)
        self.publisher.queue_stream_reads(pipe, stream_ids)
        return executions, _checked(pipe.execute(raise_on_error=False), len(stream_ids))

    def _start_by_script(
        self, pulled: list[tuple[Job, Queue]], stream_ids: Sequence[str], ttl: int
    ) -> tuple[list[Execution], dict[str, JobStream]]:
        executions, args = start_jobs(pulled, self.name, ttl, OWNER_FIELD, STREAM_OF_FIELD)
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
                if time.monotonic() + backoff > give_up_at:
                    raise
                log.warning("starting %d jobs: Redis unavailable (%s); the same start again", len(pulled), exc)
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
        repaired, stale = replies[0]
        for job_id in dict.fromkeys(repaired):
            log.warning("job %s: its token or result stream key held another type (written by hand?): deleted",
                        job_id.decode())  # fmt: skip
        for job_id in stale:
            log.info("job %s: the token stream of an earlier job of this id deleted, not resumed", job_id.decode())
        self.executions.update((execution.id, execution) for execution in executions)
        return executions, self.publisher.streams_from(stream_ids, replies[len(replies) - len(stream_ids) :])

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
            elif event.finish_reason in ("stop", "length"):
                del self.in_flight[event.job_id]
                out = event.output
                self.publisher.add(
                    job.stream, event.text, event.token_ids, event.finish_reason, usage(out), index=event.index,
                    logprobs=event.logprobs,
                )  # fmt: skip
                done.append((job, out))
            elif event.finish_reason == "abort":
                self._canceled(job, [event])
            else:
                self._errored(job, event)
        if done:
            self._end_later([job for job, _ in done], lambda: self._succeed(done))
        return len(self.in_flight) < held

    def _took(self, job: InFlight, event: JobEvent, wall: float) -> None:
        """What an event of ``job`` says besides its text: its first token, its tokens, a restart."""
        if job.first_token_at is None and event.token_ids:
            job.first_token_at = wall
        self.tokens += len(event.token_ids)
        if event.restarted:  # the engine refused the prefix: the output (and its timing) starts over
            job.stream.restart()
            job.resumed_tokens = 0

    def _piece(self, job: InFlight, event: JobEvent) -> None:
        """A running job's piece of output (not its end) to its stream."""
        self.publisher.add(
            job.stream, event.text, event.token_ids, None, None, None, event.index, logprobs=event.logprobs,
            sample_end=event.sample_end, prompt_tokens=event.prompt_tokens,
        )  # fmt: skip

    # ----- what came back -----------------------------------------------------------------------------
    def _on_statuses(self, ended: list[tuple[str, bytes | None]], registered: bool) -> None:
        """On the sender thread: the statuses that end a job (the sender keeps only those), and whether Redis still
        knows this worker."""
        if ended or not registered:
            self._reports.put((ended, registered))

    def _reports_lost(self, lost: list[tuple[str, str]]) -> None:
        for job_id, owner in lost:
            self._lost.put((job_id, owner))

    def _drop_lost(self) -> None:
        """Jobs whose events Redis refused because another attempt owns them (this worker stalled past its
        heartbeat and they were retried elsewhere): dropped without writing anything but our own execution's end."""
        reported: dict[str, InFlight] = {}
        elsewhere: list[tuple[str, str]] = []  # reports of jobs that ended here, or of an earlier attempt's events
        while not self._lost.empty():
            job_id, owner = self._lost.get()
            held = self.in_flight.get(job_id)
            if held is not None and held.execution.id == owner:
                reported[job_id] = held
            else:
                elsewhere.append((job_id, owner))
        if not reported and not elsewhere:
            return
        # Refused a while ago: the job may have come back to this attempt since (``_keep_running_copy``). The
        # sender holds the refused events, and those of the job after them: sent again now, its stream has no gap.
        try:
            owned = self._owned(list(reported.values()))
            with self.connection.pipeline(transaction=False) as pipe:
                for job_id, _owner in elsewhere:
                    pipe.hmget(Job.key_for(job_id), OWNER_FIELD, "status")
                hashes = pipe.execute(raise_on_error=False)  # (a hash of another type: not ours)
        except Exception as exc:  # Redis away, or busy with a long script: looked at again (the events wait held)
            for job_id, owner in [*((j, h.execution.id) for j, h in reported.items()), *elsewhere]:
                self._lost.put((job_id, owner))
            if isinstance(exc, REDIS_UNAVAILABLE):
                return
            raise
        for (job_id, owner), found in zip(elsewhere, hashes):
            now_owner, status = (None, None) if isinstance(found, Exception) else found
            if self._ends_elsewhere(job_id):  # its callback thread lets its events go, after its result
                continue
            if now_owner is not None and now_owner.decode() == owner and status not in (b"queued", b"failed"):
                self.sender.release_held(job_id, owner)  # (ended here, ours: its last events go out)
            else:
                self.sender.discard_held(job_id, owner)
        for held, ours in zip(reported.values(), owned):
            if ours is not False:
                self.sender.release_held(held.job.id, held.execution.id)
                continue
            job_id = held.job.id
            self.sender.discard_held(job_id, held.execution.id)
            del self.in_flight[job_id]
            self.pump.cancel(job_id)
            self.publisher.discard(held.stream)  # nothing more of it is written, with or without the lease
            log.warning("job %s belongs to another attempt now, or RQ ended it (this worker stalled): dropped", job_id)
            self.metrics.job_ended("lost", None)

            def end(held: InFlight = held) -> None:
                with self.connection.pipeline() as pipe:
                    self.cleanup_execution(held.job, pipe, held.execution)
                    pipe.execute()

            self._tasks.append(end)

    def _apply_reports(self) -> None:
        self._drop_lost()
        while not self._reports.empty():
            ended, registered = self._reports.get()
            if not registered:
                try:
                    self._redis_lost_data()
                except REDIS_UNAVAILABLE as exc:  # the sender reports it again once Redis answers
                    log.error("could not register again yet: Redis unavailable (%s)", exc)
                except Exception:  # the next report tries again; the jobs in flight go on meanwhile
                    log.exception("registering again after Redis lost its data failed; trying again shortly")
            # Not deleted by anyone when Redis restarted empty: such a job finishes and writes its result.
            ending = {j: s for j, s in ended if j in self.in_flight and (s is not None or registered)}
            for job_id, events in self.pump.cancel_many(list(ending)).items():  # one round trip to an engine process
                status = ending[job_id]  # None: its hash was deleted (Redis still knows this worker: not data lost)
                self._canceled(self.in_flight[job_id], events, stopped=status == b"stopped", deleted=status is None)

    def _apply_stop_requests(self, died_in: list[JobEvent] | None = None) -> list[JobEvent]:
        """RQ's stop-job commands. A job this worker has marked started but not yet handed to the engine (a step
        can pass meanwhile) is stopped once it is: the command was ignored, and the job ran to its end. ``died_in``:
        the events of a step that failed (an engine process's death too); a job asked to stop ends stopped with its
        own (its failure, retryable, would have run it again elsewhere); the others' are returned."""
        died_in = list(died_in or [])
        asked, self._stops_waiting = self._stops_waiting, []
        while not self._stop_jobs.empty():
            asked.append(self._stop_jobs.get())
        for job_id, execution, since in asked:
            job = self.in_flight.get(job_id)
            # Ended here, its end being written (after its callback): not on its way, unless its next attempt is.
            if job is None and job_id in self._ending and not self.puller.handing_over(job_id):
                log.info("stop-job %s: the job ended here, its end being written: ignored", job_id)
                continue
            if job is None and self._on_its_way(job_id, since):
                self._stops_waiting.append((job_id, execution, since))
                continue
            if job is not None and execution is not None and job.execution.id != execution:
                log.info("stop-execution %s of job %s: not the one running here, ignored", execution, job_id)
                continue
            own = [e for e in died_in if e.job_id == job_id]
            if job is not None and own and own[-1].retryable:  # (not one that ended before the step failed)
                # Its failure as the cancel it would have been: what it made kept, no error, nothing to retry.
                ended = replace(own[-1], finish_reason="abort", error=None, retryable=False, error_type=None)
                events = [*own[:-1], ended]
                died_in = [e for e in died_in if e.job_id != job_id]
            else:
                events = self.pump.cancel(job_id) if job is not None else []
            if not events:
                log.info("stop-job %s: not in flight here, ignored", job_id)
                continue
            self._canceled(job, events, stopped=True)
        return died_in

    def _on_its_way(self, job_id: str, since: float) -> bool:
        """Whether this worker took ``job_id`` and has yet to hand it to the engine (for a few seconds at most)."""
        if self.puller.handing_over(job_id):
            return True
        if time.monotonic() - since > STOP_WAIT_S:
            return False
        # Marked started by this worker's puller, which has not yet handed it over (a few ms).
        try:
            name, status = self.connection.hmget(Job.key_for(job_id), "worker_name", "status")
        except REDIS_UNAVAILABLE:
            return True  # asked again at the next iteration
        return name == self.name.encode() and status == JobStatus.STARTED.value.encode()

    def _redis_lost_data(self) -> None:
        """Our registration is gone: Redis restarted without its data (no AOF), or this worker was cut off from it
        past the registration's TTL. Register again; the jobs in flight carry on and write their results (their
        hashes come back with them where Redis lost them)."""
        log.error("Redis lost its data (restarted without persistence?): registering again, jobs in flight go on")
        ttl = self.get_heartbeat_ttl(None)  # type: ignore[arg-type]
        # With the jobs a pull started that the step loop has not taken in: their hashes, gone, read as deleted
        # once they were, and they were canceled without a result.
        arrived = {a.job.id: a for a in self.puller.unapplied() if a.error is None}
        held: list[Any] = list({**arrived, **self.in_flight}.values())
        with self.connection.pipeline(transaction=False) as pipe:
            for job in held:
                pipe.hmget(job.job.key, OWNER_FIELD, "status")
            now_as = pipe.execute()
        # The jobs' hashes first, from memory: once registration is back, the sender reads their statuses as
        # meaning what they say again, and a missing one as deleted. A hash Redis still has is left as it is: cut
        # off, this worker's jobs went to others meanwhile (their events, refused now, drop them here), or ended.
        with self.connection.pipeline() as pipe:
            for job, (owner, status) in zip(held, now_as):
                if status is None:
                    job.job.save(pipeline=pipe)
                    job.job.set_status(JobStatus.STARTED, pipeline=pipe)
                    pipe.hset(job.job.key, OWNER_FIELD, job.execution.id)
                elif not self._runs_here(job, owner, status):
                    continue
                self._register_execution(job, ttl, pipe)
            pipe.execute()
        for attempt in range(3):
            self.connection.delete(self.key)  # what heartbeats recreated since, so registration does not see a twin
            try:
                self.register_birth()
                break
            except ValueError:  # the heartbeat thread recreated the key between the two: once more
                if attempt == 2:
                    raise
        self.set_state(WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE)

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
        self._route(self.pump.step())
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
            pipe.exists(self.key)
            for job in held:
                pipe.hmget(job.job.key, OWNER_FIELD, "status")
            registered, *now_as = pipe.execute()
        for job, (owner, status) in zip(held, now_as):
            # Only a job still running as this attempt goes back: one canceled, stopped, deleted or another
            # attempt's since the sender's last look (a client's cancel of a moment ago) keeps what was done to it.
            if status is None and not registered:
                fresh = job.job  # Redis lost its data (this worker's registration too): the copy here is all there is
            elif self._runs_here(job, owner, status):
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


def _checked(replies: list, num_streams: int) -> list:
    """A start's replies, read with ``raise_on_error=False``: an error of the start itself is raised; those of the
    last ``num_streams`` (the stream reads) are each left to its job (``Publisher.streams_from``)."""
    for reply in replies[: len(replies) - num_streams]:
        if isinstance(reply, Exception):
            raise reply
    return replies
