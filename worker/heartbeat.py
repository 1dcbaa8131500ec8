"""Heartbeats from a thread of their own: the worker, every job in flight and the statistics of
``roseinfer status`` stay fresh however long a step, a tokenization or a callback takes on the main thread."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from rq.executions import ExecutionRegistry
from rq.utils import now, utcformat

from producer.connection import REDIS_UNAVAILABLE, redis_waits
from producer.protocol import START_FIELD
from worker.due_retries import DUE_JOBS_EVERY_S, DueRetries
from worker.intake import load_script

if TYPE_CHECKING:
    from worker.batch_worker import BatchWorker

log = logging.getLogger("roseinfer.worker")

# Registry scores are whole seconds (rounded down) and a beat comes a little late: a job whose entry would end the
# lease within this of the next beat is beaten again, or the lease lapsed for ~0.6 s of every 10 (every event then
# checked one by one).
LEASE_SLACK_S = 3.0

# KEYS: job hashes, then their executions' hashes (as many); ARGV: the heartbeat's stamp, as a date and as a number,
# and the executions' TTL. RQ's job and execution heartbeats (HSET, EXPIRE), only where the hash exists: a job
# deleted (RQ's job.delete()) just before a beat came back as a hash of one field and no TTL, for good; an
# execution whose end was written between the beat's look at the jobs and its writes came back for a TTL.
_BEAT_JOBS = """
local n = #KEYS / 2
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('HSET', KEYS[i], 'last_heartbeat', ARGV[1]) end
  if redis.call('EXISTS', KEYS[n + i]) == 1 then
    redis.call('HSET', KEYS[n + i], 'last_heartbeat', ARGV[2])
    redis.call('EXPIRE', KEYS[n + i], ARGV[3])
  end
end
"""


class Heartbeat:
    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rate = (time.monotonic(), 0)  # (when, tokens) at the last beat, for tokens/s
        self.due_retries = DueRetries(worker)
        self._beat_jobs: Any = None  # ``_BEAT_JOBS``, loaded at the first beat where Redis runs Lua
        self._leased = True  # whether the last beat kept the lease (a loss is logged once)
        self.last_beat_at: float | None = None  # when Redis last took a beat (Unix time): a stuck worker's stops
        self.failing = False  # the last beat failed (Redis away): the next comes in a second, not an interval
        self.back_at: float | None = None  # when a beat went in again after failed ones (monotonic)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="roseinfer-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.due_retries.stop()
        # (a replica after a failover, a full or busy Redis: it lapses; the stop goes on whatever Redis says)
        with contextlib.suppress(*REDIS_UNAVAILABLE, redis.exceptions.ResponseError):
            # A stopped worker shows nothing in flight, and holds no lease (its statistics are another start's, under
            # its name, once that start took it over).
            keys = [] if self.worker.name_taken else [self.worker.stats_key()]
            keys += [k for k in [self.worker.sender.lease_key] if k]
            if keys:
                self.worker.connection.delete(*keys)

    def _run(self) -> None:
        interval = self.worker.settings.heartbeat_interval
        next_beat = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + interval
                try:
                    self.beat()
                except Exception as exc:
                    # A full disk's MISCONF, a long script's BUSY are outages too (each was a traceback a beat, at the
                    # interval, and the clean-up once Redis took writes again failed live jobs as abandoned).
                    if not redis_waits(exc):
                        log.exception("heartbeat failed")
                    else:
                        if not self.failing:
                            log.warning("heartbeat: Redis unavailable (%s); beating again every second", exc)
                        # Soon, not an interval later: the jobs' registry entries lapse meanwhile, and the first
                        # clean-up after Redis is back (any worker's) took them for abandoned while they ran.
                        self.failing, next_beat = True, time.monotonic() + min(1.0, interval)
                else:
                    if self.failing:
                        self.failing, self.back_at = False, time.monotonic()
            try:
                self.due_retries.enqueue()
            except Exception as exc:
                if redis_waits(exc):
                    log.debug("due retries: Redis unavailable (%s)", exc)
                else:
                    log.exception("moving due retries back to their queues failed")
            self._stop.wait(max(0.0, min(DUE_JOBS_EVERY_S, next_beat - time.monotonic())))

    def beat(self) -> None:
        """Worker, executions and jobs kept alive in one pipeline, with the statistics."""
        w = self.worker
        ttl = w.get_heartbeat_ttl(None)  # type: ignore[arg-type]
        mono = time.monotonic()
        when, tokens = self._rate
        rate = (w.tokens - tokens) / max(mono - when, 1e-6)
        self._rate = (mono, w.tokens)
        # A snapshot (the main thread adds and removes jobs meanwhile), with the jobs the puller started that the step
        # loop has not taken in: inside a long step they waited unbeaten, and RQ took them for abandoned.
        held = {job.job.id: job for job in w.puller.unapplied()}
        held.update(w.in_flight)
        jobs = list(held.values())
        # And those ended here whose endings wait in the sender (behind an allowed callback, say): beaten, not leased
        # (an ending may have written its status already; a beat's registry writes are XX: it brings back no entry).
        ending = [job for job_id, job in w._ending.copy().items() if job_id not in held]
        # A job beaten less than half the grace ago (less LEASE_SLACK_S) keeps its registry entry (TTL interval +
        # grace) past the next beat plus the lease's margin, so the lease lasts until then: a job started a moment
        # ago costs no writes (six a job a beat).
        fresh = mono - max(0.0, w.settings.heartbeat_grace / 2 - LEASE_SLACK_S)
        stale = [job for job in (*jobs, *ending) if job.beat_at <= fresh]
        # A job whose registry entry may have lapsed since its last beat (this worker stalled): RQ's clean-up may be
        # between its read of the entry and its write (a failure, a requeue), and the job's status still says
        # started. No lease on this beat: it would let the events go out unchecked once the clean-up wrote.
        lapsed = any(mono - job.beat_at >= ttl - w.settings.heartbeat_grace / 2 for job in jobs)
        # Nor once a stop began: it hands jobs back to their queues, and the sender's backlog of their events must
        # meet the per-event check (a job another worker took since would get this attempt's events in its stream).
        no_lease = lapsed or w._stop_requested
        if stale and w.sender.runs_scripts and self._beat_jobs is None:
            self._beat_jobs = load_script(w.connection, _BEAT_JOBS)
        try:
            replies = self._beat(stale, jobs, ttl, rate, mono, no_lease)
        except redis.exceptions.NoScriptError:  # Redis restarted and forgot it
            self._beat_jobs = load_script(w.connection, _BEAT_JOBS)
            replies = self._beat(stale, jobs, ttl, rate, mono, no_lease)
        self.last_beat_at = time.time()
        if w.sender.lease_key:
            if self._leased and not replies[-1] and not w._stop_requested:
                log.warning("lease not kept: a job held here belongs to another attempt now, or its heartbeat lapsed")
            self._leased = bool(replies[-1])

    def _beat(self, stale: list, jobs: list, ttl: int, rate: float, mono: float, no_lease: bool = False) -> list:
        w = self.worker
        # ``birth`` is written by registration only (the beat below recreates the key without it): gone, Redis lost
        # its data. The sender looks too, but an idle worker sends nothing: it stayed unlisted for good. Looked at
        # before the beat's writes: under another start's registration (its name taken over) they are not made.
        birth, start = w.connection.hmget(w.key, "birth", START_FIELD)
        if birth is not None and start is not None and start.decode() != w.start_token:
            w.name_taken_over()
            return [None]
        with w.connection.pipeline(transaction=False) as pipe:
            w.heartbeat(max(ttl, w.worker_ttl) + 60, pipeline=pipe)
            stamp = now()
            for job in stale:
                job.job.last_heartbeat = job.execution.last_heartbeat = stamp
            looks: list[tuple[int, str]] = []  # without Lua: where each look at a hash replies, and the hash
            if stale and self._beat_jobs is not None:
                keys = [*(job.job.key for job in stale), *(job.execution.key for job in stale)]
                pipe.evalsha(self._beat_jobs.sha, len(keys), *keys, utcformat(stamp), stamp.timestamp(), ttl)
                for job in stale:  # (the rest of RQ's execution heartbeat: its registry entries, XX)
                    job.job.started_job_registry.add_execution(job.execution, ttl=ttl, pipeline=pipe, xx=True)
                    ExecutionRegistry(job_id=job.job.id, connection=pipe).add(job.execution, ttl, pipe, xx=True)
            else:  # no Lua (a Redis that refuses scripts): RQ's own, which writes whether or not the hash exists
                for job in stale:
                    looks.append((len(pipe.command_stack), job.execution.key))
                    pipe.exists(job.execution.key)
                    job.execution.heartbeat(job.job.started_job_registry, ttl, pipe)
                    looks.append((len(pipe.command_stack), job.job.key))
                    pipe.exists(job.job.key)
                    job.job.heartbeat(stamp, ttl, pipeline=pipe)
            key = w.stats_key()
            pipe.hset(key, mapping={**w.stats(), "generated_tokens": w.tokens, "tokens_per_s": f"{rate:.1f}"})
            # The statistics lapse with the heartbeat: a dead worker drops out of `roseinfer status`.
            pipe.expire(key, ttl)
            if w.sender.lease_key and no_lease:
                pipe.delete(w.sender.lease_key)
                pipe.exists(w.sender.lease_key)  # (the lease's place in the replies: 0, not set)
            elif w.sender.lease_key:  # after the jobs' beats: the lease reads their registry entries
                self._lease(jobs, pipe)
            replies = pipe.execute()
        if birth is None:
            w._on_statuses([], registered=False)  # the step loop registers again
        if gone := [key for at, key in looks if not replies[at]]:
            # The HSET made the hash: it had been deleted meanwhile (RQ's job.delete(), the end of an execution).
            # Deleted again, as RQ's own heartbeat does: else a job's hash of one field stayed for good, and the
            # delete was no cancel (an execution's, for a TTL).
            w.connection.delete(*gone)
        for job in stale:  # (beaten once Redis took it: a beat that failed left the next one to skip them, fresh,
            job.beat_at = mono  # and their registry entries lapsed before the one after)
        return replies

    def _lease(self, jobs: list, pipe: Any) -> None:
        """The lease until the next beat and then half the grace; never later than half the grace before any job's
        registry entry lapses (RQ may requeue it then, whatever the skew, up to that half, between Redis's clock
        and the one of the host whose maintenance requeues it). Set only while every job held is still this
        worker's; else the sender's per-event checks find the lost ones, and the next beat tries again."""
        settings, sender = self.worker.settings, self.worker.sender
        margin_ms = settings.heartbeat_grace * 500
        keys, args = [sender.lease_key], [settings.heartbeat_interval * 1000 + margin_ms, margin_ms]
        for job in jobs:
            keys += [job.job.key, job.job.started_job_registry.key]
            args += [job.execution.id, job.execution.composite_key]
        sender.lease_script(keys=keys, args=args, client=pipe)
