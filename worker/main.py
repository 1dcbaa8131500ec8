"""Start a worker: load the model once, join Redis, serve until stopped."""

from __future__ import annotations

import logging

from redis import Redis

from worker.settings import WorkerSettings

log = logging.getLogger("roseinfer.worker")


def build_worker(settings: WorkerSettings, connection: Redis | None = None):
    from roseinfer import LLM
    from worker.batch_worker import BatchWorker

    connection = connection or Redis.from_url(settings.redis_url)
    connection.ping()  # a wrong URL fails here, before minutes of model loading
    engine = LLM(settings.model, **settings.engine_options()).engine
    return BatchWorker(engine, settings, connection)


def run_worker(settings: WorkerSettings, logging_level: str = "INFO") -> int:
    worker = build_worker(settings)
    log.info("worker %s serving queue %r with %s", worker.name, settings.queue, settings.model)
    worker.work(burst=settings.burst, logging_level=logging_level)
    return 0
