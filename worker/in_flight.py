"""A job this worker holds: what it took in, where its stream goes, and how far its end has been written."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from producer.protocol import usage_of
from producer.schema import JobRequest
from worker.publisher import JobStream

NO_USAGE = usage_of(0, 0)  # a job that ended before it ran


@dataclass
class InFlight:
    job: Job
    queue: Queue
    execution: Execution
    request: JobRequest
    stream: JobStream
    started_at: float
    first_token_at: float | None = None
    finished_at: float | None = None  # when its last event came out of the engine (its result is built later)
    resumed_tokens: int = 0  # output tokens an earlier attempt made (its stream's), not timed by this one
    # Its success written through RQ's path (and its completion list pushed): a retry of the end skips those.
    success_written: bool = False
    # Its success callback ran (returned, or raised this): a retry of its end after Redis failed a write does not
    # run it again.
    called_back: bool = False
    callback_error: Exception | None = None
    notified: bool = False
    result_size: int = 0  # about how many bytes its result takes in Redis (``result_bytes``), once it finished
    made_bytes: int = 0  # what its output so far adds to its result (``piece_bytes``): past the bound, it ends
    ended_elsewhere: bool = False  # its end handed to a callback thread: a retry of this end leaves it there
    # When its heartbeat was last written (this host's monotonic clock): at its start, then by the heartbeats.
    beat_at: float = field(default_factory=time.monotonic)

    @property
    def priority(self) -> int:
        return self.request.priority


def enqueued_at(job: InFlight) -> float:
    """When its attempt was enqueued (RQ's stamp, by the producer's clock; a job without one, or one stamped after
    its start by a clock ahead of this one: its start), as a Unix time."""
    return min(job.job.enqueued_at.timestamp(), job.started_at) if job.job.enqueued_at else job.started_at


def ended_timings(job: InFlight) -> dict[str, float]:
    """What the metrics take of a job that ran here and ended other than finished: its time since its enqueue."""
    return {"total_s": time.time() - enqueued_at(job)}


def jobs_named(ids: list[str]) -> str:
    """A log line's subject for a batch of jobs (``job <id>``, or ``<n> jobs: <id>, <id>, ...``): one line per batch,
    still found by any job's id."""
    return f"job {ids[0]}" if len(ids) == 1 else f"{len(ids)} jobs: {', '.join(ids)}"
