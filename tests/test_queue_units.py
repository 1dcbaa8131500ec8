"""Unit tests of the queue's pieces: payload schema, event encoding, stream resumption (fakeredis)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import re
import threading
import time
import uuid

import fakeredis
import pytest

from producer.protocol import (
    STREAM_FIELD,
    STREAM_OF_FIELD,
    event_from_message,
    event_from_stream,
    make_event,
    result_key,
    stream_key,
)
from producer.schema import JobRequest
from producer.wire import StreamEvent
from worker.jobs import job_seed
from worker.publisher import Publisher


def _nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"x": value}
    return value


def test_a_schema_as_deep_as_the_bound_is_taken():
    assert JobRequest.model_validate({"prompt": "hi", "structured_outputs": {"json": _nested(100)}})


def _called(arguments: str) -> dict:
    """A chat payload whose assistant turn made one call with these arguments."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]}


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "repetition_penalty": float("inf")}, "repetition_penalty"),
        # An integer of 401 digits (valid JSON): float() raised OverflowError past pydantic, naming no field.
        ({"prompt": "hi", "temperature": 10**400}, "temperature\n.*less than or equal to 2"),
        ({"prompt": "hi", "top_p": -(10**400)}, "top_p\n.*greater than 0"),
        ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "hi", "stop": [""]}, "stop strings must not be empty"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "hi", "unknown": 1}, "unknown"),
        ({"prompt": ""}, "the prompt is empty"),
        ({}, "exactly one of"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
        ({"messages": [{"role": "robot", "content": "b"}]}, "role"),
        ({"messages": []}, "messages must not be empty"),
        ({"prompt": "hi", "structured_outputs": {"json": _nested(101)}}, "schema nests .* deeper than 100"),
        ({"prompt": "hi", "metadata": _nested(101)}, "metadata nests .* deeper than 100"),
        # Read as infinity, written back as Infinity into the result: JSON no other language parses.
        ({"prompt": "hi", "metadata": {"x": json.loads("1e400")}}, "metadata holds NaN or an infinite number"),
        ({"prompt": "hi", "structured_outputs": {"json": {"maximum": float("nan")}}}, "schema holds NaN"),
        # A datetime, a set, a numpy number: a raw TypeError through pydantic (submit_many's said InvalidRequest).
        ({"prompt": "hi", "metadata": {"when": {1, 2}}}, "metadata holds a value JSON cannot hold: .* set"),
        ({"prompt": "hi", "structured_outputs": {"json": {"default": b"x"}}}, "schema holds a value JSON cannot hold"),
        # Its text: the checks of the schema as an object were skipped, and the worker's read of 3,000 levels was a
        # RecursionError (a server error for the job's own fault).
        ({"prompt": "hi", "structured_outputs": {"json": json.dumps(_nested(101))}}, "schema nests .* deeper than 100"),
        ({"prompt": "hi", "structured_outputs": {"json": "[" * 3000 + "]" * 3000}}, "schema nests deeper than 100"),
        ({"prompt": "hi", "structured_outputs": {"json": "{not json"}}, "schema is not JSON"),
        ({"prompt": "hi", "top_logprobs": 5}, "top_logprobs goes with logprobs: true"),  # none came back
        ({"prompt": "hi", "logprobs": 2, "top_logprobs": 5}, "top_logprobs goes with logprobs: true"),
        ({"prompt": "hi", "max_tokens": 4.5}, "max_tokens"),  # (4.0 is taken: below)
        # Lists every step reads, and constraints compiled on the step loop: bounded (one job slowed every other).
        ({"prompt": "hi", "stop": ["x"] * 65}, "stop holds 65 strings; at most 64"),
        ({"prompt": "hi", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ({"prompt": "hi", "structured_outputs": {"grammar": "x" * 40_000}}, "grammar"),
        ({"prompt": "hi", "structured_outputs": {"choice": ["x" * 20_000] * 2}}, "choice has more than 32768"),
        # A tool call's arguments past the depth bound: the template's reading recursed through them (a server error).
        (_called("[" * 500 + "]" * 500), "arguments are a JSON object"),
        (_called('{"a": ' + "[" * 500 + "]" * 500 + "}"), "nest deeper than 100"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids"),
    ],
)
def test_bad_payloads_are_refused(fields, phrase):
    with pytest.raises(ValueError, match=phrase):
        JobRequest.model_validate(fields)


def test_a_whole_number_written_as_a_float_is_an_integer():
    """JSON Schema's "integer" takes 4.0, and writers whose numbers are doubles (Go's float64, PHP, Java) write it
    so: the schema took such a payload and the worker refused it."""
    req = JobRequest.model_validate({"prompt_token_ids": [1.0, 2], "max_tokens": 4.0, "n": 2.0, "seed": 7.0,
                                     "stop_token_ids": [3.0], "logprobs": 2.0, "priority": 10.0})  # fmt: skip
    assert (req.prompt_token_ids, req.max_tokens, req.n, req.seed, req.stop_token_ids) == ([1, 2], 4, 2, 7, [3])
    assert type(req.max_tokens) is int and req.logprobs == 2 and type(req.logprobs) is int and req.priority == 10


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
    assert event["v"] == 3


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


def test_a_job_run_again_after_its_end_gives_its_stream_the_running_ttl_again():
    """A failed job requeued (``rq requeue``) starts its stream over after the end event, which left the stream
    minutes to live (``stream_ttl_after_end``): its next attempt wrote on without a TTL of its own, and the stream
    could expire while the job ran."""
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=3600, result_ttl=60, stream_ttl_after_end=5)
    first = pub.resume(conn, ["j"])["j"]
    first.start(can_resume=True)
    pub.add(first, "old", [7], "error", {}, "failed")
    _send(conn, pub)
    assert 0 < conn.ttl(stream_key("j")) <= 5
    again = pub.resume(conn, ["j"])["j"]
    assert again.start(can_resume=True) == [] and again.pending_reset  # (it ended: it starts over)
    pub.add(again, "new", [8])
    _send(conn, pub)
    assert conn.ttl(stream_key("j")) > 3000
    pub.add(again, "er", [9])
    _send(conn, pub)
    assert [e["n"] for e in _events(conn)] == [0, 1, 2]


def test_an_ended_streams_ttl_given_longer_than_a_running_ones_is_kept_and_the_default_is_cut(monkeypatch):
    """``stream_ttl_after_end`` of 2 h beside a ``stream_ttl`` of 1 h was cut to 1 h without a word; the default, 10
    minutes, is what is cut, where stream_ttl is shorter."""
    from worker.cli import build_parser, load_settings
    from worker.settings import WorkerSettings

    def ended(settings) -> int:
        return Publisher.from_settings(settings).stream_ttl_after_end

    assert ended(WorkerSettings(stream_ttl=3600, stream_ttl_after_end=7200)) == 7200
    assert ended(WorkerSettings(stream_ttl=60)) == 60 and ended(WorkerSettings()) == 600
    assert ended(WorkerSettings().model_copy(update={"stream_ttl": 30})) == 30
    args = build_parser().parse_args(["worker", "--stream-ttl", "120"])
    assert ended(load_settings(args)) == 120
    monkeypatch.setenv("ROSEINFER_STREAM_TTL_AFTER_END", "7200")
    assert ended(load_settings(args)) == 7200
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=3600, result_ttl=60, stream_ttl_after_end=7200)
    job = pub.resume(conn, ["j"])["j"]
    job.start(can_resume=True)
    pub.add(job, "all", [7], "stop", {}, "finished")
    _send(conn, pub)
    assert 3600 < conn.ttl(stream_key("j")) <= 7200


def test_samples_ending_in_one_flush_each_say_their_own_end_and_the_job_ends_on_its_samples_piece():
    """n > 1: sample 0 pending, then sample 2's last piece (its own end, "stop" on "a"), then sample 0's end of the
    job, all before one flush. The job's end went on sample 2's piece (the last pending), whose own end was dropped:
    no event said sample 2 ended, and sample 0's end was said with index 2."""
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    s = pub.resume(conn, ["j"])["j"]
    s.start(can_resume=False)
    pub.add(s, "x", [1], index=0)
    _send(conn, pub)
    pub.add(s, "y", [2], index=0)
    pub.add(s, "za", [3], index=2, sample_end="stop", stop_reason="a")
    pub.add(s, "e", [4], "stop", {"completion_tokens": 4}, index=0, stop_reason="e")
    _send(conn, pub)
    _first, sample_2, last = _events(conn)
    assert (sample_2["index"], sample_2["sample_finish_reason"], sample_2["stop_reason"]) == (2, "stop", "a")
    assert "finish_reason" not in sample_2 and sample_2["text"] == "za"
    assert last.get("index", 0) == 0 and (last["finish_reason"], last["stop_reason"]) == ("stop", "e")
    assert last["text"] == "ye" and last["token_ids"] == [2, 4] and "sample_finish_reason" not in last


def test_an_event_carries_the_logprobs_of_its_tokens_and_only_all_of_them():
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    s = pub.resume(conn, ["j"])["j"]
    s.start(can_resume=False)
    pub.add(s, "He", [1], logprobs=[{7: -0.5, 1: -1.25}])
    pub.add(s, "llo", [2], logprobs=[{2: -0.125}])  # two steps gathered into one event
    _send(conn, pub)
    pub.add(s, "!", [3, 4], logprobs=[{3: -2.0}])  # one short: left out rather than out of step with the ids
    _send(conn, pub)
    pub.add(s, "", [], "length", {"completion_tokens": 4})
    _send(conn, pub)
    first, second, last = _events(conn)
    assert first["logprobs"] == [[[7, -0.5], [1, -1.25]], [[2, -0.125]]] and first["token_ids"] == [1, 2]
    assert "logprobs" not in second and "logprobs" not in last
    for event in (first, second, last):
        StreamEvent.model_validate(event)


def test_a_stream_with_logprobs_resumes_a_job_asking_for_them():
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    s = pub.resume(conn, ["j"])["j"]
    s.start(can_resume=True, with_logprobs=True)
    pub.add(s, "He", [1], logprobs=[{7: -0.5, 1: -1.25}])
    _send(conn, pub)
    pub.add(s, "y", [2], logprobs=[{2: -0.125}])
    _send(conn, pub)
    retry = pub.resume(conn, ["j"])["j"]
    assert retry.start(can_resume=True, with_logprobs=True) == [1, 2]
    assert retry.resume_logprobs == [{7: -0.5, 1: -1.25}, {2: -0.125}]


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
        ("the job asks for logprobs, which this stream does not hold", 0, False, True),
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
    assert retry.start(can_resume=can_resume, with_logprobs="logprobs" in why) == [], why
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


def test_a_replay_of_a_long_stream_restarted_late_gives_the_new_output_only_in_both_clients():
    """The restart past the first 1,024 entries: the void text was handed out, then StreamRestarted, and each call
    again did the same (``roseinfer submit --stream`` looped on it for good)."""

    server = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=server)
    pub = Publisher(maxlen=100_000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("x", [7])] * 1100)
    retry = pub.resume(conn, ["j"])["j"]
    retry.start(can_resume=False)
    pub.add(retry, "new", [1])
    pub.add(retry, " text", [2], "length", {})
    _send(conn, pub)
    conn.hset("rq:job:j", "status", "finished")
    assert _streamed_by_both_clients(server, "j") == ("new text", "new text")


@pytest.mark.parametrize("page", [3, 4, 1024])
def test_a_replay_read_in_pages_hands_out_what_follows_the_last_reset_only(page, monkeypatch):
    """The backlog is read a page at a time (one XRANGE of 100,000 entries held Redis 40 ms): a reset in any page
    voids what the pages before held, and the new output's events after it, over later pages, all come out."""
    import producer.generation_job as generation_job
    from producer import Client

    monkeypatch.setattr(generation_job, "REPLAY_PAGE", page)
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("old", [7])] * 6)
    retry = pub.resume(conn, ["j"])["j"]
    retry.start(can_resume=False)
    for i in range(7):
        pub.add(retry, f" n{i}", [i], *(("length", {}) if i == 6 else ()))
        _send(conn, pub)
    conn.hset("rq:job:j", "status", "finished")
    assert "".join(Client(connection=conn).job("j").stream(timeout=5)) == "".join(f" n{i}" for i in range(7))


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


def test_a_stream_trimmed_before_it_was_read_says_so_rather_than_give_part_of_the_text():
    """A late reader of a stream the worker trimmed (a short --stream-maxlen): its first events are gone. It is told
    (the text it would read is not the output); both clients read through the same ``EventCursor``."""
    from producer import Client, StreamGap

    conn = fakeredis.FakeRedis()
    conn.hset("rq:job:j", "status", "finished")
    for n in range(5, 10):  # events 0-4 trimmed
        end = ("stop", {}) if n == 9 else ()
        conn.xadd(stream_key("j"), {STREAM_FIELD: json.dumps(make_event(n, f"t{n} ", [n], *end))})
    with pytest.raises(StreamGap, match="events 0-4"):
        list(Client(connection=conn).job("j").stream(timeout=5))
    # With the result there, a reader that had read nothing gets its text, as once the stream expired (it was the
    # gap, the whole output a read away; the async client reads through the same code).
    from producer.protocol import encode_result, result_key

    whole = {"id": "j", "status": "finished", "text": "t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 ", "finish_reason": "stop"}
    conn.xadd(result_key("j"), {"type": 1, "return_value": encode_result(whole)})
    assert list(Client(connection=conn).job("j").stream(timeout=5)) == [whole["text"]]


def test_a_finish_reason_of_null_does_not_end_a_stream():
    """The event schema allows ``"finish_reason": null`` on any event (another language's writer sets every field):
    the followers took it for the end and returned the text so far, where the cursor read it as none."""

    server = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=server)
    conn.hset("rq:job:j", "status", "finished")
    conn.xadd(stream_key("j"), {STREAM_FIELD: json.dumps({**make_event(0, "Hello", [0]), "finish_reason": None})})
    conn.xadd(stream_key("j"), {STREAM_FIELD: json.dumps(make_event(1, " world", [1], "stop", {}))})
    assert _streamed_by_both_clients(server, "j") == ("Hello world", "Hello world")


def _streamed_by_both_clients(server, job_id: str) -> tuple[str, str]:
    """A job's text as ``stream()`` gives it in the sync client and in the async one, on a fakeredis server."""
    from producer import Client
    from producer.aio import AsyncGenerationJob, StreamHub

    conn = fakeredis.FakeRedis(server=server)

    class Async:  # what AsyncGenerationJob reads through: an async connection, its hub and a sync client
        _check_loop = staticmethod(lambda: None)  # (AsyncClient's look at the loop: one loop here)
        connection = fakeredis.FakeAsyncRedis(server=server)
        hub = StreamHub(connection)
        sync = Client(connection=conn)

    async def read() -> str:
        return "".join([piece async for piece in AsyncGenerationJob(Async(), job_id).stream(timeout=5)])

    return "".join(Client(connection=conn).job(job_id).stream(timeout=5)), asyncio.run(read())


def test_an_event_written_twice_is_read_once():
    """Without Lua, a round trip Redis refused part of (full memory) was tried again whole, and its first events
    went into the stream two or three times: ``stream()`` handed each out again (1,672 characters of a 1,386-character
    result). The worker writes such a round trip in MULTI now; a reader leaves out an event it read already."""
    from producer import Client

    conn = fakeredis.FakeRedis()
    conn.hset("rq:job:j", "status", "finished")
    for n, text in ((0, "a"), (0, "a"), (1, "b"), (2, "c"), (1, "b"), (2, "c"), (3, "d")):
        end = ("stop", {}) if n == 3 else ()
        conn.xadd(stream_key("j"), {STREAM_FIELD: json.dumps(make_event(n, text, [n], *end))})
    assert "".join(Client(connection=conn).job("j").stream(timeout=5)) == "abcd"
    # Another event at a number read already is no copy: it is read (a client's abort numbered after a read).
    conn.hset("rq:job:k", "status", "canceled")
    for event in (make_event(0, "a", [0]), make_event(1, "b", [1]), make_event(1, "", [], "abort", {})):
        conn.xadd(stream_key("k"), {STREAM_FIELD: json.dumps(event)})
    assert [e.get("finish_reason") for e in Client(connection=conn).job("k").events(timeout=5)] == [None, None, "abort"]


def _tokens_forever(conn, job_id: str, stop) -> None:
    """A job whose tokens keep coming, every 2 ms, until ``stop`` is set (5 s at most)."""
    n, end = 0, time.monotonic() + 5
    while not stop.is_set() and time.monotonic() < end:
        conn.xadd(stream_key(job_id), {STREAM_FIELD: json.dumps(make_event(n, "x", [n]))})
        n += 1
        time.sleep(0.002)


def test_a_streams_timeout_runs_out_while_its_tokens_keep_coming(redis_url):
    """The deadline was looked at only after a quiet read: ``stream(timeout=0.5)`` of a job whose tokens came faster
    than its reader took them read on for as long as the job ran (``roseinfer submit --stream --timeout 5`` of a
    minute-long job on a GPU).
    (A real Redis: fakeredis's blocking read does not wake for a new entry, so every read there was a quiet one.)"""
    import threading

    from redis import Redis

    from producer import Client

    conn, job_id = Redis.from_url(redis_url), f"tokens-{uuid.uuid4().hex[:6]}"
    conn.hset(f"rq:job:{job_id}", "status", "started")
    stop = threading.Event()
    threading.Thread(target=_tokens_forever, args=(conn, job_id, stop), daemon=True).start()
    started, pieces = time.monotonic(), []
    try:
        with pytest.raises(TimeoutError, match=r"no end of stream within 0\.5 s"):
            for piece in Client(redis_url).job(job_id).stream(timeout=0.5):
                pieces.append(piece)
                time.sleep(0.005)  # a reader slower than the tokens: each read finds some
    finally:
        stop.set()
    assert pieces and time.monotonic() - started < 2.0
    conn.delete(f"rq:job:{job_id}", stream_key(job_id))


@pytest.mark.slow  # seconds of waiting
@pytest.mark.redis
def test_a_follower_on_a_url_with_a_short_socket_timeout_waits_its_own_timeout_not_a_lost_redis(redis_url, monkeypatch):
    """``?socket_timeout=0.5`` in the URL: each blocking read of a second timed out, taken for an outage, and a
    follower of a job still queued raised "lost Redis" once its patience ran out (30 s) though Redis answered."""
    import producer.event_reading as event_reading
    from producer import Client

    monkeypatch.setattr(event_reading, "REDIS_PATIENCE_S", 0.8)  # (30 s: the outage it was taken for ended it sooner)
    job = Client(redis_url + "?socket_timeout=0.5", queue=f"nobody-{uuid.uuid4().hex[:6]}").submit("hi")
    for follow in (lambda: list(job.stream(timeout=2)), lambda: job.result(timeout=2)):
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="within 2 s"):  # (not redis' TimeoutError, which is no builtin)
            follow()
        assert time.monotonic() - started >= 1.9


def test_a_result_of_a_job_that_does_not_exist_raises_no_such_job():
    """It raised a plain JobFailed: a caller could not tell a wrong id (or an expired job) from a failure. RQ's
    users catch NoSuchJobError for it; a JobFailed it stays."""
    from rq.exceptions import NoSuchJobError

    from producer import Client, JobFailed, NoSuchJob

    with pytest.raises(NoSuchJob, match="no such job") as raised:
        Client(connection=fakeredis.FakeRedis()).job("nope").result(timeout=1)
    assert isinstance(raised.value, NoSuchJobError) and isinstance(raised.value, JobFailed)


def test_a_result_wait_for_a_canceled_jobs_partial_result_keeps_within_the_callers_timeout():
    """A canceled job that ran: ``result`` waits up to 2 s for the partial result the worker writes, which took
    those 2 s whatever the caller's timeout (0.1 s here)."""
    from producer import Client, JobCanceled

    conn = fakeredis.FakeRedis()
    conn.hset("rq:job:j", mapping={"status": "canceled", "started_at": "2026-11-29T00:00:00.000000Z"})
    started = time.monotonic()
    with pytest.raises(JobCanceled):
        Client(connection=conn).job("j").result(timeout=0.1)
    assert time.monotonic() - started < 1.5  # (the bug waited the 2 s grace)


@pytest.mark.slow  # a second's wait
@pytest.mark.redis
def test_a_result_waiter_looks_again_only_once_redis_holds_its_subscription(redis_url, monkeypatch):
    """``result`` subscribes to the job's channel, then looks at the job again. The SUBSCRIBE went out unconfirmed
    and the look on another connection: Redis could serve the look first, and a job ending in between published
    its end to nobody (the worker publishes only to channels with subscribers), so the waiter learned of it up to
    a second late. Here the SUBSCRIBE reaches Redis 0.3 s late, as over a slow link."""
    import threading

    from redis import Redis
    from redis.client import PubSub

    from producer import Client
    from producer.protocol import channel_key

    send = PubSub._execute

    def late_subscribe(self, connection, command, *args, **kwargs):
        if args and args[0] == "SUBSCRIBE":
            threading.Timer(0.3, send, (self, connection, command, *args), kwargs).start()
            return None
        return send(self, connection, command, *args, **kwargs)

    monkeypatch.setattr(PubSub, "_execute", late_subscribe)
    client = Client(redis_url)
    job = client.submit("hi", max_tokens=3)  # no worker: it stays queued
    subscribers, look = [], client.connection.pipeline
    other = Redis.from_url(redis_url)

    def looked(*args, **kwargs):
        subscribers.append(other.pubsub_numsub(channel_key(job.id))[0][1])
        return look(*args, **kwargs)

    monkeypatch.setattr(client.connection, "pipeline", looked)
    try:
        with pytest.raises(TimeoutError):
            job.result(timeout=1.0)
    finally:
        client.connection.delete(job.rq_job.key)
        client.connection.lrem(client.queue.key, 0, job.id)
    assert subscribers[:2] == [0, 1]  # the first look, then the look once subscribed


@pytest.mark.redis
def test_a_stream_of_a_job_that_failed_long_ago_says_so_at_once(redis_url):
    """A job that ran and failed (or was canceled) long ago, its stream expired: every stream() of it, sync and
    async, waited 2 s for a final event that could not come, where result() said so at once."""
    import asyncio
    import uuid

    from redis import Redis

    from producer import AsyncClient, Client, JobFailed
    from producer.protocol import encode_result, result_key

    conn, job_id = Redis.from_url(redis_url), f"old-{uuid.uuid4().hex[:8]}"
    conn.hset(f"rq:job:{job_id}", mapping={"status": "failed", "started_at": "2026-11-30T10:00:00.000000Z"})
    result = {"v": 3, "id": job_id, "status": "failed", "error": "it broke", "finish_reason": "error"}
    written_ms = int(conn.time()[0] * 1000) - 3_600_000  # an hour ago, by Redis's clock
    conn.xadd(result_key(job_id), {"type": "2", "return_value": encode_result(result)}, id=f"{written_ms}-0")

    async def async_stream() -> None:
        client = AsyncClient(redis_url)
        try:
            async for _ in client.job(job_id).stream(timeout=5):
                pass
        finally:
            await client.close()

    try:
        for follow in (
            lambda: list(Client(redis_url).job(job_id).stream(timeout=5)),
            lambda: asyncio.run(async_stream()),
        ):
            started = time.monotonic()
            with pytest.raises(JobFailed, match="it broke"):
                follow()
            assert time.monotonic() - started < 1.8  # (the bug waited the 2 s grace)
    finally:
        conn.delete(f"rq:job:{job_id}", result_key(job_id))


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
@pytest.mark.redis
@pytest.mark.parametrize(("ended", "raised"), [("canceled", "JobCanceled"), ("failed", "JobFailed")])
def test_a_job_whose_hash_is_gone_ends_as_its_result_says(redis_url, ended, raised):
    """The hash evicted (or deleted by hand) while the result of a canceled or failed job stays: ``result`` waited
    for good (a status "missing" with a result matched no ending), sync and async, and ``stream`` said "no such
    job"."""
    import asyncio
    import uuid

    from redis import Redis

    import producer
    from producer import AsyncClient, Client
    from producer.protocol import encode_result, result_key

    conn, job_id = Redis.from_url(redis_url), f"gone-{uuid.uuid4().hex[:8]}"
    result = {"v": 3, "id": job_id, "status": ended, "error": "it ended so", "finish_reason": "abort"}
    conn.xadd(result_key(job_id), {"type": "3", "return_value": encode_result(result)})
    conn.expire(result_key(job_id), 60)
    job = Client(redis_url).job(job_id)
    waits = [lambda: job.result(timeout=3)] + ([lambda: "".join(job.stream(timeout=3))] if ended == "canceled" else [])
    for wait in waits:  # (stream() once: its first read waits a second for events)
        started = time.monotonic()
        with pytest.raises(getattr(producer, raised)) as err:
            wait()
        assert time.monotonic() - started < 2 and err.value.result["error"] == "it ended so"

    async def async_result() -> None:
        client = AsyncClient(redis_url)
        try:
            await client.job(job_id).result(timeout=3)
        finally:
            await client.close()

    with pytest.raises(getattr(producer, raised)):
        asyncio.run(async_result())


@pytest.mark.redis
@pytest.mark.slow  # seconds of timers: keeps the fast lane under a minute
def test_a_job_whose_stream_expired_long_ago_streams_its_result_within_a_short_timeout(redis_url):
    """Every stream() of a job long over waited a blocked read and a 2 s grace for a final event that could not
    come (its stream gone): one with a timeout under ~3 s raised TimeoutError, its result there."""
    from rq.results import Result

    from producer import AsyncClient, Client
    from producer.protocol import result_entry, result_key, usage_of

    client = Client(redis_url)
    job = client.submit("hi", max_tokens=3)
    conn = client.connection
    conn.lrem(client.queue.key, 0, job.id)  # a worker ran it, long ago: its result is kept, its stream expired
    result = {"v": 3, "id": job.id, "status": "finished", "finish_reason": "stop", "text": "hello world",
              "token_ids": [1, 2], "usage": usage_of(1, 2)}  # fmt: skip
    conn.xadd(result_key(job.id), result_entry(result, Result.Type.SUCCESSFUL, "w"))
    conn.hset(job.rq_job.key, "status", "finished")
    assert list(job.stream(timeout=0.5)) == ["hello world"]
    # The raw events are gone: said as such, not as a failure (`except JobFailed` took the finished job for failed).
    from producer import JobFailed, StreamExpired, StreamGap

    with pytest.raises(StreamExpired, match="use result") as expired:
        list(job.events(timeout=0.5))
    assert isinstance(expired.value, StreamGap) and not isinstance(expired.value, JobFailed)

    async def async_stream() -> list[str]:
        aclient = AsyncClient(redis_url)
        try:
            return [piece async for piece in aclient.job(job.id).stream(timeout=0.5)]
        finally:
            await aclient.close()

    assert asyncio.run(async_stream()) == ["hello world"]


def test_a_sample_index_the_job_does_not_make_is_refused_and_a_cancel_before_any_text_says_so():
    """``stream(index=7)`` of a job of n=3 ended at once with no text and no error; a job canceled before it made
    text said "the text above is what it made first"."""
    import asyncio

    from producer import Client, JobCanceled
    from producer.aio import AsyncGenerationJob
    from producer.job_errors import InvalidRequest

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn)
    job = client.submit("hi", max_tokens=2, n=3, temperature=1.0)
    for index in (3, 7, -1):
        with pytest.raises(InvalidRequest, match=f"makes 3 sample\\(s\\) \\(n=3\\): there is no sample index {index}"):
            next(job.stream(timeout=1, index=index))

    class Async:
        _check_loop = staticmethod(lambda: None)  # (AsyncClient's look at the loop: one loop here)
        sync = client

    async def async_stream():
        return [piece async for piece in AsyncGenerationJob(Async(), job.id).stream(timeout=1, index=5)]

    with pytest.raises(InvalidRequest, match="no sample index 5"):
        asyncio.run(async_stream())
    assert asyncio.run(AsyncGenerationJob(Async(), job.id).samples()) == 3  # (the async handle tells n too)
    single = client.submit("hi", max_tokens=2)
    conn.xadd(stream_key(single.id), {STREAM_FIELD: json.dumps(make_event(0, "", [], "abort", {}))})
    conn.hset(single.rq_job.key, mapping={"status": "canceled", "started_at": "2026-11-30T00:00:00.000000Z"})
    with pytest.raises(JobCanceled, match="the job was canceled; it had made no text"):
        list(single.stream(timeout=2))


def test_an_async_result_waiter_reads_the_stream_from_its_end_not_its_start():
    """A waiter joining a long stream read and decoded every entry of it, and dragged the hub's shared read of that
    key back to its start."""
    import asyncio

    from producer import Client
    from producer.aio import AsyncGenerationJob, StreamHub

    server = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=server)
    for n in range(2000):
        conn.xadd(stream_key("long"), {STREAM_FIELD: json.dumps(make_event(n, "x", [1]))})
    conn.hset("rq:job:long", "status", "started")
    last = conn.xrevrange(stream_key("long"), count=1)[0][0].decode()
    reads = []

    class Async:
        _check_loop = staticmethod(lambda: None)  # (AsyncClient's look at the loop: one loop here)
        connection = fakeredis.FakeAsyncRedis(server=server)
        hub = StreamHub(fakeredis.FakeAsyncRedis(server=server), wait_ms=20)
        sync = Client(connection=conn)

    real = Async.hub.connection.xread

    async def xread(streams, **kwargs):
        reads.append(dict(streams))
        return await real(streams, **kwargs)

    Async.hub.connection.xread = xread

    async def wait():
        with pytest.raises(TimeoutError):
            await AsyncGenerationJob(Async(), "long").result(timeout=0.3)

    asyncio.run(wait())
    assert reads and all(read[stream_key("long")] == last for read in reads)


def test_an_async_result_without_a_timeout_waits_on_for_a_job_that_went_on_after_an_ended_look(monkeypatch):
    """The async waiter hands a job it saw ended (or missing) to the sync client's last look, for 5 s: where the job
    went on meanwhile (requeued, or enqueued under that id since), a wait given no timeout raised "no result within
    5 s". It follows the job again."""
    import asyncio

    from rq.results import Result

    from producer import Client
    from producer.aio import AsyncGenerationJob, StreamHub
    from producer.generation_job import GenerationJob
    from producer.protocol import result_entry, result_key, usage_of

    server = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=server)

    class Async:
        _check_loop = staticmethod(lambda: None)  # (AsyncClient's look at the loop: one loop here)
        connection = fakeredis.FakeAsyncRedis(server=server)
        hub = StreamHub(fakeredis.FakeAsyncRedis(server=server), wait_ms=20)
        sync = Client(connection=conn)

    last_look = GenerationJob.result

    def went_on(self, timeout=None):  # the id's job enqueued as the last look began: it waited its 5 s out
        if not conn.exists("rq:job:later"):
            conn.hset("rq:job:later", "status", "queued")
            raise TimeoutError("job later: no result within 5 s (status queued)")
        return last_look(self, timeout)

    monkeypatch.setattr(GenerationJob, "result", went_on)

    def finish() -> None:
        time.sleep(0.3)
        result = {"v": 3, "id": "later", "status": "finished", "finish_reason": "stop", "text": "done",
                  "token_ids": [1], "usage": usage_of(1, 1)}  # fmt: skip
        conn.xadd(result_key("later"), result_entry(result, Result.Type.SUCCESSFUL, "w"))
        conn.hset("rq:job:later", "status", "finished")

    async def wait() -> dict:
        asyncio.get_running_loop().run_in_executor(None, finish)
        return await AsyncGenerationJob(Async(), "later").result(timeout=None)

    assert asyncio.run(wait())["text"] == "done"


def test_an_infinite_timeout_waits_without_end():
    """``timeout=inf`` (``roseinfer submit --stream --timeout inf`` takes it): the stream's wait in milliseconds of
    it was an OverflowError."""
    import threading

    from producer import Client

    conn = fakeredis.FakeRedis()
    job = Client(connection=conn).submit("hi", max_tokens=2)
    event = {"v": 3, "n": 0, "text": "hi", "token_ids": [1], "finish_reason": "stop", "usage": {}}
    later = threading.Timer(0.3, lambda: conn.xadd(f"roseinfer:stream:{job.id}", {"event": json.dumps(event)}))
    later.start()  # the wait is on when it comes
    try:
        assert "".join(job.stream(timeout=math.inf)) == "hi"
    finally:
        later.cancel()


def test_a_job_canceled_in_its_queue_ends_as_a_worker_ends_one_and_leaves_no_hash_for_good():
    """RQ's cancel takes the job out of its queue, so no worker reaches it: its hash (and prompt) stayed for good,
    with no final event (a follower of the stream alone waited for ever), no result and no push to its completion
    list. The client writes that ending now, as a worker writes it for a job canceled before it ran. A job a worker
    already took off the queue (pulled, not started) is left to that worker, which ends it itself."""
    from producer import Client, JobCanceled
    from producer.protocol import result_key, stream_key

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn, result_ttl=3600)
    job = client.submit("hi", custom_id="row-7", notify="done-here")
    assert job.cancel()
    assert conn.llen("rq:queue:roseinfer") == 0 and 3500 < conn.ttl(job.rq_job.key) <= 3600
    assert 3500 < conn.ttl(result_key(job.id)) <= 3600
    [(_, fields)] = conn.xrange(stream_key(job.id))
    event = json.loads(fields[b"event"])
    assert (event["n"], event["finish_reason"], event["text"]) == (0, "abort", "")
    assert 0 < conn.ttl(stream_key(job.id)) <= 600
    assert conn.lrange("roseinfer:done:done-here", 0, -1) == [job.id.encode()]
    assert conn.zscore("rq:canceled:roseinfer", job.id) <= time.time() + 3600
    with pytest.raises(JobCanceled) as err:
        job.result(timeout=1)
    assert err.value.result["custom_id"] == "row-7" and err.value.result["finish_reason"] == "abort"
    assert job.rq_job.latest_result().return_value["status"] == "canceled"  # as RQ users read an ending

    pulled = client.submit("there")
    conn.lmove("rq:queue:roseinfer", "rq:queue:roseinfer:intermediate")  # a worker took it, and starts it next
    assert pulled.cancel() and pulled.status() == "canceled"
    assert not conn.exists(stream_key(pulled.id)) and not conn.exists(result_key(pulled.id))
    conn.delete("rq:queue:roseinfer:intermediate")

    # RQ 3's rate limit: one job queued, the next waiting for its slot; both are ended as any unrun job (the hash
    # stayed for good, no result). One a worker pulled is left to it, as above.
    from rq import Queue
    from rq.rate_limit import RateLimit
    from rq.serializers import JSONSerializer

    queue = Queue("roseinfer", connection=conn, serializer=JSONSerializer)
    limited = [queue.enqueue("worker.jobs.generate", prompt="p", rate_limit=RateLimit("rl", 1)) for _ in range(3)]
    assert [j.get_status().value for j in limited] == ["queued", "rate_limited", "rate_limited"]
    conn.lmove("rq:queue:roseinfer", "rq:queue:roseinfer:intermediate")
    limited.append(queue.enqueue("worker.jobs.generate", prompt="p", rate_limit=RateLimit("other", 1)))
    for rq_job, ended in zip(limited, (False, True, True, True)):
        assert client.job(rq_job.id).cancel()
        assert conn.exists(result_key(rq_job.id)) == ended and conn.exists(stream_key(rq_job.id)) == ended
        assert (0 < conn.ttl(rq_job.key) <= 3600) == ended


def test_a_cancel_that_meets_the_job_finishing_leaves_it_finished_and_says_so(monkeypatch):
    """``cancel`` looked at the status, then had RQ cancel: a job that finished between the two became canceled
    (moved to the canceled registry, its result there) and ``cancel`` said True."""
    from rq.job import Job

    from producer import Client

    conn = fakeredis.FakeRedis()
    job = Client(connection=conn).submit("a", max_tokens=2)
    rq_cancel = Job.cancel

    def finishing_meanwhile(self, *args, **kwargs):  # the worker's end lands between the look and the cancel
        conn.hset(f"rq:job:{self.id}", "status", "finished")
        monkeypatch.setattr(Job, "cancel", rq_cancel)
        return rq_cancel(self, *args, **kwargs)

    monkeypatch.setattr(Job, "cancel", finishing_meanwhile)
    assert job.cancel() is False
    assert job.status() == "finished" and not conn.zrange("rq:canceled:roseinfer", 0, -1)


def test_a_result_read_between_rqs_failure_record_and_the_workers_result_waits_for_the_result():
    """The worker records a failure as RQ does (status failed, RQ's entry without a result), then writes the job's
    result (its error, its error_type, what it made) a round trip later: ``result`` read in between raised
    JobFailed without it (``roseinfer result`` printed nothing). An old failure of RQ's alone still raises at once."""
    import base64
    import threading
    import zlib

    from producer import Client, JobFailed
    from producer.protocol import encode_result

    def rq_failure(job_id: str, exc: str, at_ms: int) -> None:  # RQ's own record: no return_value
        exc_string = base64.b64encode(zlib.compress(exc.encode())).decode()
        conn.xadd(f"rq:results:{job_id}", {"type": 2, "exc_string": exc_string}, id=f"{at_ms}-0")

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn)
    j, k = client.submit("a", max_tokens=2).id, client.submit("b", max_tokens=2).id
    conn.hset(f"rq:job:{j}", "status", "failed")
    rq_failure(j, "worker.jobs.JobRejected: prompt too long", int(time.time() * 1000))
    stored = {"id": j, "status": "failed", "error": "prompt too long", "error_type": "invalid_request", "text": ""}

    def write_result() -> None:
        time.sleep(0.3)
        conn.xadd(f"rq:results:{j}", {"type": 2, "return_value": encode_result(stored)})

    threading.Thread(target=write_result, daemon=True).start()
    with pytest.raises(JobFailed) as failed:
        client.job(j).result(timeout=10)
    assert failed.value.result == stored and failed.value.error_type == "invalid_request"

    conn.hset(f"rq:job:{k}", "status", "failed")  # failed by RQ alone (abandoned), a minute ago
    rq_failure(k, "abandoned", int(time.time() * 1000) - 60_000)
    started = time.monotonic()
    with pytest.raises(JobFailed, match="abandoned"):
        client.job(k).result(timeout=10)
    assert time.monotonic() - started < 1.5  # (the bug waited the 2 s grace)


@pytest.mark.redis
def test_a_failure_read_just_after_rqs_record_waits_for_the_result_whatever_the_clients_clock(redis_url, monkeypatch):
    """Whether RQ's failure record is fresh was read against the client's clock: one 5 s ahead of Redis's took it
    for old and raised JobFailed without the job's error (one behind waited 2 s for every old failure)."""
    import base64
    import threading
    import zlib

    from redis import Redis

    from producer import Client, JobFailed
    from producer.protocol import encode_result

    conn = Redis.from_url(redis_url)
    job = Client(redis_url, queue=f"clock-{uuid.uuid4().hex[:6]}").submit("a", max_tokens=2)
    conn.hset(f"rq:job:{job.id}", "status", "failed")
    seconds, micros = conn.time()  # RQ's record, written now by Redis's clock
    exc_string = base64.b64encode(zlib.compress(b"worker.jobs.StepFailed: boom")).decode()
    conn.xadd(f"rq:results:{job.id}", {"type": 2, "exc_string": exc_string}, id=f"{seconds * 1000 + micros // 1000}-0")
    stored = {"id": job.id, "status": "failed", "error": "boom", "error_type": "server_error", "text": ""}
    result = {"type": 2, "return_value": encode_result(stored)}
    writer = threading.Timer(0.3, lambda: conn.xadd(f"rq:results:{job.id}", result))
    writer.start()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 5)  # this client's clock, 5 s ahead
    with pytest.raises(JobFailed) as failed:
        job.result(timeout=10)
    writer.join()
    assert failed.value.result == stored


def _cancel_then_abort(conn, job_id: str, delay: float) -> None:
    """What a worker does to a running job canceled: the status first (the canceller's), the abort event later."""
    conn.xadd(stream_key(job_id), {STREAM_FIELD: json.dumps(make_event(0, "Once ", [5]))})
    conn.hset(f"rq:job:{job_id}", mapping={"status": "canceled", "started_at": "2026-11-29T00:00:00.000000Z"})
    time.sleep(delay)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    conn.xadd(stream_key(job_id), {STREAM_FIELD: json.dumps(make_event(1, "upon", [6], "abort", usage))})


@pytest.mark.slow  # a second of waiting for the abort event
def test_a_follower_of_a_job_canceled_while_it_ran_gets_its_abort_event():
    """The status says canceled a step before the worker's abort event (the last text, the usage) lands: a follower
    that looked in between raised JobCanceled without it, as ``result`` waits for the partial result."""
    import threading

    from producer import Client, JobCanceled

    conn = fakeredis.FakeRedis()
    conn.hset("rq:job:j", "status", "started")
    events = Client(connection=conn).job("j").events(timeout=10)
    threading.Thread(target=_cancel_then_abort, args=(conn, "j", 1.2), daemon=True).start()
    got = list(events)
    assert [e["text"] for e in got] == ["Once ", "upon"] and got[-1]["usage"]["completion_tokens"] == 2
    conn.hset("rq:job:q", mapping={"status": "canceled"})  # canceled before it ran: no event will come
    started = time.monotonic()
    with pytest.raises(JobCanceled):
        list(Client(connection=conn).job("q").events(timeout=10))
    assert time.monotonic() - started < 1.8  # (no grace: no event will come)


@pytest.mark.slow  # a second of waiting for the abort event
def test_an_async_follower_of_a_job_canceled_while_it_ran_gets_its_abort_event(redis_url):
    import asyncio
    import threading

    from redis import Redis

    from producer.aio import AsyncClient

    conn, job_id = Redis.from_url(redis_url), f"aborted-{uuid.uuid4().hex[:6]}"
    conn.hset(f"rq:job:{job_id}", "status", "started")

    async def follow() -> list:
        client = AsyncClient(redis_url)
        try:
            got, events = [], client.job(job_id).events(timeout=10)
            threading.Thread(target=_cancel_then_abort, args=(conn, job_id, 1.2), daemon=True).start()
            async for event in events:
                got.append(event)
            return got
        finally:
            await client.close()

    got = asyncio.run(follow())
    assert [e["text"] for e in got] == ["Once ", "upon"] and got[-1]["finish_reason"] == "abort"
    conn.delete(f"rq:job:{job_id}", stream_key(job_id))


@pytest.mark.redis
def test_one_stream_key_of_another_type_fails_its_own_async_followers_only(redis_url):
    """An async client reads every followed stream in one XREAD, and a key of another type (written by hand) fails
    the whole command: every follower in the process (every request of a server) heard WRONGTYPE, every half
    second. Its own followers hear it now; the others read on."""
    import asyncio

    import redis
    from redis import Redis

    from producer.aio import AsyncClient
    from producer.protocol import make_event

    conn, tag = Redis.from_url(redis_url), uuid.uuid4().hex[:6]
    good, bad = f"good-{tag}", f"bad-{tag}"
    for job_id in (good, bad):
        conn.hset(f"rq:job:{job_id}", "status", "started")
    conn.set(stream_key(bad), "not a stream")

    async def follow() -> None:
        client = AsyncClient(redis_url)

        async def text(job_id: str) -> str:
            return "".join([piece async for piece in client.job(job_id).stream(timeout=10)])

        try:
            reading = asyncio.create_task(text(good))
            await asyncio.sleep(0.2)  # followed
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                async for _ in client.job(bad).events(timeout=10):  # (no replay first: straight to the hub)
                    pass
            conn.xadd(stream_key(good), {"event": json.dumps(make_event(0, "hi", [1], "stop", {}))})
            assert await reading == "hi"
        finally:
            await client.close()

    try:
        asyncio.run(follow())
    finally:
        conn.delete(*[f"rq:job:{j}" for j in (good, bad)], stream_key(good), stream_key(bad))


@pytest.mark.redis
def test_a_finished_jobs_whole_stream_is_given_under_a_short_timeout_sync_and_async(redis_url):
    """The async client's first look at a finished job set the wait for its final event to end by the deadline: with
    a timeout under the hub's first read, its intact stream of 80 events was StreamExpired. The sync one gave one
    event, then "no end of stream within 0 s", the rest in hand."""
    import asyncio

    from redis import Redis

    from producer import Client
    from producer.aio import AsyncClient
    from producer.protocol import make_event

    conn, job_id = Redis.from_url(redis_url), f"over-{uuid.uuid4().hex[:6]}"
    conn.hset(f"rq:job:{job_id}", "status", "finished")
    for n in range(80):
        end = "length" if n == 79 else None
        conn.xadd(stream_key(job_id), {"event": json.dumps(make_event(n, f"t{n} ", [n], end, {}))})

    async def follow(timeout: float) -> list:
        async with AsyncClient(redis_url) as client:
            return [event async for event in client.job(job_id).events(timeout=timeout)]

    try:
        for timeout in (0, 0.05):
            assert len(asyncio.run(follow(timeout))) == 80
            assert len(list(Client(redis_url).job(job_id).events(timeout=timeout))) == 80
    finally:
        conn.delete(f"rq:job:{job_id}", stream_key(job_id))


def test_a_wait_of_a_timeout_of_nan_or_another_type_or_a_job_of_a_non_string_id_is_refused_at_once(redis_url):
    """``timeout=float("nan")`` made every comparison with the deadline false: result() and the async stream() hung
    for ever, the sync stream() raised "cannot convert float NaN to integer". ``timeout="1"``, ``index="1"`` and
    ``client.job(123)`` failed deep inside (a TypeError of + on float and str, of <, of RQ's key making)."""
    import asyncio

    from producer import AsyncClient, Client

    client = Client(connection=fakeredis.FakeRedis())
    job = client.submit("hi", max_tokens=2)
    for call in (lambda t: job.result(timeout=t), lambda t: list(job.stream(timeout=t)),
                 lambda t: list(job.events(timeout=t))):  # fmt: skip
        with pytest.raises(ValueError, match="timeout must be a number of seconds or None, got NaN"):
            call(float("nan"))
        with pytest.raises(TypeError, match="timeout must be a number of seconds or None, got str '1'"):
            call("1")
    from producer.event_reading import deadline_after

    assert deadline_after(10**400) is None  # (past a float's range: no end, not an OverflowError)
    assert deadline_after(-(10**400)) <= time.monotonic()  # (and the negative one's end is now)
    with pytest.raises(TypeError, match="a sample index is an int, got str '1'"):
        list(job.stream(timeout=1, index="1"))
    with pytest.raises(TypeError, match="a job id is a string, got int 123"):
        client.job(123)

    async def main() -> None:
        async with AsyncClient(redis_url) as aclient:
            with pytest.raises(TypeError, match="a job id is a string"):
                aclient.job(123)
            handle = aclient.job(f"none-{uuid.uuid4().hex[:6]}")
            with pytest.raises(ValueError, match="got NaN"):
                await handle.result(timeout=float("nan"))
            with pytest.raises(ValueError, match="got NaN"):
                async for _ in handle.stream(timeout=float("nan")):
                    pass
            for index in (False, 0.0):  # (equal to 0: the async stream took them where the sync one refused them)
                with pytest.raises(TypeError, match="a sample index is an int"):
                    async for _ in handle.stream(timeout=1, index=index):
                        pass

    asyncio.run(main())


def test_an_async_streams_timeout_runs_out_while_its_tokens_keep_coming(redis_url):
    import asyncio
    import threading

    from redis import Redis

    from producer.aio import AsyncClient

    conn, job_id = Redis.from_url(redis_url), f"tokens-{uuid.uuid4().hex[:6]}"
    conn.hset(f"rq:job:{job_id}", "status", "started")
    stop = threading.Event()
    threading.Thread(target=_tokens_forever, args=(conn, job_id, stop), daemon=True).start()

    async def follow() -> list:
        client, pieces = AsyncClient(redis_url), []
        try:
            with pytest.raises(TimeoutError, match=r"no end of stream within 0\.5 s"):
                async for piece in client.job(job_id).stream(timeout=0.5):
                    pieces.append(piece)
                    await asyncio.sleep(0.005)
            return pieces
        finally:
            await client.close()

    started = time.monotonic()
    try:
        assert asyncio.run(follow())
    finally:
        stop.set()
    assert time.monotonic() - started < 2.0
    conn.delete(f"rq:job:{job_id}", stream_key(job_id))


@pytest.mark.slow  # seconds of waiting: the full suite's, not the fast lane's
def test_a_final_event_written_just_after_the_finished_status_still_ends_the_stream():
    """The worker writes a job's result (status finished) and then, in its next write, the final event: a reader
    that looks in between waits for it; a finished job whose stream never shows its end reads as expired."""
    import threading

    from producer import Client, StreamExpired

    conn = fakeredis.FakeRedis()
    conn.hset("rq:job:j", "status", "started")
    live = Client(connection=conn).job("j").stream(timeout=10)

    def finish() -> None:
        time.sleep(0.5)  # within the reader's first quiet second; the event comes after it, once the reader
        conn.xadd(result_key("j"), {"type": "1", "return_value": "{}"})  # (the result, then the status, as the
        conn.hset("rq:job:j", "status", "finished")  # worker's finish script writes them) has found it finished
        time.sleep(0.8)
        conn.xadd(stream_key("j"), {STREAM_FIELD: json.dumps(make_event(0, "Yes", [5], "stop", {}))})

    threading.Thread(target=finish, daemon=True).start()
    assert list(live) == ["Yes"]

    conn.hset("rq:job:k", "status", "finished")  # and nothing in its stream, ever
    started = time.monotonic()
    with pytest.raises(StreamExpired, match="token stream has expired"):  # (not a failure: a StreamGap)
        list(Client(connection=conn).job("k").events(timeout=10))
    assert time.monotonic() - started < 5
    # stream(): from the first token whenever called, so the result's text once the stream expired (it raised)
    from producer.protocol import encode_result

    stored = {"id": "k", "status": "finished", "finish_reason": "stop", "text": "Kept", "token_ids": [3]}
    conn.xadd("rq:results:k", {"type": 1, "return_value": encode_result(stored)})
    assert list(Client(connection=conn).job("k").stream(timeout=10)) == ["Kept"]
    # A worker that died between its result and its last events: the stream stops short, the result is whole. The
    # reader got the text up to there, then StreamExpired; it gets the rest from the result now.
    conn.hset("rq:job:m", "status", "finished")
    for n, piece in enumerate(["Kept ", "in "]):
        conn.xadd(stream_key("m"), {STREAM_FIELD: json.dumps(make_event(n, piece, [n]))})
    whole = {**stored, "id": "m", "text": "Kept in full", "token_ids": [0, 1, 2]}
    conn.xadd("rq:results:m", {"type": 1, "return_value": encode_result(whole)})
    assert list(Client(connection=conn).job("m").stream(timeout=10)) == ["Kept ", "in ", "full"]
    conn.xadd("rq:results:m", {"type": 1, "return_value": encode_result({**whole, "text": "Other text"})})
    with pytest.raises(StreamExpired):  # (what was read is not the result's start: not made up)
        list(Client(connection=conn).job("m").stream(timeout=10))
    # So for a job canceled there (its result the partial text): the rest, then JobCanceled.
    from producer import JobCanceled

    conn.hset("rq:job:m", "status", "canceled")
    partial = {**whole, "status": "canceled", "finish_reason": "abort", "text": "Kept in part"}
    conn.xadd("rq:results:m", {"type": 3, "return_value": encode_result(partial)})
    pieces = []
    with pytest.raises(JobCanceled):
        pieces.extend(Client(connection=conn).job("m").stream(timeout=10))
    assert pieces == ["Kept ", "in ", "part"]


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
        if sorts:  # the scratch list holds the jobs watched (what a broken round trip left is gone) and stays
            assert sorted(conn.lrange(sender.status_list, 0, -1)) == sorted(j.encode() for j, _ in watch)
            rpushes = conn.info("commandstats").get("cmdstat_rpush", {}).get("calls", 0)
            sender._next_status_read = 0.0
            round_trip()
            assert conn.info("commandstats").get("cmdstat_rpush", {}).get("calls", 0) == rpushes
            watch.append((f"{tag}-new", f"rq:job:{tag}-new"))  # a job joins: the list is written again
            sender._next_status_read = 0.0
            round_trip()
            assert len(conn.lrange(sender.status_list, 0, -1)) == 4
    finally:
        sender.stop()
        conn.delete(*jobs.values(), f"rq:canceled:{tag}")
    assert not conn.exists(sender.status_list) or not sorts  # a stopped sender's list is gone


@pytest.mark.redis
def test_events_are_published_only_where_someone_listens_and_always_streamed(redis_url):
    """A channel with a subscriber gets every event, one without gets none (its stream has them all); while a
    pattern subscriber exists every channel is published. A follower that subscribes, then replays the stream
    (the protocol), misses nothing whenever it joins."""
    import uuid

    from redis import Redis

    from producer.protocol import channel_key, make_event, stream_key
    from worker.sender import Batch, Sender

    conn = Redis.from_url(redis_url)
    tag = uuid.uuid4().hex[:8]
    heard, quiet, late = (f"{tag}-{name}" for name in ("heard", "quiet", "late"))
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None)
    sender.start()
    listener, watcher = conn.pubsub(ignore_subscribe_messages=True), conn.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(channel_key(heard))

    def send(n: int, job_ids: list[str]) -> None:
        sender.put(Batch(events=[(j, make_event(n, f"t{n}", [n]), 0, "") for j in job_ids]))
        sender.drain(10)

    def messages(pubsub, expected: int) -> list[tuple[bytes, int]]:
        """What arrived: the ``expected`` messages (waited for), and any more within a grace after them."""
        got, until = [], time.monotonic() + 5.0  # (a subscription's confirmation reads as None)
        while time.monotonic() < until:
            if (m := pubsub.get_message(timeout=0.1)) is not None:
                got.append((m["channel"], json.loads(m["data"])["n"]))
            elif len(got) >= expected:
                until = min(until, time.monotonic() + 0.1)
        return got

    try:
        conn.config_resetstat()
        send(0, [heard, quiet, late])
        assert conn.info("commandstats")["cmdstat_publish"]["calls"] == 1
        watcher.subscribe(channel_key(late))  # a follower joins: it replays the stream, then listens
        replayed = [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(late))]
        send(1, [heard, quiet, late])
        assert replayed + [n for _, n in messages(watcher, 1)] == [0, 1]
        watcher.psubscribe(f"roseinfer:tokens:{tag}-*")  # a dashboard following every job
        send(2, [heard, quiet, late])
        assert sorted(messages(watcher, 4)) == sorted(
            [(channel_key(j).encode(), 2) for j in (heard, quiet, late)] + [(channel_key(late).encode(), 2)]
        )
        assert [n for _, n in messages(listener, 3)] == [0, 1, 2]
        for job_id in (heard, quiet, late):
            assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(job_id))] == [0, 1, 2]
    finally:
        listener.close()
        watcher.close()
        sender.stop()
        conn.delete(*[stream_key(j) for j in (heard, quiet, late)])


@pytest.mark.redis
@pytest.mark.parametrize("lua", [True, False])
def test_a_send_tried_again_after_its_reply_was_lost_writes_no_event_twice(redis_url, lua):
    """The connection drops after Redis ran the event script, before its reply: the sender tries the same send
    again (so does redis-py's own retry, where a connection has one: the worker's have none). The send's number makes
    that second run write nothing; without Lua too, where the sender's own try looks at it first (a MULTI's events
    went in twice: a raw follower read the text twice, a resume found the stream out of order)."""
    import uuid

    from redis import Redis

    from producer.protocol import make_event, stream_key
    from worker.sender import Sender

    conn = Redis.from_url(redis_url)
    job_id = f"twice-{uuid.uuid4().hex[:8]}"
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None)
    sender.start()
    if not lua:
        sender._emit = None  # (as where Redis refuses scripts)
    try:
        first = [(job_id, make_event(0, "Hel", [1]), 0, "")]
        send = sender._next_send()
        sender._send(first, False, send)
        sender._send(first, False, send)  # the same send again: its first run's reply was lost
        sender._send([(job_id, make_event(1, "lo", [2]), 0, "")], False, sender._next_send())
        assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(job_id))] == [0, 1]
    finally:
        sender.stop()
        conn.delete(stream_key(job_id), sender.sent_key)


@pytest.mark.redis
def test_events_let_go_by_a_task_on_the_senders_own_thread_go_out_with_its_queue_full(redis_url):
    """A job's end run in place on the sender's thread (the callback threads shut down at a stop) lets its held
    events go there: the wake-up that put on the sender's own queue waited for good once the queue was full."""
    import threading
    import uuid

    from redis import Redis

    from producer.protocol import make_event, stream_key
    from worker.sender import Batch, Sender

    conn = Redis.from_url(redis_url)
    job_id = f"held-here-{uuid.uuid4().hex[:8]}"
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None, max_pending=1)
    sender.start()
    gate = threading.Event()

    def end_in_place() -> None:
        gate.wait(10)
        sender.release_held(job_id, "")

    try:
        sender.hold(job_id, "")
        sender.put(Batch(events=[(job_id, make_event(0, "Hel", [1]), 0, "")]))  # held
        assert sender.drain(10) and not conn.exists(stream_key(job_id))
        sender.put(Batch(tasks=[end_in_place]))
        deadline = time.monotonic() + 10
        while sender._queue.qsize():  # until the thread took it and waits in it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sender.put(Batch(tasks=[lambda: None]))  # the queue (of one) is full behind it
        gate.set()
        assert sender.drain(10), "the sender waited on its own queue"
        assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(job_id))] == [0]
    finally:
        gate.set()
        sender.stop(timeout=5)
        conn.delete(stream_key(job_id), sender.sent_key)


@pytest.mark.redis
def test_a_stream_key_overwritten_while_its_job_runs_costs_no_other_job_an_event(redis_url):
    """One job's stream key set to a string by hand while it runs: its XADD failed inside the events script, which
    stopped there, and every later event of the round trip (other jobs', their final ones too) was lost. The key is
    replaced by the job's stream now."""
    import uuid

    from redis import Redis

    from producer.protocol import make_event, stream_key
    from worker.sender import Sender

    conn = Redis.from_url(redis_url)
    tag = uuid.uuid4().hex[:8]
    ids = [f"{tag}-before", f"{tag}-overwritten", f"{tag}-after"]
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None)
    sender.start()
    try:
        sender._send([(j, make_event(0, "a", [1]), 0, "") for j in ids], False, sender._next_send())
        conn.set(stream_key(ids[1]), "not a stream")
        sender._send([(j, make_event(1, "b", [2], "stop"), 0, "") for j in ids], False, sender._next_send())
        for job_id in ids[::2]:
            assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(job_id))] == [0, 1]
        assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(ids[1]))] == [1]
    finally:
        sender.stop()
        conn.delete(*[stream_key(j) for j in ids], sender.sent_key)


@pytest.mark.redis
def test_a_job_hash_overwritten_while_its_job_runs_costs_no_other_job_its_final_event(redis_url):
    """One job's hash set to a string by hand while it runs: the events script's look at its owner failed with
    WRONGTYPE and aborted the script, and every event of the round trip was dropped, other jobs' final ones too
    (their streams never ended). That job's event is fenced off as another attempt's; the others are written."""
    import uuid

    from redis import Redis

    from producer.protocol import OWNER_FIELD, make_event, stream_key
    from worker.sender import Sender

    conn = Redis.from_url(redis_url)
    tag = uuid.uuid4().hex[:8]
    ids = [f"{tag}-before", f"{tag}-overwritten", f"{tag}-after"]
    for job_id in ids:
        conn.hset(f"rq:job:{job_id}", mapping={OWNER_FIELD: "e1", "status": "started"})
    conn.delete(f"rq:job:{ids[1]}")
    conn.set(f"rq:job:{ids[1]}", "not a hash")
    lost: list = []
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None, lost.extend)
    sender.start()
    try:
        sender._send([(j, make_event(0, "a", [1], "stop"), 0, "e1") for j in ids], False, sender._next_send())
        for job_id in ids[::2]:
            assert [json.loads(f[b"event"])["finish_reason"] for _, f in conn.xrange(stream_key(job_id))] == ["stop"]
        assert not conn.exists(stream_key(ids[1])) and [job_id for job_id, _ in lost] == [ids[1]]
    finally:
        sender.stop()
        conn.delete(*[stream_key(j) for j in ids], *[f"rq:job:{j}" for j in ids], sender.sent_key)


@pytest.mark.redis
def test_a_job_rqs_clean_up_failed_as_abandoned_is_not_finished_or_streamed_by_the_stalled_worker(redis_url):
    """This worker stalled past its heartbeat; another's maintenance failed its job (no retry left): status failed,
    a FAILED result, the client told, failure callbacks run. Thawed, the worker still named as the job's owner
    finished it: status finished, two results (FAILED, SUCCESSFUL), a final event after the failure. That end now
    stands: the running job's events are refused (and it is dropped), its end here and its last event too."""
    from rq.results import Result

    from producer.protocol import make_event, stream_key

    conn, worker, _, [running, ending] = _running_jobs(redis_url, count=2)
    worker.sender._load_scripts()
    for held in (running, ending):
        held.job.set_status("failed")  # (as RQ's StartedJobRegistry.cleanup leaves an abandoned job)
        conn.zadd(held.queue.failed_job_registry.key, {held.job.id: time.time() + 60})
    lost: list = []
    worker.sender.on_lost = lost.extend
    worker.sender._send([(running.job.id, make_event(0, "a", [1]), 0, running.execution.id)], False, "1")
    worker.sender._send([(running.job.id, make_event(1, "b", [2]), 0, running.execution.id)], True, "2")
    assert lost == [(running.job.id, running.execution.id)] and conn.xlen(stream_key(running.job.id)) == 1
    worker._reports_lost(lost)
    worker._drop_lost()
    assert running.job.id not in worker.in_flight
    written, _ = worker._succeed_plain([(ending, {"id": ending.job.id, "text": "done"})])
    assert written == [] and ending.job.get_status(refresh=True) == "failed"
    assert [r.type for r in Result.all(ending.job, serializer=ending.job.serializer)] == []  # (none written here)
    assert ending.job.id in ending.queue.failed_job_registry.get_job_ids()
    final = (ending.job.id, make_event(0, "done", [3], "stop"), 0, ending.execution.id)
    from worker.sender import Batch

    worker.sender._send_until_done([Batch(finals=[final])])
    assert not conn.exists(stream_key(ending.job.id))
    # A mark left by an end that had no last event (a job put off for a retry) drops no later run's last event.
    worker.sender.drop_final(running.job.id, running.execution.id)
    worker.sender._send_until_done([Batch(tasks=[lambda: None])])
    conn.hset(running.job.key, "status", "started")
    later = (running.job.id, make_event(2, "c", [4], "stop"), 0, running.execution.id)
    worker.sender._send_until_done([Batch(finals=[later])])
    assert conn.xlen(stream_key(running.job.id)) == 2


@pytest.mark.redis
@pytest.mark.parametrize("scripts", [True, False], ids=["lua", "watch"])
def test_a_stale_copy_saved_over_a_running_jobs_status_is_no_requeue(redis_url, scripts):
    """``job.save()`` of the object ``enqueue`` returned (its meta set, say) writes "queued" over a running job: taken
    for a requeue, the job was dropped here at its end (or its events), in no queue and no registry, its stream
    unended, for good; a stop's hand-back left it out of its queue too. RQ's own worker finishes it. RQ's requeues
    take the execution's started-registry entry out with the status: while the entry is there, the job is ours."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    conn, worker, name, [ending, handed] = _running_jobs(redis_url, count=2)
    if scripts:
        worker.sender._load_scripts()
    for held in (ending, handed):
        stale = Job.fetch(held.job.id, connection=conn, serializer=JSONSerializer)
        stale._status, stale.meta["tag"] = "queued", "x"  # (as the object enqueue returned says)
        stale.save()
    assert worker._owned([ending, handed]) == [True, True]
    written, _ = worker._succeed_plain([(ending, {"id": ending.job.id, "text": "done"})])
    assert [job for job, _ in written] == [ending] and ending.job.get_status(refresh=True) == "finished"
    worker._requeue([handed], {})
    assert conn.lrange(f"rq:queue:{name}", 0, -1) == [handed.job.id.encode()]
    assert handed.job.get_status(refresh=True) == "queued"
    # A requeue by RQ's clean-up (the entry out with it) is one still: that end is not written over.
    conn.zrem(handed.job.started_job_registry.key, handed.execution.composite_key)
    assert worker._owned([handed]) == [False]
    worker.register_death()


@pytest.mark.redis
def test_a_job_lost_at_its_end_is_counted_once_when_a_watched_write_is_tried_again(redis_url):
    """Without Lua the end is one transaction under WATCH: a job another attempt owns was counted "lost", logged and
    its execution cleaned up as the transaction was built, and again at every try after a WatchError (a heartbeat's
    HSET on a watched hash is one)."""
    from redis import WatchError

    from producer.protocol import OWNER_FIELD

    conn, worker, _, [lost, kept] = _running_jobs(redis_url, count=2)
    assert worker.sender.finish_script is None  # (no scripts loaded: the WATCH path)
    conn.hset(lost.job.key, OWNER_FIELD, "another-attempt")
    ended: list = []
    worker.metrics.job_ended = lambda status, *_: ended.append(status)
    is_ours, touched = worker._is_ours, []

    def touching(job, *args, **kwargs):  # (a heartbeat's write to a watched hash, as the transaction is built)
        if not touched:
            touched.append(conn.hset(kept.job.key, "last_heartbeat", "now"))
        return is_ours(job, *args, **kwargs)

    worker._is_ours = touching
    part = [(lost, {"id": lost.job.id, "text": "a"}), (kept, {"id": kept.job.id, "text": "b"})]
    with pytest.raises(WatchError):
        worker._succeed_plain(part)
    written, _ = worker._succeed_plain(part)  # (as ``_succeed`` tries it again)
    assert touched and ended.count("lost") == 1 and [job for job, _ in written] == [kept]
    assert kept.job.get_status(refresh=True) == "finished"
    worker.register_death()


@pytest.mark.redis
def test_events_refused_while_a_job_was_queued_again_go_out_in_order_once_it_is_this_attempts_again(redis_url):
    """This worker stalled, RQ queued its job again, and this worker pulled it back while its copy still ran: the
    events refused meanwhile were lost, and the stream went 0, 1, 3, ... (followers heard StreamGap, "trimmed").
    They are held, with the job's later ones, until the step loop says: sent again in order, or dropped."""
    import uuid

    from redis import Redis

    from producer.protocol import OWNER_FIELD, make_event, stream_key
    from worker.sender import Batch, Sender

    conn = Redis.from_url(redis_url)
    job_id, other = f"held-{uuid.uuid4().hex[:8]}", f"gone-{uuid.uuid4().hex[:8]}"
    for j in (job_id, other):
        conn.hset(f"rq:job:{j}", mapping={OWNER_FIELD: "e1", "status": "started"})
    lost: list = []
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None, lost.extend)
    sender._load_scripts()

    def events(*ns):
        return [(j, make_event(n, f"<{n}>", [n]), 0, "e1") for n in ns for j in (job_id, other)]

    def texts(j):
        return "".join(json.loads(f[b"event"])["text"] for _, f in conn.xrange(stream_key(j)))

    try:
        sender._send_until_done([Batch(events=events(0, 1))])
        for j in (job_id, other):
            conn.hset(f"rq:job:{j}", "status", "queued")  # RQ's clean-up queued it again
        sender._send_until_done([Batch(events=events(2))])
        assert set(lost) == {(job_id, "e1"), (other, "e1")}
        conn.hset(f"rq:job:{job_id}", "status", "started")  # taken back here: the copy running here goes on
        sender._send_until_done([Batch(events=events(3))])  # (held: the step loop has not answered yet)
        assert texts(job_id) == "<0><1>"
        sender.release_held(job_id, "e1")
        sender.discard_held(other, "e1")  # (another attempt's now)
        sender._send_until_done([sender._queue.get_nowait(), Batch(events=events(4))])
        assert texts(job_id) == "<0><1><2><3><4>" and texts(other) == "<0><1>"
        assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(job_id))] == [0, 1, 2, 3, 4]
        # Its last event in the same round trip as a refused one: held behind it, not written before it.
        conn.hset(f"rq:job:{job_id}", "status", "queued")
        final = (job_id, make_event(6, "<6>", [6], "stop", {}), 0, "e1")

        def taken_back():
            conn.hset(f"rq:job:{job_id}", "status", "started")  # (its end lands as it is this attempt's again)

        sender._send_until_done([Batch(events=events(5)[:1], tasks=[taken_back], finals=[final])])
        assert texts(job_id) == "<0><1><2><3><4>"
        sender.release_held(job_id, "e1")
        sender._send_until_done([sender._queue.get_nowait()])
        assert [json.loads(f[b"event"])["n"] for _, f in conn.xrange(stream_key(job_id))] == [0, 1, 2, 3, 4, 5, 6]
    finally:
        conn.delete(*[stream_key(j) for j in (job_id, other)], *[f"rq:job:{j}" for j in (job_id, other)])
        conn.delete(sender.sent_key)


@pytest.mark.redis
def test_a_lane_or_canceled_registry_of_another_type_stops_no_pull_and_drops_no_event(redis_url):
    """A lane's list set to a string by hand (and added to rq:queues): its error failed the pull of every lane, the
    jobs moved from lanes before it stranded in their intermediate lists for a minute; in the sender's round trip,
    its length (or a canceled registry's count) failed the round trip, every event of every job dropped."""
    import uuid

    from redis import Redis
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import make_event, stream_key
    from worker.intake import MOVE_SCRIPT, load_script, pull
    from worker.sender import Sender

    conn, name = Redis.from_url(redis_url), f"lanes-{uuid.uuid4().hex[:6]}"
    jobs = [Client(redis_url, queue=name).submit(f"p{i}", max_tokens=2, priority=p) for i, p in enumerate((0, 5))]
    conn.set(f"rq:queue:{name}:p3", "junk")
    queues = [Queue(n, connection=conn, serializer=JSONSerializer) for n in (name, f"{name}:p3", f"{name}:p5")]
    for script in (load_script(conn, MOVE_SCRIPT), None):
        pulled, _ = pull(queues, 8, None, conn, Job, JSONSerializer, script)
        assert sorted(job.id for job, _ in pulled) == sorted(job.id for job in jobs[: 2 if script else 0])
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None)
    sender.queue_keys = [q.key for q in queues]
    sender.canceled_keys = [f"rq:canceled:{name}"]
    conn.set(sender.canceled_keys[0], "junk")
    sender.start()
    try:
        sender._send([(jobs[0].id, make_event(0, "a", [1], "stop"), 0, "")], True, sender._next_send())
        assert [json.loads(f[b"event"])["text"] for _, f in conn.xrange(stream_key(jobs[0].id))] == ["a"]
        assert sender.queued_by_key[f"rq:queue:{name}:p3"] == 0
    finally:
        sender.stop()
        conn.delete(stream_key(jobs[0].id), f"rq:queue:{name}:p3", sender.canceled_keys[0], sender.sent_key)


def test_a_stream_holding_an_event_twice_is_not_resumed_from():
    """An event written twice (by a worker before sends were numbered) would double the resumed output's tokens:
    the next attempt starts over, with a reset, instead."""
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("Hel", [1]), ("lo", [2])])
    conn.xadd(stream_key("j"), conn.xrevrange(stream_key("j"), count=1)[0][1])
    retry = pub.resume(conn, ["j"])["j"]
    assert retry.start(can_resume=True) == [] and retry.pending_reset


def test_a_stream_entry_the_schema_takes_but_resuming_cannot_read_makes_only_its_job_start_over():
    """A logprob step of three numbers passes the event schema and failed the resume's reading: the exception
    failed every job of the pull as abandoned. Now only that job starts over."""
    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    for n, step in enumerate([[[1, -0.1]], [[2, -0.2, 9]]]):
        event = {"n": n, "text": "x", "token_ids": [step[0][0]], "logprobs": [step]}
        conn.xadd(stream_key("j"), {"event": json.dumps(event)})
    conn.xadd(stream_key("k"), {"event": json.dumps({"n": 0, "text": "ok", "token_ids": [4]})})
    streams = pub.resume(conn, ["j", "k"])
    assert streams["j"].start(can_resume=True) == [] and streams["j"].pending_reset
    assert streams["k"].start(can_resume=True) == [4]


@pytest.mark.redis
def test_registering_again_after_redis_lost_its_data_survives_the_heartbeat_and_failures(redis_url, caplog):
    """Redis lost its data: the worker registers again. The heartbeat thread may recreate the worker's key (without
    ``birth``) between the step loop's delete and RQ's registration, which then refuses a twin; and registration may
    fail outright. Neither may end the step loop: it registers on the next try, or at the next report."""
    import uuid

    from redis import Redis

    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    worker = BatchWorker(
        Engine(), WorkerSettings(redis_url=redis_url, queue=f"q-{uuid.uuid4().hex[:8]}", model="fake"), conn
    )
    worker.register_birth()
    register = worker.register_birth
    calls = []

    def heartbeat_first() -> None:  # the heartbeat thread's write lands just before registration's own check
        calls.append(1)
        if len(calls) == 1:
            conn.hset(worker.key, "last_heartbeat", "now")
        register()

    try:
        conn.delete(worker.key)  # what a restart without persistence leaves
        worker.register_birth = heartbeat_first
        worker._on_statuses([], False)
        worker._apply_reports()
        assert len(calls) == 2 and conn.hexists(worker.key, "birth")

        def broken() -> None:
            raise RuntimeError("registration broke")

        conn.delete(worker.key)
        worker.register_birth = broken
        worker._on_statuses([], False)
        worker._apply_reports()  # logged, not raised: the step loop goes on
        assert "registration broke" in caplog.text and not conn.exists(worker.key)
        worker.register_birth = register
        worker._on_statuses([], False)
        worker._apply_reports()
        assert conn.hexists(worker.key, "birth")
    finally:
        conn.delete(worker.key)


def test_execution_ids_made_together_are_distinct_uuid4s_as_rq_makes_them():
    import uuid

    from worker.job_start import execution_ids

    ids = execution_ids(300) + execution_ids(300)
    assert len(set(ids)) == 600 and execution_ids(0) == []
    for made in ids:
        assert len(made) == 32 and uuid.UUID(made).version == 4 and uuid.UUID(made).hex == made


@pytest.mark.parametrize(
    "way", ["script", "script forgotten", "objects"],
    ids=["one script", "one script Redis forgot (reloaded)", "RQ's objects (Redis without Lua)"],
)  # fmt: skip
def test_the_workers_start_writes_leave_what_rqs_own_start_leaves(redis_url, way):
    """Two jobs alike: one started by RQ's own ``Execution.create`` and ``prepare_for_execution``, the other by the
    worker's ``mark_started`` (by one script, loaded again if Redis forgot it, or through RQ's objects where Redis
    runs no Lua): the same registries and scores, execution records, job hash fields, TTLs, and the same job
    objects afterwards."""
    import uuid

    from redis import Redis
    from rq.executions import Execution, ExecutionRegistry
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import MODEL_FIELD, OWNER_FIELD, RESUMED_FROM_FIELD
    from worker.batch_worker import BatchWorker
    from worker.intake import pull
    from worker.job_start import register
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    client = Client(redis_url, queue=name)
    client.submit_many([{"prompt": "hello", "max_tokens": 4}] * 2)
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    worker.sender.start_script = None if way == "objects" else register(conn)
    if way == "script forgotten":
        conn.script_flush()  # as a restarted Redis without persistence
    (ref, queue), (ours, _) = pull([worker.queues[0]], 2, None, conn, Job, JSONSerializer)[0]
    ttl = worker.get_heartbeat_ttl(None)
    for job in (ref, ours):
        conn.expire(job.key, 1000)  # a job with a TTL of its own keeps its hash while it runs
    with conn.pipeline() as pipe:
        ref_execution = Execution.create(ref, ttl, pipeline=pipe, worker_name=worker.name)
        ref.prepare_for_execution(worker.name, pipeline=pipe)
        pipe.persist(ref.key)
        pipe.lrem(queue.intermediate_queue_key, 1, ref.id)
        pipe.execute()
    # An earlier attempt's events, in the stream of the job and of one with nothing to start: read with the start.
    only_read = f"only-read-{uuid.uuid4().hex}"
    for job_id in (ours.id, only_read):
        conn.xadd(stream_key(job_id), {STREAM_FIELD: json.dumps(make_event(0, "Hi", [7, 8]))})
    conn.hset(ours.key, STREAM_OF_FIELD, conn.hget(ours.key, "created_at"))  # (as that attempt's start marked it)
    (execution,), streams = worker.mark_started([(ours, queue)], [ours.id, only_read])
    assert set(streams) == {ours.id, only_read}
    assert [(s.next_n, s.resume_ids, s.resume_text) for s in streams.values()] == [(1, [7, 8], "Hi")] * 2
    assert len(execution.id) == 32 and execution.id != ref_execution.id
    assert worker.executions[execution.id] is execution and execution.job_id == ours.id
    started = dict(conn.zrange(queue.started_job_registry.key, 0, -1, withscores=True))
    assert {m.decode() for m in started} == {ref_execution.composite_key, execution.composite_key}
    assert abs(started[execution.composite_key.encode()] - started[ref_execution.composite_key.encode()]) <= 1
    assert {m.decode() for m in conn.smembers(execution.worker_executions_key)} == set(map(bytes.decode, started))
    # The worker's heartbeat keeps it longer (seconds allowed between the write and this read: a loaded machine's)
    assert conn.ttl(execution.worker_executions_key) >= ttl + 55
    assert conn.llen(queue.intermediate_queue_key) == 0
    ref_record = conn.hgetall(ref_execution.key)
    for job, ex in ((ref, ref_execution), (ours, execution)):
        registry = ExecutionRegistry(job_id=job.id, connection=conn)
        assert registry.get_execution_ids() == [ex.id]
        assert abs(conn.ttl(registry.key) - conn.ttl(ExecutionRegistry(ref.id, conn).key)) <= 5  # (made apart)
        record = conn.hgetall(ex.key)
        assert set(record) == set(ref_record)
        assert record[b"worker_name"] == worker.name.encode() and record[b"job_id"] == job.id.encode()
        assert abs(float(record[b"created_at"]) - float(ref_record[b"created_at"])) < 5
        assert abs(conn.ttl(ex.key) - conn.ttl(ref_execution.key)) <= 5
        assert conn.ttl(job.key) == -1
        fetched = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
        assert fetched.get_status() == "started" and fetched.worker_name == worker.name
        assert abs((fetched.started_at - ref.started_at).total_seconds()) < 5
        assert fetched.last_heartbeat == fetched.started_at
        # The objects the worker keeps say what Redis says.
        assert job.get_status(refresh=False) == "started" and job.worker_name == worker.name
        assert Execution.fetch(ex.id, job.id, conn).job_id == job.id
    ref_fields, our_fields = conn.hgetall(ref.key), conn.hgetall(ours.key)
    own = {OWNER_FIELD.encode(), STREAM_OF_FIELD.encode(), RESUMED_FROM_FIELD.encode(), MODEL_FIELD.encode()}
    assert set(our_fields) == set(ref_fields) | own
    assert our_fields[MODEL_FIELD.encode()] == b"fake|"  # (its --model; an engine without a tokenizer)
    assert our_fields[RESUMED_FROM_FIELD.encode()] == conn.xrevrange(stream_key(ours.id), count=1)[0][0]
    assert our_fields[OWNER_FIELD.encode()] == execution.id.encode()


@pytest.mark.redis
@pytest.mark.parametrize("way", ["script", "transaction", "stock"])
def test_a_job_enqueued_under_an_old_jobs_id_does_not_resume_the_old_jobs_stream(redis_url, way):
    """Stock RQ's enqueue of a new job under the id of one that died mid-run (or was deleted) left that job's
    stream: the new job took its tokens as the start of its own output. Its first start deletes it (by the start
    script, the start without Lua, or the stock RQ path's); the job's own streams are resumed from: after a retry
    or a requeue, one an earlier worker version started (no mark), one of a hash written without created_at or
    with it in another form (RQ's save rewrites it)."""
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer.protocol import JOB_FUNCTION, STREAM_OF_FIELD
    from worker.intake import pull
    from worker.job_start import forget_earlier_jobs_stream, register

    conn, name, worker = _worker_without_engine(redis_url)
    worker.sender.start_script = None if way == "transaction" else register(conn)
    queue = Queue(name, connection=conn, serializer=JSONSerializer)

    def start(job_id: str) -> tuple[int, list[int]]:
        """The job pulled and started: where its stream has it resume."""
        [(job, q)] = pull([queue], 1, None, conn, Job, JSONSerializer)[0]
        if way == "stock":
            forget_earlier_jobs_stream(conn, job)
            stream = worker.publisher.resume(conn, [job_id])[job_id]
        else:
            stream = worker.mark_started([(job, q)], [job_id])[1][job_id]
        return stream.next_n, stream.resume_ids

    def streamed(job_id: str, text: str, ids: list[int]) -> None:
        conn.xadd(stream_key(job_id), {STREAM_FIELD: json.dumps(make_event(0, text, ids))})

    for kept in (False, True):  # the old job's hash gone (deleted, expired), or still there (failed as abandoned)
        job_id = f"reused-{uuid.uuid4().hex[:8]}"
        queue.enqueue(JOB_FUNCTION, job_id=job_id, kwargs={"prompt": "old", "max_tokens": 4})
        start(job_id)
        streamed(job_id, "Old", [7, 8])
        if not kept:
            conn.delete(Job.key_for(job_id))
        time.sleep(0.003)  # (a new created_at, past the stream's first entry)
        queue.enqueue(JOB_FUNCTION, job_id=job_id, kwargs={"prompt": "new", "max_tokens": 4})
        assert start(job_id) == (0, []) and not conn.exists(stream_key(job_id))
        streamed(job_id, "New", [9])  # its own attempt's events, then a requeue: resumed from, as a retry is
        queue.enqueue_job(Job.fetch(job_id, connection=conn, serializer=JSONSerializer))
        assert start(job_id) == (1, [9])
    # Its own stream, unmarked: started by a worker before marks (or its start's write lost in a failover).
    job_id = f"own-{uuid.uuid4().hex[:8]}"
    queue.enqueue(JOB_FUNCTION, job_id=job_id, kwargs={"prompt": "mine", "max_tokens": 4})
    streamed(job_id, "Mine", [5])
    assert start(job_id) == (1, [5])
    # A hash written by hand without created_at, or with it in another form than RQ's: RQ's save on a retry writes
    # its own, which is no other job's.
    for created in (None, "", "2026-11-30T10:00:00Z"):
        job_id = f"by-hand-{uuid.uuid4().hex[:8]}"
        job = queue.enqueue(JOB_FUNCTION, job_id=job_id, kwargs={"prompt": "hand", "max_tokens": 4})
        if created is None:
            conn.hdel(job.key, "created_at")  # ('' is none to RQ too: it reads the time it read the job at)
        else:
            conn.hset(job.key, "created_at", created)
        assert start(job_id) == (0, [])
        streamed(job_id, "Hand", [6])
        queue.enqueue_job(Job.fetch(job_id, connection=conn, serializer=JSONSerializer))  # (RQ's save: its form)
        assert conn.hget(job.key, "created_at") not in (None, (created or "").encode())
        assert start(job_id) == (1, [6]), created
        assert conn.hget(job.key, STREAM_OF_FIELD) is not None


@pytest.mark.redis
@pytest.mark.parametrize("way", ["script", "transaction", "stock"])
def test_a_job_an_attempt_of_another_model_streamed_starts_over(redis_url, way):
    """A dead worker's jobs resumed on a worker of another model (a fleet mid-rollout, a queue two models serve):
    half of each output one model's, half the other's (and token ids of one vocabulary read as another's). A start
    writes its model in the job; one that finds another's there starts the job over (a reset), by the start
    script, the start without Lua and the stock RQ path's. Its own model's, or none (an older worker's), resumes."""
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer.protocol import JOB_FUNCTION, MODEL_FIELD
    from worker.intake import pull
    from worker.job_start import forget_earlier_jobs_stream, ran_on_another_model, register

    conn, name, worker = _worker_without_engine(redis_url)
    worker.sender.start_script = None if way == "transaction" else register(conn)
    queue = Queue(name, connection=conn, serializer=JSONSerializer)

    def start(job_id: str) -> list[int]:
        """The job pulled and started: what it resumes from."""
        [(job, q)] = pull([queue], 1, None, conn, Job, JSONSerializer)[0]
        if way == "stock":
            forget_earlier_jobs_stream(conn, job)
            stream = worker.publisher.resume(conn, [job_id])[job_id]
            if ran_on_another_model(conn, job, worker.model_identity):
                stream.whole = False
        else:
            stream = worker.mark_started([(job, q)], [job_id])[1][job_id]
        return stream.start(can_resume=True)

    for ran_on, resumed in ((None, [7, 8]), (worker.model_identity, [7, 8]), ("other-model|abc", [])):
        job = queue.enqueue(JOB_FUNCTION, kwargs={"prompt": "x", "max_tokens": 4})
        conn.xadd(stream_key(job.id), {STREAM_FIELD: json.dumps(make_event(0, "Hi", [7, 8]))})  # an earlier attempt's
        if ran_on is not None:
            conn.hset(job.key, MODEL_FIELD, ran_on)
        assert start(job.id) == resumed, ran_on
        assert conn.hget(job.key, MODEL_FIELD) == worker.model_identity.encode()


@pytest.mark.redis
@pytest.mark.parametrize(
    "way", ["script", "script forgotten", "transaction"],
    ids=["one script", "one script Redis forgot (reloaded)", "a transaction (Redis without Lua)"],
)  # fmt: skip
def test_the_workers_success_writes_leave_what_rqs_own_success_path_leaves(redis_url, way):
    """Jobs alike, started together: one ends through RQ's own methods (``_handle_success``, ``cleanup``,
    ``cleanup_execution``), two through the worker's writes (one script, loaded again if Redis forgot it, or a
    transaction where Redis runs no Lua): the job hashes, RQ's result streams, registries, executions, TTLs and
    worker counters match, and RQ's readers see the same. A job another attempt owns now gets no write, and one
    that got dependents is left to RQ's own path (which enqueues them)."""
    import uuid
    from datetime import datetime

    from redis import Redis
    from rq.job import Job
    from rq.registry import FinishedJobRegistry, StartedJobRegistry
    from rq.results import Result
    from rq.serializers import JSONSerializer
    from rq.utils import now

    from producer import Client
    from producer.protocol import OWNER_FIELD
    from producer.schema import JobRequest
    from worker.batch_worker import BatchWorker, InFlight
    from worker.intake import pull
    from worker.job_finish import register
    from worker.publisher import JobStream
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    client = Client(redis_url, queue=name, result_ttl=900)
    payload = {"prompt": "hello", "max_tokens": 4}
    jobs = client.submit_many([payload] * 5)
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    pulled, bad = pull([worker.queues[0]], 5, None, conn, Job, JSONSerializer)
    assert not bad and [j.id for j, _ in pulled] == [job.id for job in jobs]
    (ref, queue), (ours, _), (ours2, _), (taken, _), (parent, _) = pulled
    executions, _ = worker.mark_started(pulled)
    conn.hset(taken.key, OWNER_FIELD, "another-attempt")  # requeued and started elsewhere meanwhile
    conn.sadd(parent.dependents_key, "a-child-job")
    result = {"status": "finished", "text": "ok \u00e9", "token_ids": [1, 2]}
    ended = now()

    with conn.pipeline() as pipe:  # the reference: RQ's methods, as the worker used them before
        ref.ended_at, ref._result = ended, result
        ref.heartbeat(ended, 60, pipeline=pipe)
        worker.increment_successful_job_count(pipeline=pipe)
        worker.increment_total_working_time(ended - ref.started_at, pipe)
        ref._handle_success(
            900, pipeline=pipe, worker_name=worker.name, execution_id=executions[0].id,
            execution_started_at=executions[0].created_at, execution_ended_at=ended,
        )  # fmt: skip
        ref.cleanup(900, pipeline=pipe, remove_from_queue=False)
        worker.cleanup_execution(ref, pipeline=pipe, execution=executions[0])
        pipe.execute()
    held = [
        InFlight(job, queue, execution, JobRequest.model_validate(payload), JobStream(job.id), 0.0)
        for job, execution in zip((ours, ours2, taken, parent), executions[1:])
    ]
    worker.sender.finish_script = None if way == "transaction" else register(conn)
    if way == "script forgotten":
        conn.script_flush()  # as a restarted Redis without persistence
    others = [(h, result) for h in held[2:]]
    assert worker._succeed_plain(others, ended) == ([], others[1:])
    for job in (taken, parent):
        assert conn.hget(job.key, "status") == b"started" and not conn.exists(Result.get_key(job.id))
    assert conn.hget(taken.key, OWNER_FIELD) == b"another-attempt"
    assert not conn.exists(executions[3].key)  # only this attempt's own record of it went
    assert conn.exists(executions[4].key)  # RQ's path ends it (and enqueues its dependents)
    conn.config_resetstat()
    plain = [(h, result) for h in held[:2]]
    assert worker._succeed_plain(plain, ended) == (plain, [])
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in conn.info("commandstats").items()}

    def hash_of(job: Job) -> dict:
        fields = {k.decode(): v for k, v in conn.hgetall(job.key).items()}
        assert fields.pop(OWNER_FIELD).decode() in {e.id for e in executions}
        for field in ("created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat"):
            fields[field] = datetime.fromisoformat(fields[field].decode().rstrip("Z")).replace(microsecond=0)
        return fields

    a = hash_of(ref)
    for b in (hash_of(ours), hash_of(ours2)):
        for field in ("created_at", "enqueued_at", "started_at"):  # the jobs were made a moment apart
            assert abs((a[field] - b.pop(field)).total_seconds()) <= 1
        assert {k: v for k, v in a.items() if k not in ("created_at", "enqueued_at", "started_at")} == b
    assert a["status"] == b"finished"
    for job in (ref, ours, ours2):
        again = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
        assert again.get_status() == "finished" and again.return_value() == result
        latest = Result.fetch_latest(again, serializer=JSONSerializer)
        assert latest.type == Result.Type.SUCCESSFUL and latest.worker_name == worker.name
        assert abs(latest.execution_ended_at.timestamp() - ended.timestamp()) < 1e-3
        assert 890 <= conn.ttl(job.key) <= 900 and 890 <= conn.ttl(Result.get_key(job.id)) <= 900
        assert 890 <= conn.ttl(job.dependents_key) <= 900 or not conn.exists(job.dependents_key)
    fields = [conn.xrange(Result.get_key(job.id))[0][1] for job in (ref, ours, ours2)]
    assert sorted(fields[0]) == sorted(fields[1]) == sorted(fields[2])
    # The same value (ours without JSON's optional spaces), and no other copy of it anywhere.
    values = [json.loads(base64.b64decode(f[b"return_value"])) for f in fields]
    assert values[0] == values[1] == values[2] == result
    assert len(fields[1][b"return_value"]) < len(fields[0][b"return_value"])
    assert not conn.keys("roseinfer:result:*")
    finished = FinishedJobRegistry(name, connection=conn)
    assert sorted(finished.get_job_ids()) == sorted(j.id for j in (ref, ours, ours2))
    if way != "transaction":
        # Per job: the owner and dependents checks, hash, RQ's result and its TTL, job TTL, its execution in the
        # job's registry; the finished and started registries, the worker's executions, the execution hashes and
        # two counters: one command each for the batch.
        assert sum(calls.values()) - calls["evalsha"] - calls["config|resetstat"] == 7 * 2 + 6, calls
    scores = [conn.zscore(finished.key, j.id) for j in (ref, ours, ours2)]
    assert max(scores) - min(scores) <= 1
    assert StartedJobRegistry(name, connection=conn).get_job_ids() == [parent.id]
    for execution in executions[:4]:
        assert not conn.exists(execution.key)
        assert not conn.zscore(f"rq:executions:{execution.job_id}", execution.id)
    members = conn.smembers(f"rq:worker:{worker.name}:executions")
    assert members == {executions[4].composite_key.encode()}
    assert int(conn.hget(worker.key, "successful_job_count")) == 3
    working = float(conn.hget(worker.key, "total_working_time"))
    assert abs(working - sum((ended - j.started_at).total_seconds() for j in (ref, ours, ours2))) < 1e-6
    worker._succeed_plain(plain, ended)  # the same call again, as after a lost reply: nothing written twice
    assert [conn.xlen(Result.get_key(j.id)) for j in (ours, ours2)] == [1, 1]
    assert int(conn.hget(worker.key, "successful_job_count")) == 3


@pytest.mark.redis
def test_a_failure_written_again_after_a_lost_reply_is_recorded_once(redis_url):
    """A job's end runs again when Redis took it but its reply was lost: RQ's failure (the worker's count, the
    failed registry, a retry) is not made twice; a job that will be retried later keeps the retries it has."""
    import uuid

    import redis
    from redis import Redis
    from rq.job import Job
    from rq.registry import FailedJobRegistry, ScheduledJobRegistry
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import OWNER_FIELD, read_result, result_from_entries
    from producer.schema import JobRequest
    from worker.batch_worker import BatchWorker, InFlight
    from worker.intake import pull
    from worker.publisher import JobStream
    from worker.pump import JobEvent
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    payload = {"prompt": "hello", "max_tokens": 4}
    client = Client(redis_url, queue=name)
    failing, retried = client.submit(**payload), client.submit(**payload)  # two retries each (the client's default)
    timed_out = client.submit(**payload)
    conn.hset(f"rq:job:{retried.id}", "retry_intervals", "[600]")  # the retry waits in RQ's scheduled registry
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    pulled, _ = pull([worker.queues[0]], 3, None, conn, Job, JSONSerializer)
    executions, _ = worker.mark_started(pulled)
    for (job, queue), execution in zip(pulled, executions):
        held = InFlight(job, queue, execution, JobRequest.model_validate(payload), JobStream(job.id), 0.0)
        worker.in_flight[job.id] = held
        retryable, late = job.id == retried.id, job.id == timed_out.id
        event = JobEvent(job.id, finish_reason="error", error="boom", retryable=retryable, timed_out=late)
        worker._errored(held, event)
    ends, worker._tasks = worker._tasks, []
    for _ in range(2):  # the second time as the sender's try again after a lost reply
        for end in ends:
            end()
    assert int(conn.hget(worker.key, "failed_job_count")) == 3
    # RQ swallows an error of its last write (it logs it): the end raises, so the sender tries it again.
    late_job = Job.fetch(timed_out.id, connection=conn, serializer=JSONSerializer)
    conn.hset(late_job.key, "status", "started")
    worker._finalize_failure = lambda *args: None  # as if RQ's pipeline had failed
    conn.hset(late_job.key, OWNER_FIELD, executions[2].id)
    with pytest.raises(redis.exceptions.ConnectionError, match="did not land"):
        worker._record_failure(late_job, worker.queues[0], executions[2], RuntimeError("boom"))
    conn.hset(late_job.key, OWNER_FIELD, "another-worker")  # its retry, started elsewhere meanwhile: it landed
    worker._record_failure(late_job, worker.queues[0], executions[2], RuntimeError("boom"))
    conn.hset(late_job.key, "status", "queued")
    assert FailedJobRegistry(name, connection=conn).get_job_ids() == [failing.id]
    # A timeout is retried as RQ retries its own: back in the queue, one retry spent.
    late = Job.fetch(timed_out.id, connection=conn, serializer=JSONSerializer)
    assert late.get_status() == "queued" and late.retries_left == 1 and worker.queues[0].job_ids == [timed_out.id]
    assert ScheduledJobRegistry(name, connection=conn).get_job_ids() == [retried.id]
    again = Job.fetch(retried.id, connection=conn, serializer=JSONSerializer)
    assert again.get_status() == "scheduled" and again.retries_left == 1
    latest = Job.fetch(failing.id, connection=conn, serializer=JSONSerializer).latest_result()
    assert latest.type == latest.Type.FAILED and "boom" in latest.exc_string
    # One record, RQ's own, holding the result: it was written bare with the status and ours a round trip later,
    # and an end tried again after a lost reply wrote the result again.
    [record] = Job.fetch(failing.id, connection=conn, serializer=JSONSerializer).results()
    assert record.type == record.Type.FAILED and record.return_value["error"] == "boom"
    # Whose fault, in the result and the last event: the engine refused the job itself.
    assert result_from_entries(read_result(conn, failing.id))["error_type"] == "invalid_request"
    _, finals = worker.publisher.take()
    assert [(job_id, e["finish_reason"], e["error_type"]) for job_id, e, _, _ in finals] == [
        (failing.id, "error", "invalid_request")
    ]  # the retried job's stream goes on with its next attempt


@pytest.mark.parametrize(
    "stamps, readable",
    [
        ({"created_at": "2026-11-24T09:08:07.123456Z", "enqueued_at": "2026-11-24T09:08:07.000001Z"}, True),
        ({"started_at": "2024-02-29T23:59:59.999999Z", "last_heartbeat": "2026-11-24T09:08:07Z"}, True),  # old form
        ({"ended_at": "2026-02-29T10:00:00.000000Z"}, False),  # no such day: RQ's error
        ({"created_at": "yesterday"}, False),
    ],
)
def test_the_workers_job_class_reads_a_hash_as_rqs_job_does(stamps, readable):
    """``PulledJob`` skips RQ's per-job serializer check and parses RQ's stamps without strptime: every attribute
    comes out as RQ's ``Job`` leaves it, and what RQ cannot read raises for both."""
    import json
    import zlib

    import fakeredis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from worker.intake import PulledJob

    conn = fakeredis.FakeRedis()
    data = zlib.compress(json.dumps(["worker.jobs.generate", None, [], {"prompt": "hi"}]).encode())
    raw = {b"data": data, b"origin": b"q", b"status": b"queued", b"timeout": b"60", b"result_ttl": b"500"}
    raw.update({k.encode(): v.encode() for k, v in stamps.items()})
    built = []
    for cls in (Job, PulledJob):
        job = cls("j-1", connection=conn, serializer=JSONSerializer)
        try:
            job.restore(dict(raw))
        except Exception as exc:
            built.append(type(exc))
            continue
        assert job.serializer is JSONSerializer
        # (but for PulledJob's own: whether its data was written plain, to be saved so)
        built.append({k: v for k, v in vars(job).items() if (k != "created_at" or "created_at" in stamps)
                      and k != "plain_data"})  # fmt: skip
    assert built[0] == built[1]
    assert isinstance(built[0], dict) == readable  # each case as it should come out, not only alike


@pytest.mark.redis
def test_a_pull_moves_what_the_queues_hold_not_a_command_per_slot_of_room(redis_url):
    """Taking up to 200 jobs from a lane of 3 and an empty one: three jobs, in order, and about as many LMOVEs
    (a pipeline of one per slot of room cost 400 commands a pull)."""
    import uuid

    from redis import Redis
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from worker.intake import MOVE_SCRIPT, pull

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    jobs = Client(redis_url, queue=name).submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(3)])
    lanes = [Queue(name, connection=conn, serializer=JSONSerializer), Queue(f"{name}-empty", connection=conn)]
    conn.config_resetstat()
    pulled, bad = pull(lanes, 200, None, conn, Job, JSONSerializer, conn.register_script(MOVE_SCRIPT))
    moves = conn.info("commandstats").get("cmdstat_lmove", {}).get("calls", 0)
    assert not bad and [job.id for job, _ in pulled] == [job.id for job in jobs]
    assert conn.lrange(lanes[0].intermediate_queue_key, 0, -1) == [job.id.encode() for job in jobs]
    assert moves <= 5


@pytest.mark.redis
@pytest.mark.parametrize("how", ["script", "no-lua", "blocking"])
def test_a_job_key_that_is_not_a_hash_is_moved_aside_and_the_jobs_pulled_with_it_run(redis_url, how):
    """``SET rq:job:<id>`` instead of HSET: the hash read failed, and with it the move script (after its moves) or
    the whole pull, leaving the jobs taken with it in the intermediate list, queued again by RQ's clean-up with it,
    for good. It comes back apart now, with its type; quarantine leaves the key as it was."""
    import uuid

    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import rejected_key
    from worker.intake import MOVE_SCRIPT, PulledJob, pull, quarantine

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    good = Client(redis_url, queue=name).submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(3)])
    bad = f"nothash-{uuid.uuid4().hex[:6]}"
    conn.set(f"rq:job:{bad}", "{}")
    conn.lpush(queue.key, bad)  # first in line: what a blocking pull wakes for, or a batch takes first
    # A hash holding the field that stood for "another type" in the pull's reply: its value, not UTF-8, broke the
    # pull of every job beside it (a UTF-8 one passed the hash for another type). It is a job as any other now.
    conn.hset(f"rq:job:{good[1].id}", b"\x00roseinfer:key-type", b"\xff")
    script = conn.register_script(MOVE_SCRIPT) if how == "script" else None
    pulled, unreadable = pull([queue], 10, 1 if how == "blocking" else None, conn, PulledJob, JSONSerializer, script)
    assert [job.id for job, _ in pulled] == [job.id for job in good]
    assert [(u.job_id, u.is_hash) for u in unreadable] == [(bad, False)]
    assert "holds a string, not a hash" in unreadable[0].reason
    seen = queue.intermediate_queue.get_first_seen_key(bad)
    conn.set(seen, 1, ex=86400)  # RQ's mark of a stranded id, as a worker's check of the list sets it
    with conn.pipeline() as pipe:
        quarantine(pipe, unreadable[0], 60)
        pipe.execute()
    assert conn.lrange(queue.intermediate_queue_key, 0, -1) == [job.id.encode() for job in good]
    assert not conn.exists(seen)  # (it outlived the job by a day)
    assert conn.zscore(rejected_key(name), bad) is not None and conn.get(f"rq:job:{bad}") == b"{}"
    conn.delete(f"rq:job:{bad}")
    # Each kept its TTL, not the set's, renewed by every rejection: it grew while one came a day.
    conn.zadd(rejected_key(name), {"long-ago": time.time() - 61})
    with conn.pipeline() as pipe:
        quarantine(pipe, unreadable[0], 60)
        pipe.execute()
    assert conn.zrange(rejected_key(name), 0, -1) == [bad.encode()]


@pytest.mark.redis
@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("block", [None, 1])
def test_an_id_that_is_not_text_is_moved_aside_and_the_jobs_pulled_with_it_run(redis_url, lanes, block):
    """RQ's dequeue raised on an id that is not UTF-8 and left it (and, in a batch, every job taken with it) in the
    intermediate list, where RQ's clean-up raised at every pass. A pull, blocking (by BLMOVE from the first lane)
    or not, hands it back apart, by its bytes, and the jobs around it as usual; quarantine moves it aside."""
    import uuid

    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import rejected_key
    from worker.intake import MOVE_SCRIPT, NOT_TEXT_ID, PulledJob, pull, quarantine

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    queues = [Queue(n, connection=conn, serializer=JSONSerializer) for n in (name, f"{name}-low")][:lanes]
    bad = b"bad-\xff\xfe-" + uuid.uuid4().hex[:6].encode()
    good = Client(redis_url, queue=name).submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(3)])
    conn.lpush(queues[0].key, bad)  # first in line: what a blocking pull wakes for, or a batch takes first
    script = conn.register_script(MOVE_SCRIPT)
    pulled, unreadable = pull(queues, 10, block, conn, PulledJob, JSONSerializer, script)
    assert [job.id for job, _ in pulled] == [job.id for job in good]
    assert [(u.raw_id, u.reason) for u in unreadable] == [(bad, NOT_TEXT_ID)]
    assert unreadable[0].job_id == bad.decode(errors="backslashreplace")
    assert conn.lrange(queues[0].intermediate_queue_key, 0, -1) == [bad] + [job.id.encode() for job in good]
    seen = queues[0].intermediate_queue_key.encode() + b":first_seen:" + bad
    conn.set(seen, 1, ex=86400)  # RQ's mark of a stranded id, by its bytes
    with conn.pipeline() as pipe:
        quarantine(pipe, unreadable[0], 60)
        pipe.execute()
    assert bad not in conn.lrange(queues[0].intermediate_queue_key, 0, -1) and not conn.exists(seen)
    assert conn.zscore(rejected_key(name), bad) is not None and not conn.exists(b"rq:job:" + bad)  # (no stub)
    queues[0].intermediate_queue.cleanup(None, queues[0])  # RQ's clean-up reads the list again without raising


@pytest.mark.redis
@pytest.mark.parametrize("retries", [0, 2])
def test_submit_many_writes_the_job_hashes_rqs_enqueue_many_writes(redis_url, retries):
    """The producer writes each job's hash itself: field for field what RQ's ``enqueue_many`` writes for the same
    job (times aside), RQ reads it back the same, and the queue lists and rq:queues are RQ's."""
    import uuid
    import zlib
    from datetime import datetime, timezone

    from redis import Redis
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.client import validate

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    client = Client(redis_url, queue=name, retries=retries, result_ttl=123, job_timeout=77)
    requests = [
        {"prompt": "hello", "max_tokens": 4, "custom_id": "row-1"},
        {"messages": [{"role": "user", "content": "hi \u00e9"}], "temperature": 0.5, "priority": 10},
    ]
    ours = client.submit_many(requests)
    with conn.pipeline() as pipe:  # the reference: RQ's own enqueue_many of the same jobs
        theirs = []
        for fields in requests:
            req = validate(fields)
            data = Queue.prepare_data(
                "worker.jobs.generate", kwargs=client._payload(req), job_id=f"ref-{uuid.uuid4().hex}",
                **client._job_options(req),
            )  # fmt: skip
            theirs += client.lane(req.priority).enqueue_many([data], pipeline=pipe)
        pipe.execute()

    def fields(job_id: str) -> dict:
        raw = {k.decode(): v for k, v in conn.hgetall(Job.key_for(job_id)).items()}
        raw["data"] = zlib.decompress(raw["data"])
        for stamp in ("created_at", "enqueued_at"):
            when = datetime.fromisoformat(raw.pop(stamp).decode().rstrip("Z")).replace(tzinfo=timezone.utc)
            assert abs((when - datetime.now(timezone.utc)).total_seconds()) < 60
        return raw

    for mine, ref in zip(ours, theirs):
        assert fields(mine.id) == fields(ref.id)
        a, b = (Job.fetch(j, connection=conn, serializer=JSONSerializer) for j in (mine.id, ref.id))
        assert (a.kwargs, a.origin, a.timeout, a.result_ttl, a.retries_left, a.description, a.get_status()) == (
            b.kwargs, b.origin, b.timeout, b.result_ttl, b.retries_left, b.description, b.get_status()
        )  # fmt: skip
    assert conn.lrange(f"rq:queue:{name}", 0, -1) == [ours[0].id.encode(), theirs[0].id.encode()]
    assert conn.lrange(f"rq:queue:{name}:p10", 0, -1) == [ours[1].id.encode(), theirs[1].id.encode()]
    assert {f"rq:queue:{name}".encode(), f"rq:queue:{name}:p10".encode()} <= conn.smembers("rq:queues")
    with pytest.raises(Exception, match="request 0"):
        client.submit_many([{"prompt": "x", "job_id": "has spaces"}])
    with pytest.raises(Exception, match=r"^Job ID must"):  # one request: no number (as AsyncClient.submit says it)
        client.submit("x", job_id="has spaces")


def test_the_embedded_redis_survives_its_server_dropping_a_connection_after_a_refused_command():
    """fakeredis' TCP server sometimes closes a connection after refusing a command it does not know (the worker's
    probes send some: INFO, CONFIG): the next command goes again on a fresh connection instead of failing
    `roseinfer demo`."""
    import redis

    from worker.local_redis import embedded_connection, start_embedded_redis

    conn = embedded_connection(start_embedded_redis())
    for _ in range(500):  # a few in 100 are dropped: without the retry this fails nearly every time
        with pytest.raises(redis.ResponseError):
            conn.execute_command("CONFIG", "GET", "maxmemory")
        assert conn.sort("nothing", by="nosort", get="rq:job:*->status") == []


@pytest.mark.redis
def test_a_refused_event_of_an_earlier_attempt_does_not_drop_the_attempt_running_now(redis_url):
    """The sender reports events Redis refused (another attempt owns their job) with the attempt that wrote them:
    a job this worker pulled again (after an outage) keeps running when the earlier attempt's events come back
    refused; only a report naming the attempt running now drops it (where another attempt holds the job)."""
    from producer.protocol import OWNER_FIELD

    conn, worker, _, [held] = _running_jobs(redis_url)
    job_id = held.job.id
    worker._reports_lost([(job_id, "an-earlier-attempt")])
    worker._drop_lost()
    assert job_id in worker.in_flight and not worker._tasks
    conn.hset(f"rq:job:{job_id}", OWNER_FIELD, "another-attempt")
    worker._reports_lost([(job_id, held.execution.id)])
    worker._drop_lost()
    assert job_id not in worker.in_flight and len(worker._tasks) == 1


@pytest.mark.redis
def test_an_idle_pull_of_several_lanes_never_pops_a_job_out_of_every_list(redis_url):
    """Redis has no blocking move from several lists: a BLPOP then a move lost the job when the reply was lost or the
    worker was killed between the two. An idle pull of two lanes waits by BLMOVE on the first (a job in the
    intermediate list is one RQ's clean-up recovers) and finds a job of the second lane within a short wait."""
    import uuid

    from redis import Redis
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from worker.intake import MOVE_SCRIPT, MULTI_LANE_WAIT_S, pull

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    queues = [Queue(n, connection=conn, serializer=JSONSerializer) for n in (name, f"{name}:p10")]
    client = Client(redis_url, queue=name)

    def refuse(*args, **kwargs):
        raise AssertionError("a blocking pop takes a job out of every list")

    conn.blpop = conn.brpop = conn.blmpop = refuse
    waits = []  # the blocking waits made, by their timeout
    real_blmove = conn.blmove

    def blmove(*args, **kwargs):
        waits.append(args[2])
        if len(waits) == 1:  # a job for the other lane lands while the wait is on this one
            client.submit("late", max_tokens=2, priority=10)
        return real_blmove(*args, **kwargs)

    conn.blmove = blmove
    # A job a lane holds already comes at once, whichever lane: no wait on another lane first.
    waiting = client.submit("early", max_tokens=2, priority=10)
    [(job, _)], _ = pull(queues, 10, 1.0, conn, Job, JSONSerializer, conn.register_script(MOVE_SCRIPT))
    assert job.id == waiting.id and waits == []
    got = []
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        got, _ = pull(queues, 10, 1.0, conn, Job, JSONSerializer, conn.register_script(MOVE_SCRIPT))
    assert waits and set(waits) == {MULTI_LANE_WAIT_S}  # each wait on one lane a slice, then the others looked at
    [(job, queue)] = got
    assert queue.name == f"{name}:p10" and conn.lrange(queue.intermediate_queue_key, 0, -1)[-1] == job.id.encode()


@pytest.mark.redis
@pytest.mark.parametrize("how", ["requeued by RQ", "Redis lost its data"])
def test_a_job_running_here_is_in_every_registry_again_after_it_left_them(redis_url, how):
    """A running job whose registry entries went (RQ requeued it while this worker stalled, or Redis restarted
    empty) is written into them again: the started registry, its executions, this worker's; else a crash of this
    worker later would leave it started for good, in no registry RQ's clean-up reads."""
    from rq.executions import ExecutionRegistry
    from rq.registry import StartedJobRegistry

    conn, worker, name, [held] = _running_jobs(redis_url)
    job_id, execution, queue = held.job.id, held.execution, held.queue
    started = StartedJobRegistry(name, connection=conn)

    def registered() -> tuple:
        return (
            started.get_job_ids(),
            ExecutionRegistry(job_id, connection=conn).get_job_ids(),
            conn.smembers(execution.worker_executions_key),
            conn.exists(execution.key),
        )

    before = registered()
    assert before == ([job_id], [execution.id], {execution.composite_key.encode()}, 1)
    if how == "requeued by RQ":
        conn.delete(started.key, f"rq:executions:{job_id}", execution.worker_executions_key, execution.key)
        conn.lrem(queue.key, 0, job_id)
        conn.rpush(queue.intermediate_queue_key, job_id)  # pulled again: the copy in the intermediate list
        worker._keep_running_copy(held.job, queue)
    else:
        conn.delete(*[k for k in conn.keys(f"*{name}*")], *conn.keys(f"rq:*{job_id}*"), execution.key, worker.key)
        conn.delete(execution.worker_executions_key)
        worker._redis_lost_data()
    assert registered() == before
    assert conn.hget(f"rq:job:{job_id}", "status") == b"started"


@pytest.mark.redis
@pytest.mark.parametrize("way", ["script", "objects"])
def test_a_job_pulled_again_later_is_not_queued_again_as_it_starts(redis_url, way, monkeypatch):
    """RQ's clean-up of the intermediate list marks when it first saw a job there (a day's key) and queues the job
    again once that is a minute old. A job it saw in the moment between its pull and its start kept the mark; pulled
    again later (a retry), it was queued again as it started: run twice. The start removes the mark."""
    import time

    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from worker.batch_worker import BatchWorker
    from worker.intake import pull
    from worker.job_start import register
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    [submitted] = Client(redis_url, queue=name).submit_many([{"prompt": "hello", "max_tokens": 4}])
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    worker.sender.start_script = None if way == "objects" else register(conn)
    [(job, queue)], _ = pull([worker.queues[0]], 1, None, conn, Job, JSONSerializer)
    worker.maintenance.requeue_stranded(queue)  # seen between the pull and the start
    seen = queue.intermediate_queue.get_first_seen_key(job.id)
    conn.set(seen, time.time() - 120)  # minutes pass
    worker.mark_started([(job, queue)])
    assert not conn.exists(seen)
    conn.delete(queue.started_job_registry.key)  # it ended; a retry of it is pulled again, not yet started
    conn.rpush(queue.intermediate_queue_key, job.id)
    worker.maintenance.requeue_stranded(queue)
    assert queue.job_ids == [] and submitted.id == job.id
    # A start landing after the pass read the list and the registry, before its mark: the mark outlived the job (a
    # day: 8 such keys after 14,100 jobs).
    from rq.registry import StartedJobRegistry

    conn.delete(seen)
    starting = lambda registry, **kw: worker.mark_started([(job, queue)]) and []  # noqa: E731
    monkeypatch.setattr(StartedJobRegistry, "get_job_ids", starting)
    worker.maintenance.requeue_stranded(queue)
    assert not conn.exists(seen) and not conn.lpos(queue.intermediate_queue_key, job.id)
    monkeypatch.undo()
    # Deleted while it sat there: the next pass drops the id, and its mark with it (a day's leftover before).
    conn.rpush(queue.intermediate_queue_key, job.id)
    conn.delete(queue.started_job_registry.key)
    worker.maintenance.requeue_stranded(queue)
    assert conn.exists(seen)
    conn.delete(job.key)
    worker.maintenance.requeue_stranded(queue)
    assert not conn.exists(seen) and conn.llen(queue.intermediate_queue_key) == 0


@pytest.mark.redis
@pytest.mark.parametrize("way", ["script", "objects"])
def test_a_job_deleted_between_its_pull_and_its_start_stays_deleted(redis_url, way):
    """RQ's job.delete() in the moment between a pull and its start: the start wrote the hash back as a stub RQ
    cannot read (Job.fetch: "Unexpected job format"), status started and no TTL, and the job ran to its end. It
    stays deleted now, which the worker reads as a cancel."""
    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from worker.batch_worker import BatchWorker
    from worker.intake import pull
    from worker.job_start import register
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    Client(redis_url, queue=name).submit_many([{"prompt": "hello", "max_tokens": 4}])
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    worker.sender.start_script = None if way == "objects" else register(conn)
    [(job, queue)], _ = pull([worker.queues[0]], 1, None, conn, Job, JSONSerializer)
    conn.delete(job.key)
    worker.mark_started([(job, queue)])
    assert not conn.exists(job.key)
    worker.register_death()


@pytest.mark.redis
def test_a_job_taken_back_while_it_runs_here_is_ours_again_and_a_stale_lost_report_does_not_drop_it(redis_url):
    """This worker stalled; its job went to another worker, which handed it back to the queue (a cold stop); this
    worker pulled it while its own copy still ran. The copy carries on, and the hash names this attempt again: left
    naming the other one, every event was refused and the job dropped, started for good in no registry. A report
    of events refused before the job came back (sent while it was queued) does not drop it either; one made while
    another attempt holds it does."""
    from redis.exceptions import ResponseError

    from producer.protocol import OWNER_FIELD

    conn, worker, _, [held] = _running_jobs(redis_url)
    job_id, queue = held.job.id, held.queue
    key = f"rq:job:{job_id}"
    conn.hset(key, mapping={OWNER_FIELD: "another-attempt", "status": "queued"})  # handed back by the other worker
    conn.rpush(queue.intermediate_queue_key, job_id)  # and pulled here
    refused = (job_id, {"n": 2, "text": "x", "token_ids": [1]}, 0, held.execution.id)
    worker.sender._held[(job_id, held.execution.id)] = [refused]  # (as the sender holds a refused event)
    worker._reports_lost([(job_id, held.execution.id)])  # a write refused while it was queued, applied after
    worker._keep_running_copy(held.job, queue)
    assert conn.hmget(key, OWNER_FIELD, "status") == [held.execution.id.encode(), b"started"]
    worker._drop_lost()
    assert job_id in worker.in_flight and worker.sender._released == [refused]  # sent again: no gap
    conn.hset(key, OWNER_FIELD, "a-third-attempt")  # this worker stalled again; another worker took the job
    worker.sender._held[(job_id, held.execution.id)] = [refused]
    worker._reports_lost([(job_id, held.execution.id)])
    real_owned = worker._owned
    busy = ResponseError("BUSY Redis is busy running a script")  # (waited out by the loop: the report kept)
    worker._owned = lambda held: (_ for _ in ()).throw(busy)
    with pytest.raises(ResponseError, match="BUSY"):
        worker._drop_lost()
    worker._owned = real_owned
    worker._drop_lost()
    assert job_id not in worker.in_flight and worker.sender._held == {}
    while not worker.sender._queue.empty():  # (the wake-ups release_held put: sent)
        worker.sender._queue.get_nowait()
        worker.sender._sent(1)
    worker._stop_requested, worker.sender._released = True, []
    assert worker._done(False)
    worker.sender._held[(job_id, "an-attempt")] = [refused]  # a stop waits for the word on held events
    assert not worker._done(False)


@pytest.mark.redis
def test_a_worker_cut_off_past_its_registration_takes_back_no_job_that_moved_on_without_it(redis_url):
    """Cut off from Redis past its registration's TTL (Redis itself served on), the worker finds its registration
    gone, as after a restart without data, and registers again. Its jobs went on meanwhile: one to another worker,
    one finished there. Their hashes stay as they are (they were written back from memory, started and this
    worker's again, the other attempt fenced out and the finished job reopened); a job still this worker's is in
    its registries again."""
    from rq.registry import StartedJobRegistry

    from producer.protocol import OWNER_FIELD

    conn, worker, name, held = _running_jobs(redis_url, count=3)
    moved, finished, ours = (f"rq:job:{job.job.id}" for job in held)
    conn.hset(moved, OWNER_FIELD, "another-attempt")
    conn.hset(finished, mapping={OWNER_FIELD: "another-attempt", "status": "finished"})
    started = StartedJobRegistry(name, connection=conn)
    conn.delete(started.key, worker.key)
    worker._redis_lost_data()
    assert conn.hmget(moved, OWNER_FIELD, "status") == [b"another-attempt", b"started"]
    assert conn.hmget(finished, OWNER_FIELD, "status") == [b"another-attempt", b"finished"]
    assert started.get_job_ids() == [held[2].job.id]
    assert conn.hget(ours, OWNER_FIELD) == held[2].execution.id.encode()


@pytest.mark.redis
def test_the_tokenizer_and_template_are_written_again_after_redis_lost_its_data(redis_url):
    """Written once, at the start: after Redis restarted empty the worker's statistics still named their digests,
    and a server without them in memory answered /tokenize 503 and named logprobs' tokens token_id:N."""
    from producer.protocol import TEMPLATE_KEY, TOKENIZER_KEY, tokenizer_digest

    conn, worker, _name, _held = _running_jobs(redis_url)
    tag = uuid.uuid4().hex
    worker.engine.tokenizer_json = lambda: f'{{"tokenizer": "{tag}"}}'
    worker.engine.chat_template_doc = lambda: f"template {tag}"
    worker._publish_tokenizer()
    keys = [TOKENIZER_KEY.format(digest=tokenizer_digest(f'{{"tokenizer": "{tag}"}}')),
            TEMPLATE_KEY.format(digest=tokenizer_digest(f"template {tag}"))]  # fmt: skip
    assert conn.exists(*keys) == 2
    conn.delete(*keys, worker.key)  # Redis restarted empty
    worker._redis_lost_data()
    assert conn.exists(*keys) == 2
    conn.delete(*keys)


@pytest.mark.redis
def test_a_job_a_pull_started_but_the_step_loop_has_not_taken_in_gets_its_hash_back_after_redis_lost_its_data(
    redis_url,
):
    """Only the jobs in flight were saved again: one a pull had started but the step loop had not taken in yet
    (inside a long step) was then taken in with its hash gone, read as deleted, and canceled without a result."""
    from producer.protocol import OWNER_FIELD
    from worker.puller import Arrival

    conn, worker, _name, held = _running_jobs(redis_url, count=2)
    late = worker.in_flight.pop(held[1].job.id)
    worker.puller._unapplied[late.job.id] = Arrival(late.job, late.queue, late.execution, late.stream, late.request)
    conn.delete(held[0].job.key, held[1].job.key, worker.key)  # Redis restarted empty
    worker._redis_lost_data()
    for job in held:
        assert conn.hmget(job.job.key, OWNER_FIELD, "status") == [job.execution.id.encode(), b"started"]
        assert conn.hexists(job.job.key, "data")


@pytest.mark.redis
@pytest.mark.parametrize("way", ["script", "transaction"])
@pytest.mark.parametrize("status", ["failed", "scheduled"])
def test_a_job_rq_failed_or_put_off_while_it_ran_here_ends_as_rq_left_it_or_finished(redis_url, way, status):
    """This worker stalled past its heartbeat, and RQ's clean-up failed the job (abandoned, no retry left) or, with
    a retry interval, scheduled its retry; it still ran here and finished. The failure stands (its client was told,
    its failure callbacks ran: a success over it gave two results); a job put off ends finished, out of the
    scheduled registry (where the retry falling due put the finished job back on its queue, to run again)."""
    from rq.registry import FailedJobRegistry, FinishedJobRegistry, ScheduledJobRegistry

    from worker.job_finish import register

    conn, worker, name, [held] = _running_jobs(redis_url)
    registry = (FailedJobRegistry if status == "failed" else ScheduledJobRegistry)(name, connection=conn)
    conn.hset(held.job.key, "status", status)  # what RQ's handling of an abandoned job writes
    conn.zadd(registry.key, {held.job.id: 9e9})
    worker.sender.finish_script = register(conn) if way == "script" else None
    result = {"status": "finished", "text": "ok", "token_ids": [1]}
    finished = FinishedJobRegistry(name, connection=conn)
    if status == "failed":
        assert worker._succeed_plain([(held, result)]) == ([], [])
        assert conn.hget(held.job.key, "status") == b"failed" and not conn.exists(result_key(held.job.id))
        assert registry.get_job_ids() == [held.job.id] and finished.get_job_ids() == []
        return
    assert worker._succeed_plain([(held, result)]) == ([(held, result)], [])
    assert conn.hget(held.job.key, "status") == b"finished"
    assert registry.get_job_ids() == []
    assert finished.get_job_ids() == [held.job.id]


@pytest.mark.redis
def test_a_status_written_finished_by_hand_while_the_job_runs_does_not_cost_its_result(redis_url):
    """The finish script took a "finished" status for its own earlier try (its reply lost) and wrote nothing: the
    stream ended, but no result was ever stored ("its result is not kept"). A try again still writes nothing twice."""
    from producer.protocol import read_result, result_from_entries
    from worker.job_finish import register

    conn, worker, _name, [held] = _running_jobs(redis_url)
    worker.sender.finish_script = register(conn)
    conn.hset(held.job.key, "status", "finished")
    ends = [(held, {"status": "finished", "text": "ok", "token_ids": [1]})]
    assert len(worker._succeed_plain(ends)[0]) == 1
    with conn.pipeline(transaction=False) as pipe:
        read_result(pipe, held.job.id)
        [entries] = pipe.execute()
    assert result_from_entries(entries)["text"] == "ok"
    worker._succeed_plain(ends)  # the same end again, as after a lost reply
    assert conn.xlen(result_key(held.job.id)) == 1


@pytest.mark.redis
def test_a_job_whose_hash_redis_lost_ends_with_a_whole_hash_rq_can_read(redis_url):
    """Redis restarted empty while the job ran: the finish script's three fields (status, ended_at, last_heartbeat)
    made a hash RQ cannot read (Job.fetch: "Unexpected job format"; rq-dashboard failed on it)."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer.protocol import OWNER_FIELD
    from worker.job_finish import register

    conn, worker, _name, held = _running_jobs(redis_url, count=2)
    worker.sender.finish_script = register(conn)
    conn.delete(held[0].job.key, worker.key)  # (the worker's registration too: a hash gone beside it was deleted)
    ends = [(job, {"status": "finished", "text": "ok", "token_ids": [1]}) for job in held]
    assert len(worker._succeed_plain(ends)[0]) == 2
    for job in held:
        fetched = Job.fetch(job.job.id, connection=conn, serializer=JSONSerializer)
        assert fetched.get_status() == "finished" and fetched.kwargs["prompt"] == "hello"
        assert fetched.return_value()["text"] == "ok"
        assert conn.hget(job.job.key, OWNER_FIELD) == job.execution.id.encode()
        assert conn.ttl(job.job.key) > 0


@pytest.mark.redis
def test_a_result_key_of_another_type_set_while_its_job_runs_leaves_the_batchs_other_ends_whole(redis_url):
    """Written by hand after the start (which replaces such a key): its XADD failed the finish script midway, the
    jobs before it half finished (status and result, but not their registries) and the rest of the step's ends
    left to RQ's abandoned-job handling."""
    from rq.registry import FinishedJobRegistry

    from producer.protocol import read_result, result_from_entries, result_key
    from worker.job_finish import register

    conn, worker, name, held = _running_jobs(redis_url, count=3)
    worker.sender.finish_script = register(conn)
    conn.set(result_key(held[1].job.id), "not a stream")
    done = [(job, {"status": "finished", "text": f"ok {i}", "token_ids": [1]}) for i, job in enumerate(held)]
    worker._succeed_plain(done)
    assert sorted(FinishedJobRegistry(name, connection=conn).get_job_ids()) == sorted(j.job.id for j in held)
    assert result_from_entries(read_result(conn, held[1].job.id))["text"] == "ok 1"
    worker.register_death()


@pytest.mark.redis
def test_an_end_tried_again_after_a_redis_error_writes_no_job_of_it_twice(redis_url):
    """The sender tries a step's ends again when Redis fails midway. A job of result_ttl 0 that RQ's success path
    had finished (and deleted) before the error was read as one whose hash Redis lost: reopened as started, its
    success path run again (callback, counters, completion list), or a bare started hash left behind."""
    from types import SimpleNamespace

    import redis

    notify = f"ends-{uuid.uuid4().hex[:8]}"
    conn, worker, _, held = _running_jobs(redis_url, count=2, notify=notify)
    for job in held:
        job.job.result_ttl = 0  # through RQ's own success path, which deletes the job
    worker._result = lambda job, out: {"status": "finished", "text": "ok", "token_ids": [1], "timings": {}}
    worker.metrics = SimpleNamespace(job_ended=lambda *a: None)
    write, calls = worker.handle_job_success, []

    def flaky(job, *args, **kwargs):  # (RQ's success write, after the callback)
        calls.append(job.id)
        if len(calls) == 2:
            raise redis.exceptions.ConnectionError("Redis went away")
        return write(job, *args, **kwargs)

    worker.handle_job_success = flaky
    with pytest.raises(redis.exceptions.ConnectionError):
        worker._succeed([(job, None) for job in held])
    worker._succeed([(job, None) for job in held])  # the sender's retry
    assert calls == [held[0].job.id, held[1].job.id, held[1].job.id]
    assert [conn.exists(job.job.key) for job in held] == [0, 0]
    assert sorted(conn.lrange(f"roseinfer:done:{notify}", 0, -1)) == sorted(job.job.id.encode() for job in held)


@pytest.mark.redis
def test_a_success_write_refused_for_good_fails_that_job_alone_and_the_others_end(redis_url):
    """An error of RQ's success write that waiting will not mend (a key of another type, a refused command) fails
    that job, as RQ's perform_job fails it, and the jobs ended beside it go on: raised, it left them all started,
    with no result."""
    from types import SimpleNamespace

    conn, worker, _, held = _running_jobs(redis_url, count=2)
    for job in held:
        job.job.result_ttl = 0  # (through RQ's own success path)
    worker._result = lambda job, out: {"status": "finished", "text": "ok", "token_ids": [1], "timings": {}}
    ended = []
    worker.metrics = SimpleNamespace(job_ended=lambda status, *a: ended.append(status))
    conn.set(held[0].job.dependents_key, "not a set")  # (RQ's write of the first job meets WRONGTYPE)
    try:
        worker._succeed([(job, None) for job in held])
    finally:
        conn.delete(held[0].job.dependents_key)
    assert conn.hget(held[0].job.key, "status") == b"queued"  # failed, and retried (a retry left), as RQ's
    assert not conn.exists(held[1].job.key) and sorted(ended) == ["finished", "retried"]  # (result_ttl 0: gone)


@pytest.mark.redis
def test_a_job_with_a_dependent_that_rq_failed_while_it_ran_here_stays_failed_its_dependent_as_rq_left_it(
    redis_url,
):
    """Its end goes through RQ's success path (it has a dependent): it ended finished over RQ's failure, which had
    told its client and run its failure callbacks. The failure stands, and the dependent stays as RQ's failure left
    it (deferred: it depends on a job that failed)."""
    from types import SimpleNamespace

    from rq import Queue
    from rq.registry import DeferredJobRegistry, FailedJobRegistry
    from rq.serializers import JSONSerializer

    conn, worker, name, [held] = _running_jobs(redis_url)
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    child = queue.enqueue("worker.jobs.generate", prompt="child", max_tokens=2, depends_on=held.job.id)
    conn.hset(held.job.key, "status", "failed")  # what RQ's handling of an abandoned job writes
    conn.zadd(FailedJobRegistry(name, connection=conn).key, {held.job.id: 9e9})
    worker.publisher.notify = lambda *a: None
    worker._result = lambda job, out: {"status": "finished", "text": "ok", "token_ids": [1], "timings": {}}
    worker.metrics = SimpleNamespace(job_ended=lambda *a: None)
    worker._succeed([(held, None)])
    assert conn.hget(held.job.key, "status") == b"failed"
    assert FailedJobRegistry(name, connection=conn).get_job_ids() == [held.job.id]
    assert DeferredJobRegistry(name, connection=conn).get_job_ids() == [child.id]
    assert child.id not in queue.get_job_ids()


@pytest.mark.redis
@pytest.mark.parametrize("way", ["script", "transaction"])
def test_a_job_canceled_as_it_finished_ends_finished_in_one_registry(redis_url, way):
    """The cancel (RQ's: status canceled, the canceled registry) landed as the job's end was written: it ended
    finished and stayed in the canceled registry too, counted twice by ``rq info``."""
    from rq.job import Job
    from rq.registry import CanceledJobRegistry, FinishedJobRegistry
    from rq.serializers import JSONSerializer

    from worker.job_finish import register

    conn, worker, name, [held] = _running_jobs(redis_url)
    Job.fetch(held.job.id, connection=conn, serializer=JSONSerializer).cancel()
    assert CanceledJobRegistry(name, connection=conn).get_job_ids() == [held.job.id]
    worker.sender.finish_script = register(conn) if way == "script" else None
    result = {"status": "finished", "text": "ok", "token_ids": [1]}
    assert worker._succeed_plain([(held, result)]) == ([(held, result)], [])
    assert conn.hget(held.job.key, "status") == b"finished"
    assert CanceledJobRegistry(name, connection=conn).get_job_ids() == []
    assert FinishedJobRegistry(name, connection=conn).get_job_ids() == [held.job.id]


@pytest.mark.redis
def test_a_stop_execution_command_stops_only_the_execution_it_names(redis_url):
    """RQ's stop-execution names one execution of a job: a stale one (an earlier attempt's) stopped the attempt
    running now."""
    from types import SimpleNamespace

    _conn, worker, _name, [held] = _running_jobs(redis_url)
    canceled: list[str] = []
    worker.pump = SimpleNamespace(cancel_many=lambda job_ids: canceled.extend(job_ids) or {})

    def command(**payload) -> None:
        data = json.dumps({"command": "stop-execution", "job_id": held.job.id, **payload}).encode()
        worker.handle_payload({"data": data})  # as the pub/sub thread hands it over
        worker._apply_stop_requests()

    command(execution_id="an-earlier-attempt")
    assert canceled == []
    command(execution_id=held.execution.id)
    assert canceled == [held.job.id]


@pytest.mark.redis
def test_stop_job_commands_that_come_together_reach_the_engine_in_one_cancel(redis_url):
    """Each stop-job command was its own cancel: an engine process answers one after its step, so ten commands held
    the step loop ten steps (no events handed on, no jobs taken in)."""
    from types import SimpleNamespace

    _conn, worker, _name, held = _running_jobs(redis_url, count=3)
    calls: list[list[str]] = []
    worker.pump = SimpleNamespace(cancel_many=lambda job_ids: calls.append(list(job_ids)) or {})
    for job in (*held, held[0]):  # (the first twice)
        worker._stop_jobs.put((job.job.id, None, time.monotonic()))
    worker._apply_stop_requests()
    assert calls == [[job.job.id for job in held]]


@pytest.mark.redis
def test_a_cancel_that_lands_between_the_pull_and_the_start_is_kept(redis_url):
    """The start of a pulled job wrote status started over a cancel that came in since the pull: the job ran to its
    end. The cancel stays, and the worker's watch of its jobs' statuses stops it within a step."""
    import uuid

    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from worker.batch_worker import BatchWorker
    from worker.intake import pull
    from worker.job_start import register
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    client = Client(redis_url, queue=name)
    canceled, kept = client.submit("a", max_tokens=2), client.submit("b", max_tokens=2)
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    pulled, _ = pull([worker.queues[0]], 2, None, conn, Job, JSONSerializer)
    assert canceled.cancel()  # RQ's cancel, after the pull read the job's hash
    worker.sender.start_script = register(conn)
    worker.mark_started(pulled)
    assert conn.hget(f"rq:job:{canceled.id}", "status") == b"canceled"
    assert conn.hget(f"rq:job:{kept.id}", "status") == b"started"


@pytest.mark.redis
def test_a_start_whose_reply_was_lost_is_sent_again_and_its_jobs_run_here(redis_url, monkeypatch):
    """The start's writes landed and its reply was lost: the jobs were started by no one who runs them, and failed
    as abandoned a heartbeat later. The same start (same executions) goes again, and lands once."""
    import uuid

    import redis
    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import OWNER_FIELD
    from worker.batch_worker import BatchWorker
    from worker.intake import pull
    from worker.job_start import register
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    jobs = Client(redis_url, queue=name).submit_many([{"prompt": "hello", "max_tokens": 4}] * 2)
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    worker.sender.start_script = register(conn)
    pulled, _ = pull([worker.queues[0]], 2, None, conn, Job, JSONSerializer)
    real_execute, lost = redis.client.Pipeline.execute, []

    def reply_lost_once(pipe, *args, **kwargs):
        replies = real_execute(pipe, *args, **kwargs)
        if not lost:
            lost.append(1)
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return replies

    monkeypatch.setattr(redis.client.Pipeline, "execute", reply_lost_once)
    executions, streams = worker.mark_started(pulled, [job.id for job in jobs])
    monkeypatch.undo()
    assert lost and set(streams) == {job.id for job in jobs}
    started = {m.decode() for m in conn.zrange(worker.queues[0].started_job_registry.key, 0, -1)}
    assert started == {execution.composite_key for execution in executions}  # once each
    for job, execution in zip(jobs, executions):
        assert conn.hmget(f"rq:job:{job.id}", "status", OWNER_FIELD) == [b"started", execution.id.encode()]
    assert conn.llen(worker.queues[0].intermediate_queue_key) == 0


@pytest.mark.redis
def test_a_stop_written_from_outside_is_ended_as_a_stop_not_taken_for_an_earlier_try(redis_url):
    """A running job whose status another client set to stopped: its end records the stop (RQ's failed registry,
    the started registry and the execution left, the hash's TTL), though the status already reads as what that end
    writes. Only our execution's hash being gone says an earlier try of the end ran."""
    from rq.registry import FailedJobRegistry, StartedJobRegistry

    from worker.pump import JobEvent

    conn, worker, name, [held] = _running_jobs(redis_url)
    conn.hset(held.job.key, "status", "stopped")  # as another client writes it; the sender reports it
    worker._canceled(held, [JobEvent(held.job.id, finish_reason="abort")], stopped=True)
    for end in worker._tasks:
        end()
    assert FailedJobRegistry(name, connection=conn).get_job_ids() == [held.job.id]
    assert StartedJobRegistry(name, connection=conn).get_job_ids() == [] and not conn.exists(held.execution.key)
    assert conn.ttl(held.job.key) > 0
    [record] = held.job.results()  # RQ's record of the stop, holding what the job made
    assert record.type == record.Type.STOPPED and record.return_value["status"] == "canceled"
    # Our execution's hash gone too (it lapsed while this worker stalled): taken for an earlier try of the end, whose
    # record it then wrote; none was there, so the job kept no result at all.
    conn, worker, name, [held] = _running_jobs(redis_url)
    conn.delete(held.execution.key)
    conn.hset(held.job.key, "status", "stopped")
    worker._canceled(held, [JobEvent(held.job.id, finish_reason="abort")], stopped=True)
    for end in worker._tasks * 2:  # (the second time as the sender's try again after a lost reply)
        end()
    [record] = held.job.results()
    assert record.type == record.Type.STOPPED and record.return_value["status"] == "canceled"
    assert FailedJobRegistry(name, connection=conn).get_job_ids() == [held.job.id]  # ended as RQ ends a stop
    assert StartedJobRegistry(name, connection=conn).get_job_ids() == [] and conn.ttl(held.job.key) > 0
    assert conn.hget(held.job.key, "status") == b"stopped"
    # A cancel's end tried again after a lost reply: one record, one completion-list entry.
    conn, worker, name, [held] = _running_jobs(redis_url, notify="done-list")
    conn.hset(held.job.key, "status", "canceled")
    worker._canceled(held, [JobEvent(held.job.id, finish_reason="abort")])
    for end in worker._tasks * 2:
        end()
    assert len(held.job.results()) == 1 and conn.llen("roseinfer:done:done-list") == 1
    conn.delete("roseinfer:done:done-list")
    # A job whose failure_ttl is -1 (RQ: kept for good): an EXPIRE of -1 after the failed registry's deleted its hash.
    conn, worker, name, [held] = _running_jobs(redis_url)
    held.job.failure_ttl = -1
    conn.delete(held.execution.key)  # (lapsed: the end writes RQ's record of the stop itself)
    conn.hset(held.job.key, mapping={"failure_ttl": -1, "status": "stopped"})
    worker._canceled(held, [JobEvent(held.job.id, finish_reason="abort")], stopped=True)
    for end in worker._tasks:
        end()
    assert conn.hget(held.job.key, "status") == b"stopped" and conn.ttl(held.job.key) == -1


@pytest.mark.redis
@pytest.mark.parametrize("forgotten", [False, True, None], ids=["script loaded", "Redis forgot the script", "no Lua"])
def test_a_heartbeat_never_brings_back_a_job_hash_deleted_meanwhile(redis_url, forgotten):
    """RQ's job heartbeat is an HSET whatever its xx says: a beat just after a job's ``delete()`` made a hash of one
    field with no TTL, for good. The beat writes only where the hash still is (without Lua: deletes what its HSET
    made, as RQ's own heartbeat does); a running job's hash gets its beat. So with its execution's hash: one whose
    end was written just before the beat came back for a TTL (and the lease skipped a beat)."""
    from worker.heartbeat import Heartbeat

    conn, worker, _, [deleted, running] = _running_jobs(redis_url, count=2)
    if forgotten is not None:
        worker.sender._load_scripts()
    heartbeat = Heartbeat(worker)
    for held in (deleted, running):
        held.beat_at = 0
    heartbeat.beat()  # loads its script
    if forgotten:
        conn.script_flush()
    conn.delete(deleted.job.key)  # RQ's job.delete(), by the job's owner, while it runs
    conn.delete(deleted.execution.key)  # (and its end, written between the beat's look at the jobs and its writes)
    conn.hdel(running.job.key, "last_heartbeat")
    conn.hdel(running.execution.key, "last_heartbeat")
    for held in (deleted, running):
        held.beat_at = 0
    heartbeat.beat()
    assert not conn.exists(deleted.job.key)
    assert conn.hget(running.job.key, "last_heartbeat")
    assert conn.hget(running.execution.key, "last_heartbeat") and conn.ttl(running.execution.key) > 0
    assert not conn.exists(deleted.execution.key)


@pytest.mark.slow
@pytest.mark.redis
def test_due_jobs_go_back_to_their_queue_within_a_second_not_a_heartbeat(redis_url):
    """RQ's scheduler looks for due jobs every second; the worker looked at each heartbeat (10 s by default), so a
    job ``enqueue_in`` 1 s (or a retry with an interval) ran up to 10 s late."""
    from datetime import timedelta

    from rq import Queue
    from rq.serializers import JSONSerializer

    from worker.heartbeat import Heartbeat

    conn, worker, client = _worker_of_a_new_queue(redis_url, heartbeat_interval=10)
    worker.register_birth()
    worker.sender._load_scripts()
    heartbeat = Heartbeat(worker)
    heartbeat.start()
    try:
        time.sleep(0.2)  # the first beat and look are behind it: the job falls due between looks
        queue = Queue(client.queue.name, connection=conn, serializer=JSONSerializer)
        job = queue.enqueue_in(timedelta(seconds=1), "worker.jobs.generate", prompt="later", max_tokens=2)
        deadline = time.monotonic() + 5
        while job.id not in queue.job_ids and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.id in queue.job_ids
    finally:
        heartbeat.stop()
        worker.register_death()


def test_the_due_jobs_scheduler_logs_at_the_workers_rq_level(redis_url, monkeypatch):
    """RQ's scheduler class sets its logger to INFO unless told otherwise: `roseinfer demo` (RQ at WARNING) printed
    its "Acquired scheduler lock" lines on stdout, into the tokens it streamed there."""
    import logging

    from worker.due_retries import DueRetries

    _, worker, _ = _worker_of_a_new_queue(redis_url)
    worker.register_birth()
    worker.sender._load_scripts()
    scheduler_log = logging.getLogger("rq.scheduler")
    monkeypatch.setattr(scheduler_log, "level", scheduler_log.level)  # restored after the test
    monkeypatch.setattr(worker.log, "level", logging.WARNING)
    due = DueRetries(worker)
    try:
        due.enqueue()
        assert scheduler_log.level == logging.WARNING
    finally:
        due._release()
        worker.register_death()


@pytest.mark.redis
def test_the_lease_never_outlives_a_registry_entry_of_a_job_held(redis_url):
    """A stall of Redis outlived the jobs' registry entries (absolute scores) but not the lease (a TTL, extended
    when the stall ended): RQ requeued the jobs, and the events of both attempts went out unchecked."""
    from producer.protocol import LEASE_KEY, OWNER_FIELD
    from worker.heartbeat import Heartbeat

    conn, worker, _, [first, second] = _running_jobs(redis_url, count=2)
    worker.sender._load_scripts()
    lease = worker.sender.lease_key = LEASE_KEY.format(worker=worker.name)
    heartbeat = Heartbeat(worker)
    heartbeat.beat()  # beats both jobs (their registry entries: 40 s), then sets the lease: 10 s + half the grace
    assert 20_000 < conn.pttl(lease) <= 25_000  # (its 25 s, less what the beat took: a second on a loaded machine)
    entry = {first.execution.composite_key: time.time() + 12}  # 12 s left: its heartbeats did not reach Redis
    conn.zadd(first.job.started_job_registry.key, entry)
    heartbeat.beat()  # (the jobs were beaten a moment ago: not again)
    assert not conn.exists(lease)  # it would outlive the entry less half the grace (15 s)
    conn.zadd(first.job.started_job_registry.key, {first.execution.composite_key: time.time() + 20})
    heartbeat.beat()
    assert 0 < conn.pttl(lease) <= 5_000
    conn.zadd(first.job.started_job_registry.key, {first.execution.composite_key: time.time() + 40})
    conn.hset(second.job.key, OWNER_FIELD, "another-attempt")  # requeued and taken elsewhere
    heartbeat.beat()
    assert not conn.exists(lease)
    # A job last beaten just under half the grace ago is beaten again: its entry (whole seconds, rounded down) ended
    # the lease just before the next beat, and every event was checked one by one for ~0.6 s of every 10.
    conn.hset(second.job.key, OWNER_FIELD, second.execution.id)
    for held in (first, second):
        held.beat_at = time.monotonic() - 14.9
        conn.zadd(held.job.started_job_registry.key, {held.execution.composite_key: int(time.time() - 14.9) + 40})
    heartbeat.beat()
    assert conn.pttl(lease) > 11_000  # past the next beat (10 s), with room to spare
    # RQ's clean-up took a job for abandoned: its entry gone (a retry scheduled, or queued again), the owner still
    # ours. The lease was granted whole (25 s), and both attempts' events went out unchecked.
    conn.zrem(first.job.started_job_registry.key, first.execution.composite_key)
    heartbeat.beat()
    assert not conn.exists(lease)
    for status in ("scheduled", "queued"):  # (as RQ's retry writes it, with the entry out)
        conn.hset(first.job.key, "status", status)
        heartbeat.beat()
        assert not conn.exists(lease) and conn.hget(first.job.key, "status") == status.encode()
    # A stale copy of the job saved over its status (``job.save()`` of the object ``enqueue`` returned), its entry
    # still there: no requeue. The lease was refused, the job's events after it refused and the job dropped here,
    # in no queue and no registry, for good. It says "started" again, and the lease holds.
    conn.zadd(first.job.started_job_registry.key, {first.execution.composite_key: time.time() + 40})
    for status in ("scheduled", "queued"):
        conn.hset(first.job.key, "status", status)
        heartbeat.beat()
        assert conn.exists(lease) and conn.hget(first.job.key, "status") == b"started"
    conn.delete(lease)
    # Thawed after a stall past its entries' life: RQ's clean-up may have read them lapsed and not yet written the
    # failure (the status still started). The beat renews the entries but grants no lease: its events stay checked
    # (a stalled worker streamed 12 events after the failure). The next beat does.
    conn.hset(first.job.key, "status", "started")
    for held in (first, second):
        held.beat_at = time.monotonic() - 41
    heartbeat.beat()
    assert not conn.exists(lease) and not heartbeat._leased
    heartbeat.beat()
    assert conn.exists(lease)
    # A stop hands jobs back to their queues: the sender's backlog of their events went out under the lease, unchecked
    # (the heartbeat even renewed it, nothing held vetoing it), into the stream of an attempt elsewhere.
    assert conn.exists(lease)
    worker._requeue([second], {})
    assert not conn.exists(lease) and second.job.get_status(refresh=True) == "queued"
    worker._stop_requested = True
    heartbeat.beat()
    assert not conn.exists(lease) and not heartbeat._leased


@pytest.mark.redis
def test_a_heartbeat_that_failed_is_tried_again_at_the_next_beat(redis_url, monkeypatch):
    """A beat whose round trip failed (a blip, READONLY in a failover) marked its jobs beaten all the same: the next
    beat skipped them as fresh, and their registry entries (interval + grace) lapsed before the one after, when any
    worker's maintenance took them for abandoned (failure callback, retry: run twice)."""
    import redis
    from redis.client import Pipeline

    from worker import heartbeat as heartbeat_module
    from worker.heartbeat import Heartbeat

    conn, worker, _, [held] = _running_jobs(redis_url)
    beats = Heartbeat(worker)
    held.beat_at = 0.0  # due
    execute = Pipeline.execute

    def blip(self, *args, **kwargs):
        monkeypatch.setattr(Pipeline, "execute", execute)
        raise redis.ConnectionError("a blip")

    monkeypatch.setattr(Pipeline, "execute", blip)
    with pytest.raises(redis.ConnectionError):
        beats.beat()
    before = conn.hget(held.job.key, "last_heartbeat")  # (the start's: the failed beat wrote nothing)
    later = time.monotonic() + worker.settings.heartbeat_interval  # the next beat
    monkeypatch.setattr(heartbeat_module.time, "monotonic", lambda: later)
    beats.beat()
    assert conn.hget(held.job.key, "last_heartbeat") > before
    worker.register_death()


@pytest.mark.redis
def test_step_events_met_on_the_way_to_a_cancel_keep_what_they_say(redis_url):
    """With the engine in its own process, a step's events that arrive while a cancel waits for its answer come
    before it, and went out as bare text: a restart (a refused prefix) never reset the stream, so followers kept
    the old attempt's text before the new; the first token's time, a sample's end and the prompt's length were
    lost."""
    from worker.pump import JobEvent

    _conn, worker, _, [held] = _running_jobs(redis_url)
    job_id = held.job.id
    held.stream.next_n = 3  # (an earlier attempt's events)
    worker._canceled(held, [
        JobEvent(job_id, restarted=True),
        JobEvent(job_id, "Hel", [1], prompt_tokens=5),
        JobEvent(job_id, finish_reason="abort"),
    ])  # fmt: skip
    assert held.first_token_at is not None and worker.tokens == 1
    running, finals = worker.publisher.take()
    [(_, event, *_)] = running + finals  # all it made since its last event, in one
    assert event.get("reset") and event["text"] == "Hel" and event["finish_reason"] == "abort"
    worker.register_death()


def test_writes_a_cold_stop_gives_up_on_with_redis_away_are_a_line_each_not_a_false_stack(caplog):
    """Redis away at a cold stop: each write given up logged a 50-line stack saying "their jobs' results still
    go", false there (the jobs are left for RQ's clean-up, said apart). Any other failure keeps its stack."""
    import logging

    import redis

    from worker.sender import Sender

    sender = object.__new__(Sender)  # (only its give-up time is read)
    sender.give_up_at = time.monotonic() - 1
    with caplog.at_level(logging.WARNING, logger="roseinfer.worker"):
        sender._failed(redis.ConnectionError("Connection refused"), "writing 3 events failed; (results still go)")
    [record] = caplog.records
    assert record.exc_info is None and "results still go" not in record.getMessage()
    said = "Redis unavailable at the stop (ConnectionError: Connection refused): a write given up"
    assert record.getMessage() == said
    caplog.clear()
    sender.give_up_at = None  # (not stopping: Redis's error, with its stack)
    with caplog.at_level(logging.WARNING, logger="roseinfer.worker"):
        try:
            raise redis.ConnectionError("Connection refused")
        except redis.ConnectionError as exc:
            sender._failed(exc, "writing 3 events failed")
    [record] = caplog.records
    assert record.exc_info is not None and record.getMessage() == "writing 3 events failed"


@pytest.mark.redis
def test_a_cold_stop_waits_for_a_pull_under_way_no_longer_than_its_patience(redis_url):
    """The second stop signal joined the puller for up to 120 s: one retrying a start through an outage (20 s, and
    socket timeouts) held the cold stop that long before its 5 s patience applied."""
    import threading

    _conn, worker, _, [held] = _running_jobs(redis_url)
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(30,), daemon=True)  # a pull retrying Redis
    stuck.start()
    worker.puller._thread = stuck
    worker.sender.start()
    worker.sender.give_up_at = time.monotonic() + 0.3  # (the second signal sets it)
    started = time.monotonic()
    try:
        worker._hand_back_cold()
        assert time.monotonic() - started < 5
        assert held.job.get_status(refresh=True) == "queued"  # handed back all the same
    finally:
        release.set()
        worker.sender.stop()
        worker.register_death()


@pytest.mark.redis
def test_a_stop_after_redis_lost_its_data_hands_the_jobs_copy_back(redis_url):
    """Redis restarted empty and a heartbeat made the worker's hash again (without its registration's ``birth``): a
    stop then took the missing job hash for a client's delete (the worker's key was there) and ended the job,
    where the copy the worker holds is all there is of it: it goes back to its queue."""
    conn, worker, name, [held] = _running_jobs(redis_url)
    conn.delete(held.job.key, worker.key)
    conn.hset(worker.key, "last_heartbeat", "2026-12-02T00:00:00.000000Z")  # (RQ's beat, no birth)
    worker.sender.start()
    worker.sender.give_up_at = time.monotonic() + 2
    try:
        assert worker._hand_back_cold(only=[held.job.id])  # (a warm stop's: the job made no token yet)
        assert held.job.get_status(refresh=True) == "queued" and conn.lrange(f"rq:queue:{name}", 0, -1) == [
            held.job.id.encode()
        ]
    finally:
        worker.sender.stop()
        worker.register_death()


@pytest.mark.redis
def test_a_job_of_n_samples_canceled_after_its_first_ended_is_canceled_not_finished(redis_url):
    """The result took sample 0's end for the job's: canceled after sample 0 stopped, the job's result said
    ``finished`` / ``stop`` (its stream said abort, RQ said canceled) and ``job.result()`` returned it as a success."""
    from producer import JobCanceled
    from producer.client import Client
    from roseinfer.outputs import CompletionOutput, RequestOutput
    from worker.pump import JobEvent

    conn, worker, name, [held] = _running_jobs(redis_url, n=2, temperature=1.0, seed=1)
    samples = [CompletionOutput(0, "A", [5], "stop", "\n"), CompletionOutput(1, "B C", [6, 7], "abort")]
    out = RequestOutput(held.job.id, None, [1, 2], samples, True)
    conn.hset(held.job.key, "status", "canceled")  # as RQ's cancel leaves it
    worker._canceled(held, [JobEvent(held.job.id, "C", [7], "abort", out, index=1)])
    for end in worker._tasks:
        end()
    with pytest.raises(JobCanceled) as err:
        Client(redis_url, queue=name).job(held.job.id).result(timeout=5)
    result = err.value.result
    assert (result["status"], result["finish_reason"], result["stop_reason"]) == ("canceled", "abort", None)
    assert [c["finish_reason"] for c in result["choices"]] == ["stop", "abort"]  # each sample keeps its own


@pytest.mark.redis
def test_a_job_a_pull_left_in_the_intermediate_list_goes_back_to_its_queue_not_to_failed(redis_url):
    """A pull whose reply was lost (a timeout) leaves its jobs in RQ's intermediate list, started by no one: RQ's
    clean-up failed them a minute later ("stuck in intermediate queue"), a retry spent or the job lost."""
    from datetime import timedelta

    from rq.utils import now

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    stranded, waiting = client.submit("lost in a pull", max_tokens=2), client.submit("next", max_tokens=2)
    queue = worker.queues[0]
    conn.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")  # the move ran; its reply was lost
    worker.clean_registries()  # first seen
    assert queue.intermediate_queue.get_job_ids() == [stranded.id]
    first_seen = queue.intermediate_queue.get_first_seen_key(stranded.id)
    conn.set(first_seen, (now() - timedelta(minutes=2)).timestamp())
    worker.clean_registries()
    assert queue.intermediate_queue.get_job_ids() == [] and queue.get_job_ids() == [stranded.id, waiting.id]
    assert stranded.status() == "queued" and stranded.rq_job.retries_left == 2  # never ran: nothing spent
    assert not conn.exists(first_seen)  # moved and started again in milliseconds: not taken for stranded at once


@pytest.mark.redis
def test_a_queues_clean_up_lock_is_held_a_maintenance_interval_not_rqs_15_minutes(redis_url, monkeypatch):
    """A worker killed mid-pass (or whose release met Redis away) left RQ's 899 s lock: no worker cleaned that queue,
    its dead workers' jobs stranded, for 15 minutes. Strandeds are checked against the started registry read once."""
    from rq.registry import StartedJobRegistry

    import worker.maintenance as maintenance

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    queue, seen, reads = worker.queues[0], [], []
    monkeypatch.setattr(maintenance, "clean_registries", lambda q, *a: seen.append(conn.ttl(q.registry_cleaning_key)))
    real_ids = StartedJobRegistry.get_job_ids
    monkeypatch.setattr(
        StartedJobRegistry, "get_job_ids", lambda self, *a, **k: reads.append(1) or real_ids(self, *a, **k)
    )
    for i in range(5):  # five jobs a pull left in the intermediate list
        client.submit(f"stranded {i}", max_tokens=2)
        conn.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
    worker.clean_registries()
    assert seen and all(0 < ttl <= max(int(worker.maintenance_interval), 2) for ttl in seen)  # (a lock a lane)
    assert len(reads) == 1
    assert not conn.exists(queue.registry_cleaning_key)  # released after the pass


@pytest.mark.slow  # a second: the beat after a failed one
@pytest.mark.redis
@pytest.mark.parametrize("refusal", ["down", "MISCONF", "BUSY"])
def test_no_clean_up_takes_live_jobs_for_abandoned_while_redis_is_just_back(redis_url, monkeypatch, refusal):
    """An outage past the heartbeat TTL lapses the registry entries of jobs live workers run; the first clean-up
    after Redis came back (any worker's) failed them, or spent a retry, while they ran. A beat that failed is tried
    again in a second, not an interval, and clean-ups wait a heartbeat interval after Redis is back. A Redis that
    takes no writes for now (a full disk's MISCONF, a long script's BUSY) is such an outage too: the heartbeat took
    it for an error of its own (a traceback a beat, at the interval) and held no clean-up off."""
    import redis

    error = {
        "down": redis.exceptions.ConnectionError("Connection refused"),
        "MISCONF": redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's "
                                                  "currently unable to persist to disk"),
        "BUSY": redis.exceptions.ResponseError("BUSY Redis is busy running a script."),
    }[refusal]  # fmt: skip

    conn, worker, client = _worker_of_a_new_queue(redis_url, heartbeat_interval=10)
    queue, beats = worker.queues[0], []
    job = client.submit("running elsewhere", max_tokens=2)
    conn.lpop(queue.key)
    conn.hset(job.rq_job.key, "status", "started")
    conn.zadd(queue.started_job_registry.key, {f"{job.id}:e1": time.time() - 5})  # lapsed during the outage

    def beat():
        beats.append(time.monotonic())
        if len(beats) == 1:
            raise error

    monkeypatch.setattr(worker._heartbeat, "beat", beat)
    monkeypatch.setattr(worker._heartbeat.due_retries, "enqueue", lambda: None)
    worker._heartbeat.start()
    try:
        deadline = time.monotonic() + 5
        while len(beats) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker._heartbeat._stop.set()
        worker._heartbeat._thread.join(timeout=10)
    assert len(beats) == 2 and worker._heartbeat.back_at is not None and not worker._heartbeat.failing
    worker.clean_registries()
    assert job.status() == "started"  # left for its worker to beat
    worker._heartbeat.back_at -= worker.maintenance.redis_back_s
    worker.clean_registries()
    assert job.status() == "queued"  # still lapsed a heartbeat interval later: abandoned (a retry spent)


@pytest.mark.redis
def test_a_lapsed_started_entry_whose_job_key_is_no_hash_does_not_stop_the_queues_clean_up(redis_url):
    """A running job's key set to a string by hand: once its started entry lapsed, RQ's clean-up of the queue failed
    on it at every pass (a traceback each), and a dead worker's job behind it stayed started for good."""
    conn, worker, client = _worker_of_a_new_queue(redis_url)
    queue = worker.queues[0]
    abandoned = client.submit("its worker died", max_tokens=2)
    conn.lpop(queue.key)
    conn.hset(abandoned.rq_job.key, "status", "started")
    conn.set(f"rq:job:clobbered-{queue.name}", "not a hash")
    conn.zadd(queue.started_job_registry.key, {f"clobbered-{queue.name}:e0": 1, f"{abandoned.id}:e1": 2})
    _streamed_a_token(conn, abandoned.id)  # (RQ's way: one that streamed nothing goes back, no retry spent)
    worker.clean_registries()
    assert conn.zcard(queue.started_job_registry.key) == 0
    assert abandoned.status() == "queued" and abandoned.rq_job.retries_left == 1  # RQ's handling of the abandoned


@pytest.mark.redis
def test_a_job_rq_fails_as_abandoned_gets_its_last_event_and_its_completion_entry(redis_url):
    """Its worker died (killed, out of memory) with no retry left: RQ's clean-up failed it, and its stream never got
    a last event (a follower of the protocol waited for good) nor its id the completion list it named. Both come
    now, once; a job RQ retries gets neither (its next attempt streams on)."""
    from producer import Client, JobFailed
    from producer.protocol import done_key, stream_key

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    queue = worker.queues[0]
    notify = f"done-{queue.name}"
    died = Client(redis_url, queue=queue.name, retries=0).submit("its worker died", max_tokens=8, notify=notify)
    retried = client.submit("its worker died too", max_tokens=8, notify=notify)  # (a retry left)
    for job in (died, retried):
        conn.lrem(queue.key, 0, job.id)
        conn.hset(job.rq_job.key, "status", "started")
        for n in range(2):  # what the dead worker streamed
            event = {"v": 1, "n": n, "text": f"t{n}", "token_ids": [n]}
            conn.xadd(stream_key(job.id), {"event": json.dumps(event)})
    conn.zadd(queue.started_job_registry.key, {f"{died.id}:e0": 1, f"{retried.id}:e1": 1})
    worker.clean_registries()
    events = [json.loads(fields[b"event"]) for _id, fields in conn.xrange(stream_key(died.id))]
    assert [e["n"] for e in events] == [0, 1, 2] and events[-1]["finish_reason"] == "error"
    assert "died" in events[-1]["error"] and died.status() == "failed"
    assert conn.lrange(done_key(notify), 0, -1) == [died.id.encode()]
    assert conn.xlen(stream_key(retried.id)) == 2 and retried.status() == "queued"
    with pytest.raises(JobFailed, match="AbandonedJobError"):
        died.result(timeout=5)
    # RQ's record of it lasts its failure_ttl (RQ's year, for a job of none), as the hash: it was kept for good.
    from producer.protocol import result_key

    assert 364 * 86400 < conn.ttl(result_key(died.id)) <= 365 * 86400
    worker.clean_registries()  # (nothing lapsed left: nothing written twice)
    assert conn.xlen(stream_key(died.id)) == 3 and conn.llen(done_key(notify)) == 1


@pytest.mark.slow  # two seconds: three clean-ups (the fast lane stays under a minute)
@pytest.mark.redis
def test_jobs_a_dead_worker_held_before_their_first_token_go_back_with_their_retries(redis_url):
    """A worker holds more jobs than it runs (waiting for the engine): killed, every one of them was abandoned to
    RQ's clean-up, a retry spent each (failed, with none left: 4 of 6 jobs that never ran). Those that streamed
    nothing go back to the front of their queue, retries untouched, a bounded number of times (a job that kills
    every worker at its start then fails as RQ fails it); one that streamed goes RQ's way, as before."""
    from producer import Client, JobFailed
    from worker.maintenance import FREE_REQUEUES, UNRUN_FIELD

    conn, worker, _ = _worker_of_a_new_queue(redis_url)
    queue = worker.queues[0]
    client = Client(redis_url, queue=queue.name, retries=0)
    waited, streamed = client.submit("it waited", max_tokens=8), client.submit("it streamed", max_tokens=8)
    kept = client.submit("queued behind")

    def died_holding(*jobs) -> None:
        for job in jobs:
            conn.lrem(queue.key, 0, job.id)
            conn.hset(job.rq_job.key, "status", "started")
            conn.zadd(queue.started_job_registry.key, {f"{job.id}:e{time.monotonic_ns()}": 1})

    died_holding(waited, streamed)
    _streamed_a_token(conn, streamed.id)
    worker.clean_registries()
    assert waited.status() == "queued" and conn.lrange(queue.key, 0, -1) == [waited.id.encode(), kept.id.encode()]
    assert waited.rq_job.retries_left is None and conn.hget(waited.rq_job.key, UNRUN_FIELD) == b"1"
    assert not conn.zrange(queue.started_job_registry.key, 0, -1)
    assert streamed.status() == "failed"  # (no retry left: RQ's way)
    with pytest.raises(JobFailed, match="AbandonedJobError"):
        streamed.result(timeout=5)
    for _ in range(FREE_REQUEUES - 1):
        died_holding(waited)
        worker.clean_registries()
        assert waited.status() == "queued"
    died_holding(waited)  # (a job that kills its workers: its free turns spent)
    worker.clean_registries()
    assert waited.status() == "failed"


@pytest.mark.redis
@pytest.mark.parametrize("scripts", [True, False], ids=["lua", "objects"])
def test_a_resumed_job_whose_dead_attempt_streamed_nothing_goes_back_with_its_retries(redis_url, scripts):
    """The free requeue looked at the job's whole stream: a job that streamed in an earlier attempt, then only waited
    in a worker that died, spent a retry (failed with none left, having run once). Its start marks the stream's
    last entry, and an attempt that added none streamed nothing."""
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.protocol import RESUMED_FROM_FIELD, stream_key
    from worker.intake import PulledJob, pull

    conn, worker, _ = _worker_of_a_new_queue(redis_url)
    worker.sender._load_scripts()
    if not scripts:
        worker.sender.start_script = None  # (RQ's objects under WATCH: a Redis that runs no Lua)
    queue = worker.queues[0]
    client = Client(redis_url, queue=queue.name, retries=0)
    waited, streamed = client.submit("it waited", max_tokens=8), client.submit("it streamed", max_tokens=8)
    for job in (waited, streamed):
        _streamed_a_token(conn, job.id)  # (an earlier attempt's)
    pulled, _ = pull([queue], 2, None, conn, PulledJob, JSONSerializer)
    executions, _ = worker.mark_started(pulled)
    [last] = conn.xrevrange(stream_key(waited.id), count=1)
    assert conn.hget(waited.rq_job.key, RESUMED_FROM_FIELD) == last[0]
    _streamed_a_token(conn, streamed.id)  # (this attempt's)
    for job, execution in zip((waited, streamed), executions):  # (the attempt's worker died: its entries lapse)
        conn.zadd(queue.started_job_registry.key, {f"{job.id}:{execution.id}": 1})
    worker.clean_registries()
    assert waited.status() == "queued" and waited.rq_job.retries_left is None
    assert streamed.status() == "failed"  # (no retry left: RQ's way)
    # Started again from an empty stream (an earlier job's, gone): the mark goes too.
    conn.delete(stream_key(waited.id))
    pulled, _ = pull([queue], 1, None, conn, PulledJob, JSONSerializer)
    worker.mark_started(pulled)
    assert not conn.hexists(waited.rq_job.key, RESUMED_FROM_FIELD)


@pytest.mark.redis
def test_a_cancel_between_the_requeues_look_and_its_write_stands(redis_url, monkeypatch):
    """The requeue of a dead worker's unrun job read its status, then saved the job whole, status queued: a client's
    cancel between the two (it keeps the started entry) was written over, and the canceled job ran."""
    from producer import JobCanceled
    from producer.protocol import OWNER_FIELD

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    queue = worker.queues[0]
    job = client.submit("its worker died before it ran", max_tokens=8)
    conn.lrem(queue.key, 0, job.id)
    worker.mark_started([(job.rq_job, queue)], [job.id])
    member = f"{job.id}:{conn.hget(job.rq_job.key, OWNER_FIELD).decode()}"
    conn.zadd(queue.started_job_registry.key, {member: 1}, xx=True)
    fetch = queue.job_class.fetch

    def fetched_then_canceled(job_id, **kwargs):
        read = fetch(job_id, **kwargs)
        if read.get_status(refresh=False) == "started":  # (the requeue's read: the cancel lands after it)
            assert client.job(job_id).cancel()
        return read

    monkeypatch.setattr(queue.job_class, "fetch", staticmethod(fetched_then_canceled))
    worker.clean_registries()  # (the whole pass: RQ's clean-up after the requeue dropped the entry, the job unended)
    assert job.status() == "canceled" and job.id.encode() not in conn.lrange(queue.key, 0, -1)
    with pytest.raises(JobCanceled) as ended:
        job.result(timeout=5)
    assert ended.value.result["error"] == "job canceled while the worker running it was dead"
    assert conn.ttl(job.rq_job.key) > 0 and not conn.zrange(queue.started_job_registry.key, 0, -1)


@pytest.mark.redis
@pytest.mark.parametrize("priority", [0, 10])
def test_a_client_cancel_of_a_job_whose_worker_died_ends_it_once_its_entry_lapses(redis_url, priority):
    """RQ's cancel takes the job's started entry out: a job canceled while its worker was dead was never ended (no
    result, no last event, a notify waiter waiting for good, the hash and its prompt kept for good), where a raw
    ``HSET status canceled`` was. The entry stays; maintenance ends the job as for that one. In a lane too (the
    bulk one, batch's): its ending's client was made with the lane's name, which a client refuses."""
    from producer import JobCanceled
    from producer.protocol import OWNER_FIELD, done_key, lane_name, stream_key

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    queue = next(q for q in worker.queues if q.name == lane_name(worker.queues[0].name, priority))
    notify = f"done-{worker.queues[0].name}"
    job = client.submit("its worker died", max_tokens=8, notify=notify, priority=priority)
    conn.lrem(queue.key, 0, job.id)
    worker.mark_started([(job.rq_job, queue)], [job.id])  # (its execution records, as a start writes them)
    member = f"{job.id}:{conn.hget(job.rq_job.key, OWNER_FIELD).decode()}"
    conn.zadd(queue.started_job_registry.key, {member: 1}, xx=True)  # its worker died: no beat since
    _streamed_a_token(conn, job.id)
    assert job.cancel() and job.status() == "canceled"
    assert conn.zscore(queue.started_job_registry.key, member) == 1
    worker.clean_registries()
    events = [json.loads(fields[b"event"]) for _id, fields in conn.xrange(stream_key(job.id))]
    assert [e["n"] for e in events] == [0, 1] and events[-1]["finish_reason"] == "abort"
    with pytest.raises(JobCanceled) as ended:
        job.result(timeout=5)
    assert ended.value.result["text"] == "t"
    assert ended.value.result["error"] == "job canceled while the worker running it was dead"
    assert conn.lrange(done_key(notify), 0, -1) == [job.id.encode()] and conn.ttl(job.rq_job.key) > 0
    assert not conn.zrange(queue.started_job_registry.key, 0, -1)


@pytest.mark.redis
def test_an_abandoned_jobs_allowed_failure_callback_runs_on_a_callback_thread_not_in_the_clean_up(redis_url):
    """RQ's clean-up ran a dead worker's job's failure callback itself, on the step loop: every running job's
    tokens waited for it (up to its timeout), and a loop off the main thread could not set its SIGALRM (it never
    ran). It runs on a callback thread now, under a timer; a callback the worker does not allow still never runs."""
    conn, worker, client = _worker_of_a_new_queue(redis_url, allow_callback=["hook_probe.held"])
    queue = worker.queues[0]
    held, unlisted = client.submit("its worker died", max_tokens=2), client.submit("so did this", max_tokens=2)
    for job, name in ((held, "hook_probe.held"), (unlisted, "hook_probe.record_unlisted")):
        conn.lrem(queue.key, 0, job.id)
        conn.hset(job.rq_job.key, mapping={"status": "started", "failure_callback_name": name})
        conn.zadd(queue.started_job_registry.key, {f"{job.id}:e0": 1})
        _streamed_a_token(conn, job.id)  # (one that streamed nothing goes back unfailed: no callback)
    cleaning = threading.Thread(target=worker.clean_registries, daemon=True)  # (off the main thread, as embedded)
    cleaning.start()
    cleaning.join(timeout=10)
    try:
        assert not cleaning.is_alive()  # (it waited for the callback, 30 s)
        deadline = time.monotonic() + 10
        while conn.get(f"hook-probe:{held.id}") != b"running" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conn.get(f"hook-probe:{held.id}") == b"running"  # (it ran: under SIGALRM off the main thread, never)
        assert held.status() == "queued" == unlisted.status()  # RQ's handling of the abandoned: a retry spent
        assert not conn.exists(f"hook-probe:{unlisted.id}")
        assert conn.hget(unlisted.rq_job.key, "failure_callback_name") == b"hook_probe.record_unlisted"  # kept
    finally:
        conn.set(f"hook-probe-release:{held.id}", 1)
        worker._callback_ends.shutdown(wait=True)


@pytest.mark.redis
def test_a_start_tried_again_gives_up_once_a_cold_stop_spent_its_patience(redis_url, monkeypatch):
    """A start whose Redis answered nothing was sent again for up to 20 s (half the heartbeat TTL), whatever the
    worker was told: a first SIGTERM's drain waits for the pull under way, so a cold stop took 34 s, not 15."""
    import redis

    import worker.batch_worker as batch_worker

    conn, worker, client = _worker_of_a_new_queue(redis_url, heartbeat_interval=30)
    job = client.submit("x", max_tokens=2)
    tries = []

    def unanswered(*args, **kwargs):
        tries.append(time.monotonic())
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    worker.sender.start_script = batch_worker.register_start_script(conn)  # (the Lua path, as a started worker's)
    monkeypatch.setattr(batch_worker, "queue_start", unanswered)
    worker._force_stop, worker.sender.give_up_at = True, time.monotonic() + 0.3
    started = time.monotonic()
    with pytest.raises(redis.exceptions.TimeoutError):
        worker.mark_started([(job.rq_job, worker.queues[0])], [job.id])
    assert time.monotonic() - started < 2 and len(tries) >= 2  # (tried again until then: a blip is waited out)


@pytest.mark.redis
def test_a_worker_thawed_after_another_took_its_name_over_stops_and_leaves_the_others_registration(redis_url):
    """A worker frozen past its heartbeat (SIGSTOP, a paused VM) was taken for dead and a new start took its name
    over; thawed, it ran on beside it under one name, one registration, one statistics key and one lease: either's
    stop unregistered both, and its events could go out under the other's lease. It stops at its next beat now,
    writing nothing of the other's, and each start has a lease of its own."""
    from rq import Worker

    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    name = f"w-{uuid.uuid4().hex[:8]}"
    conn, first, _ = _worker_of_a_new_queue(redis_url, name=name)
    first.register_birth()
    conn.delete(first.key)  # its registration lapsed while it was frozen

    class Engine:
        tokenizer = None

    settings = WorkerSettings(redis_url=redis_url, queue=first.queues[0].name, model="fake", name=name)
    second = BatchWorker(Engine(), settings, conn)
    second.register_birth()
    second.tokens = 12345  # (what its statistics say: the thawed one's beat wrote its own over them)
    second._heartbeat.beat()
    stats, registration = conn.hgetall(second.stats_key()), conn.hgetall(second.key)
    first._heartbeat.beat()  # thawed
    assert first.name_taken and first._force_stop and not second.name_taken
    assert conn.hgetall(second.stats_key()) == stats and conn.hgetall(second.key) == registration
    first._heartbeat.stop()
    assert conn.exists(second.stats_key()) and name in [w.name for w in Worker.all(connection=conn)]
    second._heartbeat.beat()
    assert not second.name_taken and first.start_token != second.start_token  # (each start's lease key has its own)


@pytest.mark.redis
def test_an_abandoned_job_deleted_before_its_failure_callback_ran_is_said_so(redis_url, caplog):
    """Its callback runs after the clean-up, on a callback thread: a job deleted meanwhile was logged as a callback
    that raised (NoSuchJobError's traceback)."""
    conn, worker, client = _worker_of_a_new_queue(redis_url, allow_callback=["hook_probe.record"])
    queue = worker.queues[0]
    job = client.submit("its worker died", max_tokens=2)
    conn.lrem(queue.key, 0, job.id)
    conn.hset(job.rq_job.key, mapping={"status": "started", "failure_callback_name": "hook_probe.record"})
    conn.zadd(queue.started_job_registry.key, {f"{job.id}:e0": 1})
    _streamed_a_token(conn, job.id)
    later: list = []
    worker.maintenance.run_callback = later.append
    worker.clean_registries()
    conn.delete(job.rq_job.key)
    with caplog.at_level("WARNING", logger="roseinfer.worker"):
        [run] = later
        run()
    assert "was deleted before its failure callback ran" in caplog.text and "Traceback" not in caplog.text
    assert not conn.exists(f"hook-probe:{job.id}")


def _streamed_a_token(conn, job_id: str) -> None:
    """What a dead worker streamed of the job: RQ's clean-up takes it (one that streamed nothing goes back)."""
    from producer.protocol import stream_key

    conn.xadd(stream_key(job_id), {"event": json.dumps({"v": 1, "n": 0, "text": "t", "token_ids": [0]})})


@pytest.mark.redis
def test_a_lane_before_every_job_held_is_pulled_past_twice_the_limit(redis_url):
    """A worker full past twice its limit (interactive jobs taken for the bulk ones held) took no more, an urgent
    lane's job too: it waited for an interactive job's whole run. A lane before every job held still comes in; one
    no better than the best held does not."""
    from types import SimpleNamespace

    _conn, worker, client = _worker_of_a_new_queue(redis_url, max_num_seqs=2)
    limit = worker.settings.in_flight_limit
    for i in range(2 * limit):
        worker.in_flight[f"held-{i}"] = SimpleNamespace(priority=0, job=None)
    same = client.submit("as urgent as those held", max_tokens=2)
    client.submit("more urgent than every job held", max_tokens=2, priority=-10)
    assert worker.puller._pull_once() and worker.puller._handed == 1
    [arrival] = worker.puller.unapplied()
    assert arrival.job.kwargs["priority"] == -10 and same.status() == "queued"


@pytest.mark.redis
def test_a_worker_counts_the_places_its_jobs_take_not_the_jobs(redis_url):
    """Five jobs of n = 8 went to one worker of 4 places (it counted jobs), run one after another while another
    worker sat idle. A job of n samples takes n places."""
    from types import SimpleNamespace

    _conn, worker, client = _worker_of_a_new_queue(redis_url, max_num_seqs=4)
    worker.in_flight["held"] = SimpleNamespace(priority=0, job=None, request=SimpleNamespace(n=8))
    waiting = client.submit("another", max_tokens=2)
    assert not worker.puller._pull_once() and waiting.status() == "queued"
    worker.in_flight["held"].request.n = 1
    assert worker.puller._pull_once() and worker.puller._handed == 1


@pytest.mark.redis
def test_a_burst_leaves_the_jobs_past_an_engines_places_to_the_fleet_for_a_while(redis_url, monkeypatch):
    """12 jobs on 3 idle workers of 8 places went 10, 1 and 1: the first look took its spare jobs (its in-flight
    limit's quarter past the engine's places) too, and two waited 9.8 s for a slot while the others sat idle. An
    idle look takes the engine's places; the spare ones come once it has been full ``SPARE_AFTER_S``, or at once for
    a lane before a job held."""
    from types import SimpleNamespace

    import worker.puller as puller

    _conn, worker, client = _worker_of_a_new_queue(redis_url, max_num_seqs=8)
    assert worker.settings.in_flight_limit == 10
    client.submit_many([{"prompt": f"burst {i}", "max_tokens": 2} for i in range(12)])
    assert worker.puller._pull_once() and worker.puller._handed == 8  # idle: the engine's places
    for arrival in worker.puller.unapplied():  # (as the step loop takes them in)
        worker.in_flight[arrival.job.id] = SimpleNamespace(priority=0, job=None)
    worker.puller._taken = worker.puller._handed
    worker.puller._unapplied.clear()
    assert not worker.puller._pull_once()  # full just now: the 4 others wait for the fleet's other workers
    urgent = client.submit("urgent", max_tokens=2, priority=-5)
    worker._refresh_lanes()  # (its lane found, as the worker's loop finds a new one)
    worker.puller._next_pull = 0.0  # (a pull is due: the sender, not running here, would have seen the job)
    assert worker.puller._pull_once() and [a.job.id for a in worker.puller.unapplied()] == [urgent.id]
    worker.in_flight[urgent.id] = SimpleNamespace(priority=-5, job=None)
    worker.puller._taken = worker.puller._handed
    worker.puller._unapplied.clear()
    monkeypatch.setattr(puller, "SPARE_AFTER_S", 0.0)  # full a while: the spare places fill
    worker.puller._next_pull = 0.0
    assert worker.puller._pull_once() and worker.puller._handed == 10
    # A worker running one job, not full: a burst fills its places, not its spare ones (it took 9 of 12).
    _conn, busy, client = _worker_of_a_new_queue(redis_url, max_num_seqs=8)
    busy.in_flight["running"] = SimpleNamespace(priority=0, job=None)
    client.submit_many([{"prompt": f"burst {i}", "max_tokens": 2} for i in range(12)])
    assert busy.puller._pull_once() and busy.puller._handed == 7


@pytest.mark.redis
def test_a_due_job_canceled_by_hand_is_ended_once(redis_url):
    """The first look after a worker takes the scheduler lock reads the due ids and walks the registry too: a due
    job canceled by hand was in both, and ended twice (two last events, two pushes to its completion list)."""
    from datetime import datetime, timedelta, timezone

    from rq import Queue
    from rq.serializers import JSONSerializer

    from producer.protocol import JOB_FUNCTION, stream_key
    from worker.due_retries import DueRetries

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    worker.sender._load_scripts()  # (RQ's scheduler lock is a script)
    queue = Queue(client.queue.name, connection=conn, serializer=JSONSerializer)
    notify = f"once-{uuid.uuid4().hex[:8]}"
    due = datetime.now(timezone.utc) - timedelta(seconds=5)
    job = queue.enqueue_at(due, JOB_FUNCTION, kwargs={"prompt": "x", "notify": notify})
    conn.hset(job.key, "status", "canceled")
    DueRetries(worker).enqueue()
    assert conn.lrange(f"roseinfer:done:{notify}", 0, -1) == [job.id.encode()]
    ends = [json.loads(f[b"event"]) for _, f in conn.xrange(stream_key(job.id))]
    assert [e["finish_reason"] for e in ends] == ["abort"] and conn.llen(queue.key) == 0


def _worker_of_a_new_queue(redis_url: str, **settings):
    """A worker (no engine: what it writes is under test) of a queue of its own: (connection, worker, its client)."""
    import uuid

    from redis import Redis

    from producer import Client
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake", **settings), conn)
    return conn, worker, Client(redis_url, queue=name)


def _running_jobs(redis_url: str, count: int = 1, **fields):
    """A worker of a new queue (no engine: its ends and registries are under test) that pulled and started ``count``
    jobs of ``fields``, each in flight: (connection, worker, queue name, the jobs in flight)."""
    import uuid

    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from producer.schema import JobRequest
    from worker.batch_worker import BatchWorker, InFlight
    from worker.intake import pull
    from worker.publisher import JobStream
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    payload = {"prompt": "hello", "max_tokens": 4, **fields}
    Client(redis_url, queue=name).submit_many([payload] * count)
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    pulled, _ = pull([worker.queues[0]], count, None, conn, Job, JSONSerializer)
    executions, _ = worker.mark_started(pulled)
    held = []
    for (job, queue), execution in zip(pulled, executions):
        stream = JobStream(job.id, owner=execution.id)
        held.append(InFlight(job, queue, execution, JobRequest.model_validate(payload), stream, 0.0))
        worker.in_flight[job.id] = held[-1]
    return conn, worker, name, held


def test_a_copy_of_a_running_job_started_before_the_loop_knew_it_runs_is_dropped_not_fatal(redis_url):
    """A running job's copy that the puller started (a new execution: its own registry entry, the job's owner) in the
    moment a read-again of another copy left open: the engine refused a job already in flight, and the worker died
    of it, handing every job back. The running attempt goes on, the job its own again, the copy's records gone."""
    from producer.protocol import OWNER_FIELD
    from worker.puller import Arrival

    conn, worker, _, [held] = _running_jobs(redis_url)
    [copy_execution], _ = worker.mark_started([(held.job, held.queue)])
    assert conn.hget(held.job.key, OWNER_FIELD).decode() == copy_execution.id  # (the copy owns it now)
    copy = Arrival(held.job, held.queue, copy_execution, held.stream, held.request)
    started: list[str] = []
    assert worker._apply_arrival(copy, time.time(), started) == [] and started == []
    assert worker.in_flight == {held.job.id: held}
    assert conn.hget(held.job.key, OWNER_FIELD).decode() == held.execution.id
    registry = held.queue.started_job_registry
    entries = registry.get_job_and_execution_ids()
    assert entries == [(held.job.id, held.execution.id)]  # (the copy's entry would lapse: RQ failed a running job)
    assert not conn.exists(copy_execution.key)


def test_a_jobs_unset_sampling_fields_take_the_models_recommended_defaults():
    """As vLLM's server: the model's generation config fills what the payload leaves unset; what it sets wins."""
    from producer.schema import JobRequest
    from worker.jobs import sampling_params

    defaults = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    unset = sampling_params("j1", JobRequest.model_validate({"prompt": "x"}), defaults)
    assert (unset.temperature, unset.top_k, unset.repetition_penalty, unset.max_tokens) == (0.7, 20, 1.05, 64)
    assert unset.seed is not None  # sampled (at the model's temperature): a seed of its own, for its retries
    payload = {"prompt": "x", "temperature": 0, "max_tokens": 5}
    given = sampling_params("j2", JobRequest.model_validate(payload), defaults)
    assert (given.temperature, given.max_tokens, given.top_k, given.seed) == (0.0, 5, 20, None)
    assert sampling_params("j3", JobRequest.model_validate({"prompt": "x"})).temperature == 1.0  # none: the API's
    # A writer that sends every field sends max_tokens null: unset, as the producers' (which leave it out) and vLLM's
    null = sampling_params("j4", JobRequest.model_validate({"prompt": "x", "max_tokens": None}), defaults)
    assert null.max_tokens == 64


def test_a_recommendable_setting_given_at_its_default_value_reaches_the_worker_and_wins():
    """``submit(temperature=1.0, top_k=0, repetition_penalty=1.0)`` sent a payload without them (defaults were left
    out), so the worker ran the model's 0.7, 20 and 1.05: a model's recommendation could not be turned off."""
    from producer import Client
    from producer.schema import MODEL_RECOMMENDED, JobRequest
    from roseinfer.model_loader import _SAMPLING_DEFAULTS
    from worker.jobs import sampling_params

    assert set(_SAMPLING_DEFAULTS.values()) <= MODEL_RECOMMENDED  # (the engine's list and the producer's agree)
    conn = fakeredis.FakeRedis()
    job = Client(connection=conn, queue="rec").submit("x", temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    payload = job.rq_job.kwargs
    assert {k: payload.get(k) for k in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "min_p": None}  # fmt: skip
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.1}
    params = sampling_params(job.id, JobRequest.model_validate(payload), defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert params.min_p == 0.1  # (not given: the model's)


def test_a_recommended_setting_the_engine_refuses_is_left_out_of_the_defaults():
    """Taken, it would fail every job that leaves that field unset, as if the job were at fault."""
    from transformers import GenerationConfig

    from roseinfer.model_loader import sampling_defaults

    config = GenerationConfig(do_sample=True, temperature=7.0, repetition_penalty=1.05, top_k=20)
    assert sampling_defaults(config) == {"top_k": 20, "repetition_penalty": 1.05}


def test_a_json_schema_response_format_without_its_schema_asks_for_any_json_object():
    """``schema`` is optional in OpenAI's API (and vLLM's): its absence was a 400, 'Field required'."""
    from producer.schema import JobRequest, ResponseFormat

    bare = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "anything"}})
    assert bare.engine_form() == {"json_object": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    given = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert given.engine_form() == {"json": schema}
    job = JobRequest.model_validate({"prompt": "x", "response_format": bare.model_dump(by_alias=True)})
    assert job.structured_form() == {"json_object": True}


def test_an_async_client_given_a_connection_without_its_url_is_refused():
    """Its reads went to the default URL's server: streams failed and result() timed out on the caller's jobs."""
    from producer.aio import AsyncClient

    with pytest.raises(TypeError, match="needs the redis_url of that connection's server"):
        AsyncClient(connection=fakeredis.FakeRedis())


def test_an_async_client_takes_a_burst_of_commands_past_redis_pys_pool_size(redis_url):
    """A server's burst of requests puts a command per request in flight at once: redis-py 8's pool refused the
    101st ("Too many connections", each such request a 503 saying Redis was unavailable). Past the client's
    connections, a command waits for one."""
    import asyncio

    from producer.aio import AsyncClient

    async def burst() -> list:
        client = AsyncClient(redis_url, queue="burst")
        try:  # twice the client's own bound (256 connections)
            return await asyncio.gather(*(client.job(f"none-{i}").status() for i in range(512)), return_exceptions=True)
        finally:
            await client.close()

    assert asyncio.run(burst()) == ["missing"] * 512


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_a_client_shared_by_more_than_a_hundred_threads_follows_every_job(redis_url):
    """A service's thread pool sharing one Client holds a connection per blocked read: redis-py 8's pool refused the
    101st ("Too many connections"), which the follower took for Redis being down. Threads bound the connections."""
    import threading

    from producer import Client

    client = Client(redis_url, queue="threads-past-100")  # no worker: every job stays queued
    jobs = client.submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(150)])
    outcomes: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def follow(i: int) -> None:
        start.wait()
        try:
            list(jobs[i].events(timeout=0.5))  # each XREAD blocks on a connection of its own till then
        except Exception as exc:  # the outcome is what is compared
            outcomes[i] = type(exc).__name__

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert outcomes == ["TimeoutError"] * len(jobs)
    client.connection.close()


def test_one_job_id_twice_in_one_submit_many_is_refused():
    """Two payloads under one id made one job (the second's), and two handles on it."""
    from producer import Client, InvalidRequest

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    with pytest.raises(InvalidRequest, match="request 1: job id 'a' is given twice"):
        client.submit_many([{"prompt": "x", "job_id": "a"}, {"prompt": "y", "job_id": "a"}])
    assert client.connection.llen("rq:queue:q") == 0


@pytest.mark.parametrize(
    ("message", "waits"),
    [
        ("BUSY Redis is busy running a script.", True),
        ("Command # 3 (EVALSHA abc 0) of pipeline caused error: BUSY Redis is busy running a script.", True),
        ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", True),
        ("Error running script (call to f_abc): @user_script:1: @user_script: 1: -OOM command not allowed", True),
        ("Error running script (call to f_abc): @user_script:3: -READONLY You can't write against a read only", True),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
        ("ERR unknown command 'FOO'", False),
    ],
)
def test_redis_refusing_for_now_is_waited_for_and_other_errors_are_not(message, waits):
    """A failed snapshot (MISCONF: a full disk) and Redis 6.2's refusals inside a script were taken for errors of the
    writes: the sender dropped events and ends, and the step loop's next write stopped the worker."""
    import redis

    from producer.connection import redis_waits

    assert redis_waits(redis.exceptions.ResponseError(message)) is waits


def test_an_id_used_again_after_its_hash_is_gone_does_not_stream_the_old_jobs_text():
    """The old job's hash gone (result_ttl 0, or under the stream's ten minutes; RQ's delete()) and its stream left:
    the new job's stream replayed the old events, final one included, while the new job was still queued."""
    from producer import Client

    conn = fakeredis.FakeRedis()
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    _stream_with(conn, pub, [("OLD ", [1])])
    old = pub.resume(conn, ["j"])["j"]
    pub.add(old, "TEXT", [2], "stop", {})
    _send(conn, pub)
    assert conn.exists(stream_key("j")) and not conn.exists("rq:job:j")
    job = Client(connection=conn, result_ttl=0).submit("new prompt", job_id="j")
    assert job.status() == "queued" and not conn.exists(stream_key("j"))
    with pytest.raises(TimeoutError):
        list(job.stream(timeout=0.3))  # nothing yet: the new job has not run


@pytest.mark.parametrize("status", ["queued", "started", "deferred", "scheduled"])
@pytest.mark.parametrize("many", [False, True])
def test_an_id_of_a_job_still_queued_or_running_is_refused_and_the_job_left_as_it_was(many, status):
    """Enqueued again, the live job's payload was written over and its id pushed twice: both callers got the first
    job's result and the second request was lost without a word."""
    from producer import Client
    from producer.job_errors import InvalidRequest

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn)
    first = client.submit("first", job_id="order-1", max_tokens=400)
    conn.hset(first.rq_job.key, "status", status)
    data = conn.hget(first.rq_job.key, "data")
    with pytest.raises(InvalidRequest, match=f"'order-1' is taken by a job that is {status}"):
        if many:
            client.submit_many([{"prompt": "other", "job_id": "fresh"}, {"prompt": "second", "job_id": "order-1"}])
        else:
            client.submit("second", job_id="order-1", max_tokens=5)
    assert conn.lrange("rq:queue:roseinfer", 0, -1) == [b"order-1"] and not conn.exists("rq:job:fresh")
    assert conn.hget(first.rq_job.key, "data") == data and conn.hget(first.rq_job.key, "status") == status.encode()
    conn.hset(first.rq_job.key, "status", "canceled")  # once it ended, the id is free again
    assert client.submit("second", job_id="order-1").status() == "queued"


@pytest.mark.parametrize("many", [False, True])
def test_an_id_of_a_canceled_job_whose_run_still_stops_is_refused_until_its_worker_ends_it(many):
    """A running job's cancel sets its status at once; its worker stops the run within a step. Submitted again in
    between, the new job was taken by that worker for its running copy: the old request ran on under the new job,
    its tokens streamed to the new job's followers, and the new request was never run."""
    from rq.registry import StartedJobRegistry

    from producer import Client
    from producer.job_errors import JobIdTaken
    from producer.protocol import OWNER_FIELD

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn)
    first = client.submit("first", job_id="order-1", max_tokens=400)
    started = StartedJobRegistry("roseinfer", connection=conn).key
    conn.lpop("rq:queue:roseinfer")  # (pulled by a worker, which runs it under its execution)
    conn.hset(first.rq_job.key, mapping={"status": "canceled", OWNER_FIELD: "exec-1"})  # (the cancel's, as RQ's)
    conn.zadd(started, {"order-1:exec-1": time.time() + 60})
    with pytest.raises(JobIdTaken, match="'order-1' is taken by a job that is canceled, its run still stopping"):
        if many:
            client.submit_many([{"prompt": "other", "job_id": "fresh"}, {"prompt": "second", "job_id": "order-1"}])
        else:
            client.submit("second", job_id="order-1")
    assert conn.llen("rq:queue:roseinfer") == 0 and not conn.exists("rq:job:fresh")
    conn.zadd(started, {"order-1:exec-0": time.time() + 60})  # (an earlier attempt's entry: not this run's)
    conn.zrem(started, "order-1:exec-1")  # its worker ended the run
    assert client.submit("second", job_id="order-1").status() == "queued"


def test_a_job_of_the_id_enqueued_between_the_look_and_the_write_makes_the_second_submit_refused(monkeypatch):
    """Two producers giving one id at once: the look saw no job, another client's enqueue came next; the watched
    transaction fails and the look again refuses the id instead of writing over the other job."""
    from producer import Client
    from producer.job_errors import InvalidRequest

    conn = fakeredis.FakeRedis()
    client, other = Client(connection=conn), Client(connection=conn)
    looked = Client._ended
    calls = []

    def ended_then_raced(self, job_ids):
        found = looked(self, job_ids)
        if self is client and not calls:
            calls.append(job_ids)
            other.submit("other's", job_id="same")
        return found

    monkeypatch.setattr(Client, "_ended", ended_then_raced)
    with pytest.raises(InvalidRequest, match="'same' is taken by a job that is queued"):
        client.submit("mine", job_id="same")
    assert calls == [["same"]] and conn.lrange("rq:queue:roseinfer", 0, -1) == [b"same"]


@pytest.mark.parametrize("many", [False, True])
def test_an_id_used_again_leaves_no_registry_entry_or_field_of_the_old_job(many):
    """The old job failed (or finished, or was canceled): its id stayed in that registry, so the new job was counted
    failed and queued at once (RQ's requeue of the failed ones ran it again), and fields the enqueue does not write
    stayed (its retries left, its meta: a client without retries inherited them). The field naming the attempt that
    owns the job stays: it fences off the old job's run."""
    from producer import Client
    from producer.protocol import OWNER_FIELD

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn, retries=0)
    old = Client(connection=conn, retries=3).submit("old", job_id="row1")
    conn.lpop("rq:queue:roseinfer")  # a worker ran it, and it failed with retries left
    conn.hset(old.rq_job.key, mapping={"status": "failed", "meta": "{}", OWNER_FIELD: "attempt-1"})
    for registry in ("failed", "finished", "canceled"):
        conn.zadd(f"rq:{registry}:roseinfer", {"row1": time.time() + 3600})
    new = client.submit_many([{"prompt": "new", "job_id": "row1"}])[0] if many else client.submit("new", job_id="row1")
    assert new.status() == "queued" and client.status()["failed"] == 0
    for registry in ("failed", "finished", "canceled"):
        assert conn.zscore(f"rq:{registry}:roseinfer", "row1") is None, registry
    fields = conn.hgetall(new.rq_job.key)
    assert b"retries_left" not in fields and b"meta" not in fields and fields[OWNER_FIELD.encode()] == b"attempt-1"
    assert new.rq_job.kwargs["prompt"] == "new"


def test_a_redis_never_reached_is_an_error_at_once_and_one_that_went_away_is_waited_for(monkeypatch):
    """``roseinfer result ID`` with a wrong URL waited 30 s (the patience with a Redis restarting) before it said so;
    ``stream()`` gave up at once on a Redis that went away (its first read was not waited out)."""
    import threading
    import time

    import redis

    import producer.event_reading as event_reading
    from producer import Client

    never = Client("redis://127.0.0.1:1/0").job("x")
    began = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        never.result(timeout=None)
    assert time.monotonic() - began < 5
    monkeypatch.setattr(event_reading, "REDIS_PATIENCE_S", 10.0)
    server = fakeredis.FakeServer()
    client = Client(connection=fakeredis.FakeRedis(server=server))
    job = client.submit("hello", job_id="w")
    conn = fakeredis.FakeRedis(server=server)
    pub = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60)
    s = pub.resume(conn, ["w"])["w"]
    pub.add(s, "back", [1], "stop", {})
    _send(conn, pub)
    server.connected = False  # Redis restarting: back in half a second
    threading.Timer(0.5, lambda: setattr(server, "connected", True)).start()
    assert "".join(job.stream(timeout=10)) == "back"


@pytest.mark.slow  # seconds of tokens and outages: the full suite's
@pytest.mark.redis
def test_an_async_follower_has_its_whole_patience_for_each_outage_not_one_for_all(redis_url, monkeypatch):
    """The async follower's patience with an outage restarted only after a look at the job, never after events the
    stream reader brought: with tokens flowing after a first outage, a second one a patience later raised at once
    (the server's streams died a second into it). The sync follower restarts it after every read."""
    import asyncio
    import json

    import redis
    from redis import Redis

    import producer.aio as aio_mod
    import producer.event_reading as event_reading
    from producer import AsyncClient
    from producer.protocol import stream_key

    monkeypatch.setattr(event_reading, "REDIS_PATIENCE_S", 1.0)
    conn = Redis.from_url(redis_url)
    job_id = f"outages-{uuid.uuid4().hex[:8]}"
    conn.hset(f"rq:job:{job_id}", "status", "started")
    failing, failures = [False], [0]
    status = aio_mod.AsyncGenerationJob.status

    async def status_or_outage(self):  # a Redis restart as the follower's look at the job meets it
        if failing[0]:
            failures[0] += 1
            raise redis.exceptions.ConnectionError("Redis restarting")
        return await status(self)

    monkeypatch.setattr(aio_mod.AsyncGenerationJob, "status", status_or_outage)

    def add(n: int, final: bool = False) -> None:
        event = {"n": n, "text": f"t{n}", "token_ids": [n], **({"finish_reason": "stop", "usage": {}} if final else {})}
        conn.xadd(stream_key(job_id), {"event": json.dumps(event)})

    async def outage() -> None:
        failing[0], before = True, failures[0]
        while failures[0] == before:  # (no event for a second: the follower looks at the job)
            await asyncio.sleep(0.01)
        failing[0] = False

    async def follow_through_two_outages() -> list[str]:
        async with AsyncClient(redis_url, queue="outages") as client:
            got: list[str] = []

            async def follow() -> None:
                async for event in client.job(job_id).events(timeout=60):
                    got.append(event["text"])

            followed = asyncio.create_task(follow())
            add(0)
            while not got:
                await asyncio.sleep(0.01)
            await outage()
            for n in range(1, 16):  # tokens for longer than the patience
                add(n)
                await asyncio.sleep(0.1)
            await outage()  # the second outage: its own patience
            add(16, final=True)
            await asyncio.wait_for(followed, 30)
            return got

    try:
        assert asyncio.run(follow_through_two_outages()) == [f"t{n}" for n in range(17)]
    finally:
        conn.delete(f"rq:job:{job_id}", stream_key(job_id))


@pytest.mark.redis
def test_closing_either_client_closes_its_connections_and_stops_its_stream_reader(redis_url):
    """``Client`` had no close (nor ``with``), only AsyncClient did; and AsyncClient's close left its stream reader
    reading, on connections opened again, and a follower of a job that never ended waiting for good."""
    import asyncio

    from redis import Redis

    from producer import AsyncClient, Client
    from producer.protocol import stream_key

    name = f"closing-{uuid.uuid4().hex[:8]}"
    mine = Redis.from_url(redis_url)
    with Client(redis_url, queue="closing") as client:
        client.connection.client_setname(name)
        assert name in [c["name"] for c in mine.client_list()]
    deadline = time.monotonic() + 5  # (the server drops it once it reads the close: a moment later, under load)
    while name in [c["name"] for c in mine.client_list()]:  # its connection closed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    Client(connection=mine).close()
    assert mine.ping()  # a connection passed in is the caller's

    job_id = f"closing-{uuid.uuid4().hex[:8]}"
    mine.hset(f"rq:job:{job_id}", "status", "started")
    mine.xadd(stream_key(job_id), {"event": json.dumps({"n": 0, "text": "t0", "token_ids": [0]})})

    async def close_while_following() -> None:
        client = AsyncClient(redis_url, queue="closing")
        got: list[dict] = []

        async def follow() -> None:
            async for event in client.job(job_id).events(timeout=None):
                got.append(event)

        followed = asyncio.create_task(follow())
        waited = asyncio.create_task(client.job(job_id).result(timeout=None))
        while not got or len(client.hub._by_key.get(stream_key(job_id), {})) < 2:  # (both follow it, Redis found)
            await asyncio.sleep(0.01)
        reader = client.hub._task
        await client.close()
        assert reader.done()
        for task in (followed, waited):  # (the result's wait polled on, on connections opened again)
            with pytest.raises(RuntimeError, match="closed"):
                await asyncio.wait_for(task, 5)

    try:
        asyncio.run(close_while_following())
    finally:
        mine.delete(f"rq:job:{job_id}", stream_key(job_id))


@pytest.mark.redis
def test_maintenance_takes_ids_whose_job_is_gone_out_of_the_canceled_registry(redis_url):
    """A canceled job's hash expires (after --result-ttl), and RQ cleans no canceled registry: ids of jobs long gone
    piled up there for good, counted by ``rq info``. Those whose hash is still there stay, whatever their score (RQ's
    own cancel scores its entry "now")."""
    from rq.registry import CanceledJobRegistry

    conn, worker, _client = _worker_of_a_new_queue(redis_url)
    key = CanceledJobRegistry(worker.queues[0].name, connection=conn).key
    kept = f"kept-{worker.queues[0].name}"
    conn.hset(f"rq:job:{kept}", "status", "canceled")
    conn.zadd(key, {"gone-1": 1, "gone-2": 9e12, kept: 1})
    try:
        worker.clean_registries()
        assert [m.decode() for m in conn.zrange(key, 0, -1)] == [kept]
    finally:
        conn.delete(f"rq:job:{kept}", key)


def test_the_servers_tokenizers_come_from_redis_once_and_tokens_go_by_id_without_one(monkeypatch):
    """The server names logprobs' tokens with the tokenizer a worker wrote to Redis (by the digest in its
    statistics); none named, none there, or one that does not parse: by id, and looked for again a minute later."""
    from types import SimpleNamespace

    from producer.protocol import TOKENIZER_KEY, tokenizer_digest
    from producer.token_names import BY_ID, TokenizerCache
    from roseinfer.tiny_models import build_tiny_tokenizer

    text = build_tiny_tokenizer().backend_tokenizer.to_str()
    digest = tokenizer_digest(text)

    async def main():
        conn = fakeredis.aioredis.FakeRedis()
        cache = TokenizerCache(SimpleNamespace(connection=conn))
        assert await cache.names(None) is BY_ID and BY_ID(7) == "token_id:7" and BY_ID.bytes(7) is None
        assert await cache.names(digest) is BY_ID  # not written yet
        await conn.set(TOKENIZER_KEY.format(digest=digest), text)
        assert await cache.names(digest) is BY_ID  # a minute before it is looked for again
        monkeypatch.setattr(TokenizerCache, "RETRY_S", 0.0)
        names = await cache.names(digest)
        assert names is not BY_ID and await cache.names(digest) is names  # read once
        await conn.set(TOKENIZER_KEY.format(digest="broken"), "{not json")
        assert await cache.names("broken") is BY_ID
        return names

    names = asyncio.run(main())
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("hello world")["input_ids"]
    assert [names(t) for t in ids] == [tokenizer.decode([t]) for t in ids]
    assert names.bytes(ids[0]) == list(names(ids[0]).encode())


def test_events_and_results_with_fields_a_newer_worker_adds_are_read_and_resumed_from():
    """A newer worker adds fields within a protocol version (``error_code``, say). A client and a worker deployed
    before it went on to call its jobs off the protocol (``ProtocolError``; a retried job started over): they read
    them now, as OpenAI's clients read responses with fields they do not know. A known field of the wrong type is
    still off the protocol."""
    from producer import Client
    from producer.job_errors import ProtocolError
    from producer.protocol import encode_result, result_key

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn)
    job = client.submit("a", max_tokens=2)
    newer = [{**make_event(0, "Hel", [1, 2]), "novel": {"x": 1}}, make_event(1, "lo", [3], "stop", {"total_tokens": 3})]
    conn.xadd(stream_key(job.id), {STREAM_FIELD: json.dumps(newer[0])})
    s = Publisher(maxlen=1000, stream_ttl=60, result_ttl=60).resume(conn, [job.id])[job.id]
    assert (s.next_n, s.whole) == (1, True)  # a retry resumes from it: not a start over
    conn.xadd(stream_key(job.id), {STREAM_FIELD: json.dumps(newer[1])})
    result = {"v": 3, "id": job.id, "status": "finished", "finish_reason": "stop", "text": "Hello", "novel": 1,
              "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4, "cached_tokens": 0}}  # fmt: skip
    conn.xadd(result_key(job.id), {"type": 1, "return_value": encode_result(result)})
    conn.hset(f"rq:job:{job.id}", "status", "finished")
    assert "".join(job.stream(timeout=5)) == "Hello" and job.result(timeout=5)["text"] == "Hello"

    other = client.submit("b", max_tokens=2)
    conn.xadd(result_key(other.id), {"type": 1, "return_value": encode_result({**result, "id": other.id, "text": 5})})
    conn.hset(f"rq:job:{other.id}", "status", "finished")
    with pytest.raises(ProtocolError, match="text"):
        other.result(timeout=5)


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
def test_a_client_of_a_redis_that_answers_nothing_gives_up_instead_of_waiting_for_good(monkeypatch):
    """A Redis that accepts and answers nothing (SIGSTOPped, a failover's old primary gone without a reset): with
    redis-py before 8 (``redis>=6`` is allowed) a client's reads had no socket timeout, and ``result(timeout=1)``,
    sync or async, waited for good. They time out as redis-py 8's do now (here after 0.5 s, not 5)."""
    import asyncio
    import socket
    import threading

    import redis

    from producer import AsyncClient, Client, connection

    monkeypatch.setitem(connection._TIMEOUTS, "socket_timeout", 0.5)

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(silent.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    url = f"redis://127.0.0.1:{silent.getsockname()[1]}"

    async def async_result() -> None:
        client = AsyncClient(url)
        try:
            await client.job("x").result(timeout=1)
        finally:
            await client.close()

    try:
        for wait in (lambda: Client(url).job("x").result(timeout=1), lambda: asyncio.run(async_result())):
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                wait()
            assert time.monotonic() - started < 3
    finally:
        for sock in [silent, *held]:
            sock.close()


def test_a_step_handing_work_to_a_sender_thread_that_stopped_hears_why_instead_of_waiting_for_good(monkeypatch):
    """The sender thread stopped (a bug, an allowed callback raising SystemExit) with its queue full: ``put`` looked
    at the error only before its wait for room, and the step loop waited for good while the jobs' heartbeats kept
    them claimed."""
    import threading

    from worker.sender import Batch, Sender

    conn = fakeredis.FakeRedis()
    sender = Sender(conn, Publisher(100, 60, 60), lambda ended, registered: None, max_pending=1)
    entered, release = threading.Event(), threading.Event()

    def stops(batches):
        entered.set()
        release.wait(5)
        raise SystemExit("a callback's exit")

    monkeypatch.setattr(sender, "_send_until_done", stops)
    sender.start()
    sender.put(Batch(tasks=[lambda: None]))
    assert entered.wait(5)
    sender.put(Batch(tasks=[lambda: None]))  # the queue is full now: the next waits for room
    outcome: list[BaseException] = []

    def step() -> None:
        try:
            sender.put(Batch(tasks=[lambda: None]))
        except BaseException as exc:
            outcome.append(exc)

    stepping = threading.Thread(target=step, daemon=True)
    stepping.start()
    time.sleep(0.3)
    release.set()  # the sender thread stops
    stepping.join(5)
    assert not stepping.is_alive() and isinstance(outcome[0], SystemExit)


def test_a_timeout_is_rqs_job_timeout_exception_with_its_own_message():
    """A failure callback or exception handler matching RQ's JobTimeoutException missed the worker's timeouts; and
    RQ's timer death penalty rewrites the message of the class it raises, which must not reach ours."""
    from rq.timeouts import JobTimeoutException, TimerDeathPenalty

    from worker.jobs import JobTimedOut

    TimerDeathPenalty(3, JobTimeoutException)  # (as RQ's callbacks set one up: the class's message rewritten)
    error = JobTimedOut("job exceeded its timeout of 1 s")
    assert isinstance(error, JobTimeoutException) and str(error) == "job exceeded its timeout of 1 s"


@pytest.mark.redis
def test_a_failure_rq_retries_is_logged_as_retried(redis_url, caplog):
    """ "job ... failed: job exceeded its timeout" of a job RQ then retried: counted as a failure by anyone counting
    the log's failures (the metric said retried)."""
    from worker.jobs import JobTimedOut

    _conn, worker, client = _worker_of_a_new_queue(redis_url)
    error = JobTimedOut("job exceeded its timeout of 1 s")
    for retries, said in [(2, "(retried: 1 retries left after this one)"), (None, "timeout of 1 s\n")]:
        job = client.submit("x", max_tokens=2).rq_job
        job.retries_left = retries
        caplog.clear()
        with caplog.at_level("WARNING", logger="roseinfer.worker"):
            worker.handle_exception(job, JobTimedOut, error, None)
        assert f"job {job.id} failed: job exceeded its timeout of 1 s" in caplog.text and said in caplog.text + "\n"


def test_the_metrics_read_the_queue_depth_at_the_scrape_and_say_when_redis_did_not_answer():
    from types import SimpleNamespace

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from worker.metrics import _depths

    lane = SimpleNamespace(name="q", key="rq:queue:q")
    refused = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))  # (at once)
    dead = SimpleNamespace(connection=refused, lane_depths=lambda: [(0, lane, 3)])
    assert _depths(dead) == ([("q", 3)], False)  # the sender's last reading, and Redis down
    conn = fakeredis.FakeRedis()
    conn.rpush("rq:queue:q", "a", "b")
    live = SimpleNamespace(connection=conn, lane_depths=lambda: [(0, lane, 0)])
    assert _depths(live) == ([("q", 2)], True)


def test_a_payloads_words_in_its_refusal_are_one_bounded_line():
    """A refusal quotes the payload: a field named with a newline forged a line of the worker's log, and a 100 KB
    logit_bias key came back whole in the result (kept for a year)."""
    from pydantic import ValidationError

    from producer.schema import describe_validation_error

    for payload, shown in (
        ({"prompt": "x", "colour\nFORGED: x": 1}, "colour\\nFORGED: x: unknown field"),
        ({"prompt": "x", "logit_bias": {"a" * 100_000: 1}}, "got 'aaa"),
    ):
        with pytest.raises(ValidationError) as refused:
            JobRequest.model_validate(payload)
        reason = describe_validation_error(refused.value)
        assert shown in reason and "\n" not in reason and len(reason) < 600


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        ({"prompt": "x", "MaxTokens": 3}, "MaxTokens: unknown field"),
        ({"prompt": "x", "str": 1}, "str: unknown field"),
        ({"messages": [{"role": "user", "content": "x", "Name": "y"}]}, "messages.0.Name: unknown field"),
    ],
)
def test_an_unknown_field_is_named_whatever_it_looks_like(payload, said):
    """A name like a type (``str``) or capitalized (a C# or Go producer's ``MaxTokens``) was taken for pydantic's
    union member and left out: "payload: unknown field", no hint which."""
    from pydantic import ValidationError

    from producer.schema import describe_validation_error

    with pytest.raises(ValidationError) as refused:
        JobRequest.model_validate(payload)
    assert describe_validation_error(refused.value) == said


def test_data_that_is_not_utf8_is_said_so_and_pickled_data_is_said_to_be_pickle():
    """JSON data with a byte that is not UTF-8 was asked whether it was enqueued with the pickle serializer; gzip
    data (Node's gzipSync, not the zlib format the protocol names) was said not to be UTF-8."""
    import gzip
    import pickle

    from rq.job import Job
    from rq.serializers import JSONSerializer

    from worker.jobs import JobRejected, parse_request

    conn = fakeredis.FakeRedis()
    for data, said in (
        (b'["worker.jobs.generate", null, [], {"prompt": "\xff"}]', "the job's data is not UTF-8 text"),
        (pickle.dumps(("worker.jobs.generate", None, (), {})), "was it enqueued with the pickle serializer?"),
        (gzip.compress(b'["worker.jobs.generate", null, [], {"prompt": "hi"}]'), "the job's data is gzip: compress"),
    ):
        job = Job("x", connection=conn, serializer=JSONSerializer)
        job.data = data
        with pytest.raises(JobRejected, match=re.escape(said)):
            parse_request(job)


def test_a_job_canceled_while_it_waits_for_its_retry_keeps_what_its_earlier_attempt_streamed():
    """A worker died mid-output, RQ's clean-up queued the job again for its retry, and its client canceled it there:
    the result said "canceled before it ran", with no text, and the final event said 0 tokens after the 3 the stream
    held. What was streamed stays the output (as a running job's cancel keeps it), every sample's; the stream goes
    when the result does, not 600 s later."""
    from producer import Client, JobCanceled
    from producer.protocol import make_event, stream_key

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn, result_ttl=30)
    job = client.submit("hi", n=2)
    pieces = [make_event(0, "Hel", [1]), make_event(1, "A", [7], index=1), make_event(2, "lo", [2, 3])]
    for event in pieces:  # the earlier attempt's, no final event: it died
        conn.xadd(stream_key(job.id), {"event": json.dumps(event)})
    assert job.cancel()
    with pytest.raises(JobCanceled) as err:
        job.result(timeout=1)
    result = err.value.result
    assert (result["text"], result["token_ids"], result["usage"]["completion_tokens"]) == ("Hello", [1, 2, 3], 4)
    assert [(c["index"], c["text"]) for c in result["choices"]] == [(0, "Hello"), (1, "A")]
    assert conn.hget(job.rq_job.key, "roseinfer_owner") == b"roseinfer-client"  # (a stalled attempt: fenced off)
    last = json.loads(conn.xrevrange(stream_key(job.id), count=1)[0][1][b"event"])
    assert (last["n"], last["finish_reason"], last["usage"]["completion_tokens"]) == (3, "abort", 4)
    pieces = []
    with pytest.raises(JobCanceled, match="what it made first"):
        pieces.extend(job.stream(timeout=1))
    assert "".join(pieces) == "Hello" and 0 < conn.ttl(stream_key(job.id)) <= 30
    # An earlier attempt that ended (an error, then queued again by hand): its output is void, the abort a reset.
    again = client.submit("there")
    conn.xadd(stream_key(again.id), {"event": json.dumps(make_event(0, "x", [1], "error", error="it broke"))})
    assert again.cancel()
    with pytest.raises(JobCanceled) as err:
        again.result(timeout=1)
    assert "text" not in err.value.result
    last = json.loads(conn.xrevrange(stream_key(again.id), count=1)[0][1][b"event"])
    assert (last["n"], last["finish_reason"], last.get("reset")) == (1, "abort", True)
    # An earlier job's stream under its id (stock RQ's enqueue reused the id of one that died): none of its output.
    from rq import Queue
    from rq.serializers import JSONSerializer

    from producer.protocol import JOB_FUNCTION

    conn.xadd(stream_key("reused"), {"event": json.dumps(make_event(0, "Old text", [4, 5]))})
    time.sleep(0.003)
    Queue(connection=conn, serializer=JSONSerializer, name=client.queue.name).enqueue(
        JOB_FUNCTION, job_id="reused", kwargs={"prompt": "new", "max_tokens": 4}
    )
    assert client.job("reused").cancel()
    with pytest.raises(JobCanceled) as err:
        client.job("reused").result(timeout=1)
    assert "text" not in err.value.result and err.value.result["error"] == "job canceled before it ran"
    last = json.loads(conn.xrevrange(stream_key("reused"), count=1)[0][1][b"event"])
    assert (last["n"], last.get("reset"), last["usage"]["completion_tokens"]) == (1, True, 0)
    # A client keeping no results (result_ttl 0) still ends it (it raised AttributeError after RQ's cancel).
    unkept = Client(connection=conn, result_ttl=0).submit("kept?")
    assert unkept.cancel() and 0 < conn.ttl(stream_key(unkept.id)) <= 600
    with pytest.raises(JobCanceled):
        unkept.result(timeout=1)


def test_a_scheduled_or_deferred_job_canceled_by_a_client_gets_its_ending():
    """RQ's cancel takes a job out of its scheduled registry (``enqueue_in``, a retry's wait) or its deferred one
    (``depends_on``) too, where no worker reaches it: the client wrote no ending for them (no result, no push to
    its completion list, a stream with no last event, the hash kept for good)."""
    from datetime import timedelta

    from rq import Queue
    from rq.serializers import JSONSerializer

    from producer import Client, JobCanceled
    from producer.protocol import JOB_FUNCTION, make_event, result_key, stream_key

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn, result_ttl=3600)
    queue = Queue(connection=conn, serializer=JSONSerializer, name=client.queue.name)
    later = queue.enqueue_in(timedelta(minutes=5), JOB_FUNCTION, kwargs={"prompt": "x", "notify": "here"})
    parent = client.submit("first")
    child = queue.enqueue(JOB_FUNCTION, kwargs={"prompt": "y", "notify": "here"}, depends_on=parent.id)
    assert (later.get_status(), child.get_status()) == ("scheduled", "deferred")
    ready = client.submit("between deferred and queued")  # (RQ's ready registry: its dependencies met)
    conn.lrem(queue.key, 0, ready.id)
    conn.hset(ready.rq_job.key, "status", "ready_to_enqueue")
    retried = queue.enqueue_in(timedelta(minutes=5), JOB_FUNCTION, kwargs={"prompt": "z"})
    conn.xadd(stream_key(retried.id), {"event": json.dumps(make_event(0, "Hel", [1, 2]))})  # its first attempt's
    for job in (later, child, ready.rq_job, retried):
        assert client.job(job.id).cancel()
        assert 3500 < conn.ttl(job.key) <= 3600 and 3500 < conn.ttl(result_key(job.id)) <= 3600
        last = json.loads(conn.xrevrange(stream_key(job.id), count=1)[0][1][b"event"])
        assert last["finish_reason"] == "abort"
        with pytest.raises(JobCanceled) as err:
            client.job(job.id).result(timeout=1)
        assert err.value.result["finish_reason"] == "abort"
    assert err.value.result["text"] == "Hel"  # (the retried job's: what its first attempt streamed stays)
    assert sorted(conn.lrange("roseinfer:done:here", 0, -1)) == sorted([later.id.encode(), child.id.encode()])
    # The dependency sets go with the hash (RQ's cleanup's), not kept for good: the child's, and a queued parent's.
    assert 3500 < conn.ttl(child.dependencies_key) <= 3600
    assert parent.cancel() and 3500 < conn.ttl(parent.rq_job.dependents_key) <= 3600


def test_a_client_sets_how_long_failed_jobs_are_kept():
    """A failed (or stopped) job keeps its hash and result for its ``failure_ttl``, RQ's year where it sets none, and
    the client had no way to set one: 1,753 failed jobs of a soak held 22 MB for a year."""
    from producer import Client

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn, failure_ttl=600)
    one = client.submit("hi")
    [many] = client.submit_many([{"prompt": "there"}])
    assert one.rq_job.failure_ttl == many.rq_job.failure_ttl == 600
    assert Client(connection=conn).submit("hi").rq_job.failure_ttl is None  # (RQ's own default)
    for bad in (0, -5, True, 1.5, "60"):
        with pytest.raises(ValueError, match="failure_ttl"):
            Client(connection=conn, failure_ttl=bad)
    # Its siblings alike: 1.5 went into the job hash as 1 (a job killed after a second), "x" failed at submit.
    for name, bads, goods in (
        ("job_timeout", (0, -2, 1.5, "1h", True), (1, -1)),
        ("result_ttl", (-2, 1.5, "60", None), (0, -1, 60)),
        ("retries", (-1, 0.5, "2", None), (0, 3)),
    ):
        for bad in bads:
            with pytest.raises(ValueError, match=name):
                Client(connection=conn, **{name: bad})
        for good in goods:
            Client(connection=conn, **{name: good}).submit("hi")


@pytest.mark.redis
def test_a_queue_that_looks_like_a_lane_but_is_none_is_said_once(redis_url, caplog):
    """A producer in another language writing "<queue>:p0" (or :p05, :p101) for its jobs: they waited for good, no
    worker serving them and nothing said."""
    conn, name, worker = _worker_without_engine(redis_url)
    for odd in ("p0", "p05", "p101"):
        conn.sadd("rq:queues", f"rq:queue:{name}:{odd}")
    conn.sadd("rq:queues", f"rq:queue:{name}:prod")  # (a queue of its own, not a lane: nothing to say)
    try:
        with caplog.at_level("WARNING", logger="roseinfer.worker"):
            worker._refresh_lanes()
            worker._refresh_lanes()
        said = [r.getMessage() for r in caplog.records if "looks like a lane" in r.getMessage()]
        assert sorted(line.split()[1] for line in said) == sorted(f"{name}:{odd}" for odd in ("p0", "p05", "p101"))
    finally:
        conn.srem("rq:queues", *[f"rq:queue:{name}:{odd}" for odd in ("p0", "p05", "p101", "prod")])
        worker.register_death()


def test_a_lane_found_after_the_start_is_in_rqs_record_of_what_the_worker_serves(redis_url, monkeypatch):
    """`rq info` (and RQ's Worker.all(queue=...)) listed the worker under the lanes it started with only, though it
    served the ones a producer made later too."""
    import redis
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    from producer import Client

    conn, name, worker = _worker_without_engine(redis_url)
    Client(redis_url, queue=name).submit("hi", priority=3)  # a lane of its own, made now

    def blip(*args, **kwargs):
        raise redis.ConnectionError("blip")

    with monkeypatch.context() as patch:  # Redis away at that moment: the record is made at the next check
        patch.setattr(redis.client.Pipeline, "execute", blip)
        with pytest.raises(redis.ConnectionError):
            worker._refresh_lanes()
    worker._refresh_lanes()
    lane = Queue(f"{name}:p3", connection=conn, serializer=JSONSerializer)
    assert f"{name}:p3" in conn.hget(worker.key, "queues").decode().split(",")
    assert [w.name for w in Worker.all(queue=lane, serializer=JSONSerializer)] == [worker.name]
    worker.register_death()


@pytest.mark.redis
def test_a_worker_starting_beside_workers_of_another_model_says_so(redis_url, caplog):
    """A rollout, or a mistake: a job runs on whichever worker takes it. The server said so, the worker did not."""
    import logging

    from redis import Redis

    from producer.protocol import STATS_KEY
    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn, name, worker = _worker_without_engine(redis_url)  # serves "fake"
    with caplog.at_level(logging.WARNING, logger="roseinfer.worker"):
        worker._warn_of_other_models()  # alone: nothing to say
        assert not caplog.records
        other = BatchWorker(
            Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="other"), Redis.from_url(redis_url)
        )
        other.register_birth()
        conn.hset(STATS_KEY.format(worker=other.name), mapping={"model": "other"})
        worker._warn_of_other_models()
    assert [r.message for r in caplog.records] == [
        f"the workers on queue {name!r} serve several models (fake, other), and a job runs on whichever takes it: "
        "give each model a queue of its own, and one model at several paths one --served-model-name"
    ]
    conn.hset(STATS_KEY.format(worker=other.name), "in_flight", "many")  # written by hand: a look, not a failed start
    worker._warn_of_other_models()


@pytest.mark.redis
def test_listing_the_workers_keeps_the_clients_socket_timeout(redis_url):
    """RQ's Worker objects (``Worker.all``) raise their connection's socket timeout to a worker's 415 s: after one
    look at the workers (a server's /health, a worker's look at its fleet's models) the client's commands waited
    minutes on a Redis that stopped answering (a cold stop of a worker hung past its patience)."""
    from producer import Client

    _conn, name, worker = _worker_without_engine(redis_url)
    client = Client(redis_url, queue=name)
    client.connection.hset(f"roseinfer:stats:{worker.name}", "model", "fake")
    before = client.connection.connection_pool.connection_kwargs.get("socket_timeout")
    assert [row["name"] for row in client.workers()] == [worker.name] and client._stock_workers(name) == []
    assert client.connection.connection_pool.connection_kwargs.get("socket_timeout") == before == 5.0


def _worker_without_engine(redis_url: str):
    """A batching worker, registered, on a queue of its own, with no engine (its Redis writes alone are tested):
    its connection, its queue's name, itself."""
    from redis import Redis

    from worker.batch_worker import BatchWorker
    from worker.settings import WorkerSettings

    class Engine:
        tokenizer = None

    conn = Redis.from_url(redis_url)
    name = f"q-{uuid.uuid4().hex[:8]}"
    worker = BatchWorker(Engine(), WorkerSettings(redis_url=redis_url, queue=name, model="fake"), conn)
    worker.register_birth()
    return conn, name, worker


def test_a_refusal_or_a_cancel_before_the_run_tried_again_after_a_lost_reply_is_written_once(redis_url, monkeypatch):
    """The sender runs an end again when Redis took it but its reply was lost: a job refused at the pull wrote its
    failure twice (two records, two completion-list entries, its failure callback twice); a job canceled while
    queued, its canceled record and entry twice. The rest of the end is done once all the same (its count, its
    rate-limit slot freed)."""
    import redis

    from worker.puller import Arrival

    conn, worker, _, [refused, queued] = _running_jobs(redis_url, count=2, notify="done-twice")
    worker.in_flight.clear()
    worker._fail(
        Arrival(refused.job, refused.queue, refused.execution, refused.stream, refused.request, error="no such thing")
    )
    assert list(worker._ending) == [refused.job.id]  # beaten until its end is written
    queued.job.set_status("canceled")  # (as any client's HSET of it, read at the pull)
    worker._never_ran(queued.job, queued.queue, queued.stream)
    ended, freed = [], []
    monkeypatch.setattr(worker.metrics, "job_ended", lambda how, _: ended.append(how))
    monkeypatch.setattr(worker, "_free_slot", lambda job: freed.append(job.id))
    execute = redis.client.Pipeline.execute

    def reply_lost(self, *args, **kwargs):  # it lands, and its reply never comes back
        execute(self, *args, **kwargs)
        raise redis.ConnectionError("Connection reset by peer")

    def check_lost(*args):  # (RQ logs a failed write of a failure; the check after it reads whether it landed)
        raise redis.ConnectionError("Connection reset by peer")

    for end in worker._tasks:
        with monkeypatch.context() as patch:
            patch.setattr(redis.client.Pipeline, "execute", reply_lost)
            patch.setattr(worker, "_check_end_landed", check_lost)
            with pytest.raises(redis.ConnectionError):
                end()
        end()  # the sender's try again
    assert worker._ending == {} and ended == ["rejected", "canceled"] and freed == [queued.job.id]
    [failed] = refused.job.results()
    assert failed.type == failed.Type.FAILED and failed.return_value["error"] == "no such thing"
    [canceled] = queued.job.results()
    assert canceled.type == canceled.Type.STOPPED and canceled.return_value["status"] == "canceled"
    assert sorted(conn.lrange("roseinfer:done:done-twice", 0, -1)) == sorted([refused.job.id.encode(),
                                                                              queued.job.id.encode()])  # fmt: skip
    assert int(conn.hget(worker.key, "failed_job_count")) == 1
    conn.delete("roseinfer:done:done-twice")


@pytest.mark.parametrize("how", ["script", "no-lua"])
def test_an_id_whose_hash_is_gone_leaves_no_mark_behind_it(redis_url, how, caplog):
    """A queued id whose job was deleted meanwhile is skipped, as RQ skips it: off the intermediate list, and RQ's
    mark of it there too (it outlived the id by a day). Said in a line: a job pushed before its HSET, or to another
    database, went without a word (its follower waited for good)."""
    import uuid

    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    from worker.intake import MOVE_SCRIPT, PulledJob, pull

    conn = Redis.from_url(redis_url)
    queue = Queue(f"q-{uuid.uuid4().hex[:8]}", connection=conn, serializer=JSONSerializer)
    gone = f"gone-{uuid.uuid4().hex[:6]}"
    forged = "x\n2026-12-02 04:21:00,000 roseinfer.worker: a forged line \x1b[31m"  # (escaped: one line, no escape)
    conn.lpush(queue.key, gone, forged)
    seen = queue.intermediate_queue.get_first_seen_key(gone)
    conn.set(seen, 1, ex=86400)
    script = conn.register_script(MOVE_SCRIPT) if how == "script" else None
    with caplog.at_level("WARNING", logger="roseinfer.worker"):
        assert pull([queue], 10, None, conn, PulledJob, JSONSerializer, script) == ([], [])
    assert conn.llen(queue.intermediate_queue_key) == 0 and not conn.exists(seen)
    assert f"job {gone!r} was in queue {queue.name} with no job hash rq:job:<id>" in caplog.text
    assert f"job {forged!r} was in queue" in caplog.text and "\x1b" not in caplog.text


def test_an_unreadable_job_moved_aside_again_after_a_lost_reply_has_one_record(redis_url):
    """Its end, tried again by the sender after a lost reply, wrote a second failed record (its pipeline is not a
    transaction: the record landed, or not, apart from the rest)."""
    from rq.job import Job

    from producer.protocol import rejected_key
    from worker.intake import Unreadable
    from worker.publisher import JobStream

    conn, worker, name, _ = _running_jobs(redis_url)  # (its one job aside)
    bad = f"bad-{uuid.uuid4().hex[:6]}"
    conn.hset(f"rq:job:{bad}", mapping={"status": "queued", "data": "not json"})
    conn.rpush(worker.queues[0].intermediate_queue_key, bad)
    worker._reject_unreadable(Unreadable(bad, worker.queues[0], "RQ cannot read this job"), JobStream(bad))
    for end in worker._tasks * 2:  # (the second time as the sender's try again after a lost reply)
        end()
    assert conn.xlen(f"rq:results:{bad}") == 1
    assert conn.zscore(rejected_key(name), bad) is not None and conn.hget(Job.key_for(bad), "status") == b"failed"
    assert conn.llen(worker.queues[0].intermediate_queue_key) == 0


def test_a_client_on_a_connection_that_decodes_replies_is_refused_at_once():
    """``Client(connection=Redis(decode_responses=True))``, a service's shared client: the submit went in, then every
    look at the job (status, result, cancel) failed with "'str' object has no attribute 'decode'"."""
    from producer import Client

    with pytest.raises(ValueError, match="without decode_responses"):
        Client(connection=fakeredis.FakeRedis(decode_responses=True))
    assert Client(connection=fakeredis.FakeRedis()).submit("hi").status() == "queued"


def test_an_empty_list_of_intervals_is_refused_only_where_rq_would_index_it():
    """RQ's retry indexes its retry intervals: an empty list with retries left failed there, the job left started.
    A repeat's empty list RQ reads as no interval, and a job with no retries left never reads its retry intervals:
    those run as before."""
    from rq import Queue, Repeat, Retry
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from worker.intake import out_of_bounds

    conn = fakeredis.FakeRedis()
    queue = Queue("q", connection=conn, serializer=JSONSerializer)

    def read(**options):
        job = queue.enqueue("worker.jobs.generate", prompt="hi", **options)
        return Job.fetch(job.id, connection=conn, serializer=JSONSerializer)

    assert "'retry_intervals' holds []" in out_of_bounds(read(retry=Retry(max=2, interval=[])))
    assert out_of_bounds(read(repeat=Repeat(times=2, interval=[]))) is None
    spent = read(retry=Retry(max=1, interval=[]))
    spent.retries_left = 0
    assert out_of_bounds(spent) is None


@pytest.mark.redis
def test_a_follower_that_does_not_read_is_left_out_of_the_hubs_read_and_loses_nothing(redis_url, monkeypatch):
    """The hub handed every entry to every follower whether it read or not: a client that stopped reading a job's
    stream held all of it in memory (~475 MB a stalled client). Past MAX_QUEUED reads it is left out of the read,
    and taken back from its last entry once it has taken what it had: every event, in order, once."""
    import asyncio

    import producer.aio as aio
    from producer import AsyncClient
    from producer.protocol import make_event, stream_key

    monkeypatch.setattr(aio, "MAX_QUEUED", 3)
    job_id = f"lagging-{uuid.uuid4().hex[:8]}"
    key = stream_key(job_id)

    async def run() -> list[int]:
        client = AsyncClient(redis_url, queue="lagging")
        try:
            follower = client.hub.follow(key)
            for n in range(40):  # one read each (the hub wakes for each): the follower takes none meanwhile
                await client.connection.xadd(key, {"event": json.dumps(make_event(n, f"t{n}", [n]))})
                await asyncio.sleep(0.02)
            assert follower.detached and follower.entries.qsize() <= 3
            got = []
            while len(got) < 40:
                got += [json.loads(fields[b"event"])["n"] for _id, fields in await client.hub.entries(follower, 5)]
            client.hub.leave(follower)
            return got
        finally:
            await client.connection.delete(key)
            await client.close()

    assert asyncio.run(run()) == list(range(40))


@pytest.mark.redis
def test_a_pull_leaves_a_job_hash_larger_than_a_worker_reads_unread(redis_url):
    """The move script read every moved hash whole (HGETALL) before any bound was looked at: eight written by hand
    with a 128 MB field each held a pull 7 s and took the worker 1.2 GB. Past what a worker reads, a hash comes
    back as its size, unread; by the script and by the blocking wait's own read alike."""
    from redis import Redis
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from producer import Client
    from worker.intake import MOVE_SCRIPT, load_script, pull

    conn, name = Redis.from_url(redis_url), f"fat-{uuid.uuid4().hex[:6]}"
    client = Client(redis_url, queue=name)
    queue = Queue(name, connection=conn, serializer=JSONSerializer)
    for script, block in ((load_script(conn, MOVE_SCRIPT), None), (None, 1)):
        fat, good = client.submit("fat", max_tokens=2), client.submit("good", max_tokens=2)
        conn.hset(fat.rq_job.key, "description", "x" * 3_000_000)
        pulled, unreadable = pull([queue], 8, block, conn, Job, JSONSerializer, script, max_data_bytes=64 * 1024)
        if block:  # (the blocking wait took the first alone: the rest come with the next pull)
            pulled += pull([queue], 8, None, conn, Job, JSONSerializer, script, max_data_bytes=64 * 1024)[0]
        assert [job.id for job, _ in pulled] == [good.id]
        [refused] = unreadable
        assert refused.job_id == fat.id and "more than this worker reads" in refused.reason
        conn.delete(fat.rq_job.key, good.rq_job.key, queue.intermediate_queue_key)


@pytest.mark.redis
def test_an_async_result_too_large_for_the_event_loop_is_read_on_a_thread(redis_url, monkeypatch):
    """A result of tens of MB (n = 64 samples with their logprobs) was decoded and checked on the event loop: the
    server answered nothing else meanwhile (/health took 14 s). One past OFF_LOOP_BYTES is read on a thread, whole."""
    from rq.results import Result

    import producer.aio as aio
    from producer import AsyncClient, Client
    from producer.protocol import result_entry, result_key, usage_of

    threads = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(aio.asyncio, "to_thread", lambda f, *a, **k: threads.append(f) or to_thread(f, *a, **k))
    client = Client(redis_url)
    job = client.submit("hi", max_tokens=3)
    client.connection.lrem(client.queue.key, 0, job.id)
    text = "word " * 100_000  # 500 KB
    result = {"v": 3, "id": job.id, "status": "finished", "finish_reason": "length", "text": text,
              "token_ids": list(range(1000)), "usage": usage_of(1, 1000)}  # fmt: skip
    client.connection.xadd(result_key(job.id), result_entry(result, Result.Type.SUCCESSFUL, "w"))
    client.connection.hset(job.rq_job.key, "status", "finished")

    async def read() -> dict:
        aclient = AsyncClient(redis_url)
        try:
            return await aclient.job(job.id).result(timeout=5)
        finally:
            await aclient.close()

    assert asyncio.run(read())["text"] == text and aio._finished_result in threads


@pytest.mark.redis
def test_a_job_canceled_by_hand_while_its_worker_is_dead_is_ended_by_the_maintenance(redis_url):
    """HSET status canceled (the protocol's cancel, from any language) on a job whose worker died: RQ's clean-up
    passes over a job that is not "started", so it was never ended: no result, no last event, its hash (the
    prompt) kept for good. The maintenance ends it as a client's cancel of a job no worker runs ends it."""
    from producer import JobCanceled
    from producer.protocol import done_key, make_event, stream_key

    conn, worker, client = _worker_of_a_new_queue(redis_url)
    queue = worker.queues[0]
    notify = f"done-{queue.name}"
    job = client.submit("its worker died", max_tokens=8, notify=notify)
    conn.lrem(queue.key, 0, job.id)
    conn.hset(job.rq_job.key, "status", "canceled")  # by hand, once its worker was gone
    conn.persist(job.rq_job.key)  # (a start persists the hash)
    conn.xadd(stream_key(job.id), {"event": json.dumps(make_event(0, "Hel", [5]))})
    conn.zadd(queue.started_job_registry.key, {f"{job.id}:e0": 1})
    worker.clean_registries()
    with pytest.raises(JobCanceled) as err:
        job.result(timeout=5)
    assert err.value.result["text"] == "Hel" and conn.ttl(job.rq_job.key) > 0
    last = json.loads(conn.xrevrange(stream_key(job.id), count=1)[0][1][b"event"])
    assert (last["n"], last["finish_reason"]) == (1, "abort")
    assert conn.lrange(done_key(notify), 0, -1) == [job.id.encode()]
    assert conn.zcard(queue.started_job_registry.key) == 0


def test_a_client_cancel_of_a_queued_job_keeps_its_completion_lists_own_ttl():
    """The list a job names is every job's that names it: a cancel set it to the canceled job's result_ttl (a
    short one expired the ids other jobs had pushed; -1 kept the list for good). It gets a worker's TTL, as a push."""
    from producer import Client
    from producer.client import DEFAULT_RESULT_TTL
    from producer.protocol import done_key

    conn = fakeredis.FakeRedis()
    for result_ttl in (30, -1):
        job = Client(connection=conn, result_ttl=result_ttl).submit("x", notify="everyones")
        assert job.cancel()
        assert DEFAULT_RESULT_TTL - 5 < conn.ttl(done_key("everyones")) <= DEFAULT_RESULT_TTL, result_ttl


def test_every_job_end_has_its_series_from_the_start_and_no_time_is_negative():
    """A labelled series came at its first job (rate() and increase() miss that increment: an alert on the first
    failed job never fired); times across a clock skew (the producer's enqueue, this host's end) were observed
    negative, and a histogram's sum went back."""
    from worker.metrics import JOB_ENDS, WorkerMetrics

    metrics = WorkerMetrics()
    value = metrics.registry.get_sample_value
    assert all(value("roseinfer_jobs_total", {"status": status}) == 0 for status in JOB_ENDS)
    metrics.job_started(-0.5)
    metrics.first_token(-0.25)
    metrics.job_ended("finished", {"total_s": -0.1, "first_token_at": None})
    assert value("roseinfer_jobs_total", {"status": "finished"}) == 1
    for name in ("roseinfer_queue_time_seconds", "roseinfer_ttft_seconds", "roseinfer_e2e_latency_seconds"):
        assert value(f"{name}_sum") == 0 and value(f"{name}_count") == 1
    # The time per output token, between two stamps of this host's wall clock, which NTP may step back between them.
    metrics.job_ended("finished", {"total_s": 0.2, "first_token_at": 100.0, "finished_at": 99.0}, 3)
    assert value("roseinfer_time_per_output_token_seconds_sum") == 0
    # A CPU's prefill step of 64 prompts (~3 s) and a slow token land in buckets of their own, not +Inf alone.
    metrics.step.observe(3.0)
    assert value("roseinfer_engine_step_seconds_bucket", {"le": "5.0"}) == 1
    assert value("roseinfer_engine_step_seconds_bucket", {"le": "2.5"}) == 0


@pytest.mark.redis
def test_an_async_wait_or_stream_under_a_timeout_always_ends_by_it(redis_url):
    """Before Python 3.12 ``asyncio.wait_for`` (redis-py's around each command under a socket timeout, and the hub's
    own) returned its result when a cancel landed as it finished: a timeout around a wait for a queued job's result
    never fired, a few in a hundred (the wait went on for good), and one around a stream ran to the job's end."""
    import asyncio
    import random

    from redis import Redis

    from producer.aio import AsyncClient

    conn, queue = Redis.from_url(redis_url), f"q-{uuid.uuid4().hex[:8]}"
    rng = random.Random(3)

    async def wait_all() -> tuple[int, int, float]:
        async with AsyncClient(redis_url, queue=queue) as client:
            jobs = [await client.submit(f"never run {i}", max_tokens=2) for i in range(20)]  # (no worker: queued)

            async def one(job, seconds: float, streamed: bool) -> bool:
                try:
                    async with asyncio.timeout(seconds):
                        if streamed:
                            async for _ in job.stream():
                                pass
                        else:
                            await job.result()
                except TimeoutError:
                    return True
                return False

            began = time.monotonic()
            ended = await asyncio.wait_for(
                asyncio.gather(*[one(job, rng.uniform(0.02, 0.6), i % 2 == 0) for i in range(10) for job in jobs]),
                timeout=30,
            )
            took = time.monotonic() - began
            for job in jobs:
                await job.cancel()
            return sum(ended), len(ended), took

    if not hasattr(asyncio, "timeout"):
        pytest.skip("asyncio.timeout is Python 3.11's")
    timed_out, waits, took = asyncio.run(wait_all())
    assert (timed_out, waits) == (200, 200) and took < 10, took
    for key in conn.scan_iter(f"*{queue}*"):
        conn.delete(key)


@pytest.mark.redis
def test_a_closed_async_client_takes_no_job(redis_url):
    """After ``close()`` a submit still went in (its connections opened again and left open), a job no stream of the
    client could follow (``stream()`` said ClientClosed)."""
    import asyncio

    from redis import Redis

    from producer.aio import AsyncClient, ClientClosed

    queue = f"q-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        client = AsyncClient(redis_url, queue=queue)
        await client.close()
        with pytest.raises(ClientClosed):
            await client.submit("after close", max_tokens=2)
        with pytest.raises(ClientClosed):
            await client.submit_many([{"prompt": "after close", "max_tokens": 2}])

    asyncio.run(main())
    assert Redis.from_url(redis_url).llen(f"rq:queue:{queue}") == 0


def test_a_refused_jobs_result_echoes_its_metadata_only_where_the_job_would_have_taken_it():
    """A job refused for its metadata (NaN, a lone surrogate, nested past what a reader parses) echoed that very
    metadata in its failed result: JSON no other language reads."""
    from producer.protocol import failure_result
    from producer.schema import MAX_JSON_DEPTH, ending_of

    deep: dict = {}
    inner = deep
    for _ in range(MAX_JSON_DEPTH + 1):
        inner["a"] = {}
        inner = inner["a"]
    for refused in ({"x": float("nan")}, {"x": "\ud800"}, {"x": float("inf")}, deep):
        assert "metadata" not in failure_result("j", ending_of({"metadata": refused}), "refused")
    assert failure_result("j", ending_of({"metadata": {"run": 3}}), "refused")["metadata"] == {"run": 3}


def test_handles_of_one_job_are_equal_and_clients_say_where_they_submit():
    """As RQ's Job: two handles on one id are one job (a set of them held it twice); a client printed as an object
    address, its URL's password hidden when it says where it submits."""
    from producer import AsyncClient, Client

    conn = fakeredis.FakeRedis()
    client = Client(connection=conn, queue="here")
    assert client.job("a") == client.job("a") and client.job("a") != client.job("b")
    assert len({client.job("a"), client.job("a"), client.job("b")}) == 2
    assert repr(Client("redis://:secret@127.0.0.1:1/3", queue="q")) == "Client('redis://***@127.0.0.1:1/3', queue='q')"
    assert client.queue_name == "here"
    aclient = AsyncClient("redis://127.0.0.1:1/3", queue="q")
    assert aclient.job("a") == aclient.job("a") and len({aclient.job("a"), aclient.job("a")}) == 1
    assert repr(aclient) == "AsyncClient('redis://127.0.0.1:1/3', queue='q')"


def test_an_async_clients_options_are_named_and_checked_as_the_clients():
    """``AsyncClient(**options)`` hid Client's options from a reader of its signature, and a misspelt one was
    refused in Client's name."""
    import inspect

    from producer import AsyncClient, Client

    sync = inspect.signature(Client.__init__).parameters
    assert list(inspect.signature(AsyncClient.__init__).parameters) == list(sync)
    with pytest.raises(TypeError, match=r"AsyncClient\.__init__"):
        AsyncClient("redis://127.0.0.1:1/0", bogus=1)
    with pytest.raises(ValueError, match="job_timeout"):
        AsyncClient("redis://127.0.0.1:1/0", job_timeout=0)


def test_an_async_client_used_on_a_second_event_loop_says_so(redis_url):
    """A client made once and used from two asyncio.run (per-test loops, a CLI): redis-py's connections failed deep
    inside ("attached to a different loop", "Event loop is closed")."""
    from producer import AsyncClient

    client = AsyncClient(redis_url, queue=f"loops-{uuid.uuid4().hex[:6]}")

    async def submit():
        return await client.submit("hi", max_tokens=1)

    first = asyncio.run(submit())

    async def follow(job):
        return await job.result(timeout=0.1)

    with pytest.raises(TimeoutError):  # (no worker here: the first loop follows it)
        asyncio.run(follow(first))
    second = asyncio.run(submit())  # a submit runs on any loop, as it did
    with pytest.raises(RuntimeError, match="follows jobs on another event loop than its first"):
        asyncio.run(follow(second))
    client.sync.close()
