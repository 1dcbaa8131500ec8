"""The worker's Prometheus metrics (``--metrics-port``): latencies as histograms observed as jobs end and steps
run, and the rest (jobs in flight, queue depth per lane, tokens, KV cache use, preemptions) read from the worker
when scraped. Every worker has a registry of its own, so several in one process (tests) do not collide."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from roseinfer.config import ConfigError

if TYPE_CHECKING:
    from worker.batch_worker import BatchWorker

# Up to two hours: enqueue-to-token times include the wait in a queue, minutes or more for a bulk lane's jobs.
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
# Up to seconds a token and tens of seconds a step: on a CPU a prefill step of 64 prompts takes ~3 s, and every
# one fell in the +Inf bucket (the tops were 1 s and 2.5 s).
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


JOB_ENDS = ("finished", "failed", "retried", "rejected", "canceled", "stopped", "lost")  # roseinfer_jobs_total's


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._server: Any = None  # the /metrics server, once ``serve`` started it
        r = self.registry
        self.jobs = Counter("roseinfer_jobs", "jobs ended here, by final status", ["status"], registry=r)
        for status in JOB_ENDS:  # each series there from the start: rate() and increase() miss a first increment
            self.jobs.labels(status)
        self.ttft = Histogram("roseinfer_ttft_seconds", "enqueue to first token", buckets=_LATENCY, registry=r)
        self.tpot = Histogram(
            "roseinfer_time_per_output_token_seconds", "first token to last, per later token", buckets=_PER_TOKEN,
            registry=r,
        )  # fmt: skip
        self.e2e = Histogram("roseinfer_e2e_latency_seconds", "enqueue to end", buckets=_LATENCY, registry=r)
        self.queue_time = Histogram(
            "roseinfer_queue_time_seconds", "enqueue to start (vLLM's request_queue_time)", buckets=_LATENCY, registry=r
        )
        self.step = Histogram("roseinfer_engine_step_seconds", "one engine step", buckets=_STEP, registry=r)
        self.redis_rtt = Histogram(
            "roseinfer_redis_round_trip_seconds", "one round trip of the sender", buckets=_STEP, registry=r
        )

    def watch(self, worker: BatchWorker) -> None:
        """Read the worker's state at each scrape."""
        self.registry.register(_WorkerState(worker))

    @staticmethod
    def check_port(port: int, host: str = "0.0.0.0") -> None:
        """The ConfigError ``serve`` would raise now (a port taken, one kept for root): said before the model loads."""
        with _said_as_the_flag(port), socket.socket() as probe:  # (as the server binds it)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            probe.listen()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        with _said_as_the_flag(port):
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        """Stop serving, and free the port (a worker started again in this process takes it again)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # Each as it happens, whatever the job's end (observed at a finished job's end only, a canceled or timed-out
    # job was in no histogram, and a long job's first token was counted minutes late). Times from the producer's
    # clock to this host's: a skew made them negative, and a histogram's sum fell.
    def job_started(self, queue_s: float) -> None:
        self.queue_time.observe(max(0.0, queue_s))

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(0.0, ttft_s))

    def job_ended(self, status: str, timings: dict | None, completion_tokens: int = 0) -> None:
        """``timings``: the job's ``total_s`` (a job that ran here and ended: finished, failed, canceled, stopped),
        and for its time per token ``first_token_at`` and ``finished_at``, with ``completion_tokens`` those this
        attempt made of its longest sample."""
        self.jobs.labels(status).inc()
        if not timings:
            return
        if completion_tokens > 1 and timings.get("first_token_at") is not None:
            # (this host's wall clock at both ends: a step back of it between them, NTP's, made it negative)
            spent = max(0.0, timings["finished_at"] - timings["first_token_at"])
            self.tpot.observe(spent / (completion_tokens - 1))
        self.e2e.observe(max(0.0, timings["total_s"]))


class _WorkerState(Collector):
    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator:
        w = self.worker
        engine = w.engine
        yield GaugeMetricFamily("roseinfer_jobs_in_flight", "jobs held by this worker", value=len(w.in_flight))
        # vLLM's num_requests_running and _waiting: of those held, the ones in the batch and those waiting for a
        # place in it (a worker holds a quarter more than its batch: they were in no gauge, and their wait in no
        # queue's depth). Sequences: a job of n samples counts n.
        scheduler = engine.scheduler
        yield GaugeMetricFamily(
            "roseinfer_requests_running", "sequences in the engine's running batch", value=scheduler.num_running
        )
        yield GaugeMetricFamily(
            "roseinfer_requests_waiting", "sequences waiting in the engine for a place in its batch (preempted too)",
            value=scheduler.num_waiting,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "roseinfer_jobs_ending", "jobs ended here whose ends are still being written (behind allowed callbacks)",
            value=len(w._ending),
        )  # fmt: skip
        depth = GaugeMetricFamily(
            "roseinfer_queue_depth",
            "jobs waiting in each lane (the queue's, the same from every worker)",
            labels=["lane"],
        )
        depths, answered = _depths(w)
        for name, count in depths:
            depth.add_metric([name], count)
        yield depth
        yield GaugeMetricFamily(
            "roseinfer_redis_up", "whether Redis answered this scrape (1) or not (0)", value=answered
        )
        beat = getattr(getattr(w, "_heartbeat", None), "last_beat_at", None)
        if beat is not None:  # (a probe compares it with the time: a worker whose beats stopped is stuck or cut off)
            yield GaugeMetricFamily(
                "roseinfer_last_heartbeat_timestamp_seconds", "when Redis last took this worker's heartbeat", value=beat
            )
        yield CounterMetricFamily("roseinfer_generated_tokens", "tokens generated here", value=w.tokens)
        yield CounterMetricFamily(
            "roseinfer_prompt_tokens", "prompt tokens of the requests run here (each prompt once, cache hits included)",
            value=engine.stats.num_prompt_tokens_computed,
        )  # fmt: skip
        yield CounterMetricFamily(
            "roseinfer_prompt_tokens_cached", "of those, the ones the prefix cache held (not computed)",
            value=getattr(engine.stats, "num_prompt_tokens_cached", 0),
        )  # fmt: skip
        kv = engine.kv
        yield GaugeMetricFamily(
            "roseinfer_kv_cache_usage_ratio", "share of KV cache blocks in use",
            value=1 - kv.num_free_blocks / kv.num_blocks,
        )  # fmt: skip
        yield CounterMetricFamily(
            "roseinfer_preemptions", "requests preempted (recomputed later)", value=engine.scheduler.num_preemptions
        )


def _depths(worker: BatchWorker) -> tuple[list[tuple[str, int]], bool]:
    """Each lane's length, read now: the sender's reading is only as fresh as its last round trip, and an idle worker
    makes none (a queue filling while it was suspended read 0). Where Redis does not answer, that reading; and
    whether it answered."""
    lanes = worker.lane_depths()
    try:
        with worker.connection.pipeline(transaction=False) as pipe:
            for _, queue, _ in lanes:
                pipe.llen(queue.key)
            return [(queue.name, count) for (_, queue, _), count in zip(lanes, pipe.execute())], True
    except redis.exceptions.RedisError:
        return [(queue.name, count) for _, queue, count in lanes if count is not None], False


@contextlib.contextmanager
def _said_as_the_flag(port: int) -> Iterator[None]:
    """A port the server cannot listen on, as one line naming the flag (create_server's error repeats the address)."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: {exc.strerror or exc}") from None
