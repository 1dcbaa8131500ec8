"""Worker settings: command-line flags, else ``ROSEINFER_*`` environment variables, else these defaults.

The engine's options are not declared here: ``WorkerSettings`` takes every field of ``roseinfer.EngineConfig``
(name, type, default, help) as a setting of the same name, and checks them with the engine's own rules.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import typing
from typing import Literal

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer.protocol import DEFAULT_QUEUE, STREAM_TTL_AFTER_END_S, check_queue_name
from roseinfer.config import ENGINE_ENV_VARS, EngineConfig, engine_options
from worker.intake import MAX_SECONDS, MULTI_LANE_WAIT_S, webhook_target

DAY = 24 * 3600  # the longest interval: a thread's wait past threading.TIMEOUT_MAX raises

ENV_PREFIX = "ROSEINFER_"
# Read by other commands: the producer's (the queues' URLs), serve's (its key, its CORS origins), the tests'.
OTHER_ENV_VARS = (
    "ROSEINFER_TEST_REDIS_SERVER", "ROSEINFER_QUEUE_URLS", "ROSEINFER_API_KEY", "ROSEINFER_ALLOWED_ORIGINS"
)  # fmt: skip


class QueueSettings(BaseSettings):
    """The worker's own settings (the engine's are added to these in ``WorkerSettings``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="the Redis to serve (redis://, rediss://, unix://, redis+sentinel://); without the flag, the "
        "queue's entry in $ROSEINFER_QUEUE_URLS comes first",
    )
    queue: str = Field(DEFAULT_QUEUE, min_length=1, description="the RQ queue to pull jobs from")
    name: str | None = Field(
        None, description="worker name in RQ (default: a random one, as RQ gives; a name in use is refused)"
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="places in the batch its jobs held at once take, running and waiting (a job of n "
        "samples takes n; default: max_num_seqs + a quarter)",
    )
    # At most what RQ and Redis's EXPIRE take (past it, every write that sets a TTL failed, events with it).
    stream_ttl: int = Field(
        24 * 3600, ge=1, le=MAX_SECONDS,
        description="seconds a running job's replay stream lives, from its first event: more than a job runs",
    )  # fmt: skip
    stream_ttl_after_end: int | None = Field(
        None,
        ge=1,
        le=MAX_SECONDS,
        description=f"seconds a job's replay stream lives after its last event (default: {STREAM_TTL_AFTER_END_S}, "
        "or stream_ttl where that is shorter; its result keeps its own)",
    )
    result_ttl: int = Field(
        24 * 3600,
        ge=1,
        le=MAX_SECONDS,
        description="seconds a result is kept: a job's that sets no result_ttl (a producer's in another language; the "
        "Python client and the roseinfer commands set their own, Client(result_ttl=), a day), a canceled or rejected "
        "job's",
    )
    # XADD's MAXLEN is a signed 64-bit count: past it every event write failed.
    stream_maxlen: int = Field(100_000, ge=16, le=2**63 - 1, description="events kept per replay stream")
    # Recovery of a dead worker's jobs takes at most heartbeat_interval + heartbeat_grace + maintenance_interval
    # (about 55 s with these), run by any surviving worker.
    heartbeat_interval: int = Field(
        10, ge=1, le=DAY, description="seconds between heartbeats of the worker and its jobs"
    )
    heartbeat_grace: int = Field(
        30, ge=1, le=DAY, description="seconds a missed heartbeat is forgiven before jobs return"
    )
    maintenance_interval: int = Field(
        15, ge=1, le=DAY, description="seconds between RQ registry clean-ups (dead workers)"
    )
    # Short, so signals and maintenance stay prompt.
    idle_wait: float = Field(
        MULTI_LANE_WAIT_S,  # (the default was 1.0, which waited 0.2: the help said so beside a default of 1.0)
        gt=0,
        le=60,
        description="seconds a pull blocks on an empty queue when nothing runs, 0.2 at most (a larger value waits "
        "0.2): a worker serves two lanes or more (interactive, bulk) and looks at each in between",
    )
    burst: bool = Field(False, description="quit when the queue is empty and every job is done")
    # The worker's threads and the step loop share one interpreter lock in one process: apart, neither waits.
    engine_process: bool = Field(
        False, description="run the engine in a process of its own, so Redis work never holds up a step"
    )
    # vLLM's engine has the like (VLLM_ENGINE_ITERATION_TIMEOUT_S).
    engine_step_timeout: float = Field(
        300, ge=0, description="seconds an engine step may run before the engine is taken for hung: an engine "
        "process is killed and its jobs fail retryably; an engine in the worker's process ends the process (exit "
        "70), and other workers recover its jobs (0: wait for good; else 1 or more)",
    )  # fmt: skip
    event_interval_ms: int = Field(
        20, ge=0, le=1000, description="ms a job's new text may wait to share one event with the next steps' "
        "(its first piece and its end go at once)",
    )  # fmt: skip
    # Events are Redis's work per token (an XADD and a PUBLISH each): a budget per worker keeps a fleet's load on
    # one Redis bounded however many jobs each worker runs. With few jobs the interval above rules.
    max_events_per_s: int = Field(
        2000, ge=1, le=1_000_000, description="running jobs' events per second a worker sends at most: with many "
        "jobs in flight each job's text waits longer (jobs / this seconds) to share an event",
    )  # fmt: skip
    # A job names nothing that runs: RQ callbacks and webhooks are refused unless allowed here by exact name.
    allow_callback: list[str] = Field(
        default_factory=list, description="an RQ callback (module.function) jobs may name; repeatable"
    )
    allow_webhook_host: list[str] = Field(
        default_factory=list,
        description="a host (its scheme's default port) or host:port that jobs' RQ webhooks may call; repeatable",
    )
    drain_timeout: float | None = Field(
        None, gt=0, le=DAY, allow_inf_nan=False,
        description="seconds a stop waits for the jobs generating to end before it hands the rest back to the queue "
        "(as a second signal does); none: no limit. Give less than the orchestrator's grace before its kill",
    )  # fmt: skip
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        description="the worker's log level: INFO has a line per batch of jobs started and ended "
        "(`roseinfer -v worker`: DEBUG)",
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="serve Prometheus metrics on this port at /metrics (off by default)"
    )
    require_noeviction: bool = Field(
        False, description="refuse to start unless Redis's maxmemory-policy is noeviction (else: a loud warning)"
    )
    # vLLM's --served-model-name: copies of one model at other paths on other machines are one model to clients.
    served_model_name: str | None = Field(
        None, min_length=1, description="the model's name in results, `roseinfer status` and the server's "
        "/v1/models (default: --model)",
    )  # fmt: skip
    max_job_bytes: int = Field(
        4 * 2**20, ge=1024, description="largest job payload, in bytes, read before anything is tokenized"
    )
    # One result is one Redis write: past Redis's 512 MB an argument resets the connection, which the worker took for
    # an outage and tried again for good (n=64 x 1,900 tokens x 20 logprobs: 100 MB). Past this the job fails alone.
    max_result_bytes: int = Field(
        64 * 2**20, ge=2**20, le=256 * 2**20, description="largest result a job may leave in Redis, in bytes "
        "(about: its text, token ids and logprobs); a job past it fails alone once its output passes it, not retried",
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _none_unsets(cls, data: object) -> object:
        """``none`` (or nothing) for a setting that may be unset, from a flag or the environment: unset, as its help
        says (``ROSEINFER_DRAIN_TIMEOUT=none`` was 'not a valid number'). Text settings keep the word."""
        if not isinstance(data, dict):
            return data
        data = dict(data)  # (the caller's own stays as it was)
        for name, value in list(data.items()):
            field = cls.model_fields.get(name)
            if field is None or not isinstance(value, str) or value.strip().lower() not in ("none", ""):
                continue
            kinds = typing.get_args(field.annotation)
            if type(None) in kinds and str not in kinds:
                data[name] = None
        return data

    @field_validator("queue")
    @classmethod
    def _one_queue(cls, value: str) -> str:
        return check_queue_name(value)

    @field_validator("allow_webhook_host")
    @classmethod
    def _bare_hosts(cls, hosts: list[str]) -> list[str]:
        # A webhook's host is compared as urlsplit reads it (lower case): "https://h" or "" were taken, and matched no
        # webhook, each refused at its job. A port is the operator's to allow too (``HookPolicy``).
        checked = []
        for host in hosts:
            bare = host.strip().lower()
            found = re.fullmatch(r"([a-z0-9._-]+|\[(?:[0-9a-f]*:){2,}[0-9a-f.]*\]|(?:[0-9a-f]*:){2,}[0-9a-f.]*)"
                                 r"(?::([0-9]{1,5}))?", bare)  # (a name, IPv4 or IPv6, and a port)  # fmt: skip
            if found is None or (found[2] is not None and not 0 < int(found[2]) < 65536):
                raise ValueError(
                    f"{host!r}: a host name or address, and a port where not its scheme's own (no scheme or path): "
                    "hooks.example.com, hooks.example.com:8443"
                )
            checked.append(webhook_target(found[1].strip("[]"), int(found[2]) if found[2] else None))
        return checked

    @field_validator("engine_step_timeout")
    @classmethod
    def _a_step_may_take_a_second(cls, value: float) -> float:
        if 0 < value < 1:  # (every step outlasted a quarter of it: the worker ended itself on its first)
            raise ValueError("an engine step may take a second at least: 0 (wait for good) or 1 or more")
        if value == float("inf"):  # (NaN and negatives: refused by ge=0 already)
            raise ValueError("a number of seconds (0: wait for good)")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value  # (ROSEINFER_LOG_LEVEL=warning, as RQ's flag)

    @model_validator(mode="after")
    def _engine_options_are_valid(self) -> QueueSettings:
        self.engine_config()  # the engine's own checks, before anything loads or connects
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{opt.name: getattr(self, opt.name) for opt in engine_options()})

    def engine_options(self) -> dict:
        """Keyword arguments for ``roseinfer.LLM(model, **options)``."""
        return {opt.name: getattr(self, opt.name) for opt in engine_options() if opt.name != "model"}

    @property
    def socket_timeout(self) -> int:
        """The worker's Redis socket timeout: its longest blocking pull and 5 s. (RQ's own, its dequeue wait and 10,
        415 s, made a Redis that stops answering hang every command for 7 minutes without a word.) A pull blocks
        ``MULTI_LANE_WAIT_S`` at most, whatever ``idle_wait`` says: --idle-wait 60 made a Redis that stopped
        answering go unnoticed 65 s, for a wait that never came."""
        return math.ceil(min(self.idle_wait, MULTI_LANE_WAIT_S)) + 5

    @property
    def model_name(self) -> str:
        """The name clients know the model by."""
        return self.served_model_name or self.model  # type: ignore[attr-defined]

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.max_num_seqs + max(1, self.max_num_seqs // 4)


WorkerSettings = create_model(
    "WorkerSettings",
    __base__=QueueSettings,
    __doc__="Everything a worker is told: its own settings and every engine option.",
    **{opt.name: (opt.type, Field(opt.default, description=opt.help)) for opt in engine_options()},
)


def known_env_vars() -> set[str]:
    return {ENV_PREFIX + name.upper() for name in WorkerSettings.model_fields} | set(ENGINE_ENV_VARS + OTHER_ENV_VARS)


def unknown_env_vars(environ: dict[str, str] | None = None) -> list[str]:
    """Warnings for ``ROSEINFER_`` variables nothing reads (a misspelt one would otherwise be silently ignored)."""
    known = known_env_vars()
    settings = {ENV_PREFIX + field.upper() for field in WorkerSettings.model_fields}  # (read in any case)
    warnings = []
    for name in sorted(environ if environ is not None else os.environ):
        if not name.upper().startswith(ENV_PREFIX) or name in known:
            continue
        if name.upper() in settings:  # pydantic's settings read names in any case; os.environ.get does not
            warnings.append(
                f"warning: {name} is read by the worker as {name.upper()}, but not by every command (the producer's "
                f"read capitals): write it {name.upper()}"
            )
        elif name.upper() in known:  # (an engine or server variable: read in capitals alone, by everything)
            warnings.append(f"warning: {name} is ignored: write it {name.upper()}")
        else:
            # (by the part after the prefix: the prefix's likeness alone made ROSEINFER_PORT "ROSEINFER_BURST?")
            suffixes = {k[len(ENV_PREFIX) :]: k for k in known}
            close = difflib.get_close_matches(name.upper()[len(ENV_PREFIX) :], list(suffixes), n=1)
            hint = f"; did you mean {suffixes[close[0]]}?" if close else ""
            warnings.append(f"warning: {name} is not a roseinfer setting and is ignored{hint}")
    return warnings
