"""OpenAI's Responses API (``POST /v1/responses``) over the chat completions' job: a request is read into the chat
request it means (``input`` and ``instructions`` as messages, ``text.format`` as ``response_format``, function tools
as tools), so every check and the job itself are the chat's; the answer comes back as a response object, or as its
stream of typed events. Nothing is stored: a conversation goes on by sending it whole (no
``previous_response_id``). No HTTP here."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator

from producer.openai_api import (
    APIError,
    APIShape,
    ChatCompletionRequest,
    ObjectSchema,
    RefusalPart,
    SentBack,
    cached_tokens,
    chat_logprobs,
    parse,
    parse_request,
    samples,
)
from producer.reasoning import ReasoningFormat, ReasoningStream, reasoning_tokens
from producer.schema import call_arguments
from producer.token_names import BY_ID, TokenNames
from producer.tool_calls import CallStream, ToolChoice
from producer.tool_formats import FormatStream

LOGPROBS = "message.output_text.logprobs"  # what include names for the output text's logprobs
# The rest of what OpenAI's include takes: outputs of tools and inputs not here, and an encrypted thought (a client
# that stores nothing asks for it always): nothing to add (vLLM takes them as well).
INCLUDABLE = frozenset((
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
))  # fmt: skip
# The chat request's names of fields, in the Responses API's terms (a message's place in the chat is not an input
# item's: instructions come first, an answer's text and calls share a message).
_RENAMES = [
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmessages(\.\d+)?"), "input"),
    (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
]


class InputText(SentBack):
    type: Literal["input_text", "output_text"]  # (an earlier answer's part, sent back)
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


# What a text model cannot read, and the items that name what is stored (nothing is, here): each a 400 saying so,
# not pydantic's list of every shape the item was not.
NOT_TEXT = ("input_image", "input_file", "input_audio")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _checked_input(value: Any) -> Any:
    """``input``'s items that cannot be taken, each refused by its place and its reason (the chat's messages they
    would become are numbered otherwise)."""
    if not isinstance(value, list):
        return value
    for i, item in enumerate(value):
        if not isinstance(item, dict):  # (pydantic's to say: not an object)
            continue
        kind = item.get("type")
        if kind == "item_reference":
            raise ValueError(f"item {i}: nothing is stored here to refer to: send the item itself")
        if kind is not None and kind not in ITEM_TYPES:
            raise ValueError(f"item {i}: items of type {kind!r} are not taken here, only {', '.join(ITEM_TYPES)}")
        if kind == "function_call" and isinstance(item.get("arguments"), str):
            try:
                call_arguments(item["arguments"])
            except ValueError as exc:
                raise ValueError(f"item {i}: {exc}") from None
        parts = item.get("content") if kind in (None, "message") else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") in NOT_TEXT:
                raise ValueError(f"item {i}, content {j}: {part['type']} is not taken by a text model: send text")
    return value


class InputMessage(SentBack):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | RefusalPart]  # (an earlier answer's refusal: its text, as the chat's)
    id: str | None = None  # (an earlier answer's item, sent back)
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def chat_content(self) -> str | list[dict[str, str]]:
        """Its content as a chat message's: parts stay text parts (a template that loops over them gets the list,
        as the chat's parts)."""
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": p.text} for p in self.content]


class FunctionCallItem(SentBack):
    """A call an earlier answer made, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ReasoningText(SentBack):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(SentBack):
    """An earlier answer's thinking, sent back (its summary is none here; an encrypted one cannot be read)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[Any] | None = None
    encrypted_content: None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


class FunctionCallOutput(SentBack):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionTool(APIShape):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class NamedFunction(APIShape):
    type: Literal["function"]
    name: str


class TextFormat(APIShape):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ReasoningConfig(APIShape):
    """OpenAI's ``reasoning``: its effort goes to the chat template (as a chat's ``reasoning_effort``); a summary is
    taken, and echoed (the reasoning item holds the whole thinking)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (summary's older name)


class TextConfig(APIShape):
    format: TextFormat | None = None
    verbosity: str | None = None  # (a reasoning model's; taken, as nothing here reads it)


class ResponsesStreamOptions(APIShape):
    include_obfuscation: bool | None = None  # OpenAI's padding of events against side channels: none here


class ResponsesRequest(APIShape):
    model: str
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    _input = field_validator("input", mode="before")(_checked_input)
    truncation: Literal["disabled", "auto"] | None = None  # auto: the earliest turns dropped to fit (the job's)
    # Taken and changing nothing (nothing is stored here)
    store: bool | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None  # (of what OpenAI's takes, the output text's logprobs alone are here)
    top_logprobs: int | None = None
    # Asking for what is not here: a 400 (``chat_body``)
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # (of built-in tools, which are none here)
    # vLLM's extras (the openai client sends them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_body(self, reasons: bool = False) -> dict[str, Any]:
        """The chat completions request this one means; ``reasons``: the server tells the model's thinking from its
        answer (a reasoning parser), so ``reasoning`` may be asked for."""
        if self.previous_response_id is not None:
            raise APIError(400, "responses are not stored here: send the conversation as input",
                           param="previous_response_id")  # fmt: skip
        if self.background:
            raise APIError(400, "background responses are not supported: stream, or wait", param="background")
        if self.reasoning and self.reasoning.model_fields_set and not reasons:
            raise APIError(400, "this model does not reason: leave reasoning out", param="reasoning")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        if other := [kind for kind in self.include or () if kind != LOGPROBS and kind not in INCLUDABLE]:
            raise APIError(400, f"include takes {sorted({LOGPROBS, *INCLUDABLE})}, not {other}", param="include")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        fields = ("temperature", "top_p", "parallel_tool_calls", "metadata", "user", "top_k", "min_p",
                  "repetition_penalty", "seed", "priority", "stop", "presence_penalty", "frequency_penalty",
                  "logit_bias", "ignore_eos", "chat_template_kwargs", "truncation")  # fmt: skip
        body.update((k, v) for k in fields if (v := getattr(self, k)) is not None)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.reasoning and self.reasoning.effort is not None:  # (the template's, as the chat's)
            body["reasoning_effort"] = self.reasoning.effort
            if self.reasoning.effort == "none":  # (vLLM's: Qwen3's and GLM's templates read enable_thinking)
                body["chat_template_kwargs"] = {"enable_thinking": False, **(self.chat_template_kwargs or {})}
        if LOGPROBS in (self.include or ()) or self.top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            functions = [t.model_dump(exclude={"type"}, exclude_none=True) for t in self.tools]
            body["tools"] = [{"type": "function", "function": f} for f in functions]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            fmt = self.text.format
            if fmt.type == "json_schema" and fmt.schema_ is None:  # (OpenAI's 400; not JSON of any shape)
                raise APIError(400, "text.format of type json_schema needs its schema", param="text.format.schema")
            if fmt.type == "json_schema":
                schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
            else:
                body["response_format"] = {"type": "json_object"}
        return body

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:  # ("": none, as vLLM's; an empty system message would replace the template's own)
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            last = messages[-1] if messages else None
            thought = last is not None and "reasoning" in last and last["content"] is None and "tool_calls" not in last
            if isinstance(item, ReasoningItem):
                messages.append({"role": "assistant", "content": None, "reasoning": item.text()})
            elif isinstance(item, InputMessage) and item.role == "assistant" and thought:
                last["content"] = item.text()  # type: ignore[index]  # (one answer: its thinking, then its text)
            elif isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.chat_content()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # (one answer: its text, its parallel calls)
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
                messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
        return messages


def parse_responses(
    body: Any, tool_parser: str | None = None, reasoning_parser: str | None = None
) -> tuple[ResponsesRequest, ChatCompletionRequest, dict[str, Any]]:
    """The request, the chat request it means and its job's payload; an ``APIError`` named in the Responses API's
    terms. ``tool_parser``: as ``parse``'s."""
    request: ResponsesRequest = parse_request(ResponsesRequest, body)
    try:
        body = request.chat_body(reasons=reasoning_parser is not None)
        chat, fields = parse(ChatCompletionRequest, body, tool_parser, reasoning_parser)
    except APIError as exc:
        exc.message, exc.param = in_responses_terms(exc.message), in_responses_terms(exc.param)
        raise
    return request, chat, fields


def in_responses_terms(text: str | None) -> str | None:
    """A chat request's field names in ``text`` as the Responses API names them."""
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text) if text is not None else None
    return text


def _usage(values: dict[str, Any], reasoning: int = 0) -> dict[str, Any]:
    prompt, completion = int(values.get("prompt_tokens", 0)), int(values.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached_tokens(values)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, completion)},
        "total_tokens": prompt + completion,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call as the Responses API's output item."""
    fn = call["function"]
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}  # fmt: skip


class ResponseWriter:
    """One response's object, whole or as the stream of its typed events, from its job's text."""

    def __init__(
        self,
        job_id: str,
        model: str,
        request: ResponsesRequest,
        tools: ToolChoice | None,
        top_logprobs: int | None = None,
        names: TokenNames = BY_ID,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        """``top_logprobs``: the alternatives shown per token of a text answer (None: no logprobs asked);
        ``reasoning``: how the model's thinking is told from its answer (a reasoning item before the answer's)."""
        self.request, self.tools, self.reasoning = request, tools, reasoning
        self.thoughts: ReasoningStream | None = None
        self.thought: dict[str, Any] | None = None  # the reasoning item, while its text comes
        self.thinking = ""
        self.top, self.names = top_logprobs, names  # (a text answer's: as a chat's, every token's, calls' too)
        self.logprobs: list[dict[str, Any]] = []  # the text's tokens' so far
        self.unsent: list[dict[str, Any]] = []  # those of tokens whose text has not gone out yet
        self.head = {"id": f"resp_{job_id}", "object": "response", "created_at": int(time.time()), "model": model}
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output items, as they come
        self.text = ""  # the job's text so far
        self.output, self.token_ids = "", []  # all of it, thinking too, and its tokens (the thinking's are counted)
        self.fed = False  # any text or logprobs taken in (a parser may hold it: a job's restart cannot void it)
        self.calls: CallStream | FormatStream | None = None
        self.message: dict[str, Any] | None = None  # the output's message item (a text answer, or "auto")
        self.message_index = 0
        self.shown = ""  # its text so far
        self.call_index = 0  # the named function's call item, in the output
        self.openings: list[dict[str, Any]] = []  # that call, opened once the thinking before it is done

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 reason: str | None = None, reasoning: int = 0) -> dict[str, Any]:  # fmt: skip
        req = self.request
        incomplete = status == "incomplete"
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else None
        text = {"format": fmt or {"type": "text"}}
        if req.text is not None and req.text.verbosity is not None:
            text["verbosity"] = req.text.verbosity
        return {
            **self.head,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": req.reasoning.model_dump(exclude_unset=True) if req.reasoning is not None else None,
            "store": False,  # (nothing is kept: a later previous_response_id could not find it)
            "temperature": req.temperature,
            "text": text,
            "tool_choice": _shown_choice(req.tool_choice),
            "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": _usage(usage, reasoning) if usage is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
            # (echoed as OpenAI's response echoes them: nothing here reads them but top_logprobs)
            "top_logprobs": req.top_logprobs,
            "max_tool_calls": req.max_tool_calls,
            "service_tier": req.service_tier,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
        }

    def whole(self, result: dict[str, Any]) -> dict[str, Any]:
        """The response to a job's result."""
        status = "incomplete" if result.get("finish_reason") == "length" else "completed"
        raw = result.get("text", "")
        thinking, text = self.reasoning.split(raw) if self.reasoning else (None, raw)
        if text is None and thinking is not None and self.reasoning.end in raw:
            text = ""  # (the thinking ended, its answer empty: a named call is made, of no arguments, as streamed)
        content, calls = self.tools.read(text) if self.tools and text is not None else (text, [])
        named = self.tools is not None and self.tools.name is not None  # (its arguments are the text: cut short too)
        output = [_function_call(call, status if named else "completed") for call in calls]
        text_answers = self.tools is None or self.tools.parser is not None  # ("required" and a named call: calls only)
        if content or (not output and not thinking and text_answers):  # (no output at all: an empty message)
            part = _text_part(content or "", self._logprobs(samples(result)[0]))
            message = {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant",
                       "content": [part]}  # fmt: skip
            output.insert(self._calls_before_text(text or "") if content and output else 0, message)
        if thinking:  # (no item for an empty thought, as vLLM, and as streamed)
            output.insert(0, _reasoning_item(thinking, status if text is None else "completed"))
        counted = reasoning_tokens(self.reasoning, raw, samples(result)[0].get("token_ids") or [], self.names.tokenizer)
        return self.response(status, output, result.get("usage") or {}, reasoning=counted)

    def _calls_before_text(self, text: str) -> int:
        """How many calls "auto"'s output makes before its answer's first text: where its message item goes among
        them, as the stream places it (``_feed``)."""
        stream, made = self.tools.stream(), 0
        for ch in text:
            content, deltas = stream.feed(ch)
            if content:
                return made
            made += len(deltas)
        return made

    # ----- streamed --------------------------------------------------------------------------------------------
    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": type_, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        """The events before any text: the response created and in progress; a message's item and part opened (a
        text answer, or "auto", which may answer in text), or a named function's call."""
        started = self.response("in_progress", [])
        events = [self._event("response.created", response=started), self._event("response.in_progress",
                                                                                 response=started)]  # fmt: skip
        if self.reasoning is not None:  # (its items open as their text comes: the thinking's first)
            self.thoughts = self.reasoning.stream()
        elif self.tools is None:  # ("auto"'s opens with its first text: an output of calls alone has none)
            events += self._open_message()
        if self.tools is not None:
            self.calls = self.tools.stream()
            self.openings = self.calls.opening()  # (a named function's: its arguments come as the text)
            if self.reasoning is None:  # (else after the thinking's item, in the whole response's order)
                events += self._open_calls()
        return events

    def _open_calls(self) -> list[dict[str, Any]]:
        events = []
        for call in self.openings:
            events += self._add(_function_call(call, "in_progress"))
            self.call_index = len(self.items) - 1
        self.openings = []
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        events = self._add(item)
        self.message, self.message_index = item, len(self.items) - 1
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.message_index,
                                  content_index=0, part=_text_part("")))  # fmt: skip
        return events

    def _think(self, text: str) -> list[dict[str, Any]]:
        """The events of the next piece of thinking (its item opened with the first)."""
        events = []
        if self.thought is None:
            self.thought = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "status": "in_progress",
                            "content": []}  # fmt: skip
            events += self._add(self.thought)
            events.append(self._event("response.content_part.added", item_id=self.thought["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))  # fmt: skip
        self.thinking += text
        index = self.items.index(self.thought)
        return events + [self._event("response.reasoning_text.delta", item_id=self.thought["id"], output_index=index,
                                     content_index=0, delta=text)]  # fmt: skip

    def _thought_done(self, status: str = "completed") -> list[dict[str, Any]]:
        """The thinking's item done, once the answer begins (or the output ends)."""
        item, self.thoughts = self.thought, None
        if item is None:
            return []
        part, index = {"type": "reasoning_text", "text": self.thinking}, self.items.index(item)
        item.update(status=status, content=[part])
        return [
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=self.thinking),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]  # fmt: skip

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _logprobs(self, tokens: dict[str, Any]) -> list[dict[str, Any]]:
        """OpenAI's logprobs of ``tokens`` (a result's or an event's), where they were asked for."""
        if self.top is None or not tokens.get("logprobs"):
            return []
        return (chat_logprobs(tokens, self.top, self.names) or {}).get("content", [])

    def piece(self, text: str, event: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The events of the job's next text; ``event``: the job's event it came in (its tokens' logprobs)."""
        self.unsent += self._logprobs(event or {})
        if (event or {}).get("reset"):  # (the job's output started over before any text came)
            self.output, self.token_ids = "", []
        self.output += text
        self.token_ids += (event or {}).get("token_ids", ())
        self.fed = self.fed or bool(text) or bool(self.unsent)
        if not text:
            return []
        events = []
        if self.thoughts is not None:
            thinking, text = self.thoughts.feed(text)
            events += self._think(thinking) if thinking else []
            events += self._thought_done() if text else []
        if not text:
            return events
        self.text += text
        return events + self._feed(text)

    def _feed(self, text: str) -> list[dict[str, Any]]:
        """The events of the answer's next text. Until its first text, "auto"'s is read a character at a time: the
        message item goes where that text comes among the calls, whatever the pieces (as in the whole response)."""
        if self.calls is None:
            return self._out(text, [])
        if self.message is not None or not self.tools.auto:
            return self._out(*self.calls.feed(text))
        events = []
        for i, ch in enumerate(text):
            events += self._out(*self.calls.feed(ch))
            if self.message is not None:
                return events + self._out(*self.calls.feed(text[i + 1 :]))
        return events

    def _out(self, content: str, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of text and tool call deltas let out."""
        events = self._open_calls() if deltas else []
        if content and self.message is None:  # (the answer's first text)
            events += self._open_message()
        if content and self.message is not None:
            self.shown += content
            logprobs, self.unsent = self.unsent, []
            self.logprobs += logprobs
            events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                      output_index=self.message_index, content_index=0, delta=content,
                                      logprobs=logprobs))  # fmt: skip
        for delta in deltas:
            if "id" in delta:  # a call whole ("required", "auto"): added (no arguments yet), its arguments, done
                # (added with them, the official client's snapshot, which appends each delta, held them twice)
                events += self._add({**_function_call(delta, "in_progress"), "arguments": ""})
                events += self._arguments(len(self.items) - 1, delta["function"]["arguments"])
            else:  # the named function's arguments, piece by piece
                events += self._arguments(self.call_index, delta["function"]["arguments"], done=False)
        return events

    def _arguments(self, index: int, arguments: str, done: bool = True) -> list[dict[str, Any]]:
        item = self.items[index]
        events = [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=arguments)]  # fmt: skip
        if done:
            events += self._call_done(index, arguments)
        return events

    def _call_done(self, index: int, arguments: str, status: str = "completed") -> list[dict[str, Any]]:
        item = self.items[index]
        item.update(arguments=arguments, status=status)
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=arguments),
            self._event("response.output_item.done", output_index=index, item=dict(item)),
        ]  # fmt: skip

    def closing(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The events after the last text: what the output's end lets out, the items done, then the response
        completed (or incomplete)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        events = []
        if self.thoughts is not None:  # (the output ended thinking, or before it said whether it would)
            thoughts = self.thoughts
            thinking, text = thoughts.finish()
            events += self._think(thinking) if thinking else []
            events += self._thought_done("completed" if thoughts.answering else status)  # (cut short in it: status)
            events += self._open_calls() if thoughts.answering else []  # (a named call of no arguments: the whole's)
            self.text += text  # (as piece's: a named call's arguments are read from it)
            events += self._feed(text) if text else []
        events += self._out(*self.calls.finish()) if self.calls is not None else []
        text_answers = self.tools is None or self.tools.parser is not None  # ("required" and a named call: calls only)
        if self.message is None and self.thought is None and not self.items and text_answers:
            events += self._open_message()  # (an answer of no text and no call at all: an empty message, as whole)
        if self.message is not None:
            item = self.message
            self.logprobs += self.unsent  # (tokens that added no text: the end's)
            part = _text_part(self.shown, self.logprobs)
            item.update(status=status, content=[part])
            index = self.message_index
            events += [
                self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self.shown, logprobs=self.logprobs),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=dict(item)),
            ]  # fmt: skip
        elif isinstance(self.calls, CallStream) and self.calls.name is not None and not self.openings:
            events += self._call_done(self.call_index, self.text, status)  # (ends with the text; cut short: incomplete)
        # (A call never opened: the output ended in the thinking. The whole response has no call either.)
        counted = reasoning_tokens(self.reasoning, self.output, self.token_ids, self.names.tokenizer)
        final = self.response(status, self.items, usage, reasoning=counted)
        return [*events, self._event(f"response.{status}", response=final)]

    def failed(self, err: APIError) -> list[dict[str, Any]]:
        """The events of a stream its job failed: the error, then the response failed (OpenAI's last event, which
        clients wait for), with the output so far."""
        code = err.code or err.type
        final = {**self.response("failed", self.items), "error": {"code": code, "message": err.message}}
        return [self._event("error", code=code, message=err.message, param=err.param),
                self._event("response.failed", response=final)]  # fmt: skip


def _shown_choice(choice: str | NamedFunction | None) -> Any:
    """The response's ``tool_choice``: the request's, or OpenAI's default, "auto" (with no tools as well)."""
    if isinstance(choice, NamedFunction):
        return choice.model_dump()
    return choice or "auto"
