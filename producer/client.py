"""The producer side: submit jobs, stream their tokens, wait for results. Needs no torch."""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
import warnings
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import NoPermissionError, WatchError
from rq import Queue, Retry
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, validate_job_id
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat
from rq.worker import Worker

from producer.connection import REDIS_DOWN, connect, longest_block_s
from producer.protocol import (
    DEFAULT_QUEUE,
    JOB_FUNCTION,
    OWNER_FIELD,
    STATS_KEY,
    STREAM_FIELD,
    STREAM_TTL_AFTER_END_S,
    canceled_result,
    channel_key,
    done_key,
    event_from_stream,
    is_last,
    lane_name,
    lanes,
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
from producer.schema import JobRequest, describe_validation_error, job_ending
from producer.wire import JobResult, StreamEvent, read_check

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_ENDED = ("failed", "canceled", "stopped")
_OVER = tuple(status.encode() for status in ("finished", *_ENDED))  # a job's statuses once it has ended
# A finished job's final event goes out in the worker's next write after its result: a reader that finds the job
# finished and its stream short of that event waits this long for it before calling the stream expired.
FINAL_EVENT_GRACE_S = 2.0
POLL_WITHOUT_BLOCKING_S = 0.5  # how often a result is looked for where Redis refuses channels and blocking reads
DEFAULT_RESULT_TTL = 24 * 3600  # a day, as the worker's --result-ttl
_NOT_KEPT = "the job finished, but its result is not kept (result_ttl 0, or expired)"
CANCELER = "roseinfer-client"  # the worker name on the result of a job a client ended (canceled in its queue)


class JobError(Exception):
    """A job ended without a result. ``result`` holds what the worker recorded, if anything; ``error_type`` whose
    fault a failure was, as the worker said (``invalid_request``, ``timeout``, ``server_error``; None: not said);
    ``error_code`` what it was where a client can act on it (``context_length_exceeded``; None: not said)."""

    def __init__(
        self,
        job_id: str,
        reason: str,
        result: dict[str, Any] | None = None,
        error_type: str | None = None,
        error_code: str | None = None,
    ) -> None:
        super().__init__(f"job {job_id}: {reason}")
        self.job_id, self.reason, self.result = job_id, reason, result
        self.error_type = error_type or (result or {}).get("error_type")
        self.error_code = error_code or (result or {}).get("error_code")


class JobFailed(JobError):
    @classmethod
    def of_event(cls, job_id: str, event: dict[str, Any]) -> JobFailed:
        """The failure a job's last event (``finish_reason: error``) says."""
        reason, fault, code = event.get("error", "failed"), event.get("error_type"), event.get("error_code")
        return cls(job_id, reason, error_type=fault, error_code=code)


class ResultNotKept(JobFailed):
    """The job finished, but its result is not kept: ``result_ttl=0`` (RQ deletes such a job as it finishes), or
    expired. Its text went out on its stream. A ``JobFailed``, as it was before."""


class JobCanceled(JobError):
    pass


class NoSuchJob(JobFailed, NoSuchJobError):
    """No job of that id on this Redis: never submitted, or expired. A ``JobFailed`` (what it was before), and
    RQ's ``NoSuchJobError``, which RQ's users catch for it."""


class InvalidRequest(ValueError):
    pass


class JobIdTaken(InvalidRequest):
    """Ids given for new jobs that name jobs still queued or running (``job_ids``: all of them)."""

    def __init__(self, job_ids: list[str], status: str) -> None:
        super().__init__(
            f"job id {job_ids[0]!r} is taken by a job that is {status}: wait for it to end or cancel it, or give "
            "another id" + (f" ({len(job_ids) - 1} more ids are taken too)" if len(job_ids) > 1 else "")
        )
        self.job_ids, self.status = job_ids, status


class StreamGap(Exception):
    """Events of the job's stream were trimmed before they were read (the worker keeps ``stream_maxlen`` entries a
    job): what the stream gives is not the whole output. ``result()`` holds it."""

    def __init__(self, job_id: str, first: int, last: int) -> None:
        super().__init__(
            f"job {job_id}: events {first}-{last} of its stream were trimmed before they were read (the worker's "
            "stream_maxlen); its text here is not whole: read result()"
        )
        self.job_id = job_id


class StreamRestarted(Exception):
    """The job's output started over (a retry could not resume what an earlier attempt streamed): the text
    already read from ``stream()`` is void. Call ``stream()`` again for the new output from its start."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: its output restarted from the beginning; the text read so far is void")
        self.job_id = job_id


class ProtocolError(JobError):
    """What a worker wrote does not follow the protocol (docs/protocol.md, docs/schemas/)."""


MAX_JOB_ID = 256  # the protocol's (the worker refuses a longer one)


@dataclass
class EndedJob:
    """What is left of an ended job whose id is used again: its lane, its hash's fields."""

    id: str
    origin: str | None  # None: the hash is gone
    fields: list[bytes]


def deadline_after(timeout: float | None) -> float | None:
    """The monotonic time a wait of ``timeout`` seconds ends; None for no end (None, or infinity: a wait in
    milliseconds of it was an OverflowError)."""
    return None if timeout is None or timeout == math.inf else time.monotonic() + timeout


def check_job_id(job_id: Any) -> None:
    """RQ's rule for a job id (text of letters, digits, ``-`` and ``_``) and the protocol's length, as an
    ``InvalidRequest``."""
    try:
        validate_job_id(job_id)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(str(exc)) from None
    if len(job_id) > MAX_JOB_ID:
        raise InvalidRequest(f"a job id is at most {MAX_JOB_ID} characters, got {len(job_id)}")


def checked(model: type, value: dict[str, Any], job_id: str) -> dict[str, Any]:
    """``value`` if it follows the protocol's schema (the same models the schemas are generated from), fields it
    does not know aside (``read_check``)."""
    try:
        read_check(model, value)
    except ValidationError as exc:
        raise ProtocolError(job_id, f"{model.__name__} off the protocol: {describe_validation_error(exc)}") from None
    return value


def eviction_policy(connection: Redis) -> str | None:
    """Redis's ``maxmemory-policy``: by CONFIG, else by INFO (a managed Redis refuses CONFIG: ElastiCache's
    default is volatile-lru); None where neither may be read."""
    for read in (
        lambda: connection.config_get("maxmemory-policy").get("maxmemory-policy"),
        lambda: connection.info("memory").get("maxmemory_policy"),
    ):
        try:
            policy = read()
        except REDIS_DOWN:
            raise
        except Exception:
            continue
        return policy.decode() if isinstance(policy, bytes) else policy
    return None


def eviction_warning(connection: Redis, policy: str | None = None) -> str | None:
    """A warning when Redis may evict keys to make room: under any policy but ``noeviction``, queued jobs,
    job hashes and results can vanish without a trace. None when the policy is safe or cannot be read.
    ``policy``: as ``eviction_policy`` read it already."""
    if policy is None:
        try:
            policy = eviction_policy(connection)
        except REDIS_DOWN:
            return None  # (the command that follows says so)
    if policy in (None, "noeviction"):
        return None
    return (
        f"Redis evicts keys under memory pressure (maxmemory-policy {policy}): queued jobs, job hashes and results "
        "can vanish without a trace; set maxmemory-policy noeviction"
    )


def validate(fields: dict[str, Any]) -> JobRequest:
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid job: {describe_validation_error(exc)}") from None


REPLAY_PAGE = 1024  # stream entries a read of the backlog takes (one XRANGE of 100,000 held Redis 40 ms)


class EventCursor:
    """Where a reader of a job's stream is, and the events each batch of entries it reads holds (checked against
    the protocol; with ``skip_void``, those a later reset in the batch makes void are left out)."""

    def __init__(self, job_id: str, skip_void: bool = False) -> None:
        self.job_id, self.skip_void = job_id, skip_void
        self.last_id: bytes | str = "0-0"
        self.next_n = 0
        self.missing: tuple[int, int] | None = None  # events trimmed before they were read (no reset since)
        self._seen: dict[int, dict[str, Any]] = {}  # the events read since the last reset, by number

    def next_entry(self) -> str:
        """The id of the first stream entry this reader has not read (XRANGE's start)."""
        if self.last_id in ("0-0", b"0-0"):
            return "-"
        ms, _, seq = (self.last_id.decode() if isinstance(self.last_id, bytes) else self.last_id).partition("-")
        return f"{ms}-{int(seq) + 1}"

    def hold(self, page: list, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``held`` (events read, not yet handed out) with the events of ``page`` (a read of the backlog): a reset in
        it voids what was held."""
        events = self.take(page)
        return events if events and events[0].get("reset") else held + events

    def take(self, entries: list) -> list[dict[str, Any]]:
        if not entries:
            return []
        events = [checked(StreamEvent, event_from_stream(fields), self.job_id) for _id, fields in entries]
        self.last_id = entries[-1][0]
        resets = [i for i, e in enumerate(events) if e.get("reset")] if self.skip_void else []
        out = events[resets[-1] :] if resets else events
        kept = []
        for event in out:
            # An event read already, as it was (written twice: a write tried again after Redis refused part of it),
            # is left out; event 0 again after others is a restart (the stream expired), unless it follows itself.
            n = event["n"]
            if not event.get("reset") and self._seen.get(n) == event and (n > 0 or self.next_n == 1):
                continue
            if event["n"] == 0 and self.next_n:
                event["reset"] = True
            if event.get("reset"):
                self._seen = {}
            self._seen[n] = dict(event)
            kept.append(event)
            if event.get("reset"):  # the text starts over: what was missed before it is void anyway
                self.missing = None
            elif event["n"] > self.next_n and self.missing is None:
                self.missing = (self.next_n, event["n"] - 1)
            self.next_n = event["n"] + 1
        if self.missing is not None and kept and is_last(kept[-1]):
            raise StreamGap(self.job_id, *self.missing)  # the output ended without them: it is not whole
        return kept


class StreamExpired(StreamGap):
    """Finished, but its replay stream expired before it was read to its end (10 minutes after the end, by
    default): ``events()`` raises this, ``stream()`` gives the result's text instead. Not a failure (it was a
    ``JobFailed``, so ``except JobFailed`` took a finished job for failed): ``result()`` holds the output."""

    def __init__(self, job_id: str) -> None:
        Exception.__init__(self, f"job {job_id}: the job finished but its token stream has expired; use result()")
        self.job_id = job_id


def stream_expired(job_id: str) -> StreamExpired:
    return StreamExpired(job_id)


def piece_of(job_id: str, event: dict[str, Any], index: int, read_any: bool) -> str:
    """The text ``event`` adds to sample ``index``; ``StreamRestarted`` for a reset after text was read."""
    if event.get("reset") and read_any:
        raise StreamRestarted(job_id)
    return event["text"] if event.get("index", 0) == index else ""


def ends_sample(event: dict[str, Any], index: int) -> bool:
    """``event`` is the last of sample ``index`` while others go on (n > 1): nothing more of it follows."""
    return "sample_finish_reason" in event and event.get("index", 0) == index


def raise_at_a_bad_end(job_id: str, event: dict[str, Any], read_any: bool = True) -> None:
    """After its text: a last event of a failed job raises ``JobFailed``; of one canceled (or stopped) while it ran,
    ``JobCanceled``, as for one canceled while queued (``read_any``: whether the follower handed out text)."""
    if event.get("finish_reason") == "error":
        raise JobFailed.of_event(job_id, event)
    if event.get("finish_reason") == "abort":
        made = "the text above is what it made first" if read_any else "it had made no text"
        raise JobCanceled(job_id, f"the job was canceled; {made}")


def _failed_just_now(status: str, entries: list[Any], redis_time: tuple[int, int]) -> bool:
    """A failure whose latest result entry is RQ's own record, written in the last seconds (by Redis's clock,
    ``redis_time``: a client's clock 2 s off read it as old, or every failure as new): the worker writes the job's
    result (its error, what it made) a round trip after it."""
    if status != "failed" or not entries:
        return False
    seconds, micros = redis_time
    return seconds * 1000 + micros // 1000 - _entry_millis(entries) < FINAL_EVENT_GRACE_S * 1000


def _entry_millis(entries: list[Any]) -> int:
    """When the first of a stream's ``entries`` was written: its id's milliseconds (Redis's clock)."""
    entry_id = entries[0][0]
    return int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])


def stream_wait_ends(deadline: float | None, may_come: bool) -> float:
    """When a follower of a finished job that read no final event gives up on its stream: after
    ``FINAL_EVENT_GRACE_S`` where it ``may_come`` (its stream is there, or the job ended in the last seconds: a
    worker writes a job's last event a round trip after its result and status, and the stream of a job of one step
    holds nothing before it), else at once (expired); never past the caller's deadline (a job long over cost every
    ``stream()`` 3 s, and one with a timeout under that a TimeoutError, its result there)."""
    now = time.monotonic()
    return min(now + FINAL_EVENT_GRACE_S, math.inf if deadline is None else deadline) if may_come else now


def queue_end_reads(pipe: Any, job_id: str) -> None:
    """Queue on ``pipe`` what ``final_event_may_come`` reads: the stream's existence, Redis's clock, the result's
    latest entry."""
    pipe.exists(stream_key(job_id))
    pipe.time()
    pipe.xrevrange(result_key(job_id), count=1)


def final_event_may_come(replies: list[Any]) -> bool:
    """From ``queue_end_reads``' replies: the stream is there, or the result was written in the last
    ``FINAL_EVENT_GRACE_S`` (by Redis's clock: no client's clock is compared with it)."""
    stream_left, (seconds, micros), entries = replies
    if stream_left:
        return True
    return bool(entries) and seconds * 1000 + micros // 1000 - _entry_millis(entries) < FINAL_EVENT_GRACE_S * 1000


def time_left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (None: no end), at least a millisecond: a last read still goes out."""
    return None if deadline is None else max(0.001, deadline - time.monotonic())


def sample_text(result: dict[str, Any], index: int) -> str:
    """The text of sample ``index`` of a result (one with n > 1 holds them in ``choices``)."""
    choices = result.get("choices") or [{"index": 0, "text": result.get("text", "")}]
    return next((c.get("text", "") for c in choices if c.get("index", 0) == index), "")


REDIS_PATIENCE_S = 30.0  # a follower waits out a Redis restart or failover this long, then raises


class Outage:
    """A follower's patience with a Redis that went away (a restart, a Sentinel failover): it tries again with
    backoff, for up to ``REDIS_PATIENCE_S`` at a time and never past the caller's deadline, then raises the error.
    Without it every stream and wait died with the restart, the jobs going on. A Redis the client never reached
    (a wrong URL) is no outage: its error is raised at once (a typo waited 30 s)."""

    def __init__(self, deadline: float | None, client: Client) -> None:
        self.deadline, self.since, self.backoff, self.client = deadline, None, 0.1, client

    def wait(self, exc: Exception) -> None:
        time.sleep(self.pause(exc))

    def pause(self, exc: Exception) -> float:
        """The seconds to wait before trying again after ``exc``; raises it once patience (or the deadline) ran out."""
        if not self.client.reached:
            raise exc
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        end = self.since + REDIS_PATIENCE_S
        end = end if self.deadline is None else min(end, self.deadline)
        if now >= end:
            raise exc
        pause = min(self.backoff, end - now)
        self.backoff = min(self.backoff * 2, 2.0)
        return pause

    def over(self) -> None:
        self.since, self.backoff = None, 0.1
        self.client.reached = True


def _whole(name: str, value: object, least: int, meaning: str, special: int | None = None) -> None:
    """``value`` a whole number of at least ``least`` (or ``special``), else a ValueError saying what ``name`` is."""
    if type(value) is not int or (value < least and value != special):  # (not True, 1.5, "60")
        raise ValueError(f"{name} is {meaning}, got {value!r}")


class Client:
    """``Client(redis_url, queue="roseinfer")``: submit generation jobs to roseinfer workers.

    Jobs are RQ jobs (JSON serializer). ``retries`` lets a job survive workers that die under it;
    ``job_timeout`` bounds a job's run time (seconds, enforced by the worker); ``result_ttl`` keeps an ended job's
    result, ``failure_ttl`` a failed (or stopped) one's (None: RQ's year).
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        queue: str = DEFAULT_QUEUE,
        *,
        connection: Redis | None = None,
        retries: int = 2,
        job_timeout: int = 3600,
        result_ttl: int = DEFAULT_RESULT_TTL,
        failure_ttl: int | None = None,
    ) -> None:
        # Whole seconds, checked here in their own words: 1.5 went into the job hash as 1, "x" failed in RQ at submit.
        _whole("retries", retries, 0, "a count of retries, 0 or more")
        _whole("job_timeout", job_timeout, 1, "seconds, at least 1 (-1: no limit)", -1)
        _whole("result_ttl", result_ttl, 0, "seconds, 0 or more (0: not kept, -1: for good)", -1)
        if failure_ttl is not None:
            _whole("failure_ttl", failure_ttl, 1, "seconds, at least 1 (None: RQ's year)")
        if connection is not None and connection.get_connection_kwargs().get("decode_responses"):
            # (its submit went in, then every look at the job failed: 'str' object has no attribute 'decode')
            raise ValueError(
                "Client(connection=...) takes a Redis client without decode_responses: job hashes and streams are "
                "read as bytes (as RQ reads them)"
            )
        self.connection = connection or connect(redis_url)
        self.queue = Queue(queue, connection=self.connection, serializer=JSONSerializer)
        self._lanes: dict[int, Queue] = {0: self.queue}
        self.retries, self.job_timeout, self.result_ttl = retries, job_timeout, result_ttl
        self.failure_ttl = failure_ttl
        self._policy_checked = False
        self.reached = False  # Redis answered this client once: a later error is an outage to wait out
        self._owns_connection = connection is None

    def close(self) -> None:
        """Its connections to Redis closed (a connection passed in is the caller's to close), as AsyncClient's."""
        if self._owns_connection:
            self.connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        job_id: str | None = None,
        **fields: Any,
    ) -> GenerationJob:
        """Enqueue one job; ``fields`` are the payload's sampling fields (OpenAI names) plus custom_id/metadata."""
        req = validate({"prompt": prompt, "messages": messages, **fields})
        if job_id is not None:
            check_job_id(job_id)  # (in its own words, before Redis is asked: submit_many says "request 0: ...")
        self._check_eviction_policy()
        queue = self.lane(req.priority)
        if job_id is not None:  # checked and written in one watched transaction: see submit_many
            return self.submit_many([{"prompt": prompt, "messages": messages, **fields, "job_id": job_id}])[0]
        job = queue.enqueue_call(JOB_FUNCTION, kwargs=self._payload(req), job_id=job_id, **self._job_options(req))
        self.reached = True
        return GenerationJob(self, job.id)

    def _ended(self, job_ids: list[str]) -> list[EndedJob]:
        """Those of ``job_ids`` (given by the caller) whose job ran before and ended, or whose hash is gone (its
        ``result_ttl`` of 0 or under the stream's life, RQ's ``delete()``): what is left of it is an old job's.
        An id whose job is still queued or running is refused: enqueued again, its payload was written over and
        the id pushed twice, and both callers got the first job's result (the second request lost without a word;
        vLLM refuses a running request's id too)."""
        if not job_ids:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(Job.key_for(job_id), "status", "origin")
                pipe.hkeys(Job.key_for(job_id))
            replies = pipe.execute()
        taken = [(job_id, status) for job_id, (status, _) in zip(job_ids, replies[::2]) if status not in (None, *_OVER)]
        if taken:
            raise JobIdTaken([job_id for job_id, _ in taken], taken[0][1].decode(errors="replace")[:40])
        return [
            EndedJob(job_id, origin.decode() if origin else None, fields)
            for job_id, (status, origin), fields in zip(job_ids, replies[::2], replies[1::2])
            if status is None or status in _OVER
        ]

    @staticmethod
    def _forget_ended(pipe: Any, ended: list[EndedJob], lanes: dict[str, str]) -> None:
        """An id used again for a new job (in lane ``lanes[id]``): the old job's token stream and result go first.
        Its text was streamed to the new job's followers, and its result taken for the new job's while that one was
        queued. Its entries in RQ's finished, failed and canceled registries go too (the new job was counted as
        failed as well, and a requeue of the failed ones ran it again), and its hash's fields but one (an enqueue
        writes over some only: its retries left, its meta stayed the new job's). The one kept, the field naming the
        attempt that owns the job, fences off a run of the old job still going somewhere (canceled, or taken for
        dead), which would write its end over the new job. Its expiry goes too (an enqueue without ``ttl`` sets
        none): the old job's ``result_ttl`` would delete the new one while it waits. (A job still queued or running
        never gets here: ``_ended`` refuses its id.)"""
        for old in ended:
            pipe.delete(stream_key(old.id), result_key(old.id))
            stale = [f for f in old.fields if f != OWNER_FIELD.encode()]
            if stale:
                pipe.hdel(Job.key_for(old.id), *stale)
            pipe.persist(Job.key_for(old.id))
            for lane in {old.origin, lanes[old.id]} - {None}:
                for registry in (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry):
                    pipe.zrem(registry.key_template.format(lane), old.id)

    def lane(self, priority: int) -> Queue:
        """The RQ queue holding this client's jobs of ``priority`` (the queue itself for 0)."""
        if priority not in self._lanes:
            name = lane_name(self.queue.name, priority)
            self._lanes[priority] = Queue(name, connection=self.connection, serializer=JSONSerializer)
        return self._lanes[priority]

    def submit_many(self, requests: Iterable[dict[str, Any]]) -> list[GenerationJob]:
        """Enqueue many jobs in one pipeline. Each request is a payload dict (may hold ``job_id``); all are
        validated before any is enqueued."""
        hashes: list[tuple[str, Queue, dict[str, Any]]] = []
        given: dict[str, None] = {}  # the ids the caller chose (maybe an ended job's); a dict: 100k ids, no scan
        stamp = utcformat(now())  # the jobs are enqueued together, in one transaction
        for i, fields in enumerate(requests):
            fields = dict(fields)
            job_id = fields.pop("job_id", None)
            try:
                req = validate(fields)
                if job_id is not None:
                    check_job_id(job_id)
                    if job_id in given:  # two payloads, one job: the first was lost without a word
                        raise InvalidRequest(f"job id {job_id!r} is given twice")
                    given[job_id] = None
            except (ValueError, TypeError) as exc:
                raise InvalidRequest(f"request {i}: {exc}") from None
            job_id = job_id or str(uuid.uuid4())
            lane = self.lane(req.priority)
            hashes.append((job_id, lane, self._job_hash(lane, req, stamp)))
        self._check_eviction_policy()
        with self.connection.pipeline() as pipe:
            # Watched: a job of one of these ids enqueued or started after the look below fails the transaction,
            # which looks again (two callers of one id: the second is refused, not written over the first).
            while True:
                try:
                    self._enqueue_hashes(pipe, hashes, list(given))
                    break
                except WatchError:
                    continue
        self.reached = True
        return [GenerationJob(self, job_id) for job_id, _, _ in hashes]

    def _enqueue_hashes(self, pipe: Any, hashes: list[tuple[str, Queue, dict[str, Any]]], given: list[str]) -> None:
        if given:
            pipe.watch(*(Job.key_for(job_id) for job_id in given))
        ended = self._ended(given)
        pipe.multi()
        self._forget_ended(pipe, ended, {job_id: lane.name for job_id, lane, _ in hashes})
        for key in dict.fromkeys(lane.key for _, lane, _ in hashes):
            pipe.sadd(Queue.redis_queues_keys, key)
        ids_by_lane: dict[str, list[str]] = {}
        for job_id, lane, mapping in hashes:
            pipe.hset(Job.key_for(job_id), mapping=mapping)
            ids_by_lane.setdefault(lane.key, []).append(job_id)
        # One RPUSH a lane, in submission order (the transaction makes the hashes and ids appear together):
        # a command a job cost this process ~7 us to pack and Redis a command to run.
        for key, ids in ids_by_lane.items():
            pipe.rpush(key, *ids)
        pipe.execute()

    def _job_hash(self, lane: Queue, req: JobRequest, stamp: str) -> dict[str, Any]:
        """The job hash RQ's ``enqueue_many`` writes for this request, made without RQ's Job objects (0.14 ms a job
        of this process's time: 256 jobs took 35 ms to submit). ``tests/test_queue_units.py`` holds it to RQ's."""
        options = self._job_options(req)
        fields: dict[str, Any] = {
            "created_at": stamp,
            "data": zlib.compress(JSONSerializer.dumps((JOB_FUNCTION, None, (), self._payload(req)))),
            "success_callback_name": "",
            "failure_callback_name": "",
            "stopped_callback_name": "",
            "started_at": "",
            "ended_at": "",
            "last_heartbeat": "",
            "worker_name": "",
            "group_id": "",
        }
        retry = options["retry"]
        if retry is not None:
            fields["retries_left"] = retry.max
            fields["retry_intervals"] = json.dumps(retry.intervals)
        fields.update(
            origin=lane.name,
            description=options["description"],
            enqueued_at=stamp,
            timeout=options["timeout"],
            result_ttl=options["result_ttl"],
            status="queued",
        )
        if options.get("failure_ttl") is not None:
            fields["failure_ttl"] = options["failure_ttl"]
        return fields

    def _check_eviction_policy(self) -> None:
        """Once per client, before its first job: a loud warning where Redis may evict the queue's keys."""
        if self._policy_checked:
            return
        self._policy_checked = True
        warning = eviction_warning(self.connection)
        if warning:
            warnings.warn(warning, RuntimeWarning, stacklevel=3)

    def job(self, job_id: str) -> GenerationJob:
        return GenerationJob(self, job_id)

    def status(self) -> dict[str, Any]:
        """Queue depth, jobs in flight, finished and failed counts, live workers and their tokens/s."""
        rows = self.workers()
        queues = [self.lane(p) for p, _name in lanes(self.connection, self.queue.name)]
        kinds = ("started_job_registry", "finished_job_registry", "failed_job_registry", "canceled_job_registry")
        # Entries not yet expired, counted without RQ's cleanup (``registry.count`` runs it): that fails a dead
        # worker's jobs here, through RQ's plain Job, running the failure callbacks the workers refuse.
        with self.connection.pipeline(transaction=False) as pipe:
            for q in queues:
                for kind in kinds:
                    pipe.zcount(getattr(q, kind).key, time.time(), "+inf")
            counts = pipe.execute()
        per_kind = [sum(counts[i :: len(kinds)]) for i in range(len(kinds))]
        return {
            "queue": self.queue.name,
            "queued": sum(q.count for q in queues),
            "lanes": {str(p): q.count for p, q in self._lanes.items() if q in queues},  # queued, per priority
            "in_flight": per_kind[0],
            "finished": per_kind[1],
            "failed": per_kind[2],
            "canceled": per_kind[3],
            "workers": rows,
            "tokens_per_s": sum(r["tokens_per_s"] for r in rows),
            "redis": self._memory_state(),
        }

    def _memory_state(self) -> str:
        """``full: ...`` where Redis takes no writes for want of memory (the workers' own word on it is a write
        Redis refuses then: it said "ok"), ``ok`` otherwise, or where INFO is not this user's to read."""
        try:
            info = self.connection.info("memory")
        except REDIS_DOWN:
            raise
        except Exception:
            return "ok"
        used, most = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        if most and used >= most and info.get("maxmemory_policy") == "noeviction":
            return f"full: {used} bytes used of maxmemory {most}; writes are refused until it has room"
        return "ok"

    def workers(self, queue: str | None = None) -> list[dict[str, Any]]:
        """The live workers of the queue (or of ``queue``): name, state, model, jobs in flight, tokens/s, Redis
        health."""
        serving = self.queue if queue is None else Queue(queue, connection=self.connection)
        workers = Worker.all(connection=self.connection, queue=serving)
        with self.connection.pipeline(transaction=False) as pipe:
            for w in workers:
                pipe.hgetall(STATS_KEY.format(worker=w.name))
            stats = pipe.execute()
        rows = []
        for w, st in zip(workers, stats):
            if not st:  # its statistics lapse with its heartbeat: a dead worker (SIGKILL, OOM) is not listed
                continue
            st = {k.decode(): v.decode() for k, v in st.items()}
            rows.append(
                {
                    "name": w.name,
                    "state": w.get_state(),
                    "model": st.get("model"),
                    "in_flight": int(st.get("in_flight", 0)),
                    "tokens_per_s": float(st.get("tokens_per_s", 0.0)),
                    "redis": st.get("redis", "ok"),  # or why Redis refuses the worker's writes right now
                    "tokenizer": st.get("tokenizer") or None,  # the digest of the tokenizer it wrote to Redis
                    "template": st.get("template") or None,  # and of its chat template
                    "max_model_len": int(st["max_model_len"]) if st.get("max_model_len", "").isdigit() else None,
                    "dtype": st.get("dtype") or None,
                    "quantization": st.get("quantization") or None,  # int8, int8+output_layer
                }
            )
        return rows

    def no_worker_warning(self, queue: str | None = None) -> str | None:
        """A warning when no live worker serves the queue (or ``queue``: its jobs wait there), else None."""
        if self.workers() if queue is None else self.workers(queue):
            return None
        name = self.queue.name if queue is None else queue
        return (
            f"warning: no live worker serves queue {name!r} (yet): its jobs wait there until one starts "
            f"(roseinfer worker --queue {name}; roseinfer status lists the workers)"
        )

    def _payload(self, req: JobRequest) -> dict[str, Any]:
        return req.model_dump(exclude_defaults=True, by_alias=True)

    def _job_options(self, req: JobRequest) -> dict[str, Any]:
        if req.prompt_token_ids is not None:
            text = f"<{len(req.prompt_token_ids)} token ids>"
        else:
            text = req.prompt if req.prompt is not None else req.messages[-1].content  # type: ignore[index]
        return {
            "timeout": self.job_timeout,
            "result_ttl": self.result_ttl,
            "failure_ttl": self.failure_ttl,
            "retry": Retry(max=self.retries) if self.retries else None,
            "description": f"generate: {text[:60]!r}" + (f" [{req.custom_id}]" if req.custom_id else ""),
        }


def ends_the_wait(message: dict[str, Any] | None) -> bool:
    """Whether a message read on a job's channel ends a wait for its result: its final event (the one with a
    finish reason), or anything not ours to read (the next look at the result decides)."""
    if not message or message["type"] != "message":
        return False
    try:
        event = json.loads(message["data"])
    except ValueError:
        return True
    return not isinstance(event, dict) or is_last(event)


def _wait_for_subscribed(pubsub: Any, seconds: float) -> None:
    """Read a channel until Redis confirms the subscription, or for ``seconds``: the look again that follows goes
    out on another connection, and Redis could serve it first, then publish the job's end to nobody."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=left)
        if message and message["type"] == "subscribe":
            return


def _wait_for_final_event(pubsub: Any, seconds: float) -> None:
    """Read a job's channel until its final event, or for ``seconds``."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        if ends_the_wait(pubsub.get_message(timeout=left)):
            return


class GenerationJob:
    """A handle on one submitted job, by id: stream its text, wait for its result, cancel it."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"GenerationJob({self.id!r})"

    @property
    def rq_job(self) -> Job:
        return Job.fetch(self.id, connection=self.client.connection, serializer=JSONSerializer)

    def samples(self) -> int | None:
        """How many samples the job makes (its payload's ``n``); None if its hash is gone or cannot be read."""
        try:
            return int(self.rq_job.kwargs.get("n") or 1)
        except (NoSuchJobError, ValueError, TypeError, AttributeError):
            return None

    def check_sample(self, index: int) -> None:
        """``InvalidRequest`` for a sample ``index`` the job does not make (its payload's ``n``): a stream of it
        ended at once with no text and no error."""
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
        made canceled (its result there, ``cancel`` saying True). A job taken out of its queue by it is ended here
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
                        job.cancel()
                        return True
                    pipe.multi()
                    pipe.lrem(Queue(job.origin, connection=pipe).key, 0, job.id)  # (RQ's own LREM then finds none)
                    job.cancel(pipeline=pipe)
                    in_queue = pipe.execute()[0]
                    break
                except WatchError:  # the job changed meanwhile (it started, it ended): look again
                    continue
        if in_queue:
            self._end_unrun(job)
        return True

    def _end_unrun(self, job: Job) -> None:
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
        result = canceled_result(self.id, ending, reason, made)
        if made:
            result["usage"] = spent
        with conn.pipeline() as pipe:
            # Ended by this client: an attempt of it that still runs somewhere (its worker stalled) is another's
            # now, fenced off (it wrote its own cancel, a second result and last event, once thawed).
            pipe.hset(job.key, OWNER_FIELD, CANCELER)
            pipe.xadd(result_key(self.id), result_entry(result, Result.Type.STOPPED, CANCELER), maxlen=10)
            keys = [result_key(self.id), job.key]
            if ending.notify:
                pipe.rpush(done_key(ending.notify), self.id)
                keys.append(done_key(ending.notify))
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
        longest = max(1, int(1000 * longest_block_s(conn)))  # (0 blocks for good)
        while True:
            wait_ms = longest if deadline is None else max(1, min(longest, int((deadline - time.monotonic()) * 1000)))
            if expired_at is not None:
                wait_ms = max(1, min(wait_ms, int((expired_at - time.monotonic()) * 1000)))
            try:
                reply = conn.xread({key: cursor.last_id}, count=1024, block=wait_ms if looked else None)
                looked = True
                status = None if reply else self.status()
                if (status in _ENDED or status == "missing") and conn.xread({key: cursor.last_id}, count=1):
                    continue  # the last events landed just now
            except REDIS_DOWN as exc:
                outage.wait(exc)  # a restart, a failover: read on from the same place once it answers
                continue
            outage.over()
            for _key, entries in reply or []:
                for event in cursor.take(entries):
                    yield event
                    if is_last(event):
                        return
                    if deadline is not None and time.monotonic() >= deadline:  # tokens still coming: not the end
                        raise TimeoutError(f"job {self.id}: no end of stream within {timeout:g} s")
            if reply:
                continue
            # One reading of the clock for the checks below: a finished job's wait may end at the deadline itself, and
            # two readings could cross it between them (a TimeoutError where its stream had expired, its result there).
            now = time.monotonic()
            if status in _ENDED or status == "missing":
                if status in ("canceled", "stopped", "failed") and (expired_at or self._was_running()):
                    # its final event (an abort's last text and usage, a failure's error) lands after the status
                    expired_at = expired_at or min(time.monotonic() + FINAL_EVENT_GRACE_S, deadline or math.inf)
                    if time.monotonic() < expired_at:
                        continue
                self._raise_ended(status)
            if status == "finished":
                if expired_at is None:
                    try:
                        with conn.pipeline(transaction=False) as pipe:
                            queue_end_reads(pipe, self.id)
                            expired_at = stream_wait_ends(deadline, final_event_may_come(pipe.execute()))
                    except REDIS_DOWN as exc:
                        outage.wait(exc)
                        continue
                if now >= expired_at:
                    raise stream_expired(self.id)
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"job {self.id}: no end of stream within {timeout:g} s")

    def stream(self, timeout: float | None = None, index: int = 0) -> Iterator[str]:
        """The generated text piece by piece, from the first token, whenever it is called (of sample ``index`` for a
        job with n > 1, ending at that sample's last piece): its stream replayed, then live; once that stream expired
        (10 minutes after the end, by default), the result's text in one piece. Raises ``StreamRestarted`` if the
        output starts over after text was read (call it again to follow the new one)."""
        self.check_sample(index)
        read_any = False
        deadline = deadline_after(timeout)
        try:
            with contextlib.closing(self.events(timeout, skip_void=True)) as events:
                for event in events:
                    piece = piece_of(self.id, event, index, read_any)
                    if piece:
                        read_any = True
                        yield piece
                    raise_at_a_bad_end(self.id, event, read_any)
                    if ends_sample(event, index):  # its sample is whole: the others' tokens are not waited for
                        return
        except StreamExpired:
            if read_any:
                raise
            yield sample_text(self.result(timeout=time_left(deadline)), index)

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
                if status == "finished" and result is None:  # RQ writes both at once: not kept, or expired
                    raise ResultNotKept(self.id, _NOT_KEPT)
                if status in _ENDED or status == "missing":
                    if result is None and (grace or _failed_just_now(status, entries, redis_time) or self._ran(status)):
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
                        _wait_for_subscribed(pubsub, wait)
                        continue
                    _wait_for_final_event(pubsub, wait)
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
                raise ResultNotKept(self.id, _NOT_KEPT)  # RQ deletes a job with result_ttl 0 once it finishes
            raise NoSuchJob(self.id, "no such job (never submitted, or expired)")
        if status in ("canceled", "stopped"):
            raise JobCanceled(self.id, f"job {status}", result)
        reason = result.get("error") if result else None
        if not reason and not gone:  # (RQ's failure record: read through the job's hash)
            latest = self.rq_job.latest_result()
            lines = [ln for ln in (latest.exc_string or "").splitlines() if ln.strip()] if latest else []
            reason = lines[-1] if lines else None
        raise JobFailed(self.id, reason or "failed", result)
