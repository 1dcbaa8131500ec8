"""``roseinfer batch``: rows in (OpenAI batch lines or plain rows, JSONL or Parquet), their outputs out; resumable.

Each line gets a job id derived from its custom_id and content, so a rerun after a crash picks up jobs that
are still queued or already finished instead of generating them again, and skips lines already in the output.
Rows taken from an earlier run's jobs are counted (``reused``); a run id (``--fresh``) gives every line new job ids.
Bad lines and failed jobs go to the errors file (rewritten each run, so failures are retried); none stops the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError
from redis.exceptions import ResponseError

from producer.batch_io import (
    DEFAULT_FIELDS,
    OUTPUT_FORMATS,
    JSONLSink,
    ParquetSink,
    RowOptions,
    Undecodable,
    count_rows,
    format_of,
    input_columns,
    open_lines,
    opens_a_json_array,
    payload_digest,
    read_rows,
)
from producer.chat_render import template_messages
from producer.client import Client, JobIdTaken, validate
from producer.connection import REDIS_UNAVAILABLE, redis_waits
from producer.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_choices,
    chat_logprobs,
    completion_choices,
    fit_to_context,
    parse,
    prompt_logprobs,
    samples,
    without_output,
)
from producer.protocol import (
    BULK_PRIORITY,
    DEFAULT_QUEUE,
    STREAM_TTL_AFTER_END_S,
    done_key,
    read_result,
    result_from_entries,
    result_key,
)
from producer.reasoning import FORMATS as REASONING_FORMATS
from producer.reasoning import ReasoningFormat, job_fields_of, plan_for
from producer.responses_api import ResponsesRequest, ResponseWriter, parse_responses
from producer.schema import JobRequest, lone_surrogate
from producer.token_names import BY_ID, TokenNames, digest_of, load_names
from producer.tool_calls import ToolChoice

log = logging.getLogger("roseinfer.batch")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
# Statuses of an earlier run's job that will still give (or gave) a result: followed, not submitted again.
_LIVE = ("queued", "started", "scheduled", "deferred")
RUN_ID = re.compile(r"[A-Za-z0-9]{1,32}")
ID_FIELD = "custom_id"
# A plain row is named row-N unless --id-column names its id: a custom_id of its own was dropped without a word
# (and in a Parquet output its values would overwrite the ids the resume reads).
_UNREAD_ID = (
    "{what} 'custom_id', and plain rows are named row-N unless --id-column says otherwise: pass --id-column "
    "custom_id to name the rows by it, or rename it"
)


class BadLine(ValueError):
    """A line refused before any job is submitted; ``custom_id`` is the line's when it had a usable one."""

    def __init__(self, reason: str, custom_id: str | None = None, row: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.custom_id, self.row = custom_id, row  # (a plain row's columns: a Parquet output keeps its failed rows)


REDIS_PATIENCE_S = 600.0  # a run waits this long for a Redis that went away (a failover takes seconds to a minute)


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, SIGHUP: ``signum``) during a batch. The output then holds complete lines only; ``summary``
    counts what was done."""

    def __init__(self, summary: dict[str, int], signum: int = signal.SIGINT) -> None:
        super().__init__()
        self.summary, self.signum = summary, signum


class _Signaled(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum


class RedisLost(RuntimeError):
    """Redis went away during a batch for longer than ``REDIS_PATIENCE_S``. As after Ctrl-C, the output holds
    complete lines only and ``summary`` counts what was done; the jobs submitted go on in the workers, and a rerun
    resumes."""

    def __init__(self, summary: dict[str, int], cause: Exception) -> None:
        super().__init__(f"Redis unavailable for over {REDIS_PATIENCE_S:g} s during the run ({cause})")
        self.summary = summary


@dataclass
class Line:
    number: int
    custom_id: str
    url: str
    payload: dict[str, Any]
    job_id: str
    row: dict[str, Any] | None = None  # a plain row's columns (a Parquet output keeps them)
    prompt_logprobs: int | None = None  # what the line asked for (vLLM's), shown in its output line
    echo: bool = False  # a completion's echo: its output begins with the prompt (and its logprobs)
    chat: ChatCompletionRequest | None = None  # the chat request an OpenAI line means: its tool calls, its echo
    responses: ResponsesRequest | None = None  # a /v1/responses line's request: its output is a response object
    reasoning: ReasoningFormat | None = None  # how a chat's thinking is told from its answer (--reasoning-parser)
    echo_only: bool = False  # a completion's echo with max_tokens 0: the prompt scored, the job's one token left out

    @property
    def tools(self) -> ToolChoice | None:
        return self.chat.tool_plan() if self.chat is not None else None  # (a plain line's tools ask for no calls)


def new_run_id() -> str:
    return secrets.token_hex(4)


def job_id_for(payload: dict[str, Any], run_id: str | None = None, queue: str = DEFAULT_QUEUE) -> str:
    """The same line and settings give the same job id; a run id gives new ones, and so does another queue (its
    workers may serve another model: a run on it must not take the jobs of a run on this one for its results).

    ``--fresh`` takes new ids rather than deleting the earlier jobs: the worker derives an unseeded sampled job's
    seed from its id, so the same id would replay the same samples, and another run may still follow those jobs.
    """
    # Not the priority: it orders the jobs and changes no output, so a rerun at another one resumes the same rows.
    # (Taken as the default every earlier run wrote: their ids stay as they were.)
    same_output = {**payload, "priority": BULK_PRIORITY, **_on_queue(queue)}
    digest = hashlib.sha256(json.dumps(same_output, sort_keys=True).encode()).hexdigest()[:24]
    return f"batch-{digest}" if run_id is None else f"batch-{run_id}-{digest}"


def _on_queue(queue: str) -> dict[str, str]:
    """What the queue adds to a run's job ids: nothing for the default one, whose ids stay as they were."""
    return {} if queue == DEFAULT_QUEUE else {"queue": queue}


def parse_line(
    number: int,
    text: str | bytes | dict[str, Any] | Undecodable,
    run_id: str | None = None,
    priority: int = BULK_PRIORITY,
    options: RowOptions | None = None,
    queue: str = DEFAULT_QUEUE,
) -> Line:
    """One input row (a JSONL line's text, or a Parquet row) into a job payload (at ``priority`` unless it says;
    the run's defaults where it names none); BadLine (a ValueError) with a readable reason for a bad one."""
    options = options or RowOptions()
    # A plain row's id is its number where no column names it: known even for a row that cannot be read (a Parquet
    # output holds every row of the input, a failed one too).
    numbered = f"row-{number}" if options.plain and options.id_column is None else None
    try:
        if isinstance(text, Undecodable):
            raise BadLine(text.reason)
        line_text = None if isinstance(text, dict) else _utf8(text)
        obj = text if line_text is None else _json(line_text)
        if not isinstance(obj, dict):
            raise BadLine("a line must be a JSON object")
    except BadLine as exc:
        if exc.custom_id is None and numbered is not None:
            raise BadLine(str(exc), numbered) from None
        raise
    if options.plain:
        key = options.id_column
        if key is None and ID_FIELD in obj:
            raise BadLine(_UNREAD_ID.format(what="this row has a field"), numbered)
        given = obj.get(key) if key is not None else f"row-{number}"
        custom_id = str(given) if isinstance(given, (int, str)) and not isinstance(given, bool) else None
        if key is not None and not custom_id:
            raise BadLine(f"the id column {key!r} must hold a non-empty string or integer, got {given!r}")
    else:
        custom_id = obj.get("custom_id", f"line-{number}")
        if not isinstance(custom_id, str) or not custom_id:
            raise BadLine("custom_id must be a non-empty string")
    # Bytes decoded as UTF-8 hold a surrogate only through a \u escape: most lines are spared the check.
    if line_text is not None and (isinstance(text, str) or "\\u" in line_text):
        surrogate = lone_surrogate(obj)
        if surrogate is not None:
            message = f"not valid Unicode: a lone surrogate {surrogate!r} (a \\u escape of half a UTF-16 pair)"
            raise BadLine(message, custom_id if lone_surrogate(custom_id) is None else None)
    asked_as: tuple[Any, Any] = (None, None)  # an OpenAI line's request and its job's, as the server reads them
    try:
        if options.plain:
            (url, payload), api_defaults = _row_payload(obj, options), {}
        else:
            url, payload, api_defaults, asked_as = _payload(
                obj, options.tool_call_parser, options.reasoning_parser, options.defaults.get("response_format")
            )
        _apply_defaults(payload, options.defaults)
        payload.update((k, v) for k, v in api_defaults.items() if k not in payload)  # (the run's came first)
        payload["custom_id"] = custom_id
        payload.setdefault("priority", priority)
        job = validate(payload)  # InvalidRequest is a ValueError
        reasoning = _row_reasoning(payload, job, options) if options.plain and job.messages else None
    except ValueError as exc:
        raise BadLine(str(exc), custom_id, obj if options.plain else None) from None
    row = obj if options.plain else None
    # As the line asked: an echo puts prompt_logprobs in the payload too, for the prompt it shows its own way.
    asked = {} if options.plain else obj.get("body", obj)
    shown, echo = asked.get("prompt_logprobs"), bool(asked.get("echo"))
    request, chat = asked_as
    responses = request if isinstance(request, ResponsesRequest) else None
    chat = chat if isinstance(chat, ChatCompletionRequest) else None
    reasoning = chat.reasoning_plan() if chat is not None else reasoning
    # An OpenAI line's context_overflow follows from its max_tokens: out of its id, as the runs before it had none.
    hashed = payload if options.plain else {k: v for k, v in payload.items() if k != "context_overflow"}
    job_id = job_id_for(hashed, run_id, queue)
    echo_only = isinstance(request, CompletionRequest) and request.echo_only
    return Line(number, custom_id, url, payload, job_id, row, shown, echo, chat, responses, reasoning, echo_only)


def _row_reasoning(payload: dict[str, Any], job: JobRequest, options: RowOptions) -> ReasoningFormat | None:
    """A plain chat row's reasoning format (the run's --reasoning-parser), as the server's for a chat: its job
    thinks before a constraint that lets it, and keeps special tokens where the markers are some."""
    if options.reasoning_parser is None:
        return None
    form = job.structured_form() or {}
    fmt = plan_for(REASONING_FORMATS[options.reasoning_parser], next((k for k in form if k != "thinking"), None))
    if added := {k: v for k, v in job_fields_of(fmt, bool(form)).items() if k not in payload}:
        payload.update(added)
        validate(payload)
    return fmt


def _utf8(text: str | bytes) -> str:
    """A JSONL line's text; BadLine for bytes that are not UTF-8 (never replaced: the job would run on a damaged
    prompt)."""
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"not UTF-8: {exc.reason} (byte {exc.object[exc.start]:#04x} at byte {exc.start})") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text.rstrip("\r\n"))  # (with its newline, a line cut short was said to end on line 2)
    except ValueError as exc:  # JSONDecodeError, or a number past Python's 4,300 digits (it stopped the whole run)
        raise BadLine(f"not JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested past the parser's depth: it stopped the whole run
        raise BadLine("nested too deeply to read") from None


def _row_payload(row: dict[str, Any], options: RowOptions) -> tuple[str, dict[str, Any]]:
    """A plain row's prompt (or messages) column; its other columns are data, not settings."""
    if options.messages_column is not None:
        messages = _text_cells(row.get(options.messages_column))
        if not isinstance(messages, list):
            raise ValueError(f"the messages column {options.messages_column!r} must hold a list of messages")
        return "/v1/chat/completions", {"messages": messages}
    prompt = _text_cells(row.get(options.prompt_column))  # type: ignore[arg-type]
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt column {options.prompt_column!r} must hold text, got {type(prompt).__name__}")
    if options.chat:  # an instruct model's chat template around it (a raw prompt only continues the text)
        system = [{"role": "system", "content": options.system}] if options.system else []
        return "/v1/chat/completions", {"messages": [*system, {"role": "user", "content": prompt}]}
    return "/v1/completions", {"prompt": prompt}


def _text_cells(value: Any) -> Any:
    """A Parquet cell's text stored as binary (Spark and other writers make such columns) as str, within lists and
    structs too: bytes went into the payload and failed the whole run at its first row, as no JSON can hold them."""
    if isinstance(value, bytes):
        return _utf8(value)
    if isinstance(value, list):
        return [_text_cells(v) for v in value]
    if isinstance(value, dict):
        return {k: _text_cells(v) for k, v in value.items()}
    return value


def _apply_defaults(payload: dict[str, Any], defaults: dict[str, Any]) -> None:
    """The run's defaults (``--max-tokens`` ...) for what the row does not set itself."""
    for name in DEFAULT_FIELDS:
        if name not in defaults or name in payload:
            continue
        if name == "response_format" and "structured_outputs" in payload:
            continue
        payload[name] = defaults[name]


def _payload(
    obj: dict[str, Any],
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    response_format: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any], dict[str, Any], tuple[Any, Any]]:
    """The endpoint and the job payload (without custom_id) of an OpenAI batch line or a plain line, the fields
    an OpenAI line leaves to the API's defaults, which yield to the run's, and its request and the chat or
    completion request of its job as the server reads them (a /v1/responses line's chat; None for a plain line).
    ``response_format``: the run's, for a request that gives none: read with the request, as the server would read
    it there (added to the job afterwards, a reasoning parser's thinking never heard of it: the JSON answer went to
    the reasoning, the content was null)."""
    if "body" not in obj and ("method" in obj or "url" in obj):  # (else read as a plain line: "unknown field url")
        raise ValueError("an OpenAI batch line needs a body: the request, as a JSON object")
    if "body" not in obj:
        payload = {k: v for k, v in obj.items() if k != "custom_id"}
        return ("/v1/chat/completions" if "messages" in payload else "/v1/completions"), payload, {}, (None, None)
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
    if body.get("stream", False):
        raise ValueError("stream must be false in batch requests")
    if url == "/v1/chat/completions" and "prompt" in body:
        raise ValueError("/v1/chat/completions takes messages, not prompt")
    if url == "/v1/completions" and "messages" in body:
        raise ValueError("/v1/completions takes prompt, not messages")
    # The server's reading of OpenAI's request (max_completion_tokens, content as text parts, logprobs forms);
    # roseinfer's own fields (priority, metadata) pass through.
    own = {k: body[k] for k in ("priority", "metadata") if k in body}
    request = {k: v for k, v in body.items() if k not in own}
    if response_format is not None and response_format.get("type") != "text":
        text = request.get("text", {})
        if url != "/v1/responses":
            if "response_format" not in request and "structured_outputs" not in request:
                request["response_format"] = response_format
        elif isinstance(text, dict) and text.get("format") is None:  # (a text that is no object: the parse says so)
            request["text"] = {**text, "format": _text_format(response_format)}
    try:
        if url == "/v1/responses":
            asked, parsed, payload = parse_responses({"model": "batch", **request}, tool_parser, reasoning_parser)
        else:
            parsed, payload = parse(REQUESTS[url], {"model": "batch", **request}, tool_parser, reasoning_parser)
            asked = parsed
    except APIError as exc:
        raise ValueError(exc.message) from None
    if getattr(parsed, "echo", False):  # the output line is made from the result: it needs the prompt in it
        payload.setdefault("prompt_logprobs", 0)
    # What the body leaves to the API's defaults (n 1; a completion's max_tokens 16) yields to the run's (--n,
    # --max-tokens): set aside, taken only where the run gives none.
    given = parsed.model_fields_set | ({"max_tokens"} if "max_completion_tokens" in parsed.model_fields_set else set())
    api_defaults = {k: payload.pop(k) for k in ("n", "max_tokens") if k in payload and k not in given}
    # A max_tokens the body sets must fit the context, as the server (and OpenAI's Batch API) refuses it otherwise.
    return url, {**fit_to_context(payload), **own}, api_defaults, (asked, parsed)


def _text_format(response_format: dict[str, Any]) -> dict[str, Any]:
    """A chat's response_format as the Responses API's ``text.format``."""
    if response_format.get("type") == "json_schema":
        return {"type": "json_schema", **response_format.get("json_schema", {})}
    return {"type": response_format.get("type", "json_object")}


def output_line(line: Line, result: dict[str, Any], names: Callable[[str], TokenNames] | None = None) -> dict[str, Any]:
    """The OpenAI batch output line for a finished job; ``names``: the token names of a model, for logprobs (by id
    without)."""
    created = int(result["timings"]["finished_at"])
    asked = line.payload.get("logprobs")
    top = None
    if asked is not None and asked is not False:  # OpenAI's shape
        top = (line.payload.get("top_logprobs") or 0) if asked is True else asked
    named = top is not None or line.prompt_logprobs is not None
    token_names = names(result["model"]) if named and names is not None else BY_ID
    tools = line.tools
    if line.responses is not None:
        writer = ResponseWriter(result["id"], result["model"], line.responses, tools, top, token_names, line.reasoning)
        return _output_line(line, result, {**writer.whole(result), "created_at": created})
    if line.url == "/v1/chat/completions":
        body = {"id": f"chatcmpl-{result['id']}", "object": "chat.completion"}
        echoed = line.chat.echoed if line.chat is not None else ""
        shown = line.chat is None or line.chat.include_reasoning is not False
        choices = chat_choices(result, None, tools=tools, echoed=echoed, reasoning=line.reasoning, shown=shown)
        if top is not None:
            for choice, sample in zip(choices, samples(result)):
                choice["logprobs"] = chat_logprobs(sample, top, token_names)
    else:
        body = {"id": f"cmpl-{result['id']}", "object": "text_completion"}
        result = without_output(result) if line.echo_only else result
        choices = completion_choices(result, top, echo=line.echo, names=token_names)
    for choice, sample in zip(choices, samples(result)):
        if choice["finish_reason"] != "tool_calls":  # ("auto" called tools: OpenAI's reason, as the server's)
            choice["finish_reason"] = sample["finish_reason"]  # as the job ended (OpenAI's batch keeps them)
    if line.prompt_logprobs is not None:  # where vLLM's responses hold them
        shown = prompt_logprobs(result, line.prompt_logprobs, token_names)
        for choice in [body] if line.url == "/v1/chat/completions" else choices:
            choice["prompt_logprobs"] = shown
    body.update({"created": created, "model": result["model"], "system_fingerprint": result.get("system_fingerprint"),
                 "choices": choices, "usage": result["usage"]})  # fmt: skip
    return _output_line(line, result, body)


def _output_line(line: Line, result: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{result['id']}",
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": result["id"], "body": body},
        "error": None,
    }


def error_line(
    number: int, custom_id: str | None, code: str, message: str, job_id: str | None = None
) -> dict[str, Any]:
    """OpenAI's per-line object of a batch's error file (plus the input ``line``): ``id`` names the job that failed,
    as the output names the one that finished; null for a row refused before it became a job."""
    return {
        "id": f"batch_req_{job_id}" if job_id else None,
        "custom_id": custom_id,
        "line": number,
        "response": None,
        "error": {"code": code, "message": message},
    }


def duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``: short enough for a progress line."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """A tqdm bar on a terminal; otherwise a log line every ``log_interval`` seconds, whether jobs end or not."""

    def __init__(
        self, total: int, already: int, failed: int = 0, log_interval: float = 10.0, stream: TextIO | None = None
    ) -> None:
        """``already`` rows are done before the first job (in the output, or bad lines), ``failed`` of them bad."""
        self.stream = stream or sys.stderr
        self.total, self.done, self.already, self.failed, self.tokens = total, already, already, failed, 0
        self.log_interval = log_interval
        self.start = self.last_log = time.monotonic()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            # (smoothing 0: the rate is the rows made over the time taken, which rows skipped stay out of; tqdm's
            # moving average counted the skipped rows of a resumed run, thousands a second)
            self.bar = tqdm(total=total, initial=already, unit="row", dynamic_ncols=True, file=self.stream, smoothing=0)

    def update(self, tokens: int, failed: bool = False, made_before: bool = False) -> None:
        """A row whose job ended; ``made_before``: its job had ended before this run (its result taken, not made:
        out of the rates, which it made absurd after a resume, and the ETA with them)."""
        if made_before:
            self.skip()
            return
        self.done += 1
        self.failed += failed
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.tokens / self._elapsed():.0f} tok/s", refresh=False)  # (drawn at its pace)

    def skip(self, failed: bool = False) -> None:
        """A row settled without a job (already in the output, or a bad line): done, but not in the rates."""
        self.done += 1
        self.already += 1
        self.failed += failed
        if self.bar is not None:
            self.bar.initial += 1  # (out of its rate and ETA, as the log lines keep it)
            self.bar.update(1)

    def tick(self) -> None:
        """Called every poll: a log line off a terminal once ``log_interval`` has passed since the last."""
        if self.bar is None and time.monotonic() - self.last_log >= self.log_interval:
            self.last_log = time.monotonic()
            rate = (self.done - self.already) / self._elapsed()
            eta = duration((self.total - self.done) / rate) if rate > 0 else "unknown"
            self._print(
                f"batch: {self.done}/{self.total} rows done ({self.failed} failed), {rate:.2f} rows/s, "
                f"{self.tokens / self._elapsed():.1f} tokens/s, ETA {eta}"
            )

    def finish(self, summary: dict[str, Any], output: Path, errors: Path) -> None:
        self.close()
        elapsed = self._elapsed()
        reused = f" ({summary['reused']} from an earlier run's jobs)" if summary["reused"] else ""
        reasons = ", ".join(f"{n} {code}" for code, n in sorted(summary.get("failures", {}).items()))
        failed = f" ({reasons}; see {errors})" if summary["failed"] else ""
        self._print(
            f"batch: {summary['total']} rows in {duration(elapsed)}: {summary['succeeded']} succeeded{reused}, "
            f"{summary['failed']} failed{failed}, {summary['skipped']} already in {output}; "
            f"{(self.done - self.already) / elapsed:.2f} rows/s, {self.tokens / elapsed:.1f} tokens/s"
        )

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self._print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _elapsed(self) -> float:
        return max(time.monotonic() - self.start, 1e-6)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def default_errors_path(output_path: str | Path, dry: bool = False) -> Path:
    """``out.jsonl`` -> ``out.errors.jsonl`` (``out.dry-run-errors.jsonl`` for a dry run, which so leaves the last
    real run's errors in place): the output's last suffix replaced."""
    return Path(output_path).with_suffix(".dry-run-errors.jsonl" if dry else ".errors.jsonl")


Sink = JSONLSink | ParquetSink


def settings_path(output_path: Path) -> Path:
    """Beside the output: the settings its rows were made with (a rerun with others is refused)."""
    return output_path.with_name(output_path.name + ".batch.json")


def _stored_settings(output_path: Path) -> Any:
    """What the output's settings file holds (parsed), or None where there is none to read."""
    try:
        return json.loads(settings_path(output_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _begun_before_queues(output_path: Path) -> bool:
    """Whether a run began this output before job ids and settings named their queue (its settings file names
    none): its job ids name no queue, so a resume finds that run's jobs and rows, and any queue may go on with it."""
    before = _stored_settings(output_path)
    return isinstance(before, dict) and "id_column" in before and "queue" not in before


def _settings_on(output_path: Path, options: RowOptions, queue: str) -> tuple[dict[str, Any], str]:
    """The run's settings as its output keeps them, and the queue its job ids name (an output begun before ids
    named their queue keeps its ids, on any queue)."""
    if _begun_before_queues(output_path):
        return options.fingerprint(), DEFAULT_QUEUE
    return {**options.fingerprint(), "queue": queue}, queue


def _run_id_of(output_path: Path, run_id: str | None) -> str | None:
    """``run_id``, else the one the output's settings file keeps: a ``--fresh`` run's, which a rerun resumes (one
    killed, by kill -9 or the OOM killer, never printed it; its Parquet rows come back only from its jobs)."""
    if run_id is not None:
        return run_id
    before = _stored_settings(output_path)
    stored = before.get("run_id") if isinstance(before, dict) else None
    return stored if isinstance(stored, str) and RUN_ID.fullmatch(stored) else None


def _differences(before: dict[str, Any], now: dict[str, Any], where: str = "") -> list[str]:
    """Where two settings differ, each as 'defaults.max_tokens: 64 in the output, 32 now' (the whole of both, a
    schema and all, buried the one difference in a kilobyte)."""
    out = []
    for key in sorted(set(before) | set(now)):
        name, old, new = f"{where}{key}", before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += _differences(old, new, name + ".")
        elif old != new:
            out.append(f"{name}: {_shown(old)} in the output, {_shown(new)} now")
    return out


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_settings(
    output_path: Path, fingerprint: dict[str, Any], has_rows: bool, write: bool = True, run_id: str | None = None
) -> None:
    """Other settings than those the output's rows were made with are refused; this run's are kept (``write``),
    with its run id (which is not a setting: a rerun may name another, ``--fresh``)."""
    before = _stored_settings(output_path) if has_rows else None
    if isinstance(before, dict):
        before.pop("run_id", None)
    if before is not None and before != fingerprint:
        differ = "; ".join(_differences(before, fingerprint)) if isinstance(before, dict) else "unreadable"
        raise ValueError(
            f"{output_path} holds rows made with other settings ({differ}): write to a new output, or run with the "
            "same settings"
        )
    if write:
        kept = {**fingerprint, "run_id": run_id} if run_id is not None else fingerprint
        settings_path(output_path).write_text(json.dumps(kept, sort_keys=True) + "\n")


def _formats(input_path: Path, input_format: str | None, output_path: Path, output_format: str | None):
    in_fmt, out_fmt = format_of(input_path, input_format), format_of(output_path, output_format)
    if out_fmt not in OUTPUT_FORMATS:
        raise ValueError(f"an output is one of {OUTPUT_FORMATS} (datasets loads Parquet: Dataset.from_parquet)")
    return in_fmt, out_fmt


def _check_columns(input_path: Path, input_format: str, options: RowOptions) -> None:
    """The columns the run reads, in a table's schema (a JSONL file has none to look at): a missing one is one
    error, not one failed row each. So is a JSONL input that is a JSON array."""
    if options.id_column is not None and not options.plain:
        raise ValueError("--id-column names the id column of plain rows: give --prompt-column or --messages-column")
    if input_format == "jsonl" and opens_a_json_array(input_path):
        raise ValueError(
            f"{input_path} holds a JSON array, not JSON Lines (one object a line): convert it first, e.g. "
            f"jq -c '.[]' {shlex.quote(str(input_path))} > rows.jsonl"
        )
    columns = input_columns(input_path, input_format)
    if columns is None:
        return
    for flag, name in (("--prompt-column", options.prompt_column), ("--messages-column", options.messages_column),
                       ("--id-column", options.id_column)):  # fmt: skip
        if name is not None and name not in columns.names:
            raise ValueError(f"{flag} {name!r}: {input_path} has no such column (it has {', '.join(columns.names)})")
    if options.plain and options.id_column is None and ID_FIELD in columns.names:
        raise ValueError(_UNREAD_ID.format(what="the input has a column"))


def _open_sink(output_path: Path, output_format: str, input_path: Path, input_format: str, options: RowOptions) -> Sink:
    if output_format == "jsonl":
        return JSONLSink(output_path)
    id_column = options.id_column or ID_FIELD  # (an input column of that name was refused: _check_columns)
    columns = input_columns(input_path, input_format) if options.plain else None
    reasoning = options.reasoning_parser is not None  # (a reasoning column beside the output)
    return ParquetSink(output_path, columns, id_column, int(options.defaults.get("n", 1)), reasoning)


def check_run_settings(options: RowOptions, priority: int, max_in_flight: int = 1) -> None:
    """The run's defaults and priority, checked once as every job's payload is (JobRequest): a bad one is one
    ValueError before anything is read or written, not an error on every row and a state file that keeps it."""
    if max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be at least 1, got {max_in_flight}")
    values = {**options.defaults, "priority": priority}
    try:
        JobRequest.model_validate({"prompt": "x", **values})
    except ValidationError as exc:
        problems = "; ".join(_settings_problem(error, values) for error in exc.errors())
        raise ValueError(f"bad batch settings: {problems}") from None


def _settings_problem(error: Any, values: dict[str, Any]) -> str:
    """``--temperature 5.0: Input should be ...``: named by the flag that set it (and the place in a nested value)."""
    if not error["loc"]:
        return error["msg"]
    name, *inner = error["loc"]
    flag = "--" + str(name).replace("_", "-")
    where = ".".join(str(part) for part in inner) if inner else values.get(name)
    return f"{flag} {where}: {error['msg']}"


def run_batch(
    client: Client,
    input_path: str | Path,
    output_path: str | Path,
    *,
    errors_path: str | Path | None = None,
    max_in_flight: int = 256,
    timeout: float | None = None,
    poll_interval: float = 0.2,
    log_interval: float = 10.0,
    run_id: str | None = None,
    priority: int = BULK_PRIORITY,
    options: RowOptions | None = None,
    input_format: str | None = None,
    output_format: str | None = None,
) -> dict[str, Any]:
    """Run every row of ``input_path`` as a job; returns ``total``, ``skipped`` (already in the output),
    ``succeeded``, ``failed``, ``reused`` (succeeded rows whose job an earlier run had submitted) and ``failures``
    (failed rows by reason).

    ``run_id`` derives new job ids (see ``job_id_for``): pass a new one to generate again what an earlier run's
    jobs still hold in Redis, the same one to resume that run. Ctrl-C raises BatchInterrupted with the counts.
    """
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ValueError(f"a run id is 1 to 32 letters and digits, got {run_id!r}")
    queue = client.queue.name
    options = options or RowOptions()
    check_run_settings(options, priority, max_in_flight)
    input_path, output_path = Path(input_path), Path(output_path)
    in_fmt, out_fmt = _formats(input_path, input_format, output_path, output_format)
    options = options.for_format(in_fmt)
    errors_path = Path(errors_path) if errors_path else default_errors_path(output_path)
    _check_paths(errors_path, input_path, output_path)
    _check_columns(input_path, in_fmt, options)
    summary: dict[str, Any] = {"total": 0, "skipped": 0, "succeeded": 0, "failed": 0, "reused": 0, "failures": {}}
    progress: Progress | None = None
    try:
        summary["total"] = count_rows(input_path, in_fmt)  # a first pass that keeps nothing: for progress and ETA
        with _only_run_on(output_path):
            client.connection.ping()  # a Redis that does not answer: one error, and nothing written (settings, errors)
            sink = _open_sink(output_path, out_fmt, input_path, in_fmt, options)
            done = sink.done()
            settings, queue = _settings_on(output_path, options, queue)
            run_id = _run_id_of(output_path, run_id)
            _check_settings(output_path, settings, bool(done), run_id=run_id)  # a refused run leaves the last errors
            with open_lines(errors_path, "w") as err, _signals_interrupt():
                progress = Progress(summary["total"], 0, 0, log_interval)
                sink.open(err)
                try:
                    lines = _read_input(
                        input_path, in_fmt, options, done, run_id, queue, summary, priority, sink, progress
                    )
                    try:
                        _run(client, lines, sink, progress, summary, max_in_flight, timeout, poll_interval)
                    except (*REDIS_UNAVAILABLE, ResponseError) as exc:  # (it answered the ping: not a wrong URL)
                        if not redis_waits(exc):
                            raise
                        raise RedisLost(summary, exc) from exc
                finally:  # also on Ctrl-C: every row is written whole, and a Parquet output gets its footer
                    sink.close()
        progress.finish(summary, output_path, errors_path)
    except KeyboardInterrupt as exc:
        raise BatchInterrupted(summary, getattr(exc, "signum", signal.SIGINT)) from None
    finally:
        if progress is not None:
            progress.close()
    return summary


def _check_paths(errors_path: Path, input_path: Path, output_path: Path) -> None:
    """The input is read twice (its rows counted first), so it is a file, not a pipe (the count would use it up
    and the run would find no row); the output is appended to, and the errors file rewritten each run: neither is
    the input, nor one the other."""
    if input_path.exists() and not (input_path.is_file() or input_path.is_dir()):  # (a folder: a saved dataset)
        raise ValueError(
            f"the input {input_path} is not a regular file (a pipe?): it is read twice, to count its rows first; "
            "save it to a file"
        )
    if output_path.resolve() == input_path.resolve():
        raise ValueError(f"the output {output_path} is the input: give -o another path")
    for name, path in (("input", input_path), ("output", output_path)):
        if errors_path.resolve() == path.resolve():
            raise ValueError(f"the errors file {errors_path} is the {name}: give --errors another path")


@contextmanager
def _only_run_on(output_path: Path) -> Iterator[None]:
    """One run at a time on an output (a lock file beside it, held while the run writes): two at once wrote every
    row twice into a JSONL output, and left a Parquet output corrupt."""
    if not output_path.parent.is_dir():
        raise ValueError(f"the output's folder {output_path.parent} does not exist")
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    lock_path = output_path.with_name(output_path.name + ".lock")
    while True:
        lock = open(lock_path, "a")  # noqa: SIM115 (closed below, or when the run ends)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ValueError(
                f"another run is writing {output_path} (it holds {lock_path}); wait for it to end"
            ) from None
        # The file locked must still be the one at the path: a run that ended removed it after this one opened it,
        # and a third run would lock a new file beside this one's lock of the removed one.
        try:
            if os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    with lock:
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)  # the lock goes with its run


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (a kill, a closed terminal) stop the run as Ctrl-C does: every row settled is written and
    the output is whole and resumable. The first only: a second one acts as it did before the run. One ignored
    when the run starts stays ignored: ``nohup`` ignores SIGHUP so that a run outlives its terminal."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may handle signals
        yield
        return
    names = [
        name
        for name in ("SIGTERM", "SIGHUP")
        if hasattr(signal, name) and signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN
    ]
    before = {name: signal.getsignal(getattr(signal, name)) for name in names}

    def interrupt(signum: int, frame: Any) -> None:
        _restore(before)
        raise _Signaled(signum)

    for name in names:
        signal.signal(getattr(signal, name), interrupt)
    try:
        yield
    finally:
        _restore(before)


def _restore(handlers: dict[str, Any]) -> None:
    for name, handler in handlers.items():
        signal.signal(getattr(signal, name), handler)


def dry_run(
    input_path: str | Path,
    output_path: str | Path,
    *,
    errors_path: str | Path | None = None,
    run_id: str | None = None,
    priority: int = BULK_PRIORITY,
    options: RowOptions | None = None,
    input_format: str | None = None,
    output_format: str | None = None,
    tokenizer: Any = None,
    queue: str = DEFAULT_QUEUE,
) -> dict[str, Any]:
    """Check every row as ``run_batch`` would on ``queue``, submitting nothing: ``total``, ``valid`` (would run),
    ``skipped`` (already in the output), ``failed`` (bad rows, written to the errors file) and ``failures`` by
    reason. With a
    ``tokenizer`` (a transformers tokenizer: its chat template applied to messages), also ``prompt_tokens`` of the
    rows that would run and the longest one's, ``max_prompt_tokens``."""
    options = options or RowOptions()
    check_run_settings(options, priority)
    input_path, output_path = Path(input_path), Path(output_path)
    in_fmt, out_fmt = _formats(input_path, input_format, output_path, output_format)
    options = options.for_format(in_fmt)
    errors_path = Path(errors_path) if errors_path else default_errors_path(output_path, dry=True)
    _check_paths(errors_path, input_path, output_path)
    _check_columns(input_path, in_fmt, options)
    summary: dict[str, Any] = {"total": count_rows(input_path, in_fmt), "skipped": 0, "succeeded": 0, "failed": 0}
    summary.update(reused=0, failures={})
    # Under the run lock too: it reads (and may cut) the output's last line and rewrites the errors file.
    with _only_run_on(output_path):
        sink = _open_sink(output_path, out_fmt, input_path, in_fmt, options)
        done = sink.done(cut=False)
        settings, queue = _settings_on(output_path, options, queue)
        run_id = _run_id_of(output_path, run_id)
        _check_settings(output_path, settings, bool(done), write=False)  # the refusal the run would meet
        with open_lines(errors_path, "w") as err, open(os.devnull, "w") as quiet:
            sink.open(err, output=False)
            progress = Progress(summary["total"], 0, 0, log_interval=float("inf"), stream=quiet)
            lines = _read_input(input_path, in_fmt, options, done, run_id, queue, summary, priority, sink, progress)
            valid = prompt_tokens = longest = 0
            for line in lines:
                valid += 1
                if tokenizer is not None:
                    n = count_prompt_tokens(tokenizer, line.payload)
                    prompt_tokens, longest = prompt_tokens + n, max(longest, n)
            sink.flush()
    counts = {k: summary[k] for k in ("total", "skipped", "failed", "failures")}
    if tokenizer is not None:
        counts.update(prompt_tokens=prompt_tokens, max_prompt_tokens=longest)
    return {**counts, "valid": valid}


def count_prompt_tokens(tokenizer: Any, payload: dict[str, Any]) -> int:
    """The prompt's tokens as the worker makes them: the chat template applied to messages, a plain prompt as is."""
    if "messages" in payload:
        job = JobRequest.model_validate(payload)
        messages = template_messages(tokenizer, job)  # (the template's forms: tool calls' arguments, roles)
        return len(tokenizer.apply_chat_template(messages, return_dict=False, **job.template_args()))
    if "prompt_token_ids" in payload:
        return len(payload["prompt_token_ids"])
    return len(tokenizer.encode(payload["prompt"]))


def _read_input(
    path: Path,
    fmt: str,
    options: RowOptions,
    done: dict[str, int],
    run_id: str | None,
    queue: str,
    summary: dict[str, Any],
    priority: int,
    sink: Sink,
    progress: Progress,
) -> Iterator[Line]:
    """The rows still to run, read as they are needed (memory stays bounded by the jobs in flight, plus the ids
    seen); bad rows go to the errors, rows already in the output are counted as they come. A row in the output
    made from another request than this row's (the input changed since) is refused, not mixed in."""
    seen: set[str] = set()
    for number, raw in read_rows(path, fmt):
        try:
            line = parse_line(number, raw, run_id, priority, options, queue)
        except BadLine as exc:
            known = exc.custom_id is not None and exc.custom_id not in seen  # a row of its own in a Parquet output,
            # unless the output holds this id's row from before (kept, as a JSONL output keeps its line: both made
            # one id two rows)
            failed = Line(number, exc.custom_id, "", {}, "", exc.row) if known and exc.custom_id not in done else None
            if known:
                seen.add(exc.custom_id)  # its id is taken: a later row of the same id is a duplicate, not a 2nd row
            _bad(sink, error_line(number, exc.custom_id, "invalid_request", str(exc)), summary, progress, failed)
            continue
        if line.custom_id in seen:
            error = error_line(number, line.custom_id, "duplicate_custom_id", "custom_id already used above")
            _bad(sink, error, summary, progress)
            continue
        seen.add(line.custom_id)
        refused = sink.refuse(line.payload)
        if refused:
            kept = line if line.custom_id not in done else None  # (as above)
            _bad(sink, error_line(number, line.custom_id, "invalid_request", refused), summary, progress, kept)
            continue
        digest = done.get(line.custom_id)
        if digest is None:
            yield line
        elif digest == payload_digest(line.job_id):
            summary["skipped"] += 1
            progress.skip()
        else:
            message = "the output holds this custom_id made from another request (the row or the settings changed)"
            _bad(sink, error_line(number, line.custom_id, "changed_request", message), summary, progress)


def _bad(
    sink: Sink, error: dict[str, Any], summary: dict[str, Any], progress: Progress, line: Line | None = None
) -> None:
    """A row refused before it ran: in the errors, and given its ``line``, in a Parquet output as a failed row."""
    sink.error(error, line)
    _count_failure(summary, error["error"]["code"])
    progress.skip(failed=True)


def _count_failure(summary: dict[str, Any], code: str) -> None:
    summary["failed"] += 1
    summary["failures"][code] = summary["failures"].get(code, 0) + 1


def _run(
    client: Client,
    lines: Iterator[Line],
    sink: Sink,
    progress: Progress,
    summary: dict[str, Any],
    max_in_flight: int,
    timeout: float | None,
    poll_interval: float,
) -> None:
    """Keep jobs in flight and write each row as its job ends. The run's jobs push their ids onto a completion
    list of its own when they end, and the run blocks on it; every job in flight is also looked at now and then
    (``poll_interval``, backing off to 5 s or to ``poll_interval`` if longer), for the endings no job announces (a
    job that expired, one submitted by an earlier run, one canceled by a client older than this one's)."""
    conn = client.connection
    notify = f"batch-{secrets.token_hex(8)}"
    in_flight: dict[str, tuple[Line, float | None]] = {}  # job id -> its line, when it was first seen running
    reused: dict[str, bool] = {}  # job id -> whether it had ended before this run
    more = True
    sweep_every, next_sweep = poll_interval, 0.0
    workers, names = WorkerWatch(client, progress), ModelTokenNames(client)
    pending, outage = Lines(lines), RedisOutage(progress)
    try:
        while more or in_flight or pending.taken_back:
            try:
                picked_up = len(reused)
                more = _submit(client, pending, in_flight, max_in_flight, reused, notify)
                if len(reused) > picked_up:  # an earlier run's jobs: they announce their ends to it, so look now
                    sweep_every, next_sweep = poll_interval, 0.0
                if not in_flight:
                    continue  # (the input used up: nothing to wait for)
                if time.monotonic() >= next_sweep or outage.since is not None:  # (after an outage: every job)
                    ended = list(in_flight)
                    sweep_every = min(sweep_every * 2, max(poll_interval, 5.0))
                    next_sweep = time.monotonic() + sweep_every
                else:
                    ended = _wait_for_endings(conn, done_key(notify), min(1.0, next_sweep - time.monotonic()))
                ended = list(dict.fromkeys(j for j in ended if j in in_flight))  # an id pushed twice (a write again)
                _settle(client, ended, in_flight, reused, sink, progress, summary, timeout, names, pending)
                outage.over()
                progress.tick()
                workers.check()
            except (*REDIS_UNAVAILABLE, ResponseError) as exc:  # a failover, a restart: each step can be taken again
                if not redis_waits(exc):  # (full, read-only or loading for now: waited out as the worker waits)
                    raise
                outage.wait(exc)
    finally:
        with contextlib.suppress(*REDIS_UNAVAILABLE):  # (a list of ids; it expires) not an error on top of Redis gone
            conn.delete(done_key(notify))


class ModelTokenNames:
    """A run's token names per model (``TokenizerCache.names`` for a synchronous reader): the tokenizer a live worker
    serving the model wrote to Redis, looked up once a run; by id where there is none."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._by_model: dict[str, TokenNames] = {}

    def __call__(self, model: str) -> TokenNames:
        if model not in self._by_model:
            digest = digest_of(self.client.workers(), model)
            self._by_model[model] = load_names(self.client.connection, digest)
        return self._by_model[model]


WORKER_CHECK_S = 10.0  # how often a run waiting on its jobs looks for a live worker on the queue


class WorkerWatch:
    """Says once when no live worker serves the queue (the run's jobs wait there: a progress line of 0 rows/s told
    nothing of why), and again if the workers come and go."""

    def __init__(self, client: Client, progress: Progress) -> None:
        self.client, self.progress = client, progress
        self.next_check, self.warned = 0.0, False

    def check(self) -> None:
        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + WORKER_CHECK_S
        warning = self.client.no_worker_warning()
        if warning is not None and not self.warned:
            self.progress.note(warning)
        self.warned = warning is not None


def _wait_for_endings(conn, key: str, wait: float) -> list[str]:
    """Job ids pushed onto ``key`` within ``wait`` seconds: the first blocks, the rest come in the same call."""
    first = conn.blpop([key], timeout=max(wait, 0.01))
    if first is None:
        return []
    with conn.pipeline() as pipe:  # MULTI: nothing pushed between the read and the delete is lost
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        rest, _ = pipe.execute()
    return [x.decode() if isinstance(x, bytes) else x for x in [first[1], *rest]]


def _settle(
    client: Client,
    job_ids: list[str],
    in_flight: dict[str, tuple[Line, float | None]],
    reused: dict[str, bool],
    sink: Sink,
    progress: Progress,
    summary: dict[str, Any],
    timeout: float | None,
    names: ModelTokenNames | None = None,
    lines: Lines | None = None,
) -> None:
    """Write the rows of the jobs among ``job_ids`` that ended, and fail those running for longer than ``timeout``
    (from when a look first saw them started: time waiting in the queue, behind other jobs, is not theirs). A job
    Redis lost (no hash, no result: a restart without persistence) goes back to ``lines`` to be submitted again,
    once: its row failed ``job_missing``, though Redis only was at fault."""
    if not job_ids:
        return
    with client.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:  # the status first, as the client reads them
            pipe.hget(f"rq:job:{job_id}", "status")
            read_result(pipe, job_id)
        replies = pipe.execute()
    now = time.monotonic()
    written = []
    for job_id, status, entries in zip(job_ids, replies[::2], replies[1::2]):
        line, started = in_flight[job_id]
        status = status.decode() if status else "missing"
        if started is None and status == "started":
            in_flight[job_id] = (line, now)
        result = result_from_entries(entries)
        if result is not None and result.get("status") == "finished":
            sink.result(line, output_line(line, result, names), result)
            summary["succeeded"] += 1
            made_before = reused.get(job_id)  # (popped below: a long run keeps no ended job's id)
            summary["reused"] += made_before is not None
            progress.update(result["usage"]["completion_tokens"], made_before=bool(made_before))
        elif status == "missing" and result is None and lines is not None and job_id not in lines.lost:
            lines.lost.add(job_id)
            lines.taken_back.append(line)
            del in_flight[job_id]
            reused.pop(job_id, None)
            continue
        elif status in ("failed", "canceled", "stopped", "missing", "finished"):
            reason = (result or {}).get("error") or _failure_reason(client, job_id, status)
            # The worker found the row at fault: the row's error, as one refused here; a prompt past the context by
            # OpenAI's code for it, so those rows can be found, shortened and run again.
            fault = (result or {}).get("error_type") == "invalid_request"
            code = ((result or {}).get("error_code") or "invalid_request") if fault else "job_" + status
            _fail(sink, line, code, reason, summary, progress)
        elif timeout is not None and started is not None and now - started > timeout:
            if not client.job(job_id).cancel():
                continue  # it ended since its status was read: the next look writes its row
            reason = f"no result within {timeout} s of its start: the job was canceled (a rerun submits it again)"
            _fail(sink, line, "timeout", reason, summary, progress)
        else:
            continue
        del in_flight[job_id]
        reused.pop(job_id, None)
        written.append(job_id)
    sink.flush()
    if sink.keeps_flushed_rows:
        _release(client, written)


RELEASED_TTL_S = STREAM_TTL_AFTER_END_S  # a written row's job and result: kept for a look, not for the client's day


def _release(client: Client, job_ids: list[str]) -> None:
    """The jobs of rows now in the output, their results no longer needed (a rerun skips those rows): expired soon,
    not kept the client's ``result_ttl`` (a day). Each finished row held ~6.5 KB of Redis for that day, so a run of a
    million rows filled a Redis with noeviction and ended the run. Only shortened, never lengthened."""
    keys = [key for job_id in job_ids for key in (f"rq:job:{job_id}", result_key(job_id))]
    if not keys:
        return
    with client.connection.pipeline(transaction=False) as pipe:  # (EXPIRE ... LT is Redis 7's; 6.2 is served)
        for key in keys:
            pipe.ttl(key)
        ttls = pipe.execute()
        for key, ttl in zip(keys, ttls):
            if ttl == -1 or ttl > RELEASED_TTL_S:  # (-2: gone already)
                pipe.expire(key, RELEASED_TTL_S)
        pipe.execute()


def _fail(sink: Sink, line: Line, code: str, reason: str, summary: dict[str, Any], progress: Progress) -> None:
    sink.error(error_line(line.number, line.custom_id, code, reason, line.job_id), line)
    _count_failure(summary, code)
    progress.update(0, failed=True)


class Lines:
    """The input's lines, and those a submit took but could not send (Redis went away): handed out again first."""

    def __init__(self, lines: Iterator[Line]) -> None:
        self.lines, self.taken_back = lines, []
        self.tried: set[str] = set()  # job ids of lines taken back: their submit may have gone in, theirs if so
        self.lost: set[str] = set()  # job ids Redis lost (no hash, no result) once: submitted again, once

    def __iter__(self) -> Lines:
        return self

    def __next__(self) -> Line:
        return self.taken_back.pop() if self.taken_back else next(self.lines)

    def take_back(self, taken: list[Line]) -> None:
        self.taken_back.extend(reversed(taken))
        self.tried.update(line.job_id for line in taken)


class RedisOutage:
    """A run waits out Redis going away (a failover, a restart) for ``REDIS_PATIENCE_S``, saying so once a minute;
    past that it ends as Ctrl-C ends it, resumable (``RedisLost``)."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.since, self.backoff, self.said = progress, None, 0.5, 0.0

    def wait(self, exc: Exception) -> None:
        mono = time.monotonic()
        self.since = self.since or mono
        if mono - self.since > REDIS_PATIENCE_S:
            raise exc
        if mono >= self.said + 60:
            self.progress.note(f"Redis unavailable ({exc}): waiting for it, up to {REDIS_PATIENCE_S:g} s in all")
            self.said = mono
        time.sleep(self.backoff)
        self.backoff = min(self.backoff * 2, 10.0)

    def over(self) -> None:
        if self.since is not None:
            self.progress.note(f"Redis answers again after {time.monotonic() - self.since:.0f} s: the run goes on")
        self.since, self.backoff, self.said = None, 0.5, 0.0


def _submit(
    client: Client,
    lines: Lines,
    in_flight: dict[str, tuple[Line, float | None]],
    limit: int,
    reused: dict[str, bool],
    notify: str | None = None,
) -> bool:
    """Top up to ``limit`` jobs in flight from ``lines``; a line whose job exists from an earlier run is picked
    up, not redone (and its id added to ``reused``). False once ``lines`` is used up."""
    take: list[Line] = []
    more = True
    while len(in_flight) + len(take) < limit:
        line = next(lines, None)
        if line is None:
            more = False
            break
        take.append(line)
    if not take:
        return more
    try:
        _submit_lines(client, take, in_flight, reused, notify, lines.tried)
    except BaseException:  # (Redis went away) handed out again: a job that went in is then picked up, not doubled
        lines.take_back([line for line in take if line.job_id not in in_flight])
        raise
    return more


def _submit_lines(
    client: Client, take: list[Line], in_flight: dict[str, tuple[Line, float | None]], reused: dict[str, bool],
    notify: str | None, tried: set[str],
) -> None:  # fmt: skip
    with client.connection.pipeline(transaction=False) as pipe:
        for line in take:
            pipe.hget(f"rq:job:{line.job_id}", "status")
            pipe.exists(result_key(line.job_id))
        replies = pipe.execute()
    fresh = []
    for line, status, has_result in zip(take, replies[::2], replies[1::2]):
        status = status.decode() if status else None
        if status in _LIVE or (status == "finished" and has_result):
            in_flight[line.job_id] = (line, None)
            if line.job_id not in tried:  # (else this run's own submit went in, its reply lost)
                reused[line.job_id] = status == "finished"
            continue
        # (Failed or canceled last time, or finished with its result expired: submitted again, which clears the old
        # job's stream and result but keeps its hash, whose owner field fences off a run of it still going.)
        fresh.append(line)
    extra = {"notify": notify} if notify else {}  # not part of the payload the job id is derived from
    while fresh:
        try:
            client.submit_many([{**line.payload, **extra, "job_id": line.job_id} for line in fresh])
            break
        except JobIdTaken as exc:  # another run of this input submitted them since the look: followed, as its jobs
            taken = set(exc.job_ids)
            for line in fresh:
                if line.job_id in taken:
                    in_flight[line.job_id] = (line, None)
                    if line.job_id not in tried:
                        reused[line.job_id] = False
            fresh = [line for line in fresh if line.job_id not in taken]
    for line in fresh:
        in_flight[line.job_id] = (line, None)


def _failure_reason(client: Client, job_id: str, status: str) -> str:
    if status == "missing":
        return "the job disappeared from Redis (expired or deleted)"
    if status == "finished":  # RQ writes a result with the status: this one is gone
        return "the job finished, but its result expired"
    from producer.client import JobError

    try:
        client.job(job_id)._raise_ended(status)
    except JobError as exc:
        return exc.reason
    return status
