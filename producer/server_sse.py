"""A streamed answer: its jobs' events merged, the first ones held for the headers (a refused job is the request's
status), then written as server-sent events, chat and completion chunks or the Responses API's typed events, with a
keep-alive comment while nothing comes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from prometheus_client import Gauge
from redis.exceptions import RedisError

from producer.aio import AsyncGenerationJob
from producer.job_errors import JobCanceled, JobFailed, ProtocolError, StreamGap, StreamRestarted
from producer.openai_api import APIError, ChunkWriter, total_usage, without_output
from producer.responses_api import ResponseWriter, in_responses_terms
from producer.server_jobs import (
    ServerStopping,
    cancel_all_soon,
    cancel_soon,
    job_error,
    not_to_retry,
    stopping,
    unless_gone,
)

# A stream of several prompts holds its headers for every job's first event (a refused job is the request's status),
# but once one came, no longer than this: a job queued behind a full worker streams when it starts.
FIRST_EVENTS_GRACE_S = 1.0
# A stream whose jobs sent nothing yet (queued behind others) gets its headers after this, then a comment line
# every PING_EVERY_S while nothing comes: a proxy's read timeout (nginx's 60 s) cut it, and with it the job.
HEADERS_HOLD_S = 5.0
PING_EVERY_S = 15.0
# The request field a context_length_exceeded error names, by endpoint (behind a proxy's path prefix too).
PROMPT_FIELDS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}


async def start_stream(
    request: Request, jobs: list[AsyncGenerationJob], wait: float, timeout: float
) -> tuple[list[tuple[int, dict[str, Any]]], MergedEvents]:
    """The jobs' events, those before the headers read: a job refused among them is the request's status.
    ``--timeout`` counts from each job's last event: a stream that goes on is not cut (OpenAI's and vLLM's are
    not; a client's read timeout counts between chunks too). The first events wait ``wait`` at most, but where
    the stream's pings come sooner than the client stops reading: they keep it, and ``--timeout`` bounds them."""
    events = MergedEvents([each.events(timeout, skip_void=True, idle=True) for each in jobs])
    # (where the headers go before any event: the 504 comes in-stream)
    events.expect_first_within(timeout if wait > PING_EVERY_S else wait)
    try:
        first = asyncio.wait_for(first_events(jobs, events, HEADERS_HOLD_S), wait)  # (the client waits)
        return await unless_gone(request, jobs, first, wait), events
    except BaseException:  # (its jobs canceled already where they should be)
        events.close()
        raise


async def first_events(
    jobs: list[AsyncGenerationJob], events: MergedEvents, hold: float
) -> list[tuple[int, dict[str, Any]]]:
    """The events that come before any byte of the response: every job's first, or once one came, those within
    ``FIRST_EVENTS_GRACE_S``; none if none came within ``hold`` (jobs queued behind others). A job the worker
    refuses among them (a prompt too long) is the request's status, 400, as without streaming (OpenAI and vLLM
    check before they stream), not 200 and an error chunk."""
    early: list[tuple[int, dict[str, Any]]] = []
    seen: set[int] = set()
    deadline = time.monotonic() + hold
    while len(seen) < len(jobs):
        wait = deadline - time.monotonic()
        if wait <= 0:
            break
        try:
            got = await events.get(wait)
        except NothingYet:  # (a stream's own TimeoutError, its job past --timeout, is the request's 504)
            break
        if got is None:
            break
        i, event = got
        reason = event.get("finish_reason")
        if reason == "error":
            raise JobFailed.of_event(jobs[i].id, event)
        if reason == "abort" and not event["text"]:
            raise JobCanceled(jobs[i].id, "the job was canceled")
        if not early:
            deadline = time.monotonic() + FIRST_EVENTS_GRACE_S
        early.append(got)
        seen.add(i)
    return early


async def chunk_stream(
    jobs: list[AsyncGenerationJob],
    chunks: ChunkWriter,
    timeout: float,
    open_streams: Gauge,
    early: list[tuple[int, dict[str, Any]]],
    events: MergedEvents,
) -> AsyncIterator[str]:
    """The chunks of the jobs' events, ``(job i, event)``: those that came before the headers, then the others as
    they come. Job i's samples are choices i * n .. i * n + n - 1 (one job but for a completion of several prompts);
    the usage of them all at the end. A job's error ends the stream and cancels the others."""
    finished, finals = False, []  # the jobs' final events, for the usage of them all
    sent: set[int] = set()  # the jobs some of whose text went out
    ended: set[int] = set()  # the choices whose finish went out (a sample of n > 1 ends before its job)
    open_streams.inc()
    try:
        for i, event in early:
            chunks.note_prompt(i, event)
        for index in range(len(jobs) * chunks.n if chunks.chat or chunks.echo else 0):  # (a chat's role; an echo)
            yield data_event(
                chunks.piece(chunks.echo[index // chunks.n] if chunks.echo else "", first=True, index=index)
            )
        async for got in events.after(early):
            if got is None:  # nothing for a while (jobs queued): a comment line, which clients skip, keeps it open
                yield PING
                continue
            i, event = got
            job, base = jobs[i], i * chunks.n
            if chunks.echo_only:
                event = without_output(event)
            if event.get("reset") and i in sent:
                raise StreamRestarted(job.id)  # text already sent cannot be taken back
            reason = event.get("finish_reason")
            if reason == "error":
                raise JobFailed.of_event(job.id, event)
            if event["text"] or event.get("logprobs"):
                sent.add(i)
            chunks.count(i, event)
            index = base + event.get("index", 0)
            if reason == "abort":  # canceled (or stopped): an error, as without streaming, not a whole answer
                if event["text"] and (chunk := chunks.piece(event["text"], index=index, event=event)):
                    yield data_event(chunk)
                raise JobCanceled(job.id, "the job was canceled")
            shows_logprobs = chunks.logprobs is not None and event.get("logprobs")  # tokens whose text waits
            if event["text"] or shows_logprobs or (reason is not None and chunks.n == 1):
                end = None if chunks.n > 1 else reason
                if (chunk := chunks.piece(event["text"], end, index=index, event=event)) is not None:
                    yield data_event(chunk)
            if event.get("sample_finish_reason") and reason is None and index not in ended:  # as OpenAI, at once
                ended.add(index)
                stop = event.get("stop_reason")
                yield data_event(chunks.piece("", event["sample_finish_reason"], index=index, stop_reason=stop))
            if reason is not None and chunks.n > 1:  # each sample ends with its own reason: the result has them
                result = await job.result(timeout)
                result = without_output(result) if chunks.echo_only else result
                for choice in result.get("choices") or []:
                    if base + choice["index"] not in ended:
                        yield data_event(chunks.piece("", choice["finish_reason"], index=base + choice["index"],
                                                      stop_reason=choice.get("stop_reason")))  # fmt: skip
            if reason is not None:
                finals.append(event)
                if len(finals) == len(jobs):
                    break
        if chunks.include_usage:
            yield data_event(chunks.usage(total_usage(finals)))
        yield "data: [DONE]\n\n"
        finished = True
    except STREAM_ERRORS as exc:
        path = "/v1/chat/completions" if chunks.chat else "/v1/completions"
        yield data_event(stream_error(exc, timeout, PROMPT_FIELDS[path]).body())
        yield "data: [DONE]\n\n"
    finally:
        open_streams.dec()
        events.close()
        if not finished:
            cancel_all_soon(jobs)


async def response_stream(
    job: AsyncGenerationJob,
    writer: ResponseWriter,
    timeout: float,
    open_streams: Gauge,
    early: list[tuple[int, dict[str, Any]]],
    events: MergedEvents,
) -> AsyncIterator[str]:
    """A response's typed events from its job's: created, the text (or calls) as it comes, completed; an error
    event where the job fails, and its cancel where the client goes away."""
    finished = False
    open_streams.inc()
    try:
        for event in writer.opening():
            yield typed_event(event)
        async for got in events.after(early):
            if got is None:
                yield PING
                continue
            event = got[1]
            if event.get("reset") and writer.fed:  # (the reasoning parser's held "<think>" and logprobs too)
                raise StreamRestarted(job.id)  # text already sent (thinking too) cannot be taken back
            reason = event.get("finish_reason")
            if reason == "error":
                raise JobFailed.of_event(job.id, event)
            for out in writer.piece(event["text"], event):
                yield typed_event(out)
            if reason == "abort":  # canceled: an error, as without streaming
                raise JobCanceled(job.id, "the job was canceled")
            if reason is not None:  # (off the loop: the thinking's tokens are counted by decoding, a long thought's)
                for out in await asyncio.to_thread(writer.closing, reason, event.get("usage") or {}):
                    yield typed_event(out)
                break
        finished = True
    except STREAM_ERRORS as exc:
        for out in writer.failed(stream_error(exc, timeout, PROMPT_FIELDS["/v1/responses"])):
            yield typed_event(out)
    finally:
        open_streams.dec()
        events.close()
        if not finished:
            cancel_soon(job)


STREAM_ERRORS = (
    JobFailed, JobCanceled, StreamRestarted, StreamGap, ProtocolError, TimeoutError, RedisError, ServerStopping
)  # fmt: skip


def context_error_named(err: APIError, prompt_field: str | None, max_tokens_field: str = "max_tokens") -> APIError:
    """A prompt too long names ``prompt_field`` as its param, the request's own name of max_tokens (a chat's may be
    ``max_completion_tokens``), and in a response's error the Responses API's fields."""
    if err.code == "context_length_exceeded":
        err.param = err.param or prompt_field
        err.message = err.message.replace("'max_tokens'", f"'{max_tokens_field}'")
        if prompt_field == PROMPT_FIELDS["/v1/responses"]:
            err.message = in_responses_terms(err.message) or err.message  # (its max_tokens: max_output_tokens)
    return err


def stream_error(exc: Exception, timeout: float, prompt_field: str | None = None) -> APIError:
    """What ends a stream once its headers went out, as the error it sends (a prompt too long names
    ``prompt_field``, as the status it would have been names it)."""
    if isinstance(exc, (JobFailed, JobCanceled)):
        return context_error_named(job_error(exc), prompt_field)
    if isinstance(exc, NoFirstEvent):  # (the headers went ahead of the first event, which never came)
        return not_to_retry(APIError(504, str(exc), "timeout"))
    if isinstance(exc, TimeoutError):  # a job sent nothing for --timeout
        return not_to_retry(APIError(504, f"no new token within {timeout:g} s", "timeout"))
    if isinstance(exc, ServerStopping):
        return stopping()
    if isinstance(exc, RedisError):  # Redis went away past the client's retries: said, not a cut stream
        return APIError(503, f"Redis is unavailable: {exc}", "service_unavailable")
    return APIError(500, str(exc), "server_error")


def typed_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class NoFirstEvent(TimeoutError):
    """A stream whose headers went before any event of its jobs (queued behind others) got none in time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no result within {seconds:g} s")


class NothingYet(Exception):
    """``MergedEvents.get``'s own wait ran out: not a stream's TimeoutError, which is its job past ``--timeout``."""


MAX_ARRIVED = 256  # events read for a stream's response and not written yet: the readers wait past this


class MergedEvents:
    """``(i, event)`` of each stream i as its events come, each read by a task of its own (a wait for the next one
    can time out without losing any); a stream's error once it comes."""

    open: ClassVar[weakref.WeakSet[MergedEvents]] = weakref.WeakSet()  # (``stop_open_streams``)

    def __init__(self, streams: list[AsyncIterator[dict[str, Any]]]) -> None:
        self._first_within: tuple[float, float] | None = None  # (seconds, by when: monotonic) for ``after``
        # Bounded: a client that stops reading stops the readers, and the hub leaves them out of its read past its own
        # bound (it reads on from their last entry later); unbounded, this queue took every event of the job (30 MB
        # in 22 s of a stalled reader of 32 samples with logprobs), however long the connection stayed open.
        self._arrived: asyncio.Queue = asyncio.Queue(MAX_ARRIVED)
        self._stop: tuple[Exception, int] | None = None  # ``stop``'s error, and how many events go before it
        self._left = len(streams)
        self._readers = [asyncio.create_task(self._read(i, stream)) for i, stream in enumerate(streams)]
        self._loop = asyncio.get_running_loop()
        MergedEvents.open.add(self)

    async def _read(self, i: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for event in stream:
                await self._arrived.put((i, event, None))
        except Exception as exc:
            await self._arrived.put((i, None, exc))
            return
        await self._arrived.put((i, None, None))

    async def get(self, timeout: float | None = None) -> tuple[int, dict[str, Any]] | None:
        """The next ``(i, event)``; None once every stream ended; ``NothingYet`` past ``timeout`` seconds."""
        while self._left:
            if self._stop is not None and self._stop[1] <= 0:
                raise self._stop[0]
            arrived = self._arrived.get()
            try:
                i, event, exc = await (arrived if timeout is None else asyncio.wait_for(arrived, timeout))
            except asyncio.TimeoutError:  # (not the builtin TimeoutError before Python 3.11)
                raise NothingYet from None
            if self._stop is not None:
                self._stop = (self._stop[0], self._stop[1] - 1)
            if i < 0:  # ``stop``'s wake-up
                continue
            if exc is not None:
                raise exc
            if event is not None:
                return i, event
            self._left -= 1
        return None

    def expect_first_within(self, seconds: float) -> None:
        """``after`` raises ``NoFirstEvent`` where no event came within ``seconds`` from now."""
        self._first_within = seconds, time.monotonic() + seconds

    async def after(self, early: list[tuple[int, dict[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]] | None]:
        """``early`` (events already taken), then the rest as they come; None each ``PING_EVERY_S`` seconds nothing
        came (the stream's keep-alive). ``NoFirstEvent`` where none came at all in time (``expect_first_within``)."""
        for got in early:
            yield got
        first = self._first_within if not early else None
        while True:
            wait = PING_EVERY_S
            if first is not None:
                left = first[1] - time.monotonic()
                if left <= 0:
                    raise NoFirstEvent(first[0])
                wait = min(wait, left)
            try:
                got = await self.get(wait)
            except NothingYet:
                yield None
                continue
            if got is None:
                return
            first = None
            yield got

    def stop(self, exc: Exception) -> None:
        """``get`` raises ``exc`` once it has given what came before."""
        self._stop = (exc, self._arrived.qsize())
        with contextlib.suppress(asyncio.QueueFull):  # (full: no get waits; it raises once it took those)
            self._arrived.put_nowait((-1, None, None))  # wakes a get waiting on an empty queue

    def close(self) -> None:
        MergedEvents.open.discard(self)
        for reader in self._readers:
            reader.cancel()


def stop_open_streams() -> None:
    """Every open stream of this event loop's server ends with the server's stopping error (its jobs canceled as it
    ends); another loop's (a second server in the process) are its own to stop."""
    loop = asyncio.get_running_loop()
    for events in list(MergedEvents.open):
        if events._loop is loop:
            events.stop(ServerStopping())


PING = ": ping\n\n"  # an SSE comment: every client skips it


def data_event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
