"""Redis clients from a URL: ``redis://``, ``rediss://``, ``unix://`` as redis-py reads them, and
``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`` for a primary that Redis Sentinel
manages (``rediss+sentinel://`` for TLS to it; ``?sentinel_password=`` when the sentinels want one). A Sentinel
client asks the sentinels where the primary is, and asks again after a failover."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis down, unreachable, or not answering within the socket timeout: what waiting (not the request) may mend.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


# Redis up but refusing writes for now (maxmemory with noeviction, a replica during a failover, loading its data):
# back-pressure, not death.
REDIS_REFUSING = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    MasterDownError,  # a replica cut off from its primary mid-failover (replica-serve-stale-data no)
    TryAgainError,
    ClusterDownError,
)
REDIS_UNAVAILABLE = REDIS_DOWN + REDIS_REFUSING


# Error codes of a Redis that will take writes again: another client's script past ``busy-reply-threshold`` (BUSY
# to every command until it ends), a failed snapshot with ``stop-writes-on-bgsave-error`` (MISCONF: a full disk),
# and the refusals above as a script's error wraps them (Redis 6.2: "Error running script ...: -OOM ...").
# UNBLOCKED: a blocking read ended by the server (a primary made a replica: REPLICAOF, by hand or by a tool).
_WAIT_CODES = ("BUSY", "MISCONF", "OOM", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "UNBLOCKED")


def redis_waits(exc: Exception) -> bool:
    """Whether ``exc`` says Redis cannot take this now but will (a write is then waited for, nothing dropped):
    unavailable, or refusing for now with an error redis-py names no class of its own (``_WAIT_CODES``)."""
    if isinstance(exc, REDIS_UNAVAILABLE):
        return True
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc)  # a pipeline's names its command first ("... caused error: BUSY ...")
    return any(
        text.startswith(f"{code} ") or f"caused error: {code} " in text or f"-{code} " in text for code in _WAIT_CODES
    )


def unblocked(exc: BaseException) -> bool:
    """Redis ended a blocking read (``XREAD BLOCK``) itself: a primary made a replica ("UNBLOCKED force unblock
    from blocking operation, instance state changed"). A reader reads on, as after an outage: every stream follower
    ended with it."""
    return isinstance(exc, ResponseError) and str(exc).startswith("UNBLOCKED")


def wrong_type(exc: BaseException) -> bool:
    """Redis's refusal of a command on a key of another type (a key written by hand): that key's fault alone."""
    text = str(exc)  # (a pipeline's names its command first: "... caused error: WRONGTYPE ...")
    return isinstance(exc, ResponseError) and (text.startswith("WRONGTYPE") or "caused error: WRONGTYPE" in text)


SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS to the primary


class InvalidRedisURL(ValueError):
    """A Redis URL that cannot be read (the message says why, without its password)."""


class UnsafeRedis(RuntimeError):
    """Redis may evict the queue's keys, and the operator asked for a Redis that never does."""


@dataclass
class SentinelURL:
    hosts: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    sentinel_password: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the primary's connection options (?ssl_ca_certs=...)


def parse_sentinel_url(url: str) -> SentinelURL | None:
    """The parts of a ``redis+sentinel://`` URL; None for any other URL; InvalidRedisURL saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        return None
    rest, _, query = rest.partition("?")
    credentials, at, rest = rest.rpartition("@")  # (a password may hold a '/': the login ends at the last '@')
    hostlist, _, path = rest.partition("/")
    if not at:
        credentials = ""
    username = password = None
    if credentials:
        user, colon, secret = credentials.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    hosts = []
    for item in hostlist.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise InvalidRedisURL(f"a sentinel address is host:port, got {item!r} in {redacted_url(url)}")
        hosts.append((host.strip("[]"), int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise InvalidRedisURL(f"a Sentinel URL ends in /service or /service/db, got {redacted_url(url)}")
    params = parse_qs(query)
    ssl = SENTINEL_SCHEMES[scheme]
    return SentinelURL(
        hosts,
        unquote(parts[0]),
        int(parts[1]) if len(parts) == 2 else 0,
        username,
        password,
        ssl,
        params.get("sentinel_password", [None])[0],
        _primary_options(params, ssl, url),
    )


def _primary_options(params: dict[str, list[str]], ssl: bool, url: str) -> dict[str, Any]:
    """A Sentinel URL's options for the primary's connections, read as redis-py reads a plain URL's (they were
    dropped: a primary whose certificate needed ?ssl_ca_certs= could not be reached)."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, SSLConnection

    options: dict[str, Any] = {}
    for name, values in params.items():
        if name == "sentinel_password":
            continue
        if name.startswith("ssl_") and not ssl:
            raise InvalidRedisURL(f"{name} in {redacted_url(url)}: a TLS option, for rediss+sentinel:// only")
        try:
            options[name] = URL_QUERY_ARGUMENT_PARSERS.get(name, str)(values[0])
        except (TypeError, ValueError) as exc:
            raise InvalidRedisURL(f"{name}={values[0]} in {redacted_url(url)}: {exc}") from None
    try:  # (what a plain URL's connection takes, checked as ``_check_options`` checks one)
        (SSLConnection if ssl else Connection)(**options)
    except TypeError as exc:
        raise InvalidRedisURL(f"{redacted_url(url)}: an option its connection does not take ({exc})") from None
    return options


QUEUE_URLS_ENV = "ROSEINFER_QUEUE_URLS"


def queue_urls(spec: str | None) -> dict[str, str]:
    """``"chat=redis://a:6379/0;bulk=redis+sentinel://s1:26379,s2:26379/bulk"`` -> {queue: URL}: where each
    queue's Redis deployment is, when queues are spread over several (``;`` apart, since Sentinel URLs hold commas)."""
    mapping: dict[str, str] = {}
    for item in (spec or "").split(";"):
        if not item.strip():
            continue
        queue, eq, url = item.partition("=")
        if not eq or not queue.strip() or not url.strip():
            shown = redacted_url(item)
            raise InvalidRedisURL(f"{QUEUE_URLS_ENV} takes queue=URL pairs separated by ';', got {shown!r}")
        mapping[queue.strip()] = url.strip()
    return mapping


def redacted_url(url: str) -> str:
    """``url`` without its login, in its user info (also of a URL without its scheme) or as a ``password=``
    option."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    # Up to the last '@' of all (a password may hold '/', '?' or '@'): a query's '@' hides the host too, never a login.
    url = f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else f"{scheme}{sep}{rest}"
    return re.sub(r"(?i)([?&](?:sentinel_)?password=)[^&#]*", r"\1***", url)


def _primary_kwargs(s: SentinelURL) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"db": s.db, "username": s.username, "password": s.password, **s.options}
    if s.ssl:
        kwargs["ssl"] = True
    return kwargs


# A blocking client's connections: one per thread with a command in flight (a follower's blocked read holds it up to a
# second, a ``result`` wait its subscription), so the threads sharing it bound them. redis-py 8's pool refused the
# 101st at once ("Too many connections", taken for Redis being down); this is redis-py 7's bound.
SYNC_MAX_CONNECTIONS = 2**31


# A reply, or a connection, that takes longer is an outage (waited out, or an error), not a wait without end: redis-py
# 8's default; before it (redis>=6 is allowed) none, and a Redis that accepted and answered nothing (SIGSTOPped, a
# failover's old primary gone without a reset) held result(timeout=...) and every read for good. The clients' own
# blocking reads stop within a second.
SOCKET_TIMEOUT_S = 5.0
_TIMEOUTS = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_TIMEOUT_S}


def longest_block_s(conn: Redis, wanted: float = 1.0) -> float:
    """How long a blocking read on ``conn`` may wait: ``wanted``, or half its socket timeout where that is shorter (a
    URL's ``socket_timeout=0.5``): a read blocked past it timed out, taken for an outage, and a follower of a job
    still queued gave up on a Redis that answered all along."""
    timeout = conn.connection_pool.connection_kwargs.get("socket_timeout")
    return wanted if not timeout else min(wanted, timeout / 2)


def connect(url: str, **kwargs: Any) -> Redis:
    """A Redis client for ``url`` (any of the forms above)."""
    from redis.sentinel import Sentinel

    return _connect(url, Redis, Sentinel, {"max_connections": SYNC_MAX_CONNECTIONS, **_TIMEOUTS, **kwargs})


# An asyncio client's connections: each command in flight holds one, so a server's burst of requests needs as many
# as it has commands out at once. redis-py 8's pool refused the 101st at once ("Too many connections": a 503 from
# the server at 100 concurrent requests); this one opens up to ASYNC_MAX_CONNECTIONS and then makes a command wait
# for a free one, ASYNC_POOL_WAIT_S at most.
ASYNC_MAX_CONNECTIONS = 256
ASYNC_POOL_WAIT_S = 30.0


def connect_async(url: str, **kwargs: Any) -> AsyncRedis:
    """The ``redis.asyncio`` client for ``url``."""
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio.sentinel import Sentinel

    if parse_sentinel_url(url) is not None:  # redis-py has no waiting pool for a Sentinel primary: redis-py 7's bound
        return _connect(url, AsyncRedis, Sentinel, {"max_connections": SYNC_MAX_CONNECTIONS, **_TIMEOUTS, **kwargs})
    pool = {"max_connections": ASYNC_MAX_CONNECTIONS, "timeout": ASYNC_POOL_WAIT_S, **_TIMEOUTS, **kwargs}
    return _connect(url, AsyncRedis, Sentinel, pool, BlockingConnectionPool)


def _check_timeouts(url: str) -> None:
    """A URL's socket timeouts (they win over the worker's), as seconds above 0: 0 made every socket non-blocking,
    each command failed as a Redis still starting, and a worker waited for it for good; -1 was a traceback."""
    try:
        query = urlsplit(url).query
    except ValueError as exc:  # ("Invalid IPv6 URL") a traceback
        raise InvalidRedisURL(f"{exc} (got {redacted_url(url)})") from None
    for name, values in parse_qs(query).items():
        if name not in ("socket_timeout", "socket_connect_timeout"):
            continue
        for value in values:
            try:
                seconds = float(value)
            except ValueError:
                seconds = 0.0
            if not 0 < seconds < float("inf"):
                raise InvalidRedisURL(f"{name}={value} in {redacted_url(url)}: a number of seconds above 0")


def _connect(
    url: str, client_class: type, sentinel_class: type, kwargs: dict[str, Any], pool_class: type | None = None
) -> Any:
    if not url.strip():
        raise InvalidRedisURL("the Redis URL is empty (ROSEINFER_REDIS_URL set to nothing?): give one, or unset it")
    _check_timeouts(url)
    s = parse_sentinel_url(url)
    if s is None:
        parts = urlsplit(url)
        if parts.scheme in ("redis", "rediss") and parts.path.strip("/") and not parts.path.strip("/").isdigit():
            # redis-py ignores a path it cannot read: the jobs went to database 0
            if "@" in parts.path:  # (a '/' in the password: what follows it is no database, and no message's)
                raise InvalidRedisURL(f"{redacted_url(url)}: a '/' in the login is written %2F")
            raise InvalidRedisURL(f"the database in {redacted_url(url)} is not a number ({parts.path.strip('/')!r})")
        try:
            if pool_class is None:
                client = client_class.from_url(url, **kwargs)
            else:
                client = client_class(connection_pool=pool_class.from_url(url, **kwargs))
                client.auto_close_connection_pool = True  # closed with the client, as the pool from_url makes is
        except ValueError as exc:
            raise InvalidRedisURL(f"{exc} (got {redacted_url(url)}; or redis+sentinel://host:port/service)") from None
        _check_options(client, url)
        return client
    sentinel = sentinel_class(s.hosts, sentinel_kwargs={"password": s.sentinel_password, **_TIMEOUTS}, socket_timeout=5)
    return sentinel.master_for(s.service, **{**kwargs, **_primary_kwargs(s)})  # (the URL's options win)


def _check_options(client: Any, url: str) -> None:
    """A URL's options its connections cannot take (a typo, ?ssl_cert_reqs= on redis://) refused now: redis-py
    passes them on, and the first command raised a TypeError traceback."""
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)  # (made, not connected)
    except TypeError as exc:
        raise InvalidRedisURL(f"{redacted_url(url)}: an option its connection does not take ({exc})") from None
