"""Heartbeats from a thread of their own: the worker, every job in flight and the statistics of
``roseinfer status`` stay fresh however long a step, a tokenization or a callback takes on the main thread."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from rq.utils import now

from worker.intake import REDIS_DOWN, REDIS_UNAVAILABLE

if TYPE_CHECKING:
    from worker.batch_worker import BatchWorker

log = logging.getLogger("roseinfer.worker")


class Heartbeat:
    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rate = (time.monotonic(), 0)  # (when, tokens) at the last beat, for tokens/s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="roseinfer-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(*REDIS_DOWN):
            self.worker.connection.delete(self.worker.stats_key())  # a stopped worker shows nothing in flight

    def _run(self) -> None:
        interval = self.worker.settings.heartbeat_interval
        while not self._stop.is_set():
            try:
                self.beat()
            except REDIS_UNAVAILABLE as exc:
                log.warning("heartbeat: Redis unavailable (%s)", exc)
            except Exception:
                log.exception("heartbeat failed")
            self._stop.wait(interval)

    def beat(self) -> None:
        """Worker, executions and jobs kept alive in one pipeline, with the statistics."""
        w = self.worker
        ttl = w.get_heartbeat_ttl(None)  # type: ignore[arg-type]
        mono = time.monotonic()
        when, tokens = self._rate
        rate = (w.tokens - tokens) / max(mono - when, 1e-6)
        self._rate = (mono, w.tokens)
        jobs = list(w.in_flight.values())  # a snapshot: the main thread adds and removes jobs meanwhile
        with w.connection.pipeline(transaction=False) as pipe:
            w.heartbeat(max(ttl, w.worker_ttl) + 60, pipeline=pipe)
            for job in jobs:
                job.execution.heartbeat(job.job.started_job_registry, ttl, pipe)
                job.job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            key = w.stats_key()
            pipe.hset(key, mapping={**w.stats(), "generated_tokens": w.tokens, "tokens_per_s": f"{rate:.1f}"})
            # The statistics lapse with the heartbeat: a dead worker drops out of `roseinfer status`.
            pipe.expire(key, ttl)
            pipe.execute()
