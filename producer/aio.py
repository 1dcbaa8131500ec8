"""``AsyncClient``: the producer API for asyncio services, on ``redis.asyncio``.

Following a job (its events, text and result) never blocks the event loop: XREAD, GET and HGET go through
``redis.asyncio``. Submitting and cancelling go through RQ, which has no asyncio API: they run RQ's own code on a
thread (``asyncio.to_thread``), so a job is enqueued exactly as ``Client`` enqueues it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis as AsyncRedis
from rq.job import Job

from producer.client import (
    _ENDED,
    DEFAULT_REDIS_URL,
    Client,
    EventCursor,
    GenerationJob,
    JobCanceled,
    JobFailed,
    StreamRestarted,
    checked,
    stream_expired,
)
from producer.protocol import DEFAULT_QUEUE, result_key, stream_key
from producer.wire import JobResult


class AsyncClient:
    """``AsyncClient(redis_url, queue="roseinfer")``: ``await submit(...)``, ``async for piece in job.stream()``,
    ``await job.result()``. Options as ``Client``'s."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, queue: str = DEFAULT_QUEUE, **options: Any) -> None:
        self.connection = AsyncRedis.from_url(redis_url)
        self.sync = Client(redis_url, queue, **options)  # RQ's enqueue and cancel, run on a thread

    @property
    def queue_name(self) -> str:
        return self.sync.queue.name

    async def submit(self, prompt: str | None = None, **fields: Any) -> AsyncGenerationJob:
        job = await asyncio.to_thread(self.sync.submit, prompt, **fields)
        return self.job(job.id)

    async def submit_many(self, requests: list[dict[str, Any]]) -> list[AsyncGenerationJob]:
        jobs = await asyncio.to_thread(self.sync.submit_many, requests)
        return [self.job(job.id) for job in jobs]

    def job(self, job_id: str) -> AsyncGenerationJob:
        return AsyncGenerationJob(self, job_id)

    async def status(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.status)

    async def close(self) -> None:
        await self.connection.aclose()
        self.sync.connection.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncGenerationJob:
    """A handle on one submitted job, as ``GenerationJob`` with awaitables."""

    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"AsyncGenerationJob({self.id!r})"

    @property
    def _sync(self) -> GenerationJob:
        return self.client.sync.job(self.id)

    async def status(self) -> str:
        status = await self.client.connection.hget(Job.key_for(self.id), "status")
        return status.decode() if status else "missing"

    async def cancel(self) -> bool:
        return await asyncio.to_thread(self._sync.cancel)

    async def events(self, timeout: float | None = None, skip_void: bool = False) -> AsyncIterator[dict[str, Any]]:
        """As ``GenerationJob.events``."""
        conn, key = self.client.connection, stream_key(self.id)
        cursor = EventCursor(self.id, skip_void)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = 1000 if deadline is None else max(1, min(1000, int((deadline - time.monotonic()) * 1000)))
            reply = await conn.xread({key: cursor.last_id}, count=1024, block=wait_ms)
            for _key, entries in reply or []:
                for event in cursor.take(entries):
                    yield event
                    if "finish_reason" in event:
                        return
            if reply:
                continue
            status = await self.status()
            if status in _ENDED or status == "missing":
                if await conn.xread({key: cursor.last_id}, count=1):
                    continue  # the last events landed just now
                await asyncio.to_thread(self._sync._raise_ended, status)
            if status == "finished":
                raise stream_expired(self.id)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id}: no end of stream within {timeout} s")

    async def stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        """As ``GenerationJob.stream``: text pieces; ``StreamRestarted`` if the output starts over after some."""
        read_any = False
        async for event in self.events(timeout, skip_void=True):
            if event.get("reset") and read_any:
                raise StreamRestarted(self.id)
            if event["text"]:
                read_any = True
                yield event["text"]
            if event.get("finish_reason") == "error":
                raise JobFailed(self.id, event.get("error", "failed"))

    async def result(self, timeout: float | None = None) -> dict[str, Any]:
        """As ``GenerationJob.result``: the result once the job finished; ``JobFailed`` or ``JobCanceled``."""
        conn = self.client.connection
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01
        while True:
            async with conn.pipeline(transaction=False) as pipe:
                pipe.get(result_key(self.id))
                pipe.hget(Job.key_for(self.id), "status")
                raw, status = await pipe.execute()
            status = status.decode() if status else "missing"
            result = json.loads(raw) if raw else None
            if result is not None and result.get("status") == "finished":
                return checked(JobResult, result, self.id)
            if status in _ENDED or status == "finished" or (status == "missing" and result is None):
                # The rarer endings (RQ's own result store, a partial result still being written) as the sync client.
                return await asyncio.to_thread(self._sync.result, 5.0)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id}: no result within {timeout} s (status {status})")
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 0.1)


__all__ = ["AsyncClient", "AsyncGenerationJob", "JobCanceled", "JobFailed"]
