"""What the producer raises: a job that failed, was canceled or is not there; a request refused before it was
sent; a stream that cannot be read whole; events off the protocol."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from rq.exceptions import NoSuchJobError

from producer.schema import describe_validation_error
from producer.wire import read_check


class JobError(Exception):
    """A job ended without a result. ``result`` holds what the worker recorded, if anything; ``error_type`` whose
    fault a failure was, as the worker said (``invalid_request``, ``timeout``, ``server_error``; None: not said);
    ``error_code`` what it was where a client can act on it (``context_length_exceeded``; None: not said)."""

    def __init__(
        self,
        job_id: str,
        reason: str,
        result: dict[str, Any] | None = None,
        error_type: str | None = None,
        error_code: str | None = None,
    ) -> None:
        super().__init__(f"job {job_id}: {reason}")
        self.job_id, self.reason, self.result = job_id, reason, result
        self.error_type = error_type or (result or {}).get("error_type")
        self.error_code = error_code or (result or {}).get("error_code")


class JobFailed(JobError):
    @classmethod
    def of_event(cls, job_id: str, event: dict[str, Any]) -> JobFailed:
        """The failure a job's last event (``finish_reason: error``) says."""
        reason, fault, code = event.get("error", "failed"), event.get("error_type"), event.get("error_code")
        return cls(job_id, reason, error_type=fault, error_code=code)


class ResultNotKept(JobFailed):
    """The job finished, but its result is not kept: ``result_ttl=0`` (RQ deletes such a job as it finishes), or
    expired. Its text went out on its stream. A ``JobFailed``, as it was before."""


class JobCanceled(JobError):
    pass


class NoSuchJob(JobFailed, NoSuchJobError):
    """No job of that id on this Redis: never submitted, or expired. A ``JobFailed`` (what it was before), and
    RQ's ``NoSuchJobError``, which RQ's users catch for it."""


class InvalidRequest(ValueError):
    pass


class JobIdTaken(InvalidRequest):
    """Ids given for new jobs that name jobs still queued or running (``job_ids``: all of them)."""

    def __init__(self, job_ids: list[str], status: str, stopping: list[str] | None = None) -> None:
        """``stopping``: those of ``job_ids`` whose job was canceled and whose run its worker is still stopping
        (free again within a step or so)."""
        super().__init__(
            f"job id {job_ids[0]!r} is taken by a job that is {status}: wait for it to end or cancel it, or give "
            "another id" + (f" ({len(job_ids) - 1} more ids are taken too)" if len(job_ids) > 1 else "")
        )
        self.job_ids, self.status, self.stopping = job_ids, status, stopping or []


class StreamGap(Exception):
    """Events of the job's stream were trimmed before they were read (the worker keeps ``stream_maxlen`` entries a
    job): what the stream gives is not the whole output. ``result()`` holds it."""

    def __init__(self, job_id: str, first: int, last: int) -> None:
        super().__init__(
            f"job {job_id}: events {first}-{last} of its stream were gone before they were read (trimmed to the "
            "worker's stream_maxlen, or the stream key deleted or evicted); its text here is not whole: read result()"
        )
        self.job_id = job_id


class StreamRestarted(Exception):
    """The job's output started over (a retry could not resume what an earlier attempt streamed): the text
    already read from ``stream()`` is void. Call ``stream()`` again for the new output from its start."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: its output restarted from the beginning; the text read so far is void")
        self.job_id = job_id


class ProtocolError(JobError):
    """What a worker wrote does not follow the protocol (docs/protocol.md, docs/schemas/)."""


class StreamExpired(StreamGap):
    """Finished, but its replay stream expired before it was read to its end (10 minutes after the end, by
    default): ``events()`` raises this, ``stream()`` gives the result's text instead. Not a failure (it was a
    ``JobFailed``, so ``except JobFailed`` took a finished job for failed): ``result()`` holds the output."""

    def __init__(self, job_id: str) -> None:
        Exception.__init__(self, f"job {job_id}: the job finished but its token stream has expired; use result()")
        self.job_id = job_id


def stream_expired(job_id: str) -> StreamExpired:
    return StreamExpired(job_id)


def checked(model: type, value: dict[str, Any], job_id: str) -> dict[str, Any]:
    """``value`` if it follows the protocol's schema (the same models the schemas are generated from), fields it
    does not know aside (``read_check``)."""
    try:
        read_check(model, value)
    except ValidationError as exc:
        raise ProtocolError(job_id, f"{model.__name__} off the protocol: {describe_validation_error(exc)}") from None
    return value
