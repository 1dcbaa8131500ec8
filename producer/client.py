"""The producer side: ``Client`` submits jobs (one or many in a round trip) and reads the queue's state; each job's
handle, to stream its tokens and wait for its result, is a ``GenerationJob`` (``generation_job.py``). Needs no torch."""

from __future__ import annotations

import json
import shlex
import time
import uuid
import warnings
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis import Redis
from redis.exceptions import WatchError
from rq import Queue, Retry, worker_registration
from rq.job import Job, validate_job_id
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat
from rq.worker import Worker

from producer.connection import REDIS_DOWN, connect, redacted_url
from producer.generation_job import DEFAULT_RESULT_TTL, ENDED, GenerationJob
from producer.job_errors import InvalidRequest, JobIdTaken
from producer.protocol import (
    DEFAULT_QUEUE,
    JOB_FUNCTION,
    OWNER_FIELD,
    START_FIELD,
    STATS_KEY,
    check_queue_name,
    lane_name,
    lanes,
    rejected_key,
    result_key,
    stream_key,
)
from producer.schema import MODEL_RECOMMENDED, JobRequest, describe_validation_error

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_OVER = tuple(status.encode() for status in ("finished", *ENDED))  # a job's statuses once it has ended


MAX_JOB_ID = 256  # the protocol's (the worker refuses a longer one)
DEFAULT_JOB_TIMEOUT = 3600  # a job's run time, each attempt's, the worker enforces


@dataclass
class EndedJob:
    """What is left of an ended job whose id is used again: its lane, its hash's fields."""

    id: str
    origin: str | None  # None: the hash is gone
    fields: list[bytes]


def check_job_id(job_id: Any) -> None:
    """RQ's rule for a job id (text of letters, digits, ``-`` and ``_``) and the protocol's length, as an
    ``InvalidRequest``."""
    try:
        validate_job_id(job_id)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(str(exc)) from None
    if len(job_id) > MAX_JOB_ID:
        raise InvalidRequest(f"a job id is at most {MAX_JOB_ID} characters, got {len(job_id)}")


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
        job_timeout: int = DEFAULT_JOB_TIMEOUT,
        result_ttl: int = DEFAULT_RESULT_TTL,
        failure_ttl: int | None = None,
    ) -> None:
        # Whole seconds, checked here in their own words: 1.5 went into the job hash as 1, "x" failed in RQ at submit.
        _whole("retries", retries, 0, "a count of retries, 0 or more")
        _whole("job_timeout", job_timeout, 1, "seconds, at least 1 (-1: no limit)", -1)
        _whole("result_ttl", result_ttl, 0, "seconds, 0 or more (0: not kept, -1: for good)", -1)
        if failure_ttl is not None:
            _whole("failure_ttl", failure_ttl, 1, "seconds, at least 1 (None: RQ's year)")
        check_queue_name(queue)  # (one no worker serves: its jobs waited for good)
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
        self._url = None if connection is not None else redis_url  # (what a hint to start a worker names)

    @property
    def queue_name(self) -> str:
        return self.queue.name

    def __repr__(self) -> str:
        return f"Client({self._shown_url()!r}, queue={self.queue_name!r})"

    def _shown_url(self) -> str:
        """Its Redis's URL, the password hidden; a connection passed in by its host, port and database."""
        if self._url is not None:
            return redacted_url(self._url)
        kw = self.connection.get_connection_kwargs()
        return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"

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
                pipe.hmget(Job.key_for(job_id), "status", "origin", OWNER_FIELD)
                pipe.hkeys(Job.key_for(job_id))
            replies = pipe.execute()
        looks = [(job_id, *look) for job_id, look in zip(job_ids, replies[::2])]
        taken = [(job_id, status.decode(errors="replace")[:40]) for job_id, status, _, _ in looks
                 if status not in (None, *_OVER)]  # fmt: skip
        stopping = self._still_running(looks)
        taken += [(job_id, "canceled, its run still stopping") for job_id in stopping]
        if taken:
            raise JobIdTaken([job_id for job_id, _ in taken], taken[0][1], stopping)
        return [
            EndedJob(job_id, origin.decode() if origin else None, fields)
            for (job_id, _, origin, _), fields in zip(looks, replies[1::2])
        ]

    def _still_running(self, looks: list[tuple[str, Any, Any, Any]]) -> list[str]:
        """The ids of canceled (or stopped) jobs whose run still holds its started entry (kept by the cancel until
        its worker ends the run, within a step): a new job of the id was taken for the running copy by that
        worker, which ran the old request on, and streamed its tokens to the new job's followers."""
        stopping = [(job_id, origin, owner) for job_id, status, origin, owner in looks
                    if status in (b"canceled", b"stopped") and origin and owner]  # fmt: skip
        if not stopping:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id, origin, owner in stopping:
                started = StartedJobRegistry(origin.decode(errors="replace"), connection=self.connection).key
                pipe.zscore(started, f"{job_id}:{owner.decode(errors='replace')}")
            scores = pipe.execute()
        return [job_id for (job_id, _, _), score in zip(stopping, scores) if score is not None]

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
            if not isinstance(fields, Mapping):  # (a list of prompts, as vLLM's generate takes: dict()'s riddle)
                raise InvalidRequest(f"request {i}: a payload dict, as {{'prompt': ...}}, got {type(fields).__name__}")
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
                except REDIS_DOWN as exc:  # (a reply lost in a stall: its transaction may have run all the same)
                    exc.maybe_enqueued = [job_id for job_id, _, _ in hashes]  # type: ignore[attr-defined]
                    raise
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
        found = lanes(self.connection, self.queue.name)
        queues = [self.lane(p) for p, _name in found]
        kinds = ("started_job_registry", "finished_job_registry", "failed_job_registry", "canceled_job_registry")
        # Entries not yet expired, counted without RQ's cleanup (``registry.count`` runs it): that fails a dead
        # worker's jobs here, through RQ's plain Job, running the failure callbacks the workers refuse.
        now = time.time()
        with self.connection.pipeline(transaction=False) as pipe:
            for q in queues:
                for kind in kinds:
                    pipe.zcount(getattr(q, kind).key, now, "+inf")
            for q in queues:  # started, their worker's heartbeat lapsed: a dead worker's, until a live one's
                pipe.zcount(q.started_job_registry.key, "-inf", f"({now}")  # maintenance takes them back
            for q in queues:  # put aside unread (a hash RQ cannot read), each failed with its reason
                pipe.zcard(rejected_key(q.name))
            for q in queues:  # (in the same round trip: a job moving from a queue to a registry counts once)
                pipe.llen(q.key)
            counts = pipe.execute()
        per_kind = [sum(counts[i : len(kinds) * len(queues) : len(kinds)]) for i in range(len(kinds))]
        stalled = sum(counts[len(kinds) * len(queues) : (len(kinds) + 1) * len(queues)])
        rejected = sum(counts[(len(kinds) + 1) * len(queues) : (len(kinds) + 2) * len(queues)])
        depths = {str(p): depth for (p, _name), depth in zip(found, counts[(len(kinds) + 2) * len(queues) :])}
        return {
            "queue": self.queue.name,
            "queued": sum(depths.values()),
            "lanes": depths,  # queued, per priority
            "in_flight": per_kind[0],
            "finished": per_kind[1],
            "failed": per_kind[2],
            "canceled": per_kind[3],
            # (both were counted nowhere: a dead worker's jobs read as none in flight, with no worker left)
            "stalled": stalled,
            "rejected": rejected,
            "workers": rows,
            "tokens_per_s": float(sum(r["tokens_per_s"] for r in rows)),  # (0.0, not 0, with no worker)
            "redis": self._memory_state(),
        }

    def _memory_state(self) -> str:
        """``full: ...`` where Redis takes no writes for want of memory, ``read-only: ...`` where it is a replica
        (the workers' own word on it is a write Redis refuses then: it said "ok", and listed no worker), ``ok``
        otherwise, or where INFO is not this user's to read."""
        try:
            info = self.connection.info("memory")
            role = self.connection.info("replication")
        except REDIS_DOWN:
            raise
        except Exception:
            return "ok"
        if role.get("role") == "slave" and role.get("slave_read_only", 1):
            primary = f"{role.get('master_host')}:{role.get('master_port')}"
            return f"read-only: a replica of {primary} (its link {role.get('master_link_status')}); writes are refused"
        used, most = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        if most and used >= most and info.get("maxmemory_policy") == "noeviction":
            return f"full: {used} bytes used of maxmemory {most}; writes are refused until it has room"
        return "ok"

    def workers(self, queue: str | None = None) -> list[dict[str, Any]]:
        """The live workers of the queue (or of ``queue``): name, state, model, jobs in flight, tokens/s, Redis
        health."""
        workers = self._registered(self.queue.name if queue is None else queue)
        with self.connection.pipeline(transaction=False) as pipe:
            for name, _state, _ours in workers:
                pipe.hgetall(STATS_KEY.format(worker=name))
            stats = pipe.execute()
        rows = []
        for (name, state, _ours), st in zip(workers, stats):
            if not st:  # its statistics lapse with its heartbeat: a dead worker (SIGKILL, OOM) is not listed
                continue
            st = {k.decode(): v.decode() for k, v in st.items()}
            rows.append(
                {
                    "name": name,
                    "state": state,
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

    def _stock_workers(self, queue: str) -> list[str]:
        """The names of stock ``rq worker``s registered on ``queue`` (RQ's registration, without a roseinfer
        worker's start token: ``START_FIELD``)."""
        return [name for name, _state, ours in self._registered(queue) if not ours]

    def _registered(self, queue: str) -> list[tuple[str, str, bool]]:
        """(name, state, whether a roseinfer worker's) of each worker RQ lists on ``queue``, read from its hash:
        RQ's Worker objects (``Worker.all``) raise their connection's socket timeout to a worker's 415 s, and this
        client's commands (a worker's own, where it looked) then waited minutes on a Redis that stopped answering."""
        keys = sorted(worker_registration.get_keys(Queue(queue, connection=self.connection), self.connection))
        with self.connection.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
                pipe.hmget(key, "state", START_FIELD)
            replies = pipe.execute()
        prefix = Worker.redis_worker_namespace_prefix
        return [
            (key.removeprefix(prefix), state.decode() if state else "?", start is not None)
            for key, exists, (state, start) in zip(keys, replies[::2], replies[1::2])
            if exists  # (its hash gone: RQ's own listing leaves it out too)
        ]

    def no_worker_warning(self, queue: str | None = None) -> str | None:
        """A warning when no live worker serves the queue (or ``queue``: its jobs wait there), else None."""
        if self.workers() if queue is None else self.workers(queue):
            return None
        name = self.queue.name if queue is None else queue
        if self._stock_workers(name):  # (RQ's own worker runs them too, one at a time: no roseinfer statistics)
            return None
        # (a worker started by the hint without the client's Redis would serve the default one)
        named = self._url not in (None, DEFAULT_REDIS_URL)
        url = f" --redis-url {shlex.quote(redacted_url(self._url))}" if named else ""
        return (
            f"warning: no live worker serves queue {name!r} (yet): its jobs wait there until one starts "
            f"(roseinfer worker{url} --queue {shlex.quote(name)}; roseinfer status lists the workers)"
        )

    def _payload(self, req: JobRequest) -> dict[str, Any]:
        payload = req.model_dump(exclude_defaults=True, by_alias=True)
        # A setting the model may recommend, given at its default value, stays: the worker fills a field the payload
        # leaves out with the model's recommendation (temperature=1.0 ran at the model's 0.7, top_k=0 at its 20).
        for name in MODEL_RECOMMENDED & req.model_fields_set:
            if name not in payload and getattr(req, name) is not None:
                payload[name] = getattr(req, name)
        return payload

    def _job_options(self, req: JobRequest) -> dict[str, Any]:
        if req.prompt_token_ids is not None:
            text = f"<{len(req.prompt_token_ids)} token ids>"
        else:
            text = req.prompt if req.prompt is not None else req.messages[-1].text  # type: ignore[index]
        return {
            "timeout": self.job_timeout,
            "result_ttl": self.result_ttl,
            "failure_ttl": self.failure_ttl,
            "retry": Retry(max=self.retries) if self.retries else None,
            "description": f"generate: {text[:60]!r}" + (f" [{req.custom_id}]" if req.custom_id else ""),
        }
