"""The server's streams over jobs whose events are scripted (no Redis, no worker): when headers go out, what a job's
error mid-stream does to the others, which jobs a failing request cancels."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import redis

from producer import server as server_module
from producer import server_sse
from producer.server import create_app


def event(n: int, text: str, reason: str | None = None, **extra) -> dict:
    out = {"v": 3, "n": n, "text": text, "token_ids": [n]}
    if reason:
        out.update(finish_reason=reason, usage={"prompt_tokens": 2, "completion_tokens": n + 1, "total_tokens": n + 3})
    return {**out, **extra}


class ScriptedJob:
    """A job whose events come as scripted: ``(seconds to wait, event or exception)``."""

    def __init__(self, job_id: str, script: list, canceled: list[str]) -> None:
        self.id, self.script, self.canceled = job_id, script, canceled
        self.first_event_at: float | None = None
        job = self

        class _Sync:  # (the attribute AsyncGenerationJob has, used to cancel on a thread)
            @staticmethod
            def cancel() -> None:
                job.canceled.append(job.id)

        self._sync = _Sync

    async def events(self, timeout=None, skip_void=False, idle=False):
        for delay, item in self.script:
            await asyncio.sleep(delay)
            if isinstance(item, Exception):
                raise item
            self.first_event_at = self.first_event_at or time.monotonic()
            yield item
            if "finish_reason" in item:
                return
        await asyncio.sleep(3600)  # (a job that never ends: canceled or timed out)

    async def result(self, timeout=None):
        final = self.script[-1][1]
        text = "".join(item["text"] for _, item in self.script if isinstance(item, dict))
        choices = [{"index": 0, "finish_reason": final["finish_reason"], "text": text}]
        return {"status": "finished", "text": text, "usage": final.get("usage"), "choices": choices}


class ScriptedClient:
    queue_name = "q"

    def __init__(self, scripts: list[list]) -> None:
        self.scripts, self.jobs, self.canceled = scripts, [], []

    models = ("m",)

    async def workers(self):
        return [{"name": f"w{i}", "model": model} for i, model in enumerate(self.models)]

    async def submit(self, **fields) -> ScriptedJob:
        job = ScriptedJob(fields.get("job_id") or f"job{len(self.jobs)}", self.scripts[len(self.jobs)], self.canceled)
        self.jobs.append(job)
        return job


def post(
    client: ScriptedClient,
    body: dict | bytes,
    path: str = "/v1/completions",
    headers: dict | None = None,
    **app_options,
) -> tuple[dict, list]:
    """Run one request through the app as ASGI: its response start (status, headers, when) and its body's events."""
    sent: list = []
    start: dict = {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def main() -> None:
        done = False

        async def receive():
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.sleep(3600)  # the client stays

        async def send(message):
            if message["type"] == "http.response.start":
                headers = {k.decode(): v.decode() for k, v in message["headers"]}
                start.update(status=message["status"], headers=headers, at=time.monotonic())
            elif message.get("body"):
                start["body"] = start.get("body", b"") + message["body"]
                lines = message["body"].decode().split("\n")  # (a typed event's "event:" line comes first)
                sent.extend(line[6:] for line in lines if line.startswith("data: "))

        asked = [(b"content-type", b"application/json")]
        asked += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
                 "headers": asked, "client": ("t", 1), "server": ("t", 80)}  # fmt: skip
        await create_app(client, **app_options)(scope, receive, send)
        await asyncio.sleep(0.05)  # the cancels run on threads

    asyncio.run(main())
    return start, [line if line == "[DONE]" else json.loads(line) for line in sent]


def test_a_streamed_completion_opens_with_text_as_openais_and_a_chat_with_its_role():
    """A completion's stream began with an empty text chunk per choice, which OpenAI's legacy stream and vLLM do not
    send (tools counting chunks, or timing the first one, saw it); a chat's first chunk says its role, as OpenAI's;
    an echo's first chunk is the prompt."""
    script = [(0.01, event(0, "The")), (0.01, event(1, " sea", "stop"))]
    _, chunks = post(ScriptedClient([script]), {"model": "m", "prompt": "p", "stream": True})
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["The", " sea"]
    _, chunks = post(ScriptedClient([script]), {"model": "m", "prompt": "p", "echo": True, "stream": True})
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["p", "The", " sea"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    _, chunks = post(ScriptedClient([script]), chat, path="/v1/chat/completions")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_an_error_mid_stream_ends_it_and_cancels_the_other_prompts_jobs():
    """One job of a several-prompt stream fails after the headers: an error chunk, then [DONE], no usage chunk;
    the other job, which no one will read, is canceled rather than left to run to its end."""
    failing = [(0.01, event(0, "a")), (0.05, event(1, "", "error", error="step failed", error_type="server_error"))]
    slow = [(0.01, event(0, "b"))] + [(0.2, event(i, "b")) for i in range(1, 20)] + [(0.2, event(20, "", "stop"))]
    client = ScriptedClient([failing, slow])
    start, chunks = post(client, {"model": "m", "prompt": ["p", "q"], "stream": True,
                                  "stream_options": {"include_usage": True}})  # fmt: skip
    assert start["status"] == 200
    assert chunks[-2]["error"] == {"message": "step failed", "type": "server_error", "param": None, "code": None}
    assert chunks[-1] == "[DONE]" and not any(c != "[DONE]" and c.get("usage") for c in chunks)
    assert sorted(client.canceled) == sorted(job.id for job in client.jobs)


def test_a_prompt_queued_behind_others_does_not_hold_the_stream_of_the_first(monkeypatch):
    """The headers wait for every job's first event (a refused job is the request's status), but once one came, only
    a grace: a job that starts later (queued behind a full worker) streams when it starts."""
    monkeypatch.setattr(server_sse, "FIRST_EVENTS_GRACE_S", 0.05)
    first = [(0.01, event(0, "a")), (0.01, event(1, "a", "stop"))]
    later = [(0.5, event(0, "b")), (0.01, event(1, "b", "stop"))]
    client = ScriptedClient([first, later])
    start, chunks = post(client, {"model": "m", "prompt": ["p", "q"], "stream": True})
    assert start["status"] == 200 and start["at"] < client.jobs[1].first_event_at
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert texts == {0: "aa", 1: "bb"} and chunks[-1] == "[DONE]" and client.canceled == []


def test_a_prompt_refused_among_the_first_events_is_the_requests_status():
    refused = [(0.05, event(0, "", "error", error="the prompt is too long", error_type="invalid_request"))]
    fine = [(0.01, event(0, "a"))] + [(0.05, event(i, "a")) for i in range(1, 40)]
    client = ScriptedClient([fine, refused])
    start, chunks = post(client, {"model": "m", "prompt": ["p", "q"], "stream": True})
    assert start["status"] == 400 and chunks == []
    assert sorted(client.canceled) == sorted(job.id for job in client.jobs)


def test_a_restart_before_any_of_a_jobs_text_went_out_is_no_error():
    """A job whose output started over (a retry that could not resume) before any of its text was sent streams the
    new output; only text already sent makes the stream fail (it cannot be taken back)."""
    restarted = [(0.01, event(3, "new", reset=True)), (0.01, event(4, "er", "stop"))]
    client = ScriptedClient([restarted])
    start, chunks = post(client, {"model": "m", "prompt": "p", "stream": True})
    assert start["status"] == 200 and chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "newer"


def test_a_streamed_job_whose_first_event_cannot_be_read_is_canceled():
    """Redis failing while a streamed request waits for its job's first event: a 503 in OpenAI's shape, and the
    job, which no one will read, is canceled rather than left to run."""
    client = ScriptedClient([[(0.01, redis.exceptions.ConnectionError("Redis went away"))]])
    start, _ = post(client, {"model": "m", "prompt": "p", "stream": True})
    assert start["status"] == 503 and client.canceled == ["job0"]


@pytest.mark.parametrize("prompts", [3, 40])
def test_the_job_id_header_names_a_requests_jobs_and_stays_short(prompts):
    """A request of several prompts names its jobs <base>-0 .. <base>-<k-1>; the header lists them, or past 32 the
    first and the count (256 ids were ~9.5 KB, past a proxy's header buffer)."""
    client = ScriptedClient([[(0.0, event(0, "x", "stop"))] for _ in range(prompts)])
    start, _ = post(client, {"model": "m", "prompt": ["p"] * prompts, "stream": True})
    ids = [job.id for job in client.jobs]
    base = ids[0].removesuffix("-0")
    assert ids == [f"{base}-{i}" for i in range(prompts)] and start["status"] == 200
    assert start["headers"]["x-request-id"] == ids[0]
    if prompts <= 32:
        assert start["headers"]["x-roseinfer-job-id"] == ",".join(ids)
    else:
        assert start["headers"]["x-roseinfer-job-id"] == ids[0]
        assert start["headers"]["x-roseinfer-job-count"] == str(prompts)


def test_a_follower_that_joins_during_a_read_still_gets_the_streams_start():
    """The hub reads each stream from its followers' lowest position: one that came while a read from further on
    was under way used to get only that read's entries, its position past all it never got (a job's ``result()``
    and ``stream()`` followed at once: the stream then missed its start)."""
    import fakeredis

    from producer.aio import StreamHub

    async def main() -> tuple[list[int], list[int]]:
        conn = fakeredis.FakeAsyncRedis()
        for n in range(3):
            await conn.xadd("s", {"n": n})
        hub = StreamHub(conn, wait_ms=200)
        early = hub.follow("s")
        await early.entries.get()  # 0-2: the hub now waits for entries past them
        await asyncio.sleep(0.02)
        late = hub.follow("s")  # during that wait
        await conn.xadd("s", {"n": 3})
        got: list[int] = []
        while len(got) < 4:  # (in one batch or more)
            got += [int(fields[b"n"]) for _, fields in await asyncio.wait_for(late.entries.get(), 2)]
        more = [int(fields[b"n"]) for _, fields in await asyncio.wait_for(early.entries.get(), 2)]
        hub.leave(early)
        hub.leave(late)
        return got, more

    got, more = asyncio.run(main())
    assert got == [0, 1, 2, 3] and more == [3]


def test_a_bad_field_message_uses_the_requests_names():
    """Both the error's ``param`` and its message use the request's names (``prompt``, ``max_completion_tokens``),
    not the job payload's (``prompt_token_ids``, ``max_tokens``)."""
    from producer.openai_api import APIError, ChatCompletionRequest, parse, parse_completions

    with pytest.raises(APIError) as err:
        parse_completions({"model": "m", "prompt": [[1], [2, -3]]})
    assert err.value.param == "prompt" and err.value.body()["error"]["message"].startswith("prompt.1: ")
    with pytest.raises(APIError) as err:
        parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "max_completion_tokens": -1})  # fmt: skip
    assert err.value.param == "max_completion_tokens" and "max_tokens" not in err.value.body()["error"]["message"]


def test_a_request_while_the_queues_workers_name_several_models_is_served_and_said(caplog):
    """A job names no model: with workers of two models on one queue, a request for one may be answered by either
    (a rollout, one model at two paths). Served, as before (refused, an upgrade took a working fleet down), and
    said: a warning logged, once a minute at most."""
    client = ScriptedClient([[(0.01, event(0, "a", "stop"))], [(0.01, event(0, "b", "stop"))]])
    client.models = ("m", "other")
    with caplog.at_level("WARNING", logger="roseinfer.server"):
        start, _ = post(client, {"model": "m", "prompt": "p"})
    assert start["status"] == 200 and len(client.jobs) == 1
    assert [r.message for r in caplog.records if "serve several models (m, other)" in r.message]


def test_openais_metadata_tags_the_job_and_its_cache_and_safety_ids_are_taken_and_ignored():
    """``metadata`` (a request's tags, in OpenAI's API and taken by vLLM) was a 400 "unsupported parameter", where
    ``user`` and ``store`` were taken: it is the job's metadata now, echoed in its result."""
    from producer.openai_api import ChatCompletionRequest, parse
    from producer.responses_api import parse_responses

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"team": "search"}}
    _, fields = parse(ChatCompletionRequest, {**body, "prompt_cache_key": "k1", "safety_identifier": "u1"})
    assert fields["metadata"] == {"team": "search"} and "prompt_cache_key" not in fields
    assert "safety_identifier" not in fields
    # The prompt cache's retention and options (newer fields of OpenAI's chat and Responses APIs) were a 400.
    cache = {"prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "1h"}}
    _, fields = parse(ChatCompletionRequest, {**body, **cache})
    assert not set(cache) & set(fields)
    _, _, job = parse_responses({"model": "m", "input": "hi", **cache})
    assert not set(cache) & set(job)


HERMES_PIECES = [
    "Let me",
    " look. <tool",
    '_call>\n{"name": "get_weather", "arguments": {"city": ',
    '"Oslo"}}\n</tool_call>',
]
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _hermes_script() -> list:
    *pieces, last = HERMES_PIECES
    return [(0.01, event(i, piece)) for i, piece in enumerate(pieces)] + [(0.01, event(3, last, "stop"))]


def test_auto_tool_calls_in_the_models_own_format_come_back_as_openais_streamed_and_not():
    """With --tool-call-parser hermes, "auto" (the default where there are tools) reads the model's <tool_call>
    blocks: the text before them is the content, each block a call, and the finish "tool_calls"; streamed, no piece
    of a marker leaks out as text, though it came split between events."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": WEATHER_TOOLS}
    start, _ = post(ScriptedClient([_hermes_script()]), body, "/v1/chat/completions")
    assert start["status"] == 400 and b"--tool-call-parser" in start["body"]  # (no parser: vLLM's 400)
    start, _ = post(ScriptedClient([_hermes_script()]), body, "/v1/chat/completions", tool_call_parser="hermes")
    [choice] = json.loads(start["body"])["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    client = ScriptedClient([_hermes_script()])
    start, chunks = post(client, {**body, "stream": True}, "/v1/chat/completions", tool_call_parser="hermes")
    deltas = [c["choices"][0]["delta"] for c in chunks if c != "[DONE]"]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look. "
    [streamed] = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1] == "[DONE]"


OTHER_FORMATS = {  # each format's output in pieces: text before the call, the call split between events
    "llama3_json": ["<|python", '_tag|>{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}'],
    "mistral": ["Let me look. [TOOL", '_CALLS][{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}]'],
    "pythonic": ["[get_weather(", "city='Oslo'", ")]"],
}


@pytest.mark.parametrize("parser", list(OTHER_FORMATS))
def test_auto_tool_calls_in_llama_mistral_and_pythonic_formats(parser):
    """The other formats' calls, through the server as the official client reads them: the same call whole and
    streamed, the text before it the content, nothing of a marker in the text."""
    pieces = OTHER_FORMATS[parser]
    script = [(0.01, event(i, piece, "stop" if i == len(pieces) - 1 else None)) for i, piece in enumerate(pieces)]
    content = "Let me look. " if parser == "mistral" else None
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": WEATHER_TOOLS}
    start, _ = post(ScriptedClient([list(script)]), body, "/v1/chat/completions", tool_call_parser=parser)
    [choice] = json.loads(start["body"])["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    _, chunks = post(ScriptedClient([list(script)]), {**body, "stream": True}, "/v1/chat/completions",
                     tool_call_parser=parser)  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks if c != "[DONE]"]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    [streamed] = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


QWEN3_PIECES = ["<thi", "nk>\nWeather needs a", " lookup.\n</th", "ink>\n\n<tool_call>", '{"name": "get_weather", ',
                '"arguments": {"city": "Oslo"}}</tool_call>']  # fmt: skip


def test_thinking_comes_as_reasoning_beside_the_answer_and_its_calls_streamed_and_not():
    """--reasoning-parser: a Qwen3 answer's <think> block is the message's reasoning (and reasoning_content), whole
    and in the deltas, no piece of a marker in either; the answer after it is read for tool calls as before."""
    script = [(0.01, event(i, p, "stop" if i == len(QWEN3_PIECES) - 1 else None)) for i, p in enumerate(QWEN3_PIECES)]
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": WEATHER_TOOLS}
    options = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
    start, _ = post(ScriptedClient([list(script)]), body, "/v1/chat/completions", **options)
    [choice] = json.loads(start["body"])["choices"]
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nWeather needs a lookup.\n"
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    _, chunks = post(ScriptedClient([list(script)]), {**body, "stream": True}, "/v1/chat/completions", **options)
    deltas = [c["choices"][0]["delta"] for c in chunks if c != "[DONE]"]
    thinking = [d["reasoning"] for d in deltas if "reasoning" in d]
    assert "".join(thinking) == message["reasoning"] and len(thinking) > 1  # (as it came, not at the end)
    assert all(d["reasoning_content"] == d["reasoning"] for d in deltas if "reasoning" in d)
    assert "".join(d.get("content") or "" for d in deltas) == ""
    [streamed] = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert streamed["function"] == message["tool_calls"][0]["function"]
    plain = [(0.01, event(0, "It is")), (0.01, event(1, " sunny.", "stop"))]  # (qwen3 without thinking: all answer)
    _, chunks = post(ScriptedClient([plain]), {**body, "tools": None, "stream": True}, "/v1/chat/completions",
                     reasoning_parser="qwen3")  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks if c != "[DONE]"]
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny." and not any(
        "reasoning" in d for d in deltas
    )
    response_body = {"model": "m", "input": "Weather?", "tools": [{"type": "function", "name": "get_weather"}]}
    start, _ = post(ScriptedClient([list(script)]), response_body, "/v1/responses", **options)
    output = json.loads(start["body"])["output"]
    assert [i["type"] for i in output] == ["reasoning", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": message["reasoning"]}]
    answered = {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "Rain"}
    again = {**response_body, "input": [{"role": "user", "content": "Weather?"}, *output, answered]}
    start, _ = post(ScriptedClient([plain]), again, "/v1/responses", **options)  # (the output sent back is taken)
    assert json.loads(start["body"])["output"][0]["content"][0]["text"] == "It is sunny."
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        post(ScriptedClient([plain]), body, "/v1/chat/completions", reasoning_parser="r2")


def test_auto_tool_calls_through_the_responses_api_are_function_call_items():
    body = {"model": "m", "input": "Weather?", "tools": [{"type": "function", "name": "get_weather"}]}
    start, _ = post(ScriptedClient([_hermes_script()]), body, "/v1/responses", tool_call_parser="hermes")
    output = json.loads(start["body"])["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me look. " and output[1]["arguments"] == '{"city": "Oslo"}'
    client = ScriptedClient([_hermes_script()])
    _, events = post(client, {**body, "stream": True}, "/v1/responses", tool_call_parser="hermes")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    [done] = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["output_index"] == 1]
    assert text == "Let me look. " and (done["name"], done["arguments"]) == ("get_weather", '{"city": "Oslo"}')
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call"]


def test_a_failed_responses_stream_ends_with_response_failed_after_its_error():
    """A job failing mid-stream ended the typed events with a bare ``error``: clients of the Responses API wait for
    a last ``response.completed``, ``response.failed`` or ``response.incomplete``."""
    failing = [(0.01, event(0, "It")), (0.01, event(1, "", "error", error="step failed", error_type="server_error"))]
    _, events = post(ScriptedClient([failing]), {"model": "m", "input": "Hi", "stream": True}, "/v1/responses")
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "step failed"}
    assert failed["output"][0]["type"] == "message"  # (what had come out before)


@pytest.mark.parametrize(
    ("body", "phrase"),
    [
        (b'{"model": "m", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", "not valid JSON"),
        (b'{"model": "m", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature: Input should be"),
        (b'{"model": "m", "input": "hi", "user": "\\ud800"}', "lone surrogate"),
        (b'{"model": "m", "prompt": "x", "temperature": ' + str(2**1024 - 1).encode() + b"}", "temperature: Input"),
    ],
    ids=["5000 digits", "past a float", "lone surrogate", "just past a float"],
)
def test_json_the_server_cannot_take_is_a_400_in_openais_shape_not_a_plain_500(body, phrase):
    """An integer past Python's 4300 digits, one past a float's range, half a UTF-16 pair in a field a response
    echoes (only its writing failed, after the job had run): plain-text 500s, which the official client retries."""
    path = "/v1/responses" if b"input" in body else "/v1/completions"
    client = ScriptedClient([[(0.01, event(0, "x", "stop"))]])
    start, _ = post(client, body, path)
    error = json.loads(start["body"])["error"]
    assert start["status"] == 400 and phrase in error["message"] and client.jobs == []


def test_a_body_past_the_servers_bound_is_a_413_before_it_is_read_whole(monkeypatch):
    """A 30 MB prompt to /tokenize (which needs no key, as vLLM's) took 22 s and 2.6 GB of the server's memory."""
    monkeypatch.setattr(server_module, "MAX_BODY_BYTES", 1000)
    client = ScriptedClient([[(0.01, event(0, "x", "stop"))]])
    start, _ = post(client, {"model": "m", "prompt": "x" * 2000})
    assert start["status"] == 413 and json.loads(start["body"])["error"]["code"] == "request_too_large"
    assert client.jobs == []
    start, _ = post(ScriptedClient([[(0.01, event(0, "x", "stop"))]]), {"model": "m", "prompt": "x" * 100})
    assert start["status"] == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch, path):
    """16 MB of token ids (256 prompts) held the event loop 18 s, /health and every stream waiting: 2 s of decoding
    and checking, 16 s of dumping the whole request once a prompt."""
    on_loop: list[bool] = []
    real = server_module._decoded

    def decoded(raw):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(raw)

    monkeypatch.setattr(server_module, "_decoded", decoded)
    monkeypatch.setattr(server_module, "PARSE_ON_LOOP_BYTES", 200)
    field = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/responses": "input"}[path]
    for text in ("x", "x" * 300):
        value = text if field != "messages" else [{"role": "user", "content": text}]
        start, _ = post(ScriptedClient([[(0.01, event(0, "x", "stop"))]]), {"model": "m", field: value}, path)
        assert start["status"] == 200
    assert on_loop == [True, False]


def test_a_completion_of_many_prompts_dumps_its_settings_once_not_its_prompts():
    """Each prompt's job dumped the whole request, every prompt in it, to keep its settings: 256 prompts of 21,000
    token ids took 20 s to parse."""
    from producer.openai_api import CompletionRequest, parse_completions

    dumped: list[Any] = []
    real = CompletionRequest.model_dump

    def model_dump(self, **kwargs):
        out = real(self, **kwargs)
        dumped.append(out.get("prompt"))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompletionRequest, "model_dump", model_dump)
        _, jobs = parse_completions({"model": "m", "prompt": [[1, 2]] * 8, "max_tokens": 1, "seed": 3})
    assert [job["prompt_token_ids"] for job in jobs] == [[1, 2]] * 8 and all(job["seed"] == 3 for job in jobs)
    assert dumped and not any(dumped)


def test_a_fault_of_the_servers_own_is_a_500_in_openais_shape():
    class Broken(ScriptedClient):
        async def workers(self):
            raise KeyError("nobody")

    app = create_app(Broken([]))

    async def main():
        # (Starlette raises the fault again once its answer is sent, so that the server logs it: not to the client)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            reply = await http.post("/v1/completions", json={"model": "m", "prompt": "x"})
            return reply, (await http.get("/metrics")).text

    reply, metrics = asyncio.run(main())
    assert reply.status_code == 500
    assert reply.json()["error"] == {"message": "internal error: KeyError", "type": "server_error", "param": None,
                                     "code": None}  # fmt: skip
    # Counted, as every answer is (Starlette's outermost layer sent it, past the counting one: an alert on the
    # error rate never saw the server's own faults)
    assert 'roseinfer_server_requests_total{endpoint="/v1/completions",status="500"} 1.0' in metrics


def test_browser_origins_are_allowed_only_where_named():
    """A chat page served from another origin (a web UI on localhost:3000) needs CORS: its preflight got a 405 and
    its answers no allow-origin header. Named origins get them, a preflight answered before the key is asked for
    (browsers send none with it); by default, as before, no origin is allowed."""

    async def main(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            ask = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
            preflight = await http.options("/v1/chat/completions", headers=ask)
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            keyless = await http.post("/v1/completions", json=body, headers={"Origin": "http://ui.example"})
            other = await http.options("/v1/chat/completions", headers={**ask, "Origin": "http://evil.example"})
            return preflight, keyless, other

    app = create_app(ScriptedClient([]), api_key="k", allowed_origins=["http://ui.example"])
    preflight, keyless, other = asyncio.run(main(app))
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == "http://ui.example"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    preflight, keyless, _ = asyncio.run(main(create_app(ScriptedClient([]), api_key="k")))
    assert not any("access-control-allow-origin" in r.headers for r in (preflight, keyless))


def test_a_web_pages_post_is_refused_unless_its_origin_is_allowed_whatever_its_body():
    """CORS keeps a page from reading an answer, not from sending its request: a form, text/plain or a body of no
    type goes cross-origin with no preflight, and the job ran (CORS off, no key: any page a user opened could run
    jobs on a server on their machine). A browser names the page's origin: unless --allowed-origins names it, the
    POST is refused before anything runs. Requests with no origin (curl, the SDKs) are served as before."""
    body = json.dumps({"model": "m", "prompt": "p", "max_tokens": 1}).encode()
    for media in ("text/plain", "application/x-www-form-urlencoded", None):
        client = ScriptedClient([[(0.01, event(0, "a", "stop"))]])
        headers = {"origin": "http://elsewhere.example", **({"content-type": media} if media else {})}
        start, _ = post(client, body, headers=headers)
        assert start["status"] == 403 and not client.jobs
        assert "--allowed-origins" in json.loads(start["body"])["error"]["message"]
    for headers, options in (({}, {}), ({"origin": "http://ui.example"}, {"allowed_origins": ["http://ui.example"]}),
                             ({"origin": "http://any.example"}, {"allowed_origins": ["*"]})):  # fmt: skip
        client = ScriptedClient([[(0.01, event(0, "a", "stop"))]])
        start, _ = post(client, body, headers={"content-type": "text/plain", **headers}, **options)
        assert start["status"] == 200 and len(client.jobs) == 1, (headers, start)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"max_tokens": 2, "min_tokens": 5}, "min_tokens", "min_tokens (5) must not exceed max_tokens (2)"),
        (
            {"max_tokens": 0, "echo": True, "min_tokens": 2},
            "min_tokens",
            "min_tokens (2) must not exceed max_tokens (0)",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "give structured_outputs or response_format, not both",
        ),
    ],
    ids=["min-over-max", "min-over-an-echos-0", "two-constraints"],
)
def test_a_check_across_fields_names_its_parameter_in_plain_words(extra, param, message):
    """It said ``payload: Value error, min_tokens (5) ...`` with ``param`` null: pydantic's prefix, and no field."""
    start, _ = post(ScriptedClient([]), {"model": "m", "prompt": "x", **extra})
    error = json.loads(start["body"])["error"]
    assert start["status"] == 400 and (error["param"], error["message"]) == (param, message)


def test_an_assistants_refusal_part_is_taken_back_as_its_text():
    """OpenAI's assistant content may hold ``{"type": "refusal"}`` parts: a conversation holding one was a 400. Its
    words are the message's text, as vLLM reads them; a user's refusal part, an image, are still refused."""
    from producer.openai_api import APIError, ChatCompletionRequest, parse

    said = [{"type": "text", "text": "Well."}, {"type": "refusal", "refusal": "I cannot help with that."}]
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "ok"},
    ]
    _, fields = parse(ChatCompletionRequest, {"model": "m", "messages": messages})
    parts = [{"type": "text", "text": "Well."}, {"type": "text", "text": "I cannot help with that."}]
    assert fields["messages"][1] == {"role": "assistant", "content": parts}
    for part, words in (
        ({"type": "refusal", "refusal": "no"}, "a refusal part is an assistant's"),
        ({"type": "image_url", "image_url": {"url": "x"}}, "Input tag 'image_url'"),
    ):
        with pytest.raises(APIError) as err:
            parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [part]}]})
        assert words in err.value.message and err.value.status == 400


@pytest.mark.slow  # seconds of timers: keeps the fast lane under a minute
def test_a_stream_queued_behind_others_gets_its_headers_and_keep_alives_before_its_first_token(monkeypatch):
    """Its headers waited for the job's first event, for as long as the job stayed queued (5.4 s behind 14 jobs): a
    proxy's read timeout (nginx's 60 s) cut such a stream, and with it the job. Now they go after a hold, then a
    comment line while nothing comes; a first event that never comes is the 504 in the stream, the job canceled."""
    monkeypatch.setattr(server_sse, "HEADERS_HOLD_S", 0.1)
    monkeypatch.setattr(server_sse, "PING_EVERY_S", 0.1)
    late = [(1.0, event(0, "a")), (0.01, event(1, "b", "stop"))]
    for path, body in (
        ("/v1/completions", {"model": "m", "prompt": "p", "stream": True}),
        ("/v1/responses", {"model": "m", "input": "p", "stream": True}),
    ):
        client = ScriptedClient([late])
        start, chunks = post(client, body, path)
        assert start["status"] == 200 and start["at"] < client.jobs[0].first_event_at - 0.5
        assert start["body"].count(b"\n\n: ping\n\n") >= 3 and client.canceled == []
        if path == "/v1/completions":
            assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "ab" and chunks[-1] == "[DONE]"
        else:
            assert chunks[-1]["type"] == "response.completed"
    never = ScriptedClient([[]])
    start, chunks = post(never, {"model": "m", "prompt": "p", "stream": True}, timeout=0.5)
    assert start["status"] == 200 and chunks[-1] == "[DONE]"
    assert chunks[-2]["error"]["type"] == "timeout" and "no result within 0.5 s" in chunks[-2]["error"]["message"]
    assert never.canceled == ["job0"]


def test_a_prompt_refused_after_the_headers_went_is_an_error_chunk_naming_the_field(monkeypatch):
    """Queued past the hold, a job refused as too long can no longer be the request's 400: its error chunk says it,
    naming the field to shorten as the status would have."""
    monkeypatch.setattr(server_sse, "HEADERS_HOLD_S", 0.05)
    too_long = event(
        0, "", "error", error="too long", error_type="invalid_request", error_code="context_length_exceeded"
    )
    client = ScriptedClient([[(0.3, too_long)]])
    start, chunks = post(client, {"model": "m", "prompt": "p", "stream": True})
    assert start["status"] == 200 and chunks[-1] == "[DONE]"
    assert chunks[-2]["error"]["code"] == "context_length_exceeded" and chunks[-2]["error"]["param"] == "prompt"


def test_the_model_list_is_a_503_when_no_worker_is_alive_as_every_route_is():
    """/v1/models answered 200 with an empty list while chat, /health and a model's own card answered 503: a
    client's ``models.list().data[0].id`` (README's example) failed with an IndexError, not an error it could tell."""

    async def get(path: str) -> httpx.Response:
        client = ScriptedClient([])
        client.models = ()
        transport = httpx.ASGITransport(app=create_app(client))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.get(path)

    for path in ("/v1/models", "/v1/models/m"):
        response = asyncio.run(get(path))
        assert response.status_code == 503, path
        assert response.json()["error"]["message"] == "no live worker on queue 'q'"


def test_refused_requests_are_in_the_latency_histogram_as_in_the_request_counts():
    """401 and 403 answers were counted in roseinfer_server_requests_total but never observed in the latency
    histogram: its _count fell short of the requests (9 against 4 for /v1/models)."""
    app = create_app(ScriptedClient([]), api_key="k", allowed_origins=["http://ui.example"])

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            assert (await http.get("/v1/models")).status_code == 401
            page = {"origin": "http://other.example", "authorization": "Bearer k"}
            assert (await http.post("/v1/chat/completions", headers=page, json={})).status_code == 403
            assert (await http.get("/v1/models", headers={"authorization": "Bearer k"})).status_code == 200

    asyncio.run(main())
    registry = app.state.metrics.registry
    for endpoint, statuses in (("/v1/models", ("401", "200")), ("/v1/chat/completions", ("403",))):
        counted = sum(registry.get_sample_value("roseinfer_server_requests_total", {"endpoint": endpoint,
                      "status": status}) or 0 for status in statuses)  # fmt: skip
        observed = registry.get_sample_value("roseinfer_server_request_seconds_count", {"endpoint": endpoint})
        assert counted == observed == len(statuses), endpoint


def test_a_submit_answered_503_whose_jobs_went_in_all_the_same_has_them_canceled(monkeypatch):
    """Redis stalled past the socket timeout while a submit's transaction waited in it: the request was answered
    503 (which the official client retries), and once Redis ran the transaction its job ran for nobody."""
    import fakeredis
    import redis

    import producer.server_jobs as server_jobs
    from producer import Client

    client = Client(connection=fakeredis.FakeRedis())
    real = redis.client.Pipeline.execute

    def ran_then_lost(self, *args, **kwargs):  # (the transaction ran; its reply never came)
        enqueues = any(command[0][0] == "RPUSH" for command in self.command_stack)
        replies = real(self, *args, **kwargs)
        if enqueues:
            raise redis.TimeoutError("Timeout reading from socket")
        return replies

    monkeypatch.setattr(redis.client.Pipeline, "execute", ran_then_lost)
    with pytest.raises(redis.TimeoutError) as lost:
        client.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    monkeypatch.setattr(redis.client.Pipeline, "execute", real)
    went_in = lost.value.maybe_enqueued
    assert [client.job(job_id).status() for job_id in went_in] == ["queued", "queued"]
    monkeypatch.setattr(server_jobs, "UNSEEN_GRACE_S", 0.2)
    server_jobs._cancel_when_found(client, [*went_in, "never-went-in"])  # (returns once the grace is over)
    assert [client.job(job_id).status() for job_id in went_in] == ["canceled", "canceled"]

    # The server's requests hand such jobs over (once for a batch of several requests), and answer 503.
    handed = []
    monkeypatch.setattr(server_jobs, "_cancel_when_found", lambda sync, job_ids: handed.append((sync, job_ids)))

    class Stalled(ScriptedClient):
        sync = client

        async def submit(self, **fields):
            raise lost.value

    for path, body in (("/v1/completions", {"model": "m", "prompt": "p"}),
                       ("/v1/responses", {"model": "m", "input": "p"})):  # fmt: skip
        lost.value.unseen_handled = False
        start, _ = post(Stalled([]), body, path)
        assert start["status"] == 503
    for _ in range(50):  # (each on a thread of its own)
        if len(handed) == 2:
            break
        time.sleep(0.01)
    assert handed == [(client, went_in)] * 2


def test_the_api_key_is_asked_for_behind_a_path_prefix_too():
    """Mounted under a prefix (a Starlette ``Mount``, uvicorn's ``--root-path`` behind a proxy), ``scope["path"]``
    holds the prefix: ``/api/v1/models`` skipped the key check, which looked for paths starting ``/v1/``."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    async def get(app, path: str, headers: dict, root_path: str = "") -> int:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (await http.get(path, headers=headers)).status_code

    key = {"Authorization": "Bearer k"}
    mounted = Starlette(routes=[Mount("/api", app=create_app(ScriptedClient([]), api_key="k"))])
    assert asyncio.run(get(mounted, "/api/v1/models", {})) == 401
    assert asyncio.run(get(mounted, "/api/v1/models", key)) == 200
    assert asyncio.run(get(mounted, "/api/health", {})) == 503  # (open, as without the prefix: no worker here)
    proxied = create_app(ScriptedClient([]), api_key="k")
    assert asyncio.run(get(proxied, "/api/v1/models", {}, root_path="/api")) == 401
    assert asyncio.run(get(proxied, "/api/v1/models", key, root_path="/api")) == 200
    # A server that leaves the root path out of the path (uvicorn before 0.26), with a root path that is not a whole
    # segment of it: the key is asked for all the same (cut anywhere, "/v1/models" under "/v" read "1/models").
    for root in ("/", "/v", "/api"):
        assert asyncio.run(get(proxied, "/v1/models", {}, root_path=root)) == 401, root


@pytest.mark.slow  # a second of timers
def test_a_queued_stream_whose_pings_keep_the_client_reading_is_not_cut_at_its_read_timeout(monkeypatch):
    """A stream's first event waited at most the client's read timeout (x-stainless-read-timeout), as a whole answer
    does; but the pings reach the client sooner than that, so a job queued past it was canceled for nothing (a
    client reading 60 s got a 504 at 57 s). A client that reads less than the pings' interval still gets its 504."""
    monkeypatch.setattr(server_sse, "HEADERS_HOLD_S", 0.05)
    monkeypatch.setattr(server_sse, "PING_EVERY_S", 0.1)
    late = [(1.2, event(0, "a")), (0.01, event(1, "b", "stop"))]
    client = ScriptedClient([late])
    body = {"model": "m", "prompt": "p", "stream": True}
    start, chunks = post(client, body, headers={"x-stainless-read-timeout": "1"})  # (waited 0.8 s)
    assert start["status"] == 200 and client.canceled == []
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "ab" and chunks[-1] == "[DONE]"
    monkeypatch.setattr(server_sse, "PING_EVERY_S", 1.0)  # slower than the client reads: it would give up first
    client = ScriptedClient([late])
    start, chunks = post(client, body, headers={"x-stainless-read-timeout": "1"})
    assert start["status"] == 200 and chunks[-2]["error"]["type"] == "timeout" and client.canceled == ["job0"]


def test_a_chat_asking_for_text_output_alone_is_taken_and_other_modalities_refused():
    """``modalities: ["text"]`` (some clients send it always) was a 400, "unsupported parameter"; audio is not
    made here, and a request for it is refused by name."""
    from producer.openai_api import APIError, ChatCompletionRequest, parse

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    _, payload = parse(ChatCompletionRequest, {**body, "modalities": ["text"]})
    assert "modalities" not in payload and payload["messages"] == body["messages"]
    with pytest.raises(APIError) as refused:
        parse(ChatCompletionRequest, {**body, "modalities": ["text", "audio"]})
    assert refused.value.status == 400 and refused.value.param == "modalities.1"


def test_a_stream_nobody_reads_holds_a_bounded_number_of_events_and_stops_after_them():
    """A client that stopped reading left the readers of its response's streams running: every event of its job
    piled up in the server (30 MB in 22 s, 32 samples with logprobs), past the hub's own bound. They wait now; a
    stop raises once what was read before it is given."""
    made = [0, 0]

    async def stream(i: int):
        for n in range(5 * server_sse.MAX_ARRIVED):
            made[i] += 1
            yield {"n": n}

    async def main() -> None:
        events = server_sse.MergedEvents([stream(0), stream(1)])
        await asyncio.sleep(0.05)  # nobody reads
        assert sum(made) <= server_sse.MAX_ARRIVED + 2  # (each reader holds the one it waits to put)
        got = [await events.get() for _ in range(10)]
        queued = events._arrived.qsize()
        events.stop(server_sse.ServerStopping())
        while True:
            try:
                got.append(await events.get())
            except server_sse.ServerStopping:
                break
        assert len(got) == 10 + queued and sum(made) < 10 * server_sse.MAX_ARRIVED
        assert [e["n"] for i, e in got if i == 0] == list(range(len([g for g in got if g[0] == 0])))
        events.close()

    asyncio.run(main())
