"""Token events out to Redis: what each job has streamed, its next events, and where they are written."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from producer.connection import wrong_type
from producer.protocol import (
    STREAM_FIELD,
    STREAM_TTL_AFTER_END_S,
    channel_key,
    done_key,
    event_from_stream,
    make_event,
    result_key,
    stream_key,
    streamed_output,
    usage_of,
)
from producer.wire import StreamEvent, read_check

log = logging.getLogger("roseinfer.worker")


@dataclass
class JobStream:
    """What one job has put on its channel and stream, and what waits to go out. A retried job resumes from what
    its earlier attempts streamed (``resume_ids``): the engine takes those tokens as the start of its output and
    only the rest is generated, so the stream and the result agree whatever the precision or the hardware."""

    job_id: str
    owner: str = ""  # the attempt writing it (the job hash's roseinfer_owner must hold this); "": no check
    next_n: int = 0
    ended: bool = False  # a final event is in the stream (an earlier attempt may have written it)
    # What the stream holds since its start (or its last reset): the output an attempt can resume from.
    resume_ids: list[int] = field(default_factory=list)
    resume_text: str = ""
    resume_logprobs: list[dict[int, float]] | None = None  # theirs, when every event since carried them
    # Per sample, the text and token ids the stream holds since (``streamed_output``): a job canceled before its
    # next attempt keeps them as its partial output; and the prompt's length where an event said it.
    resume_output: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    resume_prompt_tokens: int = 0
    # The stream cannot serve as a prefix (trimmed, or with a final event): a retry starts over, after a reset.
    whole: bool = True
    # Not sent yet: per sample (0 unless the job has n > 1) the text pieces and token ids since its last event, and
    # the final event's fields once the job ended.
    # sample index -> its texts, token ids and their logprobs (a job that asked for them) not sent yet
    pending: dict[int, tuple[list[str], list[int], list[dict[int, float]]]] = field(default_factory=dict)
    pending_end: tuple[str, dict[str, int] | None, str | None, str | None, str | None, int | str | None] | None = None
    pending_reset: bool = False
    # sample index -> its own finish reason: a sample of n > 1 that ended while the others go on
    pending_sample_ends: dict[int, tuple[str, int | str | None]] = field(default_factory=dict)
    # This attempt set the stream's TTL (with its first event): an earlier attempt's end left minutes of it.
    ttl_renewed: bool = False
    # A job asking for the usage on every event (stream_options.continuous_usage_stats): the prompt's length once the
    # engine said it, and the tokens the output holds up to the events taken (a resumed attempt's prefix included).
    usage_each_event: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int = 0

    def read(self, events: list[dict[str, Any]]) -> None:
        """Take in what an earlier attempt left in the stream."""
        if not events:
            return
        self.next_n = events[-1]["n"] + 1
        self.ended = "finish_reason" in events[-1]
        resets = [i for i, e in enumerate(events) if e.get("reset")]
        since = events[resets[-1] :] if resets else events
        # Numbered one after another: a repeated or missing event (a write tried twice, an entry lost) would make
        # the resumed output wrong, so the job starts over instead.
        in_order = all(b["n"] == a["n"] + 1 for a, b in itertools.pairwise(since))
        self.whole = (bool(resets) or events[0]["n"] == 0) and in_order and not self.ended
        self.resume_ids = [t for e in since for t in e["token_ids"]]
        self.completion_tokens = len(self.resume_ids)
        self.resume_text = "".join(e["text"] for e in since)
        steps = [step for e in since for step in e.get("logprobs") or ()]
        aligned = len(steps) == len(self.resume_ids)
        self.resume_logprobs = [{int(t): lp for t, lp in step} for step in steps] if aligned else None
        self.resume_output = (streamed_output(since) or {}) if self.whole else {}
        said = [e["usage"].get("prompt_tokens", 0) for e in since if e.get("usage")]
        self.resume_prompt_tokens = said[-1] if said else 0

    def start(self, can_resume: bool, with_logprobs: bool = False) -> list[int]:
        """Plan this attempt: the output it resumes from (its stream is whole, the job allows it, and it holds the
        logprobs ``with_logprobs`` asks for: ``resume_logprobs``), or [] and a reset first when something streamed
        before is void (a follower then drops what it has). A stream that expired has nothing to resume: it starts
        again at event 0, which tells a follower as much."""
        if can_resume and self.whole and self.resume_ids and (not with_logprobs or self.resume_logprobs is not None):
            return self.resume_ids
        if self.next_n:
            self.restart()
        return []

    def restart(self) -> None:
        """The job starts over: its next event tells followers to drop what they have."""
        self.pending_reset, self.ended = True, False
        self.resume_ids, self.resume_text, self.resume_logprobs, self.resume_output = [], "", None, {}
        self.completion_tokens = 0


# (job id, event, the stream's TTL to set with it in seconds (0: none), the attempt that must own the job ("": any))
Event = tuple[str, dict[str, Any], int, str]


class Publisher:
    """Collects each job's new text as the steps produce it and turns it into events when asked (``take``): all a
    job produced since its last event becomes one event, so a fast engine's steps share writes. Nothing is lost
    when Redis is unreachable: events taken are kept by whoever sends them until Redis accepts them."""

    def __init__(self, maxlen: int, stream_ttl: int, result_ttl: int, stream_ttl_after_end: int | None = None) -> None:
        self.maxlen = maxlen
        self.stream_ttl = stream_ttl
        # A finished job's stream is for late followers only: it goes soon; the result keeps its own TTL. One given
        # is kept as given, even past stream_ttl (it was cut to it without a word); the default is cut to it.
        self.stream_ttl_after_end = stream_ttl_after_end or min(STREAM_TTL_AFTER_END_S, stream_ttl)
        self.result_ttl = result_ttl
        self._dirty: dict[str, JobStream] = {}  # jobs with something pending, in the order they got it
        self._urgent: dict[str, JobStream] = {}  # those whose pending should not wait: a first piece (TTFT), an end

    @classmethod
    def from_settings(cls, settings: Any) -> Publisher:
        """A worker's (its ``QueueSettings``): the streams' bound and the TTLs."""
        return cls(settings.stream_maxlen, settings.stream_ttl, settings.result_ttl, settings.stream_ttl_after_end)

    def resume(self, conn: Redis, job_ids: list[str]) -> dict[str, JobStream]:
        """Stream state per job: fresh for new jobs, where the last attempt stopped for retried ones."""
        with conn.pipeline(transaction=False) as pipe:
            self.queue_stream_reads(pipe, job_ids)
            entries = pipe.execute(raise_on_error=False)  # (a key of another type fails its own job's read alone)
        return self.streams_from(job_ids, entries)

    @staticmethod
    def queue_stream_reads(pipe: Pipeline, job_ids: Sequence[str]) -> None:
        """Queue on ``pipe`` the reads ``streams_from`` takes: each job's whole stream."""
        for job_id in job_ids:
            pipe.xrange(stream_key(job_id))

    def streams_from(self, job_ids: Sequence[str], entries: list[Any]) -> dict[str, JobStream]:
        """``resume``'s streams, from the replies of ``queue_stream_reads`` (read with ``raise_on_error=False``: a
        stream key of another type, written by hand, is its own job's fault; any other error is raised)."""
        streams = {}
        for job_id, found in zip(job_ids, entries):
            streams[job_id] = s = JobStream(job_id)
            if isinstance(found, Exception):
                if not wrong_type(found):
                    raise found
                log.warning("job %s: its stream key holds another type (written by hand?): not read", job_id)
                s.whole = False  # (the first event written replaces it)
                continue
            try:
                events = [event_from_stream(fields) for _id, fields in found]
                for event in events:
                    read_check(StreamEvent, event)
                s.read(events)  # (a logprob step of three numbers passes the schema and fails here)
            except (ValueError, KeyError, TypeError, RecursionError) as exc:  # written by hand, say (JSON nested
                # past the parser's depth, too): it can't be the output's start
                log.warning("job %s: its stream holds an entry off the protocol (%s): the job starts over", job_id, exc)
                streams[job_id] = s = JobStream(job_id)
                s.next_n, s.whole = len(found), False
        return streams

    def add(
        self,
        s: JobStream,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
        error: str | None = None,
        index: int = 0,
        error_type: str | None = None,
        logprobs: list[dict[int, float]] | None = None,
        sample_end: str | None = None,
        prompt_tokens: int | None = None,
        error_code: str | None = None,
        stop_reason: int | str | None = None,
    ) -> None:
        """``text`` and ``token_ids`` (and their ``logprobs``) of sample ``index`` to stream; ``finish_reason`` ends
        the job; ``sample_end`` ends sample ``index`` alone (n > 1: its own finish reason, the others go on);
        ``prompt_tokens``: the prompt's length, for a job asking for the usage on every event; ``stop_reason``: the
        stop string or token id that ended the output (with either end)."""
        if prompt_tokens is not None:
            s.prompt_tokens = prompt_tokens
        if s.ended or (
            finish_reason is None and sample_end is None and not text and not token_ids and not s.pending_reset
        ):
            return
        pending = s.pending.get(index)
        if pending is None:  # (setdefault would build the empty lists at every token)
            pending = s.pending[index] = ([], [], [])
        texts, ids, lps = pending
        if text:
            texts.append(text)
        ids += token_ids
        if logprobs:
            lps += logprobs
        if finish_reason is not None:
            # Its piece goes out last, carrying the end: the end went on whichever sample's piece was pending last,
            # and a sample ending in the same flush lost its own end to it (its sample_finish_reason dropped).
            s.pending[index] = s.pending.pop(index)
            s.pending_end = (finish_reason, usage, error, error_type, error_code, stop_reason)
        if sample_end is not None:
            s.pending_sample_ends[index] = (sample_end, stop_reason)
        if s.next_n == 0 or s.pending_reset or finish_reason is not None:
            self._urgent[s.job_id] = s
        self._dirty[s.job_id] = s

    def discard(self, s: JobStream) -> None:
        """Drop what ``s`` has pending: its job is another attempt's now."""
        self._dirty.pop(s.job_id, None)
        self._urgent.pop(s.job_id, None)
        s.pending, s.pending_end, s.pending_reset, s.pending_sample_ends = {}, None, False, {}

    def expedite(self, s: JobStream) -> None:
        """What ``s`` has pending goes out with the next hand-over, however soon."""
        if s.job_id in self._dirty:
            self._urgent[s.job_id] = s

    @property
    def urgent(self) -> bool:
        return bool(self._urgent)

    def take(self, urgent_only: bool = False) -> tuple[list[Event], list[Event]]:
        """One event per job (per sample of a job with n > 1) with something pending (``urgent_only``: of the jobs
        whose pending should not wait), as (job id, event, stream TTL to set, owner): (running jobs' events, final
        events). Final events go out after their job's result and status."""
        events: list[Event] = []
        finals: list[Event] = []
        streams = self._urgent if urgent_only else self._dirty
        for s in streams.values():
            pieces = list(s.pending.items()) or [(0, ([], [], []))]
            for k, (index, (texts, ids, lps)) in enumerate(pieces):
                last = k == len(pieces) - 1
                reason, usage, error, error_type, code, stop = (s.pending_end if last else None) or (None,) * 6
                reset = s.pending_reset and k == 0
                lps = lps if len(lps) == len(ids) else None  # all or none: never out of step with the ids
                ended, sample_stop = s.pending_sample_ends.get(index, (None, None))
                s.completion_tokens += len(ids)
                if reason is None and s.usage_each_event and s.prompt_tokens is not None:
                    usage = usage_of(s.prompt_tokens, s.completion_tokens)
                event = make_event(
                    s.next_n,
                    "".join(texts),
                    ids,
                    reason,
                    usage,
                    error,
                    reset,
                    index,
                    error_type,
                    lps,
                    ended,
                    code,
                    stop if reason is not None else sample_stop,
                )
                ttl = self.stream_ttl_after_end if reason is not None else self.stream_ttl if not s.ttl_renewed else 0
                s.ttl_renewed = True
                (finals if reason is not None else events).append((s.job_id, event, ttl, s.owner))
                s.next_n += 1
                s.ended = reason is not None
            s.pending, s.pending_end, s.pending_reset, s.pending_sample_ends = {}, None, False, {}
        if urgent_only:
            for job_id in self._urgent:
                del self._dirty[job_id]
        else:
            self._dirty = {}
        self._urgent = {}
        return events, finals

    def queue_writes(self, pipe: Pipeline, events: list[Event], publish: bool = True) -> None:
        """Queue the writes of ``events`` on ``pipe``: each to its job's stream and (``publish``) channel."""
        for job_id, event, ttl, _owner in events:
            key, message = stream_key(job_id), json.dumps(event)
            pipe.xadd(key, {STREAM_FIELD: message}, maxlen=self.maxlen, approximate=True)
            if publish:
                pipe.publish(channel_key(job_id), message)
            if ttl:
                pipe.expire(key, ttl)

    @staticmethod
    def script_args(events: list[Event]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the sender's event script: the same writes as ``queue_writes``, as one command, each
        only while its attempt owns the job."""
        keys, args = [], []
        for job_id, event, ttl, owner in events:
            keys += [stream_key(job_id), Job.key_for(job_id)]
            args += [ttl, channel_key(job_id), json.dumps(event), owner]
        return keys, args

    def flush(self, pipe: Pipeline) -> None:
        """Take what is pending and queue its writes on ``pipe`` (final events last); the caller executes it."""
        events, finals = self.take()
        self.queue_writes(pipe, events + finals)

    def write_result(
        self, pipe: Pipeline | Redis, job_id: str, entry: dict[str, Any], ttl: int, notify: str | None = None
    ) -> None:
        """The job's result (an entry of RQ's result stream, ``result_entry``) for ``ttl`` seconds (-1: for good, as
        RQ has it), and its id onto the completion list it named, if any."""
        pipe.xadd(result_key(job_id), entry, maxlen=10)  # RQ keeps a job's last 10 results
        if ttl == -1:
            pipe.persist(result_key(job_id))
        else:
            pipe.expire(result_key(job_id), ttl)
        self.notify(pipe, job_id, notify)

    def notify(self, pipe: Pipeline | Redis, job_id: str, notify: str | None) -> None:
        """The job's id onto the completion list it named (``notify``), after its result."""
        if notify:
            pipe.rpush(done_key(notify), job_id)
            pipe.expire(done_key(notify), self.result_ttl)
