"""``roseinfer batch``: OpenAI batch lines and plain lines in, OpenAI output lines out, resumable, errors aside."""

from __future__ import annotations

import json

import pytest
from conftest import ThreadWorker

from producer import Client
from producer.batch import parse_line, run_batch


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


def test_batch_writes_openai_lines_sends_bad_lines_aside_and_resumes(served, tmp_path):
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

    summary = run_batch(client, src, out, max_in_flight=8, poll_interval=0.05)
    assert summary == {"total": 35, "skipped": 10, "succeeded": 20, "failed": 5}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30
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
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in rows)

    errors = [json.loads(line) for line in out.with_suffix(".errors.jsonl").read_text().splitlines()]
    assert len(errors) == 5
    messages = " | ".join(e["error"]["message"] for e in errors)
    for phrase in ("not JSON", "max_tokens", "url must be one of", "custom_id already used", "colour: unknown field"):
        assert phrase in messages

    again = run_batch(client, src, out, poll_interval=0.05)
    assert again["skipped"] == 30 and again["succeeded"] == 0
    assert len(out.read_text().splitlines()) == 30


def test_a_rerun_picks_up_jobs_of_the_interrupted_run_instead_of_generating_again(served, tmp_path):
    _, client = served
    line = parse_line(1, json.dumps({"custom_id": "again", "prompt": "Resume me", "max_tokens": 3}))
    job = client.submit_many([{**line.payload, "job_id": line.job_id}])[0]
    job.result(timeout=60)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "again", "prompt": "Resume me", "max_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    assert run_batch(client, src, out, poll_interval=0.05)["succeeded"] == 1
    row = json.loads(out.read_text())
    assert row["response"]["request_id"] == job.id
