"""Taking jobs off the queue without trusting them.

A job hash is written by whoever can reach Redis, in any language. What RQ cannot read (a date that does not
parse, a status that does not exist, bytes that are not UTF-8, an id outside ``[A-Za-z0-9_-]``) is moved aside
with a reason, never built into a ``Job`` without data. What a job names to be run or called (RQ callbacks,
webhooks) is refused unless the operator allowed that exact name or host.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

import redis
from rq.exceptions import DequeueTimeout
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import resolve_serializer
from rq.utils import parse_timeout, str_to_date

from producer.protocol import rejected_key

log = logging.getLogger("roseinfer.worker")

JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
BAD_ID = "job ids may only use A-Z, a-z, 0-9, '_' and '-' (at most 256 of them)"
_DATES = ("created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat")
_INTS = ("result_ttl", "failure_ttl", "ttl", "retries_left", "number_of_retries", "success_callback_timeout",
         "failure_callback_timeout", "stopped_callback_timeout")  # fmt: skip
_JSON = ("retry_intervals", "dependency_ids")
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# Redis up but refusing writes for now (maxmemory with noeviction, a replica during a failover, loading its data):
# back-pressure, not death.
REDIS_REFUSING = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
)
REDIS_UNAVAILABLE = REDIS_DOWN + REDIS_REFUSING


# RQ's own stamps (``utcformat``): read by ``datetime.fromisoformat``, a tenth of what RQ's ``strptime`` costs.
_STAMP = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_STAMP_FIELDS = tuple(name.encode() for name in _DATES)
_resolved_serializer = functools.cache(resolve_serializer)


class PulledJob(Job):
    """RQ's ``Job``, made and restored as RQ does, less two costs a burst of jobs paid per job: the serializer's
    check (a ``Protocol`` isinstance, ~10 us) made once per serializer, and RQ's own date stamps parsed without
    ``strptime``. What is not such a stamp goes through RQ's parsing, and fails there as it would."""

    def __init__(self, id: str | None = None, connection: redis.Redis | None = None, serializer=None) -> None:
        super().__init__(id, connection)
        self.serializer = _resolved_serializer(serializer)

    def restore(self, raw_data) -> None:
        stamps: dict[bytes, datetime] = {}
        if isinstance(raw_data, dict):
            for name in _STAMP_FIELDS:
                value = raw_data.get(name)
                if isinstance(value, bytes) and _STAMP.fullmatch(value):
                    with contextlib.suppress(ValueError):  # a 13th month, say: RQ's parsing says so
                        stamps[name] = datetime.fromisoformat(value[:-1].decode()).replace(tzinfo=timezone.utc)
            if stamps:
                raw_data = {k: v for k, v in raw_data.items() if k not in stamps}
        super().restore(raw_data)
        for name, value in stamps.items():
            setattr(self, name.decode(), value)


@dataclass
class Unreadable:
    """A job RQ could not read: its id, its queue and why."""

    job_id: str
    queue: Queue
    reason: str


# KEYS: a queue, its intermediate list; ARGV[1]: how many at most. RQ's dequeue move, repeated until the queue is
# empty: a pipeline of that many LMOVEs cost a command each whatever the queue held (hundreds a pull, for nothing).
MOVE_SCRIPT = """
local ids = {}
for _ = 1, tonumber(ARGV[1]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  ids[#ids + 1] = id
end
return ids
"""


def load_script(connection: redis.Redis, source: str):
    """``source`` registered and loaded now: called by its SHA from then on (a pipeline holding a registered script
    would ask SCRIPT EXISTS first, a round trip more at every call)."""
    script = connection.register_script(source)
    connection.script_load(source)
    return script


def pull(
    queues: list[Queue],
    limit: int,
    block: float | None,
    connection: redis.Redis,
    job_class: type[Job],
    serializer,
    move_script=None,
) -> tuple[list[tuple[Job, Queue]], list[Unreadable]]:
    """Up to ``limit`` jobs off ``queues``, blocking ``block`` seconds for the first one only (None: not at all).
    Jobs RQ cannot read come back apart, already off the queue; Redis errors propagate. ``move_script``: the
    registered ``MOVE_SCRIPT`` (None where Redis runs no Lua: a pipeline of ``limit`` LMOVEs then)."""
    pulled: list[tuple[Job, Queue]] = []
    unreadable: list[Unreadable] = []
    if block:  # RQ's blocking dequeue for the first job; the burst it woke for comes in batches below
        _dequeue_one(queues, block, connection, job_class, serializer, pulled, unreadable)
        if not pulled and not unreadable:
            return pulled, unreadable
    for queue in queues:  # each queue in turn (first-served first), a batch of round trips each
        room = limit - len(pulled) - len(unreadable)
        if room <= 0:
            break
        got, bad = _pull_batch(queue, room, connection, job_class, serializer, move_script)
        pulled += got
        unreadable += bad
    return pulled, unreadable


def _dequeue_one(
    queues: list[Queue],
    block: float,
    connection: redis.Redis,
    job_class: type[Job],
    serializer,
    pulled: list[tuple[Job, Queue]],
    unreadable: list[Unreadable],
) -> None:
    """One job by RQ's blocking dequeue (up to ``block`` seconds), into ``pulled`` or ``unreadable``."""
    try:
        got = Queue.dequeue_any(queues, block, connection=connection, job_class=job_class, serializer=serializer)
    except DequeueTimeout:
        return
    except REDIS_DOWN:
        raise
    except Exception as exc:  # the job hash itself: a field RQ cannot parse, an id it refuses
        job_id, queue = getattr(exc, "job_id", None), getattr(exc, "queue", None)
        if job_id is None or queue is None:  # nothing to pin it on: log it and leave the queue for now
            log.exception("could not take a job off the queue")
            return
        unreadable.append(Unreadable(job_id, queue, diagnose(connection.hgetall(Job.key_for(job_id)), job_id, exc)))
        return
    if got is None:
        return
    job, queue = got
    if not JOB_ID.match(job.id):
        unreadable.append(Unreadable(job.id, queue, BAD_ID))
    else:
        pulled.append(got)


def _pull_batch(
    queue: Queue, limit: int, connection: redis.Redis, job_class: type[Job], serializer, move_script=None
) -> tuple[list[tuple[Job, Queue]], list[Unreadable]]:
    """What RQ's dequeue does (LMOVE to the intermediate list, then the job's hash), for ``limit`` jobs in two
    round trips instead of two per job."""
    if move_script is not None:
        moved = move_script(keys=[queue.key, queue.intermediate_queue_key], args=[limit])
    else:
        with connection.pipeline(transaction=False) as pipe:
            for _ in range(limit):
                pipe.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
            moved = [i for i in pipe.execute() if i is not None]
    ids = [i.decode() if isinstance(i, bytes) else i for i in moved]
    if not ids:
        return [], []
    with connection.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hgetall(Job.key_for(job_id))
        raws = pipe.execute()
    pulled: list[tuple[Job, Queue]] = []
    unreadable: list[Unreadable] = []
    for job_id, raw in zip(ids, raws):
        if not raw:  # deleted meanwhile: RQ skips it too
            connection.lrem(queue.intermediate_queue_key, 1, job_id)
            continue
        if not JOB_ID.match(job_id):
            unreadable.append(Unreadable(job_id, queue, BAD_ID))
            continue
        try:
            job = job_class(job_id, connection=connection, serializer=serializer)
            job.restore(raw)
        except Exception as exc:  # a field RQ cannot parse, an id it refuses
            unreadable.append(Unreadable(job_id, queue, diagnose(raw, job_id, exc)))
            continue
        pulled.append((job, queue))
    return pulled, unreadable


def diagnose(raw: dict, job_id: str, exc: Exception) -> str:
    """Which field of the hash (``raw``, as HGETALL gives it) RQ could not read, in words (RQ's own errors rarely
    name it)."""
    if not JOB_ID.match(job_id):
        return BAD_ID
    fields = {k.decode("utf-8", "replace"): v for k, v in (raw or {}).items()}
    checks = [(name, str_to_date) for name in _DATES] + [(name, int) for name in _INTS]
    checks += [("timeout", parse_timeout), ("status", lambda v: JobStatus(v.decode()))]
    checks += [(name, lambda v: json.loads(v.decode())) for name in _JSON]
    for name, parse in checks:
        if fields.get(name):
            try:
                parse(fields[name])
            except Exception:
                return f"RQ cannot read this job: its field {name!r} holds {fields[name][:60]!r}"
    for name, value in fields.items():
        if name != "data":
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return f"RQ cannot read this job: its field {name!r} is not UTF-8 text"
    return f"RQ cannot read this job: {type(exc).__name__}: {exc}"


def quarantine(pipe: redis.client.Pipeline, item: Unreadable, ttl: int) -> None:
    """Off the queue lists, status failed where the hash exists, and into ``roseinfer:rejected:<queue>`` (a sorted
    set by time) where an operator finds it; RQ's own registries never hold it, so its maintenance cannot trip."""
    queue = item.queue
    pipe.lrem(queue.intermediate_queue_key, 0, item.job_id)
    pipe.lrem(queue.key, 0, item.job_id)
    pipe.hset(Job.key_for(item.job_id), "status", "failed")  # the hash exists: RQ found it and could not read it
    rejected = rejected_key(queue.name)
    pipe.zadd(rejected, {item.job_id: time.time()})
    pipe.expire(rejected, ttl)


@dataclass(frozen=True)
class HookPolicy:
    """What a job may name to be run or called: exact callback names, webhook hosts. Empty: nothing."""

    callbacks: frozenset[str] = frozenset()
    webhook_hosts: frozenset[str] = frozenset()

    def refuse(self, job: Job) -> str | None:
        """Why this job may not run here, or None. Whatever is refused is also taken off the job, so RQ's
        failure path cannot call it either."""
        problems = []
        for kind in ("success", "failure", "stopped"):
            name = getattr(job, f"_{kind}_callback_name", None)
            if name and name not in self.callbacks:
                problems.append(f"{kind} callback {name!r}")
                setattr(job, f"_{kind}_callback_name", None)
                setattr(job, f"_{kind}_callback", None)
        kept = []
        for hook in getattr(job, "webhooks", None) or []:
            host = urlsplit(str(hook.url)).hostname or ""
            if host in self.webhook_hosts:
                kept.append(hook)
            else:
                problems.append(f"webhook to {hook.url!r}")
        job.webhooks = kept
        if not problems:
            return None
        return (
            f"this worker runs no code and calls no address that a job names; refused: {', '.join(problems)} "
            "(an operator allows exact names with --allow-callback module.function and hosts with --allow-webhook-host)"
        )
