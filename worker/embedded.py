"""``roseinfer serve --embedded``: a private Redis, a worker on a thread and the OpenAI-compatible server, in one
process, so ``curl`` works on a laptop with nothing else installed (a ``redis-server`` on the PATH is used when
there is one, else fakeredis' embedded server)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("roseinfer.worker")
# How long a job's result and hash outlive its answer in the embedded Redis: no one else reads that Redis, and it
# lives in the command's memory (a day's, the default, took ~13 KB a request: a busy day, hundreds of MB).
EMBEDDED_RESULT_TTL = 600


def serve_embedded(args: argparse.Namespace) -> int:
    from producer.cli import target
    from producer.server import run_server, server_client
    from worker.local_redis import (
        embedded_connection,
        start_embedded_redis,
        start_private_redis,
        stop_private_redis,
    )
    from worker.main import build_worker
    from worker.settings import WorkerSettings

    # A SIGTERM from here on ends the command through its finally (the worker stopped, the Redis too): one during
    # the model's load killed it outright, its redis-server and folder left behind. uvicorn re-raises a SIGTERM once
    # it has shut down, which comes here too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    redis_proc = worker = thread = None
    try:  # (a bad option or model below must not leave the redis-server running)
        url, redis_proc = start_private_redis(own_session=True)  # (stopped below, whatever stops the command)
        connection = None
        if redis_proc is None:
            url = start_embedded_redis()
            connection = embedded_connection(url)
        queue = target(args)[1]  # --queue, else ROSEINFER_QUEUE; the Redis is this command's own
        given = {k: v for k, v in {"model": args.model, "dtype": args.dtype}.items() if v is not None}
        if "ROSEINFER_RESULT_TTL" not in os.environ:  # (a canceled or rejected job's)
            given["result_ttl"] = EMBEDDED_RESULT_TTL
        settings = WorkerSettings(redis_url=url, queue=queue, **given)  # (else ROSEINFER_MODEL, ROSEINFER_DTYPE)
        log.warning("embedded Redis at %s; loading %s", url, settings.model)
        worker = build_worker(settings, connection)
        thread = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
        thread.start()
        client = server_client(
            url, queue, connection=embedded_connection(url) if connection is not None else None,
            result_ttl=EMBEDDED_RESULT_TTL, failure_ttl=EMBEDDED_RESULT_TTL,
        )  # fmt: skip
        return run_server(
            url, queue, args.host, args.port, args.api_key, args.timeout, client=client,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            allowed_origins=args.allowed_origins,
        )  # fmt: skip
    finally:
        if worker is not None and thread is not None:
            worker.request_stop()
            thread.join(timeout=30)
        stop_private_redis(redis_proc)
