"""OpenAI's request and response shapes, and how they map to a roseinfer job and back. No HTTP here: the server
(``producer/server.py``) reads requests through these models and writes what these functions build."""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    model_validator,
)

from producer.protocol import usage_of
from producer.reasoning import FORMATS as REASONING_FORMATS
from producer.reasoning import ReasoningFormat, ReasoningStream, job_fields_of, plan_for
from producer.schema import JobRequest, ResponseFormat, StructuredOutputs, describe_validation_error, field_path
from producer.token_names import BY_ID, TokenNames
from producer.tool_calls import CallStream, ToolChoice, ToolChoiceError, object_parameters
from producer.tool_formats import FormatStream

# Fields of OpenAI's requests taken and not acted on (they change nothing a job does).
IGNORED = (
    "user", "service_tier", "store", "parallel_tool_calls", "prompt_cache_key", "safety_identifier", "verbosity",
    "prompt_cache_retention", "prompt_cache_options",  # (the prefix cache here keeps what it can, unasked)
    "tools", "tool_choice",  # (a chat's: ``ChatCompletionRequest.job_fields`` takes them)
    "modalities",  # (["text"] alone: what a text model makes)
)  # fmt: skip


class APIError(Exception):
    """An error in OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers: dict[str, str] = {}  # e.g. the job a failed request ran as

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Number fields: strict mode refuses 1 for them, and JSON writers send 1.0 that way.
_FLOATS = frozenset(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"))
# A null that says something: ``max_tokens: null`` is no limit but the context (a completion's default is 16).
_NULL_MEANS_NO_LIMIT = ("max_tokens",)


class APIShape(BaseModel):
    """A part of OpenAI's requests: unknown fields refused, and a null taken for a field not given, as OpenAI and
    vLLM take it (clients send nulls for what they leave unset: ``n=None``, and a response's message dumped back
    into the conversation carries ``refusal``, ``tool_calls`` ... as nulls). Types are strict, as OpenAI's and the
    job's: JSON's ``true`` is no count (``logprobs: false`` on a completion asked for logprobs), ``"5"`` and
    ``5.0`` no integer; an integer is a number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: _as_float(v) if k in _FLOATS and type(v) is int else v
            for k, v in data.items()
            if v is not None or k in _NULL_MEANS_NO_LIMIT
        }


def _as_float(value: int) -> float | int:
    """An integer as the number it means; one past a float's range stays as it is (the field refuses it: a 400)."""
    try:
        return float(value)
    except OverflowError:
        return value


class SentBack(APIShape):
    """A conversation's part: keys the official client adds to a message it built (a streamed call's ``index``,
    ``parse()``'s ``parsed``) or a proxy's (``cache_control``) are dropped, as vLLM drops them."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(SentBack):
    type: Literal["text"]
    text: str


class RefusalPart(SentBack):
    """An assistant's refusal, sent back as a part of its content (OpenAI's): its words are text, as vLLM reads it."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]  # (an image: "does not match")


class FunctionCall(SentBack):
    name: str
    arguments: str


class ToolCall(SentBack):
    """A call an assistant made earlier in the conversation (a response's ``tool_calls``, sent back)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(SentBack):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None  # none: an assistant's message of tool calls alone
    name: str | None = None  # given to the chat template, as vLLM does (SmolLM2's does not use it)
    tool_calls: list[ToolCall] | None = None  # an assistant's: given to the chat template
    tool_call_id: str | None = None  # a tool message's: the call it answers, given to the chat template
    # an assistant's thinking, sent back (vLLM's field, and its older name): given to the chat template
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.thinking is not None)):
            raise ValueError("content is required (only an assistant's message of tool_calls or reasoning may omit it)")
        if (
            self.role != "assistant"
            and isinstance(self.content, list)
            and any(isinstance(p, RefusalPart) for p in self.content)
        ):
            raise ValueError("a refusal part is an assistant's (OpenAI's rule)")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content (its older name) differ: give one")
        return self

    @property
    def thinking(self) -> str | None:
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    def text(self) -> str:
        if self.content is None:
            return ""  # (vLLM's, for a template that reads content as a string)
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)  # (vLLM's)

    def job_form(self) -> dict[str, Any]:
        """The message as a job's payload carries it."""
        content: Any = self.text()
        if isinstance(self.content, list):  # (parts stay parts: the engine gives a template that loops over them the
            content = [{"type": "text", "text": p.text} for p in self.content]  # list, as vLLM; else it joins them)
        out: dict[str, Any] = {"role": self.role, "content": content}
        out.update(self.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True))
        if self.thinking is not None:
            out["reasoning"] = self.thinking
        return out


# A function's parameters: a JSON schema of an object (the arguments of a call are a JSON object's text).
ObjectSchema = Annotated[dict[str, Any], AfterValidator(object_parameters)]


class FunctionDefinition(APIShape):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # (OpenAI's rule)
    description: str | None = None
    parameters: ObjectSchema | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # the arguments always follow the schema here, strict or not


class Tool(APIShape):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(APIShape):
    name: str


class NamedToolChoice(APIShape):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(APIShape):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks against side channels: none here


class _Common(APIShape):
    """What chat and text completions share: OpenAI's sampling fields and vLLM's extras."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extras (the openai client sends them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: int | None = None  # lower runs first; the job goes into its priority's lane
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's form (extra_body)
    user: str | None = None
    metadata: dict[str, str] | None = None  # OpenAI's tags of a request: the job's metadata, echoed in its result
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    logit_bias: dict[str, float] | None = None  # checked as the job's (token ids as keys, values in [-100, 100])
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs and top N, in the response (not streamed)
    # A chat's function calling, by structured output (``producer/tool_calls.py``); a completion takes them empty.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    _tool_parser: str | None = PrivateAttr(None)  # the server's: the model's own tool-call format "auto" reads
    _reasoning_parser: str | None = PrivateAttr(None)  # the server's: how the model's thinking is told from its answer

    def sampling(self) -> dict[str, Any]:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:  # (a job's come in its result, not its events)
            raise APIError(400, "prompt_logprobs are not streamed: ask without stream", param="prompt_logprobs")
        skip = {"model", "stream", "stream_options", "messages", "prompt", *IGNORED}
        skip |= set() if self.logit_bias else {"logit_bias"}  # {}: no bias
        # (excluded from the dump, not dropped after it: a list of 256 prompts was dumped once a prompt, 20 s)
        dumped = self.model_dump(exclude_none=True, by_alias=True, exclude=skip & set(type(self).model_fields))
        fields = {k: v for k, v in dumped.items() if k not in skip}
        if self.continuous_usage:  # the job's events carry the prompt's length, which the chunks' usage needs
            fields["stream_options"] = {"continuous_usage_stats": True}
        return fields

    def tool_plan(self) -> ToolChoice | None:
        """What ``tools`` and ``tool_choice`` ask for: calls made by structured output, calls in the model's own
        format (read by the server's tool-call parser), or none."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        try:
            return ToolChoice.of(tools, choice, self.parallel_tool_calls is not False, self._tool_parser)
        except ToolChoiceError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    def reasoning_plan(self) -> ReasoningFormat | None:
        """How the output's thinking is told from its answer: the server's parser, where the output's constraint
        lets it think (``producer.reasoning.plan_for``); none where the template is told not to think (Qwen3's and
        GLM's ``enable_thinking``, DeepSeek V3.1's ``thinking``: false), which closes the thinking in the prompt."""
        kwargs = getattr(self, "chat_template_kwargs", None) or {}
        if self._reasoning_parser is None or False in (kwargs.get("enable_thinking"), kwargs.get("thinking")):
            return None
        return plan_for(REASONING_FORMATS[self._reasoning_parser], self.constraint())

    def constraint(self) -> str | None:
        """What kind of constraint the output is under (json, json_object, regex, choice, grammar), if any: the
        request's own, or a forced tool call's (JSON)."""
        if self.structured_outputs is not None:
            return next(iter(self.structured_outputs.engine_form()))
        if self.response_format is not None and self.response_format.type != "text":
            return "json"
        plan = self.tool_plan()
        return "json" if plan is not None and not plan.auto else None

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: continuous_usage_stats counts only with include_usage."""
        opts = self.stream_options
        return opts is not None and opts.include_usage and opts.continuous_usage_stats


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's chat template options (extra_body), the job's
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None  # the Responses API's: auto drops the earliest turns to fit
    echo: bool | None = None  # vLLM's: the answer begins with the last message's text where it is the assistant's
    # OpenAI's, for reasoning models: the chat template's reasoning_effort (vLLM's way; a template may not read it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool | None = None  # vLLM's: false leaves the thinking out of the answer (still told apart)
    verbosity: Literal["low", "medium", "high"] | None = None  # (a reasoning model's; taken, as nothing reads it)
    # OpenAI's output kinds: text is all a text model makes (some clients send ["text"] always; it was a 400)
    modalities: list[Literal["text"]] | None = None

    @property
    def echoed(self) -> str:
        """The text the answer begins with (``echo``): the last message's, where it is the assistant's own (and the
        answer is text, not tool calls)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" and self.tool_plan() is None else ""

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives to show per token; None: no logprobs asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def job_fields(self) -> dict[str, Any]:
        fields = self.sampling()
        fields.pop("max_completion_tokens", None)
        fields.pop("echo", None)  # (the response's doing)
        fields.pop("include_reasoning", None)  # (the response's too)
        if (effort := fields.pop("reasoning_effort", None)) is not None:  # (the request's own kwargs say it first)
            fields["chat_template_kwargs"] = {"reasoning_effort": effort, **(self.chat_template_kwargs or {})}
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:  # OpenAI's rule: none would come back
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        fields["messages"] = [m.job_form() for m in self.messages]
        if self.tools:  # shown by the chat template (even with tool_choice "none", as vLLM does)
            fields["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if (plan := self.tool_plan()) is not None and not plan.auto:
            text = self.response_format is None or self.response_format.type == "text"  # (OpenAI's default: no limit)
            if not text or self.structured_outputs is not None:
                given = "response_format" if not text else "structured_outputs"
                raise APIError(400, f"tool_choice constrains the output already: give it or {given}", param=given)
            fields.pop("response_format", None)  # (text: nothing to pass on)
            try:
                fields["structured_outputs"] = {"json": plan.schema()}
            except ToolChoiceError as exc:
                raise APIError(400, str(exc), param=exc.param) from None
        if plan is not None and plan.auto:  # (the model's call markers may be special tokens: vLLM's hermes parser)
            fields.setdefault("skip_special_tokens", False)
        for name, value in job_fields_of(self.reasoning_plan(), self.constraint() is not None).items():
            fields.setdefault(name, value)
        return fields


class CompletionRequest(_Common):
    # OpenAI's forms: text or token ids, one or a list (ids strict: JSON's true is no token 1)
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16  # the legacy API's default (OpenAI's and vLLM's); chat's is the context
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # OpenAI's: samples made to return the n best; only n itself here

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt scored, nothing generated (OpenAI's and vLLM's way to read a
        text's logprobs). Its job generates one token, which the response leaves out, as vLLM's."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """Its prompts: one (text, or token ids), or a list of them."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    def job_fields(self, prompt: str | list[int] | None = None) -> dict[str, Any]:
        """The job of ``prompt``, by default the request's one prompt."""
        fields = self.sampling()
        if prompt is None:
            prompts = self.prompts()
            if len(prompts) != 1:
                raise APIError(400, "give one prompt here (not a list of them)", param="prompt")
            prompt = prompts[0]
        if self.echo and (self.logprobs is not None or isinstance(prompt, list)):
            if self.stream:
                raise APIError(400, "a streamed echo takes a text prompt, without logprobs", param="echo")
            # The prompt's text and its tokens' logprobs come back in the job's result: the response begins with them.
            fields["prompt_logprobs"] = max(self.logprobs or 0, self.prompt_logprobs or 0)
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if fields.pop("best_of", self.n) != self.n:  # (vLLM dropped it; OpenAI's best_of == n asks for nothing more)
            raise APIError(400, f"best_of {self.best_of} is not supported: give n samples (best_of n, or none)",
                           param="best_of")  # fmt: skip
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tools (function calling) are for /v1/chat/completions", param="tools")
        fields.pop("echo", None)
        fields.pop("suffix", None)
        if self.echo_only:
            if fields.get("min_tokens"):  # (said of the job's 1, it named a max_tokens the request never sent)
                raise APIError(400, f"min_tokens ({fields['min_tokens']}) must not exceed max_tokens (0)",
                               param="min_tokens")  # fmt: skip
            fields["max_tokens"] = 1
        fields["prompt_token_ids" if isinstance(prompt, list) else "prompt"] = prompt
        return fields


class TokenizeRequest(APIShape):
    """vLLM's ``/tokenize``: a prompt's token ids by the model's tokenizer, or a chat's (``messages``, with the chat
    template's options) as its job's would be."""

    model: str
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # (vLLM's defaults: true for a prompt, false for a chat)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_chat(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages")
        chat_only = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
        if self.prompt is not None and (given := [k for k in chat_only if getattr(self, k) is not None]):
            raise ValueError(f"{', '.join(given)} go with messages")
        return self

    def chat_job(self) -> JobRequest:
        """The chat's job, checked as a chat request's (an ``APIError`` naming the field at fault)."""
        options = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
        body = {"model": self.model, **{k: v for k in options if (v := getattr(self, k)) is not None}}
        if self.tools:  # shown to the template, and nothing more: no tool choice (an "auto" one needed a parser)
            body["tool_choice"] = "none"
        _, fields = parse(ChatCompletionRequest, body)
        return JobRequest.model_validate(fields)


class DetokenizeRequest(APIShape):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str
    tokens: list[StrictInt]


def parse_request(model: type[APIShape], body: Any) -> Any:
    """The request, or an ``APIError`` naming the parameter at fault."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_path(first.get("loc", ())) or None
        if first.get("type") == "extra_forbidden":
            raise APIError(400, f"unsupported parameter: {param}", param=param) from None
        raise APIError(400, describe_validation_error(exc), param=param) from None


def parse(
    model: type[_Common], body: Any, tool_parser: str | None = None, reasoning_parser: str | None = None
) -> tuple[_Common, dict[str, Any]]:
    """The request and the job's payload fields, or an ``APIError`` naming the parameter at fault. ``tool_parser``:
    the model's own tool-call format, which "auto" reads (``producer/tool_formats.py``); ``reasoning_parser``: how
    its thinking is told from its answer (``producer/reasoning.py``)."""
    request = parse_request(model, body)
    request._tool_parser, request._reasoning_parser = tool_parser, reasoning_parser
    fields = request.job_fields()
    _check_job(request, fields)
    return request, fields


def fit_to_context(fields: dict[str, Any]) -> dict[str, Any]:
    """The server's job: a max_tokens the request sets (or the legacy default's 16) must fit the context beside the
    prompt, or the job fails, answered 400 as OpenAI's and vLLM's servers answer (only the worker counts the
    prompt). A batch run does so for its OpenAI lines that set max_tokens; the others keep the payload's default,
    cut at the context, as vLLM's offline ``LLM`` does."""
    return {**fields, "context_overflow": "error"} if fields.get("max_tokens") is not None else fields


MAX_PROMPTS = 256  # prompts of one /v1/completions request: a job each


def parse_completions(body: Any) -> tuple[CompletionRequest, list[dict[str, Any]]]:
    """A /v1/completions request and the payload of each of its prompts (OpenAI's list forms: a job a prompt)."""
    request: CompletionRequest = parse_request(CompletionRequest, body)
    prompts = request.prompts()
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"give 1 to {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt")
    if any(not p for p in prompts):  # (" " is a prompt: it has a token)
        raise APIError(400, "a prompt must not be empty", param="prompt")
    jobs = [request.job_fields(prompt) for prompt in prompts]
    for fields in jobs:
        _check_job(request, fields)
    return request, jobs


def _check_job(request: _Common, fields: dict[str, Any]) -> None:
    """The job's payload as a worker will read it, or an ``APIError`` naming the parameter at fault."""
    try:
        JobRequest.model_validate(fields)
    except ValidationError as exc:
        names = {"prompt_token_ids": "prompt"}  # the request's own names of the payload's fields
        if getattr(request, "max_completion_tokens", None) is not None:
            names["max_tokens"] = "max_completion_tokens"
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else _named_first(first.get("msg", ""))
        raise APIError(400, describe_validation_error(exc, names), param=names.get(param, param)) from None


def _named_first(message: str) -> str | None:
    """The payload field a check across fields names first (``min_tokens (5) must not exceed max_tokens (2)``):
    the parameter of the error it raised, which had none."""
    return next((w for w in re.findall(r"\w+", message) if w in JobRequest.model_fields), None)


# ----- responses -----------------------------------------------------------------------------------------


def without_output(result: dict[str, Any]) -> dict[str, Any]:
    """A result (or an event) of an ``echo_only`` request's job with the token it generated left out: no text,
    no tokens, no logprobs of its own, its end "length" (the 0 tokens asked for) and its usage of none."""
    empty = {"text": "", "token_ids": []}
    if "logprobs" in result:
        empty["logprobs"] = [] if result["logprobs"] is not None else None
    out = {**result, **empty}
    for end in ("finish_reason", "sample_finish_reason"):  # (an event's: a sample of n that ended before its job)
        if result.get(end) not in (None, "error", "abort"):
            out[end] = "length"
    if "choices" in result:
        out["choices"] = [without_output(choice) for choice in result["choices"]]
    if result.get("usage"):
        prompt = int(result["usage"].get("prompt_tokens", 0))
        out["usage"] = {**result["usage"], **usage_of(prompt, 0)}
    return out


def usage(result: dict[str, Any]) -> dict[str, Any]:
    """A job's usage in OpenAI's shape: its counts, and its prompt's cached tokens (0 where a job did not say)."""
    u = result.get("usage") or {}
    return usage_of(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)), cached_tokens(u))


def cached_tokens(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def total_usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of several jobs (results, or their final events) together."""
    each = [usage(result) for result in results]
    return usage_of(
        sum(u["prompt_tokens"] for u in each),
        sum(u["completion_tokens"] for u in each),
        sum(cached_tokens(u) for u in each),
    )


def chat_logprobs(result: dict[str, Any], top: int, names: TokenNames = BY_ID) -> dict[str, Any] | None:
    steps = result.get("logprobs")
    if steps is None:
        return None
    content = []
    for token_id, pairs in zip(result["token_ids"], steps):
        lps = {int(t): lp for t, lp in pairs}
        content.append(
            {
                "token": names(token_id),
                "logprob": lps.get(token_id, -9999.0),  # (finite, as vLLM's: JSON has no -Infinity)
                "bytes": names.bytes(token_id),
                "top_logprobs": [
                    {"token": names(int(t)), "logprob": lp, "bytes": names.bytes(int(t))} for t, lp in pairs[:top]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    result: dict[str, Any], top: int, names: TokenNames = BY_ID, offset: int = 0
) -> dict[str, Any] | None:
    """``offset``: where the tokens' text begins in the choice's (a stream's text sent before them)."""
    steps = result.get("logprobs")
    if steps is None:
        return None
    return _legacy_logprobs(result["token_ids"], steps, top, names, offset)


def _legacy_logprobs(
    token_ids: list[int], steps: list[list | None], top: int, names: TokenNames = BY_ID, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs of ``token_ids``: a step of None (an echoed prompt's first token) stays None. With
    the tokens' texts, ``text_offset`` too: each token's place in the choice's text, from ``offset`` (vLLM's)."""
    chosen = [
        None if pairs is None else {int(t): lp for t, lp in pairs}.get(tid) for tid, pairs in zip(token_ids, steps)
    ]
    # The top ``logprobs`` and the sampled token among them, as OpenAI's legacy API: up to logprobs + 1 entries.
    top_logprobs = [
        None if pairs is None else {**{names(int(t)): lp for t, lp in pairs[:top]}, names(tid): lp}
        for tid, lp, pairs in zip(token_ids, chosen, steps)
    ]
    tokens = [names(t) for t in token_ids]
    out = {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": top_logprobs}
    if names.tokenizer is not None:  # ("token_id:N" has no place in the text)
        out["text_offset"] = names.offsets(token_ids, offset)
    return out


def _echoed(
    result: dict[str, Any], sample: dict[str, Any], top: int | None, prompt: str | None, names: TokenNames = BY_ID
) -> dict[str, Any]:
    """``sample``'s choice with its prompt before it (``echo``: the request's text, else the result's), the prompt
    tokens' logprobs before its own."""
    logprobs = None
    if top is not None:
        ids = result["prompt_token_ids"] + sample.get("token_ids", [])
        logprobs = _legacy_logprobs(ids, result["prompt_logprobs"] + (sample.get("logprobs") or []), top, names)
    text = prompt if prompt is not None else result.get("prompt") or ""
    return {"text": text + sample.get("text", ""), "logprobs": logprobs}


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason) if reason else None  # type: ignore[arg-type]


def samples(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result's samples (``choices``; a result without them is its one sample)."""
    return result.get("choices") or [{"index": 0, **result}]


def chat_choices(
    result: dict[str, Any],
    request: ChatCompletionRequest | None,
    names: TokenNames = BY_ID,
    tools: ToolChoice | None = None,
    echoed: str | None = None,
    reasoning: ReasoningFormat | None = None,
    shown: bool | None = None,
) -> list[dict[str, Any]]:
    """``tools``: the calls the output holds, read back into ``tool_calls``; ``echoed``: the text each answer
    begins with; ``reasoning``: how its thinking is told from its answer; ``shown``: whether the thinking is in
    the message (vLLM's include_reasoning) (all by default the request's)."""
    top = request.num_logprobs if request is not None else None
    want = top is not None
    tools = tools or (request.tool_plan() if request is not None else None)
    echoed = echoed if echoed is not None else request.echoed if request is not None else ""
    reasoning = reasoning or (request.reasoning_plan() if request is not None else None)
    if shown is None:
        shown = request is None or request.include_reasoning is not False
    choices = []
    for s in samples(result):
        message = _message(s.get("text", ""), tools, reasoning, echoed, shown)
        reason = finish_reason(s.get("finish_reason"))
        choices.append(
            {
                "index": s["index"],
                "message": message,
                "finish_reason": _calls_finish(reason, tools, bool(message.get("tool_calls"))),
                "stop_reason": s.get("stop_reason"),  # (vLLM's: the stop string or token id that ended it)
                "logprobs": chat_logprobs(s, top or 0, names) if want else None,
            }
        )
    return choices


def _message(
    text: str, tools: ToolChoice | None, reasoning: ReasoningFormat | None, echoed: str, shown: bool = True
) -> dict[str, Any]:
    """``shown``: the thinking is in the message (told apart from the answer all the same)."""
    thinking = None
    if reasoning is not None:  # (an output that is thinking alone has no answer: a null content)
        thinking, answer = reasoning.split(text)
        thinking = (thinking or None) if shown else None  # (an empty thought: none, as streamed, and as Responses')
        if answer is None and tools is not None and tools.name is not None and reasoning.end in text:
            answer = ""  # (its thinking ended, its answer empty: the named call is made, of no arguments, as streamed)
        if answer is None and not echoed:
            return {"role": "assistant", "content": None, **_thought(thinking)}
        text = answer or ""
    text = echoed + text
    if tools is None:
        return {"role": "assistant", "content": text, **_thought(thinking)}
    # (no calls where the only one was cut short: the finish reason says "length"; OpenAI's null content)
    content, calls = tools.read(text)
    return {"role": "assistant", "content": content, **_thought(thinking), **({"tool_calls": calls} if calls else {})}


def _thought(thinking: str | None) -> dict[str, str]:
    """A message's or a delta's thinking: vLLM's field, and its older name, which clients still read."""
    return {} if thinking is None else {"reasoning": thinking, "reasoning_content": thinking}


def _calls_finish(reason: str | None, tools: ToolChoice | None, called: bool) -> str | None:
    """Calls of the model's choosing ("auto" or "required"): OpenAI's and vLLM's "tool_calls"; the call of a named
    function ends "stop", as theirs does."""
    return "tool_calls" if reason == "stop" and called and tools is not None and tools.name is None else reason


def completion_choices(
    result: dict[str, Any],
    top: int | None,
    echo: bool = False,
    prompt: str | list[int] | None = None,
    names: TokenNames = BY_ID,
) -> list[dict[str, Any]]:
    """The choices of a completion's job; ``echo``: each begins with ``prompt``, the request's (a text), or the
    result's prompt and its logprobs (a job asked for ``prompt_logprobs``)."""
    text = prompt if isinstance(prompt, str) and top is None else None
    return [
        {
            "index": s["index"],
            "text": s.get("text", ""),
            "finish_reason": finish_reason(s.get("finish_reason")),
            "stop_reason": s.get("stop_reason"),  # (vLLM's: the stop string or token id that ended it)
            "logprobs": completion_logprobs(s, top, names) if top is not None else None,
            **(
                _echoed(result, s, top, text, names)
                if echo and (text is not None or "prompt_logprobs" in result)
                else {}
            ),
        }
        for s in samples(result)
    ]


def prompt_logprobs(result: dict[str, Any], top: int, names: TokenNames = BY_ID) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a job's result: per prompt token (None for the first), its logprob and the top
    ``top`` alternatives, each ``{"logprob", "rank", "decoded_token"}`` by token id. A token outside the top has no
    rank here (the engine ranks only the top)."""
    out: list[dict[str, Any] | None] = []
    for token_id, pairs in zip(result["prompt_token_ids"], result["prompt_logprobs"]):
        if pairs is None:
            out.append(None)
            continue
        entry = {
            str(int(t)): {"logprob": lp, "rank": rank, "decoded_token": names(int(t))}
            for rank, (t, lp) in enumerate(pairs[:top], 1)
        }
        if str(token_id) not in entry:
            lp = next(lp for t, lp in pairs if int(t) == token_id)
            entry[str(token_id)] = {"logprob": lp, "rank": None, "decoded_token": names(token_id)}
        out.append(entry)
    return out


def chat_response(
    job_id: str,
    model: str,
    request: ChatCompletionRequest,
    result: dict[str, Any],
    names: TokenNames = BY_ID,
    created: int | None = None,
) -> dict[str, Any]:
    """``created``: when the request came (OpenAI's, and a streamed answer's); now where not given."""
    body = {
        "id": f"chatcmpl-{job_id}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "system_fingerprint": result.get("system_fingerprint"),
        "choices": chat_choices(result, request, names),
        "usage": usage(result),
    }
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(result, request.prompt_logprobs, names)
    return body


def completion_response(
    job_id: str,
    model: str,
    request: CompletionRequest,
    results: list[dict[str, Any]],
    names: TokenNames = BY_ID,
    created: int | None = None,
) -> dict[str, Any]:
    """The response to the jobs of a request's prompts, in order: prompt i's samples are choices i * n to
    i * n + n - 1, as OpenAI numbers them, and the usage is theirs together. ``created``: as ``chat_response``'s."""
    prompts = request.prompts()
    if request.echo_only:
        results = [without_output(result) for result in results]
    choices = [
        {**choice, "index": i * request.n + choice["index"]}
        for i, result in enumerate(results)
        for choice in completion_choices(result, request.logprobs, request.echo, prompts[i], names)
    ]
    if request.prompt_logprobs is not None:  # (vLLM's place for them: each choice of the prompt's)
        for choice in choices:
            result = results[choice["index"] // request.n]
            choice["prompt_logprobs"] = prompt_logprobs(result, request.prompt_logprobs, names)
    return {
        "id": f"cmpl-{job_id}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "system_fingerprint": results[0].get("system_fingerprint"),
        "choices": choices,
        "usage": total_usage(results),
    }


class ChunkWriter:
    """The chunks of one streamed response, in OpenAI's shape (chat or text). ``logprobs``: the alternatives to show
    per token, from the events' logprobs (None: the request asked for none)."""

    def __init__(
        self,
        job_id: str,
        model: str,
        chat: bool,
        n: int = 1,
        logprobs: int | None = None,
        echo: list[str] | None = None,
        include_usage: bool = False,
        continuous_usage: bool = False,
        names: TokenNames = BY_ID,
        tools: ToolChoice | None = None,
        reasoning: ReasoningFormat | None = None,
        include_reasoning: bool = True,
        echo_only: bool = False,
    ) -> None:
        self.names = names
        self.include_reasoning = include_reasoning  # false: the thinking is told apart, and left out
        self.tools = tools  # a chat's tool calls, made by structured output: its text goes out as their deltas
        self.calls: dict[int, CallStream | FormatStream] = {}  # choice -> its tool calls read so far
        self.openings: dict[int, list[dict[str, Any]]] = {}  # choice -> its named call, held until its answer begins
        self.reasoning = reasoning  # how a chat's thinking is told from its answer
        self.thoughts: dict[int, ReasoningStream] = {}  # choice -> its thinking and answer read so far
        self.sent: dict[int, int] = {}  # choice -> the length of its text sent (a completion's text_offset)
        self.chat, self.n, self.logprobs = chat, n, logprobs
        self.include_usage = include_usage  # OpenAI's: a last chunk with the usage, every other one with a null
        self.echo = echo  # a streamed completion's ``echo``: each job's prompt, its choices' first text
        self.echo_only = echo_only  # ``echo`` with max_tokens 0: the echo alone, the token each job made left out
        # continuous_usage_stats: job -> its prompt's tokens (from its events' usage), choice -> its tokens so far
        self.prompt_tokens: dict[int, int] | None = {} if continuous_usage else None
        self.made: dict[int, int] = {}
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def piece(
        self,
        text: str,
        reason: str | None = None,
        first: bool = False,
        index: int = 0,
        event: dict | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any] | None:
        """A chunk of ``text``; with ``event``, the logprobs of its tokens too (where the request asked for them),
        and with ``reason`` its stop_reason; ``stop_reason``: that of a sample ended apart from its event.
        None: nothing to send (text that completes no tool call yet)."""
        shown = event if self.logprobs is not None and event and event.get("logprobs") else None
        if self.chat:
            thinking, text = self._split(text, first, index, ended=reason is not None)
            if self.tools is not None:
                delta = self._calls_delta(text, first, index, ended=reason is not None)
                reason = _calls_finish(reason, self.tools, bool(self.calls[index].made))
            else:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                if (reason is not None or self.reasoning is not None) and not text and not first:
                    delta = {}
            delta.update(_thought(thinking or None) if self.include_reasoning else {})
            if not delta and reason is None and shown is None and not first:
                return None  # (text held: a piece of a marker, or what reads no call yet)
            logprobs = chat_logprobs(shown, self.logprobs or 0, self.names) if shown else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        else:
            offset = self.sent.get(index, 0)
            logprobs = completion_logprobs(shown, self.logprobs or 0, self.names, offset) if shown else None
            self.sent[index] = offset + len(text)
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        if reason is not None:  # (vLLM's, on the choice's last chunk: the stop string or token id that ended it)
            choice["stop_reason"] = stop_reason if stop_reason is not None else (event or {}).get("stop_reason")
        chunk = {**self.head, "choices": [choice]}
        if self.prompt_tokens is not None and (prompt := self.prompt_tokens.get(index // self.n)) is not None:
            chunk["usage"] = usage_of(prompt, self.made.get(index, 0))
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def _split(self, text: str, first: bool, index: int, ended: bool) -> tuple[str, str]:
        """The thinking and the answer of a piece of a choice's text (the first piece, an echo, is answer)."""
        if self.reasoning is None:
            return "", text
        if first:
            self.thoughts[index] = self.reasoning.stream()
            return "", text
        stream = self.thoughts[index]
        thinking, answer = stream.feed(text)
        if ended:
            more_thinking, more_answer = stream.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        return thinking, answer

    def _calls_delta(self, text: str, first: bool, index: int, ended: bool) -> dict[str, Any]:
        assert self.tools is not None
        if first:
            self.calls[index] = stream = self.tools.stream()
            opening = stream.opening()
            content = "" if self.tools.auto else None  # ("auto" may answer in text)
            if self.reasoning is not None and opening:
                # A named function's call opens with the answer, after the thinking (the whole message has no call
                # where no answer came: thinking alone, cut short)
                self.openings[index], opening = opening, []
            return {"role": "assistant", "content": content, **({"tool_calls": opening} if opening else {})}
        stream = self.calls[index]
        content, deltas = stream.feed(text)
        if ended:
            rest, last = stream.finish()
            content, deltas = content + rest, deltas + last
        answered = ended and self.thoughts[index].answering if index in self.openings else False
        if index in self.openings and (deltas or answered):  # the answer's first piece: the call, its arguments so
            # far with it (none, where the answer ended empty: the whole message has the call too)
            [opening] = self.openings.pop(index)
            arguments = "".join(d["function"].get("arguments", "") for d in deltas)  # (its opening's own: none)
            deltas = [{**opening, "function": {**opening["function"], "arguments": arguments}}]
        return {**({"content": content} if content else {}), **({"tool_calls": deltas} if deltas else {})}

    def note_prompt(self, job: int, event: dict[str, Any]) -> None:
        """Job ``job``'s prompt length, from an event that carries the usage (continuous_usage_stats)."""
        if self.prompt_tokens is not None and "prompt_tokens" in (event.get("usage") or {}):
            self.prompt_tokens[job] = event["usage"]["prompt_tokens"]

    def count(self, job: int, event: dict[str, Any]) -> None:
        """An event of job ``job`` read: the tokens of its choice (all of them start over at a reset)."""
        if self.prompt_tokens is None:
            return
        self.note_prompt(job, event)
        base = job * self.n
        if event.get("reset"):
            for index in range(base, base + self.n):
                self.made.pop(index, None)
        index = base + event.get("index", 0)
        self.made[index] = self.made.get(index, 0) + len(event["token_ids"])

    def usage(self, values: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage({"usage": values})}
