"""The producer's command line: submit flags derived from the payload model, ``result`` of a canceled job,
``batch`` interrupted by Ctrl-C and resumed, results reused from an earlier run and ``--fresh``."""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
import time
from pathlib import Path

import fakeredis
import pytest
import redis
from conftest import ThreadWorker, slow_engine_steps
from pydantic import Field

from producer import Client, JobRequest
from producer import batch as batch_mod
from producer import cli as producer_cli
from producer.batch import Progress
from producer.job_errors import InvalidRequest
from producer.protocol import encode_result, result_key


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="roseinfer")
    producer_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def _help(command: str) -> str:
    parser = argparse.ArgumentParser(prog="roseinfer")
    sub = parser.add_subparsers()
    producer_cli.add_parsers(sub)
    return " ".join(sub.choices[command].format_help().split())  # argparse wraps lines: compare words


@pytest.fixture
def no_redis(monkeypatch):
    """Fail the test if a command builds a client: a bad value must be refused before Redis is asked."""

    def refuse(args):
        raise AssertionError("connected to Redis")

    monkeypatch.setattr(producer_cli, "_client", refuse)


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=8, heartbeat_interval=1)
    yield w, Client(redis_url, queue=w.queue)
    w.stop()


# -- submit: flags from JobRequest ------------------------------------------------------------------------------


def test_every_scalar_payload_field_has_a_submit_flag_with_its_description_and_default():
    text = _help("submit")
    for name, field in JobRequest.model_fields.items():
        if name in ("prompt", "messages", "metadata"):
            continue
        flag = "--" + name.replace("_", "-")
        flags = {flag, flag.removesuffix("s")}  # --stop-token-id for stop_token_ids: one a flag, repeated
        assert flags & set(re.findall(r"--[a-z][a-z0-9-]*", text)), name  # a whole flag, not a piece of another
        assert " ".join((field.description or name).split()) in text, name
    temperature = JobRequest.model_fields["temperature"].description or "temperature"
    assert (f"--temperature FLOAT {temperature} (a number; >= 0.0; <= 2.0; default: the model's recommendation (its "
            "generation config), else 1.0)") in text  # fmt: skip
    assert "--temperature FLOAT" in text and "--max-tokens INT" in text and "--logprobs BOOL|INT" in text
    assert "--ignore-eos, --no-ignore-eos keep generating past EOS (default: false)" in text
    assert "(;" not in text and "()" not in text  # (a switch has no value to describe, only its default)
    assert "default: until EOS or the context (an integer; >= 1)" in text  # (said once, in words)
    assert "$ROSEINFER_REDIS_URL" in text and "$ROSEINFER_QUEUE" in text


def test_a_field_added_to_the_payload_model_gets_its_flag(monkeypatch):
    class Extended(JobRequest):
        typical_p: float = Field(0.9, ge=0.0, le=1.0, description="a new knob")

    monkeypatch.setattr(producer_cli, "JobRequest", Extended)
    monkeypatch.setattr(producer_cli, "validate", lambda fields: Extended.model_validate(fields))
    text = _help("submit")
    assert "--typical-p FLOAT a new knob (a number; >= 0.0; <= 1.0; default: 0.9)" in text
    args = _parse("submit", "hi", "--typical-p", "0.5")
    assert producer_cli.request_from_args(args)["typical_p"] == 0.5


def test_submit_flags_become_a_typed_payload(no_redis):
    args = _parse(
        "submit",
        "hello",
        "--raw",
        "--max-tokens",
        "4",
        "--temperature",
        "1",
        "--stop",
        "A",
        "--stop",
        "B",
        "--stop-token-id",
        "3",
        "--stop-token-id",
        "7",
        "--logprobs",
        "true",
        "--top-logprobs",
        "2",
        "--ignore-eos",
        "--custom-id",
        "c-1",
        "--metadata",
        '{"k": 1}',
        "--logit-bias",
        '{"42": -100}',
    )
    assert producer_cli.request_from_args(args) == {
        "prompt": "hello",
        "max_tokens": 4,
        "temperature": 1.0,
        "stop": ["A", "B"],
        "stop_token_ids": [3, 7],
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "custom_id": "c-1",
        "metadata": {"k": 1},
        "logit_bias": {"42": -100},
    }
    chat = producer_cli.request_from_args(_parse("submit", "hi", "--logprobs", "3", "--no-ignore-eos"))
    assert chat == {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3, "ignore_eos": False}
    # Token ids are the prompt (the positional one was required, and always sent beside them: a refused job).
    ids = producer_cli.request_from_args(_parse("submit", "--prompt-token-id", "5", "--prompt-token-id", "9"))
    assert ids == {"prompt_token_ids": [5, 9]}
    with pytest.raises(InvalidRequest, match="give a prompt"):
        producer_cli.request_from_args(_parse("submit", "--max-tokens", "3"))
    with pytest.raises(InvalidRequest, match="--stream prints one sample"):  # it printed sample 0 alone
        producer_cli.submit(_parse("submit", "hi", "--stream", "--n", "3"))


@pytest.mark.parametrize(
    ("flag", "value", "phrase"),
    [
        ("--max-tokens", "4.5", "max_tokens: '4.5' is not an integer"),
        ("--temperature", "warm", "temperature: 'warm' is not a number"),
        ("--temperature", "3", "temperature: Input should be less than or equal to 2"),
        ("--max-tokens", "-3", "max_tokens: Input should be greater than or equal to 1"),
        ("--logprobs", "many", "logprobs: 'many' is not true or false or an integer"),
        ("--stop-token-id", "-1", "stop_token_ids.0"),
        ("--metadata", "{oops", "metadata: not JSON"),
        ("--logit-bias", '{"42": 200}', "logit_bias: logit_bias values are numbers in [-100, 100]"),
    ],
)
def test_a_bad_flag_value_is_one_line_before_redis_is_asked(no_redis, flag, value, phrase):
    args = _parse("submit", "hi", flag, value)
    with pytest.raises(InvalidRequest) as err:
        producer_cli.submit(args)
    assert phrase in str(err.value) and "\n" not in str(err.value)


def test_json_flags_take_the_json_or_a_file_and_response_format_a_bare_schema_in_submit_and_batch(tmp_path, no_redis):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (tmp_path / "label v2.json").write_text(json.dumps(schema))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    request = producer_cli.request_from_args(
        _parse("submit", "hi", "--tools", f"@{tmp_path / 'tools.json'}", "--response-format", json.dumps(schema))
    )
    assert request["tools"] == tools
    assert request["response_format"] == {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    wrapped = {"type": "json_schema", "json_schema": {"name": "label_v2", "schema": schema}}
    by_file = _parse("submit", "hi", "--response-format", f"@{tmp_path / 'label v2.json'}")
    assert producer_cli.request_from_args(by_file)["response_format"] == wrapped
    for value in (str(tmp_path / "label v2.json"), json.dumps({"type": "json_object"})):  # batch: a path, or the JSON
        defaults = producer_cli.batch_options(
            _parse("batch", "in.jsonl", "-o", "out.jsonl", "--response-format", value)
        )
        assert defaults.defaults["response_format"] == (wrapped if value.endswith(".json") else {"type": "json_object"})
    for argv, phrase in (
        (("--tools", f"@{tmp_path / 'missing.json'}"), "invalid job: tools @"),
        (("--response-format", "label.json"), "response_format label.json: neither a JSON object nor a file"),
        (("--response-format", "[1]"), "neither a JSON object nor a file"),
        (("--response-format", '{"type": '), "response_format: not JSON"),
    ):
        with pytest.raises(InvalidRequest, match=phrase.replace("[", r"\[")):
            producer_cli.request_from_args(_parse("submit", "hi", *argv))


def test_connection_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("ROSEINFER_REDIS_URL", "redis://envhost:6390/3")
    monkeypatch.setenv("ROSEINFER_QUEUE", "envq")
    client = producer_cli._client(_parse("status"))
    assert client.connection.connection_pool.connection_kwargs["host"] == "envhost"
    assert client.queue.name == "envq"
    client = producer_cli._client(_parse("status", "--redis-url", "redis://flaghost:1/0", "--queue", "q2"))
    assert client.connection.connection_pool.connection_kwargs["host"] == "flaghost" and client.queue.name == "q2"


def test_an_empty_redis_url_is_refused_as_the_worker_refuses_it(monkeypatch, capsys):
    """``--redis-url ""`` or an empty ROSEINFER_REDIS_URL: the commands took the default Redis (perhaps another than
    meant), while the worker refused it with "got ;"."""
    from producer.connection import InvalidRedisURL, connect

    with pytest.raises(InvalidRedisURL, match="--redis-url is empty"):
        producer_cli._client(_parse("status", "--redis-url", ""))
    monkeypatch.setenv("ROSEINFER_REDIS_URL", " ")
    with pytest.raises(InvalidRedisURL, match="ROSEINFER_REDIS_URL is set but empty"):
        producer_cli._client(_parse("status"))
    with pytest.raises(InvalidRedisURL, match="the Redis URL is empty"):
        connect("")
    assert producer_cli._client(_parse("status", "--redis-url", "redis://flaghost:1/0")) is not None  # (it wins)
    # The worker's empty flag named the variable ("ROSEINFER_REDIS_URL set to nothing?"), set or not.
    from worker.cli import main

    monkeypatch.setenv("ROSEINFER_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["worker", "--model", "tiny", "--redis-url", ""]) == 2
    assert "error: --redis-url is empty: give a Redis URL, or leave the flag out" in capsys.readouterr().err


def test_status_lists_the_lanes_once_there_are_several(monkeypatch, capsys):
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    client.submit("now", max_tokens=2)
    client.submit_many([{"prompt": "later", "max_tokens": 2, "priority": 10}] * 2)
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    assert producer_cli.status(_parse("status")) == 0
    assert "lanes: priority 0: 1, priority 10: 2" in capsys.readouterr().out


def test_status_counts_a_dead_workers_jobs_and_those_put_aside_unread(monkeypatch, capsys):
    """A job started by a worker since killed read as none in flight (its registry entry lapsed), no worker left
    to say it; a job hash RQ cannot read, failed and put aside, was in no count."""
    from producer.protocol import rejected_key

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    jobs = client.submit_many([{"prompt": "x", "max_tokens": 2}] * 3)
    conn = client.connection
    lapsed, live = jobs[0].id, jobs[1].id
    conn.lrem(client.queue.key, 0, lapsed)
    conn.lrem(client.queue.key, 0, live)
    conn.zadd(client.queue.started_job_registry.key, {f"{lapsed}:e0": 1, f"{live}:e1": time.time() + 60})
    conn.zadd(rejected_key("q"), {"bad-hash": time.time()})
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    st = client.status()
    assert (st["queued"], st["in_flight"], st["stalled"], st["rejected"]) == (1, 1, 1, 1)
    assert producer_cli.status(_parse("status")) == 0
    out = capsys.readouterr().out
    assert "1 started jobs whose worker stopped beating" in out and "1 jobs put aside unread" in out


def test_status_shows_each_workers_numerics(monkeypatch, capsys):
    """A fleet mixing float and int8 workers (whose text differs a little): each worker's line says which it is."""
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    row = {"name": "w1", "state": "busy", "model": "smol", "in_flight": 3, "tokens_per_s": 12.0}
    workers = [{**row, "dtype": "bfloat16", "quantization": "int8"}, {**row, "name": "w2", "dtype": None}]
    monkeypatch.setattr(client, "workers", lambda: workers)
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    assert producer_cli.status(_parse("status")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  w1  busy     smol (bfloat16, int8)  3 in flight  12.0 tok/s" in lines
    assert "  w2  busy     smol  3 in flight  12.0 tok/s" in lines  # (an older worker says nothing of it)
    assert not [line for line in lines if "several models" in line]


def test_status_warns_of_a_queue_whose_workers_serve_several_models(monkeypatch, capsys):
    """A rollout, or a mistake: a job runs on whichever worker takes it. The server said so; status did not."""
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    row = {"name": "w1", "state": "busy", "model": "smol", "in_flight": 3, "tokens_per_s": 12.0}
    monkeypatch.setattr(client, "workers", lambda: [row, {**row, "name": "w2", "model": "other"}])
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    assert producer_cli.status(_parse("status")) == 0
    assert "warning: the workers on queue 'q' serve several models (other, smol)" in capsys.readouterr().out


# -- result of a job that ended without finishing ---------------------------------------------------------------


def test_result_of_a_failed_job_prints_what_the_worker_stored(monkeypatch, capsys):
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    client.connection.hset("rq:job:j1", "status", "failed")
    stored = {"id": "j1", "status": "failed", "text": "half", "finish_reason": "error", "error": "boom"}
    client.connection.xadd(result_key("j1"), {"type": 2, "return_value": encode_result(stored)})
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    assert producer_cli.result(_parse("result", "j1")) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == stored
    assert err.strip().splitlines() == ["error: job j1: boom (what it had generated is on stdout)"]
    client.connection.xadd(result_key("j1"), {"type": 2, "return_value": encode_result({**stored, "text": None})})
    assert producer_cli.result(_parse("result", "j1")) == 1  # nothing generated: nothing said to be
    assert capsys.readouterr().err.strip() == "error: job j1: boom (what the worker stored is on stdout)"


def test_a_streamed_text_cut_by_an_error_ends_its_line_before_the_error(monkeypatch, capsys):
    """A job canceled (or timed out, or Redis lost) mid-text: stdout had no line end, so the terminal showed
    "...The every error: job ...". A stream's lost Redis pointed at ``result``, not at following it again."""
    import redis

    from producer.generation_job import GenerationJob
    from producer.job_errors import JobCanceled

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    for error, said in [
        (JobCanceled("j", "job canceled", {"text": "The every"}), "error: job j: job canceled"),
        (redis.exceptions.ConnectionError("gone"), "`roseinfer stream "),
        (TimeoutError("job j: no end of stream within 5 s"), "error: job j: no end of stream within"),
    ]:

        def cut(self, timeout=None, index=0, error=error):
            yield "The every"
            raise error

        monkeypatch.setattr(GenerationJob, "stream", cut)
        assert producer_cli.submit(_parse("submit", "hi", "--stream")) in (1, 124)
        out, err = capsys.readouterr()
        assert out == "The every\n" and said in err, (out, err)
    with pytest.raises(InvalidRequest, match="give one of them"):  # (--wait was dropped unsaid)
        producer_cli.submit(_parse("submit", "hi", "--stream", "--wait"))


def test_the_client_takes_openai_shaped_messages_as_the_server_and_llm_chat_do():
    """Content as a list of text parts, and an assistant's turn of tool calls with content null (OpenAI's forms,
    which LLM.chat and the server take): "messages.N.content: Input should be a valid string"."""
    from producer.schema import JobRequest

    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]  # fmt: skip
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    job = client.submit(messages=conversation, max_tokens=4)
    taken = JobRequest.model_validate(job.rq_job.kwargs)  # (as the worker reads it)
    assert [m.text for m in taken.messages] == ["Weather\nin Paris?", "", "sunny"]
    assert isinstance(taken.messages[0].content, list)  # (the parts as given: the engine joins them, or not)
    for bad, said in [
        ({"role": "user", "content": None}, "content is missing"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages.0.content"),
    ]:
        with pytest.raises(InvalidRequest, match=said):
            client.submit(messages=[bad])


def test_submit_many_of_strings_says_what_a_request_is():
    """A list of prompts, as vLLM's generate takes: "dictionary update sequence element #0 has length 1"."""
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    with pytest.raises(InvalidRequest, match=r"request 0: a payload dict, as \{'prompt': \.\.\.\}, got str"):
        client.submit_many(["a", "b"])


@pytest.mark.parametrize("command", ["submit", "result"])
def test_redis_lost_during_a_wait_says_the_job_goes_on_not_to_check_the_url(monkeypatch, capsys, command):
    """Redis gone for longer than a follower waits it out, after the submit went in (or the result's first read
    answered): it said "cannot reach Redis ...; check --redis-url" with exit 2, as for a wrong URL."""
    import redis

    from producer.generation_job import GenerationJob

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)

    def lost(self, timeout=None):
        self.client.reached = True  # (it answered before it went)
        raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(GenerationJob, "result", lost)
    args = _parse("submit", "hi", "--wait") if command == "submit" else _parse("result", "j1")
    assert getattr(producer_cli, command)(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    job_id = client.queue.job_ids[0] if command == "submit" else "j1"
    assert err == (
        "error: lost Redis while waiting (Error 111 connecting to 127.0.0.1:6379. Connection refused.); job "
        f"{job_id} goes on in the workers: `roseinfer result {job_id}` once Redis answers"
    )


@pytest.mark.redis
def test_result_of_a_canceled_job_prints_its_partial_text_and_exits_1(served, redis_url, capsys, monkeypatch):
    worker, client = served
    slow_engine_steps(monkeypatch, worker.worker.engine)
    job = client.submit("Write forever", max_tokens=200, temperature=0, ignore_eos=True)
    next(iter(job.events(timeout=30)))
    assert job.cancel()
    rc = producer_cli.result(
        _parse("result", job.id, "--timeout", "30", "--redis-url", redis_url, "--queue", worker.queue)
    )
    out, err = capsys.readouterr()
    assert rc == 1
    partial = json.loads(out)
    assert partial["status"] == "canceled" and partial["finish_reason"] == "abort"
    assert 0 < partial["usage"]["completion_tokens"] < 200 and len(partial["token_ids"]) > 0
    events = list(job.events(timeout=10))
    assert partial["text"] == "".join(e["text"] for e in events)
    assert err.strip().splitlines() == [f"error: job {job.id}: job canceled (what it had generated is on stdout)"]


@pytest.mark.redis
def test_stream_of_a_job_that_keeps_no_result_prints_its_text_and_exits_0(served, redis_url, capsys):
    """result_ttl 0: RQ deletes the job as it finishes. Followed live, its text was printed, then "result is not kept"
    with exit 1 (a failed job's); once over, "no job on this Redis", its stream still there for ten minutes."""
    from producer import Client

    worker, _ = served
    unkept = Client(redis_url, queue=worker.queue, result_ttl=0)
    argv = ("--timeout", "30", "--redis-url", redis_url, "--queue", worker.queue)
    for wait_first in (False, True):
        job = unkept.submit("Say hi", max_tokens=4, temperature=0)
        if wait_first:
            text = "".join(job.stream(timeout=30))
            assert job.status() == "missing"
        rc = producer_cli.stream(_parse("stream", job.id, *argv))
        out, err = capsys.readouterr()
        assert (
            rc == 0
            and out.strip()
            and err.strip().endswith("[finished; its result is not kept (result_ttl 0, or expired)]")
        )
        if wait_first:
            assert out == text + "\n"


# -- batch: Ctrl-C, resume, reuse, --fresh ----------------------------------------------------------------------


def _batch_input(path, n: int, **body) -> list[str]:
    ids = [f"row-{i}" for i in range(n)]
    path.write_text("".join(json.dumps({"custom_id": c, "prompt": f"Story {c}:", **body}) + "\n" for c in ids))
    return ids


def _rows(path) -> list[dict]:
    text = path.read_text()
    assert not text or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("fresh", [False, True], ids=["plain", "fresh"])
def test_ctrl_c_during_a_batch_says_how_to_resume_and_the_resume_completes_it(
    served, redis_url, tmp_path, monkeypatch, capsys, fresh
):
    worker, _ = served
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _batch_input(src, 16, max_tokens=24, temperature=0.7, ignore_eos=True)
    argv = ["batch", str(src), "-o", str(out), "--max-in-flight", "3", "--redis-url", redis_url]
    argv += ["--queue", worker.queue] + (["--fresh"] if fresh else [])

    real_tick, real_submit = Progress.tick, batch_mod._submit
    seen: dict = {}

    def remember_progress(self):
        seen["progress"] = self
        real_tick(self)

    def submit_then_interrupt_with_rows_done_and_jobs_in_flight(client, pending, flight, *args):
        more = real_submit(client, pending, flight, *args)
        progress = seen.get("progress")
        if progress is not None and progress.done > 0 and flight:  # Ctrl-C now: rows written, jobs running
            raise KeyboardInterrupt
        return more

    monkeypatch.setattr(batch_mod, "_submit", submit_then_interrupt_with_rows_done_and_jobs_in_flight)
    monkeypatch.setattr(Progress, "tick", remember_progress)
    assert producer_cli.batch(_parse(*argv)) == 130
    said = capsys.readouterr()
    err = said.err
    assert "Traceback" not in err
    first = _rows(out)  # every line complete
    assert 0 < len(first) < 16
    summary = json.loads(said.out)  # the counts so far on stdout, as a run's summary
    assert (summary["total"], summary["succeeded"], summary["in_output"]) == (16, len(first), len(first))
    assert f"interrupted: {len(first)} rows in {out} ({len(first)} of them from this run), 0 in " in err
    command = err.strip().splitlines()[-1].strip()
    assert command.startswith(f"roseinfer batch {shlex.quote(str(src))} -o {shlex.quote(str(out))} ")
    assert "--fresh" not in command and ("--run-id" in command) == fresh
    assert f"--queue {worker.queue}" in command and "--max-in-flight 3" in command
    # "the same command again" would be another --fresh run: its id pinned is the one to run
    assert ("run this command (the run's --run-id, not --fresh)" in err) == fresh
    assert ("run the same command again" in err) == (not fresh)

    monkeypatch.setattr(Progress, "tick", real_tick)

    def interrupt(*args):
        raise KeyboardInterrupt

    # A resume stopped before its reader reached the rows done said "0 of 16 rows done (0 in out.jsonl ...)".
    monkeypatch.setattr(batch_mod, "_submit", interrupt)
    assert producer_cli.batch(_parse(*shlex.split(command)[1:])) == 130
    assert f"interrupted: {len(first)} rows in {out} (0 of them from this run), 0 in " in capsys.readouterr().err
    monkeypatch.setattr(batch_mod, "_submit", real_submit)
    with out.open("a") as f:
        f.write('{"custom_id": "row-1')  # a row cut short, as by a kill mid-write: dropped, not glued to the next
    argv = shlex.split(command)
    assert argv[0] == "roseinfer"
    assert producer_cli.batch(_parse(*argv[1:])) == 0
    summary = json.loads(capsys.readouterr().out)  # (stdout holds it alone: a script's `| jq .failed`)
    rows = _rows(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(ids)  # each row once
    assert summary["skipped"] == len(first) and summary["succeeded"] == 16 - len(first)
    assert summary["reused"] >= 1  # the jobs in flight at Ctrl-C were picked up, in both modes
    if fresh:  # the resumed --fresh run kept its own job ids
        run_id = argv[argv.index("--run-id") + 1]
        assert all(r["response"]["request_id"].startswith(f"batch-{run_id}-") for r in rows)
    # A mistyped --run-id was a new run: every row left submitted again under new ids (none left here: still said).
    typo = [a if a != run_id else "typo123" for a in argv[1:]] if fresh else [*argv[1:], "--run-id", "typo123"]
    assert producer_cli.batch(_parse(*typo)) == 2
    said = f"was made by run {run_id}, not run typo123" if fresh else "a run of no run id"
    assert said in capsys.readouterr().err


def test_a_fresh_run_says_its_id_only_once_it_is_taken(tmp_path, capsys):
    """--fresh said "its jobs' ids name run X; a rerun without --fresh resumes it" before anything was checked: a run
    then refused (Redis unreachable, other settings) had no id kept, and nothing to resume."""

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "p"}) + "\n")
    argv = ["batch", str(src), "-o", str(out), "--fresh", "--redis-url", "redis://127.0.0.1:1/0"]  # (nothing there)
    with pytest.raises(redis.exceptions.ConnectionError):  # (one line from the command's main)
        producer_cli.batch(_parse(*argv))
    assert "a fresh run" not in capsys.readouterr().err


@pytest.mark.slow  # a second or more: the full suite's (the fast lane stays under a minute)
@pytest.mark.redis
@pytest.mark.parametrize(
    ("error", "said"),
    [
        ("ConnectionError", "Connection refused"),
        ("OutOfMemoryError", "command not allowed when used memory > 'maxmemory'."),
        ("ReadOnlyError", "You can't write against a read only replica."),
        ("ResponseError", "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist"),
    ],
)
def test_redis_lost_during_a_batch_says_how_to_resume_not_to_check_the_url(
    redis_url, tmp_path, monkeypatch, capsys, error, said
):
    """Redis gone mid-run for longer than the run waits for it ended the batch with "cannot reach Redis ...; check
    --redis-url", as if the URL were wrong, with no count and no way to resume. It says what it was, what was done,
    and the command that resumes, as after Ctrl-C. A Redis refusing writes for now (full with noeviction, a replica
    after a failover, a failed snapshot) is waited out the same way: it ended the run at once with exit 2, the code
    of a bad flag, and no resume command."""
    import uuid

    import redis

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _batch_input(src, 8, max_tokens=4)
    queue = f"nobody-{uuid.uuid4().hex[:8]}"
    argv = ["batch", str(src), "-o", str(out), "--max-in-flight", "3", "--redis-url", redis_url, "--queue", queue]
    real_submit, calls = batch_mod._submit, []

    def submit_then_lose_redis(*args):
        calls.append(1)
        if len(calls) >= 2:
            raise getattr(redis.exceptions, error)(said)
        return real_submit(*args)

    monkeypatch.setattr(batch_mod, "_submit", submit_then_lose_redis)
    monkeypatch.setattr(batch_mod, "REDIS_PATIENCE_S", 1.0)
    assert producer_cli.batch(_parse(*argv)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "check --redis-url" not in err
    assert f"Redis unavailable for over 1 s during the run ({said}): 0 rows in {out} (0 of them from this run)" in err
    assert len(calls) > 2  # (tried again before giving up)
    assert "To resume once Redis answers, run the same command again" in err
    assert err.strip().splitlines()[-1].strip().startswith(f"roseinfer batch {shlex.quote(str(src))} ")


def test_a_disk_full_mid_run_says_what_was_done_and_how_to_resume(redis_url, tmp_path, monkeypatch, capsys):
    """A write that failed mid-run (ENOSPC) was "error: [Errno 28] No space left on device", exit 2 (a bad flag's
    code): no file, no count, no resume command."""
    import errno
    import uuid

    from producer.batch_io import JSONLSink

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _batch_input(src, 3, max_tokens=4)
    with src.open("a") as f:
        f.write("not json\n")  # its error line is the write that fails

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(JSONLSink, "error", full)
    queue = f"nobody-{uuid.uuid4().hex[:8]}"
    argv = ["batch", str(src), "-o", str(out), "--redis-url", redis_url, "--queue", queue]
    assert producer_cli.batch(_parse(*argv)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: [Errno" not in err
    assert "the run stopped on the system's error ([Errno 28] No space left on device): " in err
    assert "To resume once that is fixed, run the same command again" in err
    assert err.strip().splitlines()[-1].strip().startswith(f"roseinfer batch {shlex.quote(str(src))} ")


def test_paths_a_run_cannot_use_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """stdout as the output hung (read back for the rows done) and left /dev/stdout.lock behind; '-' was a file of
    that name, or "pass --format"; a missing errors folder was found once a --fresh run had taken its id; a CSV
    input was told to pass --format, which has no CSV."""
    src = tmp_path / "in.jsonl"
    _batch_input(src, 2)
    (tmp_path / "in.csv").write_text("prompt\nhi\n")
    monkeypatch.chdir(tmp_path)
    cases = [
        (["in.jsonl", "-o", "-", "--output-format", "jsonl"], "the output cannot be stdin or stdout ('-')"),
        (["-", "-o", "out.jsonl", "--format", "jsonl"], "the input cannot be stdin or stdout ('-')"),
        (["in.jsonl", "-o", "/dev/null", "--output-format", "jsonl"], "the output /dev/null is not a regular file"),
        (["in.jsonl", "-o", "out.jsonl", "--errors", "gone/e.jsonl", "--fresh"], "the errors file's folder gone"),
        (["in.csv", "-o", "out.jsonl"], "in.csv: CSV is not read; convert it to JSONL or Parquet"),
        # (the errno's words, "[Errno 21] Is a directory: 'd'", the dry run's too)
        (["in.jsonl", "-o", "out.jsonl", "--errors", str(tmp_path), "--dry-run"], "is a folder: give --errors a file"),
    ]
    for argv, said in cases:
        assert producer_cli.batch(_parse("batch", *argv, "--redis-url", "redis://127.0.0.1:1/0")) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "a fresh run" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.csv", "in.jsonl"]  # nothing written


def test_an_outputs_extension_says_its_format_over_format(tmp_path, monkeypatch):
    """--format jsonl with -o out.parquet wrote JSONL text into out.parquet (--format set both formats)."""
    seen = {}

    def run_batch(client, input_path, output_path, **kwargs):
        seen.update(kwargs, output=Path(output_path))
        return {"total": 0, "skipped": 0, "succeeded": 0, "failed": 0, "reused": 0, "failures": {}}

    monkeypatch.setattr(batch_mod, "run_batch", run_batch)
    src = tmp_path / "in.txt"
    src.write_text("")
    for output, extra, expected in [
        ("out.parquet", [], "parquet"),
        ("out.data", [], "jsonl"),  # (no extension that says: --format's)
        ("out.parquet", ["--output-format", "jsonl"], "jsonl"),  # (said outright)
    ]:
        argv = ["batch", str(src), "-o", str(tmp_path / output), "--format", "jsonl", *extra]
        assert producer_cli.batch(_parse(*argv)) == 0
        formats = batch_mod._formats(src, seen["input_format"], seen["output"], seen["output_format"])
        assert formats == ("jsonl", expected), output


@pytest.mark.slow
@pytest.mark.redis
def test_a_rerun_into_a_new_output_says_it_reused_results_and_fresh_generates_again(
    served, redis_url, tmp_path, capsys
):
    worker, _ = served
    src = tmp_path / "in.jsonl"
    _batch_input(src, 4, max_tokens=12, temperature=1.0, ignore_eos=True)  # sampled, no seed
    conn = ["--redis-url", redis_url, "--queue", worker.queue]

    def run(name: str, *extra: str) -> tuple[dict, str, dict[str, dict]]:
        out = tmp_path / name
        assert producer_cli.batch(_parse("batch", str(src), "-o", str(out), *conn, *extra)) == 0
        said = capsys.readouterr()
        return json.loads(said.out), said.err, {r["custom_id"]: r for r in _rows(out)}

    first, err, rows1 = run("one.jsonl")
    assert first["reused"] == 0 and "earlier run" not in err
    one = tmp_path / "one.jsonl"
    one.write_text("".join(one.read_text().splitlines(keepends=True)[:2]))  # as a run interrupted after 2 rows
    resumed, err, _ = run("one.jsonl")  # a resume: the 2 picked up are its own jobs, --fresh would waste them
    assert (resumed["skipped"], resumed["reused"]) == (2, 2) and "note:" not in err
    again, err, rows2 = run("two.jsonl")
    assert again["reused"] == 4 and again["succeeded"] == 4
    assert "note: 4 rows were taken from jobs of an earlier run still in Redis" in err and "--fresh" in err
    assert "(4 from an earlier run's jobs)" in err  # the summary line says it too
    assert rows2 == rows1  # the same samples: what the note warns about
    fresh, err, rows3 = run("three.jsonl", "--fresh")
    assert fresh["reused"] == 0 and fresh["succeeded"] == 4 and "earlier run" not in err
    assert all(rows3[c]["response"]["request_id"] != rows1[c]["response"]["request_id"] for c in rows1)
    assert _texts(rows3) != _texts(rows1)  # new samples


def _texts(rows: dict[str, dict]) -> list[str]:
    return [rows[c]["response"]["body"]["choices"][0]["text"] for c in sorted(rows)]


def test_batch_help_names_the_real_errors_file_and_the_new_flags():
    text = _help("batch")
    assert "out.jsonl -> out.errors.jsonl" in text
    assert "--log-interval" in text and "default: 10.0" in text
    assert "--fresh" in text and "--run-id" in text
    with pytest.raises(SystemExit) as exit_:
        _parse("batch", "in.jsonl", "-o", "out.jsonl", "--run-id", "not/ok")
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        _parse("batch", "in.jsonl", "-o", "out.jsonl", "--run-id", "abc", "--fresh")


def test_a_missing_input_file_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(producer_cli, "_client", lambda args: Client(connection=fakeredis.FakeRedis(), queue="q"))
    args = _parse("batch", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert producer_cli.batch(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the input {tmp_path / 'nope.jsonl'} does not exist" in err  # (not an errno's)


@pytest.mark.redis
def test_a_wait_that_runs_out_or_a_database_redis_lacks_is_one_line_not_a_traceback(redis_url, capsys):
    """``--timeout`` of a result running out is one line and exit 124 (as timeout(1)); the job stays queued. A Redis
    URL naming a database the server lacks is one line and exit 2."""
    import asyncio
    import uuid

    from worker.cli import main

    queue = f"nobody-{uuid.uuid4().hex[:6]}"
    job = Client(redis_url, queue=queue).submit("x", max_tokens=2)
    assert main(["result", job.id, "--redis-url", redis_url, "--queue", queue, "--timeout", "0.3"]) == 124
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no result within 0.3 s" in err and job.status() == "queued"
    assert f"it goes on in the workers: `roseinfer result {job.id} --redis-url" in err  # and how to stop it
    # A wait on a queue no worker serves says so (it waited in silence, for good without --timeout).
    assert main(["submit", "x", "--wait", "--redis-url", redis_url, "--queue", queue, "--timeout", "0.3"]) == 124
    err = capsys.readouterr().err
    assert f"no live worker serves queue {queue!r}" in err and err.count("\n") == 3
    # (how to start one names this Redis: one started without it served the default)
    assert f"(roseinfer worker --redis-url {redis_url} --queue {queue};" in err
    from producer import AsyncClient

    async def async_warning() -> str | None:
        async with AsyncClient(redis_url, queue=queue) as aclient:
            return await aclient.no_worker_warning()

    assert asyncio.run(async_warning()) == Client(redis_url, queue=queue).no_worker_warning()  # (the async twin's)
    # ``stream`` of a job warns about the job's own queue (its lane's), whatever --queue says: an id is Redis-wide.
    lane = Client(redis_url, queue=queue).submit("x", max_tokens=2, priority=-5)
    assert main(["stream", lane.id, "--redis-url", redis_url, "--timeout", "0.3"]) == 124
    err = capsys.readouterr().err
    assert f"no live worker serves queue {queue!r}" in err and "'roseinfer'" not in err
    assert re.search(r"no end of stream within 0\.\d+ s;", err)  # (what was left of 0.3 s, not 0.29999873...)
    bad_db = redis_url.rsplit("/", 1)[0] + "/999"
    assert main(["status", "--redis-url", bad_db]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DB index is out of range" in err


def test_a_batch_waiting_on_a_queue_no_worker_serves_says_so_once_a_time(monkeypatch):
    from producer.batch import Progress, WorkerWatch

    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    out = io.StringIO()
    watch = WorkerWatch(client, Progress(3, 0, stream=out))
    said = []
    for live in ([], [], [{"name": "w"}], [], []):  # no worker, still none, one came, it went, still gone
        monkeypatch.setattr(client, "workers", lambda live=live: live)
        watch.next_check = 0.0
        watch.check()
        said.append(out.getvalue().count("no live worker serves queue 'q'"))
    assert said == [1, 1, 1, 2, 2]


def test_a_streamed_result_without_a_first_token_time_still_prints_its_summary(monkeypatch, capsys):
    client = Client(connection=fakeredis.FakeRedis(), queue="q")

    class Job:
        id = "j1"

        def stream(self, timeout=None):
            return iter(())

        def result(self, timeout=None):
            usage = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
            return {"finish_reason": "stop", "usage": usage, "timings": {"ttft_s": None}}

    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    monkeypatch.setattr(client, "submit", lambda *a, **k: Job())
    assert producer_cli.submit(_parse("submit", "hi", "--stream")) == 0
    assert "ttft -]" in capsys.readouterr().err


def test_a_streamed_output_that_restarts_says_stdout_holds_void_text_and_exits_1(monkeypatch, capsys):
    """Its void text was already on stdout (a file, a pipe) and the new answer was appended to it, exit 0."""
    from producer.job_errors import StreamRestarted

    client = Client(connection=fakeredis.FakeRedis(), queue="q")

    class Job:
        id, calls = "j1", 0

        def stream(self, timeout=None):
            Job.calls += 1
            yield "VOID " if Job.calls == 1 else "New answer"
            if Job.calls == 1:
                raise StreamRestarted(self.id)

        def result(self, timeout=None):
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            return {"finish_reason": "stop", "usage": usage, "timings": {"ttft_s": 0.1}, "text": "New answer"}

    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    monkeypatch.setattr(client, "submit", lambda *a, **k: Job())
    assert producer_cli.submit(_parse("submit", "hi", "--stream")) == 1
    out, err = capsys.readouterr()
    assert out == "VOID New answer\n" and "stdout holds void text" in err and "roseinfer result j1" in err


@pytest.mark.redis
def test_stream_follows_a_job_from_its_first_token_from_any_shell(served, redis_url, capsys):
    """After a Ctrl-C, or for a job submitted elsewhere, only ``result`` was left: no way to follow its text."""
    worker, client = served
    job = client.submit("Stream me again", max_tokens=6, temperature=0, ignore_eos=True)
    connection = ("--redis-url", redis_url, "--queue", worker.queue)
    assert producer_cli.stream(_parse("stream", job.id, "--timeout", "60", *connection)) == 0
    out, err = capsys.readouterr()
    result = job.result(timeout=10)
    assert out == result["text"] + "\n" and "[length; " in err and "+ 6 completion tokens" in err
    assert producer_cli.stream(_parse("stream", "no-such-job", *connection)) == 1
    assert capsys.readouterr().err.strip() == "error: no job no-such-job on this Redis (never submitted, or expired)"


def test_submit_takes_a_whole_conversation_with_messages_and_stream_refuses_a_job_of_several_samples(
    monkeypatch, capsys
):
    """No flag took ``messages``: a system message or earlier turns could not be sent from the command line. And
    ``roseinfer stream`` of a job of n > 1 printed sample 0 alone with the usage of all, exit 0."""
    conversation = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    request = producer_cli.request_from_args(_parse("submit", "--messages", json.dumps(conversation)))
    assert request == {"messages": conversation}
    with pytest.raises(InvalidRequest, match="give a prompt or --messages, not both"):
        producer_cli.request_from_args(_parse("submit", "Hi", "--messages", json.dumps(conversation)))
    client = Client(connection=fakeredis.FakeRedis(), queue="q")
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    job = client.submit(messages=conversation, n=2, temperature=1.0, max_tokens=4)
    with pytest.raises(InvalidRequest, match=f"job {job.id} makes 2 samples: `roseinfer result {job.id}`"):
        producer_cli.stream(_parse("stream", job.id))


def test_ctrl_c_while_submit_waits_says_the_job_goes_on_and_how_to_cancel_it(monkeypatch, capsys):
    """It said "interrupted" alone: whether the job went on, and how to stop it, was left to guess."""
    client = Client(connection=fakeredis.FakeRedis(), queue="q")

    class Job:
        id = "j7"

        def result(self, timeout=None):
            raise KeyboardInterrupt

    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    monkeypatch.setattr(client, "submit", lambda *a, **k: Job())
    assert producer_cli.submit(_parse("submit", "hi", "--wait")) == 130
    err = capsys.readouterr().err
    assert "job j7 goes on in the workers" in err and "`roseinfer cancel j7`" in err
    # A wait for the result is taken up by `result` (`stream` printed text where JSON was asked for, and refused a
    # job of n > 1 samples, pointing back to `result`: a circle); a streamed one by `stream`.
    assert "`roseinfer result j7` waits for its result again" in err
    Job.stream = lambda self, timeout=None: (_ for _ in ()).throw(KeyboardInterrupt)
    assert producer_cli.submit(_parse("submit", "hi", "--stream")) == 130
    assert "`roseinfer stream j7` follows it again" in capsys.readouterr().err
    monkeypatch.setattr(client, "job", lambda job_id: Job())  # (`result`'s own wait: a bare "interrupted")
    assert producer_cli.result(_parse("result", "j7")) == 130
    err = capsys.readouterr().err
    assert "job j7 goes on in the workers" in err and "`roseinfer result j7` waits for its result again" in err
    # The commands it prints reach the Redis and queue this one was given: pasted as printed, they found no job. A
    # password in the URL is left out (stderr goes to logs).
    url = "redis://10.0.0.5:6379/3"
    assert producer_cli.submit(_parse("submit", "hi", "--wait", "--redis-url", url, "--queue", "my q")) == 130
    err = capsys.readouterr().err
    assert f"`roseinfer cancel j7 --redis-url {url} --queue 'my q'` stops it" in err
    secret = "redis://default:s3cret@10.0.0.5:6379/3"
    assert producer_cli.submit(_parse("submit", "hi", "--wait", "--redis-url", secret)) == 130
    err = capsys.readouterr().err
    assert "s3cret" not in err and "--redis-url 'redis://***@10.0.0.5:6379/3'" in err


def test_a_prompt_that_is_not_utf8_or_starts_with_a_bom_is_read_as_its_text(monkeypatch):
    """Bytes that were not UTF-8 (read with surrogateescape) were enqueued, and the job failed late on the worker's
    tokenizer with an unclear error; a file's byte order mark went into the prompt."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("\ufeffHello"))
    assert producer_cli.request_from_args(_parse("submit", "-", "--raw"))["prompt"] == "Hello"
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))  # an empty pipe ran an empty user message
    with pytest.raises(InvalidRequest, match="the prompt on stdin is empty"):
        producer_cli.request_from_args(_parse("submit", "-"))
    with pytest.raises(InvalidRequest, match="not valid Unicode: a lone surrogate"):
        producer_cli.request_from_args(_parse("submit", "caf\udce9"))
    # Piped bytes: under a strict locale a Latin-1 file's were a UnicodeDecodeError with a traceback.
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\ufeffcafé".encode()), encoding="ascii"))
    assert producer_cli.request_from_args(_parse("submit", "-", "--raw"))["prompt"] == "café"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("café".encode("latin-1")), encoding="utf-8"))
    with pytest.raises(InvalidRequest, match="the prompt on stdin is not UTF-8 text"):
        producer_cli.request_from_args(_parse("submit", "-", "--raw"))


def test_a_job_whose_payload_rq_cannot_read_has_no_sample_count_not_a_traceback():
    """Enqueued by stock RQ (pickle): ``roseinfer stream`` died on RQ's DeserializationError asking its n, where
    ``result`` said the worker's reason."""
    from rq import Queue

    conn = fakeredis.FakeRedis()
    rq_job = Queue("q", connection=conn).enqueue("worker.jobs.generate", prompt="hi")  # (RQ's default: pickle)
    job = Client(connection=conn, queue="q").job(rq_job.id)
    assert job.samples() is None
    job.check_sample(1)  # (n unknown: only a negative index is judged)


def test_cancel_of_a_job_hash_rq_cannot_read_marks_it_canceled(monkeypatch, capsys):
    """A job written by hand in another language, with a stamp RQ cannot parse: ``roseinfer cancel`` marks it
    canceled as any language would (the worker honours the status), not a traceback with the job left queued."""
    conn = fakeredis.FakeRedis()
    conn.hset("rq:job:hand-1", mapping={"status": "queued", "created_at": "yesterday", "origin": "q", "data": b"x"})
    conn.rpush("rq:queue:q", "hand-1")
    client = Client(connection=conn, queue="q")
    monkeypatch.setattr(producer_cli, "_client", lambda args: client)
    assert producer_cli.cancel(_parse("cancel", "hand-1")) == 0
    assert conn.hget("rq:job:hand-1", "status") == b"canceled"
    assert client.job("hand-1").cancel() is False  # ended already


@pytest.mark.parametrize("command", [["submit", "hi"], ["result", "some-job"]])
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_wait_timeout_is_refused_before_redis(command, value, capsys):
    """``--timeout -1`` enqueued the job, then gave up at once (exit 124)."""
    from worker.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, "--timeout", value, "--redis-url", "redis://127.0.0.1:1/0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--timeout: must be at least 0" in err
    assert err.count("\n") == 1 and err.endswith(f"(see roseinfer {command[0]} --help)\n")  # (not 25 lines of usage)


@pytest.mark.parametrize("command", [["submit", "hi"], ["worker"], ["bench-queue"]])
def test_an_unknown_flag_is_said_by_the_command_it_was_given_to(command, capsys):
    """``roseinfer submit hi --bogus`` said "see roseinfer --help", which lists no command's flags."""
    from worker.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*command, "--bogus", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    name = f"roseinfer {command[0]}"
    assert err == f"{name}: error: unrecognized arguments: --bogus x (see {name} --help)\n"


@pytest.mark.slow
@pytest.mark.redis
def test_output_piped_to_a_reader_that_leaves_ends_quietly(redis_url):
    """``roseinfer ... | head``: a BrokenPipeError traceback, exit 1. Now quiet, 141 as a command SIGPIPE ends."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "worker.cli", "status", "--json", "--redis-url", redis_url]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and b"Traceback" not in err


def test_batch_chat_flags_are_checked_and_kept_in_the_resume_command():
    args = _parse("batch", "in.parquet", "-o", "out.parquet", "--chat", "--system", "Be brief.")
    options = producer_cli.batch_options(args)
    assert (options.chat, options.system) == (True, "Be brief.")
    assert "--chat --system 'Be brief.'" in producer_cli.resume_command(args, None)
    with pytest.raises(InvalidRequest, match="--system goes with --chat"):
        producer_cli.batch_options(_parse("batch", "in.parquet", "-o", "out.parquet", "--system", "x"))


def test_a_bare_schema_file_names_its_schema_after_the_file_in_the_apis_letters(tmp_path):
    """``person.schema.json`` was refused: the name came straight from the file name, whose dot the API's pattern
    for a schema's name does not allow."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    for file, name in (("person.schema.json", "person_schema"), ("my pérson.json", "my_p_rson")):
        (tmp_path / file).write_text(json.dumps(schema))
        fmt = producer_cli._response_format(str(tmp_path / file))
        assert fmt["json_schema"] == {"name": name, "schema": schema}
        assert JobRequest.model_validate({"prompt": "p", "response_format": fmt}).response_format is not None


def test_first_hour_mistakes_get_one_line_each(tmp_path, monkeypatch, capsys):
    """``batch --count-tokens`` without ``--dry-run`` ran the whole batch (the flag read only in a dry run); a
    command whose extra is not installed was a ModuleNotFoundError traceback; ``--quantization none``, the word the
    help and the error message use, was refused."""
    import builtins

    from worker import cli
    from worker.settings import WorkerSettings

    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    assert cli.main(["batch", str(rows), "-o", str(tmp_path / "out.jsonl"), "--count-tokens", "tiny"]) == 2
    assert "--count-tokens goes with --dry-run" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    both = ["--prompt-column", "q", "--messages-column", "q"]  # (the messages column won, every row then failing)
    assert cli.main(["batch", str(rows), "-o", str(tmp_path / "out.jsonl"), *both]) == 2
    assert "--prompt-column or --messages-column" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()

    real_import = builtins.__import__

    def no_fastapi(name, *args, **kwargs):
        if name.split(".")[0] == "fastapi":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "producer.server", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    assert cli.main(["serve", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "roseinfer serve needs fastapi: pip install 'roseinfer[server]'" in capsys.readouterr().err

    def no_metrics(name, *args, **kwargs):  # (a worker imports prometheus_client before torch)
        if name.split(".")[0] == "prometheus_client":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    for name in ("worker.main", "worker.metrics"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    monkeypatch.setattr(builtins, "__import__", no_metrics)
    assert cli.main(["worker", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "needs prometheus_client: pip install 'roseinfer[engine]'" in capsys.readouterr().err  # (was [server])
    monkeypatch.setattr(builtins, "__import__", real_import)

    monkeypatch.setenv("ROSEINFER_QUANTIZATION", "int8")
    args = cli.build_parser().parse_args(["worker", "--quantization", "none"])
    assert cli.load_settings(args).engine_config().quantization is None
    assert WorkerSettings().engine_config().quantization == "int8"
    # The settings keep the flag's word: it showed in every result's fingerprint ("...-float32-none") and the status.
    from worker.jobs import system_fingerprint

    assert system_fingerprint(cli.load_settings(args)) == system_fingerprint(WorkerSettings(quantization=None))


def test_serve_refuses_a_port_out_of_range_a_timeout_not_above_0_and_a_port_taken_in_one_line(capsys):
    """``--port 99999`` was two tracebacks from uvicorn; ``--timeout -5`` answered every request 504; a port taken
    logged "serving" first, then uvicorn's error."""
    import socket

    from worker.cli import main

    for flags, said in ((["--port", "99999"], "a port is at most 65535"), (["--timeout", "-5"], "must be above 0")):
        with pytest.raises(SystemExit) as exited:
            main(["serve", *flags])
        assert exited.value.code == 2 and said in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    said = f"error: cannot listen on 127.0.0.1:{port} (Address already in use); choose another --host or --port\n"
    assert err == said
    # An IPv6 host is resolved as uvicorn resolves it (the check tried it as IPv4, and refused a host that works).
    from worker.cli import _check_listen

    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as probe:
            free6 = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    _check_listen("::1", free6)


def test_serve_takes_its_allowed_origins_space_or_comma_separated(monkeypatch, capsys):
    """``--allowed-origins a,b`` (or the variable so written) was one origin, "a,b", which no browser sends; nor
    does any send a path, a trailing slash or no scheme: those are refused in one line."""

    import producer.server
    from worker.cli import main

    monkeypatch.setattr("worker.cli._check_listen", lambda host, port: None)  # (run_server is not run: no port)
    port = "8000"
    given = []
    monkeypatch.setattr(producer.server, "run_server", lambda *a, **kw: given.append(kw["allowed_origins"]) or 0)
    assert main(["serve", "--port", port, "--allowed-origins", "http://a.example,http://b.example", "http://c"]) == 0
    monkeypatch.setenv("ROSEINFER_ALLOWED_ORIGINS", "http://d, http://e")
    assert main(["serve", "--port", port]) == 0
    assert given == [["http://a.example", "http://b.example", "http://c"], ["http://d", "http://e"]]
    monkeypatch.delenv("ROSEINFER_ALLOWED_ORIGINS")
    capsys.readouterr()
    for slip in ("localhost:3000", "http://ui.example/", "http://ui.example/app"):  # (they matched no request)
        assert main(["serve", "--port", port, "--allowed-origins", slip]) == 2
        assert (
            capsys.readouterr().err.strip() == f"error: --allowed-origins (or ROSEINFER_ALLOWED_ORIGINS) {slip!r}: an "
            "origin is scheme://host[:port], as a browser sends it (e.g. http://localhost:3000, no path or trailing "
            "slash), or *"
        )
    assert main(["serve", "--port", port, "--allowed-origins", "*", "chrome-extension://abc", "http://[::1]:8080"]) == 0
    assert len(given) == 3
    # As a browser writes its Origin (compared byte for byte): "HTTP://Good.Example" or a default port matched none.
    origins = ["HTTP://Good.Example", "http://good.example:80", "https://x.example:443", "https://x.example:8443"]
    assert main(["serve", "--port", port, "--allowed-origins", "http://a.example, http://b.example", *origins]) == 0
    assert given[-1] == ["http://a.example", "http://b.example", "http://good.example", "http://good.example",
                         "https://x.example", "https://x.example:8443"]  # fmt: skip


def test_serve_refuses_an_empty_api_key(monkeypatch, capsys):
    """``--api-key "$KEY"`` with KEY unset served every request, with no word of it."""

    import producer.server
    from worker.cli import main

    monkeypatch.setattr("worker.cli._check_listen", lambda host, port: None)  # (run_server is not run: no port)
    port = "8000"
    monkeypatch.setattr(producer.server, "run_server", lambda *a, **kw: 0)
    assert main(["serve", "--port", port, "--api-key", ""]) == 2
    assert "--api-key is empty (an unset variable?)" in capsys.readouterr().err
    assert main(["serve", "--port", port, "--api-key", "k"]) == 0


def test_a_batch_that_cannot_reach_redis_writes_nothing(tmp_path, capsys):
    """README: a run refused before it starts writes nothing. Its settings file was written before Redis was asked,
    and stayed."""
    from worker.cli import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(rows), "-o", str(out), "--max-tokens", "5", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "cannot reach Redis" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_a_list_flags_length_bound_counts_values_not_characters():
    flags = {f.field: f for f in producer_cli.payload_flags()}
    assert "at most 1024 values" in flags["stop_token_ids"].help and "characters" not in flags["stop_token_ids"].help


def test_an_input_that_is_not_parquet_is_named_and_demo_refuses_a_bad_max_tokens_before_loading(
    tmp_path, capsys, monkeypatch
):
    """pyarrow's "Parquet magic bytes not found in footer" named no file; ``demo --max-tokens -1`` loaded the model
    (seconds) before the job was refused."""
    pytest.importorskip("pyarrow")
    from worker.cli import main

    fake = tmp_path / "rows.parquet"
    fake.write_text("not parquet")
    assert main(["batch", str(fake), "-o", str(tmp_path / "out.jsonl"), "--dry-run"]) == 2
    assert f"error: {fake} is not a Parquet file (" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--max-tokens", "-1", "hi"])
    assert exited.value.code == 2 and "must be at least 1" in capsys.readouterr().err
    # An empty prompt (generate and submit refuse it: the demo ran it), and a bad setting said before the embedded
    # Redis starts, not after its line.
    assert main(["demo", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: a prompt is empty: give text, or no prompt for the demo's own"
    assert main(["demo", "--dtype", "float16"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --dtype / ROSEINFER_DTYPE: dtype float16 is for GPUs")
    # (the early look takes the embedded Redis's URL, as the demo's worker does: not a ROSEINFER_REDIS_URL of elsewhere)
    import worker.local_redis

    class Started(Exception):
        pass

    def started() -> str:
        raise Started

    monkeypatch.setattr(worker.local_redis, "start_embedded_redis", started)
    monkeypatch.setenv("ROSEINFER_REDIS_URL", "not-a-url")
    with pytest.raises(Started):
        main(["demo", "hi"])


def test_a_submit_option_that_would_do_nothing_is_refused():
    """``--timeout`` without --stream or --wait, and ``--raw`` with --messages, were dropped without a word (exit 0)."""
    with pytest.raises(InvalidRequest, match="--timeout bounds the wait of --stream or --wait"):
        producer_cli.submit(_parse("submit", "hi", "--timeout", "5"))
    with pytest.raises(InvalidRequest, match=r"--raw .* takes no --messages"):
        producer_cli.request_from_args(_parse("submit", "--raw", "--messages", '[{"role": "user", "content": "x"}]'))
    assert producer_cli.request_from_args(_parse("submit", "--raw", "--prompt-token-id", "5")) == {
        "prompt_token_ids": [5]
    }


def test_a_fresh_run_stopped_before_it_began_says_to_run_it_fresh_again(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a --fresh run's first pass (counting a large input's rows), before its id was the output's: the
    command it printed pinned that id, which the output (an earlier run's) does not keep, and was refused."""
    from producer.batch import settings_path

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "p"}) + "\n")
    out.write_text(json.dumps({"custom_id": "z", "response": {}}) + "\n")
    settings_path(out).write_text(json.dumps({"run_id": "aaaa1111"}) + "\n")  # (an earlier --fresh run's)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_mod, "count_rows", interrupted)
    assert producer_cli.batch(_parse("batch", str(src), "-o", str(out), "--fresh")) == 130
    command = capsys.readouterr().err.strip().splitlines()[-1].strip()
    assert "--fresh" in command.split() and "--run-id" not in command
    assert json.loads(settings_path(out).read_text())["run_id"] == "aaaa1111"
    out.unlink()  # (its settings left beside no output: a first --run-id run of it is its own)
    batch_mod.check_resumed_run(out, "other1")
    # A Parquet output's run killed outright left its rows in a .partial, never closed: its run id is kept.
    parquet = tmp_path / "out.parquet"
    settings_path(parquet).write_text(json.dumps({"run_id": "aaaa1111"}) + "\n")
    batch_mod.check_resumed_run(parquet, "other1")
    parquet.with_name("out.parquet.partial").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="made by run aaaa1111, not run other1"):
        batch_mod.check_resumed_run(parquet, "other1")


def test_a_queue_name_no_worker_serves_is_refused_by_the_client_and_the_commands(monkeypatch, capsys):
    """``submit --queue "a,b"`` took a job no worker can serve (a worker refuses the name), and ``--queue ""`` (or
    ROSEINFER_QUEUE set empty) fell back to the default queue, where the worker given the same refuses it."""
    import fakeredis

    from producer import Client
    from producer.protocol import InvalidQueueName
    from worker.cli import main

    for name in ("a,b", "", "  ", "jobs:p10", "jobs:p-5", "jobs:p05"):
        with pytest.raises(InvalidQueueName):
            Client(connection=fakeredis.FakeRedis(), queue=name)
    Client(connection=fakeredis.FakeRedis(), queue="roseinfer:prod")  # (not a lane's name)
    assert main(["submit", "hi", "--queue", "a,b"]) == 2
    assert "--queue / ROSEINFER_QUEUE 'a,b': a queue name cannot hold a comma" in capsys.readouterr().err
    monkeypatch.setenv("ROSEINFER_QUEUE", "")
    assert main(["status"]) == 2
    assert "--queue / ROSEINFER_QUEUE '': a queue name cannot be empty or blank" in capsys.readouterr().err
    # A lane's name: a worker of "jobs:p10" ran its bulk jobs at priority 0, a warning each, unseen by status.
    assert main(["submit", "hi", "--queue", "jobs:p10"]) == 2
    assert "'jobs:p10' is named as a priority lane" in capsys.readouterr().err


def test_a_stdout_that_is_not_utf8_writes_what_it_lacks_as_question_marks(monkeypatch):
    """``PYTHONIOENCODING=ascii`` (or a Windows console's cp1252): a streamed text's first character the encoding
    lacks was a UnicodeEncodeError traceback mid-job, the job going on unsaid."""
    from worker.cli import _tolerant_output

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr("sys.stdout", out)
    _tolerant_output()
    out.write("café ☕\n")
    out.flush()
    assert raw.getvalue() == b"caf? ?\n"


def test_a_batch_timeout_past_the_jobs_own_limit_raises_it(monkeypatch, tmp_path):
    """``batch --timeout 7200``: its jobs kept the client's hour, the worker ended each attempt at it first (a timeout,
    retried), and the run's own --timeout never came into play."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "prompt": "p"}) + "\n")
    limits = []

    def fake_run(client, *args, **kwargs):
        limits.append(client.job_timeout)
        return {"total": 1, "skipped": 0, "succeeded": 1, "failed": 0, "reused": 0, "failures": {}}

    monkeypatch.setattr(batch_mod, "run_batch", fake_run)
    monkeypatch.setattr(Client, "no_worker_warning", lambda self, queue=None: None)
    for timeout, limit in (("7200.5", 7201), ("60", 3600), (None, 3600), ("inf", -1)):  # (inf: OverflowError)
        argv = ["batch", str(src), "-o", str(tmp_path / f"out-{timeout}.jsonl"), "--redis-url", "redis://127.0.0.1:1/0"]
        producer_cli.batch(_parse(*argv, *(["--timeout", timeout] if timeout else [])))
        assert limits[-1] == limit


def test_a_dry_run_puts_its_counts_on_stdout_as_a_run_does(tmp_path, capsys):
    """A run's summary is one JSON line on stdout (`| jq .failed`); a dry run's counts were on stderr alone."""
    from worker import cli

    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "hi"}\n{"prompt": "x", "temperature": 9}\n')
    assert cli.main(["batch", str(rows), "-o", str(tmp_path / "out.jsonl"), "--dry-run"]) == 1
    said = capsys.readouterr()
    counts = json.loads(said.out)
    assert (counts["total"], counts["valid"], counts["failed"]) == (2, 1, 1) and "dry run: 2 rows" in said.err
