"""``roseinfer batch``: a JSONL of requests in, a JSONL of OpenAI batch output lines out; resumable.

Each line gets a job id derived from its custom_id and content, so a rerun after a crash picks up jobs that
are still queued or already finished instead of generating them again, and skips lines already in the output.
Bad lines and failed jobs go to the errors file (rewritten each run, so failures are retried); none stops the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.client import Client, InvalidRequest, validate
from producer.protocol import result_key

log = logging.getLogger("roseinfer.batch")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_IGNORED_BODY_FIELDS = ("model", "stream", "n", "user")


@dataclass
class Line:
    number: int
    custom_id: str
    url: str
    payload: dict[str, Any]
    job_id: str


def parse_line(number: int, text: str) -> Line:
    """One input line into a job payload; ValueError with a readable reason for a bad one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    custom_id = obj.get("custom_id", f"line-{number}")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if "body" in obj:  # OpenAI batch format
        extra = set(obj) - {"custom_id", "method", "url", "body"}
        if extra:
            raise ValueError(f"unknown fields {sorted(extra)}")
        if obj.get("method", "POST") != "POST":
            raise ValueError("method must be POST")
        url = obj.get("url", "/v1/chat/completions")
        if url not in ENDPOINTS:
            raise ValueError(f"url must be one of {ENDPOINTS}, got {url!r}")
        body = obj["body"]
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        if body.get("n", 1) != 1 or body.get("stream", False):
            raise ValueError("n must be 1 and stream false in batch requests")
        payload = {k: v for k, v in body.items() if k not in _IGNORED_BODY_FIELDS}
        if url == "/v1/chat/completions" and "prompt" in payload:
            raise ValueError("/v1/chat/completions takes messages, not prompt")
        if url == "/v1/completions" and "messages" in payload:
            raise ValueError("/v1/completions takes prompt, not messages")
    else:
        payload = {k: v for k, v in obj.items() if k != "custom_id"}
        url = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    payload["custom_id"] = custom_id
    try:
        validate(payload)
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]
    return Line(number, custom_id, url, payload, f"batch-{digest}")


def output_line(line: Line, result: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch output line for a finished job."""
    created = int(result["timings"]["finished_at"])
    if line.url == "/v1/chat/completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]}}
        body = {"id": f"chatcmpl-{result['id']}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": result["text"]}
        body = {"id": f"cmpl-{result['id']}", "object": "text_completion"}
    choice.update({"finish_reason": result["finish_reason"], "logprobs": result.get("logprobs")})
    body.update({"created": created, "model": result["model"], "choices": [choice], "usage": result["usage"]})
    return {
        "id": f"batch_req_{result['id']}",
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": result["id"], "body": body},
        "error": None,
    }


def error_line(number: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "line": number, "response": None, "error": {"code": code, "message": message}}


class Progress:
    """A tqdm bar on a terminal; a log line every 10 s otherwise."""

    def __init__(self, total: int, already: int) -> None:
        self.total, self.done, self.already, self.tokens = total, already, already, 0
        self.start = time.monotonic()
        self.last_log = self.start
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=already, unit="req", dynamic_ncols=True)

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.start, 1e-6)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.tokens / elapsed:.0f} tok/s")
        elif time.monotonic() - self.last_log >= 10 or self.done == self.total:
            self.last_log = time.monotonic()
            rate = (self.done - self.already) / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(
                f"batch: {self.done}/{self.total} done, {self.tokens / elapsed:.1f} tok/s, ETA {eta:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _done_ids(path: Path) -> set[str]:
    done = set()
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                done.add(json.loads(text)["custom_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash: its request runs again
    return done


def run_batch(
    client: Client,
    input_path: str | Path,
    output_path: str | Path,
    *,
    errors_path: str | Path | None = None,
    max_in_flight: int = 256,
    timeout: float | None = None,
    poll_interval: float = 0.2,
) -> dict[str, int]:
    output_path = Path(output_path)
    errors_path = Path(errors_path) if errors_path else output_path.with_suffix(".errors.jsonl")
    done = _done_ids(output_path)
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    total = 0
    for number, text in enumerate(Path(input_path).read_text().splitlines(), start=1):
        if not text.strip():
            continue
        total += 1
        try:
            line = parse_line(number, text)
        except ValueError as exc:
            errors.append(error_line(number, None, "invalid_request", str(exc)))
            continue
        if line.custom_id in seen:
            errors.append(error_line(number, line.custom_id, "duplicate_custom_id", "custom_id already used above"))
            continue
        seen.add(line.custom_id)
        if line.custom_id not in done:
            lines.append(line)
    skipped = total - len(lines) - len(errors)
    progress = Progress(total, skipped + len(errors))
    conn = client.connection
    summary = {"total": total, "skipped": skipped, "succeeded": 0, "failed": len(errors)}
    with output_path.open("a") as out, errors_path.open("w") as err:
        for e in errors:
            err.write(json.dumps(e) + "\n")
        err.flush()
        pending = list(reversed(lines))
        in_flight: dict[str, tuple[Line, float]] = {}
        while pending or in_flight:
            _submit(client, pending, in_flight, max_in_flight)
            with conn.pipeline(transaction=False) as pipe:
                for job_id in in_flight:
                    pipe.get(result_key(job_id))
                    pipe.hget(f"rq:job:{job_id}", "status")
                replies = pipe.execute()
            now = time.monotonic()
            for (job_id, (line, started)), raw, status in zip(list(in_flight.items()), replies[::2], replies[1::2]):
                status = status.decode() if status else "missing"
                result = json.loads(raw) if raw else None
                if result is not None and result.get("status") == "finished":
                    out.write(json.dumps(output_line(line, result), ensure_ascii=False) + "\n")
                    summary["succeeded"] += 1
                    progress.update(result["usage"]["completion_tokens"])
                elif status in ("failed", "canceled", "stopped", "missing") or (
                    timeout is not None and now - started > timeout
                ):
                    reason = (result or {}).get("error") or _failure_reason(client, job_id, status, timeout)
                    err.write(json.dumps(error_line(line.number, line.custom_id, "job_" + status, reason)) + "\n")
                    summary["failed"] += 1
                    progress.update(0)
                else:
                    continue
                del in_flight[job_id]
            out.flush()
            err.flush()
            if in_flight:
                time.sleep(poll_interval)
    progress.close()
    return summary


def _submit(client: Client, pending: list[Line], in_flight: dict[str, tuple[Line, float]], limit: int) -> None:
    """Top up to ``limit`` jobs in flight; a line whose job exists from an earlier run is picked up, not redone."""
    take = []
    while pending and len(in_flight) + len(take) < limit:
        take.append(pending.pop())
    if not take:
        return
    with client.connection.pipeline(transaction=False) as pipe:
        for line in take:
            pipe.hget(f"rq:job:{line.job_id}", "status")
        statuses = pipe.execute()
    fresh = []
    for line, status in zip(take, statuses):
        status = status.decode() if status else None
        if status in ("queued", "started", "finished", "scheduled", "deferred"):
            in_flight[line.job_id] = (line, time.monotonic())
            continue
        if status is not None:  # failed or canceled last time: run it again
            client.connection.delete(f"rq:job:{line.job_id}", result_key(line.job_id))
        fresh.append(line)
    if fresh:
        client.submit_many([{**line.payload, "job_id": line.job_id} for line in fresh])
        for line in fresh:
            in_flight[line.job_id] = (line, time.monotonic())


def _failure_reason(client: Client, job_id: str, status: str, timeout: float | None) -> str:
    if status in ("queued", "started"):
        return f"no result within {timeout} s"
    if status == "missing":
        return "the job disappeared from Redis (expired or deleted)"
    from producer.client import JobError

    try:
        client.job(job_id)._raise_ended(status)
    except JobError as exc:
        return exc.reason
    return status
