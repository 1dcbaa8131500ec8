"""Unit tests of the queue's pieces: payload schema, event encoding, stream resumption (fakeredis)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import fakeredis
import pytest

from producer.protocol import STREAM_FIELD, event_from_message, event_from_stream, make_event, stream_key
from producer.schema import JobRequest
from producer.wire import StreamEvent
from worker.jobs import job_seed
from worker.publisher import Publisher


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "stop": [""]}, "stop strings must not be empty"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "hi", "unknown": 1}, "unknown"),
        ({"prompt": ""}, "the prompt is empty"),
        ({}, "exactly one of"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
        ({"messages": [{"role": "robot", "content": "b"}]}, "role"),
        ({"messages": []}, "messages must not be empty"),
    ],
)
def test_bad_payloads_are_refused(fields, phrase):
    with pytest.raises(ValueError, match=phrase):
        JobRequest.model_validate(fields)


def test_payload_maps_to_engine_arguments():
    req = JobRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "temperature": 1,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "END",
        }
    )
    assert req.engine_prompt() == {"messages": [{"role": "user", "content": "Hi"}]}
    kw = req.sampling_kwargs()
    assert kw["temperature"] == 1.0 and kw["logprobs"] == 3 and kw["stop"] == "END" and kw["max_tokens"] == 5
    assert JobRequest.model_validate({"prompt": "x", "logprobs": 2}).num_logprobs == 2
    assert JobRequest.model_validate({"prompt": "x", "logprobs": False}).num_logprobs is None


def test_stream_entries_and_messages_share_one_encoding_and_old_entries_still_read():
    event = make_event(3, "héllo 4", [1, 2], "stop", {"completion_tokens": 4}, None)
    message = json.dumps(event)
    assert event_from_message(message) == event_from_stream({STREAM_FIELD.encode(): message.encode()}) == event
    # Entries of the first protocol: one field per key, every value a string (" 4" stays text, not a number).
    legacy = {
        "n": "3",
        "text": "héllo 4",
        "token_ids": "[1, 2]",
        "finish_reason": "stop",
        "usage": '{"completion_tokens": 4}',
    }
    assert event_from_stream({k.encode(): v.encode() for k, v in legacy.items()}) == {**event, "v": 1}
    assert event["v"] == 2


def test_job_seed_is_fixed_per_job_and_differs_between_jobs():
    assert job_seed("a") == job_seed("a") != job_seed("b")
    assert 0 <= job_seed("a") < 2**63


def _send(conn, pub) -> None:
    with conn.pipeline() as pipe:
        pub.flush(pipe)
        pipe.execute()


def _events(conn, job_id="j"):
    return [event_from_stream(f) for _id, f in conn.xrange(stream_key(job_id))]


def test_a_retried_job_resumes_from_what_was_streamed():
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    first = pub.resume(conn, ["j"])["j"]
    assert first.start(can_resume=True) == []
    for piece, ids in (("Hel", [1]), ("lo", [2]), (" wor", [3])):
        pub.add(first, piece, ids)
        _send(conn, pub)  # one event per step
    # The worker dies; the retry resumes after the streamed tokens and sends only what follows them.
    second = pub.resume(conn, ["j"])["j"]
    assert (second.next_n, second.resume_text, second.whole) == (3, "Hello wor", True)
    assert second.start(can_resume=True) == [1, 2, 3]
    pub.add(second, "ld", [4])
    pub.add(second, "!", [5], "length", {"completion_tokens": 5})
    _send(conn, pub)
    events = _events(conn)
    assert "".join(e["text"] for e in events) == "Hello world!"
    assert [t for e in events for t in e["token_ids"]] == [1, 2, 3, 4, 5]
    assert [e["n"] for e in events] == list(range(len(events)))
    assert not any(e.get("reset") for e in events)
    assert 0 < conn.ttl(stream_key("j")) <= 60


def _stream_with(conn, pub, pieces, first_n=0):
    s = pub.resume(conn, ["j"])["j"]
    s.next_n = first_n
    for piece, ids in pieces:
        pub.add(s, piece, ids)
        _send(conn, pub)


@pytest.mark.parametrize(
    "why, first_n, end, can_resume",
    [
        ("trimmed: its first events are gone", 4, False, True),
        ("it ended: a requeued job runs again", 0, True, True),
        ("the job asks for logprobs, which the stream does not hold", 0, False, False),
    ],
)
def test_a_stream_that_cannot_be_resumed_is_reset_once(why, first_n, end, can_resume):
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("old ", [7]), ("text", [8])], first_n)
    if end:
        s = pub.resume(conn, ["j"])["j"]
        pub.add(s, "", [], "stop", {})
        _send(conn, pub)
    retry = pub.resume(conn, ["j"])["j"]
    assert retry.start(can_resume=can_resume) == [], why
    pub.add(retry, "new", [1])
    _send(conn, pub)
    pub.add(retry, " text", [2], "length", {})
    _send(conn, pub)
    events = _events(conn)
    assert [e["n"] for e in events] == list(range(first_n, first_n + len(events)))
    reset = [i for i, e in enumerate(events) if e.get("reset")]
    assert len(reset) == 1 and events[reset[0]]["text"] == "new"
    after = events[reset[0] :]
    assert "".join(e["text"] for e in after) == "new text"
    assert [t for e in after for t in e["token_ids"]] == [1, 2]
    # A later retry resumes from the events after the reset.
    again = pub.resume(conn, ["j"])["j"]
    assert (again.resume_ids, again.resume_text, again.whole) == ([1, 2], "new text", False)


def test_steps_between_sends_share_one_event_per_job():
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    a, b = (pub.resume(conn, [j])[j] for j in ("a", "b"))
    pub.add(a, "first", [1])
    assert pub.urgent  # a job's first piece goes out at once
    _send(conn, pub)
    pub.add(b, "<b>", [2])
    assert pub.urgent
    _send(conn, pub)
    for i in range(5):  # five steps before the next send
        pub.add(a, f" {i}", [10 + i])
        pub.add(b, f"<{i}>", [20 + i])
    assert not pub.urgent
    pub.add(b, "", [], "length", {"completion_tokens": 6})
    assert pub.urgent  # and a job's end
    _send(conn, pub)
    ea = [event_from_stream(f) for _id, f in conn.xrange(stream_key("a"))]
    eb = [event_from_stream(f) for _id, f in conn.xrange(stream_key("b"))]
    assert [(e["n"], e["text"], e["token_ids"]) for e in ea] == [
        (0, "first", [1]),
        (1, " 0 1 2 3 4", [10, 11, 12, 13, 14]),
    ]
    assert [e["text"] for e in eb] == ["<b>", "<0><1><2><3><4>"] and eb[1]["finish_reason"] == "length"
    assert pub.take() == ([], [])


def test_a_hand_over_before_the_interval_takes_only_the_jobs_that_cannot_wait():
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    a, b, c = (pub.resume(conn, [j])[j] for j in ("a", "b", "c"))
    for s in (a, b):
        pub.add(s, "start", [1])
    pub.take()
    pub.add(a, " more", [2])  # running: may wait
    pub.add(b, " last", [3], "length", {"completion_tokens": 2})  # an end: may not
    pub.add(c, "first", [4])  # a first piece (the job's TTFT): may not
    events, finals = pub.take(urgent_only=True)
    assert [(job_id, e["text"]) for job_id, e, _ttl, _owner in events] == [("c", "first")]
    assert [(job_id, e["text"]) for job_id, e, _ttl, _owner in finals] == [("b", " last")]
    assert not pub.urgent
    events, finals = pub.take()  # the interval passed: the rest
    assert [(job_id, e["text"], e["n"]) for job_id, e, _ttl, _owner in events] == [("a", " more", 1)] and not finals


def test_a_follower_sees_a_restarted_output_once_and_a_replay_skips_the_void_part():
    from producer import Client, StreamRestarted

    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("old ", [7]), ("text", [8])])
    conn.hset("rq:job:j", "status", "started")
    live = Client(connection=conn).job("j").stream(timeout=5)
    assert next(live) == "old "
    retry = pub.resume(conn, ["j"])["j"]
    retry.start(can_resume=False)
    pub.add(retry, "new", [1])
    _send(conn, pub)
    pub.add(retry, " text", [2], "length", {})
    _send(conn, pub)
    conn.hset("rq:job:j", "status", "finished")
    assert next(live) == "text"
    with pytest.raises(StreamRestarted):
        next(live)
    # Read again (or late), the stream gives the new output only.
    assert "".join(Client(connection=conn).job("j").stream(timeout=5)) == "new text"


def test_an_expired_stream_starting_again_at_event_0_reads_as_a_reset():
    from producer import Client, StreamRestarted

    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("old ", [7]), ("text", [8])])
    conn.hset("rq:job:j", "status", "started")
    live = Client(connection=conn).job("j").stream(timeout=5)
    assert next(live) + next(live) == "old text"
    conn.delete(stream_key("j"))  # expired; the job runs again from nothing (minutes later: newer entry ids)
    time.sleep(0.01)
    _stream_with(conn, pub, [("new", [1])])
    with pytest.raises(StreamRestarted):
        next(live)


def test_the_producer_imports_without_torch_or_transformers():
    code = (
        "import sys, producer, producer.batch, producer.cli; from producer import Client;"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'roseinfer.llm_engine') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_cli_reports_a_dead_redis_and_a_bad_request_in_one_line(capsys):
    from worker.cli import main

    dead = ["--redis-url", "redis://127.0.0.1:1/0"]
    assert main(["submit", "hi", *dead]) == 2
    assert main(["status", *dead]) == 2
    err = capsys.readouterr().err
    assert err.count("error: cannot reach Redis") == 2 and "Traceback" not in err
    assert main(["submit", "hi", "--max-tokens", "-3", *dead]) == 2  # refused before Redis is asked
    assert "max_tokens: Input should be greater than or equal to 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields",
    [
        {"event": "not json"},
        {"event": json.dumps({"v": 2, "text": "no n", "token_ids": [1]})},
        {"event": json.dumps({"v": 2, "n": 0, "text": "x", "token_ids": "12"})},
        {"n": "zero", "text": "x", "token_ids": "[1]"},
    ],
)
def test_a_stream_entry_off_the_protocol_makes_the_job_start_over_not_fail_the_worker(fields):
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    conn.xadd(stream_key("j"), fields)
    s = pub.resume(conn, ["j"])["j"]
    assert s.start(can_resume=True) == []
    pub.add(s, "fresh", [1], "length", {})
    _send(conn, pub)
    last = event_from_stream(conn.xrevrange(stream_key("j"), count=1)[0][1])  # the bad entry stays before it
    assert (last["n"], last["reset"], last["text"]) == (1, True, "fresh")


def test_the_samples_of_a_job_get_events_of_their_own():
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    s = pub.resume(conn, ["multi"])["multi"]
    pub.add(s, "a", [1], index=0)
    pub.add(s, "b", [2], index=1)
    pub.add(s, "c", [3], index=0)  # coalesced with its own sample's piece, never with another's
    _send(conn, pub)
    pub.add(s, "d", [4], "stop", {"completion_tokens": 4}, index=1)
    _send(conn, pub)
    events = _events(conn, "multi")
    assert [(e["n"], e.get("index", 0), e["text"], e["token_ids"]) for e in events] == [
        (0, 0, "ac", [1, 3]),
        (1, 1, "b", [2]),
        (2, 1, "d", [4]),
    ]
    assert "index" not in events[0] and events[-1]["finish_reason"] == "stop"
    for e in events:
        StreamEvent.model_validate(e)


@pytest.fixture(params=["sort", "hget"])
def status_reader(request, redis_url):
    """A connection to the tests' Redis, and the way the sender reads statuses on it: one SORT for all jobs, or,
    for a user whose ACL limits its keys (SORT's GET patterns are refused then), an HGET per job."""
    import uuid

    from redis import Redis

    admin = Redis.from_url(redis_url)
    if request.param == "sort":
        yield admin, True
        return
    user, password = f"limited-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["rq:*", "roseinfer:*"], commands=["+@all"])
    try:
        yield Redis.from_url(redis_url, username=user, password=password), False
    finally:
        admin.acl_deluser(user)


@pytest.mark.redis
def test_a_cancel_through_rqs_registry_is_read_at_once_a_bare_status_at_the_next_sweep(status_reader):
    """Statuses of the jobs in flight are read every status_interval, and at once when a lane's canceled registry
    changed (what RQ's job.cancel() does), so a fast engine's round trips do not each read every job's status."""
    import uuid

    from worker.sender import Batch, Sender

    conn, sorts = status_reader
    tag = uuid.uuid4().hex[:8]
    jobs = {name: f"rq:job:{tag}-{name}" for name in ("via-registry", "bare", "deleted")}
    for key in jobs.values():
        conn.hset(key, "status", "started")
    seen: list[list] = []
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: seen.append(ended), status_interval=3600)
    sender.canceled_keys = [f"rq:canceled:{tag}"]
    conn.rpush(sender.status_list, "left-by-a-broken-round-trip")
    sender.start()
    assert sender.sorts_statuses is sorts
    watch = [(f"{tag}-{name}", key) for name, key in jobs.items()]

    def round_trip() -> list:
        seen.clear()
        sender.put(Batch(watch=watch))
        sender.drain(10)
        return sorted((job_id, status) for ended in seen for job_id, status in ended)

    try:
        assert round_trip() == []  # the first read of every status
        conn.hset(jobs["bare"], "status", "canceled")
        conn.delete(jobs["deleted"])
        assert round_trip() == []  # a bare status waits for the next sweep
        conn.hset(jobs["via-registry"], "status", "stopped")
        conn.zadd(f"rq:canceled:{tag}", {f"{tag}-via-registry": time.time() + 60})
        round_trip()  # the round trip that sees the registry change
        assert round_trip() == [
            (f"{tag}-bare", b"canceled"),
            (f"{tag}-deleted", None),
            (f"{tag}-via-registry", b"stopped"),
        ]
        assert not conn.exists(sender.status_list) or not sorts  # the scratch list lives inside a round trip
    finally:
        sender.stop()
        conn.delete(*jobs.values(), f"rq:canceled:{tag}", sender.status_list)
