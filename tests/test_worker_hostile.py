"""The worker under input a buggy or hostile producer writes: every bad job fails alone with a reason, nothing a
job names runs, good jobs between them finish, and the worker keeps serving (same thread, same process)."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import uuid
import zlib
from datetime import datetime, timedelta, timezone
from typing import ClassVar

import fakeredis
import pytest
from conftest import ThreadWorker, expire_together, slow_engine_steps
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import utcparse

from producer import Client, JobCanceled, JobFailed
from producer.protocol import BULK_PRIORITY, read_result, rejected_key, result_from_entries, result_key

FN = "worker.jobs.generate"
NOW = "2026-11-22T00:00:00.000000Z"


def _raw_job(conn: Redis, queue: str, job_id: str, payload: dict | None = None, *, push: bool = True, **fields) -> None:
    """A job written the way another language would: a hash and an RPUSH (``push=False``: the hash alone)."""
    data = json.dumps([FN, None, [], payload or {"prompt": "hi", "max_tokens": 3, "temperature": 0}])
    mapping = {"data": data, "origin": queue, "status": "queued", "created_at": NOW, "enqueued_at": NOW, **fields}
    conn.hset(f"rq:job:{job_id}", mapping=mapping)
    conn.sadd("rq:queues", f"rq:queue:{queue}")
    if push:
        conn.rpush(f"rq:queue:{queue}", job_id)


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    w = ThreadWorker(
        redis_url, tiny_chat_model, max_num_seqs=8, heartbeat_interval=1, maintenance_interval=1,
        allow_callback=[
            "hook_probe.record", "hook_probe.boom", "hook_probe.record_failure", "hook_probe.held",
            "hook_probe.count", "hook_probe.redis_of_its_own_down",
        ],
        allow_webhook_host=["allowed.invalid"], max_job_bytes=64 * 1024,
    )  # fmt: skip
    yield w, Client(redis_url, queue=w.queue), Redis.from_url(redis_url)
    w.stop()


MALFORMED = {
    "created_at": {"created_at": "yesterday"},
    "enqueued_at": {"enqueued_at": "soon"},
    "timeout": {"timeout": "forever"},
    "retries_left": {"retries_left": "many"},
    "result_ttl": {"result_ttl": "x"},
    "failure_ttl": {"failure_ttl": "x"},
    "status": {"status": "bogus"},
    "retry_intervals": {"retry_intervals": "{"},
    "dependency_ids": {"dependency_ids": "{"},
    "exc_info": {"exc_info": b"\xff\xfe\x00"},
}


def test_malformed_job_hashes_fail_alone_and_good_jobs_between_them_finish(served):
    w, client, conn = served
    good_before = client.submit("before", max_tokens=4, temperature=0)
    bad_ids = {}
    for name, fields in MALFORMED.items():
        bad_ids[name] = f"bad-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
        _raw_job(conn, w.queue, bad_ids[name], **fields)
    bad_ids["space id"] = f"with space {uuid.uuid4().hex[:6]}"
    bad_ids["non-ascii id"] = f"ünïcode-{uuid.uuid4().hex[:6]}"
    for name in ("space id", "non-ascii id"):
        _raw_job(conn, w.queue, bad_ids[name])
    good_after = [client.submit(f"after {i}", max_tokens=4, temperature=0) for i in range(3)]

    for job in [good_before, *good_after]:
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 4
    for name, job_id in bad_ids.items():
        deadline = time.time() + 30
        while not conn.exists(result_key(job_id)) and time.time() < deadline:
            time.sleep(0.05)
        stored = result_from_entries(read_result(conn, job_id))
        assert stored["status"] == "failed" and stored["finish_reason"] == "error", name
        reason = stored["error"]
        assert reason, name
        if name.endswith(" id"):
            assert "job ids may only use" in reason
        else:  # the field is named
            assert f"RQ cannot read this job: its field {name!r}" in reason, (name, reason)
        assert conn.zscore(rejected_key(w.queue), job_id) is not None, name
        assert conn.hget(f"rq:job:{job_id}", "status") == b"failed"
        assert expire_together(conn, f"rq:job:{job_id}", result_key(job_id)), name  # it was kept for good
    with pytest.raises(JobFailed, match="RQ cannot read"):
        client.job(bad_ids["status"]).result(timeout=5)
    assert conn.llen(f"rq:queue:{w.queue}:intermediate") == 0
    assert w.thread.is_alive()


def test_a_job_hash_field_past_its_bound_fails_alone_before_rq_parses_it(served):
    """RQ parses ``meta`` (and webhooks, dependency ids ...) whole and keeps it while the job runs: 30 MB of nested
    JSON there took 700 MB of the worker's memory, a job. Such a hash is refused before RQ reads it."""
    w, client, conn = served
    job_id = f"fat-meta-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, job_id, meta=json.dumps({"pad": "x" * 70_000}))
    good = client.submit("after", max_tokens=4, temperature=0)
    assert good.result(timeout=60)["usage"]["completion_tokens"] == 4
    with pytest.raises(JobFailed, match=r"field 'meta' is over 65536 bytes"):
        client.job(job_id).result(timeout=30)
    assert conn.zscore(rejected_key(w.queue), job_id) is not None and w.thread.is_alive()


@pytest.mark.parametrize("field, empty", [("status", False), ("data", False), ("status", True)])
def test_a_job_hash_without_a_field_rq_writes_is_refused_naming_it(served, field, empty):
    """Without ``status`` the start read the job as deleted meanwhile: canceled, with no result, no word and no
    expiry (or, beside other jobs, run); without ``data``: "Unexpected job format", which named no field. An empty
    ``status`` (RQ reads it as none) ran as queued."""
    w, _client, conn = served
    job_id = f"no-{field}-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, job_id, push=False)
    if empty:
        conn.hset(f"rq:job:{job_id}", field, "")
    else:
        conn.hdel(f"rq:job:{job_id}", field)
    conn.rpush(f"rq:queue:{w.queue}", job_id)
    deadline = time.time() + 30
    while not conn.exists(result_key(job_id)) and time.time() < deadline:
        time.sleep(0.05)
    stored = result_from_entries(read_result(conn, job_id))
    assert stored["status"] == "failed" and f"the job hash has no '{field}' field" in stored["error"]
    assert conn.zscore(rejected_key(w.queue), job_id) is not None and w.thread.is_alive()


def test_an_enqueued_at_ahead_of_the_workers_clock_times_the_job_from_its_start(served):
    """A producer whose clock runs an hour ahead: the result's queue_s, ttft_s and total_s were -3,600 s."""
    w, client, conn = served
    job_id = f"ahead-{uuid.uuid4().hex[:6]}"
    ahead = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    _raw_job(conn, w.queue, job_id, enqueued_at=ahead)
    timings = client.job(job_id).result(timeout=60)["timings"]
    assert timings["queue_s"] == 0 and timings["enqueued_at"] == timings["started_at"]
    assert 0 < timings["ttft_s"] <= timings["total_s"] < 60


def test_a_payload_nested_past_the_json_parsers_depth_fails_alone(served):
    """JSON that Python's parser stops reading (arrays 5,000 deep, under the size bound): that job fails, saying so;
    the worker serves on."""
    w, client, conn = served
    job_id = f"deep-{uuid.uuid4().hex[:6]}"
    deep = f'["{FN}", null, [], {{"prompt": "hi", "metadata": ' + "[" * 5_000
    _raw_job(conn, w.queue, job_id, data=deep)
    good = client.submit("after", max_tokens=4, temperature=0)
    assert good.result(timeout=60)["usage"]["completion_tokens"] == 4
    with pytest.raises(JobFailed) as failed:
        client.job(job_id).result(timeout=30)
    assert "nested too deeply" in str(failed.value)  # (was: "not a JSON list, was it pickled?")
    assert w.thread.is_alive()


def test_times_redis_or_rq_cannot_use_fail_alone_and_the_jobs_ending_beside_them_finish(served):
    """RQ's enqueue takes ``result_ttl=10**17``: the finish script's EXPIRE failed midway for every job ending in the
    same step. A retry interval RQ cannot add to a date left its job started for good, and every clean-up of its
    registry raised."""
    w, client, conn = served
    cases = {
        "result_ttl": ({"result_ttl": str(10**17)}, "'result_ttl' holds 100000000000000000"),
        "failure_ttl": ({"failure_ttl": "-7"}, "'failure_ttl' holds -7"),
        "timeout": ({"timeout": str(10**17)}, "'timeout' holds"),
        "retry_intervals": ({"retry_intervals": "5", "retries_left": "1"}, "'retry_intervals' holds 5"),
        "huge_interval": ({"retry_intervals": json.dumps([10**12]), "retries_left": "1"}, "'retry_intervals' holds"),
        # Read, then RQ's retry failed on them: the job stayed started, its queue's clean-up raised at every pass.
        "no_interval": ({"retry_intervals": "[]", "retries_left": "1"}, "'retry_intervals' holds []"),
        "meta": ({"meta": "[1]", "retries_left": "1"}, "'meta' holds [1]; a JSON object"),
        "dependency_ids": ({"dependency_ids": "5", "retries_left": "1"}, "'dependency_ids' holds 5"),
        # RQ's write of a meta nested 970 deep recursed past Python's limit at the retry (and at every clean-up of the
        # registry, which then left every other abandoned job of the queue started); a year RQ writes in 3 digits.
        "deep_meta": ({"meta": '{"a":' * 970 + "1" + "}" * 970, "retries_left": "1"}, "'meta' nests deeper than 100"),
        "year_999": ({"created_at": "0999-01-01T00:00:00.000000Z"}, "'created_at' holds the year 999"),
    }
    good = [client.submit(f"beside {i}", max_tokens=3, temperature=0) for i in range(2)]
    ids = {}
    for name, (fields, _) in cases.items():
        ids[name] = f"bounds-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
        _raw_job(conn, w.queue, ids[name], **fields)
    good += [client.submit(f"after {i}", max_tokens=3, temperature=0) for i in range(2)]
    keeping = Client(connection=conn, queue=w.queue, result_ttl=-1)  # -1 is RQ's "for good"
    forever = keeping.submit("kept for good", max_tokens=3, temperature=0)
    for job in [*good, forever]:
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 3
    assert conn.ttl(f"rq:job:{forever.id}") == -1
    for name, (_, phrase) in cases.items():
        with pytest.raises(JobFailed) as err:
            client.job(ids[name]).result(timeout=30)
        assert "RQ cannot use this job" in err.value.reason and phrase in err.value.reason, (name, err.value.reason)
        assert conn.hget(f"rq:job:{ids[name]}", "status") == b"failed"
    assert w.thread.is_alive()


def test_a_field_rq_cannot_read_is_shown_as_its_writer_wrote_it():
    """As Python's bytes (``holds b'yesterday'``), to a writer in another language."""
    from worker.intake import diagnose

    reason = diagnose({b"created_at": b"yesterday", b"status": b"queued"}, "j", ValueError("x"))
    assert reason == "RQ cannot read this job: its field 'created_at' holds \"yesterday\""


def test_a_data_list_of_another_shape_than_the_protocols_fails_alone(served):
    """docs/protocol.md says [function, null, [], {payload}]: an instance there (RQ calls a method of it) or
    arguments of {} or 0 were taken."""
    w, client, conn = served
    shapes = {
        "instance": ([FN, {"x": 1}, [], {"prompt": "hi"}], "names an instance"),
        # (it said "has [] as its third element" of ["x"] too)
        "args": ([FN, None, {}, {"prompt": "hi"}], "has \\[\\] as its third element, not \\{\\}$"),
    }
    ids = {}
    for name, (data, _) in shapes.items():
        ids[name] = f"shape-{name}-{uuid.uuid4().hex[:6]}"
        conn.hset(f"rq:job:{ids[name]}", mapping={"data": json.dumps(data), "origin": w.queue, "status": "queued",
                                                  "created_at": NOW, "enqueued_at": NOW})  # fmt: skip
        conn.rpush(f"rq:queue:{w.queue}", ids[name])
    good = client.submit("after", max_tokens=3, temperature=0)
    assert good.result(timeout=60)["usage"]["completion_tokens"] == 3
    for name, (_, phrase) in shapes.items():
        with pytest.raises(JobFailed, match=phrase):
            client.job(ids[name]).result(timeout=30)


def test_an_id_that_is_not_text_is_moved_aside_and_the_jobs_around_it_finish(served):
    """RQ's dequeue raised on it and stranded every job of the same pull in the intermediate list, queued forever."""
    w, client, conn = served
    bad = b"bad-\xff\xfe-" + uuid.uuid4().hex[:6].encode()
    conn.hset(b"rq:job:" + bad, mapping={"data": json.dumps([FN, None, [], {"prompt": "hi"}]), "status": "queued"})
    conn.rpush(f"rq:queue:{w.queue}", bad)  # the worker idle: its blocking wait takes it
    good = [client.submit(f"after {i}", max_tokens=3, temperature=0) for i in range(2)]
    conn.rpush(f"rq:queue:{w.queue}", bad)  # and again, behind a job: in the same pull as the rest
    good += [client.submit(f"later {i}", max_tokens=3, temperature=0) for i in range(2)]
    for job in good:
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 3
    assert conn.zscore(rejected_key(w.queue), bad) is not None
    # Its hash says so, and expires (it stayed "queued" for good): by its bytes, as RQ cannot key it
    assert conn.hget(b"rq:job:" + bad, "status") == b"failed" and conn.ttl(b"rq:job:" + bad) > 0
    assert bad not in conn.lrange(f"rq:queue:{w.queue}:intermediate", 0, -1)
    assert bad not in conn.lrange(f"rq:queue:{w.queue}", 0, -1)
    assert w.thread.is_alive()


def test_owner_and_stream_fields_that_are_not_utf8_run_their_job_and_break_no_pull(served):
    """A started job's owner field (and its stream's mark) are decoded to look for its running execution: bytes
    that are not UTF-8 raised out of the whole pull, every job of it left in the intermediate list, and the next
    pull took them again, for good. No execution has such an id: the job runs here, and so do those beside it."""
    w, client, conn = served
    odd = f"odd-owner-{uuid.uuid4().hex[:6]}"
    good = [client.submit(f"before {i}", max_tokens=3, temperature=0) for i in range(2)]
    _raw_job(conn, w.queue, odd, status="started", roseinfer_owner=b"\xff\xfe", roseinfer_stream_of=b"\xff")
    good += [client.submit(f"after {i}", max_tokens=3, temperature=0) for i in range(2)]
    for job in [*good, client.job(odd)]:
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 3
    assert w.thread.is_alive()


@pytest.mark.slow  # a worker of its own, or seconds of waiting
def test_maintenance_survives_a_hash_it_cannot_read_and_releases_its_lock(served, monkeypatch):
    import worker.maintenance as maintenance

    w, client, conn = served
    met = []  # what RQ's clean-up raised: the planted hash reached
    real_clean = maintenance.clean_registries

    def clean(queue, *args, **kwargs):
        try:
            return real_clean(queue, *args, **kwargs)
        except Exception as exc:
            met.append(exc)
            raise

    monkeypatch.setattr(maintenance, "clean_registries", clean)
    # A hostile hash placed straight into the started registry, where RQ's clean-up fetches it once it expires.
    job_id = f"planted-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, "elsewhere", job_id, created_at="yesterday")
    conn.lrem("rq:queue:elsewhere", 0, job_id)
    conn.zadd(f"rq:wip:{w.queue}", {f"{job_id}:exec": 1})
    gone = f"gone-{uuid.uuid4().hex[:6]}"  # a canceled job whose hash expired: a later step of each pass prunes it
    conn.zadd(f"rq:canceled:{w.queue}", {gone: 1})
    conn.delete(f"rq:clean_registries:{w.queue}")
    deadline = time.time() + 10
    while not met and time.time() < deadline:  # a maintenance pass (interval 1 s) that meets the hash
        time.sleep(0.05)
    assert met, "no maintenance pass met the planted hash"
    # The steps after RQ's clean-up still ran (they were skipped at every pass: dead workers' jobs stayed stranded).
    while conn.zscore(f"rq:canceled:{w.queue}", gone) is not None and time.time() < deadline:
        time.sleep(0.05)
    assert conn.zscore(f"rq:canceled:{w.queue}", gone) is None
    while conn.exists(f"rq:clean_registries:{w.queue}") and time.time() < deadline:  # released just after
        time.sleep(0.05)
    assert not conn.exists(f"rq:clean_registries:{w.queue}")  # the lock is not left held
    assert client.submit("still serving", max_tokens=2, temperature=0).result(timeout=30)["status"] == "finished"
    assert w.thread.is_alive()
    conn.zrem(f"rq:wip:{w.queue}", f"{job_id}:exec")


def test_callbacks_named_by_a_job_never_run_unless_allowed(served):
    w, client, conn = served
    refused = {}
    for kind, name in (("success", "builtins.print"), ("failure", "os.system"), ("stopped", "hook_probe.missing")):
        job_id = f"cb-{kind}-{uuid.uuid4().hex[:6]}"
        _raw_job(conn, w.queue, job_id, **{f"{kind}_callback_name": name})
        refused[job_id] = name
    allowed = f"cb-allowed-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, allowed, success_callback_name="hook_probe.record")
    not_allowed = f"cb-probe-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, not_allowed, failure_callback_name="hook_probe.record_unlisted", retries_left="1")
    for job_id, name in [*refused.items(), (not_allowed, "hook_probe.record_unlisted")]:
        with pytest.raises(JobFailed) as err:
            client.job(job_id).result(timeout=30)
        assert "runs no code and calls no address" in err.value.reason and name in err.value.reason
        assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == "failed"
    # The refused failure callback did not run on the failure path either.
    assert not conn.exists(f"hook-probe:{not_allowed}")
    assert client.job(allowed).result(timeout=30)["status"] == "finished"
    deadline = time.time() + 5
    while not conn.exists(f"hook-probe:{allowed}") and time.time() < deadline:
        time.sleep(0.05)
    assert conn.get(f"hook-probe:{allowed}") == b"ran"  # an allow-listed name runs, as RQ users expect


def test_a_success_callback_that_raises_fails_its_job_alone(served):
    """As RQ fails a job whose success callback raises (with that error); the jobs that ended in the same step end
    as theirs say. The error stopped the whole ending, so they stayed started until RQ took them for abandoned."""
    w, client, conn = served
    tag = uuid.uuid4().hex[:6]
    boom, fine = f"cb-boom-{tag}", f"cb-fine-{tag}"
    payload = {"prompt": "twins", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    _raw_job(conn, w.queue, boom, payload, success_callback_name="hook_probe.boom", push=False)
    _raw_job(conn, w.queue, fine, payload, success_callback_name="hook_probe.record", push=False)
    conn.rpush(f"rq:queue:{w.queue}", boom, fine)  # taken together, ended in one step
    with pytest.raises(JobFailed) as err:
        client.job(boom).result(timeout=30)
    assert "boom from the success callback" in err.value.reason
    assert err.value.result["usage"]["completion_tokens"] == 3  # (what it made, as its last event says)
    assert Job.fetch(boom, connection=conn, serializer=JSONSerializer).get_status() == "failed"
    # Its stream's last event says so too: it said "stop", a follower of the stream took the failed job for done.
    with pytest.raises(JobFailed, match="boom from the success callback"):
        list(client.job(boom).stream(timeout=30))
    # One RQ retries: no last event for the attempt that failed (its next goes on), one for the last attempt.
    again = f"cb-again-{tag}"
    _raw_job(conn, w.queue, again, payload, success_callback_name="hook_probe.boom", retries_left="1")
    with pytest.raises(JobFailed, match="boom from the success callback"):
        client.job(again).result(timeout=30)
    deadline = time.time() + 10
    while not (ends := [e for e in _events(conn, again) if e.get("finish_reason")]) and time.time() < deadline:
        time.sleep(0.02)
    assert [e["finish_reason"] for e in ends] == ["error"], _events(conn, again)
    assert client.job(fine).result(timeout=30)["status"] == "finished"
    assert Job.fetch(fine, connection=conn, serializer=JSONSerializer).get_status() == "finished"
    assert conn.get(f"hook-probe:{fine}") == b"ran"
    assert w.thread.is_alive()


def test_redis_refusing_rqs_success_write_for_now_is_waited_out_not_a_failed_callback(served, monkeypatch):
    """An OOM (READONLY, MISCONF) from RQ's success path was taken for the job's success callback raising: the
    finished job was failed (or run again), its failure callback run. Waited out, the write after the callback is
    tried again, and the callback, which ran, is not run again."""
    from redis.exceptions import OutOfMemoryError

    w, client, conn = served
    job_id = f"cb-refused-{uuid.uuid4().hex[:6]}"
    real, refused = w.worker.handle_job_success, []

    def refused_once(*args, **kwargs):
        if not refused:
            refused.append(True)
            raise OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")
        return real(*args, **kwargs)

    monkeypatch.setattr(w.worker, "handle_job_success", refused_once)
    payload = {"prompt": "twins", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    _raw_job(conn, w.queue, job_id, payload, success_callback_name="hook_probe.count",
             failure_callback_name="hook_probe.record_failure")  # fmt: skip
    assert client.job(job_id).result(timeout=30)["status"] == "finished"
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == "finished"
    assert refused and conn.get(f"hook-probe-count:{job_id}") == b"1"
    assert not conn.exists(f"hook-probe-failure:{job_id}")


def test_a_success_callback_failing_on_a_redis_of_its_own_fails_its_job_once_as_rq_does(served):
    """A redis-py error raised by the callback itself was taken for the worker's Redis refusing its write: the end
    was tried again for good, the callback run again at every try (7 in 40 s), the worker said Redis was
    unavailable, and the job stayed started. As RQ, the job fails with that error, its failure callback run."""
    w, client, conn = served
    job_id = f"cb-own-redis-{uuid.uuid4().hex[:6]}"
    payload = {"prompt": "twins", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    _raw_job(conn, w.queue, job_id, payload, success_callback_name="hook_probe.redis_of_its_own_down",
             failure_callback_name="hook_probe.record_failure")  # fmt: skip
    with pytest.raises(JobFailed, match="success callback failed"):
        client.job(job_id).result(timeout=30)
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == "failed"
    assert conn.get(f"hook-probe-count:{job_id}") == b"1" and conn.get(f"hook-probe-failure:{job_id}") == b"ran"
    assert client.submit("still serving", max_tokens=2, temperature=0).result(timeout=30)["status"] == "finished"


def test_rqs_stop_job_command_runs_the_jobs_stopped_callback_not_its_failure_callback(served, monkeypatch):
    """As RQ's worker ends a job it stopped (``_handle_stopped_job``): it ran the failure callback instead."""
    from rq.command import send_stop_job_command

    w, client, conn = served
    slow_engine_steps(monkeypatch, w.worker.engine, 0.01)  # (a stalled test thread must not see it end first)
    job_id = f"cb-stop-{uuid.uuid4().hex[:6]}"
    payload = {"prompt": "keep going", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    _raw_job(conn, w.queue, job_id, payload, stopped_callback_name="hook_probe.record",
             failure_callback_name="hook_probe.record_failure")  # fmt: skip
    next(iter(client.job(job_id).events(timeout=30)))
    send_stop_job_command(conn, job_id, serializer=JSONSerializer)
    with pytest.raises(JobCanceled):
        client.job(job_id).result(timeout=30)
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == "stopped"
    assert conn.get(f"hook-probe:{job_id}") == b"ran"
    assert not conn.exists(f"hook-probe-failure:{job_id}")


def test_a_job_refused_for_what_it_holds_is_logged_in_one_line_without_a_traceback(served, caplog):
    """A bad job is its producer's mistake: one warning naming the job and why. RQ's log of a failed job carried a
    traceback of the worker's own code, for every prompt too long and every payload that does not parse."""
    w, client, conn = served
    registry = w.worker.metrics.registry
    rejected = registry.get_sample_value("roseinfer_jobs_total", {"status": "rejected"}) or 0
    failed_before = registry.get_sample_value("roseinfer_jobs_total", {"status": "failed"}) or 0
    too_long = client.submit("word " * 400, max_tokens=4)  # refused by the engine (256 positions)
    unknown = f"unknown-field-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, unknown, {"prompt": "hi", "max_tokens": 3, "bogus": 1})  # refused as it is taken
    for job_id, why, code in ((too_long.id, "allows at most", "context_length_exceeded"), (unknown, "bogus", None)):
        with pytest.raises(JobFailed) as failed:
            client.job(job_id).result(timeout=30)
        assert failed.value.error_code == code and failed.value.result.get("error_code") == code  # OpenAI's code
        assert list(client.job(job_id).events(timeout=10))[-1].get("error_code") == code
        said = [r for r in caplog.records if job_id in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert said[0].levelno == logging.WARNING and not said[0].exc_info
        assert "Traceback" not in said[0].getMessage() and why in said[0].getMessage()
    # Both refused for what they ask, under one label (the engine's refusal was counted "failed")
    deadline = time.monotonic() + 10  # (counted once its end is written, after the result a reader saw)
    while registry.get_sample_value("roseinfer_jobs_total", {"status": "rejected"}) != rejected + 2:
        assert time.monotonic() < deadline, registry.get_sample_value("roseinfer_jobs_total", {"status": "failed"})
        time.sleep(0.02)
    assert (registry.get_sample_value("roseinfer_jobs_total", {"status": "failed"}) or 0) == failed_before


def test_keys_a_job_writes_that_hold_another_type_fail_nothing_beside_them(served, caplog):
    """A token stream, result stream or completion list written by hand with another type: the start's stream read,
    the events script and the ends script failed on it, and with it every job pulled, sent or ended together."""
    w, client, conn = served
    tag = uuid.uuid4().hex[:6]
    ids = [f"wrongtype-{kind}-{tag}" for kind in ("stream", "result", "notify", "fine")]
    conn.set(f"roseinfer:stream:{ids[0]}", "not a stream")
    conn.set(f"rq:results:{ids[1]}", "not a stream")
    conn.set(f"roseinfer:done:list-{tag}", "not a list")
    for job_id in ids:
        payload = {"prompt": "twins", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        payload["notify"] = f"list-{tag}" if "notify" in job_id else f"fine-{tag}"
        _raw_job(conn, w.queue, job_id, payload, push=False)
    conn.rpush(f"rq:queue:{w.queue}", *ids)  # taken, started, run and ended together
    for job_id in ids:
        assert client.job(job_id).result(timeout=30)["usage"]["completion_tokens"] == 3, job_id
        assert "".join(client.job(job_id).stream(timeout=10)) == client.job(job_id).result(timeout=1)["text"]
    assert sorted(conn.lrange(f"roseinfer:done:fine-{tag}", 0, -1)) == sorted(
        i.encode() for i in ids if "notify" not in i
    )
    assert conn.get(f"roseinfer:done:list-{tag}") == b"not a list"  # a key not the job's own is left as it was
    assert f"job {ids[0]}: its token or result stream key held another type" in caplog.text
    assert w.thread.is_alive()


@pytest.mark.parametrize("lane", [0, BULK_PRIORITY])
def test_jobs_rqs_own_maintenance_reads_are_stripped_of_what_the_worker_refuses(served, lane):
    """RQ's clean-up reads a dead worker's jobs itself (its registries fetch them) and ran their failure callback
    and webhooks: a fresh worker that allowed neither ran both. Its queues read jobs through the worker's policy:
    every lane's (the bulk lane, ``roseinfer batch``'s, read them through RQ's plain class)."""
    from rq.registry import StartedJobRegistry

    w, _, conn = served
    job_id = f"hooked-{uuid.uuid4().hex[:6]}"
    queue = dict(w.worker._lanes)[lane]
    hooks = [
        {"url": "http://127.0.0.1:9/hook", "job_status": "failed"},
        {"url": "http://allowed.invalid/ok", "job_status": "finished"},
    ]
    _raw_job(conn, queue.name, job_id, failure_callback_name="hook_probe.record_unlisted",
             success_callback_name="hook_probe.record", webhooks=json.dumps(hooks), status="started",
             push=False)  # fmt: skip
    # As a dead worker left it: started, off the queue (never pushed: the live worker would have taken it first).
    registry = StartedJobRegistry(queue.name, connection=conn, job_class=queue.job_class, serializer=JSONSerializer)
    for job in (queue.fetch_job(job_id), registry.job_class.fetch(job_id, connection=conn, serializer=JSONSerializer)):
        assert job.failure_callback is None and job.success_callback.__name__ == "record"  # the allowed one stays
        assert [hook.url for hook in job.webhooks] == ["http://allowed.invalid/ok"]
        reason = w.worker.hooks.refuse(job)  # and the worker still refuses to run it
        assert "hook_probe.record_unlisted" in reason and "127.0.0.1:9/hook" in reason
    plain = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)  # RQ's own class: the hash is untouched
    assert plain._failure_callback_name == "hook_probe.record_unlisted" and len(plain.webhooks) == 2
    # RQ's clean-up itself, as the worker's maintenance runs it, over the job its dead worker left expired.
    conn.zadd(registry.key, {f"{job_id}:gone-execution": 1})
    registry.cleanup()
    assert conn.hget(f"rq:job:{job_id}", "status") == b"failed"  # failed as abandoned
    assert not conn.exists(f"hook-probe:{job_id}")  # its refused failure callback did not run
    # What the job named stays in its hash (the clean-up saved the job it read): this worker's to refuse, not erase.
    kept = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert kept._failure_callback_name == "hook_probe.record_unlisted" and len(kept.webhooks) == 2
    conn.delete(f"rq:job:{job_id}")


def test_a_job_that_never_ran_still_echoes_its_custom_id_and_announces_its_end_on_its_notify_list(served):
    """A payload refused (an unknown field), a job refused for the callback it names, one canceled while queued (a
    bare HSET, as from any language): each ended with ``custom_id`` null and no push onto its ``notify`` list, so a
    producer blocking on that list (docs/protocol.md) waited for good. Its ``metadata`` is echoed too, as a finished
    job's is (it was dropped)."""
    w, _, conn = served
    tag = uuid.uuid4().hex[:6]
    cases = {
        "unknown-field": ({"colour": "red"}, {}),
        "refused-callback": ({}, {"success_callback_name": "hook_probe.record_unlisted"}),
        "canceled-queued": ({}, {"status": "canceled"}),
        # A hash RQ cannot read (C#'s 7-digit fractions of a second; Go's and Java's nanoseconds), or reads and then
        # fails on (a meta that is no object): its payload read alone for its ending.
        "unreadable-hash": ({}, {"created_at": "2026-11-22T10:00:00.1234567Z"}),
        "refused-meta": ({}, {"meta": "[1]"}),
    }
    for name, (extra, fields) in cases.items():
        payload = {"prompt": "hi", "max_tokens": 2, "custom_id": f"mine-{name}", "notify": f"nr-{tag}", **extra,
                   "metadata": {"row": name}}  # fmt: skip
        _raw_job(conn, w.queue, f"{name}-{tag}", payload, **fields)
    done = set()
    while len(done) < len(cases):
        popped = conn.blpop([f"roseinfer:done:nr-{tag}"], timeout=30)
        assert popped is not None, f"announced so far: {done}"
        done.add(popped[1].decode())
    assert done == {f"{name}-{tag}" for name in cases}
    for name in cases:
        result = result_from_entries(read_result(conn, f"{name}-{tag}"))
        assert result["custom_id"] == f"mine-{name}" and result["status"] in ("failed", "canceled"), result
        assert result["metadata"] == {"row": name}


def test_a_job_canceled_by_hand_while_it_waits_for_its_retry_keeps_what_its_earlier_attempt_streamed(served):
    """The protocol's cancel (``HSET ... status canceled``, any language) of a job queued again for its retry: the
    worker that reached it wrote a reset (followers dropped what they had) and a result without text, where a
    client's cancel of the same job keeps what the earlier attempt streamed, as README says."""
    from producer.protocol import make_event, stream_key

    w, _, conn = served
    job_id = f"retry-canceled-{uuid.uuid4().hex[:6]}"
    for event in (make_event(0, "Hel", [5]), make_event(1, "lo", [6, 7])):  # the attempt whose worker died
        conn.xadd(stream_key(job_id), {"event": json.dumps(event)})
    payload = {"prompt": "hi", "max_tokens": 8, "temperature": 0, "notify": job_id}
    _raw_job(conn, w.queue, job_id, payload, status="canceled")
    assert conn.blpop([f"roseinfer:done:{job_id}"], timeout=30) is not None
    deadline = time.time() + 10
    while conn.xlen(stream_key(job_id)) < 3 and time.time() < deadline:  # (the last event follows the result)
        time.sleep(0.02)
    result = result_from_entries(read_result(conn, job_id))
    assert (result["status"], result["text"], result["token_ids"]) == ("canceled", "Hello", [5, 6, 7])
    assert result["usage"]["completion_tokens"] == 3 and "next attempt" in result["error"]
    events = [json.loads(fields[b"event"]) for _id, fields in conn.xrange(stream_key(job_id))]
    assert [(e["n"], e.get("reset"), e.get("finish_reason")) for e in events] == [
        (0, None, None), (1, None, None), (2, None, "abort")
    ]  # fmt: skip
    # An earlier job's stream under a reused id (its entries older than this job): none of its output is this one's.
    reused = f"retry-canceled-{uuid.uuid4().hex[:6]}"
    conn.xadd(stream_key(reused), {"event": json.dumps(make_event(0, "Old", [5]))})
    later = {"prompt": "hi", "max_tokens": 8, "notify": reused}
    _raw_job(conn, w.queue, reused, later, status="canceled", created_at="2099-01-01T00:00:00.000000Z")
    assert conn.blpop([f"roseinfer:done:{reused}"], timeout=30) is not None
    result = result_from_entries(read_result(conn, reused))
    assert "text" not in result and "before it ran" in result["error"], result


def test_a_requeued_job_refused_as_it_comes_ends_its_stream_again(served):
    """A failed job requeued by hand (``rq requeue``) whose payload is now refused: its stream held the earlier
    attempt's end, so the refusal wrote no event at all (the result said invalid_request, the stream timeout)."""
    from producer.protocol import make_event, stream_key

    w, _, conn = served
    job_id = f"requeued-refused-{uuid.uuid4().hex[:6]}"
    for event in (make_event(0, "Hel", [5]), make_event(1, "", [], "error", error="timed out", error_type="timeout")):
        conn.xadd(stream_key(job_id), {"event": json.dumps(event)})
    _raw_job(conn, w.queue, job_id, {"prompt": "hi", "max_tokens": 2, "colour": "red", "notify": job_id})
    assert conn.blpop([f"roseinfer:done:{job_id}"], timeout=30) is not None
    deadline = time.time() + 10
    while conn.xlen(stream_key(job_id)) < 3 and time.time() < deadline:  # (the last event follows the result)
        time.sleep(0.02)
    events = [json.loads(fields[b"event"]) for _id, fields in conn.xrange(stream_key(job_id))]
    assert (events[-1]["n"], events[-1].get("reset"), events[-1]["error_type"]) == (2, True, "invalid_request")


def test_a_job_hash_too_large_to_read_is_refused_unread_and_the_jobs_beside_it_run(served):
    """A hash written by hand with a huge field (a 128 MB description) was read whole by the pull before any bound
    was looked at: eight held the pull 7 s and took the worker 1.2 GB. Past what a worker reads it is refused
    unread, with its size; the jobs beside it run."""
    w, client, conn = served
    job_id = f"fat-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, job_id, {"prompt": "hi", "max_tokens": 2, "notify": job_id}, description="x" * 4_000_000)
    good = client.submit("beside it", max_tokens=2, temperature=0)
    assert good.result(timeout=30)["status"] == "finished"
    with pytest.raises(JobFailed, match=r"the job hash takes \d+ bytes in Redis, more than this worker reads"):
        client.job(job_id).result(timeout=30)
    assert conn.blpop([f"roseinfer:done:{job_id}"], timeout=5) is not None  # (its data read alone: its list named)
    conn.delete(f"rq:job:{job_id}")


def test_a_dependent_enqueued_by_the_worker_keeps_the_callback_it_names_and_is_refused_for_it(served):
    """RQ enqueues a finished job's dependents through the worker's job class, which had taken the refused callback
    off the dependent it read and saved it so: the dependent then ran here, its callback gone for good (a stock
    worker it was meant for would not run it either)."""
    from rq import Callback, Queue

    w, client, conn = served
    queue = Queue(dict(w.worker._lanes)[0].name, connection=conn, serializer=JSONSerializer)
    parent = queue.enqueue(FN, prompt="first", max_tokens=2, temperature=0)
    child = queue.enqueue(FN, prompt="then", max_tokens=2, temperature=0, depends_on=parent,
                          on_success=Callback("hook_probe.record_unlisted"))  # fmt: skip
    assert client.job(parent.id).result(timeout=30)["status"] == "finished"
    with pytest.raises(JobFailed, match=r"refused: success callback 'hook_probe\.record_unlisted'"):
        client.job(child.id).result(timeout=30)
    assert conn.hget(child.key, "success_callback_name") == b"hook_probe.record_unlisted"
    assert not conn.exists(f"hook-probe:{child.id}")


# How each end is reached, with the callback it runs and how it ends: (payload, callback, stopped, error, status,
# last event's finish_reason).
CALLBACK_ENDS = {
    "finished": ({"prompt": "called back", "max_tokens": 2}, "success", None, "finished", "length"),
    "refused by the engine": ({"prompt": "word " * 400, "max_tokens": 4}, "failure", JobFailed, "failed", "error"),
    "refused as it comes": ({"prompt": "hi", "max_tokens": 3, "bogus": 1}, "failure", JobFailed, "failed", "error"),
    "stopped": (
        {"prompt": "keep going", "max_tokens": 200, "temperature": 0, "ignore_eos": True}, "stopped", JobCanceled,
        "stopped", "abort",
    ),
}  # fmt: skip


@pytest.mark.parametrize("end", list(CALLBACK_ENDS))
def test_a_slow_allowed_callback_holds_up_no_other_job_and_its_jobs_last_event_follows_its_end(served, end, caplog):
    """Allowed callbacks (success, failure, stopped) ran on the thread that writes every job's tokens and results:
    while one ran, no other job streamed or ended (ten of 0.2 s stopped another job's stream for 2 s). They run
    beside them now; their own job keeps RQ's order (the callback, then its end) and its last event comes after."""
    from rq.command import send_stop_job_command

    from producer.protocol import stream_key

    w, client, conn = served
    payload, kind, error, status, finish_reason = CALLBACK_ENDS[end]
    job_id = f"cb-held-{end.split()[0]}-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, job_id, payload, **{f"{kind}_callback_name": "hook_probe.held"})
    if kind == "stopped":
        next(iter(client.job(job_id).events(timeout=30)))
        send_stop_job_command(conn, job_id, serializer=JSONSerializer)
    _wait_callbacks_running(conn, [job_id])
    other = client.submit("meanwhile", max_tokens=8, temperature=0)
    assert "".join(other.stream(timeout=20)) == other.result(timeout=20)["text"]  # (before: 30 s behind it)
    assert client.job(job_id).status() == "started"  # its end waits for its callback
    ended = [e for _, e in conn.xrange(stream_key(job_id)) if any(b"finish_reason" in v for v in e.values())]
    assert ended == []  # and so does its last event
    assert w.worker.metrics.registry.get_sample_value("roseinfer_jobs_ending") >= 1  # (an operator sees it wait)
    caplog.set_level(logging.INFO, logger="roseinfer.worker")
    send_stop_job_command(conn, job_id, serializer=JSONSerializer)  # too late: it ended (said, not waited on)
    deadline = time.monotonic() + 10
    while not any(job_id in r.getMessage() and "its end being written" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the stop-job was not said to come too late"
        time.sleep(0.01)
    conn.set(f"hook-probe-release:{job_id}", 1)
    if error is None:
        assert client.job(job_id).result(timeout=30)["status"] == "finished"
    else:
        with pytest.raises(error):
            client.job(job_id).result(timeout=30)
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == status
    assert list(client.job(job_id).events(timeout=10))[-1]["finish_reason"] == finish_reason
    [(result_id, _)] = conn.xrange(f"rq:results:{job_id}")
    [(final_id, _)] = conn.xrevrange(stream_key(job_id), count=1)
    assert _stream_id(result_id) <= _stream_id(final_id)  # written in that order
    deadline = time.monotonic() + 5
    while job_id in w.worker._ending:
        assert time.monotonic() < deadline, "its end stayed in the worker's endings"
        time.sleep(0.01)


def test_a_stopped_job_failed_by_rqs_clean_up_before_its_end_ran_gets_no_last_event(served, monkeypatch):
    """Its stop's end, waiting for a callback thread, finds the job failed by RQ's clean-up (this worker stalled
    past its heartbeat; here written just before the end looks): the end is dropped, and its last event with it.
    That event was held for the callback thread, where the drop did not reach it: the stream ended "abort" a job
    RQ had failed."""
    from rq.command import send_stop_job_command

    from producer.protocol import stream_key

    w, client, conn = served
    job_id = f"cb-lost-stop-{uuid.uuid4().hex[:6]}"
    owned = w.worker._owned

    def failed_first(held, ends_as=()):  # RQ's clean-up, just before this end's look
        if any(job.job.id == job_id for job in held):
            conn.hset(f"rq:job:{job_id}", "status", "failed")
        return owned(held, ends_as)

    monkeypatch.setattr(w.worker, "_owned", failed_first)
    _raw_job(conn, w.queue, job_id, CALLBACK_ENDS["stopped"][0], stopped_callback_name="hook_probe.record")
    next(iter(client.job(job_id).events(timeout=30)))
    send_stop_job_command(conn, job_id, serializer=JSONSerializer)
    deadline = time.monotonic() + 30
    while conn.hget(f"rq:job:{job_id}", "status") != b"failed" or job_id in w.worker._ending:
        assert time.monotonic() < deadline, "its end never ran"
        time.sleep(0.01)
    assert w.worker.sender.drain(10)
    ended = [e for _, e in conn.xrange(stream_key(job_id)) if any(b"finish_reason" in v for v in e.values())]
    assert ended == []
    assert not conn.exists(f"hook-probe:{job_id}")  # (nor did its callback run: the job was not its to end)


def _wait_callbacks_running(conn: Redis, job_ids: list[str]) -> None:
    """Until each job's ``hook_probe.held`` callback runs (held until the test lets it go)."""
    deadline = time.monotonic() + 30
    while not all(conn.get(f"hook-probe:{job_id}") == b"running" for job_id in job_ids):
        assert time.monotonic() < deadline, "the callbacks never ran"
        time.sleep(0.01)


def test_two_jobs_stopped_at_once_with_slow_stopped_callbacks_both_end_stopped(served, monkeypatch):
    """RQ tells a stopped job from a failed one by a single field of the worker (``_stopped_job_id``): two stops
    recorded at once on two callback threads must not read each other's, or one ended failed (and was retried)."""
    import contextlib

    from rq.command import send_stop_job_command

    w, client, conn = served
    together, record = threading.Barrier(2), w.worker.handle_job_failure

    def both_at_once(job, *args, **kwargs):  # the two records meet here where they can (1 s at most)
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait(1.0)
        return record(job, *args, **kwargs)

    monkeypatch.setattr(w.worker, "handle_job_failure", both_at_once)
    tag = uuid.uuid4().hex[:6]
    ids = [f"cb-twostops-{i}-{tag}" for i in range(2)]
    payload = {"prompt": "keep going", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    for job_id in ids:
        _raw_job(conn, w.queue, job_id, payload, stopped_callback_name="hook_probe.held", retries_left="3")
    for job_id in ids:
        next(iter(client.job(job_id).events(timeout=30)))
    for job_id in ids:
        send_stop_job_command(conn, job_id, serializer=JSONSerializer)
    _wait_callbacks_running(conn, ids)
    for job_id in ids:
        conn.set(f"hook-probe-release:{job_id}", 1)
    for job_id in ids:
        with pytest.raises(JobCanceled):
            client.job(job_id).result(timeout=30)
        assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == "stopped"


def _stream_id(entry: bytes) -> tuple[int, int]:
    ms, seq = entry.decode().split("-")
    return int(ms), int(seq)


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        _Recorder.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    do_GET = do_POST  # (RQ's webhooks are GETs unless they say POST)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_webhooks_named_by_a_job_are_never_called_unless_the_host_is_allowed(served):
    w, client, conn = served
    _Recorder.hits = []  # (the class's list: another test's hits are not this one's)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/hook"
        job_id = f"wh-{uuid.uuid4().hex[:6]}"
        hooks = [{"url": url, "job_status": status} for status in ("finished", "failed")]
        _raw_job(conn, w.queue, job_id, webhooks=json.dumps(hooks))
        with pytest.raises(JobFailed, match="webhook to"):
            client.job(job_id).result(timeout=30)
        time.sleep(0.5)
        assert _Recorder.hits == []
    finally:
        server.shutdown()


def test_an_allowed_webhooks_redirect_is_not_followed_and_its_time_is_bounded():
    """RQ's send follows a 30x to any host: the allowed host's redirect reached one never allowed (a cloud's
    metadata address, say). A webhook's timeout was the job's to set, unbounded: one of 10**5 s held the worker's
    exit."""
    from rq.job import Job as RQJob
    from rq.webhook import Webhook

    from worker.intake import MAX_CALLBACK_S, _send_webhooks, out_of_bounds

    asked: list[str] = []  # (the allowed host was called: else "nothing sent" passed as "redirect not followed")

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{target.server_port}/latest/meta-data")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    _Recorder.hits = []
    target = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    allowed = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
    for server in (target, allowed):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        job = RQJob.create("worker.jobs.generate", connection=fakeredis.FakeRedis(), kwargs={"prompt": "hi"})
        _send_webhooks(job, [Webhook(f"http://localhost:{allowed.server_port}/hook", "finished")], None)
        assert asked == ["/hook"] and _Recorder.hits == []
    finally:
        target.shutdown()
        allowed.shutdown()
    job.webhooks = [Webhook("http://localhost/hook", "finished", timeout=10**5)]
    assert f"has a timeout of 100000; 1 to {MAX_CALLBACK_S} s" in out_of_bounds(job)
    job.webhooks = [Webhook("http://localhost/hook", "finished", timeout=30)]
    assert out_of_bounds(job) is None


@pytest.mark.slow  # a worker of its own
def test_an_allowed_webhook_whose_host_is_slow_to_answer_holds_up_no_other_job(redis_url, tiny_chat_model):
    """RQ's worker sends a job's webhooks from the process of that one job. Here they went out on the thread that
    writes every job's events and ends: a host slow to answer (up to a hook's timeout, per job) held them all."""
    answer, calls = threading.Event(), []

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            calls.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            answer.wait(30)  # until the test has seen another job end meanwhile
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    w = ThreadWorker(redis_url, tiny_chat_model, allow_webhook_host=[f"127.0.0.1:{server.server_port}"])
    try:
        conn, client = Redis.from_url(redis_url), Client(redis_url, queue=w.queue)
        hooked = f"wh-{uuid.uuid4().hex[:6]}"
        hooks = [{"url": f"http://127.0.0.1:{server.server_port}/done", "job_status": "finished", "method": "POST",
                  "timeout": 30}]  # fmt: skip
        _raw_job(conn, w.queue, hooked, webhooks=json.dumps(hooks))
        assert client.job(hooked).result(timeout=30)["status"] == "finished"
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(c["job_id"], c["status"]) for c in calls] == [(hooked, "finished")]  # called, and held there
        later = client.submit("meanwhile", max_tokens=3, temperature=0)
        assert later.result(timeout=10)["usage"]["completion_tokens"] == 3
        assert "".join(later.stream(timeout=5)) == later.result(timeout=5)["text"]
    finally:
        answer.set()
        w.stop()
        server.shutdown()


def test_values_past_their_bounds_fail_alone_with_the_field_named(served):
    w, client, conn = served
    cases = {
        "topk": ({"prompt": "hi", "top_k": 10**30}, "top_k"),
        "seed": ({"prompt": "hi", "seed": 2**64}, "seed"),
        "stopid": ({"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
        "huge": ({"prompt": "x" * (100 * 1024)}, "bytes"),
        "bias": ({"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
        "biasid": ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),  # past the model's vocabulary
    }
    ids = {}
    for name, (payload, _) in cases.items():
        ids[name] = f"bound-{name}-{uuid.uuid4().hex[:6]}"
        _raw_job(conn, w.queue, ids[name], payload)
    ok = client.submit("fine", max_tokens=3, temperature=0.7, top_k=10**6)  # past the vocabulary: all of it
    assert ok.result(timeout=30)["usage"]["completion_tokens"] == 3
    for name, (_, phrase) in cases.items():
        with pytest.raises(JobFailed) as err:
            client.job(ids[name]).result(timeout=30)
        assert phrase in err.value.reason, (name, err.value.reason)
    assert w.thread.is_alive()


def _inflating_to(size: int) -> bytes:
    """A job's data, compressed as RQ stores it, that inflates to ``size`` bytes (a thousandth of it stored)."""
    packer = zlib.compressobj(9)
    head = f'["{FN}", null, [], {{"prompt": "'.encode()
    chunks = [packer.compress(head)] + [packer.compress(b"x" * 2**20) for _ in range(size // 2**20)]
    return b"".join(chunks) + packer.compress(b'"}]') + packer.flush()


def test_a_field_that_inflates_past_the_bound_fails_unread_and_the_jobs_beside_it_run(served):
    """RQ inflates a job's data and exc_info as it reads the hash: 16 such jobs of 64 KB each held 1 GB."""
    w, client, conn = served
    bomb = _inflating_to(64 * 2**20)
    assert len(bomb) < 128 * 1024
    fine = zlib.compress(json.dumps([FN, None, [], {"prompt": "hi", "max_tokens": 3}]).encode())
    ids = {f"bomb-{i}-{uuid.uuid4().hex[:6]}": ("data", "exc_info")[i % 2] for i in range(16)}
    for job_id, field in ids.items():
        mapping = {"data": fine, "origin": w.queue, "status": "queued", field: bomb}
        conn.hset(f"rq:job:{job_id}", mapping=mapping)
    conn.rpush(f"rq:queue:{w.queue}", *ids)
    ok = client.submit("fine", max_tokens=3, temperature=0)
    assert ok.result(timeout=30)["usage"]["completion_tokens"] == 3
    for job_id, field in ids.items():
        with pytest.raises(JobFailed, match=f"field '{field}' is over {64 * 1024} bytes once inflated"):
            client.job(job_id).result(timeout=30)
        assert conn.zscore(rejected_key(w.queue), job_id) is not None
    assert w.thread.is_alive()


def test_the_inflated_size_of_a_payload_is_found_without_inflating_it():
    import tracemalloc

    from worker.intake import _inflates_past

    bomb = _inflating_to(64 * 2**20)
    tracemalloc.start()
    try:
        assert _inflates_past(bomb, 64 * 1024)
        assert tracemalloc.get_traced_memory()[1] < 2**20  # the peak: the bound, not the 64 MB
    finally:
        tracemalloc.stop()
    small = zlib.compress(b"x" * 1000)
    assert not _inflates_past(small, 1000) and _inflates_past(small, 999)
    assert not _inflates_past(b"[uncompressed]", 14) and _inflates_past(b"[uncompressed]", 13)  # as RQ reads it


def test_a_step_that_raises_fails_its_jobs_and_the_worker_serves_on(served, monkeypatch):
    w, client, _ = served
    engine = w.worker.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step(flush=True):
        calls["n"] += 1
        if calls["n"] == 3:
            raise IndexError("injected fault inside a step")
        return real_step(flush=flush)

    monkeypatch.setattr(engine, "step", flaky_step)
    jobs = [client.submit(f"victim {i}", max_tokens=40, temperature=0, ignore_eos=True) for i in range(3)]
    results = [job.result(timeout=60) for job in jobs]  # failed by the step, retried (retries=2), finished
    assert calls["n"] > 3
    retried = [job for job in jobs if job.rq_job.retries_left < 2]
    assert retried, "no job was failed by the faulty step"
    for job, result in zip(jobs, results):
        assert result["status"] == "finished" and result["usage"]["completion_tokens"] == 40
        events = list(job.events(timeout=10))  # the failed attempt left no final event: the retry's stream goes on
        assert [e["finish_reason"] for e in events if "finish_reason" in e] == ["length"]
        assert "".join(e["text"] for e in events) == result["text"]
    monkeypatch.setattr(engine, "step", real_step)
    after = client.submit("after the fault", max_tokens=5, temperature=0)
    assert after.result(timeout=30)["usage"]["completion_tokens"] == 5
    assert engine.kv.num_used_blocks == 0 or engine.has_unfinished_requests()
    assert w.thread.is_alive()


def test_a_job_the_engine_cannot_take_fails_alone(served, monkeypatch):
    w, client, _ = served
    engine = w.worker.engine
    real_add = engine.add_request

    def picky_add(request_id, prompt, params=None, **options):
        if "poison" in json.dumps(prompt):
            raise RuntimeError("injected fault at admission")
        return real_add(request_id, prompt, params, **options)

    monkeypatch.setattr(engine, "add_request", picky_add)
    poison = client.submit("poison pill", max_tokens=3)
    fine = client.submit("fine pill", max_tokens=3, temperature=0)
    with pytest.raises(JobFailed, match="injected fault at admission"):
        poison.result(timeout=30)
    assert fine.result(timeout=30)["usage"]["completion_tokens"] == 3
    assert w.thread.is_alive()


@pytest.mark.slow  # waits for a maintenance pass
def test_an_rq_group_key_of_another_type_is_logged_by_maintenance_not_fatal(served, caplog):
    """RQ's clean-up of job groups raised WRONGTYPE on it, and the worker stopped (each restart stopped again)."""
    from rq.group import Group

    w, client, conn = served
    group = f"bad-{uuid.uuid4().hex[:6]}"
    conn.sadd("rq:groups", group)
    conn.set(f"rq:group:{group}", "not a set")
    # One lock for every worker on this Redis, held a maintenance interval: an earlier test's worker (15 s by
    # default) could still hold it for the whole wait below.
    conn.delete(Group.REDIS_GROUP_CLEANING_KEY)
    try:
        deadline = time.time() + 10
        while "job groups failed" not in caplog.text and time.time() < deadline:
            time.sleep(0.1)
        assert "job groups failed" in caplog.text  # the served worker's maintenance runs every second
        assert client.submit("after a bad group", max_tokens=3).result(timeout=30)["status"] == "finished"
        assert w.thread.is_alive()
    finally:
        conn.srem("rq:groups", group)
        conn.delete(f"rq:group:{group}")


@pytest.mark.slow  # 150 slowed steps: keeps the fast lane under a minute
def test_a_redis_error_while_arrivals_go_in_leaves_them_for_the_next_iteration(served, monkeypatch):
    """A copy of a running job pushed again, and a new job, taken in one pull; Redis fails as the running copy's
    records are written. The arrivals after it were dropped (started, never run: abandoned a grace later), and the
    puller counted them against its room for good."""
    import redis as redis_mod

    w, client, conn = served
    slow_engine_steps(monkeypatch, w.worker.engine, 0.01)  # it still runs when its copy is taken in
    # (150 steps of 10 ms at least: the copy pushed below is taken in while it runs, whatever a loaded machine's
    # round trips before the push)
    running = client.submit("long one", max_tokens=150, temperature=0, ignore_eos=True)
    next(iter(running.events(timeout=30)))
    fresh_id = f"fresh-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, fresh_id, retries_left="2", push=False)
    fresh = client.job(fresh_id)
    real, failed = w.worker._keep_running_copy, []

    def flaky(job, queue):
        if not failed:
            failed.append(job.id)
            raise redis_mod.exceptions.ConnectionError("injected: Redis away for a moment")
        return real(job, queue)

    monkeypatch.setattr(w.worker, "_keep_running_copy", flaky)
    conn.rpush(f"rq:queue:{w.queue}", running.id, fresh_id)  # both ids in one push: one pull
    assert fresh.result(timeout=30)["status"] == "finished" and fresh.rq_job.retries_left == 2
    assert running.result(timeout=60)["usage"]["completion_tokens"] == 150 and failed == [running.id]
    assert running.rq_job.get_status() == "finished"
    deadline = time.time() + 5
    while w.worker.puller._handed != w.worker.puller._taken and time.time() < deadline:
        time.sleep(0.05)
    assert w.worker.puller._handed == w.worker.puller._taken  # nothing left counted against the room
    assert w.thread.is_alive()


@pytest.mark.slow  # keeps the fast lane under a minute
def test_a_job_requeued_while_it_runs_here_is_neither_failed_nor_run_twice(served, monkeypatch):
    w, client, conn = served
    slow_engine_steps(monkeypatch, w.worker.engine, 0.01)  # it still runs when its copy is taken in
    job = client.submit("long one", max_tokens=150, temperature=0, ignore_eos=True)
    next(iter(job.events(timeout=30)))
    conn.rpush(f"rq:queue:{w.queue}", job.id)  # what maintenance does when it thinks the worker died
    result = job.result(timeout=60)
    assert result["status"] == "finished" and result["usage"]["completion_tokens"] == 150
    events = list(job.events(timeout=10))
    assert sum(len(e["token_ids"]) for e in events) == 150
    assert [e["finish_reason"] for e in events if "finish_reason" in e] == ["length"]
    assert conn.llen(f"rq:queue:{w.queue}") == 0


@pytest.mark.slow  # seconds of a job running
def test_a_stale_copy_of_a_running_job_saved_over_it_does_not_lose_the_job(served, monkeypatch):
    """``job.meta[...] = ...; job.save()`` on the object ``enqueue`` returned writes "queued" over the running job:
    taken for a requeue at the next heartbeat, it was dropped here, in no queue and no registry, with no result and
    its stream unended, for good. RQ's own worker finishes it; so does this one, its meta as saved."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    w, client, conn = served
    slow_engine_steps(monkeypatch, w.worker.engine, 0.02)  # (it runs past a few heartbeats, 1 s apart)
    job = client.submit("long one", max_tokens=150, temperature=0, ignore_eos=True)
    stale = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    next(iter(job.events(timeout=30)))
    stale.meta["tag"] = "x"
    stale.save()  # "queued" over "started" (the lease may repair it before the next line reads it: no assert here)
    assert Job.fetch(job.id, connection=conn, serializer=JSONSerializer).meta["tag"] == "x"
    result = job.result(timeout=60)
    assert result["status"] == "finished" and result["usage"]["completion_tokens"] == 150
    events = list(job.events(timeout=10))
    assert sum(len(e["token_ids"]) for e in events) == 150 and events[-1]["finish_reason"] == "length"
    assert Job.fetch(job.id, connection=conn, serializer=JSONSerializer).meta["tag"] == "x"


@pytest.mark.slow  # a worker of its own, or seconds of waiting
def test_a_long_stall_does_not_let_rq_think_the_worker_died(redis_url, tiny_chat_model, monkeypatch):
    # Heartbeat every second and two seconds of grace (a TTL of 3 s; one, with whole-second scores, left a loaded
    # machine's beat no slack): a 4 s step would lose the jobs without the thread.
    w = ThreadWorker(redis_url, tiny_chat_model, heartbeat_interval=1, heartbeat_grace=2, maintenance_interval=1)
    try:
        client = Client(redis_url, queue=w.queue)
        engine = w.worker.engine
        real_step = engine.step
        stalled = {"done": False, "over": False}

        def stalling_step(flush=True):
            if not stalled["done"] and engine.has_unfinished_requests():
                stalled["done"] = True
                time.sleep(4)
                stalled["over"] = True
            return real_step(flush=flush)

        monkeypatch.setattr(engine, "step", stalling_step)
        job = client.submit("stall", max_tokens=20, temperature=0, ignore_eos=True)
        deadline = time.time() + 30
        while not stalled["done"] and time.time() < deadline:
            time.sleep(0.05)
        # Taken and started by the puller during the stall: it waits for the step loop, beaten meanwhile (it was
        # not, and RQ's clean-up took it for abandoned: a retry spent, or with none left, failed).
        assert stalled["done"]
        late = client.submit("during the stall", max_tokens=5, temperature=0, ignore_eos=True)
        while late.status() != "started" and not stalled["over"]:
            time.sleep(0.05)
        assert not stalled["over"], "the job submitted during the stall was not taken during it"
        result = job.result(timeout=60)
        assert stalled["done"] and result["status"] == "finished"
        assert job.rq_job.get_status() == "finished"
        assert late.result(timeout=60)["status"] == "finished" and late.rq_job.get_status() == "finished"
        # Neither was taken for abandoned: the client's default of two retries is whole.
        assert job.rq_job.retries_left == 2 and late.rq_job.retries_left == 2
        assert Redis.from_url(redis_url).llen(f"rq:queue:{w.queue}") == 0
    finally:
        w.stop()


@pytest.mark.slow  # a worker of its own, or seconds of waiting
def test_heartbeats_skip_a_job_until_its_start_is_nearly_half_the_grace_old(redis_url, tiny_chat_model, monkeypatch):
    # Beats every second, 16 s of grace: the start's heartbeat (TTL 17 s) stands for the first 5 s of a job (half
    # the grace, less LEASE_SLACK_S: the lease, which ends half the grace before any job's entry, lasts till the
    # next beat). (10 s of grace left a 2 s window, which a loaded CI machine's first event could miss: a skip.)
    w = ThreadWorker(redis_url, tiny_chat_model, heartbeat_interval=1, heartbeat_grace=16)
    try:
        client, conn = Client(redis_url, queue=w.queue), Redis.from_url(redis_url)
        real_step = w.worker.engine.step

        def slow_step(flush=True):  # ~10 s for the job below
            time.sleep(0.1)
            return real_step(flush=flush)

        monkeypatch.setattr(w.worker.engine, "step", slow_step)
        job = client.submit("beat", max_tokens=100, temperature=0, ignore_eos=True)
        next(iter(job.events(timeout=30)))
        started = conn.hget(f"rq:job:{job.id}", "last_heartbeat")
        began = utcparse(started.decode()).timestamp()

        def age() -> float:  # the job's, by Redis's clock (a loaded machine's first event may come a second late)
            seconds, micros = conn.time()
            return seconds + micros / 1e6 - began

        time.sleep(max(0.0, 1.5 - age()))  # beats came meanwhile: none for this job yet
        beaten = conn.hget(f"rq:job:{job.id}", "last_heartbeat")
        looked_in_time = age() < 5.0  # (not when the first event came too late to look before its first beat)
        assert beaten == started or not looked_in_time
        deadline = time.time() + 9
        while conn.hget(f"rq:job:{job.id}", "last_heartbeat") == started and time.time() < deadline:
            time.sleep(0.1)
        assert conn.hget(f"rq:job:{job.id}", "last_heartbeat") != started  # then it is beaten again
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 100
        if not looked_in_time:
            pytest.skip("the job's first event came too late to see that its first beats skipped it")
        assert job.rq_job.get_status() == "finished"
    finally:
        w.stop()


@pytest.mark.slow  # a worker of its own, or seconds of waiting
def test_redis_losing_its_data_mid_run_does_not_cancel_running_jobs(redis_url, tiny_chat_model, monkeypatch):
    w = ThreadWorker(redis_url, tiny_chat_model, heartbeat_interval=1)
    try:
        client = Client(redis_url, queue=w.queue)
        conn = Redis.from_url(redis_url)
        real_step = w.worker.engine.step

        def slow_step(flush=True):  # ~2 s for the jobs below, so Redis loses its data while they run
            time.sleep(0.02)
            return real_step(flush=flush)

        monkeypatch.setattr(w.worker.engine, "step", slow_step)
        jobs = client.submit_many([{"prompt": f"lost {i}", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
                                   for i in range(3)])  # fmt: skip
        for job in jobs:  # every one running (a job still queued would vanish with the data: that is not this test)
            next(iter(job.events(timeout=30)))
        conn.flushall()  # what a restart without persistence leaves: no data,
        conn.script_flush()  # and no scripts (the worker's sender loads them again)
        for job in jobs:
            deadline = time.time() + 60
            while not conn.exists(result_key(job.id)) and time.time() < deadline:
                time.sleep(0.05)
            result = job.result(timeout=5)
            assert result["status"] == "finished" and result["finish_reason"] == "length"
            assert result["usage"]["completion_tokens"] == 100
            deadline = time.time() + 10
            while job.status() != "finished" and time.time() < deadline:
                time.sleep(0.05)
            assert job.status() == "finished"  # the job's hash came back with its result
    finally:
        w.stop()


@pytest.mark.slow  # a worker of its own, or seconds of waiting
def test_stats_tell_the_truth_after_a_drain(redis_url, tiny_chat_model):
    w = ThreadWorker(redis_url, tiny_chat_model, heartbeat_interval=1)
    client = Client(redis_url, queue=w.queue)
    jobs = [client.submit(f"stat {i}", max_tokens=30, temperature=0) for i in range(4)]
    for job in jobs:
        job.result(timeout=60)
    # A heartbeat after the last job ended says 0 (a beat's snapshot taken as the last ended can say 1 till the next)
    deadline = time.monotonic() + 10
    while [row["in_flight"] for row in client.status()["workers"]] != [0]:
        assert time.monotonic() < deadline, client.status()["workers"]
        time.sleep(0.1)
    w.stop()
    assert client.status()["workers"] == []  # a stopped worker drops out


@pytest.mark.slow  # three attempts of a second each
def test_a_job_past_its_timeout_is_retried_from_where_it_stopped_and_fails_alone(served, monkeypatch):
    """A timeout is retried as RQ retries its own, while the job has retries left; each attempt resumes from what
    the last one streamed (its stream never starts over), and the job fails alone once they are spent."""
    from producer.protocol import STREAM_FIELD, event_from_stream

    w, client, conn = served
    real_step = w.worker.engine.step

    def slow_step(flush=True):  # 200 tokens take ~4 s: past the job's 1 s timeout, three times
        time.sleep(0.02)
        return real_step(flush=flush)

    monkeypatch.setattr(w.worker.engine, "step", slow_step)
    job_id = f"late-{uuid.uuid4().hex[:6]}"
    resumed_from, real_submit = [], w.worker.pump.submit

    def submit(submitted_id, prompt, params, timeout=None, output_prefix=None, *args, **kwargs):
        if submitted_id == job_id:  # each attempt's start: the tokens it goes on from
            resumed_from.append(len(output_prefix or ()))
        return real_submit(submitted_id, prompt, params, timeout, output_prefix, *args, **kwargs)

    monkeypatch.setattr(w.worker.pump, "submit", submit)
    payload = {"prompt": "slow", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    _raw_job(conn, w.queue, job_id, payload, timeout="1", retries_left="2")
    other = client.submit("quick", max_tokens=3, temperature=0)
    with pytest.raises(JobFailed, match="exceeded its timeout of 1 s"):
        client.job(job_id).result(timeout=60)
    assert conn.hget(f"rq:job:{job_id}", "status") == b"failed"
    assert conn.llen(f"rq:queue:{w.queue}") == 0
    events = [
        event_from_stream({STREAM_FIELD.encode(): f[STREAM_FIELD.encode()]})
        for _, f in conn.xrange(f"roseinfer:stream:{job_id}")
    ]
    assert not any(e.get("reset") for e in events) and events[-1]["error_type"] == "timeout"
    streamed = sum(len(e["token_ids"]) for e in events)
    assert conn.hget(f"rq:job:{job_id}", "retries_left") == b"0"  # every retry spent
    # Each attempt went on from what the ones before it streamed (however many tokens a loaded machine made in 1 s).
    # (An attempt a loaded machine stalled past its second may stream nothing: the last one went on from some.)
    assert len(resumed_from) == 3 and 0 == resumed_from[0] <= resumed_from[1] <= resumed_from[2] <= streamed < 200
    assert resumed_from[2] > 0
    assert other.result(timeout=30)["usage"]["completion_tokens"] == 3
    # Its result counts what it made, as its last event does (a sum of results' usage missed a timeout's tokens).
    assert result_from_entries(read_result(conn, job_id))["usage"] == events[-1]["usage"]
    assert events[-1]["usage"]["completion_tokens"] == streamed


@pytest.mark.slow  # a second or two of waiting
def test_a_hand_written_job_without_a_timeout_gets_rqs_default_and_minus_one_runs_unlimited(served, monkeypatch):
    """As RQ's worker reads ``timeout``: none (or 0) is the queue's default, 180 s (made 1 s here); -1 is no limit.
    A job hash written by hand without one ran unlimited here."""
    from rq import Queue

    w, client, conn = served
    real_step = w.worker.engine.step

    def slow_step(flush=True):  # 120 tokens take ~2.4 s: past the default made 1 s
        time.sleep(0.02)
        return real_step(flush=flush)

    monkeypatch.setattr(w.worker.engine, "step", slow_step)
    monkeypatch.setattr(Queue, "DEFAULT_TIMEOUT", 1)
    payload = {"prompt": "slow", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    ids = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in ("none", "zero", "unlimited")}
    _raw_job(conn, w.queue, ids["none"], payload)
    _raw_job(conn, w.queue, ids["zero"], payload, timeout="0")
    _raw_job(conn, w.queue, ids["unlimited"], payload, timeout="-1")
    for name in ("none", "zero"):
        with pytest.raises(JobFailed, match="exceeded its timeout of 1 s"):
            client.job(ids[name]).result(timeout=60)
    assert client.job(ids["unlimited"]).result(timeout=60)["usage"]["completion_tokens"] == 120


@pytest.mark.slow  # seconds of waiting: the full suite's, not the fast lane's
def test_redis_busy_with_another_clients_long_script_is_waited_out(served, redis_url):
    """Another client's Lua script runs past Redis's busy-reply-threshold: Redis answers BUSY to everyone until it
    ends. The worker's writes wait for it, as for an unreachable Redis (the sender thread died on the reply once,
    and the step loop then waited on it for good); the job running meanwhile ends whole."""
    _, client, conn = served
    threshold = conn.config_get("busy-reply-threshold")["busy-reply-threshold"]
    conn.config_set("busy-reply-threshold", 100)
    try:
        job = client.submit("keep going", max_tokens=200, ignore_eos=True, temperature=0.0)
        next(iter(job.events(timeout=30)))
        spin = "local t = tonumber(redis.call('TIME')[1]) while tonumber(redis.call('TIME')[1]) - t < 2 do end"
        busy = threading.Thread(target=lambda: Redis.from_url(redis_url).eval(spin, 0), daemon=True)
        busy.start()
        busy.join(10)
        result = job.result(timeout=60)
        assert result["usage"]["completion_tokens"] == 200
        assert "".join(job.stream(timeout=10)) == result["text"]
        after = client.submit("and after", max_tokens=4, temperature=0.0)
        assert after.result(timeout=30)["usage"]["completion_tokens"] == 4
    finally:
        conn.config_set("busy-reply-threshold", threshold)


def test_a_hand_written_job_naming_another_origin_is_kept_in_its_own_queues_registries(served):
    """``origin`` names the queue RQ keeps a job's registries and retries by: a hand-written job whose origin is not
    the list it was pushed to (the queue's name, for a job pushed to a priority lane) gets the queue it came from,
    else its heartbeats missed the registry it started in and RQ failed it while it ran."""
    from rq.registry import FinishedJobRegistry

    _, client, conn = served
    queue = client.queue.name
    job_id = f"origin-{uuid.uuid4().hex[:8]}"
    _raw_job(conn, queue, job_id, {"prompt": "hi", "max_tokens": 3, "temperature": 0}, origin="some-other-queue")
    assert client.job(job_id).result(timeout=30)["usage"]["completion_tokens"] == 3
    assert conn.hget(f"rq:job:{job_id}", "origin") == queue.encode()
    assert job_id in FinishedJobRegistry(queue, connection=conn).get_job_ids()


def test_a_hand_written_jobs_plain_json_data_stays_plain_when_it_fails(served):
    """RQ's save of a failed job wrote its ``data`` zlib-compressed: a client in another language that wrote plain
    JSON and reads the hash as text (redis-py's decode_responses, Node's string replies) failed on it."""
    _, client, conn = served
    job_id = f"plain-{uuid.uuid4().hex[:8]}"
    payload = {"prompt": "hi", "max_tokens": 3, "no_such_field": 1}
    _raw_job(conn, client.queue.name, job_id, payload)
    with pytest.raises(JobFailed, match="no_such_field"):
        client.job(job_id).result(timeout=30)
    assert json.loads(conn.hget(f"rq:job:{job_id}", "data"))[3] == payload
    assert conn.hget(f"rq:job:{job_id}", "status") == b"failed"


def test_a_bad_job_key_or_stream_fails_its_own_job_not_those_pulled_with_it(served, caplog):
    """Each of these failed a whole pull, its good jobs left started by nobody (failed as abandoned later), or came
    back with the jobs beside it at every clean-up: a job key that is not a hash (SET by hand), a canceled job's
    stream key of another type (its stream is read, not repaired, at the start), a stream entry nested past the JSON
    parser's depth."""
    w, client, conn = served
    tag = uuid.uuid4().hex[:6]
    not_hash, canceled, nested = f"nothash-{tag}", f"canceled-{tag}", f"nested-{tag}"
    good = [f"good{i}-{tag}" for i in range(3)]
    payload = {"prompt": "fine", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    conn.set(f"rq:job:{not_hash}", json.dumps(payload))
    _raw_job(conn, w.queue, canceled, payload, push=False, status="canceled")
    conn.set(f"roseinfer:stream:{canceled}", "not a stream")
    for job_id in [nested, *good]:
        _raw_job(conn, w.queue, job_id, payload, push=False)
    conn.xadd(f"roseinfer:stream:{nested}", {"event": "[" * 100_000 + "]" * 100_000})
    conn.rpush(f"rq:queue:{w.queue}", good[0], not_hash, canceled, nested, good[1], good[2])  # one pull
    for job_id in [*good, nested]:
        assert client.job(job_id).result(timeout=20)["usage"]["completion_tokens"] == 3, job_id
    with pytest.raises(JobCanceled):
        client.job(canceled).result(timeout=10)
    assert json.loads(conn.xrevrange(f"roseinfer:stream:{canceled}", count=1)[0][1][b"event"])["finish_reason"] == (
        "abort"
    )
    deadline = time.time() + 10
    while conn.zscore(rejected_key(w.queue), not_hash) is None and time.time() < deadline:
        time.sleep(0.05)
    assert conn.zscore(rejected_key(w.queue), not_hash) is not None
    assert "holds a string, not a hash" in result_from_entries(read_result(conn, not_hash))["error"]
    assert conn.get(f"rq:job:{not_hash}") == json.dumps(payload).encode()  # another type is left as it was
    assert not conn.lrange(f"rq:queue:{w.queue}:intermediate", 0, -1)
    assert w.thread.is_alive()


def test_an_allowed_callbacks_time_limit_past_its_bounds_fails_its_job_before_anything_runs(served):
    """The job sets its allowed callback's time limit: 0 or -1 set none (RQ's timer sets no timer then), and a
    callback that hung held up every job's events on the thread it runs on."""
    w, client, conn = served
    tag = uuid.uuid4().hex[:6]
    cases = {f"cbt-{v}-{tag}": v for v in ("0", "-1", "1000000000")}
    for job_id, value in cases.items():
        _raw_job(conn, w.queue, job_id, success_callback_name="hook_probe.record", success_callback_timeout=value)
    within = f"cbt-within-{tag}"
    _raw_job(conn, w.queue, within, success_callback_name="hook_probe.record", success_callback_timeout="30")
    for job_id in cases:
        with pytest.raises(JobFailed, match=r"'success_callback_timeout'.*1 to 600"):
            client.job(job_id).result(timeout=30)
        assert not conn.exists(f"hook-probe:{job_id}")
    assert client.job(within).result(timeout=30)["status"] == "finished"
    deadline = time.time() + 5
    while not conn.exists(f"hook-probe:{within}") and time.time() < deadline:
        time.sleep(0.05)
    assert conn.get(f"hook-probe:{within}") == b"ran"


def test_a_retried_job_canceled_in_its_queue_ends_its_stream_again_as_canceled(served):
    """An earlier attempt failed (its stream ends with an error event), RQ queued the job again, and a cancel landed
    (HSET status canceled) before a worker reached it: its abort event was dropped (the stream had ended once), so
    followers read the old error while the result said canceled."""
    w, client, conn = served
    job_id = f"again-{uuid.uuid4().hex[:6]}"
    old = {"v": 3, "n": 0, "text": "", "token_ids": [], "finish_reason": "error", "usage": {}, "error": "it broke"}
    conn.xadd(f"roseinfer:stream:{job_id}", {"event": json.dumps(old)})
    _raw_job(conn, w.queue, job_id, status="canceled")
    with pytest.raises(JobCanceled):
        client.job(job_id).result(timeout=30)
    deadline = time.time() + 5
    while conn.xlen(f"roseinfer:stream:{job_id}") < 2 and time.time() < deadline:
        time.sleep(0.05)
    last = json.loads(conn.xrevrange(f"roseinfer:stream:{job_id}", count=1)[0][1][b"event"])
    assert (last["n"], last["finish_reason"], last.get("reset")) == (1, "abort", True)


def test_the_status_of_a_queue_runs_no_callback_of_a_dead_workers_job():
    """``roseinfer status`` counted RQ's registries with ``count``, which runs RQ's cleanup through its plain Job: a
    dead worker's job was failed there, in the status process, and the failure callback the workers refuse ran."""
    import fakeredis

    conn = fakeredis.FakeRedis()
    queue = "dead-worker"
    _raw_job(conn, queue, "hooked", push=False, status="started", failure_callback_name="hook_probe.record_unlisted")
    conn.zadd(f"rq:wip:{queue}", {"hooked:dead-execution": 1})  # the SIGKILLed worker's entry, long expired
    conn.zadd(f"rq:wip:{queue}", {"alive:execution": time.time() + 60})
    conn.zadd(f"rq:failed:{queue}", {"old-failure": time.time() + 60, "expired-failure": 1})
    status = Client(connection=conn, queue=queue).status()
    assert conn.get("hook-probe:hooked") is None and conn.hget("rq:job:hooked", "status") == b"started"
    assert (status["in_flight"], status["failed"], status["finished"]) == (1, 1, 0)  # the entries not expired


def test_a_failure_callback_that_raises_is_the_error_the_jobs_record_holds(served):
    """As RQ records it (its failed registry too): the callback's error replaces the job's. The record written with
    the status kept the job's own error."""
    w, client, conn = served
    job_id = f"cb-fail-boom-{uuid.uuid4().hex[:6]}"
    _raw_job(conn, w.queue, job_id, {"prompt": "word " * 400, "max_tokens": 4}, failure_callback_name="hook_probe.boom")
    with pytest.raises(JobFailed):
        client.job(job_id).result(timeout=30)
    record = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).latest_result()
    assert "boom from the success callback" in record.exc_string and record.return_value["status"] == "failed"


@pytest.mark.slow  # a worker of its own
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (work() raises: the point)
def test_a_stop_whose_last_writes_redis_refuses_still_stops_the_heartbeat(redis_url, tiny_chat_model, monkeypatch):
    """The sender's last writes refused (BUSY: not an outage it waits out) ended the stop there: the heartbeat thread
    beat on for a worker that had stopped, and `rq info` listed it alive."""
    import redis

    w = ThreadWorker(redis_url, tiny_chat_model)

    def busy(*args, **kwargs):
        raise redis.exceptions.ResponseError("BUSY Redis is busy running a script.")

    monkeypatch.setattr(w.worker.sender.connection, "delete", busy)  # (the sender's last writes; the heartbeat's)
    w.worker.request_stop()
    w.thread.join(timeout=30)
    assert not w.thread.is_alive() and isinstance(w.errors[0], redis.exceptions.ResponseError)
    w.worker._heartbeat._thread.join(timeout=15)
    assert not w.worker._heartbeat._thread.is_alive()


def _events(conn: Redis, job_id: str) -> list[dict]:
    return [json.loads(fields[b"event"]) for _id, fields in conn.xrange(f"roseinfer:stream:{job_id}")]


def test_jobs_ending_behind_their_callbacks_count_against_the_jobs_a_worker_holds(redis_url, tiny_chat_model):
    """Jobs whose ends waited behind slow allowed callbacks left ``in_flight``, and the worker took more in: a burst of
    them was pulled whole (80 started at once, their results held in memory, a warm stop waiting for them all).
    They count now: past --max-in-flight, the others stay queued for another worker."""
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=4, max_in_flight=2, allow_callback=["hook_probe.held"])
    conn = Redis.from_url(redis_url)
    try:
        payload = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
        ids = [f"cb-room-{i}-{uuid.uuid4().hex[:6]}" for i in range(5)]
        for job_id in ids:
            _raw_job(conn, w.queue, job_id, payload, success_callback_name="hook_probe.held")
        deadline = time.monotonic() + 30
        while sum(conn.get(f"hook-probe:{job_id}") == b"running" for job_id in ids) < 2:
            assert time.monotonic() < deadline, "the callbacks never ran"
            time.sleep(0.01)
        time.sleep(1.5)  # (a pull looks at least once a second)
        assert conn.llen(f"rq:queue:{w.queue}") == 3
        assert sum(conn.exists(f"hook-probe:{job_id}") for job_id in ids) == 2
        for job_id in ids:
            conn.set(f"hook-probe-release:{job_id}", 1)
        client = Client(redis_url, queue=w.queue)
        assert [client.job(job_id).result(timeout=60)["status"] for job_id in ids] == ["finished"] * 5
    finally:
        for job_id in ids:
            conn.set(f"hook-probe-release:{job_id}", 1)
        w.stop()


@pytest.mark.parametrize("how", ["scheduled", "deferred"])
def test_a_job_canceled_by_hand_while_scheduled_or_deferred_ends_as_canceled(served, how):
    """The protocol's cancel (any language) of a job waiting in RQ's scheduled registry (a retry's wait,
    ``enqueue_in``) or deferred one (``depends_on``): RQ's scheduler queued it again when due as if never
    canceled, and it ran; a deferred one waited for good (RQ enqueues no canceled dependent), no ending at all."""
    from rq import Queue

    from producer.protocol import JOB_FUNCTION

    w, _, conn = served
    queue = Queue(w.queue, connection=conn, serializer=JSONSerializer)
    payload = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "notify": f"hand-{how}"}
    if how == "scheduled":
        job = queue.enqueue_in(timedelta(seconds=1), JOB_FUNCTION, kwargs=payload)
    else:
        parent = queue.enqueue_in(timedelta(hours=1), JOB_FUNCTION, kwargs={"prompt": "x"})
        job = queue.enqueue(JOB_FUNCTION, kwargs=payload, depends_on=parent.id)
    assert job.get_status() == how
    conn.hset(job.key, "status", "canceled")
    assert conn.blpop([f"roseinfer:done:hand-{how}"], timeout=30) is not None
    result = result_from_entries(read_result(conn, job.id))
    assert (result["status"], result["finish_reason"]) == ("canceled", "abort") and "text" not in result
    assert conn.hget(job.key, "status") == b"canceled" and conn.ttl(job.key) > 0


def test_an_id_past_the_bound_is_shown_cut_in_the_log(served, caplog):
    """An id of any size pushed by hand was written whole into the worker's log, a line a push (20 MB each): a
    line now shows its start and its length."""
    w, client, conn = served
    no_hash, bad = "n" * 100_000, "b" * 100_000
    conn.hset(f"rq:job:{bad}", mapping={"data": json.dumps([FN, None, [], {"prompt": "hi"}]), "status": "queued"})
    with caplog.at_level(logging.WARNING, logger="roseinfer.worker"):
        conn.rpush(f"rq:queue:{w.queue}", no_hash, bad)
        assert client.submit("after", max_tokens=2, temperature=0).result(timeout=30)["status"] == "finished"
        deadline = time.time() + 10
        while conn.zscore(rejected_key(w.queue), bad) is None and time.time() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "100000 characters" in r.getMessage()]
    assert len(lines) == 2 and all(len(line) < 1000 for line in lines), [line[:200] for line in lines]
    assert max(len(r.getMessage()) for r in caplog.records) < 10_000
    conn.delete(f"rq:job:{bad}", result_key(bad), f"roseinfer:stream:{bad}")
    conn.zrem(rejected_key(w.queue), bad)


def test_a_callback_still_running_at_a_cold_stop_ends_its_stream_after_its_result(redis_url, tiny_chat_model):
    """A cold stop (a second signal) leaves a running callback to finish, which writes its job's end: its last
    event, held until then, went to a sender thread that had ended. The result was there, the stream never ended."""
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=4, allow_callback=["hook_probe.held"])
    conn = Redis.from_url(redis_url)
    job_id = f"cold-cb-{uuid.uuid4().hex[:6]}"
    payload = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    _raw_job(conn, w.queue, job_id, payload, success_callback_name="hook_probe.held")
    try:
        _wait_callbacks_running(conn, [job_id])
        w.worker.request_stop()
        w.worker.request_stop()
        w.thread.join(timeout=30)
        assert not w.thread.is_alive() and not w.errors
    finally:
        conn.set(f"hook-probe-release:{job_id}", 1)
    deadline = time.time() + 10
    while not (ends := [e for e in _events(conn, job_id) if e.get("finish_reason")]) and time.time() < deadline:
        time.sleep(0.05)
    assert conn.hget(f"rq:job:{job_id}", "status") == b"finished"
    assert [e["finish_reason"] for e in ends] == ["length"], _events(conn, job_id)


def test_the_deferred_jobs_canceled_by_hand_are_found_a_part_of_the_registry_at_a_time(served, monkeypatch):
    """The walk of a deferred registry reads a bounded part of it each maintenance interval, and goes on from there:
    every canceled job is reached, however many wait."""
    from rq import Queue

    import worker.due_retries as due_retries
    from producer.protocol import JOB_FUNCTION

    monkeypatch.setattr(due_retries, "WAITING_WALK", 2)
    w, _, conn = served
    queue = Queue(w.queue, connection=conn, serializer=JSONSerializer)
    parent = queue.enqueue_in(timedelta(hours=1), JOB_FUNCTION, kwargs={"prompt": "x"})
    jobs = [queue.enqueue(JOB_FUNCTION, kwargs={"prompt": "y"}, depends_on=parent.id) for _ in range(5)]
    for job in jobs[::2]:
        conn.hset(job.key, "status", "canceled")
    deadline = time.time() + 30
    while any(not conn.exists(result_key(job.id)) for job in jobs[::2]) and time.time() < deadline:
        time.sleep(0.1)
    assert all(result_from_entries(read_result(conn, job.id))["status"] == "canceled" for job in jobs[::2])
    assert [job.get_status() for job in jobs[1::2]] == ["deferred", "deferred"]
    assert sorted(conn.zrange(f"rq:deferred:{w.queue}", 0, -1)) == sorted(job.id.encode() for job in jobs[1::2])
