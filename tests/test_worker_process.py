"""``roseinfer worker`` as a real process: a SIGKILL loses no job, SIGTERM drains, twice hands jobs back."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest
from redis import Redis

from producer import Client
from worker.cli import worker_command


def _start_worker(redis_url: str, queue: str, model: str, *extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        # Short heartbeats and maintenance so recovery takes seconds here (defaults: well under two minutes).
        "ROSEINFER_HEARTBEAT_GRACE": "2",
    }
    cmd = worker_command(
        redis_url,
        queue,
        model,
        "--max-num-seqs",
        "4",
        "--max-in-flight",
        "6",
        "--heartbeat-interval",
        "1",
        "--maintenance-interval",
        "1",
        *extra,
    )
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_started(client: Client, jobs, count: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(job.status() == "started" for job in jobs) >= count and client.connection.exists(
            f"roseinfer:stream:{jobs[0].id}"
        ):
            return
        time.sleep(0.05)
    raise AssertionError("the worker never started the jobs")


@pytest.fixture
def queue_name() -> str:
    return f"proc-{uuid.uuid4().hex[:8]}"


def test_sigkill_loses_no_job_and_streams_stay_whole(redis_url, tiny_chat_model, queue_name):
    client = Client(redis_url, queue=queue_name)
    jobs = client.submit_many(
        [
            {"prompt": f"Long story {i}", "max_tokens": 150, "temperature": 0.9 if i % 2 else 0.0, "ignore_eos": True}
            for i in range(10)
        ]
    )
    first = _start_worker(redis_url, queue_name, tiny_chat_model, "--max-num-batched-tokens", "64")
    try:
        _wait_started(client, jobs, 4)
        time.sleep(0.3)  # some tokens out
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert any(job.status() == "started" for job in jobs)
        killed_at = time.time()
        second = _start_worker(redis_url, queue_name, tiny_chat_model)
        try:
            results = [job.result(timeout=120) for job in jobs]
            recovery = time.time() - killed_at
        finally:
            second.terminate()
            second.wait(timeout=60)
    finally:
        first.kill()
    for job, res in zip(jobs, results):
        assert res["usage"]["completion_tokens"] == 150
        # The retried attempt regenerates the same tokens and does not repeat what was already streamed.
        assert "".join(job.stream(timeout=10)) == res["text"]
        events = list(job.events(timeout=10))
        assert [e["n"] for e in events] == list(range(len(events)))
        assert sum(len(e["token_ids"]) for e in events) == 150
    assert recovery < 60, recovery


def test_sigterm_drains_jobs_in_flight_and_leaves_the_rest_queued(redis_url, tiny_chat_model, queue_name):
    client = Client(redis_url, queue=queue_name)
    jobs = client.submit_many([{"prompt": f"Drain {i}", "max_tokens": 120, "ignore_eos": True} for i in range(12)])
    proc = _start_worker(redis_url, queue_name, tiny_chat_model, "--max-num-batched-tokens", "64")
    _wait_started(client, jobs, 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    statuses = [job.status() for job in jobs]
    assert "started" not in statuses
    finished = [job for job, s in zip(jobs, statuses) if s == "finished"]
    assert 1 <= len(finished) <= 6  # what was in flight (at most --max-in-flight) finished
    for job in finished:
        assert job.result(timeout=5)["usage"]["completion_tokens"] == 120
    assert set(statuses) <= {"finished", "queued"}
    assert client.queue.count == statuses.count("queued")


def test_second_sigterm_hands_jobs_back_to_the_queue(redis_url, tiny_chat_model, queue_name):
    client = Client(redis_url, queue=queue_name)
    jobs = client.submit_many([{"prompt": f"Back {i}", "max_tokens": 250, "ignore_eos": True} for i in range(4)])
    proc = _start_worker(redis_url, queue_name, tiny_chat_model, "--max-num-batched-tokens", "16")
    _wait_started(client, jobs, 4)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    assert [job.status() for job in jobs] == ["queued"] * 4
    assert client.queue.count == 4
    assert Redis.from_url(redis_url).zcard(f"rq:wip:{queue_name}") == 0
    # Another worker picks them up; retries were not spent.
    assert all(job.rq_job.retries_left == 2 for job in jobs)


def test_a_stock_rq_worker_runs_the_same_jobs_one_at_a_time(redis_url, tiny_chat_model, queue_name):
    client = Client(redis_url, queue=queue_name)
    jobs = client.submit_many([{"prompt": f"Stock {i}", "max_tokens": 5, "temperature": 0} for i in range(2)])
    env = {**os.environ, "ROSEINFER_MODEL": tiny_chat_model}
    subprocess.run(
        ["rq", "worker", "--burst", "-S", "rq.serializers.JSONSerializer", "-u", redis_url, queue_name],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    for job in jobs:
        res = job.result(timeout=5)
        assert res["usage"]["completion_tokens"] == 5
        assert job.rq_job.return_value() == res
        assert "".join(job.stream(timeout=5)) == res["text"]
