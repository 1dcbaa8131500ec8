"""A request's jobs, as the server waits on them: the headers that name them, the wait bounded by ``--timeout`` and
the client's own read timeout, their cancel when the client goes away, and their ends as OpenAI's errors."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from fastapi import Request

from producer.aio import AsyncClient, AsyncGenerationJob
from producer.client import Client
from producer.connection import REDIS_DOWN
from producer.job_errors import JobCanceled, JobFailed
from producer.openai_api import APIError

log = logging.getLogger("roseinfer.server")

MAX_IDS_IN_HEADER = 32  # more: the first id and the count (256 ids, ~9.5 KB, passed a proxy's header buffer)
CANCELING: set[asyncio.Future] = set()  # the cancels on their threads, which a stop waits for (the server's lifespan)


def job_headers(jobs: list[AsyncGenerationJob]) -> dict[str, str]:
    """``x-roseinfer-job-id``: the jobs' ids; past ``MAX_IDS_IN_HEADER`` the first (``<base>-0``) and their count.
    ``x-request-id`` (OpenAI's, which its clients keep as ``_request_id``): the first job's id."""
    first = {"x-request-id": jobs[0].id}
    if len(jobs) <= MAX_IDS_IN_HEADER:
        return {**first, "x-roseinfer-job-id": ",".join(job.id for job in jobs)}
    return {**first, "x-roseinfer-job-id": jobs[0].id, "x-roseinfer-job-count": str(len(jobs))}


def with_jobs(err: APIError, jobs: list[AsyncGenerationJob]) -> APIError:
    err.headers.update(job_headers(jobs))
    return err


def answer_within(request: Request, timeout: float) -> float:
    """Seconds the server waits for an answer's first byte: ``--timeout``, or less where the client says it stops
    reading sooner (the official clients send ``x-stainless-read-timeout``, 600 s by default, ``--timeout``'s own).
    The 504 must reach it first: a client that gave up on its own retried, submitting the job again each time."""
    try:
        read = float(request.headers.get("x-stainless-read-timeout", "inf"))
    except ValueError:
        return timeout
    if not 0 < read < float("inf"):
        return timeout
    return min(timeout, read - max(0.05 * read, min(1.0, 0.2 * read)))  # (the answer's own way back, and skew)


async def results_unless_gone(request: Request, jobs: list[AsyncGenerationJob], timeout: float) -> list[dict[str, Any]]:
    """The jobs' results; their cancel if the client goes away first; a job's failure as an API error."""
    waits = [asyncio.ensure_future(job.result(timeout)) for job in jobs]
    try:
        return await unless_gone(request, jobs, asyncio.gather(*waits), timeout)
    finally:  # one failed: the others' polls stop too (a failed gather leaves its children running)
        for wait in waits:
            wait.cancel()


async def unless_gone(request: Request, jobs: list[AsyncGenerationJob], wait: Any, timeout: float) -> Any:
    """What ``wait`` (an awaitable about ``jobs``) gives; their cancel if the client goes away first (or one
    fails: no one will read the others); a job's failure as an API error."""
    waiting = asyncio.ensure_future(wait)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=0.25)
            if done:
                return waiting.result()
            if await request.is_disconnected():
                raise ConnectionAbortedError
    except (TimeoutError, asyncio.TimeoutError):  # (wait_for's is not the builtin before Python 3.11)
        cancel_all_soon(jobs)
        raise with_jobs(timed_out(timeout), jobs) from None
    except (JobFailed, JobCanceled) as exc:
        if len(jobs) > 1:
            cancel_all_soon(jobs)
        raise with_jobs(job_error(exc), jobs) from None
    except ConnectionAbortedError:
        cancel_all_soon(jobs)
        raise
    except ServerStopping:  # (a stream's first events awaited as the server's grace ends)
        cancel_all_soon(jobs)
        raise with_jobs(stopping(), jobs) from None
    except asyncio.CancelledError:  # the server's stop, its grace over (a client's going away cancels nothing here)
        cancel_all_soon(jobs)
        if (task := asyncio.current_task()) is not None:
            task.uncancel()  # (answered, not torn down: uvicorn wrote a plain-text 500 for it)
        raise with_jobs(stopping(), jobs) from None
    except Exception:  # Redis away, events that cannot be read: no one will read the jobs
        cancel_all_soon(jobs)
        raise
    finally:
        waiting.cancel()
        # Retrieved, whatever it ended with: a gather cancelled after a child failed (or that a child's failure ends
        # as the cancel lands) logged "exception was never retrieved" with its traceback, a disconnect each.
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())


def job_error(exc: JobFailed | JobCanceled) -> APIError:
    if isinstance(exc, JobCanceled):
        return not_to_retry(APIError(500, "the job was canceled", "server_error"))
    # Only a job the worker found at fault is the client's (400): a timeout, a failed step, an abandoned job are not.
    if exc.error_type == "invalid_request":
        return APIError(400, exc.reason, code=exc.error_code)
    if exc.error_type == "timeout":
        return not_to_retry(APIError(504, exc.reason, "timeout"))
    return APIError(500, exc.reason, "server_error")


class ServerStopping(Exception):
    """The server is stopping and its grace for open requests is nearly over: an open stream ends with the stopping
    error and its [DONE], rather than cut when the grace ends (a traceback each, no word to its client)."""


def stopping() -> APIError:
    """The server stopped before the request's jobs ended (they are canceled): another server, or this one once
    restarted, runs it again (the official clients retry a 503)."""
    return APIError(503, "the server is stopping: the request's job was canceled; send it again", "server_error")


def timed_out(timeout: float) -> APIError:
    """The request outlived ``--timeout`` (its jobs are canceled)."""
    return not_to_retry(APIError(504, f"no result within {timeout:g} s", "timeout"))


def not_to_retry(err: APIError) -> APIError:
    """The official clients retry a status >= 500 twice unless told not to: a request that timed out (or whose job
    an operator canceled) would be submitted twice more, adding load to a queue already behind."""
    err.headers["x-should-retry"] = "false"
    return err


def cancel_all_soon(jobs: list[AsyncGenerationJob]) -> None:
    for job in jobs:
        cancel_soon(job)


def cancel_soon(job: AsyncGenerationJob) -> None:
    """Cancel the job on a thread, not awaited: this runs while the request's task is being cancelled."""
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(None, job._sync.cancel)
    CANCELING.add(done)
    done.add_done_callback(CANCELING.discard)
    done.add_done_callback(lambda f: _cancel_failed(job.id, f))
    log.info("job %s canceled: its client went away", job.id)


def _cancel_failed(job_id: str, done: asyncio.Future) -> None:
    """A cancel that did not reach Redis, said in a line (it was asyncio's "exception was never retrieved" and a
    traceback, one per request, when Redis went away first)."""
    if not done.cancelled() and (exc := done.exception()) is not None:
        log.warning("job %s: its cancel did not reach Redis (%s: %s)", job_id, type(exc).__name__, exc)


# How long a submit's jobs that may have gone in unseen are looked for, to be canceled: Redis's stall or outage, then
# the grace a transaction sent before it has to land once Redis answers again.
UNSEEN_PATIENCE_S, UNSEEN_GRACE_S = 120.0, 5.0


def cancel_unseen_jobs(client: AsyncClient, exc: BaseException) -> None:
    """The jobs of a submit that failed on Redis down (its reply lost in a stall; ``maybe_enqueued``), canceled
    where they went in all the same: Redis ran the transaction once it answered, and the job ran for nobody, the
    client told 503 (and its retry made a second one)."""
    job_ids = getattr(exc, "maybe_enqueued", None)
    if not job_ids or getattr(exc, "unseen_handled", False):  # (one batch's error reaches each of its requests)
        return
    exc.unseen_handled = True  # type: ignore[attr-defined]
    threading.Thread(target=_cancel_when_found, args=(client.sync, list(job_ids)), daemon=True).start()


def _cancel_when_found(client: Client, job_ids: list[str]) -> None:
    deadline, backoff, answered_at = time.monotonic() + UNSEEN_PATIENCE_S, 0.5, None
    while job_ids and time.monotonic() < deadline:
        try:
            for job_id in list(job_ids):
                job = client.job(job_id)
                if job.cancel():
                    log.warning("job %s canceled: its submit was answered 503 (Redis unavailable), yet went in", job_id)
                if job.status() != "missing":  # (canceled now, or ended: either way not looked for again)
                    job_ids.remove(job_id)
            answered_at = answered_at or time.monotonic()
        except REDIS_DOWN:
            pass
        if answered_at is not None and time.monotonic() - answered_at > UNSEEN_GRACE_S:
            return  # (not there once Redis answered, and after the grace: the submit never went in)
        time.sleep(backoff)
        backoff = min(backoff * 2, 2.0)
