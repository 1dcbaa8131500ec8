"""A batch's lines: an input row (an OpenAI batch line, a plain payload line, or a data row read by its columns)
into the job it means, with the job id a rerun finds it by; a finished job's result into its OpenAI batch output
line, and a failure into its errors-file line."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producer.batch_io import (
    DEFAULT_FIELDS,
    RowOptions,
    Undecodable,
)
from producer.client import validate
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
)
from producer.reasoning import FORMATS as REASONING_FORMATS
from producer.reasoning import ReasoningFormat, job_fields_of, plan_for
from producer.responses_api import ResponsesRequest, ResponseWriter, parse_responses
from producer.schema import JobRequest, joined_text, lone_surrogate
from producer.token_names import BY_ID, TokenNames
from producer.tool_calls import ToolChoice

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


ID_FIELD = "custom_id"


# A plain row is named row-N unless --id-column names its id: a custom_id of its own was dropped without a word
# (and in a Parquet output its values would overwrite the ids the resume reads).
UNREAD_ID = (
    "{what} 'custom_id', and plain rows are named row-N unless --id-column says otherwise: pass --id-column "
    "custom_id to name the rows by it, or rename it"
)


class BadLine(ValueError):
    """A line refused before any job is submitted; ``custom_id`` is the line's when it had a usable one, ``param``
    the request's field at fault where the server's reading of it names one."""

    def __init__(
        self, reason: str, custom_id: str | None = None, row: dict[str, Any] | None = None, param: str | None = None
    ) -> None:
        super().__init__(reason)
        self.custom_id, self.row = custom_id, row  # (a plain row's columns: a Parquet output keeps its failed rows)
        self.param = param


class RefusedRequest(ValueError):
    """An OpenAI line's body the server would refuse (its 400), with the field it names."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


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


def job_id_for(payload: dict[str, Any], run_id: str | None = None, queue: str = DEFAULT_QUEUE) -> str:
    """The same line and settings give the same job id; a run id gives new ones, and so does another queue (its
    workers may serve another model: a run on it must not take the jobs of a run on this one for its results).

    ``--fresh`` takes new ids rather than deleting the earlier jobs: the worker derives an unseeded sampled job's
    seed from its id, so the same id would replay the same samples, and another run may still follow those jobs.
    """
    # Not the priority: it orders the jobs and changes no output, so a rerun at another one resumes the same rows.
    # (Taken as the default every earlier run wrote: their ids stay as they were.)
    same_output = {**payload, "priority": BULK_PRIORITY, **_on_queue(queue)}
    if isinstance(payload.get("messages"), list):  # (text parts hashed as the joined text earlier runs carried)
        same_output["messages"] = [_joined_parts(m) for m in payload["messages"]]
    digest = hashlib.sha256(json.dumps(same_output, sort_keys=True).encode()).hexdigest()[:24]
    return f"batch-{digest}" if run_id is None else f"batch-{run_id}-{digest}"


def _joined_parts(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        return message
    return {**message, "content": joined_text(content)}


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
            raise BadLine(UNREAD_ID.format(what="this row has a field"), numbered)
        # (an id column stored as binary, as Spark writes text, is read as its text, as the prompt column is)
        given = _text_cells(obj.get(key)) if key is not None else f"row-{number}"
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
        if url == "/v1/responses" and options.defaults.get("n", 1) > 1:  # (its output holds one sample alone)
            raise ValueError("/v1/responses makes one sample a request: run its lines without --n")
        _apply_defaults(payload, options.defaults)
        payload.update((k, v) for k, v in api_defaults.items() if k not in payload)  # (the run's came first)
        payload["custom_id"] = custom_id
        payload.setdefault("priority", priority)
        job = validate(payload)  # InvalidRequest is a ValueError
        reasoning = _row_reasoning(payload, job, options) if options.plain and job.messages else None
    except ValueError as exc:
        raise BadLine(str(exc), custom_id, obj if options.plain else None, getattr(exc, "param", None)) from None
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
        messages = _column_text(row, options.messages_column)
        if not isinstance(messages, list):
            raise ValueError(f"the messages column {options.messages_column!r} must hold a list of messages")
        return "/v1/chat/completions", {"messages": messages}
    prompt = _column_text(row, options.prompt_column)  # type: ignore[arg-type]
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt column {options.prompt_column!r} must hold text, got {type(prompt).__name__}")
    if options.chat:  # an instruct model's chat template around it (a raw prompt only continues the text)
        system = [{"role": "system", "content": options.system}] if options.system else []
        return "/v1/chat/completions", {"messages": [*system, {"role": "user", "content": prompt}]}
    return "/v1/completions", {"prompt": prompt}


def _column_text(row: dict[str, Any], column: str) -> Any:
    """A row's cell, binary text as str; a cell that is not UTF-8 is refused naming its column (as a string one)."""
    try:
        return _text_cells(row.get(column))
    except BadLine as exc:
        raise BadLine(f"column {column!r} is {exc}") from None


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
        raise RefusedRequest(exc.message, exc.param) from None
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
    named = (
        top is not None
        or line.prompt_logprobs is not None
        or (line.responses is not None and line.reasoning is not None)
    )
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
    number: int, custom_id: str | None, code: str, message: str, job_id: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's per-line object of a batch's error file (plus the input ``line``): ``id`` names the job that failed,
    as the output names the one that finished; null for a row refused before it became a job. A request refused
    (400) or failed on the worker's side (500) has OpenAI's ``response`` of that status, its body the error the
    server answers, beside ``error`` (vLLM's); an end that is no request's answer (canceled, stopped, timed out
    here, a row changed since the output was made) has none, as OpenAI's expired or canceled requests."""
    status = _status_of(code)
    response = None
    if status is not None:
        kind = "server_error" if status == 500 else "invalid_request_error"
        error = {"message": message, "type": kind, "param": param, "code": code}
        response = {"status_code": status, "request_id": job_id, "body": {"error": error}}
    return {
        "id": f"batch_req_{job_id}" if job_id else None,
        "custom_id": custom_id,
        "line": number,
        "response": response,
        "error": {"code": code, "message": message},
    }


def _status_of(code: str) -> int | None:
    """The HTTP status the server answers a request with for an error line's ``code``; None for an end no request's
    answer gives (a job canceled or stopped, one timed out here, a row changed since the output was made)."""
    if code == "job_failed":
        return 500
    if code.startswith("job_") or code in ("timeout", "changed_request"):
        return None
    return 400  # (the request refused: a bad line, a duplicate custom_id, a prompt past the context)
