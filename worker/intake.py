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
import math
import re
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar
from urllib.parse import urlsplit

import redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import resolve_serializer
from rq.utils import parse_timeout, str_to_date
from rq.webhook import Webhook

from producer.connection import wrong_type
from producer.protocol import rejected_key
from producer.schema import MAX_JSON_DEPTH, Ending, ending_of, json_depth

log = logging.getLogger("roseinfer.worker")

JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
BAD_ID = "job ids may only use A-Z, a-z, 0-9, '_' and '-' (at most 256 of them)"


def shown_id(job_id: str) -> str:
    """A job id as a log line shows it: whole within the protocol's bound, else its start and its length (an id of
    20 MB pushed by hand was logged whole, 20 MB a push)."""
    return repr(job_id) if len(job_id) <= 256 else f"{job_id[:64]!r}... ({len(job_id)} characters)"


NOT_TEXT_ID = f"this job's id is not UTF-8 text, so no result can be keyed on it: moved aside ({BAD_ID})"
_DATES = ("created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat")
_INTS = ("result_ttl", "failure_ttl", "ttl", "retries_left", "number_of_retries", "success_callback_timeout",
         "failure_callback_timeout", "stopped_callback_timeout")  # fmt: skip
_JSON = ("retry_intervals", "dependency_ids")
# Times a job gives in seconds: past ~31 years Redis's EXPIRE or Python's dates overflow (10**17 s made the finish
# script fail midway, for every job ending in the same step).
MAX_SECONDS = 10**9
MAX_CALLBACK_S = 600  # an allowed callback's longest time limit (RQ's default is 60)
_SECONDS = ("result_ttl", "failure_ttl", "ttl", "timeout")
_INTERVALS = ("retry_intervals", "repeat_intervals")
# RQ's own stamps (``utcformat``): read by ``datetime.fromisoformat``, a tenth of what RQ's ``strptime`` costs.
_STAMP = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
_STAMP_FIELDS = tuple(name.encode() for name in _DATES)
_INFLATED = (b"data", b"exc_info")  # the fields RQ's restore zlib-inflates
WEBHOOK_SENDERS = 8  # webhooks sent at once, at most
MAX_OTHER_FIELD = 64 * 1024  # bytes of any other field of a job hash (``meta``, ``description``, ...)
_resolved_serializer = functools.cache(resolve_serializer)


class PulledJob(Job):
    """RQ's ``Job``, made and restored as RQ does, less two costs a burst of jobs paid per job: the serializer's
    check (a ``Protocol`` isinstance, ~10 us) made once per serializer, and RQ's own date stamps parsed without
    ``strptime``. What is not such a stamp goes through RQ's parsing, and fails there as it would.

    With a ``hook_policy`` (``HookPolicy.job_class``), what a job names that the policy refuses is taken off it as
    it is read, whoever reads it: RQ's maintenance builds jobs of its own (a dead worker's job failed by the
    clean-up ran its refused failure callback and webhook)."""

    hook_policy: ClassVar[HookPolicy | None] = None

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
        # Data written as plain JSON (by a client in another language) is saved back so: RQ's saves (a failure, a
        # retry) wrote it zlib-compressed, and a reader of the hash as text failed on it (UnicodeDecodeError).
        written = raw_data.get(b"data") if isinstance(raw_data, dict) else None
        self.plain_data = written is not None and self._data is written
        for name, value in stamps.items():
            setattr(self, name.decode(), value)
        if self.hook_policy is not None:
            self.refused_hooks = self.hook_policy.strip(self)

    def send_webhooks(self, status: str | JobStatus, *, exc_string: str | None = None) -> None:
        """RQ's, on threads of their own. RQ's worker sends them from the process of the one job it runs; here they
        went out on the thread that writes every job's events and ends (and RQ's clean-up's on the step loop), and a
        host slow to answer (10 s a hook by default) held all of those behind it. Errors are logged there, as RQ's
        are; the sends still waiting go out before the process exits."""
        hooks = [hook for hook in self.webhooks or () if hook.job_status == status]
        if hooks:
            _webhook_senders().submit(_send_webhooks, self, hooks, exc_string)

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        """RQ's, with what the policy took off the job as the job named it: RQ saves jobs it read (a dependent it
        enqueues, a job its clean-up fails or retries), and the fields must not be erased for the stock worker,
        or the requeue after an operator allows them, that would run them."""
        obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        obj.update(getattr(self, "named_hooks", {}))
        if getattr(self, "plain_data", False):
            obj["data"] = self.data
        return obj


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # (urllib then raises the 30x as an HTTPError: logged as a send that failed)


def webhook_target(host: str, port: int | None) -> str:
    """A host and port as ``--allow-webhook-host`` holds it: ``host`` (its scheme's port) or ``host:port``."""
    if port is None:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# What a job's webhook may not set: where the request goes (Host: another site behind the allowed address's proxy)
# and how it is framed, which are the sender's.
_HEADERS_NOT_A_JOBS = frozenset(
    ["host", "connection", "content-length", "transfer-encoding", "proxy-authorization", "proxy-connection", "te",
     "upgrade", "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"]
)  # fmt: skip

_WEBHOOK_OPENER = urllib.request.build_opener(_NoRedirects)


def _send_webhooks(job: Job, hooks: list[Webhook], exc_string: str | None) -> None:
    """RQ's ``Webhook.send`` of each, but a redirect is not followed (its target's host was never checked against
    the allowed ones: a 302 from an allowed host reached any other) and none waits past ``MAX_CALLBACK_S``."""
    for hook in hooks:
        try:
            if hook.method == "GET":
                request = urllib.request.Request(hook.url, headers=hook.headers or {}, method="GET")
            else:
                body = json.dumps(hook.get_payload(job, exc_string=exc_string)).encode("utf-8")
                headers = {"Content-Type": "application/json", **(hook.headers or {})}
                request = urllib.request.Request(hook.url, data=body, headers=headers, method="POST")
            with _WEBHOOK_OPENER.open(request, timeout=min(hook.timeout, MAX_CALLBACK_S)):
                pass
        except urllib.error.HTTPError as exc:  # (an answer, said in a line: a redirect is one, not followed)
            logging.getLogger("rq.webhook").warning(
                "webhook to %s for job %s answered %d %s (a redirect is not followed)", hook.url, job.id, exc.code,
                exc.reason,
            )  # fmt: skip
        except Exception:  # (logged, never raised: RQ's way, an endpoint down fails no job)
            logging.getLogger("rq.webhook").warning(
                "Failed to send webhook to %s for job %s", hook.url, job.id, exc_info=True
            )


@functools.cache
def _webhook_senders() -> ThreadPoolExecutor:
    """The threads that send jobs' webhooks (made at the first one): a host slow to answer holds one of them."""
    return ThreadPoolExecutor(max_workers=WEBHOOK_SENDERS, thread_name_prefix="roseinfer-webhook")


@dataclass(frozen=True)
class OtherType:
    """A job's key that holds another type than a hash (SET by hand): ``kind``, as TYPE names it."""

    kind: str

    @classmethod
    def of(cls, reply: bytes | str) -> OtherType:
        return cls(reply.decode(errors="backslashreplace") if isinstance(reply, bytes) else str(reply))


@dataclass
class Oversized:
    """A job hash that takes more memory in Redis than a worker reads (its bytes): left unread."""

    size: int


@dataclass
class Unreadable:
    """A job RQ could not read: its id, its queue and why."""

    job_id: str
    queue: Queue
    reason: str
    raw_id: bytes | None = None  # an id that is not UTF-8 text (``job_id`` then shows it escaped)
    is_hash: bool = True  # its key holds a hash (else another type, left as it is)
    ending: Ending = field(default_factory=Ending)  # its payload's custom_id and notify, where they can be read


# KEYS: a queue, its intermediate list; ARGV: how many at most, the job hashes' key prefix. RQ's dequeue move,
# repeated until the queue is empty (a pipeline of that many LMOVEs cost a command each whatever the queue held:
# hundreds a pull, for nothing), and each moved job's hash read in the same call (a pipeline of HGETALLs cost ~15 us
# of the worker's Python a job). Returns the ids and, in the same order, the hashes as flat field-value lists (a key
# of another type: its type, a string; its error aborted the script, and left the jobs moved before it in the
# intermediate list, with it, until RQ's clean-up queued them all again, and again). Not a field of a hash standing
# for the type: a hash written with that field passed for another type, or broke the pull of every job beside it.
# ARGV[3]: the most bytes a hash may take to be read (0: any); past it its size comes back in its place, unread (eight
# hashes written by hand with a 128 MB field each, read whole, held the pull 7 s and took the worker 1.2 GB).
MOVE_SCRIPT = """
local ids, hashes, most = {}, {}, tonumber(ARGV[3])
for _ = 1, tonumber(ARGV[1]) do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  ids[#ids + 1] = id
  local size = most > 0 and redis.pcall('MEMORY', 'USAGE', ARGV[2] .. id, 'SAMPLES', '0') or 0
  if type(size) == 'number' and size > most then
    hashes[#hashes + 1] = size
  else
    local hash = redis.pcall('HGETALL', ARGV[2] .. id)
    if hash.err then hash = redis.call('TYPE', ARGV[2] .. id)['ok'] end
    hashes[#hashes + 1] = hash
  end
end
return {ids, hashes}
"""


def load_script(connection: redis.Redis, source: str):
    """``source`` registered and loaded now: called by its SHA from then on (a pipeline holding a registered script
    would ask SCRIPT EXISTS first, a round trip more at every call)."""
    script = connection.register_script(source)
    connection.script_load(source)
    return script


# An idle worker waits on one lane (the queue itself) this long at a time, and looks at every lane in between: a job
# of another lane waits at most as long; 5 BLMOVEs and 5 scripts a lane a second per idle worker. A worker always
# serves two lanes or more, and its socket timeout counts on this bound (``WorkerSettings.socket_timeout``).
MULTI_LANE_WAIT_S = 0.2


def pull(
    queues: list[Queue],
    limit: int,
    block: float | None,
    connection: redis.Redis,
    job_class: type[Job],
    serializer,
    move_script=None,
    max_data_bytes: int | None = None,
    wait_on: int = 0,
) -> tuple[list[tuple[Job, Queue]], list[Unreadable]]:
    """Up to ``limit`` jobs off ``queues``, blocking ``block`` seconds (``MULTI_LANE_WAIT_S`` at most; None: not at
    all) for the first one only, on ``queues[wait_on]``. Jobs RQ cannot read come back apart, already off the
    queue; Redis errors propagate.
    ``move_script``: the registered ``MOVE_SCRIPT`` (None where Redis runs no Lua: a pipeline of ``limit`` LMOVEs
    then). ``max_data_bytes``: a job with a field RQ inflates (its data, its exc_info) that would inflate past it
    comes back apart too, unread."""
    pulled: list[tuple[Job, Queue]] = []
    unreadable: list[Unreadable] = []
    if block and len(queues) > 1:  # what the lanes hold already comes at once, not after a wait on one of them
        pulled, unreadable = _pull_lanes(queues, limit, connection, job_class, serializer, move_script, max_data_bytes)
        if pulled or unreadable:
            return pulled, unreadable
    if block:  # a blocking wait for the first job; the burst it woke for comes in batches below
        queue = queues[wait_on]
        wait = min(block, MULTI_LANE_WAIT_S)
        try:
            raw_id = _wait_for_one(queue, wait, connection)
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            _say_unusable(queue, exc)
            time.sleep(wait)  # (as a wait that found nothing: the other lanes are looked at in between)
            raw_id = None
        if raw_id is None:
            return pulled, unreadable
        raw = _hash_at(connection, _hash_key(job_class, raw_id), max_data_bytes)
        pulled, unreadable = _restore(queue, [raw_id], [raw], connection, job_class, serializer, max_data_bytes)
        limit -= len(pulled) + len(unreadable)
    got, bad = _pull_lanes(queues, limit, connection, job_class, serializer, move_script, max_data_bytes)
    return pulled + got, unreadable + bad


def _pull_lanes(
    queues: list[Queue],
    limit: int,
    connection: redis.Redis,
    job_class: type[Job],
    serializer,
    move_script=None,
    max_data_bytes: int | None = None,
) -> tuple[list[tuple[Job, Queue]], list[Unreadable]]:
    """Up to ``limit`` jobs, each queue in turn (first-served first), a batch of round trips each, no waiting."""
    pulled: list[tuple[Job, Queue]] = []
    unreadable: list[Unreadable] = []
    for queue in queues:
        room = limit - len(pulled) - len(unreadable)
        if room <= 0:
            break
        try:
            got, bad = _pull_batch(queue, room, connection, job_class, serializer, move_script, max_data_bytes)
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            _say_unusable(queue, exc)  # skipped: its error failed the pull of every lane, the jobs moved from
            continue  # lanes before it left in their intermediate lists until RQ's clean-up, a minute on
        pulled += got
        unreadable += bad
    return pulled, unreadable


_SAID_UNUSABLE: dict[str, float] = {}  # queue key -> when it was last said to hold another type


def _say_unusable(queue: Queue, exc: Exception) -> None:
    """A lane whose list (or intermediate list) holds another type, set by hand: said once a minute, skipped."""
    if time.monotonic() - _SAID_UNUSABLE.get(queue.key, -math.inf) >= 60:
        _SAID_UNUSABLE[queue.key] = time.monotonic()
        log.error("queue %s cannot be read (%s: its list or intermediate list holds another type, set by hand?): "
                  "its jobs wait; the other queues are served", queue.name, exc)  # fmt: skip


def _wait_for_one(queue: Queue, timeout: float, connection: redis.Redis) -> bytes | None:
    """The id of the first job to come into ``queue`` within ``timeout`` seconds, moved to its intermediate list by
    BLMOVE, as RQ's dequeue of one queue does: atomic, so a reply lost or a worker killed leaves it where RQ's
    clean-up finds it (a BLPOP and then the move, as RQ does for several queues, lost it). Redis has no blocking
    move from several lists: a worker of several lanes waits on one ``MULTI_LANE_WAIT_S`` at a time and looks at
    the others in between. As raw bytes: RQ's dequeue raised on an id that is not text and left it where its
    clean-up of the intermediate list raised too, at every pass."""
    return connection.blmove(queue.key, queue.intermediate_queue_key, timeout, "LEFT", "RIGHT")


def _pull_batch(
    queue: Queue,
    limit: int,
    connection: redis.Redis,
    job_class: type[Job],
    serializer,
    move_script=None,
    max_data_bytes: int | None = None,
) -> tuple[list[tuple[Job, Queue]], list[Unreadable]]:
    """What RQ's dequeue does (LMOVE to the intermediate list, then the job's hash), for ``limit`` jobs in one
    script call (without Lua: two round trips) instead of two round trips per job."""
    if move_script is not None:
        prefix = job_class.redis_job_namespace_prefix
        most = 0 if max_data_bytes is None else hash_bytes_read(max_data_bytes)
        moved, flat = move_script(keys=[queue.key, queue.intermediate_queue_key], args=[limit, prefix, most])
        raws = [_moved_hash(got) for got in flat]
    else:
        # One transaction, as the script is one command: a burst landing midway was taken in part (its first jobs
        # met moves already run), and then handed to the engine in slices.
        with connection.pipeline(transaction=True) as pipe:
            for _ in range(limit):
                pipe.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
            moved = [i for i in pipe.execute() if i is not None]
        with connection.pipeline(transaction=False) as pipe:
            for raw_id in moved:
                pipe.hgetall(_hash_key(job_class, raw_id))
            replies = pipe.execute(raise_on_error=False) if moved else []
        raws = [
            _hash_at(connection, _hash_key(job_class, raw_id)) if isinstance(reply, Exception) else reply
            for raw_id, reply in zip(moved, replies)
        ]
    return _restore(queue, moved, raws, connection, job_class, serializer, max_data_bytes)


def hash_bytes_read(max_data_bytes: int) -> int:
    """The most memory a job hash may take in Redis to be read at all: its data, twice over (Redis's own encoding),
    and its other fields, each bounded by ``MAX_OTHER_FIELD`` once read."""
    return 2 * max_data_bytes + 32 * MAX_OTHER_FIELD


def _moved_hash(got: Any) -> dict | OtherType | Oversized:
    """One hash of the move script's reply: its fields, the type its key holds instead, or its size unread."""
    if isinstance(got, list):
        return dict(zip(got[::2], got[1::2]))
    return Oversized(got) if isinstance(got, int) else OtherType.of(got)


def _hash_key(job_class: type[Job], raw_id: bytes) -> bytes:
    """``Job.key_for`` of an id still in bytes (it may not be text)."""
    return job_class.redis_job_namespace_prefix.encode() + raw_id


def _hash_at(connection: redis.Redis, key: bytes, max_data_bytes: int | None = None) -> dict | OtherType | Oversized:
    """The job hash at ``key``, the type its key holds instead, or its size where it is past what a worker reads (as
    the move script reads it)."""
    if max_data_bytes is not None:
        try:
            size = connection.memory_usage(key, samples=0)
        except redis.ResponseError:  # (a Redis that refuses MEMORY: read as before)
            size = None
        if size is not None and size > hash_bytes_read(max_data_bytes):
            return Oversized(size)
    try:
        return connection.hgetall(key)
    except redis.ResponseError as exc:
        if not wrong_type(exc):
            raise
        return OtherType.of(connection.type(key))


def _restore(
    queue: Queue,
    raw_ids: list[bytes],
    raws: list[dict | OtherType],
    connection: redis.Redis,
    job_class: type[Job],
    serializer,
    max_data_bytes: int | None,
) -> tuple[list[tuple[Job, Queue]], list[Unreadable]]:
    """The jobs of ``raw_ids`` (taken off ``queue``), built from their hashes ``raws``; those RQ cannot read apart,
    with the reason."""
    pulled: list[tuple[Job, Queue]] = []
    unreadable: list[Unreadable] = []
    for raw_id, raw in zip(raw_ids, raws):
        try:
            job_id = raw_id.decode()
        except UnicodeDecodeError:
            is_hash = bool(raw) and not isinstance(raw, OtherType)  # (its status set failed too, as any refused)
            shown = raw_id.decode(errors="backslashreplace")
            unreadable.append(Unreadable(shown, queue, NOT_TEXT_ID, raw_id, is_hash=is_hash))
            continue
        if not raw:  # deleted meanwhile: RQ skips it too; said (a job pushed before its HSET, or to another
            # database, went without a word, its follower waiting for good)
            with connection.pipeline() as pipe:
                pipe.lrem(queue.intermediate_queue_key, 1, raw_id)
                pipe.delete(first_seen_key(queue, raw_id))
                pipe.execute()
            log.warning(
                "job %s was in queue %s with no job hash rq:job:<id> (deleted, or pushed before its HSET?): skipped",
                shown_id(job_id), queue.name,
            )  # fmt: skip
            continue
        if isinstance(raw, OtherType):
            reason = f"the job's key rq:job:<id> holds a {raw.kind}, not a hash: write it with HSET (docs/protocol.md)"
            unreadable.append(Unreadable(job_id, queue, reason, is_hash=False))
            continue
        if isinstance(raw, Oversized):
            reason = (
                f"the job hash takes {raw.size} bytes in Redis, more than this worker reads "
                f"({hash_bytes_read(max_data_bytes or 0)}: its --max-job-bytes payload and short fields)"
            )
            unreadable.append(Unreadable(job_id, queue, reason))
            continue
        if not JOB_ID.fullmatch(job_id):  # (match: "$" takes a trailing newline, which RQ's own check refuses)
            unreadable.append(Unreadable(job_id, queue, BAD_ID))
            continue
        # (without status, the start read it as a job deleted meanwhile: canceled, with no word; an empty one, as RQ
        # reads it, ran as queued)
        missing = [name for name in (b"data", b"status") if not (raw.get(name) or raw.get(name.decode()))]
        if missing:
            reason = f"the job hash has no {missing[0].decode()!r} field (or an empty one): write it with the job"
            unreadable.append(Unreadable(job_id, queue, reason))
            continue
        swollen = [name for name in _INFLATED if _inflates_past(raw.get(name), max_data_bytes)]
        if swollen:
            reason = (
                f"the job's field {swollen[0].decode()!r} is over {max_data_bytes} bytes once inflated; "
                "this worker takes at most that"
            )
            unreadable.append(Unreadable(job_id, queue, reason))
            continue
        # The other fields RQ parses (meta, webhooks, dependency ids ...) are kept in memory while the job runs: 30 MB
        # of nested JSON there took 700 MB. RQ's own are short; a job's own data goes in its payload.
        oversize = [k for k, v in raw.items() if k not in _INFLATED and len(v) > MAX_OTHER_FIELD]
        if oversize:
            name = oversize[0].decode(errors="backslashreplace") if isinstance(oversize[0], bytes) else oversize[0]
            reason = f"the job's field {name!r} is over {MAX_OTHER_FIELD} bytes; this worker takes at most that"
            unreadable.append(Unreadable(job_id, queue, reason))
            continue
        try:
            job = job_class(job_id, connection=connection, serializer=serializer)
            job.restore(raw)
        except Exception as exc:  # a field RQ cannot parse, an id it refuses
            unreadable.append(Unreadable(job_id, queue, diagnose(raw, job_id, exc)))
            continue
        beyond = out_of_bounds(job)
        if beyond:  # RQ reads it, and then fails on it (its retry, its expiry): not built into a running job
            unreadable.append(Unreadable(job_id, queue, beyond))
            continue
        pulled.append((job, queue))
    raw_of = dict(zip(raw_ids, raws)) if unreadable else {}
    for item in unreadable:  # (ends as it asks, as a refused job RQ could read does: its list waited for good)
        raw = raw_of.get(item.job_id.encode()) if item.raw_id is None else None
        if isinstance(raw, Oversized):  # its data alone, where that is within bounds (its list waits for its end)
            raw = _data_alone(connection, Job.key_for(item.job_id), max_data_bytes)
        if isinstance(raw, dict):
            item.ending = _ending_of_hash(raw, max_data_bytes)
    return pulled, unreadable


def _data_alone(connection: redis.Redis, key: str, max_data_bytes: int | None) -> dict | None:
    """The ``data`` field of a hash too large to read whole, where it is no larger than ``max_data_bytes``."""
    if max_data_bytes is None or connection.hstrlen(key, "data") > max_data_bytes:
        return None
    return {b"data": connection.hget(key, "data")}


def _ending_of_hash(raw: dict, max_data_bytes: int | None) -> Ending:
    """``ending_of`` the payload in a hash RQ could not read, where its data can be read at all (within the size
    bound; stored compressed or not); none otherwise."""
    data = raw.get(b"data", raw.get("data"))
    if not data or _inflates_past(data, max_data_bytes):
        return Ending()
    try:
        with contextlib.suppress(zlib.error):  # (else stored as it is)
            data = zlib.decompress(data)
        decoded = json.loads(data)
        return ending_of(decoded[3] if isinstance(decoded, list) and len(decoded) > 3 else None)
    except Exception:  # (not JSON, nested past the parser: it has no ending to read)
        return Ending()


def out_of_bounds(job: Job) -> str | None:
    """Why RQ's own handling of this job would fail (a time past what Redis or a date can hold, retry intervals that
    are not a list of seconds), or None. RQ's enqueue takes ``result_ttl=10**17``; its retry of a job whose
    interval overflows raised and left the job started for good, and every clean-up of its registry raised too.
    An allowed callback's time limit is the job's to set, within ``MAX_CALLBACK_S``: 0 or -1 set none (RQ's timer
    then sets no timer), and a callback that hung held up every job's events on the thread it runs on."""
    for kind in ("success", "failure", "stopped"):
        value = getattr(job, f"_{kind}_callback_timeout", None)
        if getattr(job, f"_{kind}_callback_name", None) and value is not None and not 1 <= value <= MAX_CALLBACK_S:
            name = f"{kind}_callback_timeout"
            return f"this job's field {name!r} holds {value!r}; a callback's time limit is 1 to {MAX_CALLBACK_S} s"
    for hook in getattr(job, "webhooks", None) or ():  # (RQ takes any positive time: one of 10**5 s held the exit)
        if not 1 <= hook.timeout <= MAX_CALLBACK_S:
            return f"this job's webhook to {hook.url!r} has a timeout of {hook.timeout!r}; 1 to {MAX_CALLBACK_S} s"
    for name in _SECONDS:
        value = getattr(job, name, None)
        if value is not None and not (isinstance(value, int) and -1 <= value <= MAX_SECONDS):
            return f"RQ cannot use this job: its field {name!r} holds {value!r}; seconds are -1 or 0 to {MAX_SECONDS}"
    for name in _INTERVALS:
        value = getattr(job, name, None)
        if value is None:
            continue
        # An empty list of retry intervals RQ indexes at a retry (a repeat's, RQ reads as no interval)
        empty_retry = not value and name == "retry_intervals" and (job.retries_left or 0) > 0
        if not isinstance(value, list) or empty_retry or not all(_seconds(x) for x in value):
            shown = json.dumps(value)[:60]
            return f"RQ cannot use this job: its field {name!r} holds {shown}; a list of seconds, 0 to {MAX_SECONDS}"
    # RQ's retry writes the job again, and fails on these (a meta it reads with .get, dependency ids it indexes):
    # the job stayed started, and every clean-up of its queue's registry raised on it.
    if not isinstance(job.meta, dict):
        return f"RQ cannot use this job: its field 'meta' holds {json.dumps(job.meta)[:60]}; a JSON object"
    if json_depth(job.meta) > MAX_JSON_DEPTH:  # (RQ's write of it, deeper in the stack, recursed past Python's limit)
        return f"RQ cannot use this job: its field 'meta' nests deeper than {MAX_JSON_DEPTH} levels"
    for name in _DATES:  # (RQ writes a year before 1000 in three digits, and cannot read it back)
        stamp = getattr(job, name, None)
        if stamp is not None and not 1000 <= stamp.year <= 9999:
            return f"RQ cannot use this job: its field {name!r} holds the year {stamp.year}; 1000 to 9999"
    dependencies = job._dependency_ids
    if not isinstance(dependencies, list) or not all(isinstance(x, str) for x in dependencies):
        shown = json.dumps(dependencies)[:60]
        return f"RQ cannot use this job: its field 'dependency_ids' holds {shown}; a list of job ids"
    return None


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_SECONDS


def _inflates_past(data: bytes | None, limit: int | None) -> bool:
    """Whether a field RQ's restore inflates is over ``limit`` bytes once inflated, found by inflating no more than
    ``limit`` + 1 of them: a 200 KB hash held 200 MB of prompt, and a pull of 256 such jobs, 51 GB."""
    if not data or limit is None:
        return False
    try:
        return len(zlib.decompressobj().decompress(data, limit + 1)) > limit
    except zlib.error:  # stored as it is: RQ reads it so
        return len(data) > limit


def diagnose(raw: dict, job_id: str, exc: Exception) -> str:
    """Which field of the hash (``raw``, as HGETALL gives it) RQ could not read, in words (RQ's own errors rarely
    name it)."""
    if not JOB_ID.fullmatch(job_id):
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
                shown = json.dumps(fields[name][:60].decode("utf-8", "backslashreplace"))  # (not Python's b'...')
                return f"RQ cannot read this job: its field {name!r} holds {shown}"
    for name, value in fields.items():
        if name != "data":
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return f"RQ cannot read this job: its field {name!r} is not UTF-8 text"
    return f"RQ cannot read this job: {type(exc).__name__}: {exc}"


def first_seen_key(queue: Queue, job_id: str | bytes) -> bytes:
    """RQ's mark of when a job id was first seen stranded in the queue's intermediate list (any id, text or not)."""
    raw = job_id if isinstance(job_id, bytes) else job_id.encode()
    return queue.intermediate_queue.get_first_seen_key("").encode() + raw


def quarantine(pipe: redis.client.Pipeline, item: Unreadable, ttl: int) -> None:
    """Off the queue lists, status failed where the hash exists, and into ``roseinfer:rejected:<queue>`` (a sorted
    set by time, each kept ``ttl``) where an operator finds it; RQ's own registries never hold it, so its
    maintenance cannot trip."""
    queue, job_id = item.queue, item.raw_id or item.job_id
    pipe.lrem(queue.intermediate_queue_key, 0, job_id)
    pipe.delete(first_seen_key(queue, job_id))  # (else it outlived the job by RQ's day)
    pipe.lrem(queue.key, 0, job_id)
    if item.is_hash:  # RQ found it and could not read it (an id not text: by its bytes; it stayed queued for good)
        key = Job.key_for(job_id) if item.raw_id is None else Job.redis_job_namespace_prefix.encode() + item.raw_id
        pipe.hset(key, "status", "failed")
        pipe.expire(key, ttl)  # with its result (it was kept for good)
    rejected = rejected_key(queue.name)
    added = time.time()
    pipe.zremrangebyscore(rejected, "-inf", added - ttl)  # (the set's TTL, renewed at each add, never dropped one)
    pipe.zadd(rejected, {job_id: added})
    pipe.expire(rejected, ttl)


@dataclass(frozen=True)
class HookPolicy:
    """What a job may name to be run or called: exact callback names, webhook hosts. Empty: nothing."""

    callbacks: frozenset[str] = frozenset()
    webhook_hosts: frozenset[str] = frozenset()

    def job_class(self) -> type[PulledJob]:
        """``PulledJob`` under this policy: the worker's job class, so every job it or RQ's maintenance reads is
        stripped of what the policy refuses."""
        return type("PolicedJob", (PulledJob,), {"hook_policy": self})

    def refuse(self, job: Job) -> str | None:
        """Why this job may not run here, or None. Whatever is refused is also taken off the job, so RQ's
        failure path cannot call it either."""
        refused = getattr(job, "refused_hooks", None)  # taken off as the job was read (``PulledJob.restore``)
        problems = refused if refused is not None else self.strip(job)
        if not problems:
            return None
        return (
            f"this worker runs no code and calls no address that a job names; refused: {', '.join(problems)} "
            "(an operator allows exact names with --allow-callback module.function and hosts with --allow-webhook-host)"
        )

    def strip(self, job: Job) -> list[str]:
        """Takes off ``job`` the callbacks and webhooks it may not name here (kept in ``named_hooks``, the fields
        its hash keeps: only this process's object loses them); what it took, in words."""
        problems = []
        named: dict[str, str] = {}
        for kind in ("success", "failure", "stopped"):
            name = getattr(job, f"_{kind}_callback_name", None)
            if name and name not in self.callbacks:
                problems.append(f"{kind} callback {name!r}")
                named[f"{kind}_callback_name"] = name
                setattr(job, f"_{kind}_callback_name", None)
                setattr(job, f"_{kind}_callback", None)
        hooks = getattr(job, "webhooks", None) or []
        kept = []
        for hook in hooks:
            if not self._allows(str(hook.url)):
                problems.append(f"webhook to {hook.url!r}")
            elif set_too := sorted(str(h) for h in (hook.headers or {}) if str(h).lower() in _HEADERS_NOT_A_JOBS):
                problems.append(f"webhook to {hook.url!r} setting {', '.join(set_too)}")  # (Host: another site)
            else:
                kept.append(hook)
        if len(kept) < len(hooks):
            named["webhooks"] = json.dumps([hook.to_dict() for hook in hooks])
        job.webhooks = kept
        job.named_hooks = named
        return problems

    def _allows(self, url: str) -> bool:
        """Whether ``url``'s host and port are allowed: a host alone allows its scheme's own port (80, 443) only, as a
        job could otherwise reach any service on that machine."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port
        except ValueError:  # (a port past 65535, or not a number)
            return False
        default = {"http": 80, "https": 443}.get(parts.scheme)
        if default is None:  # (RQ sends http and https alone)
            return False
        allowed = webhook_target(host, port or default) in self.webhook_hosts
        return allowed or (port in (None, default) and host in self.webhook_hosts)
