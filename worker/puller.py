"""Jobs in, off the step loop: a thread that takes jobs off the queues while the engine steps.

Taking a job is round trips (the LMOVEs, the job hashes, RQ's start writes, the streams of retried jobs) and Python
(RQ's ``Job`` objects, the payload checks). On the step loop all of it stalls the engine: with short jobs on a fast
engine, pulling took a third of the loop's time. The puller does it on a thread of its own, up to the room the worker
has, and hands the step loop arrivals ready to admit (or to fail, for a job that can never run). The step loop only
applies them: its own state (the jobs in flight, the pump, the publisher) is never touched from here.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoPermissionError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry

from producer.connection import REDIS_UNAVAILABLE, redis_waits
from producer.protocol import OWNER_FIELD
from worker.intake import MULTI_LANE_WAIT_S, Unreadable, pull
from worker.jobs import JobRejected, parse_request, resume_from, sampling_params
from worker.publisher import JobStream

if TYPE_CHECKING:
    from producer.schema import JobRequest
    from worker.batch_worker import BatchWorker

log = logging.getLogger("roseinfer.worker")

HAND_OVER = 64  # jobs a pull takes at most while jobs run, handed to the step loop together
SPARE_AFTER_S = 0.5  # a worker full this long takes jobs past its engine's places (up to its in-flight limit)
LOOK_AGAIN_S = 0.05  # after a pull that could not block and found nothing, with no job in flight
DID_NOT_BLOCK_S = 0.02  # after a blocking pull that the server answered at once (an idle worker spun a core so)
POLL_S = 0.2  # an idle worker whose Redis user may not block (no @blocking): a look this often, a job's wait at most
STALE_DEPTHS_S = 1.0  # lanes seen empty longer ago than this are looked at again (the sender reads them as it sends)


def _blocked_at_least(block: float) -> float:
    """Half of what an empty blocking pull waits (its BLMOVE's slice of ``block``)."""
    return min(block, MULTI_LANE_WAIT_S) / 2


@dataclass
class Arrival:
    """A job taken off a queue, for the step loop. ``error`` set: it can never run (it fails alone); else it is
    marked started under ``execution`` and ready for the engine."""

    job: Job
    queue: Queue
    execution: Execution
    stream: JobStream
    request: JobRequest | None = None
    params: Any = None
    prefix: list[int] | None = None  # what an earlier attempt streamed: the output resumes from there
    prefix_logprobs: list[dict[int, float]] | None = None  # its logprobs, for a job asking for them
    error: str | None = None
    prompt: Any = None  # the request's prompt as the engine takes it
    tokenized: Any = None  # its prompt's tokenizing, started by the pump's ``tokenize_ahead`` (None: not started)
    # When its heartbeat was last written, by this host's monotonic clock: at its start (with the registry's
    # expiry), then by the heartbeats, which beat it until the step loop takes it in (after a step that may outlast
    # the expiry) and then as a job in flight.
    beat_at: float = 0.0
    ended_elsewhere: bool = False  # its end (with its failure callback) handed to a callback thread


@dataclass
class NeverRan:
    """A job canceled while it waited in the queue: it ends without running."""

    job: Job
    queue: Queue
    stream: JobStream


@dataclass
class RunningCopy:
    """A job RQ requeued while this worker may still run it (a stall outlived its heartbeat)."""

    job: Job
    queue: Queue


@dataclass
class Rejected:
    """A job hash RQ cannot read."""

    item: Unreadable
    stream: JobStream | None  # None: an id that is not text has no stream


def _samples(job: object) -> int:
    """The places in the batch a job held takes: its ``n``."""
    request = getattr(job, "request", None)
    return max(1, getattr(request, "n", 1) or 1)


def _names_a_callback(job: Job) -> bool:
    """Whether the job names an allowed callback (the policy took the others off it as it was read)."""
    return bool(job._success_callback_name or job._failure_callback_name or job._stopped_callback_name)


class Puller:
    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker
        self._arrivals: queue.SimpleQueue[list] = queue.SimpleQueue()
        # Jobs handed over and not yet taken by the step loop: each counter written by one thread only.
        self._handed = 0
        self._taken = 0
        # Jobs handed over to start, not yet in flight (the step loop's), by id: the heartbeat beats them too.
        self._unapplied: dict[str, Arrival] = {}
        self._wake = threading.Event()  # room freed or jobs seen waiting: pull now
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._pulling = False
        self.dry = False  # the last pull found the queues empty (burst mode quits on it)
        self.burst = False  # never block waiting for jobs
        self._next_pull = 0.0
        self._follow_up = False  # pull again at once, without waiting for the sender to see jobs
        self._full_since: float | None = None  # (monotonic) since when its jobs fill the engine's places
        self._blocked = False  # the last pull blocked waiting for jobs
        self._did_not_block = False  # ... or should have, and the server answered at once that it found none
        self._may_block = True  # the Redis user may wait on a queue (BLMOVE: not a managed user without @blocking)
        self._said_unavailable_at = -math.inf  # when an outage was last logged
        self._paused_until = 0.0
        self._thread = threading.Thread(target=self._run, name="roseinfer-puller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 120.0) -> None:
        """No more pulls; returns once a pull under way has handed over what it took (``timeout`` s at most)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout)

    def wake(self) -> None:
        self._wake.set()

    def take(self) -> list:
        """What arrived since the last call, in order (on the step loop, which calls ``applied`` once the jobs are
        in flight: until then they count against the room)."""
        got: list = []
        while True:
            try:
                got += self._arrivals.get_nowait()
            except queue.Empty:
                return got

    def applied(self, arrivals: list) -> None:
        self._taken += sum(1 for a in arrivals if not isinstance(a, Rejected))
        for a in arrivals:
            if isinstance(a, Arrival):
                self._unapplied.pop(a.job.id, None)

    def wait(self, timeout: float) -> None:
        """Until something arrives, or ``timeout`` (the step loop when it has nothing to run)."""
        self._arrived.wait(timeout)
        self._arrived.clear()

    def unapplied(self) -> list[Arrival]:
        """The jobs started here that the step loop has not taken in yet (it may be inside a long step)."""
        return list(self._unapplied.values())

    def handing_over(self, job_id: str) -> bool:
        """Whether ``job_id`` was taken and started here and waits for the step loop to take it in."""
        return job_id in self._unapplied

    @property
    def stopped(self) -> bool:
        """``stop`` was called: no pull comes any more (what the last one took may still be running)."""
        return self._stop.is_set()

    @property
    def quiet(self) -> bool:
        """No pull under way and nothing handed over untaken."""
        return not self._pulling and self._arrivals.empty()

    # ----- the thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pulled = self._pull_once()
            except REDIS_UNAVAILABLE as exc:  # the jobs in flight go on; their events wait in the sender
                if time.monotonic() >= self._said_unavailable_at + 60:  # (once a minute through an outage)
                    log.error("no new jobs for now: Redis unavailable (%s); trying again every 5 s", exc)
                    self._said_unavailable_at = time.monotonic()
                self._paused_until = time.monotonic() + 5.0
                pulled = False
            except Exception as exc:  # a bug here must not stop the worker taking jobs for good
                if redis_waits(exc):  # Redis busy with another client's long script
                    log.error("no new jobs for now: %s; trying again in 1 s", exc)
                else:
                    log.exception("taking jobs off the queue failed; trying again in 1 s")
                self._paused_until = time.monotonic() + 1.0
                pulled = False
            finally:
                self._pulling = False
            # Until the sender sees jobs waiting (it reads the queues while jobs run), room frees; a pull that
            # blocked has waited already (a burst arriving as its wait ran out must not wait 50 ms more).
            if not pulled and (not self._blocked or self._did_not_block):  # the latter: rather than spin
                idle_wait = LOOK_AGAIN_S if self._may_block else POLL_S
                self._wake.wait(DID_NOT_BLOCK_S if self._blocked else 1.0 if self.worker.in_flight else idle_wait)
                self._wake.clear()

    def _pull_once(self) -> bool:
        """One pull, when one is due; whether it took anything."""
        self._blocked = self._did_not_block = False
        w = self.worker
        mono = time.monotonic()
        if w._stop_requested or w._force_stop or mono < self._paused_until or w._is_suspended(mono):
            return False
        if w.pump.failure:  # an engine process that died: a job taken now would only fail (a retry spent)
            return False
        idle = not w.in_flight and self._handed == self._taken and not w.sender.busy
        # While jobs run, pull only when the sender saw jobs waiting (or once a second): an empty LMOVE is a round
        # trip for nothing.
        if not (idle or w.sender.queued > 0 or mono >= self._next_pull or self._follow_up):
            return False
        limit = w.settings.in_flight_limit
        # Jobs handed over, not yet taken in, read before the snapshot of those in flight: the step loop takes a job
        # in before it counts it taken, so a job moving meanwhile counts twice (room for one less), never not at all.
        on_its_way = self._handed - self._taken
        # Jobs ended whose ends may wait behind their allowed callbacks count too: without them, a burst of slow
        # callbacks let the worker take the whole queue in, every job started and its result held in memory. (Not
        # every end not yet written: a finished job's slot came free only a round trip later, or a second.)
        on_its_way += sum(_names_a_callback(job.job) for job in list(w._ending.values()))
        held = list(w.in_flight.values())  # a snapshot: the step loop adds and removes jobs meanwhile
        # Sequences, not jobs: a job of n samples takes n places in the batch (five jobs of n = 8 went to one worker
        # of 4 places, run one after another, while another sat idle).
        taken = sum(_samples(job) for job in held)
        seqs = w.settings.max_num_seqs
        if taken + on_its_way < seqs:
            self._full_since = None
        elif self._full_since is None:
            self._full_since = mono
        # Lanes the sender saw empty are skipped; an idle worker blocks on all of them, and so does a pull when the
        # sender read no depths for a second (it reads them as it sends: during a long step, a job that came waited
        # for the step's end, its lane seen empty before it).
        stale = mono - w.sender.depths_read_at > STALE_DEPTHS_S
        lanes = [(p, q) for p, q, depth in w.lane_depths() if idle or stale or depth is None or depth > 0]
        ranked = taken + on_its_way >= limit and bool(held)  # full: only lanes before jobs held come in
        if ranked:
            # Full: jobs of a lane that comes before a job held here still come in (up to twice the limit); the
            # engine preempts the later ones for them. Past that, a lane before every job held still does (a limit's
            # worth more): at twice, an urgent job waited for an interactive one's whole run. Bounded: once one is
            # held, only a lane before it qualifies.
            worst, best = max(job.priority for job in held), min(job.priority for job in held)
            urgent = [(p, q) for p, q in lanes if p < best]
            lanes = [(p, q) for p, q in lanes if p < worst]
            if taken + on_its_way >= 2 * limit and urgent:
                lanes, limit = urgent, taken + limit  # (those on their way use it up: no limit more per pull)
            else:
                limit *= 2
        room = limit - taken - on_its_way
        if not ranked and (self._full_since is None or mono - self._full_since < SPARE_AFTER_S):
            # Past the engine's places (the spare jobs a step's end starts at once) only once it has been full a
            # while: a burst's first look took them too, and they waited for a slot while the fleet's other workers
            # sat idle (12 jobs on 3 idle workers of 8 places: 10, 1 and 1, two waiting 9.8 s). A lane before a job
            # held still comes in at once (the engine preempts for it).
            worst = max((job.priority for job in held), default=None)
            ahead = [(p, q) for p, q in lanes if worst is not None and p < worst]
            if ahead:
                lanes = ahead
            else:
                room = min(room, seqs - taken - on_its_way)
        if room <= 0 or not lanes:
            return False
        self._pulling = True
        self._next_pull = mono + 1.0
        block = w.idle_wait_arg() if idle and not self.burst and self._may_block else None
        # While jobs run, a slice at a time, so new jobs reach the engine before the rest are read. An idle worker
        # loses no step while it reads: it takes as many as the engine runs at once, and one prefill starts them all
        # (in slices, the first ones' steps and the reading of the rest slowed each other down: 256 jobs took
        # 0.85-1.65 s against 0.76-1.04 s, whole winning 6 of 7 interleaved pairs).
        room = min(room, seqs if idle else HAND_OVER)
        queues = [q for _, q in lanes]
        wait_on = next((i for i, (p, _) in enumerate(lanes) if p == 0), 0)  # the queue itself: interactive jobs
        began = time.monotonic()
        try:
            pulled, unreadable = pull(
                queues, room, block, w.connection, w.job_class, w.serializer, w.sender.move_script,
                w.settings.max_job_bytes, wait_on,
            )  # fmt: skip
        except NoPermissionError as exc:
            if block is None or "blmove" not in str(exc).lower():  # (a key the user may not touch: not this)
                raise
            # A user without @blocking (a managed Redis's): a traceback a second, for good. Said once; polled.
            log.warning("this Redis user may not wait on a queue (BLMOVE: %s): an idle worker looks every %g s",
                        exc, POLL_S)  # fmt: skip
            self._may_block = False
            return False
        self.dry = not pulled and not unreadable
        self._blocked = block is not None
        # An empty BLMOVE returns only at its timeout, except from a server that does not block (fakeredis 2.40).
        self._did_not_block = self._blocked and self.dry and time.monotonic() - began < _blocked_at_least(block)
        # Jobs come in bursts: the wait ended with the first of one, the rest may still be on their way in; a pull
        # that filled its room leaves more behind.
        self._follow_up = (block is not None and not self.dry) or len(pulled) + len(unreadable) >= room
        if len(pulled) + len(unreadable) < room:
            w.sender.queued = 0  # the queue ran dry: no more pulls until the sender sees jobs again
        arrivals = self.read(pulled, unreadable)
        if not arrivals:
            return False
        self._handed += sum(1 for a in arrivals if not isinstance(a, Rejected))
        self._unapplied.update((a.job.id, a) for a in arrivals if isinstance(a, Arrival))
        self._arrivals.put(arrivals)
        self._arrived.set()
        return True

    def read(self, pulled: list[tuple[Job, Queue]], unreadable: list[Unreadable] = ()) -> list:
        """The arrivals of jobs just taken off the queues: jobs to run marked started, their payloads checked."""
        w = self.worker
        fresh, canceled, running, over = [], [], [], []
        seen: set[str] = set()
        for job, q in pulled:
            # An id pushed twice (a producer's RPUSH tried again) is one job: the copy that runs carries on. Looked
            # up in _unapplied before in_flight: the step loop adds a job to in_flight before it leaves _unapplied,
            # so between the two looks it is in one of them (the other order could miss it in both).
            status = job.get_status(refresh=False)
            if job.id in seen or job.id in self._unapplied or job.id in w.in_flight:
                running.append(RunningCopy(job, q))
            elif status in (JobStatus.CANCELED, JobStatus.STOPPED):
                canceled.append((job, q))
            elif status in (JobStatus.FINISHED, JobStatus.FAILED):  # a copy of a job that ended: it ran again
                over.append((job, q))
            else:
                fresh.append((job, q))
            seen.add(job.id)
        started = [(job, q) for job, q in fresh if job.get_status(refresh=False) == JobStatus.STARTED]
        if started:  # (a copy of a job another worker runs: left to it)
            elsewhere = self._running_elsewhere(started)
            over += [(job, q) for job, q in fresh if job.id in elsewhere]
            fresh = [(job, q) for job, q in fresh if job.id not in elsewhere]
        if over:
            self._drop_copies(over)
        self._own_origins(fresh)
        # The payloads first: their prompts are tokenized (the pump's thread) while the round trips below run.
        checked = [self._check(job) for job, _ in fresh]
        prompts = [request.engine_prompt() for request, _, error in checked if error is None]
        ahead = iter(w.pump.tokenize_ahead(prompts) or ())
        prompt_of = iter(prompts)
        # Every job's stream is read, even one whose hash shows no earlier start: a failover can lose the start's
        # writes to the job hash while the stream keeps events written after it.
        ids = [job.id for job, _ in fresh + canceled] + [item.job_id for item in unreadable if item.raw_id is None]
        started_mono = time.monotonic()  # before the writes: the heartbeat then errs early, never late
        if fresh:  # the streams in the start's round trip
            executions, streams = w.mark_started(fresh, ids)
        else:
            executions, streams = [], w.publisher.resume(w.connection, ids) if ids else {}
        arrivals: list = [Rejected(item, streams.get(item.job_id)) for item in unreadable]
        arrivals += [NeverRan(job, q, streams[job.id]) for job, q in canceled]
        for (job, q), execution, (request, params, error) in zip(fresh, executions, checked):
            stream = streams[job.id]
            stream.owner = execution.id
            arrival = Arrival(job, q, execution, stream, request, params, error=error, beat_at=started_mono)
            if error is None:
                arrival.prompt, arrival.tokenized = next(prompt_of), next(ahead, None)
                arrival.prefix, arrival.prefix_logprobs = resume_from(stream, params)
            arrivals.append(arrival)
        return arrivals + running  # last: a copy of a job this pull starts finds it in flight

    def _own_origins(self, fresh: list[tuple[Job, Queue]]) -> None:
        """A hand-written job whose ``origin`` is not the queue it was taken from (``roseinfer`` for a job pushed to
        a priority lane): RQ keeps its registries and retries by ``origin``, so it is made that queue, else its
        heartbeats went to a registry it is not in and RQ failed it while it ran."""
        stray = [(job, q) for job, q in fresh if job.origin != q.name]
        if not stray:
            return
        with self.worker.connection.pipeline(transaction=False) as pipe:
            for job, q in stray:
                log.warning("job %s names origin %r but came from queue %r: its origin is now that queue",
                            job.id, job.origin, q.name)  # fmt: skip
                job.origin = q.name
                pipe.hset(job.key, "origin", q.name)
            pipe.execute()

    def read_again(self, job: Job, q: Queue) -> list:
        """The arrival of a copy whose running job ended meanwhile (on the step loop): it runs like any other, but
        for a job that ended as it is now (its status read again: the pull's is from before that end)."""
        self._unapplied.pop(job.id, None)
        status = self.worker.connection.hget(job.key, "status")
        if status is not None:
            job._status = status.decode()  # (what get_status(refresh=False) reads; JobStatus compares equal to it)
        return self.read([(job, q)])

    def _running_elsewhere(self, started: list[tuple[Job, Queue]]) -> set[str]:
        """Of jobs pulled while their status says started, those another worker runs now: their owning execution's
        started-registry entry is live. Such a copy (an id pushed twice, on another worker) was started here too,
        the running attempt fenced out of its own end, and the job ran twice. A job started by no live execution
        (its worker died; a status written by hand) runs here as before."""
        conn = self.worker.connection
        with conn.pipeline(transaction=False) as pipe:
            for job, _q in started:
                pipe.hget(job.key, OWNER_FIELD)
            owners = pipe.execute()
        with conn.pipeline(transaction=False) as pipe:
            for (job, _q), owner in zip(started, owners):  # (in its origin's registry: the lane it started from)
                pipe.zscore(StartedJobRegistry.key_template.format(job.origin), f"{job.id}:{_text(owner)}")
            scores = pipe.execute()
        now, ours = time.time(), self.worker.executions  # (ours: its end not written yet, its entry maybe lapsed)
        return {
            job.id for (job, _q), owner, score in zip(started, owners, scores)
            if owner and ((score and score > now) or _text(owner) in ours)
        }  # fmt: skip

    def _drop_copies(self, over: list[tuple[Job, Queue]]) -> None:
        """Copies of jobs that ended (finished or failed: an id pushed twice, a requeue that crossed the end) off
        the intermediate lists, as a start takes them off: never run again, their results left as they are."""
        with self.worker.connection.pipeline(transaction=False) as pipe:
            for job, q in over:
                log.warning("job %s: a copy of it came from queue %r while it had %s: dropped, not run again",
                            job.id, q.name, _how(job))  # fmt: skip
                pipe.lrem(q.intermediate_queue_key, 1, job.id)
                pipe.delete(q.intermediate_queue.get_first_seen_key(job.id))
            pipe.execute()

    def _check(self, job: Job) -> tuple[JobRequest | None, Any, str | None]:
        """The job's request and sampling parameters, or why it cannot run."""
        try:
            refused = self.worker.hooks.refuse(job)
            if refused:
                raise JobRejected(refused)
            request = parse_request(job, self.worker.settings.max_job_bytes)
            return request, sampling_params(job.id, request, self.worker.sampling_defaults), None
        except JobRejected as exc:
            return None, None, str(exc)
        except Exception as exc:  # anything else about one job stays with that job
            log.exception("job %s could not be read", job.id)
            return None, None, f"unreadable job: {exc}"


def _how(job: Job) -> str:
    status = job.get_status(refresh=False)
    return "started on another worker" if status == JobStatus.STARTED else f"ended ({status})"


def _text(owner: bytes | None) -> str:
    """An owner field as text: one written by hand may not be UTF-8 (its decode raised out of the whole pull, every
    job of it left in the intermediate list); no live execution has such an id."""
    return (owner or b"").decode(errors="backslashreplace")
