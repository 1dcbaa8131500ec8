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


def count(job, connection, *args) -> None:
    """Counts its runs: a test tells a callback run once from one run again."""
    connection.incr(f"hook-probe-count:{job.id}")


def redis_of_its_own_down(job, connection, *args) -> None:
    """A callback whose own Redis (not the worker's) is unreachable: a redis-py error of the callback's."""
    import redis

    connection.incr(f"hook-probe-count:{job.id}")
    redis.Redis(port=1, socket_connect_timeout=0.2).ping()
