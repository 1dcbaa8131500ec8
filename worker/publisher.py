"""Token events out to Redis: one pipelined round trip per engine step for every job in flight."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline

from producer.protocol import channel_key, event_from_stream, make_event, result_key, stream_fields, stream_key


@dataclass
class JobStream:
    """What one job has put on its channel and stream. A retried job regenerates from the start (with the
    same seed, so the same tokens); what an earlier attempt already streamed is not sent again."""

    job_id: str
    next_n: int = 0
    resume_chars: int = 0
    resume_tokens: int = 0
    chars: int = 0
    tokens: int = 0
    ended: bool = False  # a final event is in the stream (an earlier attempt may have written it)

    def new_part(self, text: str, token_ids: list[int]) -> tuple[str, list[int]]:
        skip_chars = max(0, self.resume_chars - self.chars)
        skip_tokens = max(0, self.resume_tokens - self.tokens)
        self.chars += len(text)
        self.tokens += len(token_ids)
        return text[skip_chars:], token_ids[skip_tokens:]


class Publisher:
    def __init__(self, maxlen: int, stream_ttl: int, result_ttl: int) -> None:
        self.maxlen = maxlen
        self.stream_ttl = stream_ttl
        self.result_ttl = result_ttl
        # Events of the current step, written by flush(); kept when Redis is unreachable so none is lost.
        self.outbox: list[tuple[str, dict[str, Any], bool]] = []

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
        if finish_reason is None and not text and not token_ids:
            return
        if s.ended:
            return
        event = make_event(s.next_n, text, token_ids, finish_reason, usage, error)
        self.outbox.append((s.job_id, event, s.next_n == 0 or finish_reason is not None))
        s.next_n += 1
        s.ended = finish_reason is not None

    def flush(self, pipe: Pipeline) -> None:
        """Queue the outbox's writes on ``pipe``; the caller executes it, then calls ``sent()``."""
        for job_id, event, set_ttl in self.outbox:
            key = stream_key(job_id)
            pipe.xadd(key, stream_fields(event), maxlen=self.maxlen, approximate=True)
            pipe.publish(channel_key(job_id), json.dumps(event))
            if set_ttl:
                pipe.expire(key, self.stream_ttl)

    def sent(self) -> None:
        self.outbox.clear()

    def write_result(self, pipe: Pipeline | Redis, job_id: str, result: dict[str, Any]) -> None:
        pipe.set(result_key(job_id), json.dumps(result), ex=self.result_ttl)
