"""Structured outputs through the queue: every kind as a job (greedy and seeded), and a job resumed from what an
earlier attempt streamed goes on under its constraint and ends as the uninterrupted job."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import ThreadWorker, requeue_as_resumed, tpot_counted_after, tpot_histogram, tpot_settled

from producer import Client

pytestmark = pytest.mark.slow  # a worker and many generations

SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["label", "n"],
    "additionalProperties": False,
}
KINDS = {
    "json": ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "json_object": ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    "regex": ({"regex": "[a-c]{2}-[0-9]"}, lambda t: re.fullmatch("[a-c]{2}-[0-9]", t) or pytest.fail(t)),
    "choice": ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no") or pytest.fail(t)),
    "grammar": ({"grammar": 'start: "A" | "B" "C"'}, lambda t: t in ("A", "BC") or pytest.fail(t)),
}


@pytest.fixture(scope="module")
def served(redis_url, tiny_chat_model):
    w = ThreadWorker(redis_url, tiny_chat_model, max_num_seqs=8)
    yield w, Client(redis_url, queue=w.queue)
    w.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_every_kind_as_a_job(served, sampling):
    _, client = served
    requests = [
        {"prompt": f"Answer {kind}", "max_tokens": 200, "structured_outputs": so, **sampling}
        for kind, (so, _) in KINDS.items()
    ]
    for kind, job in zip(KINDS, client.submit_many(requests)):
        result = job.result(timeout=120)
        if kind == "json_object" and result["finish_reason"] == "length":
            continue  # any object: a random model may nest past max_tokens; what it wrote is cut, not wrong
        assert result["finish_reason"] == "stop", (kind, result["text"])
        KINDS[kind][1](result["text"])
        assert "".join(job.stream(timeout=10)) == result["text"]


def test_a_resumed_job_goes_on_under_its_constraint(served):
    w, client = served
    payload = {
        "prompt": "Resume me",
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 5,
        "structured_outputs": KINDS["json"][0],
    }
    before = tpot_settled(w.worker)[0]
    first = client.submit(**payload)
    full = first.result(timeout=120)
    events = list(first.events(timeout=10))
    assert len(events) >= 2
    tpot_counted_after(w.worker, before)  # (first's own time per token: observed just after its result is written)
    count, total = tpot_histogram(w.worker)
    resumed = requeue_as_resumed(client, payload, events[:1])  # the worker resumes after the first event
    result = resumed.result(timeout=120)
    assert (result["text"], result["token_ids"]) == (full["text"], full["token_ids"])
    replay = list(resumed.events(timeout=10))
    assert not any(e.get("reset") for e in replay) and replay[0] == events[0]
    jsonschema.validate(json.loads(result["text"]), SCHEMA)
    # Its time per token spreads this attempt's time over this attempt's tokens, not the earlier one's too.
    tpot_counted_after(w.worker, count)
    timings, made_here = result["timings"], len(result["token_ids"]) - len(events[0]["token_ids"])
    assert tpot_histogram(w.worker)[0] == count + 1  # (its own observation alone)
    observed = tpot_histogram(w.worker)[1] - total
    assert observed == pytest.approx((timings["finished_at"] - timings["first_token_at"]) / (made_here - 1), abs=2e-6)


def test_every_kind_through_roseinfer_batch(served, tmp_path):
    from producer.batch import run_batch

    _, client = served
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = []
    for kind, (so, _) in KINDS.items():
        body = {"model": "m", "prompt": f"Batch {kind} {tmp_path.name}", "max_tokens": 200, "temperature": 0}
        lines.append({"custom_id": kind, "url": "/v1/completions", "body": {**body, "structured_outputs": so}})
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Pet?"}], "max_tokens": 60, "response_format": fmt}
    lines.append({"custom_id": "response_format", "url": "/v1/chat/completions", "body": body})
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run_batch(client, src, out, poll_interval=0.05)["succeeded"] == len(lines)
    for row in map(json.loads, out.read_text().splitlines()):
        choice = row["response"]["body"]["choices"][0]
        kind = row["custom_id"]
        if kind == "response_format":
            assert choice["finish_reason"] == "stop"
            KINDS["json"][1](choice["message"]["content"])
        elif not (kind == "json_object" and choice["finish_reason"] == "length"):
            assert choice["finish_reason"] == "stop", (kind, choice["text"])
            KINDS[kind][1](choice["text"])


def test_tool_calls_through_roseinfer_batch(served, tmp_path):
    """OpenAI batch lines that ask for tool calls get them in their output lines, as the server answers; a line
    whose tool_choice cannot be done ("auto") is that line's error alone."""
    from producer.batch import run_batch
    from producer.tool_calls import ToolChoice

    _, client = served
    tools = [
        {"type": "function", "function": {"name": "pet", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "none_left"}},
    ]
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Pets {tmp_path.name}"}],
        "max_tokens": 80,
        "temperature": 0,
    }
    named = {"type": "function", "function": {"name": "pet"}}
    bodies = {
        "named": {"tool_choice": named},
        "required": {"tool_choice": "required", "parallel_tool_calls": False},
        "auto": {},
    }
    lines = [
        {"custom_id": kind, "url": "/v1/chat/completions", "body": {**chat, "tools": tools, **asked}}
        for kind, asked in bodies.items()
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(client, src, out, poll_interval=0.05)
    assert (summary["succeeded"], summary["failed"]) == (2, 1)
    [error] = map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())
    assert error["custom_id"] == "auto" and '"auto" tool choice needs a parser' in error["error"]["message"]
    rows = {row["custom_id"]: row["response"]["body"] for row in map(json.loads, out.read_text().splitlines())}
    for kind, body in rows.items():
        [choice] = body["choices"]
        # (OpenAI's and vLLM's: "tool_calls" for calls of the model's choosing, "stop" for a named function's)
        assert choice["finish_reason"] == ("stop" if kind == "named" else "tool_calls")
        assert choice["message"]["content"] is None
        constraint = ToolChoice.of(tools, named if kind == "named" else "required", parallel=False).schema()
        job = {**{k: chat[k] for k in ("messages", "max_tokens")}, "tools": tools}
        text = client.submit(**job, temperature=0.0, structured_outputs={"json": constraint}).result(timeout=60)["text"]
        calls = choice["message"]["tool_calls"]
        if kind == "named":
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("pet", text)]
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
                (c["name"], c["parameters"]) for c in json.loads(text)
            ]


def test_response_format_text_beside_structured_outputs_asks_for_nothing():
    """``response_format: {"type": "text"}`` (a writer that sends every field's default) beside vLLM's
    ``structured_outputs`` was refused as two constraints; a real second one still is."""
    from producer.schema import JobRequest

    choice = {"choice": ["a", "b"]}
    job = JobRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}, "structured_outputs": choice})
    assert job.structured_form() == {"choice": ["a", "b"]}
    with pytest.raises(ValueError, match="not both"):
        JobRequest.model_validate(
            {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": choice}
        )
