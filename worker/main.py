"""Start a worker: load the model once, join Redis, serve until stopped."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from functools import partial
from typing import Any

import redis
from redis import Redis

from producer.client import eviction_policy, eviction_warning
from producer.connection import REDIS_DOWN, InvalidRedisURL, UnsafeRedis, connect
from roseinfer.config import ConfigError
from worker.engine_process import EngineProcess, EngineProcessDied, build_engine
from worker.local_redis import MIN_REDIS
from worker.metrics import WorkerMetrics
from worker.pump import EngineBroken
from worker.settings import WorkerSettings

log = logging.getLogger("roseinfer.worker")


def wait_for_redis(connection: Redis, max_backoff: float = 30.0) -> None:
    """Ping until Redis answers: a worker may start before its Redis (compose, a restart). Logged once, then
    once a minute, without the URL's password."""
    backoff, next_log = 0.25, 0.0
    address = _address(connection)
    while True:
        try:
            connection.ping()
            if next_log:
                log.warning("Redis at %s answers", address)
            return
        except redis.exceptions.AuthenticationError:
            raise  # a wrong password is no Redis starting up: one error, not a wait for good
        except REDIS_DOWN as exc:
            refuse_untrusted_certificate(connection, exc)  # (nor is a certificate this host does not trust)
            if time.monotonic() >= next_log:
                log.warning("waiting for Redis at %s (%s); retrying with backoff", address, exc)
                next_log = time.monotonic() + 60
            time.sleep(backoff)
            backoff = min(backoff * 2, max_backoff)


def _address(connection: Redis) -> str:
    """Where the connection goes, as a log line names it: host:port, a Unix socket's path, a Sentinel service."""
    pool = connection.connection_pool
    kwargs = pool.connection_kwargs
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    if getattr(pool, "service_name", None):  # (the primary Sentinel names, wherever it is now)
        return f"the primary of Sentinel service {pool.service_name!r}"
    return "{host}:{port}".format(**{"host": "?", "port": "?", **kwargs})


def refuse_untrusted_certificate(connection: Redis, exc: Exception) -> None:
    if "CERTIFICATE_VERIFY_FAILED" in str(exc) and "mismatch" in str(exc):  # (its CA trusted, its name not this)
        raise InvalidRedisURL(
            f"Redis at {_address(connection)}: its TLS certificate names another host ({exc}); use the host name "
            "its certificate holds in the URL, or ?ssl_check_hostname=false to skip that check"
        ) from None
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        raise InvalidRedisURL(
            f"Redis at {_address(connection)}: its TLS certificate is not trusted here ({exc}); give its CA in the "
            "URL (?ssl_ca_certs=/path/to/ca.pem), or ?ssl_cert_reqs=none to skip the check"
        ) from None


def worker_connection(settings: WorkerSettings) -> Redis:
    """The worker's Redis client: a Redis that stops answering fails a command, as one that is down does (a URL's
    own options win). Set here, for the connections opened before the worker is built too."""
    keepalive = {} if settings.redis_url.lower().startswith("unix:") else {"socket_keepalive": True}  # (a socket: none)
    return connect(settings.redis_url, socket_timeout=settings.socket_timeout, socket_connect_timeout=5, **keepalive)


def build_worker(settings: WorkerSettings, connection: Redis | None = None):
    from worker.batch_worker import BatchWorker, name_in_use

    connection = connection or worker_connection(settings)
    # Where Redis answers already, what it refuses (a login, a database, a name in use, an eviction policy) is said
    # before the model loads (minutes of a GPU's time); a Redis still down is waited for after the load.
    checked = False
    try:
        connection.ping()
    except redis.exceptions.AuthenticationError:
        raise  # (a ConnectionError to redis-py, and no Redis still starting)
    except REDIS_DOWN as exc:
        refuse_untrusted_certificate(connection, exc)
    else:
        with contextlib.suppress(*REDIS_DOWN):
            if settings.name:
                taken = name_in_use(connection, settings.name, settings.heartbeat_interval + settings.heartbeat_grace)
                if taken:
                    raise ConfigError(taken)
            check_redis_version(connection)
            check_not_a_cluster(connection)
            check_eviction_policy(connection, settings.require_noeviction)
            checked = True
    if settings.metrics_port:  # (found at the start, it came after the model's load: minutes of a GPU's)
        WorkerMetrics.check_port(settings.metrics_port)
    if settings.engine_process:
        build = partial(build_engine, settings.model, settings.engine_options(), spare_a_core=True)
        engine = pump = EngineProcess(
            build, settings.event_interval_ms, settings.max_events_per_s, step_timeout=settings.engine_step_timeout
        )
    else:
        engine, pump = build_engine(settings.model, settings.engine_options()), None
    wait_for_redis(connection)
    if not checked:
        check_redis_version(connection)
        check_eviction_policy(connection, settings.require_noeviction)
    return BatchWorker(engine, settings, connection, pump)


def check_redis_version(connection: Redis) -> None:
    """A Redis older than ``MIN_REDIS`` refused: the worker said it served, and every pull failed (no BLMOVE),
    logged each second for good. One that keeps INFO from this login is not refused (its version is not known)."""
    try:
        said = str(connection.info("server").get("redis_version", ""))
    except redis.exceptions.ResponseError:
        return
    version = tuple(int(part) for part in said.split(".")[:2] if part.isdigit())
    if len(version) == 2 and version < MIN_REDIS:
        raise ConfigError(
            f"Redis at {_address(connection)} is {said}: the worker needs Redis "
            f"{'.'.join(map(str, MIN_REDIS))} or later (BLMOVE, GETDEL)"
        )


def check_not_a_cluster(connection: Redis) -> None:
    """A Redis Cluster refused before the model loads: the queue's keys of one job live in several slots (MOVED,
    CROSSSLOT on every pull, said after minutes of a GPU's load). One Redis, replicated (Sentinel) or managed."""
    try:
        enabled = str(connection.info("cluster").get("cluster_enabled", "0"))
    except redis.exceptions.ResponseError:
        return
    if enabled == "1":
        raise ConfigError(
            f"Redis at {_address(connection)} is a Redis Cluster node: roseinfer needs one Redis (a primary with "
            "replicas, through Sentinel or a managed service's endpoint), not a cluster: RQ's keys of a job span slots"
        )


def check_eviction_policy(connection: Redis, required: bool) -> None:
    policy = eviction_policy(connection)
    if required and policy is None:
        raise UnsafeRedis(
            "cannot read Redis's maxmemory-policy (CONFIG GET and INFO memory refused): --require-noeviction "
            "cannot be checked (refusing to start; drop the flag where the policy is known to be noeviction)"
        )
    warning = eviction_warning(connection, policy)
    if warning and required:
        raise UnsafeRedis(f"{warning} (refusing to start: --require-noeviction)")
    if warning:
        log.warning("WARNING: %s", warning)


def _stop_starting(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_worker(settings: WorkerSettings, logging_level: str = "INFO") -> int:
    if threading.current_thread() is threading.main_thread():
        # Until the worker's own handlers (in ``work``), a SIGTERM ends the start: as a container's PID 1 a signal
        # without a handler is ignored, and a stop during the model's load or a wait for Redis waited for the kill.
        signal.signal(signal.SIGTERM, _stop_starting)
    try:
        worker = build_worker(settings)
    except EngineProcessDied as exc:  # its own traceback is in the log above
        log.error("the worker does not start: %s", exc)
        return 1
    log.info("worker %s serving queue %r with %s", worker.name, settings.queue, settings.model)
    try:
        worker.work(burst=settings.burst, logging_level=logging_level)
    except EngineProcessDied as exc:  # its jobs failed (retryably) and were written: a supervisor restarts us
        log.error("worker %s stops: %s", worker.name, exc)
        return 1
    except EngineBroken as exc:  # its jobs handed back to their queues (an engine process's too): restart us
        log.error("worker %s stops: %s", worker.name, exc)
        return 1
    finally:
        if threading.current_thread() is threading.main_thread():
            # Stopped: a signal now ends the process at once. The worker's handlers only set flags, and the exit
            # waits for threads still running (an allowed callback blocked in a call): SIGTERM did nothing then.
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_DFL)
    return 0
