"""``GenerationJob``: a handle on one submitted job, by id: stream its text, wait for its result, cancel it."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoPermissionError, ResponseError, WatchError
from rq import Queue
from rq.exceptions import DeserializationError, InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.registry import CanceledJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from producer.connection import REDIS_DOWN, longest_block_s, unblocked
from producer.event_reading import (
    AFTER_OUTAGE_S,
    FINAL_EVENT_GRACE_S,
    REPLAY_PAGE,
    EventCursor,
    Outage,
    deadline_after,
    ending_event_may_come,
    ends_sample,
    failed_just_now,
    final_event_may_come,
    piece_of,
    queue_end_reads,
    raise_at_a_bad_end,
    rest_from_result,
    stream_wait_ends,
    text_before_its_end,
    time_left,
    wait_for_final_event,
    wait_for_subscribed,
)
from producer.job_errors import (
    InvalidRequest,
    JobCanceled,
    JobFailed,
    NoSuchJob,
    ResultNotKept,
    StreamExpired,
    StreamGap,
    checked,
    stream_expired,
)
from producer.protocol import (
    OWNER_FIELD,
    STREAM_FIELD,
    STREAM_TTL_AFTER_END_S,
    canceled_result,
    channel_key,
    done_key,
    event_from_stream,
    is_last,
    make_event,
    queue_stream_check,
    read_result,
    result_entry,
    result_from_entries,
    result_key,
    stream_check,
    stream_key,
    streamed_output,
    usage_of,
)
from producer.schema import job_ending
from producer.wire import JobResult

if TYPE_CHECKING:
    from producer.client import Client

ENDED = ("failed", "canceled", "stopped")
STREAM_POLL_S = 0.05  # how often a stream is looked at where Redis refuses XREAD (its pieces come late by this)
POLL_WITHOUT_BLOCKING_S = 0.5  # how often a result is looked for where Redis refuses channels and blocking reads
DEFAULT_RESULT_TTL = 24 * 3600  # a day, as the worker's --result-ttl
NOT_KEPT = "the job finished, but its result is not kept (result_ttl 0, or expired)"
CANCELER = "roseinfer-client"  # the worker name on the result of a job a client ended (canceled in its queue)


def handle_id(job_id: Any) -> str:
    """The id a job handle is made with, a string (an int failed later, inside RQ: "can only concatenate str")."""
    if not isinstance(job_id, str):
        raise TypeError(f"a job id is a string, got {type(job_id).__name__} {job_id!r}")
    return job_id


class GenerationJob:
    """A handle on one submitted job, by id: stream its text, wait for its result, cancel it."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = handle_id(job_id)

    def __repr__(self) -> str:
        return f"GenerationJob({self.id!r})"

    def __eq__(self, other: object) -> bool:  # (as RQ's Job: one job, whichever handle names it)
        return isinstance(other, GenerationJob) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def rq_job(self) -> Job:
        return Job.fetch(self.id, connection=self.client.connection, serializer=JSONSerializer)

    def samples(self) -> int | None:
        """How many samples the job makes (its payload's ``n``); None if its hash is gone or cannot be read."""
        try:
            return int(self.rq_job.kwargs.get("n") or 1)
        except (NoSuchJobError, DeserializationError, ValueError, TypeError, AttributeError):
            return None  # (DeserializationError: a payload RQ cannot read, as pickle's: ``stream`` was a traceback)

    def check_sample(self, index: int) -> None:
        """``InvalidRequest`` for a sample ``index`` the job does not make (its payload's ``n``): a stream of it
        ended at once with no text and no error."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"a sample index is an int, got {type(index).__name__} {index!r}")
        if index == 0:
            return
        n = self.samples()  # (None: gone, or written by hand; only a negative index is judged then)
        if index < 0 or (n is not None and index >= n):
            made = f"makes {n} sample(s) (n={n})" if n is not None else "has no such sample"
            raise InvalidRequest(f"job {self.id} {made}: there is no sample index {index}")

    def status(self) -> str:
        """RQ's status: queued, started, finished, failed, canceled, stopped, ...; "missing" if unknown."""
        status = self.client.connection.hget(Job.key_for(self.id), "status")
        return status.decode() if status else "missing"

    def cancel(self) -> bool:
        """Cancel the job, queued or running (a running job stops within one engine step). False if it had
        already ended."""
        try:
            return self._cancel_unless_ended(self.rq_job)
        except (NoSuchJobError, InvalidJobOperation):
            return False
        except ValueError:  # a hash RQ cannot read (written by hand, a stamp it cannot parse): as any language cancels
            key = Job.key_for(self.id)
            status = self.client.connection.hget(key, "status")
            if status is None or status.decode() in ("finished", "failed", "canceled", "stopped"):
                return False
            self.client.connection.hset(key, "status", "canceled")  # the worker skips it, or stops it within a step
        return True

    def _cancel_unless_ended(self, job: Job) -> bool:
        """RQ's cancel, in one transaction with the look at the status: a job that finished between the two was
        made canceled (its result there, ``cancel`` saying True). A job taken out of its queue by it, or out of
        RQ's scheduled or deferred registry (a retry's wait, ``enqueue_in``, ``depends_on``), is ended here
        (``_end_unrun``): no worker will reach it."""
        with self.client.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(job.key)
                    status = pipe.hget(job.key, "status")
                    if status is None or status.decode() in ("finished", "failed", "canceled", "stopped"):
                        return False
                    if getattr(job, "has_rate_limit", False):  # (RQ cancels such a job only in its own transaction)
                        pipe.unwatch()
                        queued = self.client.connection.lpos(Queue(job.origin, connection=pipe).key, job.id)
                        job.cancel()
                        # Taken out of its queue or its limit's waiting list: no worker reaches it (one that pulled
                        # it ends it itself), and its hash stayed for good with no result.
                        if queued is not None or status == b"rate_limited":
                            self._end_unrun(job)
                        return True
                    # A running job's started entry stays (RQ's cancel takes it out): its worker ends the job and
                    # removes it; a dead worker's lapses, and maintenance ends the job (it kept no ending at all).
                    started = StartedJobRegistry(job.origin, connection=self.client.connection).key
                    member = f"{job.id}:{(pipe.hget(job.key, OWNER_FIELD) or b'').decode(errors='replace')}"
                    score = pipe.zscore(started, member) if status == b"started" else None
                    pipe.multi()
                    pipe.lrem(Queue(job.origin, connection=pipe).key, 0, job.id)  # (RQ's own LREM then finds none)
                    job.cancel(pipeline=pipe)
                    if score is not None:
                        pipe.zadd(started, {member: score})
                    in_queue = pipe.execute()[0]
                    break
                except WatchError:  # the job changed meanwhile (it started, it ended): look again
                    continue
        if in_queue or status in (b"scheduled", b"deferred", b"ready_to_enqueue"):  # (RQ's cancel took it out of its
            # registry then: a dependent between deferred and queued waits in RQ's ready registry)
            self._end_unrun(job)
        return True

    def _end_unrun(self, job: Job, its_worker_died: bool = False) -> None:
        """The ending a worker writes for a job canceled before it ran (a final ``abort`` event, a canceled result,
        the job hash and its canceled-registry entry kept for the result's TTL), for a job canceled while still in
        its queue: RQ's cancel took it out, so no worker reaches it, and its hash (with the prompt) stayed for
        good, its followers waiting on a stream that never ended."""
        conn, key = self.client.connection, stream_key(self.id)
        # A retried job (waiting for its next attempt): what its earlier ones streamed stays its output, as a
        # canceled running job's does (the result said nothing of the text its stream held).
        entries = conn.xrange(key)
        try:
            streamed = [event_from_stream(fields) for _id, fields in entries]
            n = streamed[-1].get("n", -1) + 1 if streamed else 0
        except (ValueError, KeyError, TypeError, AttributeError):  # an entry written by hand: RQ's cancel stands
            streamed, n = [], len(entries)
        # An earlier job's of this id (a stock RQ enqueue under it) is none of this one's, as its start would find;
        # an attempt that ended (requeued by hand since): its output is void, as for the worker that would run it.
        earlier = False
        if streamed:
            with conn.pipeline(transaction=False) as pipe:
                queue_stream_check(pipe, job)
                earlier = stream_check(job.created_at, *pipe.execute(raise_on_error=False))[0]
        ended_before = earlier or (bool(streamed) and is_last(streamed[-1]))
        streamed = [] if earlier else streamed
        made = {} if ended_before else streamed_output(streamed) or {}
        ending = job_ending(job)  # (written by hand, maybe in a form it would have failed on: what reads)
        # (a result_ttl of 0 keeps no result of a finished job; a canceled one's is kept, as a worker keeps it)
        ttl = next(t for t in (job.result_ttl, self.client.result_ttl, DEFAULT_RESULT_TTL) if t not in (None, 0))
        prompt = next((e["usage"].get("prompt_tokens", 0) for e in reversed(streamed) if e.get("usage")), 0)
        spent = usage_of(prompt, sum(len(ids) for _text, ids in made.values()))
        event = json.dumps(make_event(n, "", [], "abort", spent, reset=ended_before))
        reason = "job canceled before it ran" if not made else "job canceled while it waited for its next attempt"
        if its_worker_died:  # (maintenance's end of one canceled while its worker was dead: it was running)
            reason = "job canceled while the worker running it was dead"
        result = canceled_result(self.id, ending, reason, made)
        if made:
            result["usage"] = spent
        with conn.pipeline() as pipe:
            # Ended by this client: an attempt of it that still runs somewhere (its worker stalled) is another's
            # now, fenced off (it wrote its own cancel, a second result and last event, once thawed).
            pipe.hset(job.key, OWNER_FIELD, CANCELER)
            pipe.xadd(result_key(self.id), result_entry(result, Result.Type.STOPPED, CANCELER), maxlen=10)
            keys = [result_key(self.id), job.key, job.dependents_key, job.dependencies_key]  # (RQ's cleanup's too)
            if ending.notify:  # (the list is every job's that names it: a worker's TTL, not this job's own)
                pipe.rpush(done_key(ending.notify), self.id)
                pipe.expire(done_key(ending.notify), DEFAULT_RESULT_TTL)
            for held in keys:
                if ttl == -1:
                    pipe.persist(held)
                else:
                    pipe.expire(held, ttl)
            CanceledJobRegistry(job.origin, connection=conn).add(job, ttl, pipeline=pipe)
            pipe.xadd(key, {STREAM_FIELD: event})  # after the result it announces, as a worker writes them
            pipe.expire(key, STREAM_TTL_AFTER_END_S if ttl == -1 else min(ttl, STREAM_TTL_AFTER_END_S))
            pipe.publish(channel_key(self.id), event)
            pipe.execute()

    def events(self, timeout: float | None = None, skip_void: bool = False) -> Iterator[dict[str, Any]]:
        """Every event of the job from the first, replayed then live (no gap, no duplicate), until the last.
        ``skip_void``: leave out events that a later ``reset`` event read in the same batch makes void (a replay
        then starts at the last reset). An event 0 after others (the stream expired and the job ran again) comes
        marked as a reset too."""
        conn, key = self.client.connection, stream_key(self.id)
        cursor = EventCursor(self.id, skip_void)
        deadline = deadline_after(timeout)
        expired_at: float | None = None
        # What is there already, read to its end before any goes out: a reset anywhere in it voids all before it
        # (handed out as read, text a later read voided had gone out, and every call again raised StreamRestarted).
        held: list[dict[str, Any]] = []
        outage = Outage(deadline, self.client)
        while skip_void:
            try:
                page = conn.xrange(key, min=cursor.next_entry(), count=REPLAY_PAGE)
            except REDIS_DOWN as exc:  # (as the reads below: ``stream`` gave up at once)
                outage.wait(exc)
                continue
            outage.over()
            held = cursor.hold(page, held)
            if len(page) < REPLAY_PAGE:
                break
        for event in held:
            yield event
            if is_last(event):
                return
        looked = False  # the first read does not block: a job long over says so at once
        polling = False  # Redis refuses XREAD (an ACL without @blocking): the stream is looked at every so often
        longest = max(1, int(1000 * longest_block_s(conn)))  # (0 blocks for good)

        def read(count: int, block_ms: int | None) -> list:
            if not polling:
                return conn.xread({key: cursor.last_id}, count=count, block=block_ms)
            if block_ms is not None:
                time.sleep(min(block_ms / 1000, STREAM_POLL_S))
            page = conn.xrange(key, min=cursor.next_entry(), count=count)
            return [(key, page)] if page else []

        while True:
            wait_ms = longest if deadline is None else max(1, min(longest, int((deadline - time.monotonic()) * 1000)))
            if expired_at is not None:
                wait_ms = max(1, min(wait_ms, int((expired_at - time.monotonic()) * 1000)))
            try:
                reply = read(1024, wait_ms if looked else None)
                looked = True
                status = None if reply else self.status()
                if (status in ENDED or status == "missing") and read(1, None):
                    continue  # the last events landed just now
            except NoPermissionError:
                if polling:
                    raise
                polling = True  # (result() reads on without blocking reads too)
                continue
            except REDIS_DOWN as exc:
                outage.wait(exc)  # a restart, a failover: read on from the same place once it answers
                continue
            except ResponseError as exc:
                if not unblocked(exc):
                    raise
                outage.wait(exc)  # (a primary made a replica ended the blocked read: read on)
                continue
            outage.over()
            for _key, entries in reply or []:
                for event in cursor.take(entries):
                    yield event
                    if is_last(event):
                        return
            if reply:
                # (checked once the events in hand are given: a job long over gave one, then this error)
                if deadline is not None and time.monotonic() >= deadline:  # tokens still coming: not the end
                    raise TimeoutError(f"job {self.id}: no end of stream within {timeout:g} s")
                continue
            # One reading of the clock for the checks below: a finished job's wait may end at the deadline itself, and
            # two readings could cross it between them (a TimeoutError where its stream had expired, its result there).
            now = time.monotonic()
            in_time = deadline is None or now < deadline
            if status == "missing" and outage.ended_within(AFTER_OUTAGE_S) and in_time:
                continue  # (Redis restarted empty: its workers write their jobs back; the read above waited)
            if status in ENDED or status == "missing":
                if status in ("canceled", "stopped", "failed") and (expired_at or self._was_running()):
                    # its final event (an abort's last text and usage, a failure's error) lands after the status
                    if expired_at is None:  # (not for a job long over: every stream() of it waited the grace)
                        try:
                            expired_at = self._final_event_wait(deadline, ending_event_may_come)
                        except REDIS_DOWN as exc:
                            outage.wait(exc)
                            continue
                    if time.monotonic() < expired_at:
                        continue
                self._raise_ended(status)
            if status == "finished":
                if expired_at is None:
                    try:
                        expired_at = self._final_event_wait(deadline, final_event_may_come)
                    except REDIS_DOWN as exc:
                        outage.wait(exc)
                        continue
                if now >= expired_at:
                    raise stream_expired(self.id)
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"job {self.id}: no end of stream within {timeout:g} s")

    def _final_event_wait(self, deadline: float | None, may_come: Callable[[list[Any]], bool]) -> float:
        """Until when a follower that read no final event waits for one (``stream_wait_ends``), by ``may_come`` of
        ``queue_end_reads``' replies."""
        with self.client.connection.pipeline(transaction=False) as pipe:
            queue_end_reads(pipe, self.id)
            return stream_wait_ends(deadline, may_come(pipe.execute()))

    def stream(self, timeout: float | None = None, index: int = 0) -> Iterator[str]:
        """The generated text piece by piece, from the first token, whenever it is called (of sample ``index`` for a
        job with n > 1, ending at that sample's last piece): its stream replayed, then live; once that stream expired
        (10 minutes after the end, by default) or where it was trimmed before any was read, the result's text in one
        piece. Raises ``StreamRestarted`` if the
        output starts over after text was read (call it again to follow the new one)."""
        self.check_sample(index)
        read_any, read = False, []  # (the text given: a stream that falls short is made whole from the result)
        deadline = deadline_after(timeout)
        try:
            with contextlib.closing(self.events(timeout, skip_void=True)) as events:
                for event in events:
                    piece = piece_of(self.id, event, index, read_any)
                    if piece:
                        read_any = True
                        read.append(piece)
                        yield piece
                    raise_at_a_bad_end(self.id, event, read_any)
                    if ends_sample(event, index):  # its sample is whole: the others' tokens are not waited for
                        return
        except (JobCanceled, JobFailed) as exc:  # (its stream gone: what it made is in its result)
            if text := text_before_its_end(exc, index, "".join(read)):
                yield text
            raise
        except StreamGap as gap:  # expired, trimmed, or short of its end: the rest from the result, where it is whole
            try:
                result = self.result(timeout=time_left(deadline))
            except (ResultNotKept, NoSuchJob):
                if isinstance(gap, StreamExpired) and not read:
                    raise
                raise gap from None  # (no result to give: the stream's word stands)
            if rest := rest_from_result(result, index, "".join(read), gap):
                yield rest

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the result: text, token_ids, finish_reason, usage, timings. Raises JobFailed or JobCanceled.
        Waits on the job's channel (its final event goes out once the result is written), not by polling; it looks
        again at least once a second, since a job can end without a final event (RQ failed it, it was deleted)."""
        conn = self.client.connection
        deadline = deadline_after(timeout)
        outage = Outage(deadline, self.client)
        grace: float | None = None
        pubsub = None
        channels = True  # False: an ACL user without channel rights (Redis 7's default for new users)
        longest = longest_block_s(conn)
        blocking = True  # False: nor the right to a blocking XREAD
        try:
            while True:
                try:
                    with conn.pipeline(transaction=False) as pipe:  # the status first (``read_result`` says why)
                        pipe.hget(Job.key_for(self.id), "status")
                        read_result(pipe, self.id)
                        pipe.time()
                        status, entries, redis_time = pipe.execute()
                except REDIS_DOWN as exc:
                    if pubsub is not None:  # its connection went too: subscribed again once Redis answers
                        pubsub.close()
                        pubsub = None
                    outage.wait(exc)
                    continue
                outage.over()
                result = result_from_entries(entries)
                if result is not None and result.get("status") == "finished":
                    return checked(JobResult, result, self.id)
                status = status.decode() if status else "missing"
                in_time = deadline is None or time.monotonic() < deadline
                if status == "missing" and result is None and outage.ended_within(AFTER_OUTAGE_S) and in_time:
                    time.sleep(0.1)  # (Redis restarted empty: every waiter said NoSuchJob of jobs then finished)
                    continue
                if status == "finished" and result is None:  # RQ writes both at once: not kept, or expired
                    raise ResultNotKept(self.id, NOT_KEPT)
                if status in ENDED or status == "missing":
                    if result is None and (grace or failed_just_now(status, entries, redis_time) or self._ran(status)):
                        # the worker writes the result (a canceled job's partial one, a failed job's error) a step
                        # or a round trip after the status: waited for, within the caller's timeout
                        grace = grace or min(
                            time.monotonic() + FINAL_EVENT_GRACE_S, math.inf if deadline is None else deadline
                        )
                        if time.monotonic() < grace:
                            time.sleep(0.02)
                            continue
                    self._raise_ended(status, result)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {self.id}: no result within {timeout:g} s (status {status})")
                wait = longest if left is None else min(longest, left)
                try:
                    if not channels and not blocking:  # neither a channel nor a blocking read: looked at again
                        time.sleep(min(wait, POLL_WITHOUT_BLOCKING_S))
                        continue
                    if not channels:  # the stream's end is waited on instead
                        conn.xread({stream_key(self.id): "$"}, count=1, block=max(1, int(1000 * wait)))
                        continue
                    if pubsub is None:  # subscribed, then a look again: an end in between is not missed
                        pubsub = conn.pubsub()
                        pubsub.subscribe(channel_key(self.id))
                        wait_for_subscribed(pubsub, wait)
                        continue
                    wait_for_final_event(pubsub, wait)
                except NoPermissionError:
                    if not channels:  # XREAD refused too (no @blocking): each look went on at once, thousands a second
                        blocking = False
                    channels = False
                    if pubsub is not None:
                        pubsub.close()
                        pubsub = None
                except REDIS_DOWN:
                    if pubsub is not None:
                        pubsub.close()  # the next look meets the outage, and subscribes again after it
                        pubsub = None
        finally:
            if pubsub is not None:
                pubsub.close()

    def _was_running(self) -> bool:
        return bool(self.client.connection.hget(Job.key_for(self.id), "started_at"))

    def _ran(self, status: str) -> bool:
        """Canceled or stopped after it started: the worker writes its partial result within a step."""
        return status in ("canceled", "stopped") and self._was_running()

    def _raise_ended(self, status: str, result: dict[str, Any] | None = None) -> None:
        if result is None:
            result = result_from_entries(read_result(self.client.connection, self.id))
        gone = status == "missing"
        if gone and result is not None and result.get("status") in ("canceled", "stopped", "failed"):
            status = result["status"]  # the hash went (evicted, deleted by hand): its result says how the job ended
        elif gone:
            last = self.client.connection.xrevrange(stream_key(self.id), count=1)
            if last and event_from_stream(last[0][1]).get("finish_reason") in ("stop", "length"):
                raise ResultNotKept(self.id, NOT_KEPT)  # RQ deletes a job with result_ttl 0 once it finishes
            raise NoSuchJob(self.id, "no such job (never submitted, or expired)")
        if status in ("canceled", "stopped"):
            raise JobCanceled(self.id, f"job {status}", result)
        reason = result.get("error") if result else None
        if not reason and not gone:  # (RQ's own record, a stock worker's: its stream's last event says why, as whom)
            last = self.client.connection.xrevrange(stream_key(self.id), count=1)
            if last and (event := event_from_stream(last[0][1])).get("finish_reason") == "error":
                raise JobFailed.of_event(self.id, event)
        if not reason and not gone:  # (RQ's failure record: read through the job's hash)
            latest = self.rq_job.latest_result()
            lines = [ln for ln in (latest.exc_string or "").splitlines() if ln.strip()] if latest else []
            reason = lines[-1] if lines else None
        raise JobFailed(self.id, reason or "failed", result)
