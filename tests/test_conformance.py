"""The Redis protocol as a contract (docs/protocol.md), checked as another language would use it: a real worker,
raw Redis commands only (no producer library), every event and result validated against the shipped JSON
Schemas. The same scenarios run in Node.js in test_conformance_node.py."""

from __future__ import annotations

import base64
import json
import time
import uuid
from datetime import datetime, timezone

import jsonschema
import pytest
from conftest import ThreadWorker, slow_engine_steps
from redis import Redis

from producer.wire import SCHEMA_DIR, render, schemas

SCHEMAS = {name: json.loads((SCHEMA_DIR / name).read_text()) for name in schemas()}


def test_the_shipped_schemas_are_the_models_schemas():
    for name, schema in schemas().items():
        drifted = f"{name} drifted: run python3 -m producer.write_schemas"
        assert (SCHEMA_DIR / name).read_text() == render(schema), drifted


def test_the_schema_writer_takes_a_folder_and_help_is_help(tmp_path, monkeypatch, capsys):
    """``python -m producer.wire --help`` wrote the schemas into a folder named ``--help`` (one was committed); its
    module to run, ``producer.write_schemas``, runs with no RuntimeWarning (the package imports ``wire`` first)."""
    from producer.wire import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    main([str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(schemas())
    import subprocess
    import sys

    ran = subprocess.run([sys.executable, "-m", "producer.write_schemas", str(tmp_path / "again")],
                         capture_output=True, text=True, cwd=SCHEMA_DIR.parents[1])  # fmt: skip
    assert ran.returncode == 0 and ran.stderr == "" and len(list((tmp_path / "again").iterdir())) == 3


@pytest.mark.parametrize(
    "payload",
    [{}, {"prompt": "x", "prompt_token_ids": [1]}, {"prompt": ""}, {"messages": []}, {"prompt_token_ids": []},
     {"prompt": "x", "logprobs": 50}, {"prompt": "x", "logit_bias": {"abc": 1}},
     {"prompt": "x", "logit_bias": {"5": 200}}, {"prompt": "x", "stop": [""]}, {"prompt": "x", "stop": ""}],
)  # fmt: skip
def test_what_the_schema_can_say_of_a_payload_the_worker_refuses_it_refuses_too(payload):
    """A producer validating against the shipped schema had these taken, then failed by the worker: no input or two,
    an empty one, logprobs past 20, a logit_bias key that is no token id or a bias past 100, an empty stop string."""
    from producer.schema import JobRequest

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(payload, SCHEMAS["job-payload.schema.json"])
    with pytest.raises(ValueError):
        JobRequest.model_validate(payload)
    accepted = {"prompt": None, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stop": ["a"]}
    jsonschema.validate(accepted, SCHEMAS["job-payload.schema.json"])  # (a null input beside the one given)
    JobRequest.model_validate(accepted)


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    """A worker of this module's own (the scenarios below are marked slow: they wait on generation)."""
    w = ThreadWorker(redis_url, tiny_chat_model, heartbeat_interval=1)
    yield w.queue, Redis.from_url(redis_url, decode_responses=True), w
    w.stop()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _enqueue(r: Redis, queue: str, payload: dict, *, status: str = "queued", **fields) -> str:
    job_id = f"raw-{uuid.uuid4().hex[:10]}"
    jsonschema.validate(payload, SCHEMAS["job-payload.schema.json"])  # what a producer checks before it pushes
    data = json.dumps(["worker.jobs.generate", None, [], payload])
    r.hset(f"rq:job:{job_id}", mapping={"data": data, "origin": queue, "status": status, "created_at": _now(),
                                         "enqueued_at": _now(), **fields})  # fmt: skip
    r.sadd("rq:queues", f"rq:queue:{queue}")
    r.rpush(f"rq:queue:{queue}", job_id)
    return job_id


def decode(raw: str) -> dict:
    """One decoder for a pub/sub message and a stream entry's `event` field."""
    event = json.loads(raw)
    jsonschema.validate(event, SCHEMAS["event.schema.json"])
    return event


def _replay(r: Redis, job_id: str) -> list[dict]:
    return [decode(fields["event"]) for _id, fields in r.xrange(f"roseinfer:stream:{job_id}")]


def _follow(r: Redis, job_id: str, timeout: float = 60) -> list[dict]:
    """Subscribe, replay, then live; events deduplicated by n, until the last."""
    pubsub = r.pubsub()
    pubsub.subscribe(f"roseinfer:tokens:{job_id}")
    seen: dict[int, dict] = {e["n"]: e for e in _replay(r, job_id)}
    deadline = time.time() + timeout
    while not any("finish_reason" in e for e in seen.values()):
        assert time.time() < deadline, "no final event"
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            event = decode(message["data"])
            seen.setdefault(event["n"], event)
    pubsub.close()
    return [seen[n] for n in sorted(seen)]


def _result(r: Redis, job_id: str) -> dict:
    # The protocol's promise: once the final event is out, the result and the final status are there.
    entries = r.xrevrange(f"rq:results:{job_id}", count=1)
    assert entries and "return_value" in entries[0][1], "the final event came before the result"
    result = json.loads(base64.b64decode(entries[0][1]["return_value"]))
    jsonschema.validate(result, SCHEMAS["result.schema.json"])
    assert not r.exists(f"roseinfer:result:{job_id}")  # stored once (protocol 2 kept a copy there)
    return result


def _wait_for_events(r: Redis, job_id: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not r.exists(f"roseinfer:stream:{job_id}"):
        assert time.time() < deadline
        time.sleep(0.02)


@pytest.mark.slow
def test_a_chat_job_followed_live(served):
    queue, r, _ = served
    payload = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
    job_id = f"raw-{uuid.uuid4().hex[:10]}"
    pubsub = r.pubsub()
    pubsub.subscribe(f"roseinfer:tokens:{job_id}")  # before the job exists: nothing is missed
    data = json.dumps(["worker.jobs.generate", None, [], payload])
    r.hset(f"rq:job:{job_id}", mapping={"data": data, "origin": queue, "status": "queued", "created_at": _now(),
                                         "enqueued_at": _now()})  # fmt: skip
    r.rpush(f"rq:queue:{queue}", job_id)
    live = []
    deadline = time.time() + 60
    while not live or "finish_reason" not in live[-1]:
        assert time.time() < deadline
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            live.append(decode(message["data"]))
    result = _result(r, job_id)
    assert r.hget(f"rq:job:{job_id}", "status") == "finished"
    assert [e["n"] for e in live] == list(range(len(live)))
    assert "".join(e["text"] for e in live) == result["text"]
    assert live[-1]["usage"]["completion_tokens"] == result["usage"]["completion_tokens"] == 8
    assert _replay(r, job_id) == live  # the stream holds the same events
    # No result_ttl given: the job's status lives as long as its result.
    job_ttl, result_ttl = r.ttl(f"rq:job:{job_id}"), r.ttl(f"rq:results:{job_id}")
    assert job_ttl > 0 and result_ttl > 0 and abs(job_ttl - result_ttl) < 120


@pytest.mark.slow
def test_a_sampled_prompt_followed_late(served):
    queue, r, _ = served
    job_id = _enqueue(r, queue, {"prompt": "Once", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7})
    events = _follow(r, job_id)
    time.sleep(0.2)
    late = _replay(r, job_id)
    assert late == events and late[-1]["finish_reason"] == "length"
    assert "".join(e["text"] for e in late) == _result(r, job_id)["text"]


@pytest.mark.slow
def test_cancel_a_running_job(served, monkeypatch):
    queue, r, w = served
    slow_engine_steps(monkeypatch, w.worker.engine)  # a plain HSET: seen at the next status read
    job_id = _enqueue(r, queue, {"prompt": "Long", "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    _wait_for_events(r, job_id)
    r.hset(f"rq:job:{job_id}", "status", "canceled")
    events = _follow(r, job_id)
    result = _result(r, job_id)
    assert events[-1]["finish_reason"] == "abort" and result["status"] == "canceled"
    assert "".join(e["text"] for e in events) == result["text"]
    assert 0 < result["usage"]["completion_tokens"] < 200
    assert r.zscore(f"rq:canceled:{queue}", job_id) is not None


@pytest.mark.slow
def test_cancel_a_queued_job(served):
    queue, r, _ = served
    job_id = f"raw-{uuid.uuid4().hex[:10]}"
    data = json.dumps(["worker.jobs.generate", None, [], {"prompt": "never", "max_tokens": 8}])
    r.hset(f"rq:job:{job_id}", mapping={"data": data, "origin": queue, "status": "queued", "created_at": _now(),
                                         "enqueued_at": _now()})  # fmt: skip
    r.hset(f"rq:job:{job_id}", "status", "canceled")  # canceled before any worker could take it
    r.rpush(f"rq:queue:{queue}", job_id)
    events = _follow(r, job_id)
    result = _result(r, job_id)
    assert [e["finish_reason"] for e in events] == ["abort"] and events[0]["token_ids"] == []
    assert result["status"] == "canceled" and not result.get("token_ids")
    assert result["error"] == "job canceled before it ran"
    assert r.hget(f"rq:job:{job_id}", "status") == "canceled"
    assert r.zscore(f"rq:canceled:{queue}", job_id) is not None
    assert r.ttl(f"rq:job:{job_id}") > 0


@pytest.mark.slow
def test_a_failed_job(served):
    queue, r, _ = served
    job_id = f"raw-{uuid.uuid4().hex[:10]}"
    data = json.dumps(["worker.jobs.generate", None, [], {"prompt": "x", "colour": "red"}])
    r.hset(f"rq:job:{job_id}", mapping={"data": data, "origin": queue, "status": "queued", "created_at": _now(),
                                         "enqueued_at": _now()})  # fmt: skip
    r.rpush(f"rq:queue:{queue}", job_id)
    events = _follow(r, job_id)
    result = _result(r, job_id)
    assert events[-1]["finish_reason"] == "error" and "colour" in events[-1]["error"]
    assert result["status"] == "failed" and result["error"] == events[-1]["error"]
    assert r.hget(f"rq:job:{job_id}", "status") == "failed"


@pytest.mark.slow
def test_a_job_id_outside_the_rules_fails_with_a_reason(served):
    queue, r, _ = served
    job_id = f"bad id {uuid.uuid4().hex[:6]}"
    data = json.dumps(["worker.jobs.generate", None, [], {"prompt": "x"}])
    r.hset(f"rq:job:{job_id}", mapping={"data": data, "origin": queue, "status": "queued", "created_at": _now(),
                                         "enqueued_at": _now()})  # fmt: skip
    r.rpush(f"rq:queue:{queue}", job_id)
    events = _follow(r, job_id)
    assert events[-1]["finish_reason"] == "error" and "job ids may only use" in events[-1]["error"]
    assert _result(r, job_id)["status"] == "failed"
