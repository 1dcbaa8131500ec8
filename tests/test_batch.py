"""``roseinfer batch``: OpenAI batch lines and plain lines in, OpenAI output lines out, resumable, errors aside."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import signal
import time
from pathlib import Path

import fakeredis
import pytest
from conftest import ThreadWorker, stuck_worker

from producer import Client
from producer.batch import Progress, default_errors_path, run_batch
from producer.batch_io import OUTPUT_LINE_START, JSONLSink
from producer.batch_lines import BadLine, job_id_for, output_line, parse_line
from producer.protocol import BULK_PRIORITY, installed_version, lane_name


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=8, heartbeat_interval=1)
    yield w, Client(redis_url, queue=w.queue)
    w.stop()


def _lines(n: int) -> list[str]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(
                json.dumps(
                    {
                        "custom_id": f"chat-{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": "smollm2",
                            "messages": [{"role": "user", "content": f"Hi {i}"}],
                            "max_tokens": 5,
                            "temperature": 0,
                        },
                    }
                )
            )
        elif i % 3 == 1:
            out.append(
                json.dumps(
                    {
                        "custom_id": f"cmpl-{i}",
                        "method": "POST",
                        "url": "/v1/completions",
                        "body": {"model": "smollm2", "prompt": f"Text {i}", "max_tokens": 4},
                    }
                )
            )
        else:
            out.append(json.dumps({"prompt": f"Plain {i}", "max_tokens": 3, "temperature": 0}))
    return out


@pytest.mark.redis
def test_batch_writes_openai_lines_sends_bad_lines_aside_and_resumes(served, tmp_path, caplog):
    _, client = served
    good = _lines(30)
    bad = [
        "{not json",
        json.dumps({"custom_id": "neg", "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}}),
        json.dumps({"custom_id": "url", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({"custom_id": "chat-0", "body": {"messages": [{"role": "user", "content": "dup"}]}}),
        json.dumps({"prompt": "x", "colour": "red"}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(good[:10] + bad + good[10:]) + "\n")
    out = tmp_path / "out.jsonl"

    # A first run that stopped after the first 10 lines (as if killed).
    part = tmp_path / "part.jsonl"
    part.write_text("\n".join(good[:10]) + "\n")
    first = run_batch(client, part, out, max_in_flight=4, poll_interval=0.05)
    assert first["succeeded"] == 10
    assert len(out.read_text().splitlines()) == 10

    with caplog.at_level(logging.WARNING, logger="roseinfer.batch"):
        summary = run_batch(client, src, out, max_in_flight=8, poll_interval=0.05)
    # The whole after a sample of it, one output: the other input said (another's rows went in with no word).
    assert f"{out} was begun from part.jsonl, not in.jsonl: its rows stay" in caplog.text
    failures = {"invalid_request": 4, "duplicate_custom_id": 1}
    assert summary == {"total": 35, "skipped": 10, "succeeded": 20, "failed": 5, "reused": 0, "failures": failures}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30
    assert all(line.startswith(OUTPUT_LINE_START.decode()) for line in out.read_text().splitlines())  # (a torn one)
    assert sorted(r["custom_id"] for r in rows) == sorted(
        json.loads(line).get("custom_id", f"line-{n}")
        for n, line in enumerate(good[:10] + bad + good[10:], 1)
        if line in good
    )
    by_id = {r["custom_id"]: r for r in rows}
    chat = by_id["chat-0"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 5
    cmpl = by_id["cmpl-1"]["response"]["body"]
    assert cmpl["object"] == "text_completion" and cmpl["usage"]["completion_tokens"] == 4
    dtype = served[0].settings.dtype  # the backend each row was written by, as OpenAI's batch output says it
    assert chat["system_fingerprint"] == cmpl["system_fingerprint"] == f"roseinfer-{installed_version()}-cpu-{dtype}"
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in rows)

    errors = [json.loads(line) for line in out.with_suffix(".errors.jsonl").read_text().splitlines()]
    assert len(errors) == 5
    messages = " | ".join(e["error"]["message"] for e in errors)
    for phrase in ("not JSON", "max_tokens", "url must be one of", "custom_id already used", "colour: unknown field"):
        assert phrase in messages
    assert [e["custom_id"] for e in errors] == [None, "neg", "url", "chat-0", "line-15"]

    again = run_batch(client, src, out, poll_interval=0.05)
    assert again["skipped"] == 30 and again["succeeded"] == 0
    assert len(out.read_text().splitlines()) == 30


@pytest.mark.redis
def test_batch_logprobs_name_tokens_by_their_text(served, tmp_path, tiny_chat_model):
    """As the server's: with the tokenizer the worker wrote to Redis (they went by id: ``token_id:N``)."""
    from tokenizers import Tokenizer

    _, client = served
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 1}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "lp", "body": body}) + "\n")
    assert run_batch(client, src, out, poll_interval=0.05)["succeeded"] == 1
    row = json.loads(out.read_text())
    ids = client.job(row["response"]["request_id"]).result(timeout=10)["token_ids"]
    tokenizer = Tokenizer.from_file(str(Path(tiny_chat_model) / "tokenizer.json"))
    steps = row["response"]["body"]["choices"][0]["logprobs"]["content"]
    names = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert [s["token"] for s in steps] == names
    # A token's bytes are its own: a token holding part of a character (its name U+FFFD) has that part's bytes,
    # and all of them join to the text (greedy tokens of the random model differ with the batch they ran in).
    for step, name in zip(steps, names):
        if "\ufffd" not in name:
            assert step["bytes"] == list(name.encode()), name
    joined = bytes(b for step in steps for b in step["bytes"])
    assert joined.decode(errors="replace") == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.redis
def test_a_rerun_picks_up_jobs_of_the_interrupted_run_instead_of_generating_again(served, tmp_path):
    _, client = served
    line = parse_line(
        1, json.dumps({"custom_id": "again", "prompt": "Resume me", "max_tokens": 3}), queue=client.queue.name
    )
    job = client.submit_many([{**line.payload, "job_id": line.job_id}])[0]
    job.result(timeout=60)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "again", "prompt": "Resume me", "max_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    summary = run_batch(client, src, out, poll_interval=0.05)
    assert summary["succeeded"] == 1 and summary["reused"] == 1
    row = json.loads(out.read_text())
    assert row["response"]["request_id"] == job.id


@pytest.mark.redis
def test_a_row_in_the_output_lets_its_job_and_result_expire_soon_not_after_the_clients_day(served, tmp_path):
    """Each finished row kept ~6.5 KB of Redis for a day (the client's result_ttl, for a rerun to resume from):
    a million-row run filled a Redis with noeviction and ended there. A row written to a JSONL output needs none."""
    from producer.batch import RELEASED_TTL_S
    from producer.protocol import result_key

    _, client = served
    rows = [{"custom_id": f"ttl-{i}", "prompt": f"Expire {i}", "max_tokens": 2} for i in range(3)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert run_batch(client, src, out, poll_interval=0.05)["succeeded"] == 3
    conn = client.connection
    for row in map(json.loads, out.read_text().splitlines()):
        job_id = row["response"]["request_id"]
        for key in (f"rq:job:{job_id}", result_key(job_id)):
            assert 0 < conn.ttl(key) <= RELEASED_TTL_S < client.result_ttl, key
        assert client.job(job_id).result(timeout=5)["text"] == row["response"]["body"]["choices"][0]["text"]
        # (its registry entry goes with its hash: it counted the row finished in `rq info` a day after)
        origin = conn.hget(f"rq:job:{job_id}", "origin").decode()
        assert conn.zscore(f"rq:finished:{origin}", job_id) <= time.time() + RELEASED_TTL_S + 1


@pytest.mark.redis
def test_rows_whose_jobs_ended_already_are_written_at_once_not_at_the_next_sweep(served, tmp_path, monkeypatch):
    """An earlier run's jobs announce their ends to it, not to this run: rows picked up from them were written only
    by the sweep, every 5 s, ~max_in_flight rows at a time (2,000 rows took 22 s, generating them 3 s)."""
    import producer.batch as batch_mod

    _, client = served
    rows = [json.dumps({"custom_id": f"done-{i}", "prompt": f"Done {i}", "max_tokens": 2}) for i in range(12)]
    lines = [parse_line(i + 1, row, queue=client.queue.name) for i, row in enumerate(rows)]
    for job in client.submit_many([{**line.payload, "job_id": line.job_id} for line in lines]):
        job.result(timeout=60)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(rows) + "\n")
    waits = []
    real_wait = batch_mod._wait_for_endings
    monkeypatch.setattr(batch_mod, "_wait_for_endings", lambda *a: waits.append(a) or real_wait(*a))
    summary = run_batch(client, src, out, max_in_flight=4, poll_interval=0.05)
    assert summary["succeeded"] == summary["reused"] == 12
    assert waits == []  # each pick-up was looked at once, then and there


@pytest.mark.redis
def test_a_row_the_worker_refuses_is_the_rows_fault_not_a_failed_job(served, tmp_path):
    """A prompt past the model's context passes every check here; the worker refuses it (``error_type``
    invalid_request): the row's error, not ``job_failed``, by OpenAI's code for it (``context_length_exceeded``),
    so the rows to shorten can be picked out."""
    _, client = served
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"custom_id": "long", "prompt": "word " * 400, "max_tokens": 2},
        {"custom_id": "ok", "prompt": "hi", "max_tokens": 2},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_batch(client, src, out, poll_interval=0.05)
    assert summary["failures"] == {"context_length_exceeded": 1} and summary["succeeded"] == 1
    [error] = [json.loads(x) for x in default_errors_path(out).read_text().splitlines()]
    assert error["custom_id"] == "long" and "prompt" in error["error"]["message"]
    assert error["error"]["code"] == "context_length_exceeded"
    # As OpenAI's error file holds it: the server's 400 for the job, its error in the body
    assert error["response"]["status_code"] == 400 and error["id"] == f"batch_req_{error['response']['request_id']}"
    assert error["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_a_run_on_another_queue_does_not_take_the_jobs_of_a_run_on_this_one():
    """Job ids did not name the queue: a run on queue b (its workers may serve another model) picked up queue a's
    job of the same row as its own, and would have written a's output, or deleted a's failed job to submit it."""
    from producer.batch import Lines, _submit

    connection = fakeredis.FakeRedis()
    on_a, on_b = Client(connection=connection, queue="a"), Client(connection=connection, queue="b")
    text = json.dumps({"custom_id": "x", "prompt": "same row"})
    line_a, line_b = parse_line(1, text, queue="a"), parse_line(1, text, queue="b")
    on_a.submit_many([{**line_a.payload, "job_id": line_a.job_id}])
    in_flight: dict = {}
    reused: set[str] = set()
    _submit(on_b, Lines(iter([line_b])), in_flight, 4, reused)
    assert reused == set() and list(in_flight) == [line_b.job_id] != [line_a.job_id]
    assert on_b.job(line_b.job_id).status() == "queued" == on_a.job(line_a.job_id).status()
    assert connection.hget(f"rq:job:{line_b.job_id}", "origin").decode() == lane_name("b", BULK_PRIORITY)
    # The default queue adds nothing: an output made before the queue counted resumes as it did.
    assert parse_line(1, text).job_id == job_id_for(line_a.payload) != line_a.job_id


def test_an_output_begun_before_ids_named_their_queue_resumes_with_its_own_ids(tmp_path):
    """Its settings file names no queue: a resume on its (non-default) queue was refused for other settings, and
    would have made new ids for every row. An output begun now on the default queue names it, and is refused
    for a rerun on another queue like any other."""
    from producer.batch import settings_path
    from producer.batch_io import RowOptions

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    text = json.dumps({"custom_id": "a", "prompt": "x"})
    src.write_text(text + "\n")
    before_upgrade = parse_line(1, text).job_id  # the ids then named no queue
    out.write_text(json.dumps({"custom_id": "a", "response": {"request_id": before_upgrade}}) + "\n")
    settings_path(out).write_text(json.dumps(RowOptions().fingerprint()))
    assert run_batch(_offline_client(), src, out)["skipped"] == 1  # the row made then is this row
    settings_path(out).write_text(json.dumps({**RowOptions().fingerprint(), "queue": "roseinfer"}))
    with pytest.raises(ValueError, match="other settings"):
        run_batch(_offline_client(), src, out)


def _offline_client() -> Client:
    """A client on fakeredis with no worker: jobs are queued and never run."""
    return Client(connection=fakeredis.FakeRedis(), queue="q")


def test_a_line_nested_past_the_json_parsers_depth_is_a_bad_line_not_the_end_of_the_run(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    deep = '{"custom_id": "deep", "prompt": "x", "metadata": ' + "[" * 100_000
    src.write_text(deep + "\n" + json.dumps({"custom_id": "bad", "prompt": "x", "n": 0}) + "\n")
    summary = run_batch(_offline_client(), src, out, poll_interval=0.01)
    assert summary["failures"] == {"invalid_request": 2}
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["custom_id"]) for e in errors] == [(1, None), (2, "bad")]
    assert "nested too deeply" in errors[0]["error"]["message"]


def test_a_number_past_pythons_digit_limit_is_a_bad_line_not_the_end_of_the_run(tmp_path):
    """Python refuses to read an integer of over 4,300 digits (a ValueError, not a JSON error): the run stopped at
    that line, and every rerun stopped there again."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    huge = '{"custom_id": "huge", "prompt": "x", "seed": 1' + "0" * 5000 + "}"
    src.write_text(huge + "\n" + json.dumps({"custom_id": "bad", "prompt": "x", "n": 0}) + "\n")
    summary = run_batch(_offline_client(), src, out, poll_interval=0.01)
    assert summary["failures"] == {"invalid_request": 2}
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == [1, 2] and "digits" in errors[0]["error"]["message"]


def test_a_rerun_submits_a_failed_row_again_without_unfencing_its_old_attempt(tmp_path):
    """A row whose job failed last time is submitted again under its id. Its hash stays (rewritten by the enqueue)
    with the field naming the attempt that owned it: that attempt, still going on a stalled worker, cannot write its
    end over the new job. The run deleted the hash first, and with it that fence."""
    from producer.protocol import OWNER_FIELD

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    text = json.dumps({"custom_id": "a", "prompt": "x"})
    src.write_text(text + "\n")
    client = _offline_client()
    job_id = parse_line(1, text, queue=client.queue.name).job_id
    client.connection.hset(f"rq:job:{job_id}", mapping={"status": "failed", OWNER_FIELD: "the-old-attempt"})
    with stuck_worker(client):
        assert run_batch(client, src, out, poll_interval=0.01, timeout=0.05)["failures"] == {"timeout": 1}
    key = f"rq:job:{job_id}"
    assert client.connection.hexists(key, "data")  # submitted again (the failed job's hash here had no payload)
    assert client.connection.hget(key, OWNER_FIELD) == b"the-old-attempt"


def test_bad_lines_keep_their_custom_id_in_the_errors_file(tmp_path):
    lines = [
        "{not json",
        "[1, 2]",
        json.dumps({"custom_id": 7, "prompt": "x"}),
        json.dumps({"custom_id": "extra", "body": {"prompt": "x"}, "url": "/v1/completions", "colour": "red"}),
        json.dumps({"custom_id": "field", "prompt": "x", "colour": "red"}),
        json.dumps({"custom_id": "value", "prompt": "x", "temperature": 9}),
        json.dumps({"custom_id": "url", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({"custom_id": "method", "method": "GET", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "chat-prompt", "body": {"prompt": "x"}}),
        json.dumps({"prompt": "x", "max_tokens": 0}),  # no custom_id: named line-N, as its output row would be
        json.dumps({"custom_id": "body-value", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 9}}),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    summary = run_batch(_offline_client(), src, out, poll_interval=0.01)
    assert summary == {
        "total": 11, "skipped": 0, "succeeded": 0, "failed": 11, "reused": 0, "failures": {"invalid_request": 11}
    }  # fmt: skip
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["custom_id"]) for e in errors] == [
        (1, None),
        (2, None),
        (3, None),
        (4, "extra"),
        (5, "field"),
        (6, "value"),
        (7, "url"),
        (8, "method"),
        (9, "chat-prompt"),
        (10, "line-10"),
        (11, "body-value"),
    ]
    assert all(e["error"]["code"] == "invalid_request" and e["id"] is None for e in errors)  # none became a job
    assert "temperature" in errors[5]["error"]["message"] and "colour: unknown field" in errors[4]["error"]["message"]
    # OpenAI's shape of a request it refused: the 400 the server answers, its error in the body (response was null:
    # code written for OpenAI's error file, reading response.status_code or response.body.error, failed on it)
    assert all(e["response"]["status_code"] == 400 for e in errors)
    assert errors[10]["response"]["body"]["error"] == {
        "message": errors[10]["error"]["message"], "type": "invalid_request_error", "param": "temperature",
        "code": "invalid_request",
    }  # fmt: skip


def test_the_errors_file_sits_beside_the_output_with_its_last_suffix_replaced():
    assert default_errors_path("out.jsonl") == Path("out.errors.jsonl")
    assert default_errors_path("runs/out.v2.jsonl") == Path("runs/out.v2.errors.jsonl")
    assert default_errors_path("out") == Path("out.errors.jsonl")


@pytest.mark.slow
def test_progress_is_logged_on_a_timer_off_a_terminal_while_no_job_ends(tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": "x"}) + "\n" for i in range(3)))
    # A worker that never ends its jobs: they run until the timeout; the log lines come from the timer alone.
    client = _offline_client()
    with stuck_worker(client):
        summary = run_batch(client, src, out, timeout=1.0, poll_interval=0.02, log_interval=0.1)
    assert summary["failed"] == 3 and summary["succeeded"] == 0
    lines = capsys.readouterr().err.splitlines()
    waiting = [line for line in lines if line.startswith("batch: 0/3 rows done")]
    assert len(waiting) >= 3, lines
    assert all("0.00 rows/s" in line and "tokens/s" in line and "ETA unknown" in line for line in waiting)
    assert lines[-1].startswith("batch: 3 rows in ") and "0 succeeded, 3 failed" in lines[-1]
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["r0", "r1", "r2"]
    assert all("no result within 1.0 s" in e["error"]["message"] for e in errors)
    # OpenAI's id names the job that failed, as an output line names the one that finished
    assert all(e["id"].startswith("batch_req_") for e in errors)
    assert {client.job(e["id"].removeprefix("batch_req_")).status() for e in errors} == {"canceled"}
    assert all(e["response"] is None for e in errors)  # no server's answer: OpenAI's expired requests have none


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_bar_and_no_log_lines():
    term = _Terminal()
    progress = Progress(total=4, already=1, log_interval=0.0, stream=term)
    progress.update(7)
    progress.tick()
    progress.finish({"total": 4, "skipped": 1, "succeeded": 1, "failed": 0, "reused": 0}, Path("o"), Path("e"))
    text = term.getvalue()
    assert "2/4" in text and "tok/s" in text  # tqdm's bar
    assert "rows done" not in text
    assert text.rstrip().splitlines()[-1].startswith("batch: 4 rows in ")


def test_a_resumed_runs_bar_leaves_the_rows_it_skipped_out_of_its_rate():
    """The log lines kept rows made before out of the rate and ETA; tqdm's bar counted them: 626 rows skipped in a
    moment showed 2,209 rows/s and an ETA of seconds for a run making a few rows a second."""
    import re

    term = _Terminal()
    progress = Progress(total=2000, already=0, stream=term)
    for _ in range(626):
        progress.skip()
    time.sleep(0.3)
    progress.update(5)
    progress.bar.refresh()
    rate = float(re.findall(r"([\d.]+)row/s", term.getvalue())[-1])
    assert "627/2000" in term.getvalue() and rate < 10
    progress.close()


def test_log_lines_go_on_while_a_resume_reads_past_its_done_rows():
    """The rows a resume finds done are read past in one go, between two polls: off a terminal, no log line came
    for as long as that took (minutes for millions of rows)."""
    stream = io.StringIO()
    progress = Progress(total=1000, already=0, log_interval=0.05, stream=stream)
    for _ in range(3):
        time.sleep(0.06)
        progress.skip()
    lines = stream.getvalue().splitlines()
    assert [line.split(" rows done")[0] for line in lines] == ["batch: 1/1000", "batch: 2/1000", "batch: 3/1000"]


def test_the_bar_keeps_moving_after_a_burst_of_skipped_rows():
    """With smoothing 0, tqdm's dynamic miniters only grew: 15,000 rows skipped at once set it to 15,000, and the
    bar showed 15000/20000 for 20 s while rows went on ending."""
    import re

    term = _Terminal()
    progress = Progress(total=20000, already=0, stream=term)
    for _ in range(15000):
        progress.skip()
    for _ in range(3):
        time.sleep(0.15)  # (past tqdm's mininterval of 0.1 s)
        progress.update(1)
    assert re.findall(r"(\d+)/20000", term.getvalue())[-1] == "15003"
    progress.close()


def test_openai_batch_bodies_are_read_as_the_server_reads_them():
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7,
        "logprobs": True,
        "top_logprobs": 2,
    }
    line = parse_line(1, json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert line.payload["messages"] == [{"role": "user", "content": parts}]  # (as the server's: the engine joins them)
    # Its job id is the one the joined text had (483ce84 gave this line that id): a run interrupted then
    # resumed across the change takes its rows and jobs as its own, not as changed requests.
    joined = {**body, "messages": [{"role": "user", "content": "Hi\nthere"}]}
    assert (
        line.job_id
        == parse_line(
            1, json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": joined})
        ).job_id
        == "batch-2b382f0be308f03467658ad2"
    )
    assert line.payload["max_tokens"] == 7 and line.payload["priority"] == 10
    # A max_tokens the body sets must fit the context, as the server refuses it (it was cut at the context).
    assert line.payload["context_overflow"] == "error"
    # Its job id as before that (a run interrupted then resumed now finds its jobs): the field follows from the line.
    assert line.job_id == job_id_for({k: v for k, v in line.payload.items() if k != "context_overflow"})
    without = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    line = parse_line(1, json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": without}))
    assert "context_overflow" not in line.payload  # the run's --max-tokens, or the context: cut, as vLLM's LLM
    # A line with the OpenAI fields but no body was read as a plain line: "method: unknown field; url: ...".
    with pytest.raises(BadLine, match="an OpenAI batch line needs a body"):
        parse_line(1, json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/chat/completions"}))
    with pytest.raises(BadLine, match=r"line 1 column 27 \(char 26\)"):  # (its newline made it "line 2 column 1")
        parse_line(1, '{"prompt": "broken json", \n')
    assert (line.payload["logprobs"], line.payload["top_logprobs"]) == (True, 2)
    result = {
        "id": "j",
        "text": "ok",
        "token_ids": [5, 6],
        "finish_reason": "length",
        "model": "m",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "timings": {"finished_at": 1.0},
        "logprobs": [[[5, -0.1], [9, -2.0]], [[6, -0.3], [5, -1.5]]],
    }
    choice = output_line(line, result)["response"]["body"]["choices"][0]
    steps = choice["logprobs"]["content"]
    assert [s["token"] for s in steps] == ["token_id:5", "token_id:6"] and steps[0]["logprob"] == -0.1
    assert [t["token"] for t in steps[1]["top_logprobs"]] == ["token_id:6", "token_id:5"]
    # n samples: one choice each, with its own text, finish reason and logprobs.
    second = {"index": 1, "text": "no", "token_ids": [7], "finish_reason": "stop", "logprobs": [[[7, -0.2]]]}
    first = {"index": 0, **{k: result[k] for k in ("text", "token_ids", "finish_reason", "logprobs")}}
    choices = output_line(line, {**result, "choices": [first, second]})["response"]["body"]["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in choices] == [
        (0, "ok", "length"),
        (1, "no", "stop"),
    ]
    assert choices[0] == choice and choices[1]["logprobs"]["content"][0]["token"] == "token_id:7"
    plain = parse_line(2, json.dumps({"prompt": "x", "priority": 0}))
    assert plain.payload["priority"] == 0
    # An echoed completion: its prompt's text and logprobs first, as the server gives them.
    body = {"model": "any", "prompt": "Hi", "max_tokens": 2, "echo": True, "logprobs": 1}
    line = parse_line(3, json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": body}))
    assert line.payload["prompt_logprobs"] == 1
    echoed = {**result, "prompt": "Hi", "prompt_token_ids": [3, 4], "prompt_logprobs": [None, [[4, -0.7]]]}
    choice = output_line(line, echoed)["response"]["body"]["choices"][0]
    assert choice["text"] == "Hiok" and choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in (3, 4, 5, 6)]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.7, -0.1, -0.3]
    assert "prompt_logprobs" not in choice  # the echo's, not asked for
    # max_tokens 0 with echo scores the prompt alone: the one token its job makes is left out of the line.
    only = parse_line(4, json.dumps({"url": "/v1/completions", "body": {**body, "max_tokens": 0}}))
    assert only.payload["max_tokens"] == 1 and only.echo_only
    body_only = output_line(only, echoed)["response"]["body"]
    choice = body_only["choices"][0]
    assert choice["text"] == "Hi" and choice["logprobs"]["token_logprobs"] == [None, -0.7]
    assert choice["finish_reason"] == "length" and body_only["usage"]["completion_tokens"] == 0
    # vLLM's prompt_logprobs where a line asks for them: chat's at the top, a completion's in each choice; a
    # completion without echo does not begin with its prompt (one whose result held prompt logprobs did).
    scored = {**result, "prompt_token_ids": [3, 4], "prompt_logprobs": [None, [[9, -0.2], [4, -0.7]]]}
    want = [None, {"9": {"logprob": -0.2, "rank": 1, "decoded_token": "token_id:9"}}]
    want[1]["4"] = {"logprob": -0.7, "rank": None, "decoded_token": "token_id:4"}
    for url, key, obj in (
        ("/v1/chat/completions", "messages", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", "prompt", {"prompt": "Hi"}),
    ):
        line = parse_line(5, json.dumps({"url": url, "body": {**obj, "prompt_logprobs": 1}}))
        body = output_line(line, scored)["response"]["body"]
        shown = body if key == "messages" else body["choices"][0]
        assert shown["prompt_logprobs"] == want
        assert body["choices"][0].get("text", body["choices"][0].get("message", {}).get("content")) == "ok"
    plain = output_line(parse_line(6, json.dumps({"prompt": "Hi", "prompt_logprobs": 1})), scored)
    assert plain["response"]["body"]["choices"][0]["text"] == "ok"
    assert parse_line(3, json.dumps({"url": "/v1/completions", "body": {"prompt": "x", "n": 3}})).payload["n"] == 3
    with pytest.raises(ValueError, match="n: Input should be less than or equal to 64"):
        parse_line(4, json.dumps({"url": "/v1/completions", "body": {"prompt": "x", "n": 65}}))


def test_a_dry_run_checks_every_line_and_submits_nothing(tmp_path):
    from producer.batch import dry_run

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        '{"prompt": "a"}\n{"prompt": ""}\n\n{"custom_id": "x", "prompt": "hi"}\n{"custom_id": "x", "prompt": "dup"}\n'
        '{"custom_id": "done", "prompt": "old"}\n'
    )
    done = parse_line(6, '{"custom_id": "done", "prompt": "old"}')
    out.write_text(json.dumps({"custom_id": "done", "response": {"request_id": done.job_id}}) + "\n")
    last_run_errors = '{"custom_id": "gone", "error": {"code": "worker_failed"}}\n'
    default_errors_path(out).write_text(last_run_errors)
    counts = dry_run(src, out)
    failures = {"invalid_request": 1, "duplicate_custom_id": 1}
    assert counts == {"total": 5, "valid": 2, "skipped": 1, "failed": 2, "failures": failures}
    errors = [json.loads(x) for x in default_errors_path(out, dry=True).read_text().splitlines()]
    assert [(e["line"], e["error"]["code"]) for e in errors] == [(2, "invalid_request"), (5, "duplicate_custom_id")]
    assert default_errors_path(out).read_text() == last_run_errors  # the real run's failures are kept


def test_an_output_path_holding_another_file_is_refused_and_left_as_it_was_dry_run_or_not(tmp_path):
    """A pretty-printed results.json given as the output lost its last line (taken for a crash's line cut short),
    in a dry run too, and the rows went after its text."""
    from producer.batch import dry_run

    src, out = tmp_path / "in.jsonl", tmp_path / "results.json"
    src.write_text('{"prompt": "x"}\n')
    pretty = '{\n  "config": {\n    "lr": 0.1\n  }\n}'
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    # One line without its newline was taken for a crash's first row cut short: text was cut off (the file left
    # empty), JSON got a newline and the rows after it.
    for text in (pretty, "my notes", '{"accuracy": 0.9}', '{"id": "other"'):
        out.write_text(text)
        for run in (lambda: dry_run(src, out), lambda: run_batch(client, src, out)):
            with pytest.raises(ValueError, match="exists and is not a batch output"):
                run()
            assert out.read_text() == text
    torn = tmp_path / "torn.jsonl"  # a crash in the first row's write: no whole line, and it begins as ours do
    for cut in ('{"id": "batch_req_q-0123", "custom_id": "line-1", "respo', '{"id": "bat', "{"):
        torn.write_text(cut)
        dry_run(src, torn)
        assert torn.read_text() == cut  # a dry run changes nothing
    assert JSONLSink(torn).done() == {} and torn.read_text() == ""  # a run cuts it off: its row runs again


def test_input_lines_are_read_as_jobs_are_submitted_not_all_at_once(tmp_path, monkeypatch):
    import producer.batch as batch_mod

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(1000)))
    parsed = []
    real_parse = batch_mod.parse_line
    monkeypatch.setattr(batch_mod, "parse_line", lambda *a: parsed.append(a[0]) or real_parse(*a))
    client = Client(connection=fakeredis.FakeRedis(), queue="lazy")
    progress = Progress(1000, 0, 0, stream=io.StringIO())
    summary = {"total": 1000, "skipped": 0, "succeeded": 0, "failed": 0, "reused": 0, "failures": {}}
    sink = batch_mod.JSONLSink(tmp_path / "out.jsonl")
    sink.open(io.StringIO(), output=False)
    options = batch_mod.RowOptions()
    lines = batch_mod._read_input(src, "jsonl", options, {}, None, "lazy", summary, 10, sink, progress)
    in_flight: dict = {}
    assert batch_mod._submit(client, batch_mod.Lines(lines), in_flight, 8, {}) is True
    assert len(in_flight) == 8 and len(parsed) == 8  # the other 992 rows are not read yet
    status = client.status()  # (read in one round trip: the lanes add up to what is queued)
    assert status["lanes"]["10"] == 8 and status["queued"] == sum(status["lanes"].values()) == 8
    assert status["tokens_per_s"] == 0.0 and isinstance(status["tokens_per_s"], float)  # (no worker: 0.0, not 0)


@pytest.mark.slow
def test_rows_are_written_as_their_jobs_announce_their_end_not_by_polling(served, tmp_path, monkeypatch):
    import producer.batch as batch_mod

    _, client = served
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [json.dumps({"prompt": f"Announced {i} {tmp_path.name}", "max_tokens": 3}) for i in range(12)]
    src.write_text("\n".join(rows) + "\n")  # rows no earlier test submitted: all new jobs
    announced: list[str] = []
    real_wait = batch_mod._wait_for_endings

    def spy(conn, key, wait):
        got = real_wait(conn, key, wait)
        announced.extend(got)
        return got

    monkeypatch.setattr(batch_mod, "_wait_for_endings", spy)
    lists_before = set(client.connection.keys("roseinfer:done:*"))  # an earlier test's run may have left its own
    # Sweeps of every job in flight: one at the start, the next 30 s later (not 5: the backoff's cap, a shorter
    # interval's); the run is over long before.
    summary = run_batch(client, src, out, max_in_flight=4, poll_interval=30)
    assert summary["succeeded"] == 12
    assert len(set(announced)) == 12  # every row came through the completion list
    assert set(client.connection.keys("roseinfer:done:*")) <= lists_before  # the run's list is gone with it


@pytest.mark.slow
def test_a_dry_run_counts_the_prompt_tokens_the_worker_then_sees(served, tiny_chat_model, tmp_path):
    from transformers import AutoTokenizer

    from producer.batch import dry_run

    _, client = served
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"prompt": f"Count me {i} {tmp_path.name}", "max_tokens": 2} for i in range(3)]
    rows += [
        {"messages": [{"role": "user", "content": f"Chat {i} {tmp_path.name}"}], "max_tokens": 2} for i in range(3)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = dry_run(src, out, tokenizer=AutoTokenizer.from_pretrained(tiny_chat_model))
    assert counts["valid"] == 6 and not out.exists()
    run_batch(client, src, out, poll_interval=0.05)
    usage = [json.loads(line)["response"]["body"]["usage"]["prompt_tokens"] for line in out.read_text().splitlines()]
    assert counts["prompt_tokens"] == sum(usage) and counts["max_prompt_tokens"] == max(usage)


def test_a_rerun_at_another_priority_resumes_the_same_rows():
    """The priority orders jobs and changes no output: a rerun at another one names the rows' jobs as before, so
    the rows already done are skipped, not refused as changed requests."""
    import hashlib

    from producer.protocol import BULK_PRIORITY

    line = json.dumps({"custom_id": "a", "prompt": "x", "max_tokens": 3})
    low, high = parse_line(1, line), parse_line(1, line, priority=0)
    assert (low.payload["priority"], high.payload["priority"]) == (BULK_PRIORITY, 0)
    assert high.job_id == low.job_id
    # A run at the default priority names its jobs as every earlier version did (their outputs resume).
    assert low.job_id == "batch-" + hashlib.sha256(json.dumps(low.payload, sort_keys=True).encode()).hexdigest()[:24]


def _cli_args(*argv: str):
    import argparse

    from producer import cli as producer_cli

    parser = argparse.ArgumentParser(prog="roseinfer")
    producer_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


@pytest.mark.redis
def test_a_line_with_a_lone_surrogate_is_a_bad_line_and_the_rest_run(served, tmp_path):
    """json.loads takes a \\u escape of half a UTF-16 pair; no UTF-8 file can hold it, so writing its row raised
    and stopped the whole run, on every rerun."""
    _, client = served
    tag = tmp_path.name
    lines = [
        json.dumps({"custom_id": "ok-1", "prompt": f"Surrogates {tag} 1", "max_tokens": 2}),
        '{"custom_id": "bad\\ud800", "prompt": "x"}',
        '{"custom_id": "in-prompt", "prompt": "half \\udc00 a pair"}',
        '{"custom_id": "in-key", "prompt": "x", "\\ud83d": 1}',
        json.dumps({"custom_id": "pair", "prompt": f"Whole pair \U0001f600 {tag}", "max_tokens": 2}),  # \ud83d\ude00
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    summary = run_batch(client, src, out, poll_interval=0.05)
    assert (summary["succeeded"], summary["failed"], summary["failures"]) == (2, 3, {"invalid_request": 3})
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text(encoding="utf-8").splitlines()) == ["ok-1", "pair"]
    errors = [json.loads(x) for x in default_errors_path(out).read_text(encoding="utf-8").splitlines()]
    assert [(e["line"], e["custom_id"]) for e in errors] == [(2, None), (3, "in-prompt"), (4, "in-key")]
    assert all("lone surrogate" in e["error"]["message"] for e in errors)
    again = run_batch(client, src, out, poll_interval=0.05)  # the rerun skips the rows done, refuses the same lines
    assert (again["skipped"], again["failed"]) == (2, 3)


def test_an_error_holding_a_lone_surrogate_is_written_as_its_json_escape(tmp_path):
    """Whatever reaches a line (a worker's error text, say) cannot stop the run: the escape is valid JSON."""
    from producer.batch_io import JSONLSink, open_lines

    error = {"custom_id": "x", "error": {"code": "job_failed", "message": "half \ud800 a pair"}}
    with open_lines(tmp_path / "errors.jsonl", "w") as err:
        sink = JSONLSink(tmp_path / "out.jsonl")
        sink.open(err)
        sink.error(error)
        sink.close()
    text = (tmp_path / "errors.jsonl").read_text(encoding="utf-8")
    assert "\\ud800" in text and json.loads(text) == error


def test_a_bom_opens_the_file_and_a_line_that_is_not_utf8_is_a_bad_line(tmp_path):
    """A BOM made line 1 'not JSON'; bytes that are not UTF-8 were replaced by U+FFFD and the job ran on them."""
    from producer.batch import dry_run

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = json.dumps({"prompt": "café"}, ensure_ascii=False).encode()
    src.write_bytes(b"\xef\xbb\xbf" + good + b'\n{"prompt": "caf\xe9"}\n' + good.replace(b"caf", b"the") + b"\n")
    counts = dry_run(src, out)
    assert (counts["total"], counts["valid"], counts["failed"]) == (3, 2, 1)
    errors = [json.loads(x) for x in default_errors_path(out, dry=True).read_text().splitlines()]
    assert [(e["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [(2, None, "invalid_request")]
    assert "not UTF-8" in errors[0]["error"]["message"] and "0xe9" in errors[0]["error"]["message"]


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--max-in-flight", "0", "at least 1"),
        ("--max-in-flight", "-3", "at least 1"),
        ("--timeout", "0", "above 0"),
        ("--timeout", "nan", "above 0"),
        ("--log-interval", "-1", "at least 0"),
    ],
)
def test_batch_number_flags_out_of_range_are_refused_at_the_flag(flag, value, says, capsys):
    """--max-in-flight 0 submitted nothing and waited for ever."""
    with pytest.raises(SystemExit) as exit_:
        _cli_args("batch", "in.jsonl", "-o", "out.jsonl", flag, value)
    assert exit_.value.code == 2
    assert f"argument {flag}: must be {says}" in capsys.readouterr().err


def test_run_batch_refuses_no_jobs_in_flight(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="--max-in-flight must be at least 1"):
        run_batch(_offline_client(), src, tmp_path / "out.jsonl", max_in_flight=0)
    assert list(tmp_path.iterdir()) == [src]


@pytest.mark.parametrize(
    "flag, value",
    [("--temperature", "5"), ("--priority", "500"), ("--n", "0"), ("--max-tokens", "0"), ("--seed", str(-(2**63) - 1))],
)
def test_bad_run_defaults_are_one_error_before_any_row(flag, value, tmp_path, monkeypatch, capsys):
    """They failed every row one by one, and were kept in the output's settings file."""
    from producer import cli as producer_cli

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(3)))
    client = _offline_client()
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    assert producer_cli.batch(_cli_args("batch", str(src), "-o", str(out), flag, value)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: bad batch settings: {flag} ") and "Input should be" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no output, errors or settings file
    assert client.queue.count == 0


@pytest.mark.slow  # seconds: waits for timeouts or a refused connection
def test_a_job_past_the_timeout_is_canceled_not_left_to_run(tmp_path):
    """The timeout counts from the job's start: queued behind others (here 0.6 s, three timeouts) it is not
    canceled; running past it, it is."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"custom_id": f"slow-{i}", "prompt": "x"} for i in range(2)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    client = _offline_client()
    ids = [parse_line(i, json.dumps(r), queue="q").job_id for i, r in enumerate(rows, 1)]
    began = time.monotonic()
    with stuck_worker(client, after=0.6):
        summary = run_batch(client, src, out, timeout=0.2, poll_interval=0.02, log_interval=1e9)
    assert time.monotonic() - began > 0.8
    assert summary["failures"] == {"timeout": 2}
    assert [client.job(job_id).status() for job_id in ids] == ["canceled", "canceled"]
    errors = [json.loads(x) for x in default_errors_path(out).read_text().splitlines()]
    assert all("no result within 0.2 s of its start: the job was canceled" in e["error"]["message"] for e in errors)


def test_an_outputs_settings_are_its_own_through_a_link_and_one_written_beside_the_link_still_counts(tmp_path):
    """A run through a link to an output keeps the settings beside the output itself, as its lock (two runs, one by
    each name, wrote every row twice); one a run through the link wrote beside the link before is still read (its
    run id and settings were lost: rows made otherwise mixed in, a --fresh run's jobs not found)."""
    from producer.batch import _run_id_of, settings_path

    out, link = tmp_path / "out.jsonl", tmp_path / "link.jsonl"
    out.write_text("")
    link.symlink_to(out)
    assert settings_path(link) == settings_path(out) == tmp_path / "out.jsonl.batch.json"
    (tmp_path / "link.jsonl.batch.json").write_text(json.dumps({"run_id": "abc123"}))
    assert settings_path(link) == tmp_path / "link.jsonl.batch.json" and _run_id_of(link, None) == "abc123"
    (tmp_path / "out.jsonl.batch.json").write_text(json.dumps({"run_id": "def456"}))  # (the output's own first)
    assert _run_id_of(link, None) == "def456"


def test_a_run_refused_for_other_settings_keeps_the_last_errors_file(tmp_path):
    from producer.batch_io import RowOptions

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    out.write_text(json.dumps({"custom_id": "old", "response": {"request_id": "batch-" + "0" * 24}}) + "\n")
    client = _offline_client()
    with stuck_worker(client):
        run_batch(client, src, out, timeout=0.01, poll_interval=0.01, options=RowOptions(defaults={"seed": 1}))
    errors = default_errors_path(out).read_text()
    assert '"custom_id": "a"' in errors
    with pytest.raises(ValueError, match="other settings"):
        run_batch(_offline_client(), src, out, options=RowOptions(defaults={"seed": 2}))
    assert default_errors_path(out).read_text() == errors
    from producer.batch import dry_run, settings_path

    kept = settings_path(out).read_text()
    with pytest.raises(ValueError, match="other settings"):  # a dry run says what the run would meet
        dry_run(src, out, options=RowOptions(defaults={"seed": 2}), queue="q")
    assert settings_path(out).read_text() == kept and dry_run(src, out, options=RowOptions(defaults={"seed": 1}),
                                                              queue="q")["valid"] == 1  # fmt: skip
    elsewhere = Client(connection=fakeredis.FakeRedis(), queue="elsewhere")  # maybe another model
    with pytest.raises(ValueError, match=r"other settings \(queue: \"q\" in the output, \"elsewhere\" now\)"):
        run_batch(elsewhere, src, out, options=RowOptions(defaults={"seed": 1}))


@pytest.mark.slow  # seconds: waits for timeouts or a refused connection
def test_a_second_run_on_the_same_output_is_refused_while_the_first_writes(tmp_path):
    """Two at once wrote every row twice into a JSONL output (and left a Parquet one corrupt)."""
    import threading

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    client = _offline_client()
    with stuck_worker(client):
        # The first run lasts until its job is canceled below: with a timeout of its own it could end, and free the
        # output, before a loaded machine started the second run, which then waited on the stuck worker for good.
        options = {"timeout": None, "poll_interval": 0.01, "log_interval": 1e9}
        first = threading.Thread(target=run_batch, args=(client, src, out), kwargs=options, daemon=True)
        first.start()
        deadline = time.monotonic() + 10
        while not (tmp_path / "out.jsonl.lock").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ValueError, match="another run is writing"):
            run_batch(_offline_client(), src, out, timeout=5.0)  # (a run not refused ends, and fails this test)
        (tmp_path / "link.jsonl").symlink_to(out)  # (one through a link took a lock of its own, and wrote too)
        with pytest.raises(ValueError, match=r"another run is writing .*link\.jsonl \(it holds .*/out\.jsonl\.lock"):
            run_batch(_offline_client(), src, tmp_path / "link.jsonl", timeout=5.0)
        assert first.is_alive()
        # The first run takes the lock before it submits: on a loaded machine its job may not be there yet, and a
        # cancel that found none left it waiting on the stuck worker for good.
        deadline = time.monotonic() + 30
        while not (keys := client.connection.keys("rq:job:*")):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for key in keys:
            client.job(key.decode().removeprefix("rq:job:")).cancel()
        first.join(timeout=30)
        assert not first.is_alive()
    assert not (tmp_path / "out.jsonl.lock").exists()
    again = _offline_client()
    with stuck_worker(again):  # free again
        assert run_batch(again, src, out, timeout=0.01, poll_interval=0.01, log_interval=1e9)["failed"] == 1


@pytest.mark.parametrize("dry", [False, True])
@pytest.mark.parametrize("same_as", ["in.jsonl", "out.jsonl"])
def test_an_errors_file_over_the_input_or_the_output_is_refused(tmp_path, same_as, dry):
    from producer.batch import dry_run

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    out.write_text(json.dumps({"custom_id": "old", "response": {"request_id": "batch-" + "0" * 24}}) + "\n")
    before = (src.read_text(), out.read_text())
    with pytest.raises(ValueError, match="give --errors another path"):
        if dry:
            dry_run(src, out, errors_path=tmp_path / same_as)
        else:
            run_batch(_offline_client(), src, out, errors_path=tmp_path / same_as)
    assert (src.read_text(), out.read_text()) == before


@pytest.mark.parametrize("dry", [False, True])
def test_a_piped_input_or_an_output_over_the_input_is_refused(tmp_path, dry):
    """A pipe was used up by the row count: the run found no row and exited 0. An output over the input had the
    results appended to the input."""
    import os

    from producer.batch import dry_run

    def run(src, out):
        return dry_run(src, out) if dry else run_batch(_offline_client(), src, out)

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="is the input"):
        run(src, tmp_path / "." / "in.jsonl")
    assert src.read_text().count("\n") == 1
    fifo = tmp_path / "piped.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        run(fifo, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("dry", [False, True])
def test_an_output_held_by_another_run_is_refused_and_left_as_it_is(tmp_path, dry):
    """A dry run too: it reads (and may cut) the output's last line and rewrites the errors file."""
    import fcntl

    from producer.batch import dry_run

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    out.write_text('{"custom_id": "b", "resp')  # a line the other run is writing
    default_errors_path(out).write_text("theirs\n")
    with open(tmp_path / "out.jsonl.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="another run is writing"):
            dry_run(src, out) if dry else run_batch(_offline_client(), src, out)
    assert out.read_text() == '{"custom_id": "b", "resp' and default_errors_path(out).read_text() == "theirs\n"


def test_an_output_in_a_folder_that_does_not_exist_is_one_clear_error(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"the output.s folder .*nowhere does not exist"):
        run_batch(_offline_client(), src, tmp_path / "nowhere" / "out.jsonl")


@pytest.mark.slow  # seconds: waits for timeouts or a refused connection
def test_a_run_against_a_dead_redis_keeps_the_last_errors_file(tmp_path):
    import redis

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
    default_errors_path(out).write_text('{"custom_id": "earlier"}\n')
    dead = Client(connection=redis.Redis(port=1, socket_connect_timeout=0.2), queue="q")
    with pytest.raises(redis.ConnectionError):
        run_batch(dead, src, out)
    assert default_errors_path(out).read_text() == '{"custom_id": "earlier"}\n'


def test_a_submit_whose_reply_was_lost_is_this_runs_own_job_not_one_reused_and_ended_ids_are_let_go(monkeypatch):
    """Redis took a submit and the connection dropped before its reply: the lines were handed out again and found
    their jobs queued, which counted them as an earlier run's ("N rows were taken from jobs of an earlier run").
    The ids picked up were also kept until the run's end, one per row of a long resumed run."""
    import redis

    from producer.batch import Lines, _settle, _submit

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    earlier, *ours = [parse_line(i, json.dumps({"prompt": f"row {i}"}), queue="q") for i in range(1, 4)]
    client.submit_many([{**earlier.payload, "job_id": earlier.job_id}])  # an earlier run's, still queued
    real = client.submit_many

    def went_in_then_dropped(payloads):
        real(payloads)
        raise redis.ConnectionError("Connection reset by peer")

    lines, in_flight, reused = Lines(iter([earlier, *ours])), {}, {}
    monkeypatch.setattr(client, "submit_many", went_in_then_dropped)
    with pytest.raises(redis.ConnectionError):
        _submit(client, lines, in_flight, 8, reused)
    monkeypatch.setattr(client, "submit_many", real)
    assert _submit(client, lines, in_flight, 8, reused) is False
    assert set(in_flight) == {earlier.job_id, *(line.job_id for line in ours)}
    assert reused == {earlier.job_id: False}  # (the two this run submitted are its own)

    class Sink:
        keeps_flushed_rows = False

        def __init__(self):
            self.errors = []

        def error(self, entry, line):
            self.errors.append(line.job_id)

        def flush(self):
            pass

    for line in (earlier, *ours):  # each ends (failed: its row an error line)
        client.connection.hset(f"rq:job:{line.job_id}", "status", "failed")
    summary = {"total": 3, "skipped": 0, "succeeded": 0, "failed": 0, "reused": 0, "failures": {}}
    sink = Sink()
    _settle(client, list(in_flight), in_flight, reused, sink, Progress(3, 0, 0, stream=io.StringIO()), summary, None)
    assert len(sink.errors) == 3 and in_flight == {} and reused == {}

    # A disk full at the flush: the rows it held never reached the files, and the counts (the stop's "325 rows in
    # out.jsonl", 316 there) said they had.
    import errno

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    sink.flush = full
    in_flight = {line.job_id: (line, None) for line in ours}
    with pytest.raises(OSError, match="No space"):
        _settle(client, list(in_flight), in_flight, {}, sink, Progress(3, 0, 0, stream=io.StringIO()), summary, None)
    assert (summary["failed"], summary["failures"]) == (3, {"job_failed": 3})  # (as before the failed flush)


def test_a_row_another_run_of_the_input_submitted_since_the_look_is_followed_not_a_crash(monkeypatch):
    """Two runs of one input at once (into two outputs, as the README allows): the other run submitted a row's job
    between this run's look at its status and its submit, and the id, taken by a queued job, ended the run ("job id
    ... is taken")."""
    from producer.batch import Lines, _submit

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    raced, mine = [parse_line(i, json.dumps({"prompt": f"row {i}"}), queue="q") for i in range(1, 3)]
    real = client.submit_many
    calls = []

    def other_run_first(payloads):
        if not calls:  # the other run's submit lands first
            real([{**raced.payload, "job_id": raced.job_id}])
        calls.append([p["job_id"] for p in payloads])
        return real(payloads)

    monkeypatch.setattr(client, "submit_many", other_run_first)
    lines, in_flight, reused = Lines(iter([raced, mine])), {}, {}
    assert _submit(client, lines, in_flight, 8, reused) is False
    assert calls == [[raced.job_id, mine.job_id], [mine.job_id]]
    assert set(in_flight) == {raced.job_id, mine.job_id} and reused == {raced.job_id: False}
    [lane] = client.connection.keys("rq:queue:q*")  # (a batch's own lane)
    assert client.connection.lrange(lane, 0, -1) == [raced.job_id.encode(), mine.job_id.encode()]  # each once


def test_a_row_whose_interrupted_runs_job_is_still_stopping_is_submitted_once_it_stopped():
    """A rerun right after Ctrl-C: the interrupted run canceled its jobs, and a worker was still stopping one. Its
    id is refused for that step or so (the worker took a new job of it for its running copy): the row waits for the
    next poll instead of following the canceled job, whose end would have failed it."""
    from rq.registry import StartedJobRegistry

    from producer.batch import Lines, _submit
    from producer.protocol import OWNER_FIELD

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    conn = client.connection
    stopping, mine = [parse_line(i, json.dumps({"prompt": f"row {i}"}), queue="q") for i in range(1, 3)]
    client.submit_many([{**stopping.payload, "job_id": stopping.job_id}])  # (the interrupted run's)
    [lane] = conn.keys("rq:queue:q*")
    origin = lane.decode().removeprefix("rq:queue:")
    conn.delete(lane)  # (taken by a worker: running, then canceled)
    conn.hset(f"rq:job:{stopping.job_id}", mapping={"status": "canceled", OWNER_FIELD: "exec-1"})
    started = StartedJobRegistry(origin, connection=conn).key
    conn.zadd(started, {f"{stopping.job_id}:exec-1": time.time() + 60})
    lines, in_flight, reused = Lines(iter([stopping, mine])), {}, {}
    assert _submit(client, lines, in_flight, 8, reused) is False
    assert set(in_flight) == {mine.job_id} and lines.taken_back == [stopping] and reused == {}
    conn.zrem(started, f"{stopping.job_id}:exec-1")  # its worker ended the run
    _submit(client, lines, in_flight, 8, reused)
    assert set(in_flight) == {stopping.job_id, mine.job_id} and not lines.taken_back
    assert conn.lrange(lane, 0, -1) == [mine.job_id.encode(), stopping.job_id.encode()]
    assert client.job(stopping.job_id).status() == "queued"


def test_a_job_redis_lost_is_submitted_again_once_not_failed_as_missing():
    """Redis restarted without persistence mid-run: the rows in flight failed ``job_missing`` (30 of 1,500), though
    their lines were at hand. Each is submitted again, once; lost a second time, its row is an error."""
    from producer.batch import Lines, _settle, _submit

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    rows = [parse_line(i, json.dumps({"prompt": f"row {i}"}), queue="q") for i in range(1, 3)]
    lines, in_flight, reused = Lines(iter(rows)), {}, {}
    assert _submit(client, lines, in_flight, 8, reused) is False

    class Sink:
        keeps_flushed_rows = False

        def __init__(self):
            self.errors = []

        def error(self, entry, line):
            self.errors.append((line.job_id, entry["error"]["code"]))

        def flush(self):
            pass

    sink, summary = Sink(), {"total": 2, "skipped": 0, "succeeded": 0, "failed": 0, "reused": 0, "failures": {}}
    progress = Progress(2, 0, 0, stream=io.StringIO())
    client.connection.flushall()  # the restart, empty
    _settle(client, list(in_flight), in_flight, reused, sink, progress, summary, None, None, lines)
    assert (
        sink.errors == [] and in_flight == {} and {line.job_id for line in lines.taken_back} == {r.job_id for r in rows}
    )
    _submit(client, lines, in_flight, 8, reused)  # submitted again, as new jobs
    assert set(in_flight) == {r.job_id for r in rows} and reused == {}
    assert all(client.job(r.job_id).status() == "queued" for r in rows)
    client.connection.flushall()  # lost again
    _settle(client, list(in_flight), in_flight, reused, sink, progress, summary, None, None, lines)
    assert sorted(sink.errors) == sorted((r.job_id, "job_missing") for r in rows) and in_flight == {}


def test_a_whole_last_output_line_without_its_newline_is_kept(tmp_path):
    """Only a line cut short (not JSON) is removed for its row to run again; a whole one gets its newline."""
    from producer.batch_io import JSONLSink

    out = tmp_path / "out.jsonl"
    rows = [{"custom_id": c, "response": {"request_id": "batch-" + "0" * 24}} for c in ("a", "b")]
    out.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]))
    assert set(JSONLSink(out).done()) == {"a", "b"}
    assert out.read_text().endswith("}\n")
    out.write_text(out.read_text() + '{"custom_id": "c", "resp')
    assert set(JSONLSink(out).done()) == {"a", "b"} and out.read_text().endswith("}\n")


def test_a_last_line_cut_short_then_ended_by_an_editor_is_cut_and_a_line_edited_elsewhere_is_refused(tmp_path):
    """A last line cut short and given its newline (an editor's) was kept: the rerun appended its row again, the file
    no JSONL (the id twice, once torn) for every later run. It is cut as a crash's is; a line that is no output line
    anywhere else stops the run, naming it (its row would run again, the line stay)."""
    from producer.batch import dry_run
    from producer.batch_io import JSONLSink

    out, src = tmp_path / "out.jsonl", tmp_path / "in.jsonl"
    rows = [{"id": f"batch_req_q-{c}", "custom_id": c, "response": {"request_id": "b-" + "0" * 24}} for c in "abc"]
    whole = "".join(json.dumps(r) + "\n" for r in rows[:2])
    torn = json.dumps(rows[2])[:30] + "\n"
    for tail in (torn, torn + "\n\n"):
        out.write_text(whole + tail)
        assert set(JSONLSink(out).done(cut=False)) == {"a", "b"} and out.read_text() == whole + tail  # (dry: as it was)
        assert set(JSONLSink(out).done()) == {"a", "b"} and out.read_text() == whole
    out.write_text(torn)  # (the only line: it was "not a batch output")
    assert JSONLSink(out).done() == {} and out.read_text() == ""
    out.write_text(whole + '{"custom_id": "b"}')  # JSON, no output line, no newline: it was kept, the next run refused
    with pytest.raises(ValueError, match="line 3 is not an output line"):
        JSONLSink(out).done()
    src.write_text('{"prompt": "x"}\n')
    for text, numbers in ((torn + whole, "1"), (whole.replace("\n", "\n" + torn, 1), "2"),
                          (whole + "not json\n", "3"), (whole + torn + whole, "3")):  # fmt: skip
        out.write_text(text)
        for run in (lambda: JSONLSink(out).done(), lambda: dry_run(src, out)):
            with pytest.raises(ValueError, match=rf"(line {numbers} is not an output line|is not a batch output)"):
                run()
        assert out.read_text() == text


def test_the_runs_defaults_come_before_the_apis_for_what_an_openai_line_leaves_unset():
    """--n and --max-tokens apply to every row that sets none, OpenAI batch lines too: their parsing had already
    filled in the API's defaults (n 1; max_tokens 16 for /v1/completions), which then won, so --n did nothing there.
    What a line sets wins; where the run gives no default, the API's stands."""
    from producer.batch_io import RowOptions

    def body_line(url: str, **body) -> str:
        return json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": {"model": "m", **body}})

    run = RowOptions(defaults={"n": 3, "max_tokens": 40})
    chat, text = "/v1/chat/completions", "/v1/completions"
    messages = [{"role": "user", "content": "hi"}]
    for url, body in ((chat, {"messages": messages}), (text, {"prompt": "hi"})):
        payload = parse_line(1, body_line(url, **body), options=run).payload
        assert (payload["n"], payload["max_tokens"]) == (3, 40), url
        payload = parse_line(1, body_line(url, **body, n=2, max_tokens=5)).payload
        assert (payload["n"], payload["max_tokens"]) == (2, 5), url
    assert (
        parse_line(1, body_line(chat, messages=messages, max_completion_tokens=7), options=run).payload["max_tokens"]
        == 7
    )
    payload = parse_line(1, body_line(text, prompt="hi")).payload  # no run defaults: the API's
    assert payload.get("n", 1) == 1 and payload["max_tokens"] == 16


def test_an_output_of_no_known_format_points_at_output_format_not_format(tmp_path):
    """-o out.txt was told to pass --format, which sets the input's format too: a Parquet input then misread."""
    import producer.batch as batch_mod

    with pytest.raises(ValueError, match=r"pass --output-format$"):
        batch_mod._formats(tmp_path / "in.jsonl", None, tmp_path / "out.txt", None)
    with pytest.raises(ValueError, match=r"pass --format$"):
        batch_mod._formats(tmp_path / "in.txt", None, tmp_path / "out.jsonl", None)


def test_ctrl_c_during_a_busy_redis_is_an_interrupt_not_redis_lost(tmp_path, monkeypatch):
    """The run's last clean-up swallowed Redis gone but not Redis busy (MISCONF, BUSY): its error replaced a Ctrl-C,
    which was then told as "Redis unavailable for over 600 s", exit 1 instead of 130."""
    from redis.exceptions import ResponseError

    import producer.batch as batch_mod

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "p"}) + "\n")
    client = Client(connection=fakeredis.FakeRedis())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def misconf(*names):
        raise ResponseError("MISCONF Redis is configured to save RDB snapshots, but it is unable to persist")

    monkeypatch.setattr(batch_mod, "_submit", interrupted)
    monkeypatch.setattr(client.connection, "delete", misconf)
    with pytest.raises(batch_mod.BatchInterrupted):
        run_batch(client, src, out, log_interval=1e9)


def test_a_responses_line_under_a_runs_n_is_refused_not_cut_to_one_sample():
    """--n applied to /v1/responses lines too: the worker made (and counted in usage) n samples, and the output
    line, a Response, showed the first alone. The line is refused, as a body's own n is."""
    from producer.batch_io import RowOptions

    line = json.dumps({"custom_id": "r", "url": "/v1/responses", "body": {"model": "m", "input": "hi"}})
    with pytest.raises(BadLine, match="without --n") as caught:
        parse_line(1, line, options=RowOptions(defaults={"n": 2}))
    assert caught.value.custom_id == "r"
    assert parse_line(1, line, options=RowOptions(defaults={"n": 1})).payload.get("n", 1) == 1


def test_a_rerun_resumes_the_run_id_of_a_fresh_run_the_output_keeps(tmp_path):
    """A --fresh run killed outright (kill -9, the OOM killer) never printed its run id, and a rerun gave its rows
    other job ids: a Parquet output, whose rows of a killed run come back only from their jobs, lost them all. The
    output's settings file keeps the id; a rerun that names none resumes it, and --fresh still starts anew."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"p{i}"}) + "\n" for i in range(2)))
    client = Client(connection=fakeredis.FakeRedis())
    ids = []
    for run_id in ("fresh1", None, "other2"):
        with stuck_worker(client):  # nothing runs: each row times out, and the next run submits it again
            run_batch(client, src, out, log_interval=1e9, timeout=0.01, poll_interval=0.01, run_id=run_id)
        ids.append({key.decode().split("-")[1] for key in client.connection.keys("rq:job:batch-*")})
        client.connection.flushall()
    assert ids == [{"fresh1"}, {"fresh1"}, {"other2"}]
    assert json.loads(out.with_name("out.jsonl.batch.json").read_text())["run_id"] == "other2"


def test_the_run_lock_is_taken_on_the_file_at_its_path_not_one_removed_meanwhile(tmp_path, monkeypatch):
    """A run that ends removes its lock file; a second run that had opened it just before locked the removed file,
    and a third run then locked a new one: two runs wrote one output. The lock is taken again on the file there."""
    import fcntl

    import producer.batch as batch_mod

    out = tmp_path / "out.jsonl"
    lock_path = tmp_path / "out.jsonl.lock"
    lock_path.touch()
    stale = open(lock_path, "a")  # noqa: SIM115 (opened by the second run just before the first run removed it)
    lock_path.unlink()
    opened = []

    def open_(path, mode="r", *args, **kwargs):
        opened.append(path)
        return stale if len(opened) == 1 else open(path, mode, *args, **kwargs)

    monkeypatch.setattr(batch_mod, "open", open_, raising=False)
    with batch_mod._only_run_on(out):
        assert len(opened) == 2 and stale.closed  # the removed file given up, the one at the path locked
        with open(lock_path, "a") as third, pytest.raises(BlockingIOError):
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not lock_path.exists()


def test_an_output_on_a_filesystem_without_locks_is_written_unlocked_with_a_warning(tmp_path, monkeypatch, caplog):
    """A FUSE bucket mount or NFS without its lock daemon refuses flock: the run stopped with a bare "[Errno 95]
    Operation not supported", and left its lock file behind."""
    import errno
    import fcntl

    import producer.batch as batch_mod

    def refused(*args):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fcntl, "flock", refused)
    out = tmp_path / "out.jsonl"
    with caplog.at_level("WARNING", logger="roseinfer.batch"), batch_mod._only_run_on(out):
        pass
    assert "cannot lock" in caplog.text and "Operation not supported" in caplog.text
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_rows_whose_jobs_ended_before_the_run_are_done_but_not_in_its_rates():
    """A resume took thousands of finished jobs' results in seconds, and counted them as made: the rows/s and
    tokens/s of the summary were absurd, and the ETA far too short."""
    progress = Progress(total=10, already=0, log_interval=1e9, stream=io.StringIO())
    progress.update(500, made_before=True)
    progress.update(500, made_before=True)
    progress.update(7)
    assert (progress.done, progress.already, progress.tokens) == (3, 2, 7)


def test_responses_lines_run_as_the_server_reads_them_and_answer_with_a_response(served, tmp_path):
    """OpenAI's batch API takes /v1/responses lines: the same job as the chat it means (the server's reading),
    answered with a response object; the run's defaults fill what the line leaves unset, as for a chat's."""
    _, client = served
    from producer.batch_io import RowOptions

    body = {"model": "m", "instructions": "Be brief.", "input": "Tell me about the sea", "temperature": 0}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea"}]
    chat = {"model": "m", "temperature": 0, "max_tokens": 6, "messages": messages}
    lines = [
        {"custom_id": "r", "url": "/v1/responses", "body": {**body, "max_output_tokens": 6}},
        {"custom_id": "c", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "bad", "url": "/v1/responses", "body": {**body, "previous_response_id": "resp_1"}},
        {"custom_id": "defaults", "url": "/v1/responses", "body": body},
        {"custom_id": "lp", "url": "/v1/responses", "body": {**body, "max_output_tokens": 6, "top_logprobs": 2,
                                                             "include": ["message.output_text.logprobs"]}},
    ]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(client, src, out, poll_interval=0.05, options=RowOptions(defaults={"max_tokens": 3}))
    assert (summary["succeeded"], summary["failed"]) == (4, 1)
    rows = {row["custom_id"]: row["response"]["body"] for row in map(json.loads, out.read_text().splitlines())}
    response, chat = rows["r"], rows["c"]
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["instructions"] == "Be brief." and response["max_output_tokens"] == 6
    [message] = response["output"]
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert response["status"] == "incomplete" and chat["choices"][0]["finish_reason"] == "length"
    assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] == 6
    assert rows["defaults"]["usage"]["output_tokens"] == 3  # the run's --max-tokens: the line left it unset
    part = rows["lp"]["output"][0]["content"][0]
    assert (
        part["text"] == message["content"][0]["text"] and "".join(t["token"] for t in part["logprobs"]) == part["text"]
    )
    assert [len(t["top_logprobs"]) for t in part["logprobs"]] == [2] * 6
    [error] = map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())
    assert error["custom_id"] == "bad" and "not stored here" in error["error"]["message"]


def test_an_openai_line_asking_auto_reads_calls_in_the_format_the_run_names():
    """--tool-call-parser for batch, as serve's: without it an "auto" line with tools is that line's error; with it
    the line's job is unconstrained and its output's <tool_call> blocks come back as tool_calls."""
    from producer.batch import BadLine
    from producer.batch_io import RowOptions

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools}
    text = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body})
    with pytest.raises(BadLine, match="--tool-call-parser"):
        parse_line(1, text)
    line = parse_line(1, text, options=RowOptions(tool_call_parser="hermes"))
    assert "structured_outputs" not in line.payload and line.payload["skip_special_tokens"] is False
    result = {
        "id": "j", "model": "m", "finish_reason": "stop", "timings": {"finished_at": 1.0},
        "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12},
        "text": 'On it. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    }  # fmt: skip
    [choice] = output_line(line, result)["response"]["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it. "
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert RowOptions(tool_call_parser="hermes").fingerprint() != RowOptions().fingerprint()
    assert "tool_call_parser" not in RowOptions().fingerprint()  # (outputs of earlier runs keep theirs)


def test_a_chat_lines_thinking_is_its_messages_reasoning_where_the_run_names_a_reasoning_parser():
    from producer.batch_io import RowOptions

    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
    text = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body})
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    result = {"id": "j", "model": "m", "text": "<think>Two and two.</think>4", "finish_reason": "stop",
              "timings": {"finished_at": 1.0}, "usage": usage}  # fmt: skip
    line = parse_line(1, text, options=RowOptions(reasoning_parser="deepseek_r1"))
    [choice] = output_line(line, result)["response"]["body"]["choices"]
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == ("Two and two.", "4")
    [choice] = output_line(parse_line(1, text), result)["response"]["body"]["choices"]
    assert choice["message"] == {"role": "assistant", "content": "<think>Two and two.</think>4"}
    assert RowOptions(reasoning_parser="qwen3").fingerprint() != RowOptions().fingerprint()
    assert "reasoning_parser" not in RowOptions().fingerprint()  # (outputs of earlier runs keep theirs)


def test_a_chat_lines_echo_begins_its_output_with_the_assistants_words():
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    body = {"model": "m", "messages": messages, "continue_final_message": True, "echo": True}
    line = parse_line(1, json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}))
    assert "echo" not in line.payload and line.payload["continue_final_message"] is True
    result = {"id": "j", "model": "m", "text": " blue.", "finish_reason": "stop", "timings": {"finished_at": 1.0},
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}  # fmt: skip
    [choice] = output_line(line, result)["response"]["body"]["choices"]
    assert choice["message"]["content"] == "The color is blue."


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/responses"])
def test_the_runs_response_format_is_read_with_the_line_so_a_reasoning_model_thinks_first(url):
    """--response-format with --reasoning-parser: the run's format was added to the job after the line was read as
    unconstrained, so the job had no thinking before its JSON, and the JSON answer was split off as reasoning (the
    content null in every row). It is read with the line, as the line's own format is."""
    from producer.batch_io import RowOptions

    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    options = RowOptions(defaults={"response_format": rf}, reasoning_parser="deepseek_r1")
    body = {"messages": [{"role": "user", "content": "2+2?"}]} if "chat" in url else {"input": "2+2?"}
    line = parse_line(1, json.dumps({"custom_id": "r1", "url": url, "body": body}), options=options)
    own = {
        **body,
        **(
            {"response_format": rf}
            if "chat" in url
            else {"text": {"format": {"type": "json_schema", **rf["json_schema"]}}}
        ),
    }
    asked = parse_line(1, json.dumps({"custom_id": "r1", "url": url, "body": own}), options=RowOptions(
        reasoning_parser="deepseek_r1"))  # fmt: skip
    assert line.payload.get("thinking") == asked.payload.get("thinking") == "first"
    result = {"id": "j", "model": "m", "status": "finished", "text": 'I add.</think>{"a": 4}', "finish_reason": "stop",
              "token_ids": [1, 2], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
              "timings": {"finished_at": 1.0}}  # fmt: skip
    body_out = output_line(line, result)["response"]["body"]
    if "chat" in url:
        assert body_out["choices"][0]["message"]["content"] == '{"a": 4}'
    else:
        assert body_out["output"][-1]["content"][0]["text"] == '{"a": 4}'


def test_a_signal_ignored_when_the_run_starts_stays_ignored_as_nohup_asks():
    """``nohup roseinfer batch ...`` ignores SIGHUP so the run outlives its terminal; the run's handler replaced
    that, and closing the terminal stopped the run. A signal not ignored still stops it as Ctrl-C does."""
    from producer.batch import _Signaled, _signals_interrupt

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _signals_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: the run goes on
            with pytest.raises(_Signaled):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # (delivered at the next bytecode; never reached)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize(
    "content, said",
    [
        (gzip.compress(b'{"prompt": "a"}\n', mtime=0), r"is gzip-compressed: decompress it first, e.g. gunzip -k "),
        ('{"prompt": "a"}\n'.encode("utf-16"), r"is UTF-16 text: convert it to UTF-8 first, e.g. iconv -f UTF-16"),
        (json.dumps({"prompt": "a"}, indent=2).encode(), r"holds JSON written over many lines.*jq -c \. "),
        (b"PAR1\x15\x04", r"is a Parquet file: name it with a .parquet extension, or pass --format parquet"),
    ],
    ids=["gzip", "utf-16", "pretty-printed", "parquet"],
)
def test_a_jsonl_input_that_is_no_json_lines_is_one_error_before_any_row(tmp_path, content, said):
    """A gzip or UTF-16 file, or one object pretty-printed: every line was a bad row ("not UTF-8: invalid start
    byte", "Expecting value"), which said nothing of why; .jsonl.gz could not even be named (pass --format)."""
    from producer.batch import dry_run

    src, out = tmp_path / "rows.json", tmp_path / "out.jsonl"
    src.write_bytes(content)
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    for run in (lambda: dry_run(src, out), lambda: run_batch(client, src, out)):
        with pytest.raises(ValueError, match=said):
            run()
    assert client.queue.count == 0 and not out.exists()
    named = tmp_path / "rows.jsonl.gz"
    with pytest.raises(ValueError, match=r"a compressed file \(\.gz\) is neither read nor written"):
        dry_run(named, out)


@pytest.mark.parametrize("dry", [False, True])
def test_a_json_array_given_as_jsonl_is_one_error_before_any_row(tmp_path, dry):
    """A ``.json`` file of rows pretty-printed as an array: each line was a bad row, but for the last object (no
    comma after it), which ran alone."""
    from producer.batch import dry_run

    src, out = tmp_path / "rows.json", tmp_path / "out.jsonl"
    src.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=0) + "\n")
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    with pytest.raises(ValueError, match=r"holds a JSON array, not JSON Lines.*jq -c '\.\[\]'"):
        dry_run(src, out) if dry else run_batch(client, src, out)
    assert client.queue.count == 0 and not out.exists()


def test_an_output_deleted_or_moved_while_the_run_writes_it_stops_the_run(tmp_path):
    """The run wrote on into the file it had open: deleted or moved (a clean-up, a log rotation, an mv), the run
    ended "3000 succeeded" with exit 0, no output there, and its rows' results expired ten minutes later."""
    from producer.batch_io import open_lines

    for gone in ("deleted", "moved"):
        out = tmp_path / f"{gone}.jsonl"
        with open_lines(tmp_path / "errors.jsonl", "w") as err:
            sink = JSONLSink(out)
            sink.open(err)
            line = parse_line(1, {"prompt": "p"})
            sink.result(line, {"custom_id": line.custom_id, "response": {}}, {"id": "j", "text": "t"})
            sink.flush()
            if gone == "deleted":
                out.unlink()
            else:
                out.rename(tmp_path / "elsewhere.jsonl")
            with pytest.raises(FileNotFoundError, match="the output was deleted or moved while the run wrote it"):
                sink.flush()
            sink.close()
