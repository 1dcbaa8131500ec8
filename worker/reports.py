"""What comes back about the jobs in flight: the statuses the sender read beside its writes (a job canceled, deleted,
or failed by RQ while this worker stalled), the events Redis lost, RQ's stop-job commands, and a Redis that lost
its data (this worker registers again; its jobs go on). Applied on the step loop, between steps.

A part of ``BatchWorker`` (a mixin, as ``success_path``); it uses the worker's ``in_flight``, ``pump``, ``puller``,
``sender``, ``publisher``, the queues the sender and RQ's commands fill (``_reports``, ``_lost``, ``_stop_jobs``)
and its job ends."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from redis.exceptions import WatchError
from rq.job import Job, JobStatus
from rq.worker import WorkerStatus

from producer.connection import REDIS_UNAVAILABLE
from producer.protocol import OWNER_FIELD
from worker.in_flight import InFlight
from worker.pump import JobEvent

log = logging.getLogger("roseinfer.worker")
STOP_WAIT_S = 5.0  # a stop-job command for a job this worker is taking in waits for it this long at most


class Reports:
    """The reports ``BatchWorker`` applies between steps (see the module's docstring)."""

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
        # (job, its last events where its failed step gave them, else None: the engine's cancel, one for them all: an
        # engine process answers a cancel after its step, and one at a time held the loop a step per command)
        stopping: dict[str, tuple[InFlight | None, list[JobEvent] | None]] = {}
        for job_id, execution, since in asked:
            if job_id in stopping:
                continue
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
                stopping[job_id] = (job, _as_aborted(own))
                died_in = [e for e in died_in if e.job_id != job_id]
            else:
                stopping[job_id] = (job, None)
        engine = [job_id for job_id, (job, events) in stopping.items() if job is not None and events is None]
        answers = self.pump.cancel_many(engine) if engine else {}
        for job_id, (job, events) in stopping.items():
            events = answers.get(job_id, []) if events is None else events
            if job is None or not events:
                log.info("stop-job %r: not in flight here, ignored", job_id)  # (%r: any text, newlines too)
                continue
            self._canceled(job, events, stopped=True)
        return died_in

    def _apply_cancels(self, died_in: list[JobEvent]) -> list[JobEvent]:
        """The jobs of a failed step (an engine process's death too) that a client canceled or stopped since the
        sender's last look: they end so, with what they made, not failed to be run again elsewhere (RQ ran a job
        canceled a moment before again). The others' events are returned."""
        ids = list(dict.fromkeys(e.job_id for e in died_in if e.retryable and e.job_id in self.in_flight))
        if not ids:
            return died_in
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hmget(self.in_flight[job_id].job.key, OWNER_FIELD, "status")
                found = pipe.execute(raise_on_error=False)
        except REDIS_UNAVAILABLE:  # (their failures' ends wait for Redis, and read their statuses then)
            return died_in
        ended_by_others = (JobStatus.CANCELED.value.encode(), JobStatus.STOPPED.value.encode())
        for job_id, reply in zip(ids, found):
            job = self.in_flight[job_id]
            if isinstance(reply, Exception) or reply[1] not in ended_by_others:
                continue
            if reply[0] is not None and reply[0].decode() != job.execution.id:  # (another attempt's by now)
                continue
            own = [e for e in died_in if e.job_id == job_id]
            if not own[-1].retryable:  # (it ended before the step failed)
                continue
            log.info("job %s: %s as its step failed: ended so, not run again", job_id, reply[1].decode())
            self._canceled(job, _as_aborted(own), stopped=reply[1] == ended_by_others[1])
            died_in = [e for e in died_in if e.job_id != job_id]
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
        # And those ended here whose ends are still to be written: the finish read a missing hash, registration back,
        # as RQ's delete, and dropped the finished job.
        held: list[Any] = list({**self._ending.copy(), **arrived, **self.in_flight}.values())
        # The jobs' hashes first, from memory: once registration is back, the sender reads their statuses as
        # meaning what they say again, and a missing one as deleted. A hash Redis still has is left as it is: cut
        # off, this worker's jobs went to others meanwhile (their events, refused now, drop them here), or ended.
        # Watched: an ending written on the sender's thread between the look and the writes stands.
        with self.connection.pipeline() as pipe:
            while held:
                try:
                    pipe.watch(*[job.job.key for job in held])
                    now_as = [pipe.hmget(job.job.key, OWNER_FIELD, "status") for job in held]
                    pipe.multi()
                    for job, (owner, status) in zip(held, now_as):
                        if status is None:
                            job.job.save(pipeline=pipe)
                            job.job.set_status(JobStatus.STARTED, pipeline=pipe)
                            pipe.hset(job.job.key, OWNER_FIELD, job.execution.id)
                        elif not self._runs_here(job, owner, status):
                            continue
                        self._register_execution(job, ttl, pipe)
                    pipe.execute()
                    break
                except WatchError:
                    pipe.reset()
        for attempt in range(3):
            self.connection.delete(self.key)  # what heartbeats recreated since, so registration does not see a twin
            try:
                self.register_birth()
                break
            except ValueError:  # the heartbeat thread recreated the key between the two: once more
                if attempt == 2:
                    raise
        self.set_state(WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE)
        # Its tokenizer and chat template went with the data: a server without them in memory answered /tokenize
        # 503 and named logprobs' tokens token_id:N until this worker was restarted.
        self._publish_tokenizer()


def _as_aborted(own: list[JobEvent]) -> list[JobEvent]:
    """A job's events of a failed step, its failure made the cancel it would have been: what it made kept, no error,
    nothing to retry."""
    ended = replace(own[-1], finish_reason="abort", error=None, retryable=False, error_type=None)
    return [*own[:-1], ended]
