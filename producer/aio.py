"""``AsyncClient``: the producer API for asyncio services, on ``redis.asyncio``.

Following a job (its events, text and result) never blocks the event loop: XREAD, GET and HGET go through
``redis.asyncio``. Submitting and cancelling go through RQ, which has no asyncio API: they run RQ's own code on a
thread (``asyncio.to_thread``), so a job is enqueued exactly as ``Client`` enqueues it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import NoPermissionError
from rq.job import Job

from producer.client import DEFAULT_JOB_TIMEOUT, DEFAULT_REDIS_URL, Client, check_job_id, validate
from producer.connection import REDIS_DOWN, connect_async, unblocked, wrong_type
from producer.event_reading import (
    AFTER_OUTAGE_S,
    REDIS_PATIENCE_S,
    REPLAY_PAGE,
    EventCursor,
    Outage,
    deadline_after,
    ending_event_may_come,
    ends_sample,
    final_event_may_come,
    piece_of,
    queue_end_reads,
    raise_at_a_bad_end,
    rest_from_result,
    stream_wait_ends,
    text_before_its_end,
    time_left,
)
from producer.generation_job import DEFAULT_RESULT_TTL, ENDED, GenerationJob, handle_id
from producer.job_errors import (
    JobCanceled,
    JobFailed,
    JobIdTaken,
    NoSuchJob,
    ResultNotKept,
    StreamExpired,
    StreamGap,
    checked,
    stream_expired,
)
from producer.protocol import DEFAULT_QUEUE, event_from_stream, is_last, read_result, result_from_entries, stream_key
from producer.wire import JobResult

log = logging.getLogger("roseinfer.client")


class AsyncClient:
    """``AsyncClient(redis_url, queue="roseinfer")``: ``await submit(...)``, ``async for piece in job.stream()``,
    ``await job.result()``. Options as ``Client``'s."""

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        connection: Redis | None = None,
        retries: int = 2,
        job_timeout: int = DEFAULT_JOB_TIMEOUT,
        result_ttl: int = DEFAULT_RESULT_TTL,
        failure_ttl: int | None = None,
    ) -> None:
        if redis_url is None and connection is not None:
            # Its reads are async, on connections of its own: from the default URL they missed every job.
            raise TypeError("AsyncClient(connection=...) needs the redis_url of that connection's server too")
        redis_url = redis_url or DEFAULT_REDIS_URL
        self.connection = connect_async(redis_url)
        # RQ's enqueue and cancel, run on a thread (``connection``: a sync client of the caller's, as Client takes)
        self.sync = Client(
            redis_url, queue, connection=connection, retries=retries, job_timeout=job_timeout,
            result_ttl=result_ttl, failure_ttl=failure_ttl,
        )  # fmt: skip
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop it follows jobs on, once it has
        self.hub = StreamHub(connect_async(redis_url))  # its blocking reads on a connection of their own
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._flushing = False
        self._flusher: asyncio.Task | None = None
        self._orphans: set[asyncio.Task] = set()  # cancels of jobs whose submitters left as they went in
        self.closed = False

    @property
    def queue_name(self) -> str:
        return self.sync.queue.name

    def __repr__(self) -> str:
        return f"AsyncClient({self.sync._shown_url()!r}, queue={self.queue_name!r})"

    async def submit(self, prompt: str | None = None, **fields: Any) -> AsyncGenerationJob:
        """Enqueue one job. Submissions that arrive while others are being enqueued go in one pipeline together
        (a server's concurrent requests reach the worker as one batch, not one by one)."""
        self._check_open()
        request = {"prompt": prompt, **fields} if prompt is not None else dict(fields)
        # A bad request (or job id) fails alone, here: in the batch it would fail every request sent with it.
        validate({k: v for k, v in request.items() if k != "job_id"})
        if request.get("job_id") is not None:
            check_job_id(request["job_id"])
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if not self._flushing:
            self._flushing = True
            self._flusher = asyncio.create_task(self._flush())  # kept: a task nobody holds may be collected
        try:
            return self.job(await future)
        except asyncio.CancelledError:
            # Cancelled once its job went in, before it woke (a timeout around the submit, a server's shutdown): no
            # one knows that job's id, to follow or cancel it.
            if future.done() and not future.cancelled() and future.exception() is None:
                cancel = asyncio.create_task(self._cancel_orphan(future.result()))
                self._orphans.add(cancel)  # (held till done: a task nobody holds may be collected)
                cancel.add_done_callback(self._orphans.discard)
            raise

    async def _cancel_orphan(self, job_id: str) -> None:
        try:
            await self.job(job_id).cancel()
        except Exception as exc:  # (Redis down, say) the orphan runs to its end; nobody reads it
            log.warning("could not cancel job %s, whose submitter left: %s", job_id, exc)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = _one_per_id(self._pending)
                batch = [(request, future) for request, future in batch if not future.done()]  # (cancelled: left out)
                if not batch:
                    continue
                try:
                    jobs = await asyncio.to_thread(self.sync.submit_many, [request for request, _ in batch])
                except Exception as exc:
                    taken = set(exc.job_ids) if isinstance(exc, JobIdTaken) else set()
                    refused = [(request, future) for request, future in batch if request.get("job_id") in taken]
                    if not refused:  # Redis down, say: every caller of this batch hears it
                        for _, future in batch:
                            if not future.done():
                                future.set_exception(exc)
                        continue
                    # Ids that live jobs hold (nothing went in): their callers hear it, the others go in again.
                    for request, future in refused:
                        if not future.done():
                            job_id = request["job_id"]
                            stopping = [job_id] if job_id in exc.stopping else []
                            status = "canceled, its run still stopping" if stopping else exc.status
                            future.set_exception(JobIdTaken([job_id], status, stopping))
                    self._pending = [item for item in batch if item[0].get("job_id") not in taken] + self._pending
                    continue
                orphans = []  # jobs whose callers were cancelled while the batch went in: no one will follow them
                for (_, future), job in zip(batch, jobs):
                    if not future.done():
                        future.set_result(job.id)
                    else:
                        orphans.append(job)
                for job in orphans:  # after every caller has its job: a failed cancel must not leave them waiting
                    await self._cancel_orphan(job.id)
        finally:
            self._flushing = False

    async def submit_many(self, requests: list[dict[str, Any]]) -> list[AsyncGenerationJob]:
        self._check_open()
        submitting = asyncio.ensure_future(asyncio.to_thread(self.sync.submit_many, requests))
        try:
            jobs = await asyncio.shield(submitting)
        except asyncio.CancelledError:
            # The thread goes on: the jobs it puts in are canceled, as ``submit``'s orphans (they ran for no one).
            submitting.add_done_callback(self._cancel_orphans)
            raise
        return [self.job(job.id) for job in jobs]

    def _cancel_orphans(self, submitted: asyncio.Future) -> None:
        if submitted.cancelled() or submitted.exception() is not None:
            return
        for job in submitted.result():
            cancel = asyncio.ensure_future(self._cancel_orphan(job.id))
            self._orphans.add(cancel)  # (held till done: a task nobody holds may be collected)
            cancel.add_done_callback(self._orphans.discard)

    def job(self, job_id: str) -> AsyncGenerationJob:
        return AsyncGenerationJob(self, job_id)

    async def status(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.status)

    async def workers(self, queue: str | None = None) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.workers, queue)

    async def no_worker_warning(self, queue: str | None = None) -> str | None:
        return await asyncio.to_thread(self.sync.no_worker_warning, queue)

    def _check_open(self) -> None:
        """A closed client takes no job: one went in (its connections opened again, left open) that no stream of this
        client could follow."""
        if self.closed:
            raise ClientClosed("this AsyncClient was closed")

    def _check_loop(self) -> None:
        """A job followed on a second event loop (a client made once, then two ``asyncio.run``) is refused in its own
        words: the hub's reader belongs to the first, and redis-py failed deep inside ("Event loop is closed").
        Submits, status and cancels run on any loop, as they did."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncClient follows jobs on another event loop than its first: its stream reader belongs to "
                "that loop. Make an AsyncClient on each loop (inside the coroutine asyncio.run runs)"
            )

    async def close(self) -> None:
        self.closed = True
        if self._flusher is not None:  # submits going in, or the cancel of a left caller's job: let them land
            await asyncio.wait([self._flusher])  # (its failures were its callers')
        if self._orphans:
            await asyncio.wait(self._orphans)
        await self.hub.close()
        await self.connection.aclose()
        self.sync.close()  # (a connection the caller passed is theirs to close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ClientClosed(RuntimeError):
    """The AsyncClient a job is followed through was closed meanwhile."""


# Reads handed to a follower and not taken yet: past this it is left out of the hub's read until it has taken them,
# then reads on from its last entry (a client that stopped reading held every event of its job in memory: ~475 MB).
MAX_QUEUED = 256


class StreamHub:
    """One reader for the streams of every job followed through a client: a single ``XREAD BLOCK`` over all of
    them (one command per wake-up for hundreds of streams, not one per job and event), handing each follower the
    entries past the last one it got. A stream followed from now on joins the read within ``wait_ms``."""

    def __init__(self, connection: AsyncRedis, wait_ms: int = 50) -> None:
        self.connection, self.wait_ms = connection, wait_ms
        # stream key -> its followers (by id): a reply's entries go to their key's followers alone (a scan of every
        # follower for each key cost 28 ms a wake-up with 1,000 requests waiting)
        self._by_key: dict[str, dict[int, _Follower]] = {}
        self._not_streams: set[str] = set()  # keys of another type (written by hand): left out of the read
        self.down_since: float | None = None  # when Redis stopped answering the read (None: it answers)
        self.up_again_at: float | None = None  # when it answered again after the last outage
        self.polling = False  # Redis refuses XREAD (an ACL without @blocking): each stream looked at every wait_ms
        self._next = 0
        self._task: asyncio.Task | None = None
        self._closed = False

    async def close(self) -> None:
        """The reader stopped, its followers told (they raised nothing and waited for good), its connection closed:
        it read on after the client's close, on connections opened again."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for followers in self._by_key.values():
            for f in followers.values():
                f.entries.put_nowait(ClientClosed("this AsyncClient was closed"))
        await self.connection.aclose()

    def follow(self, key: str) -> _Follower:
        if self._closed:
            raise ClientClosed("this AsyncClient was closed")
        self._not_streams.discard(key)  # (looked at again)
        follower = _Follower(self._next, key)
        self._by_key.setdefault(key, {})[follower.id] = follower
        self._next += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._read())
        return follower

    async def entries(self, follower: _Follower, wait: float) -> Any:
        """The next entries (or error) handed to ``follower``, waiting ``wait`` seconds at most; one left out of the
        read for lagging is taken back into it once it has taken what it had."""
        if follower.detached and follower.entries.empty():
            if self._closed:
                raise ClientClosed("this AsyncClient was closed")
            follower.detached = False
            self._by_key.setdefault(follower.key, {})[follower.id] = follower
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._read())
        if _timeout is None:  # (Python 3.10)
            return await asyncio.wait_for(follower.entries.get(), wait)
        async with _timeout(wait):  # (wait_for before 3.12 lost a cancel that landed as the get finished)
            return await follower.entries.get()

    def leave(self, follower: _Follower) -> None:
        followers = self._by_key.get(follower.key, {})
        followers.pop(follower.id, None)
        if not followers:
            self._by_key.pop(follower.key, None)
            self._not_streams.discard(follower.key)

    async def _read(self) -> None:
        while self._by_key:
            streams = {
                key: min(f.last for f in followers.values())
                for key, followers in self._by_key.items()
                if key not in self._not_streams
            }
            if not streams:  # (their followers heard why, and leave)
                await asyncio.sleep(self.wait_ms / 1000)
                continue
            try:
                reply = await self._read_streams(streams)
            except Exception as exc:
                if isinstance(exc, NoPermissionError) and not self.polling:
                    self.polling = True  # (the sync client's reader does the same; refused again: its followers hear)
                    continue
                try:
                    if wrong_type(exc) and await self._left_out(list(streams), exc):
                        continue  # one key's type failed the read of all: only its followers hear it
                except REDIS_DOWN as down:  # (the look at the keys' types met an outage: this reader must not end)
                    exc = down
                outage = isinstance(exc, REDIS_DOWN) or unblocked(exc)  # (a primary made a replica: read on)
                if outage and self.down_since is None:
                    self.down_since = time.monotonic()
                if not outage or time.monotonic() - self.down_since >= REDIS_PATIENCE_S:
                    for followers in self._by_key.values():  # not an outage, or a long one: every follower hears it
                        for f in followers.values():
                            f.entries.put_nowait(exc)
                await asyncio.sleep(0.5)  # (a restart, a failover: the read goes on from where it was)
                continue
            if self.down_since is not None:
                self.down_since, self.up_again_at = None, time.monotonic()
            for key, found in reply or []:
                key = key.decode() if isinstance(key, bytes) else key
                ids = [_entry_id(entry_id) for entry_id, _ in found]
                for f in list(self._by_key.get(key, {}).values()):
                    if f.last < streams[key]:  # it came during this read: the next one starts from its own last
                        continue
                    if f.entries.qsize() >= MAX_QUEUED:  # it does not read: out of the read until it catches up
                        self.leave(f)
                        f.detached = True
                        continue
                    new = [entry for entry, entry_id in zip(found, ids) if entry_id > f.last]
                    if new:
                        f.last = ids[-1]
                        f.entries.put_nowait(new)

    async def _read_streams(self, streams: dict[str, tuple[int, int]]) -> Any:
        """The entries past each stream's position, as XREAD gives them: one XREAD BLOCK, or where Redis refuses it
        a wait and one XRANGE each."""
        if not self.polling:
            since = {key: f"{ms}-{seq}" for key, (ms, seq) in streams.items()}
            return await self.connection.xread(since, count=1024, block=self.wait_ms)
        await asyncio.sleep(self.wait_ms / 1000)
        async with self.connection.pipeline(transaction=False) as pipe:
            for key, (ms, seq) in streams.items():
                pipe.xrange(key, min=f"{ms}-{seq + 1}", count=1024)
            pages = await pipe.execute()
        return [(key, page) for key, page in zip(streams, pages) if page]

    async def _left_out(self, keys: list[str], exc: Exception) -> bool:
        """The keys among ``keys`` that hold another type than a stream, left out of the read, their followers
        handed ``exc``; whether there were any."""
        async with self.connection.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.type(key)
            kinds = await pipe.execute()
        bad = [key for key, kind in zip(keys, kinds) if (kind.decode() if isinstance(kind, bytes) else kind) not in
               ("stream", "none")]  # fmt: skip
        for key in bad:
            self._not_streams.add(key)
            for f in self._by_key.get(key, {}).values():
                f.entries.put_nowait(exc)
        return bool(bad)


_timeout = getattr(asyncio, "timeout", None)  # (Python 3.11 on)


def _keep_cancel() -> None:
    """Raise the task's cancel where an await returned instead: before Python 3.12 ``asyncio.wait_for`` (redis-py's
    around each command under a socket timeout, which every connection here has) gave its result when a cancel
    landed as it finished, and a timeout around a stream or a wait for a result never fired (a wait on a queued job
    went on for good). Called once an iteration of each waiting loop. (Python 3.10 has no count of cancels.)"""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "cancelling") and task.cancelling():
        raise asyncio.CancelledError


async def _final_event(hub: StreamHub, follower: _Follower, seconds: float) -> None:
    """Read a job's stream until its final event, or for ``seconds`` (or until Redis fails: the caller looks)."""
    until = time.monotonic() + seconds
    while (wait := until - time.monotonic()) > 0:
        _keep_cancel()
        try:
            found = await hub.entries(follower, wait)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return
        if isinstance(found, ClientClosed):  # (a result waited for: it polled on, on connections opened again)
            raise found
        if isinstance(found, Exception) or any(is_last(_event(fields)) for _, fields in found):
            return


def _event(fields: dict[Any, Any]) -> dict[str, Any]:
    try:
        return event_from_stream(fields)
    except (ValueError, KeyError, TypeError):
        return {"finish_reason": None}  # not ours to read: the next look at the result decides


class _Follower:
    def __init__(self, id_: int, key: str) -> None:
        self.id, self.key = id_, key
        self.last = (0, 0)  # the last entry id handed over
        self.entries: asyncio.Queue = asyncio.Queue()
        self.detached = False  # left out of the hub's read: it lagged ``MAX_QUEUED`` reads behind


OFF_LOOP_BYTES = 256 * 1024  # a result stored larger is decoded and checked on a thread, not the event loop


def _stored_bytes(entries: list[Any]) -> int:
    return sum(len(value) for _id, fields in entries or () for value in fields.values())


def _finished_result(entries: list[Any], job_id: str) -> dict[str, Any] | None:
    """The finished result the entries hold, checked; None for any other (or none yet)."""
    result = result_from_entries(entries)
    return checked(JobResult, result, job_id) if result is not None and result.get("status") == "finished" else None


def _entry_id(value: bytes | str) -> tuple[int, int]:
    ms, _, seq = (value.decode() if isinstance(value, bytes) else value).partition("-")
    return int(ms), int(seq or 0)


class AsyncGenerationJob:
    """A handle on one submitted job, as ``GenerationJob`` with awaitables."""

    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = handle_id(job_id)

    def __repr__(self) -> str:
        return f"AsyncGenerationJob({self.id!r})"

    def __eq__(self, other: object) -> bool:  # (as RQ's Job: one job, whichever handle names it)
        return isinstance(other, AsyncGenerationJob) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def _sync(self) -> GenerationJob:
        return self.client.sync.job(self.id)

    async def status(self) -> str:
        status = await self.client.connection.hget(Job.key_for(self.id), "status")
        return status.decode() if status else "missing"

    async def cancel(self) -> bool:
        return await asyncio.to_thread(self._sync.cancel)

    async def samples(self) -> int | None:
        return await asyncio.to_thread(self._sync.samples)

    async def events(
        self, timeout: float | None = None, skip_void: bool = False, idle: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """As ``GenerationJob.events`` (read through the client's ``StreamHub``); ``idle``: ``timeout`` counts from
        the last event, not from the start (a stream that goes on is not cut, as a client's read timeout)."""
        self.client._check_loop()
        key, conn = stream_key(self.id), self.client.connection
        cursor = EventCursor(self.id, skip_void)
        deadline = deadline_after(timeout)
        outage = Outage(deadline, self.client.sync)  # a Redis restart or failover waited out, as the sync client
        held: list[dict[str, Any]] = []  # the backlog read to its end first, as ``GenerationJob.events`` reads it
        while skip_void:
            try:
                page = await conn.xrange(key, min=cursor.next_entry(), count=REPLAY_PAGE)
            except REDIS_DOWN as exc:
                await asyncio.sleep(outage.pause(exc))
                continue
            outage.over()
            held = cursor.hold(page, held)
            if len(page) < REPLAY_PAGE:
                break
        follower = self.client.hub.follow(key)
        if cursor.last_id not in ("0-0", b"0-0"):
            follower.last = _entry_id(cursor.last_id)
        expired_at: float | None = None
        try:
            for event in held:
                yield event
                if is_last(event):
                    return
            if idle and timeout is not None and held:
                deadline = outage.deadline = time.monotonic() + timeout
            looked = False  # the first look does not wait: a job long over says so at once
            while True:
                _keep_cancel()
                wait = 1.0 if deadline is None else max(0.001, min(1.0, deadline - time.monotonic()))
                if expired_at is not None:
                    wait = max(0.001, min(wait, expired_at - time.monotonic()))
                try:
                    found = await self.client.hub.entries(follower, wait) if looked else None
                except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                    found = None
                looked = True
                if isinstance(found, REDIS_DOWN):  # the hub waited out its patience: so does this follower
                    await asyncio.sleep(outage.pause(found))
                    continue
                if isinstance(found, Exception):
                    raise found
                if found:
                    outage.over()  # (the hub read them: Redis answers, and a next outage gets its whole patience)
                    for event in cursor.take(found):
                        yield event
                        if is_last(event):
                            return
                    # (once the events in hand are given, as GenerationJob.events)
                    if not idle and deadline is not None and time.monotonic() >= deadline:  # tokens still coming
                        raise TimeoutError(f"job {self.id}: no end of stream within {timeout:g} s")
                    if idle and timeout is not None:
                        deadline = outage.deadline = time.monotonic() + timeout
                    continue
                try:
                    status, expired_at = await self._look(key, cursor, expired_at, deadline, self._after(outage))
                except REDIS_DOWN as exc:
                    await asyncio.sleep(outage.pause(exc))
                    continue
                outage.over()
                if status == "more":  # events landed just now (the hub brings them), or a final one is due
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    if status == "finished":  # its wait for a final event ends by the deadline (a clock read apart)
                        raise stream_expired(self.id)
                    what = "no event" if idle else "no end of stream"
                    raise TimeoutError(f"job {self.id}: {what} within {timeout:g} s")
        finally:
            self.client.hub.leave(follower)

    def _after(self, outage: Outage) -> bool:
        """Whether an outage ended a moment ago (this wait's, or the hub's that read the streams through it): a
        missing hash may come back then (a Redis restarted empty, its workers writing their jobs back)."""
        up_again_at = self.client.hub.up_again_at
        recent = up_again_at is not None and time.monotonic() - up_again_at < AFTER_OUTAGE_S
        return recent or outage.ended_within(AFTER_OUTAGE_S)

    async def _look(
        self,
        key: str,
        cursor: EventCursor,
        expired_at: float | None,
        deadline: float | None,
        after_outage: bool = False,
    ) -> tuple[str, float | None]:
        """The job's status once no event came, and until when its final event is waited for; "more" when events
        landed just now or a final one is still due. Raises the job's ending once no final event can come.
        ``after_outage``: an outage ended a moment ago, and a missing hash may come back (a Redis restarted empty)."""
        conn = self.client.connection
        status = await self.status()
        # Events past the cursor: the hub brings them (a finished job's whole stream, where the first look of a
        # short timeout said it had expired)
        if status in (*ENDED, "missing", "finished") and await conn.xrange(key, min=cursor.next_entry(), count=1):
            return "more", expired_at  # (XRANGE: XREAD is refused without @blocking)
        if status == "missing" and after_outage:
            return "waiting", expired_at  # (its workers write their jobs back)
        if status in ENDED or status == "missing":
            if status in ("canceled", "stopped", "failed") and (
                expired_at or await conn.hget(Job.key_for(self.id), "started_at")
            ):  # its final event (an abort's last text and usage, a failure's error) lands after the status
                if expired_at is None:  # (not for a job long over: every stream() of it waited the grace)
                    async with conn.pipeline(transaction=False) as pipe:
                        queue_end_reads(pipe, self.id)
                        expired_at = stream_wait_ends(deadline, ending_event_may_come(await pipe.execute()))
                if time.monotonic() < expired_at:
                    return "more", expired_at
            await asyncio.to_thread(self._sync._raise_ended, status)
        if status == "finished":
            if expired_at is None:
                async with conn.pipeline(transaction=False) as pipe:
                    queue_end_reads(pipe, self.id)
                    expired_at = stream_wait_ends(deadline, final_event_may_come(await pipe.execute()))
            if time.monotonic() >= expired_at:
                raise stream_expired(self.id)
        return status, expired_at

    async def stream(self, timeout: float | None = None, index: int = 0) -> AsyncIterator[str]:
        """As ``GenerationJob.stream``: text pieces (of sample ``index``), the result's text once the stream expired;
        ``StreamRestarted`` if the output starts over after some."""
        if index != 0 or type(index) is not int:  # (False and 0.0 equal 0: the sync client's TypeError)
            await asyncio.to_thread(self._sync.check_sample, index)
        read_any, read = False, []  # (the text given: a stream that falls short is made whole from the result)
        deadline = deadline_after(timeout)
        try:
            async with contextlib.aclosing(self.events(timeout, skip_void=True)) as events:
                async for event in events:
                    piece = piece_of(self.id, event, index, read_any)
                    if piece:
                        read_any = True
                        read.append(piece)
                        yield piece
                    raise_at_a_bad_end(self.id, event, read_any)
                    if ends_sample(event, index):
                        return
        except (JobCanceled, JobFailed) as exc:  # (its stream gone: what it made is in its result)
            if text := text_before_its_end(exc, index, "".join(read)):
                yield text
            raise
        except StreamGap as gap:  # expired, trimmed, or short of its end: the rest from the result, where it is whole
            try:
                result = await self.result(timeout=time_left(deadline))
            except (ResultNotKept, NoSuchJob):
                if isinstance(gap, StreamExpired) and not read:
                    raise
                raise gap from None  # (no result to give: the stream's word stands)
            if rest := rest_from_result(result, index, "".join(read), gap):
                yield rest

    async def result(self, timeout: float | None = None) -> dict[str, Any]:
        """As ``GenerationJob.result``: the result once the job finished; ``JobFailed`` or ``JobCanceled``. Waits
        for the job's final event in its stream (read by the client's one ``StreamHub``, not a pub/sub connection
        a waiting job: a server with 1,000 requests waiting held 1,000), looking again at least once a second."""
        self.client._check_loop()
        conn = self.client.connection
        deadline = deadline_after(timeout)
        outage = Outage(deadline, self.client.sync)
        follower = None
        try:
            while True:
                _keep_cancel()
                try:
                    async with conn.pipeline(transaction=False) as pipe:  # the status first, as the sync client
                        pipe.hget(Job.key_for(self.id), "status")
                        read_result(pipe, self.id)
                        status, entries = await pipe.execute()
                except REDIS_DOWN as exc:
                    await asyncio.sleep(outage.pause(exc))
                    continue
                outage.over()
                status = status.decode() if status else "missing"
                if _stored_bytes(entries) > OFF_LOOP_BYTES:  # (a result of 60 MB read on the loop held it seconds)
                    result = await asyncio.to_thread(_finished_result, entries, self.id)
                else:
                    result = _finished_result(entries, self.id)
                if result is not None:
                    return result
                in_time = deadline is None or time.monotonic() < deadline
                if status == "missing" and self._after(outage) and in_time:
                    await asyncio.sleep(0.1)  # (Redis restarted empty: its workers write their jobs back)
                    continue
                if status in ENDED or status in ("finished", "missing"):
                    # The rarer endings (a partial result being written, a result not kept) as the sync client.
                    left = 5.0 if deadline is None else max(0.0, min(5.0, deadline - time.monotonic()))
                    try:
                        return await asyncio.to_thread(self._sync.result, left)
                    except TimeoutError:  # the job went on meanwhile (requeued, or enqueued under that id since)
                        if deadline is not None and time.monotonic() >= deadline:
                            raise
                        continue  # (its 5 s were this look's, not the caller's: a wait without timeout timed out)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {self.id}: no result within {timeout:g} s (status {status})")
                if follower is None:  # followed, then a look again: an end in between is not missed
                    # From the stream's last entry now, not its first: a waiter joining a long stream read and decoded
                    # all of it, and dragged the hub's shared read of that key back to its start.
                    try:
                        newest = await conn.xrevrange(stream_key(self.id), count=1)
                    except REDIS_DOWN as exc:
                        await asyncio.sleep(outage.pause(exc))
                        continue
                    follower = self.client.hub.follow(stream_key(self.id))
                    if newest:
                        follower.last = _entry_id(newest[0][0])
                    continue
                await _final_event(self.client.hub, follower, 1.0 if left is None else min(1.0, left))
        finally:
            if follower is not None:
                self.client.hub.leave(follower)


__all__ = ["AsyncClient", "AsyncGenerationJob", "JobCanceled", "JobFailed"]


def _one_per_id(pending: list[tuple[dict[str, Any], Any]]) -> tuple[list, list]:
    """The submissions to send together, and those to send after them: a second use of a job id waits for the next
    batch, as a second ``Client.submit`` would come after the first (in one batch it failed every submission)."""
    now, later, ids = [], [], set()
    for item in pending:
        job_id = item[0].get("job_id")
        (later if job_id is not None and job_id in ids else now).append(item)
        ids.add(job_id)
    return now, later
