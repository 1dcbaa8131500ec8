"""A callback a job can name (``hook_probe.record``): it leaves a mark in Redis, so a test sees whether it ran."""

from __future__ import annotations


def record(job, connection, *args) -> None:
    connection.set(f"hook-probe:{job.id}", "ran")


def record_unlisted(job, connection, *args) -> None:
    """The same, under a name no test worker allows."""
    connection.set(f"hook-probe:{job.id}", "ran")


def boom(job, connection, *args) -> None:
    """A callback that raises, as an operator's may."""
    raise RuntimeError("boom from the success callback")


def refused_once(job, connection, *args) -> None:
    """Redis refusing the write once (full memory), as RQ's success pipeline meets it; then it takes it."""
    from redis.exceptions import ResponseError

    if connection.set(f"hook-probe-refused:{job.id}", "1", nx=True):
        raise ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    connection.set(f"hook-probe:{job.id}", "ran")


def record_failure(job, connection, *args) -> None:
    """A mark of its own, for a test that tells a job's failure callback from its other ones."""
    connection.set(f"hook-probe-failure:{job.id}", "ran")


def slow(job, connection, *args) -> None:
    """A callback slower than a test worker's heartbeat TTL (3 s there): the jobs ending behind it wait."""
    import time

    time.sleep(5)


def held(job, connection, *args) -> None:
    """Marks that it runs, then waits until a test lets it go (30 s at most)."""
    import time

    connection.set(f"hook-probe:{job.id}", "running")
    deadline = time.monotonic() + 30
    while not connection.exists(f"hook-probe-release:{job.id}") and time.monotonic() < deadline:
        time.sleep(0.01)


def record_thread(job, connection, *args) -> None:
    """Marks the name of the thread it ran on."""
    import threading

    connection.set(f"hook-probe-thread:{job.id}", threading.current_thread().name)
