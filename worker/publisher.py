"""Token events out to Redis: what each job has streamed, its next events, and where they are written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.client import Pipeline

from producer.protocol import STREAM_FIELD, channel_key, event_from_stream, make_event, result_key, stream_key


@dataclass
class JobStream:
    """What one job has put on its channel and stream, and what waits to go out. A retried job regenerates from
    the start (with the same seed, so the same tokens); what an earlier attempt already streamed is not sent
    again."""

    job_id: str
    next_n: int = 0
    resume_chars: int = 0
    resume_tokens: int = 0
    chars: int = 0
    tokens: int = 0
    ended: bool = False  # a final event is in the stream (an earlier attempt may have written it)
    # Not sent yet: text and token ids since the last event, and the final event's fields once the job ended.
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_end: tuple[str, dict[str, int] | None, str | None] | None = None

    def new_part(self, text: str, token_ids: list[int]) -> tuple[str, list[int]]:
        skip_chars = max(0, self.resume_chars - self.chars)
        skip_tokens = max(0, self.resume_tokens - self.tokens)
        self.chars += len(text)
        self.tokens += len(token_ids)
        return text[skip_chars:], token_ids[skip_tokens:]


Event = tuple[str, dict[str, Any], int]  # (job id, event, the stream's TTL to set with it in seconds, 0: none)


class Publisher:
    """Collects each job's new text as the steps produce it and turns it into events when asked (``take``): all a
    job produced since its last event becomes one event, so a fast engine's steps share writes. Nothing is lost
    when Redis is unreachable: events taken are kept by whoever sends them until Redis accepts them."""

    def __init__(self, maxlen: int, stream_ttl: int, result_ttl: int, stream_ttl_after_end: int | None = None) -> None:
        self.maxlen = maxlen
        self.stream_ttl = stream_ttl
        # A finished job's stream is for late followers only: it goes soon; the result keeps its own TTL.
        self.stream_ttl_after_end = min(stream_ttl, stream_ttl_after_end or stream_ttl)
        self.result_ttl = result_ttl
        self._dirty: dict[str, JobStream] = {}  # jobs with something pending, in the order they got it
        self.urgent = False  # something waits that should not: a job's first piece (its TTFT) or its end

    def resume(self, conn: Redis, job_ids: list[str]) -> dict[str, JobStream]:
        """Stream state per job: fresh for new jobs, where the last attempt stopped for retried ones."""
        with conn.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(stream_key(job_id), count=1)
            lasts = pipe.execute()
        streams = {}
        for job_id, last in zip(job_ids, lasts):
            s = JobStream(job_id)
            if last:
                events = [event_from_stream(fields) for _id, fields in conn.xrange(stream_key(job_id))]
                s.next_n = event_from_stream(last[0][1])["n"] + 1
                s.resume_chars = sum(len(e["text"]) for e in events)
                s.resume_tokens = sum(len(e["token_ids"]) for e in events)
                s.ended = any("finish_reason" in e for e in events)
            streams[job_id] = s
        return streams

    def add(
        self,
        s: JobStream,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
        error: str | None = None,
    ) -> None:
        text, token_ids = s.new_part(text, token_ids)
        if s.ended or (finish_reason is None and not text and not token_ids):
            return
        if text:
            s.pending_text.append(text)
        s.pending_ids += token_ids
        if finish_reason is not None:
            s.pending_end = (finish_reason, usage, error)
        self.urgent = self.urgent or s.next_n == 0 or finish_reason is not None
        self._dirty[s.job_id] = s

    def take(self) -> tuple[list[Event], list[Event]]:
        """One event per job with something pending, as (job id, event, stream TTL to set): (running jobs'
        events, final events). Final events go out after their job's result and status."""
        events: list[Event] = []
        finals: list[Event] = []
        for s in self._dirty.values():
            end = s.pending_end or (None, None, None)
            event = make_event(s.next_n, "".join(s.pending_text), s.pending_ids, *end)
            ttl = self.stream_ttl_after_end if end[0] is not None else self.stream_ttl if s.next_n == 0 else 0
            (finals if end[0] is not None else events).append((s.job_id, event, ttl))
            s.next_n += 1
            s.ended = end[0] is not None
            s.pending_text, s.pending_ids, s.pending_end = [], [], None
        self._dirty = {}
        self.urgent = False
        return events, finals

    def queue_writes(self, pipe: Pipeline, events: list[Event]) -> None:
        """Queue the writes of ``events`` on ``pipe``: each to its job's stream and channel."""
        for job_id, event, ttl in events:
            key, message = stream_key(job_id), json.dumps(event)
            pipe.xadd(key, {STREAM_FIELD: message}, maxlen=self.maxlen, approximate=True)
            pipe.publish(channel_key(job_id), message)
            if ttl:
                pipe.expire(key, ttl)

    @staticmethod
    def script_args(events: list[Event]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the sender's event script: the same writes as ``queue_writes``, as one command."""
        keys, args = [], []
        for job_id, event, ttl in events:
            keys.append(stream_key(job_id))
            args += [ttl, channel_key(job_id), json.dumps(event)]
        return keys, args

    def flush(self, pipe: Pipeline) -> None:
        """Take what is pending and queue its writes on ``pipe`` (final events last); the caller executes it."""
        events, finals = self.take()
        self.queue_writes(pipe, events + finals)

    def write_result(self, pipe: Pipeline | Redis, job_id: str, result: dict[str, Any]) -> None:
        pipe.set(result_key(job_id), json.dumps(result), ex=self.result_ttl)
