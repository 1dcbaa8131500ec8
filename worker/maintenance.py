"""RQ's housekeeping of the queues this worker serves, made safe: RQ's clean-up of its registries, workers and groups,
which raised on a key it could not read (here: logged, never fatal); lapsed started entries of keys that hold no
job; a canceled registry pruned of jobs gone; jobs a pull left in RQ's intermediate list put back in their queue;
the stream's last event and the completion list's entry of a job RQ failed as abandoned (its worker died).
Each queue's pass under RQ's own lock, held a maintenance interval; none while Redis is just back from an outage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from rq import worker_registration
from rq.callbacks import execute_failure_callback
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import AbandonedJobError, NoSuchJobError
from rq.group import Group
from rq.job import Job
from rq.queue import Queue
from rq.registry import clean_registries
from rq.timeouts import TimerDeathPenalty

from producer.connection import REDIS_DOWN
from producer.protocol import RESUMED_FROM_FIELD, result_key, stream_key
from producer.schema import job_ending
from worker.due_retries import end_canceled_unrun
from worker.heartbeat import LEASE_SLACK_S, Heartbeat
from worker.intake import HookPolicy
from worker.publisher import Publisher
from worker.settings import WorkerSettings

log = logging.getLogger("roseinfer.worker")
# A job whose worker died before its first token goes back to its queue, no retry spent, this many times at most.
FREE_REQUEUES = 2
UNRUN_FIELD = "roseinfer_unrun_requeues"  # (in the job's hash: how many times it did)


class Maintenance:
    """The periodic clean-up ``BatchWorker`` runs as RQ's ``run_maintenance_tasks``, on its step loop."""

    def __init__(
        self,
        connection: redis.Redis,
        heartbeat: Heartbeat,
        settings: WorkerSettings,
        hooks: HookPolicy | None = None,
        run_callback: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        """``hooks`` and ``run_callback`` (where given): the failure callbacks a job the clean-up fails as abandoned
        names and ``hooks`` allows are run by ``run_callback`` (the worker's callback threads), not by RQ's clean-up:
        there one ran on the step loop, every running job's tokens held up for as long as it took (up to its
        timeout), and under SIGALRM, which a loop off the main thread cannot set (it never ran)."""
        self.connection, self.heartbeat, self.settings = connection, heartbeat, settings
        self.hooks, self.run_callback = hooks, run_callback
        # (the clean-up's jobs are read with every callback taken off: RQ's clean-up then runs none itself)
        self._silenced = HookPolicy(frozenset(), hooks.webhook_hosts).job_class() if hooks is not None else None
        self._canceled_scan: dict[str, int] = {}  # per queue, where the walk of its canceled registry goes on

    def clean(self, queues: list[Queue], exc_handlers: list) -> bool:
        """RQ's registry clean-up (as BaseWorker does it), which raises on job hashes it cannot read: here an
        error is logged, never fatal, and the queue's maintenance lock is always released. Not while Redis is just
        back from an outage this worker's heartbeat saw: the registry entries of jobs live workers run lapsed
        meanwhile, and are theirs again once they beat (within ``redis_back_s`` of its return). False: not run."""
        back_at = self.heartbeat.back_at
        if self.heartbeat.failing or (back_at is not None and time.monotonic() - back_at < self.redis_back_s):
            return False
        steps = (
            self.drop_unreadable_started,
            self.end_canceled_orphans,
            self.requeue_unrun,
            lambda queue: self.clean_registries(queue, exc_handlers),
            worker_registration.clean_worker_registry,
            self.requeue_stranded,
            self.prune_canceled,
        )
        for queue in queues:
            if not self.lock(queue):
                continue
            try:
                for step in steps:  # each on its own: one that raised at every pass skipped those after it for good
                    try:
                        step(queue)
                    except REDIS_DOWN:
                        raise
                    except Exception:
                        log.exception("maintenance of queue %s failed (a job hash RQ cannot read?); carrying on",
                                      queue.name)  # fmt: skip
            finally:
                queue.release_maintenance_lock()
        return True

    def clean_registries(self, queue: Queue, exc_handlers: list) -> None:
        """RQ's clean-up of the queue's registries; then the jobs it failed as abandoned (their worker died with no
        retry left) get what a failed job's end writes and RQ's does not: the last event of their stream (a
        follower of it waited for good) and their id on the completion list they named (a waiter there too)."""
        failing: list[Job] = []
        callbacks: list[str] = []  # jobs whose allowed failure callback is for us to run

        def note(job: Job, exc_type: type, *_exc: object) -> bool:
            if exc_type is AbandonedJobError and not (job.retries_left and job.retries_left > 0):
                failing.append(job)
            named = getattr(job, "named_hooks", {}).get("failure_callback_name")
            if exc_type is AbandonedJobError and self.hooks is not None and named in self.hooks.callbacks:
                callbacks.append(job.id)
            return True  # (the worker's own handlers run after it)

        if self._silenced is not None and self.run_callback is not None:
            queue = Queue(
                queue.name, connection=queue.connection, serializer=queue.serializer, job_class=self._silenced
            )
        clean_registries(queue, [note, *exc_handlers])
        for job_id in callbacks:
            self._run_failure_callback(queue, job_id)
        if failing:
            self.end_abandoned(failing)

    def _run_failure_callback(self, queue: Queue, job_id: str) -> None:
        """The allowed failure callback of a job the clean-up found abandoned, on a callback thread, as RQ's clean-up
        runs it (whether or not a retry is left), under its timeout by a timer."""
        assert self.hooks is not None and self.run_callback is not None

        def run() -> None:
            try:
                job = self.hooks.job_class().fetch(job_id, connection=self.connection, serializer=queue.serializer)
            except NoSuchJobError:  # (deleted since the clean-up failed it: no job to call it with)
                log.warning("job %s, failed as abandoned, was deleted before its failure callback ran", job_id)
                return
            except Exception:
                log.exception("job %s, failed as abandoned, could not be read for its failure callback", job_id)
                return
            try:
                execute_failure_callback(job, TimerDeathPenalty, AbandonedJobError, AbandonedJobError(), None)
            except Exception:
                log.exception("the failure callback of job %s, failed as abandoned, raised", job_id)

        try:
            self.run_callback(run)
        except RuntimeError:  # (the callback threads shut down: the worker is stopping)
            log.warning("the failure callback of job %s, failed as abandoned, was not run: stopping", job_id)

    def end_abandoned(self, jobs: list[Job]) -> None:
        """The last event and completion entry of ``jobs``, which RQ's clean-up failed as abandoned (those it did
        fail: its writes went in one transaction after its handlers ran). A stream that ended already keeps its end."""
        with self.connection.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.hget(job.key, "status")
            failed = [job for job, status in zip(jobs, pipe.execute()) if status == b"failed"]
        if not failed:
            return
        publisher = Publisher.from_settings(self.settings)  # its own: the worker's holds the running jobs' events
        streams = publisher.resume(self.connection, [job.id for job in failed])
        error = "the worker running the job died (AbandonedJobError), and it had no retry left"
        for job in failed:
            publisher.add(streams[job.id], "", [], "error", {}, error)
        _events, finals = publisher.take()
        with self.connection.pipeline(transaction=False) as pipe:
            publisher.queue_writes(pipe, finals)
            for job in failed:  # (RQ's record, its result, is there: the list's entry follows it, as for every end)
                publisher.notify(pipe, job.id, job_ending(job).notify)
                if job.failure_ttl is None:  # (RQ's record of a job of no failure_ttl was kept for good: its year)
                    pipe.expire(result_key(job.id), DEFAULT_FAILURE_TTL)
            pipe.execute()
        log.warning("%d jobs failed as abandoned: their last events written", len(failed))

    @property
    def redis_back_s(self) -> float:
        """How long after an outage clean-ups wait: every live worker beats within a heartbeat interval of Redis's
        return (a second, once a beat failed), plus slack for a beat a step held up."""
        return self.settings.heartbeat_interval + LEASE_SLACK_S

    def _lapsed(self, queue: Queue) -> list[tuple[bytes, str]]:
        """The started registry's lapsed entries (``<job id>:<execution id>``) of ``queue``, with their job ids."""
        lapsed = self.connection.zrangebyscore(queue.started_job_registry.key, 0, time.time())
        return [(member, member.decode(errors="replace").rsplit(":", 1)[0]) for member in lapsed]

    def drop_unreadable_started(self, queue: Queue) -> None:
        """Lapsed entries of the started registry whose job key holds another type (set by hand): RQ's clean-up of
        the queue failed on the first of them at every pass, and cleaned nothing behind it (a dead worker's jobs
        stayed started for good). There is no job to fail: the entry goes, said once."""
        key = queue.started_job_registry.key
        lapsed = self._lapsed(queue)
        if not lapsed:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for _member, job_id in lapsed:
                pipe.type(Job.key_for(job_id))
            kinds = pipe.execute()
        bad = [member for (member, _), kind in zip(lapsed, kinds) if kind not in (b"hash", b"none", "hash", "none")]
        if bad:
            self.connection.zrem(key, *bad)
            log.warning("%d lapsed jobs of queue %s whose key holds no job hash (set by hand?) left its started "
                        "registry", len(bad), queue.name)  # fmt: skip

    def end_canceled_orphans(self, queue: Queue) -> None:
        """Lapsed entries of the started registry whose job was canceled (or stopped) by hand while its worker was
        dead: RQ's clean-up passes over a job that is not "started", so it was never ended (no result, no last
        event, its hash kept for good). It ends as a client's cancel of a job no worker runs ends it."""
        lapsed = self._lapsed(queue)
        if not lapsed:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for _member, job_id in lapsed:
                pipe.hget(Job.key_for(job_id), "status")
            statuses = pipe.execute(raise_on_error=False)
        for (member, job_id), status in zip(lapsed, statuses):
            if status in (b"canceled", b"stopped"):
                self._end_canceled(queue, member, job_id, status)

    def _job_of(self, queue: Queue, job_id: str) -> Job | None:
        """The job, or None where it is gone meanwhile or unreadable (RQ's clean-up and the steps before take those)."""
        try:
            return queue.job_class.fetch(job_id, connection=self.connection, serializer=queue.serializer)
        except REDIS_DOWN:
            raise
        except Exception:
            return None

    def _end_canceled(self, queue: Queue, member: bytes, job_id: str, status: bytes) -> None:
        """The ending of a job canceled (or stopped) while its worker was dead, as a client's cancel of a job no
        worker runs writes it, and its lapsed entry out."""
        if not end_canceled_unrun(self.connection, queue, job_id, its_worker_died=True):
            return
        self.connection.zrem(queue.started_job_registry.key, member)
        log.warning("job %s was %s while its worker was dead: ended", job_id, status.decode())

    def requeue_unrun(self, queue: Queue) -> None:
        """Lapsed entries of the started registry whose attempt streamed nothing (it waited in its dead worker's queue
        for the engine, or was in its prompt) go back to the front of their queue, retries untouched, as a stop's
        hand-back puts them: RQ's clean-up spent a retry of each (failed those with none: 4 of 6 jobs that never
        ran, at a worker's kill). ``FREE_REQUEUES`` times a job: one that kills every worker at its start then goes
        RQ's way, not round for good."""
        lapsed = self._lapsed(queue)
        if not lapsed:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for _member, job_id in lapsed:
                pipe.hmget(Job.key_for(job_id), "status", UNRUN_FIELD, RESUMED_FROM_FIELD)
                pipe.xrevrange(stream_key(job_id), count=1)
            replies = pipe.execute(raise_on_error=False)
        handed: list[str] = []
        for i, (member, job_id) in enumerate(lapsed):
            fields, last = replies[2 * i], replies[2 * i + 1]
            if isinstance(fields, Exception) or isinstance(last, Exception):
                continue  # (a key of another type: the steps around take it)
            status, count, resumed_from = fields
            # Streamed by the attempt that died: its stream's last entry is not the one it started from (a job
            # resumed by an attempt that only waited in its dead worker spent a retry, or failed, having run once).
            if last and last[0][0] != resumed_from:
                continue
            if status != b"started" or int(count or 0) >= FREE_REQUEUES:
                continue
            job = self._job_of(queue, job_id)
            if job is None or getattr(job, "has_rate_limit", False):  # (a rate limit's slot: RQ's clean-up frees it)
                continue
            with self.connection.pipeline() as pipe:  # MULTI: out of the registry and back in the queue, or neither
                try:
                    # Still so, watched: a client's cancel since the look above (it keeps the entry now) was written
                    # over by the job's save, and the job run again.
                    pipe.watch(job.key)
                    key = queue.started_job_registry.key
                    status = pipe.hget(job.key, "status")
                    if status in (b"canceled", b"stopped") and pipe.zscore(key, member) is not None:
                        pipe.unwatch()  # canceled meanwhile: ended here (RQ's clean-up after would only drop it)
                        self._end_canceled(queue, member, job_id, status)
                        continue
                    if status != b"started" or pipe.zscore(key, member) is None:
                        continue
                    pipe.multi()
                    pipe.zrem(key, member)
                    pipe.hincrby(job.key, UNRUN_FIELD, 1)
                    queue._enqueue_job(job, pipeline=pipe, at_front=True)  # (as RQ's own requeues, the hand-back)
                    pipe.execute()
                except redis.WatchError:  # (it changed meanwhile: the steps after, or the next pass, take it)
                    continue
            handed.append(job_id)
        if handed:
            log.warning("%d jobs of queue %s whose worker died before their first token went back to its front, "
                        "retries untouched: %s", len(handed), queue.name, ", ".join(handed))  # fmt: skip

    def lock(self, queue: Queue) -> bool:
        """RQ's lock on a queue's clean-up (its key, so RQ's own workers take turns with these), held about a
        maintenance interval, not RQ's 899 s: a worker killed mid-pass (or whose release met Redis away) left no
        worker cleaning that queue, its dead workers' jobs stranded, for 15 minutes."""
        return bool(self.connection.set(queue.registry_cleaning_key, 1, nx=True, ex=self.lock_ttl))

    @property
    def lock_ttl(self) -> int:
        return max(int(self.settings.maintenance_interval) - 1, 1)

    def prune_canceled(self, queue: Queue) -> None:
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

    def clean_groups(self) -> None:
        """RQ's clean-up of its job groups (one lock for every worker), which raises on a group key it cannot read (a
        key of another type): here an error is logged, never fatal. It stopped every worker on that Redis."""
        if not Group.acquire_maintenance_lock(self.connection, self.lock_ttl):
            return
        try:
            Group.clean_registries(connection=self.connection)
        except REDIS_DOWN:
            raise
        except Exception:
            log.exception("maintenance of RQ's job groups failed (a group key RQ cannot read?); carrying on")

    def requeue_stranded(self, queue: Queue) -> None:
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
