"""The queue end to end against a real Redis server: producer -> batching worker -> streams and results."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest
from conftest import (
    ThreadWorker,
    expire_together,
    requeue_as_resumed,
    slow_engine_steps,
    tpot_counted_after,
    tpot_histogram,
    tpot_settled,
)
from redis import Redis
from rq import Queue, RateLimit
from rq.command import send_stop_job_command
from rq.job import Job
from rq.rate_limit import RateLimitRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from producer import Client, InvalidRequest, JobCanceled, JobFailed
from producer.protocol import OWNER_FIELD, result_from_entries, result_key, stream_key
from worker.jobs import job_seed


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=16, max_in_flight=24, heartbeat_interval=1)
    yield w, Client(redis_url, queue=w.queue)
    w.stop()


def _varied_requests(n: int) -> list[dict]:
    reqs = []
    for i in range(n):
        r: dict = {"max_tokens": 1 + (i * 7) % 24, "custom_id": f"req-{i}"}
        if i % 3 == 0:
            r["messages"] = [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]
        else:
            r["prompt"] = f"Once upon a time, story {i} " + "and then " * (i % 5)
        kind = i % 5
        if kind == 0:
            r["temperature"] = 0
        elif kind == 1:
            r.update(temperature=0.8, seed=i)
        elif kind == 2:
            r.update(temperature=1.0, top_k=20, top_p=0.9)  # no seed: the worker derives one per job
        elif kind == 3:
            r.update(temperature=0.7, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2)
        else:
            r.update(temperature=0, repetition_penalty=1.3, min_tokens=1)
        reqs.append(r)
    return reqs


def _reference(model: str, jobs, reqs, **engine) -> list[list[int]]:
    """The token ids of ``_reference_outputs``."""
    return [o.token_ids for o in _reference_outputs(model, jobs, reqs, **engine)]


def _reference_outputs(model: str, jobs, reqs, **engine) -> list:
    """The same requests through the engine in-process (``engine``: its options), with the seed the worker uses
    for each job: each request's first completion."""
    from roseinfer import LLM, SamplingParams
    from worker.jobs import JobRequest

    llm = LLM(model, **engine)
    prompts, params = [], []
    for job, fields in zip(jobs, reqs):
        req = JobRequest.model_validate(fields)
        kw = req.sampling_kwargs()
        if kw["seed"] is None and req.temperature > 0:
            kw["seed"] = job_seed(job.id)
        prompts.append(req.engine_prompt())
        params.append(SamplingParams(**kw))
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_hundred_varied_jobs_stream_equals_result_and_matches_the_engine(served, tiny_chat_model):
    worker, client = served
    reqs = _varied_requests(100)
    jobs = client.submit_many(reqs)
    # Live subscribers on a few jobs, started before the worker gets to them.
    live: dict[str, list[str]] = {}

    def follow(job):
        live[job.id] = list(job.stream(timeout=120))

    followers = [threading.Thread(target=follow, args=(j,)) for j in jobs[:5]]
    for t in followers:
        t.start()
    results = [job.result(timeout=180) for job in jobs]
    for t in followers:
        t.join(timeout=60)

    expected = _reference_outputs(tiny_chat_model, jobs, reqs)
    for job, fields, res, want in zip(jobs, reqs, results, expected):
        assert res["status"] == "finished"
        assert res["custom_id"] == fields["custom_id"]
        assert res["token_ids"] == want.token_ids, fields
        # Mostly "length"; a sampled job (its seed from its random id) may draw the end of sequence, as in-process.
        assert res["finish_reason"] == want.finish_reason
        made = len(res["token_ids"])
        assert res["usage"]["completion_tokens"] == made
        assert made == fields["max_tokens"] or want.finish_reason == "stop"
        assert res["usage"]["total_tokens"] == res["usage"]["prompt_tokens"] + made
        if fields.get("logprobs"):
            assert len(res["logprobs"]) == made
        # A subscriber arriving after the end replays every piece.
        assert "".join(job.stream(timeout=10)) == res["text"]
        # RQ's own view of the job agrees.
        rq_job = job.rq_job
        assert rq_job.get_status() == "finished"
        assert rq_job.return_value() == res
    assert sorted(live) == sorted(job.id for job in jobs[:5])  # every follower got to the end of its stream
    for job_id, pieces in live.items():
        assert "".join(pieces) == next(r["text"] for r in results if r["id"] == job_id)
    assert client.queue.finished_job_registry.count >= 100
    assert worker.worker.engine.kv.num_free_blocks == worker.worker.engine.kv.num_blocks


@pytest.mark.slow
def test_a_jobs_prompt_logprobs_are_in_its_result_as_the_engine_gives_them(served, tiny_chat_model):
    """vLLM's prompt_logprobs, for scoring a text: the result holds the prompt's token ids and, per token after
    the first, its logprob and the top N (the token's own last), as the engine in-process computes them."""
    from roseinfer import LLM, SamplingParams

    _, client = served
    job = client.submit(prompt="The quick brown fox jumps", max_tokens=2, temperature=0.0, prompt_logprobs=2)
    result = job.result(timeout=60)
    out = LLM(tiny_chat_model).generate(
        [result["prompt_token_ids"]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), use_tqdm=False
    )[0]
    assert result["prompt_token_ids"] == out.prompt_token_ids and len(result["prompt_logprobs"]) > 3
    assert result["prompt_logprobs"][0] is None
    for token, got, want in zip(out.prompt_token_ids[1:], result["prompt_logprobs"][1:], out.prompt_logprobs[1:]):
        assert got[-1][0] == token or token in [t for t, _ in got[:2]]
        assert dict(got) == pytest.approx(want, abs=1e-5)
    plain = client.submit(prompt="The quick brown fox jumps", max_tokens=2, temperature=0.0).result(timeout=60)
    assert "prompt_logprobs" not in plain and plain["token_ids"] == result["token_ids"]


def test_a_job_asking_for_logprobs_resumes_from_its_stream(served):
    """Its events carry their tokens' logprobs, so a retry resumes after what was streamed (it started over, its
    followers told to drop what they had) and ends as the uninterrupted job, logprobs and all."""
    _, client = served
    payload = {"prompt": "Resume me with logprobs", "max_tokens": 24, "temperature": 0.9, "seed": 3, "logprobs": 2}
    payload["ignore_eos"] = True
    first = client.submit(**payload)
    full = first.result(timeout=120)
    events = list(first.events(timeout=10))
    assert len(events) >= 2 and all(len(e["logprobs"]) == len(e["token_ids"]) for e in events if e["token_ids"])
    resumed = requeue_as_resumed(client, payload, events[:1])
    result = resumed.result(timeout=120)
    assert result["token_ids"] == full["token_ids"] and result["text"] == full["text"]
    assert result["logprobs"][: len(events[0]["token_ids"])] == events[0]["logprobs"]
    for got, want in zip(result["logprobs"], full["logprobs"]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)
    replay = list(resumed.events(timeout=10))
    assert not any(e.get("reset") for e in replay) and replay[0] == events[0]


@pytest.mark.slow
def test_a_resume_the_engine_refuses_starts_over_and_is_timed_as_such(served):
    """A stream whose tokens hold one of the job's stop tokens cannot be its output's start: the engine refuses the
    prefix, the job starts over (its followers told so), and its time per token counts every token it made."""
    worker, client = served
    payload = {"prompt": "Start over", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [5]}
    count, total = tpot_settled(worker.worker)
    job = requeue_as_resumed(client, payload, [{"v": 3, "n": 0, "text": "ab", "token_ids": [5, 6]}])
    result = job.result(timeout=120)
    replay = list(job.events(timeout=10))
    assert replay[1].get("reset") and "".join(e["text"] for e in replay[1:]) == result["text"]
    tpot_counted_after(worker.worker, count)
    timings, made = result["timings"], len(result["token_ids"])
    assert tpot_histogram(worker.worker)[0] == count + 1  # (its own observation alone)
    observed = tpot_histogram(worker.worker)[1] - total
    assert made > 1 and observed == pytest.approx(
        (timings["finished_at"] - timings["first_token_at"]) / (made - 1), abs=2e-6
    )


def test_a_job_that_keeps_no_result_says_so_instead_of_waiting(served, redis_url):
    worker, _ = served
    client = Client(redis_url, queue=worker.queue, result_ttl=0)  # RQ's meaning: the result is not kept
    job = client.submit("Keep nothing", max_tokens=3, temperature=0)
    assert list(job.events(timeout=60))[-1]["finish_reason"] == "length"
    with pytest.raises(JobFailed, match="result is not kept"):  # RQ deleted the job and kept no result
        job.result(timeout=10)
    assert not Redis.from_url(redis_url).exists(result_key(job.id))


def test_stream_events_carry_order_and_the_last_one_usage(served, redis_url):
    _, client = served
    job = client.submit("Tell me something", max_tokens=12, temperature=0)
    events = list(job.events(timeout=60))
    assert [e["n"] for e in events] == list(range(len(events)))
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert sum(len(e["token_ids"]) for e in events) == 12
    conn = Redis.from_url(redis_url)
    assert 0 < conn.ttl(stream_key(job.id)) <= 600  # a finished job's stream goes 10 minutes after its end
    stored = result_from_entries(conn.xrevrange(result_key(job.id), count=1))
    assert stored["text"] == "".join(e["text"] for e in events) == job.rq_job.return_value()["text"]
    assert not conn.exists(f"roseinfer:result:{job.id}")  # the result is stored once, in RQ's result stream


def _usage_so_far(events: list[dict], before: int = 0) -> list[dict]:
    """The usage each event should carry: the prompt's tokens and the output's up to it (``before`` streamed
    earlier)."""
    prompt, made, out = events[-1]["usage"]["prompt_tokens"], before, []
    for e in events:
        made += len(e["token_ids"])
        out.append({"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made})
    out[-1]["prompt_tokens_details"] = {"cached_tokens": events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]}
    return out  # (the last one's, as the result's, with the prompt's cached tokens)


def test_a_job_asking_for_continuous_usage_has_it_on_every_event_resumed_or_not(served):
    """vLLM's stream_options.continuous_usage_stats, on a job: each event carries the usage so far, every sample's
    tokens with n > 1, and a resumed attempt counts what the earlier one streamed. Other jobs' running events have
    none."""
    _, client = served
    payload = {"prompt": "Count with me", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    plain = list(client.submit(**payload).events(timeout=60))
    assert len(plain) >= 2 and all("usage" not in e for e in plain[:-1])
    payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    first = client.submit(**payload)
    events = list(first.events(timeout=60))
    assert [e["usage"] for e in events] == _usage_so_far(events)
    assert events[-1]["usage"] == first.result(timeout=10)["usage"] and events[-1]["usage"]["prompt_tokens"] > 0
    resumed = requeue_as_resumed(client, payload, events[:1])
    replay = list(resumed.events(timeout=60))
    assert replay[0] == events[0] and not any(e.get("reset") for e in replay)
    assert [e["usage"] for e in replay] == _usage_so_far(replay)
    samples = client.submit(**payload, n=2, seed=1)
    events = list(samples.events(timeout=60))
    assert {e.get("index", 0) for e in events} == {0, 1}
    assert [e["usage"] for e in events] == _usage_so_far(events) and events[-1]["usage"]["completion_tokens"] == 20
    with pytest.raises(ValueError, match="stream_options"):
        client.submit(**payload | {"stream_options": {"continuous_usage": True}})


def _first_event(job, timeout=30.0):
    return next(iter(job.events(timeout=timeout)))


def test_cancel_mid_generation_stops_within_a_step_and_frees_blocks(served, redis_url, monkeypatch):
    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine, 0.01)  # (a stalled test thread must not see it end first)
    counted = worker.worker.tokens
    job = client.submit("Write forever", max_tokens=200, temperature=0, ignore_eos=True)
    others = [client.submit(f"Other job {i}", max_tokens=8, temperature=0) for i in range(3)]
    _first_event(job)
    assert job.cancel()
    with pytest.raises(JobCanceled) as err:
        job.result(timeout=30)
    partial = err.value.result
    assert partial["status"] == "canceled" and partial["finish_reason"] == "abort"
    assert 0 < partial["usage"]["completion_tokens"] < 200
    assert job.status() == "canceled"
    events = list(job.events(timeout=10))
    assert events[-1]["finish_reason"] == "abort"
    pieces = []
    with pytest.raises(JobCanceled):  # as for a job canceled while queued (it ended as if whole)
        pieces.extend(job.stream(timeout=10))
    assert "".join(pieces) == partial["text"]
    # What the stream holds is the partial result, token ids included (those sampled since the last event too).
    assert "".join(e["text"] for e in events) == partial["text"]
    assert [t for e in events for t in e["token_ids"]] == partial["token_ids"]
    # Its stream expired (10 minutes after the end): stream() gave no text at all, the result holding it.
    client.connection.delete(stream_key(job.id))
    again = []
    with pytest.raises(JobCanceled):
        again.extend(job.stream(timeout=10))
    assert again == [partial["text"]]

    async def stream_async() -> list[str]:
        from producer.aio import AsyncClient

        aclient, pieces = AsyncClient(redis_url, queue=worker.queue), []
        try:
            with pytest.raises(JobCanceled):
                async for piece in aclient.job(job.id).stream(timeout=10):
                    pieces.append(piece)
        finally:
            await aclient.close()
        return pieces

    assert asyncio.run(stream_async()) == [partial["text"]]
    # RQ's view: no return value (not finished), its latest result a stop holding the partial result.
    latest = job.rq_job.latest_result()
    assert latest.type == Result.Type.STOPPED and latest.return_value == partial
    assert job.rq_job.return_value() is None
    conn = client.connection
    assert expire_together(conn, f"rq:job:{job.id}", result_key(job.id))  # it expires with its result
    for other in others:
        assert other.result(timeout=60)["usage"]["completion_tokens"] == 8
    deadline = time.time() + 10
    while worker.worker.in_flight and time.time() < deadline:
        time.sleep(0.05)
    assert worker.worker.engine.kv.num_free_blocks == worker.worker.engine.kv.num_blocks
    # Every token streamed is counted (roseinfer_generated_tokens_total), the canceled job's last piece too.
    assert worker.worker.tokens - counted == len(partial["token_ids"]) + 3 * 8


def test_a_canceled_job_is_in_the_latency_histograms_and_a_job_waiting_in_the_engine_is_counted(served, monkeypatch):
    """Latencies were observed at a finished job's end only: a canceled (or timed-out, or stopped) job was in no
    histogram, and a first token counted once the job ended. Jobs a worker holds beyond its batch were in no gauge."""
    worker, client = served
    value = worker.worker.metrics.registry.get_sample_value
    names = [f"roseinfer_{name}_seconds_count" for name in ("queue_time", "ttft", "e2e_latency")]
    before = [value(name) for name in names]
    slow_engine_steps(monkeypatch, worker.worker.engine)
    job = client.submit("Write forever", max_tokens=200, temperature=0, ignore_eos=True)
    _first_event(job)
    assert [value(name) - b for name, b in zip(names, before)] == [1, 1, 0]  # (as they happened)
    collected = {m.name: m.samples[0].value for m in worker.worker.metrics.registry.collect() if m.samples}
    assert (collected["roseinfer_requests_running"], collected["roseinfer_requests_waiting"]) == (1, 0)
    assert job.cancel()
    with pytest.raises(JobCanceled):
        job.result(timeout=30)
    deadline = time.time() + 10
    while value(names[2]) == before[2] and time.time() < deadline:
        time.sleep(0.05)
    assert [value(name) - b for name, b in zip(names, before)] == [1, 1, 1]


def test_a_job_pushed_to_another_lane_than_its_payload_says_runs_at_its_lanes_priority(served, caplog):
    """Pull order went by the lane, the engine's order and the puller's room by the payload's priority: a bulk
    payload moved into the interactive list was pulled first, then made way for every job, and counted as a
    worse job let the worker hold twice its limit. One priority now, the lane's, said in the log."""
    worker, client = served
    job = client.submit("moved by hand", max_tokens=2, priority=10)
    conn = client.connection
    assert conn.lrem(f"rq:queue:{worker.queue}:p10", 0, job.id) == 1
    conn.rpush(f"rq:queue:{worker.queue}", job.id)
    with caplog.at_level("WARNING", logger="roseinfer.worker"):
        assert job.result(timeout=30)["usage"]["completion_tokens"] == 2
    said = f"job {job.id}: its payload's priority 10 is not its lane's, {worker.queue} (0): it runs at its lane's"
    assert said in caplog.text


def test_a_canceled_job_s_dependency_sets_expire_with_it(served, monkeypatch):
    """RQ's cancel of a running job whose ``depends_on`` was met, and of a parent with a deferred child: the job
    hash expired with its result, its dependency set (``rq:job::<id>:dependencies``) and dependents set stayed for
    good (RQ's own cleanup, and a finished job's end here, expire them with the hash)."""
    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine)
    queue = Queue(worker.queue, connection=client.connection, serializer=JSONSerializer)
    long = {"prompt": "Write forever", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    first = queue.enqueue("worker.jobs.generate", prompt="first", max_tokens=20, ignore_eos=True)
    child = queue.enqueue("worker.jobs.generate", **long, depends_on=first)  # (deferred until first ends)
    parent = queue.enqueue("worker.jobs.generate", **long)
    deferred = queue.enqueue("worker.jobs.generate", prompt="then", max_tokens=2, depends_on=parent)
    conn = client.connection
    assert conn.exists(child.dependencies_key, parent.dependents_key) == 2
    assert client.job(first.id).result(timeout=30)["status"] == "finished"
    for job in (child, parent):
        _first_event(client.job(job.id))
        job.cancel()
        with pytest.raises(JobCanceled):
            client.job(job.id).result(timeout=30)
    assert deferred.get_status() == "deferred"
    for job, key in ((child, child.dependencies_key), (parent, parent.dependents_key)):
        assert expire_together(conn, key, job.key), key


def test_a_job_deleted_while_it_runs_stops_and_leaves_nothing_behind(served, monkeypatch):
    """RQ's ``job.delete()`` on a running job: it stops within a step and its followers get a last event, but no
    result, registry entry or hash of it comes back (it was written as a canceled job's)."""
    from rq.registry import CanceledJobRegistry, StartedJobRegistry

    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine, 0.01)  # (a stalled test thread must not see it end first)
    job = client.submit("Write on and on", max_tokens=200, temperature=0, ignore_eos=True)
    _first_event(job)
    job.rq_job.delete()
    events = list(job.events(timeout=30))
    assert events[-1]["finish_reason"] == "abort"
    deadline = time.time() + 10
    while job.id in worker.worker.in_flight and time.time() < deadline:
        time.sleep(0.05)
    conn, queue = client.connection, client.queue.name

    def left() -> list[str]:  # what of it is still in Redis (the sender ends jobs after their last events)
        found = [k for k in (f"rq:job:{job.id}", result_key(job.id)) if conn.exists(k)]
        found += ["canceled registry"] if job.id in CanceledJobRegistry(queue, connection=conn).get_job_ids() else []
        return found + (
            ["started registry"] if job.id in StartedJobRegistry(queue, connection=conn).get_job_ids() else []
        )

    deadline = time.time() + 10
    while left() and time.time() < deadline:
        time.sleep(0.05)
    assert left() == []


def test_an_id_used_again_is_a_new_job_not_the_old_ones_output(served, redis_url):
    """Submitted again under the id of a job that ended, the new job streamed the old one's text and its result()
    was the old result, while it still waited in the queue."""
    _, client = served
    job_id = f"again-{uuid.uuid4().hex[:8]}"
    old = client.submit("The first prompt", job_id=job_id, max_tokens=3, temperature=0).result(timeout=60)
    idle = Client(redis_url, queue=f"nobody-{uuid.uuid4().hex[:8]}")  # no worker: the new job stays queued
    waiting = idle.submit("Another prompt, longer than the first one", job_id=job_id, max_tokens=3)
    assert waiting.status() == "queued"
    # The old attempt's owner stays: a run of the old job still going somewhere cannot write its end over this one.
    assert client.connection.hget(f"rq:job:{job_id}", OWNER_FIELD) is not None
    # Nor its expiry: the old job's result_ttl deleted the new job's hash while it waited, and the job with it.
    assert client.connection.ttl(f"rq:job:{job_id}") == -1
    with pytest.raises(TimeoutError):
        waiting.result(timeout=0.5)
    waiting.cancel()
    client.connection.expire(f"rq:job:{job_id}", 600)  # as a result_ttl would
    third = idle.submit_many([{"prompt": "A third prompt", "job_id": job_id, "max_tokens": 3}])[0]
    assert client.connection.ttl(f"rq:job:{job_id}") == -1
    third.cancel()  # (canceled in its queue: kept for the result's TTL from now on)
    for submit in (client.submit, lambda prompt, **kw: client.submit_many([{"prompt": prompt, **kw}])[0]):
        new = submit("Another prompt, longer than the first one", job_id=job_id, max_tokens=3, temperature=0)
        result = new.result(timeout=60)
        assert result["usage"]["prompt_tokens"] > old["usage"]["prompt_tokens"]
        assert "".join(new.stream()) == result["text"]
    with pytest.raises(InvalidRequest, match="at most 256"):
        client.submit("x", job_id="a" * 257)


@pytest.mark.slow
def test_rq_stop_job_command_stops_a_running_job(served, redis_url, monkeypatch):
    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine, 0.01)  # (a stalled test thread must not see it end first)
    job = client.submit("Keep going", max_tokens=200, temperature=0, ignore_eos=True)
    _first_event(job)
    send_stop_job_command(Redis.from_url(redis_url), job.id, serializer=JSONSerializer)
    with pytest.raises(JobCanceled) as err:
        job.result(timeout=30)
    assert job.status() == "stopped"
    latest = job.rq_job.latest_result()  # RQ's own record of the stop, holding the partial result
    assert latest.type == Result.Type.STOPPED and latest.return_value == err.value.result
    assert "stopped by a stop-job command" in latest.exc_string and len(job.rq_job.results()) == 1
    # Kept as long as RQ keeps the stopped job in its failed registry (failure_ttl: a year), not a day.
    assert Redis.from_url(redis_url).ttl(f"rq:results:{job.id}") > 30 * 24 * 3600


@pytest.mark.slow  # steps of half a second
def test_rq_stop_job_command_stops_a_job_taken_in_but_not_yet_running(served, redis_url, monkeypatch):
    """Marked started by the puller, it reaches the engine after the step under way: a stop-job command sent
    meanwhile (RQ's worker knows its job before its status says started) was ignored, and the job ran to its end."""
    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine)
    stop_me, real_apply = f"stop-me-{uuid.uuid4().hex[:8]}", worker.worker._apply_arrivals

    def apply_arrivals() -> None:  # the step loop takes the job in once it read the stop-job command, not before
        if not (worker.worker.puller.handing_over(stop_me) and not worker.worker._stops_waiting):
            real_apply()

    monkeypatch.setattr(worker.worker, "_apply_arrivals", apply_arrivals)
    running = client.submit("Keep going", max_tokens=200, temperature=0, ignore_eos=True)
    _first_event(running)
    job = client.submit("Stop me", max_tokens=5, temperature=0, ignore_eos=True, job_id=stop_me)
    deadline = time.time() + 30
    while job.status() != "started" and time.time() < deadline:
        time.sleep(0.002)
    assert job.id not in worker.worker.in_flight  # in the window: taken, not yet handed to the engine
    send_stop_job_command(Redis.from_url(redis_url), job.id, serializer=JSONSerializer)
    with pytest.raises(JobCanceled):
        job.result(timeout=30)
    assert job.status() == "stopped"
    running.cancel()


def _enqueue_raw(conn: Redis, queue: str, job_id: str, data: bytes) -> None:
    """A job written the way any language would (see README), with whatever data we like."""
    now = "2026-11-22T00:00:00.000000Z"
    conn.hset(
        f"rq:job:{job_id}",
        mapping={
            "data": data,
            "origin": queue,
            "status": "queued",
            "created_at": now,
            "enqueued_at": now,
            "description": "raw",
        },
    )
    conn.sadd("rq:queues", f"rq:queue:{queue}")
    conn.rpush(f"rq:queue:{queue}", job_id)


def test_bad_payloads_fail_alone_with_a_clear_reason(served, redis_url):
    worker, client = served
    conn = Redis.from_url(redis_url)
    fn = "worker.jobs.generate"
    bad = {
        "malformed": (b'["worker.jobs.generate", null, [], {"prompt": ', "not a JSON"),
        "unknown": (json.dumps([fn, None, [], {"prompt": "hi", "colour": "red"}]).encode(), "colour: unknown field"),
        "types": (json.dumps([fn, None, [], {"prompt": "hi", "max_tokens": "ten"}]).encode(), "max_tokens"),
        "negative": (json.dumps([fn, None, [], {"prompt": "hi", "max_tokens": -3}]).encode(), "greater than or equal"),
        "empty": (json.dumps([fn, None, [], {"prompt": ""}]).encode(), "the prompt is empty"),
        "toolong": (json.dumps([fn, None, [], {"prompt": "word " * 400}]).encode(), "at most"),
        "otherfn": (json.dumps(["os.system", None, ["rm -rf /"], {}]).encode(), "runs only worker.jobs.generate"),
        "noinput": (json.dumps([fn, None, [], {"max_tokens": 3}]).encode(), "exactly one of"),
    }
    ids = {}
    for name, (data, _reason) in bad.items():
        ids[name] = f"bad-{name}-{uuid.uuid4().hex[:6]}"
        _enqueue_raw(conn, worker.queue, ids[name], data)
    # A pickled job, as a producer with rq's default serializer would send it.
    pickled = Queue(worker.queue, connection=conn).enqueue("worker.jobs.generate", prompt="hi", max_tokens=2)
    good = [client.submit(f"Fine job {i}", max_tokens=6, temperature=0) for i in range(5)]

    for job in good:
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 6
    for name, (_data, reason) in bad.items():
        with pytest.raises(JobFailed) as err:
            client.job(ids[name]).result(timeout=30)
        assert reason in err.value.reason, (name, err.value.reason)
        rq_job = Job.fetch(ids[name], connection=conn, serializer=JSONSerializer)
        assert rq_job.get_status() == "failed"
        assert ids[name] in Queue(worker.queue, connection=conn).failed_job_registry.get_job_ids()
        latest = rq_job.latest_result()  # RQ reads it as its own failure; it also holds the result
        assert latest.type == Result.Type.FAILED and reason in latest.exc_string
        assert len(rq_job.results()) == 1  # written with the status: no bare record of RQ's before it
        assert latest.return_value == err.value.result and latest.return_value["error"] == err.value.reason
        assert latest.return_value["status"] == "failed" and rq_job.return_value() is None
        assert 0 < conn.ttl(result_key(ids[name])) <= 365 * 24 * 3600  # as long as RQ keeps the failed job
    with pytest.raises(JobFailed) as err:
        client.job(pickled.id).result(timeout=30)
    assert "JSON" in err.value.reason
    assert worker.thread.is_alive()


def test_invalid_requests_are_refused_at_submit(served):
    from producer import InvalidRequest

    _, client = served
    for fields in (
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": ""},
        {"prompt": "a", "messages": []},
        {"prompt": "hi", "temprature": 0.5},
        {"prompt": "hi", "top_p": 1.5},
    ):
        with pytest.raises(InvalidRequest):
            client.submit(**fields)


@pytest.mark.slow  # keeps the fast lane under a minute
def test_status_reports_workers_and_queue(served):
    worker, client = served
    client.submit("status check", max_tokens=2).result(timeout=30)
    deadline = time.time() + 30  # (a heartbeat publishes the worker's statistics: polled, not slept for)
    while not (st := client.status())["workers"] and time.time() < deadline:
        time.sleep(0.1)
    assert st["queue"] == worker.queue
    assert [w["name"] for w in st["workers"]] == [worker.worker.name]
    assert st["finished"] >= 1
    assert (st["workers"][0]["dtype"], st["workers"][0]["quantization"]) == (worker.settings.dtype, None)


@pytest.mark.slow
def test_redis_outage_mid_generation_loses_no_event(redis_url, tiny_chat_model, monkeypatch):
    """Redis drops the worker's round trips for a while: the engine waits, unsent events go out afterwards."""
    import redis as redis_mod

    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=4, heartbeat_interval=1)
    failures = {"left": 0}
    make_pipeline = w.worker.connection.pipeline

    def flaky_pipeline(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        execute = pipe.execute

        def maybe_fail(*a, **k):
            if failures["left"] > 0:
                failures["left"] -= 1
                pipe.reset()
                raise redis_mod.exceptions.ConnectionError("injected outage")
            return execute(*a, **k)

        pipe.execute = maybe_fail
        return pipe

    w.worker.connection.pipeline = flaky_pipeline
    slow_engine_steps(monkeypatch, w.worker.engine)  # (still running when the outage is armed after its first event)
    try:
        client = Client(redis_url, queue=w.queue)
        job = client.submit("Through the outage", max_tokens=60, temperature=0, ignore_eos=True)
        _first_event(job)
        failures["left"] = 4
        res = job.result(timeout=120)
        assert failures["left"] == 0  # the outage did happen
        events = list(job.events(timeout=10))
        assert [e["n"] for e in events] == list(range(len(events)))
        assert sum(len(e["token_ids"]) for e in events) == 60 == res["usage"]["completion_tokens"]
        assert "".join(e["text"] for e in events) == res["text"]
    finally:
        w.stop()


@pytest.mark.slow
def test_an_interactive_job_overtakes_a_full_worker_of_bulk_jobs_without_changing_them(redis_url, tiny_chat_model):
    worker = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=2, max_in_flight=2, event_interval_ms=0)
    try:
        client = Client(redis_url, queue=worker.queue)
        bulk_requests = [
            {"prompt": f"Bulk {i}", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True, "priority": 10}
            for i in range(6)
        ]
        bulk = client.submit_many(bulk_requests)
        deadline = time.monotonic() + 30
        while client.status()["in_flight"] < 2:
            assert time.monotonic() < deadline, "the worker never filled"
            time.sleep(0.01)
        chat = client.submit("Hello there", max_tokens=4, temperature=0.0)  # priority 0
        chat_first_token = chat.result(timeout=60)["timings"]["first_token_at"]
        results = [job.result(timeout=120) for job in bulk]
        # The worker was full (two of two in flight): the chat job came in over the limit and took a running
        # bulk job's slot, before any bulk job ended.
        assert chat_first_token < min(r["timings"]["finished_at"] for r in results)
        # Preempted and recomputed (float32, greedy): the same tokens as the engine alone.
        assert [r["token_ids"] for r in results] == _reference(tiny_chat_model, bulk, bulk_requests)
        assert Queue(f"{worker.queue}:p10", connection=client.connection).count == 0
    finally:
        worker.stop()


@pytest.mark.slow
def test_a_full_worker_does_not_pull_from_lanes_it_saw_empty(redis_url, tiny_chat_model, monkeypatch):
    import worker.intake as intake

    pulls: list[str] = []
    real, workers = intake._pull_batch, []

    def spy(queue, *args):
        # Only while jobs run: an idle worker looks at every lane (so too between two pairs of jobs that end at once).
        if workers and workers[0].worker.in_flight:
            pulls.append(queue.name)
        return real(queue, *args)

    monkeypatch.setattr(intake, "_pull_batch", spy)
    worker = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=2, max_in_flight=2)
    workers.append(worker)
    slow_engine_steps(monkeypatch, worker.worker.engine, 0.01)  # seconds of a full worker: a pull a second if it looked
    try:
        client = Client(redis_url, queue=worker.queue)
        jobs = client.submit_many(
            [{"prompt": f"Full {i}", "max_tokens": 200, "ignore_eos": True, "priority": 10} for i in range(6)]
        )
        results = [job.result(timeout=120) for job in jobs]
    finally:
        worker.stop()
    assert all(r["usage"]["completion_tokens"] == 200 for r in results)
    # Full of bulk jobs with more waiting, it looks at the empty interactive lane only before the sender read it.
    assert pulls.count(worker.queue) <= 2, pulls


def test_a_rate_limited_job_frees_its_slot_as_it_ends(served, redis_url, monkeypatch):
    """RQ 3's RateLimit: a job that ended through the worker kept its slot until RQ's maintenance (~15 s), so the
    next job of its limit waited for it, as the last one waited behind a cancel."""
    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine)
    key = f"rl-{uuid.uuid4().hex[:8]}"
    queue = Queue(client.queue.name, connection=client.connection, serializer=JSONSerializer)
    first, second, third = (
        queue.enqueue("worker.jobs.generate", prompt=f"limited {i}", max_tokens=3 if i == 0 else 200,
                      temperature=0, ignore_eos=True, rate_limit=RateLimit(key, 1))
        for i in range(3)
    )  # fmt: skip
    assert [j.get_status().value for j in (second, third)] == ["rate_limited", "rate_limited"]
    registry = RateLimitRegistry(key, client.connection)

    def holding_after(ended: str) -> list[str]:
        deadline = time.time() + 5  # the slot is freed just after the job's end is written, not ~15 s later
        while time.time() < deadline and ended in registry.get_allowed_job_ids():
            time.sleep(0.05)
        return registry.get_allowed_job_ids()

    client.job(first.id).result(timeout=30)
    waiting = {second.id, third.id}  # promoted in the order RQ keeps (enqueued within a clock tick: either)
    ended = first.id
    while waiting:
        [running] = holding_after(ended)
        assert running in waiting
        waiting.discard(running)
        _first_event(client.job(running))
        client.job(running).cancel()
        ended = running
    assert holding_after(ended) == []


@pytest.mark.slow  # waits out the puller's look once a second
def test_rq_suspend_holds_new_jobs_and_shows_the_worker_suspended(served):
    """`rq suspend`: the worker takes no new job and, its jobs done, shows itself suspended in `rq info` (it showed
    idle), as RQ's worker does; `rq resume` lets the queue run again."""
    from rq.suspension import resume, suspend
    from rq.worker import Worker

    worker, client = served
    conn = client.connection

    def state_becomes(expected: str) -> str:
        deadline = time.time() + 5
        state = None
        while time.time() < deadline and (state := Worker.find_by_key(worker.worker.key, conn).get_state()) != expected:
            time.sleep(0.05)
        return state

    suspend(conn)
    try:
        assert state_becomes("suspended") == "suspended"
        job = client.submit("Wait for the resume", max_tokens=3, temperature=0)
        time.sleep(1.5)  # the puller looks once a second
        assert job.status() == "queued"
    finally:
        resume(conn)
    assert job.result(timeout=30)["usage"]["completion_tokens"] == 3
    assert state_becomes("idle") == "idle"


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_an_int8_worker_serves_jobs_whose_stream_is_their_result(redis_url, tiny_chat_model):
    """``ROSEINFER_QUANTIZATION=int8`` (a worker setting like every engine option): the worker calibrates and
    quantizes at start, then serves as any other; a job's streamed text is its result's."""
    worker = ThreadWorker(redis_url, tiny_chat_model, quantization="int8", int8_output_layer=True, heartbeat_interval=1)
    try:
        assert worker.worker.engine.model.lm_head._qweight is not None
        client = Client(redis_url, queue=worker.queue)
        jobs = client.submit_many([{"prompt": f"int8 {i}", "max_tokens": 6, "ignore_eos": True} for i in range(4)])
        for job in jobs:
            result = job.result(timeout=60)
            assert result["usage"]["completion_tokens"] == 6 and "".join(job.stream(timeout=10)) == result["text"]
        deadline = time.monotonic() + 10
        while not client.workers() and time.monotonic() < deadline:  # (its first heartbeat)
            time.sleep(0.2)
        assert client.workers()[0]["quantization"] == "int8+output_layer"  # operators see it in `roseinfer status`
    finally:
        worker.stop()


def test_a_jobs_usage_says_how_many_of_its_prompt_tokens_the_prefix_cache_held(served):
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``, on the last event and in the result: 0 for a prompt
    first seen, its full blocks for the same prompt again (the engine counted them; the result said nothing)."""
    _, client = served
    ids = [5 + (uuid.uuid4().int >> k) % 200 for k in range(70)]  # (a prompt no other test sent)
    first = client.submit(prompt_token_ids=ids, max_tokens=2, temperature=0).result(timeout=60)
    job = client.submit(prompt_token_ids=ids, max_tokens=2, temperature=0)
    again, last = job.result(timeout=60), list(job.events(timeout=60))[-1]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < 70 and cached % 8 == 0, cached
    assert last["usage"] == again["usage"] and again["usage"]["prompt_tokens"] == 70
