"""The job payload, shared by producers and the worker (pydantic only: no torch, no transformers)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

# Bounds of the sampling fields, the same as the engine's SamplingParams (tests/test_options.py checks them).
MAX_LOGPROBS = 20
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_N = 64
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # a stop string's
MAX_STOP_TOKEN_IDS = 1024
MAX_CONSTRAINT_CHARS = 32 * 1024  # a grammar's, a regex's, a choice's in all
MAX_TOOLS = 128  # OpenAI's
# The chat template call's own arguments: chat_template_kwargs may not set them (a "chat_template" there would run a
# template of the job's choosing; the engine checks against the call's signature too).
TEMPLATE_ARGUMENTS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
))  # fmt: skip
# Levels of objects and lists in a JSON value of the payload (a schema, metadata). Python's own recursion limit
# is near 1,000 levels in pickle, json and copies: a job nested deeper crashed a worker that sends it to its engine
# process, and every worker its retries reached. Real schemas stay far below.
MAX_JSON_DEPTH = 100
NonNegInt = Annotated[int, Field(ge=0)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def json_depth(value: Any) -> int:
    """Levels of dicts and lists in ``value`` (0 for a scalar), counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:  # (no need to go further)
            return deepest
        todo.extend((child, depth + 1) for child in children)
    return deepest


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str = Field(description="the call's arguments: a JSON object's text (empty: none)")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        return call_arguments(value)


def call_arguments(value: str) -> str:
    """A tool call's arguments, checked: a JSON object's text (empty: none), else a ValueError."""
    parsed = _json_or_none(value) if value.strip() else {}
    if not isinstance(parsed, dict):
        raise ValueError("a tool call's arguments are a JSON object's text")
    if json_depth(parsed) > MAX_JSON_DEPTH:  # (the template's reading recursed through them: a server error)
        raise ValueError(f"a tool call's arguments nest deeper than {MAX_JSON_DEPTH} levels")
    return value


class ToolCall(BaseModel):
    """A call an assistant message made (OpenAI's ``tool_calls``), given to the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_form(self) -> dict[str, Any]:
        """As chat templates read it (and vLLM gives it them): the arguments as an object, not its text."""
        arguments = _json_or_none(self.function.arguments) if self.function.arguments.strip() else {}
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


def joined_text(parts: list[dict[str, Any]]) -> str:
    """Text parts (``{"type": "text", "text"}``, a payload's) as one text, joined by newlines as vLLM joins them."""
    return "\n".join(part["text"] for part in parts)


class TextPart(BaseModel):
    """A part of a message's content in OpenAI's list form: text only (joined by newlines, as vLLM joins them)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # OpenAI's forms too: a list of text parts, or null for an assistant's message of tool calls (or reasoning)
    # alone; read as the text, so that the rest of the worker sees a string (a client replaying a conversation, or
    # a writer in another language, was refused them: "Input should be a valid string").
    content: str | list[TextPart] | None = Field(
        None,
        description="the text; or a list of text parts (given as such to a chat template that loops over them, "
        "else joined by newlines, as vLLM gives them); null only for an assistant's message of tool_calls or "
        "reasoning alone",
    )
    name: str | None = Field(None, description="the speaker's name, given to the chat template (which may not use it)")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls of tools, for the chat template")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")
    reasoning: str | None = Field(
        None,
        description="an assistant's thinking before its answer, for templates that show it (as reasoning_content, "
        "its older name, too)",
    )

    @model_validator(mode="after")
    def _calls_of_an_assistant(self) -> ChatMessage:
        for name in ("tool_calls", "reasoning"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"only an assistant message carries {name}")
        if self.content is None:
            if not (self.role == "assistant" and (self.tool_calls or self.reasoning is not None)):
                raise ValueError("content is missing: only an assistant's message of tool_calls or reasoning has none")
            self.content = ""
        return self

    @property
    def text(self) -> str:
        """Its content as text (a list of parts joined by newlines, as vLLM joins them for most templates; the
        engine gives a template that loops over them the list)."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content or ())

    def strings(self) -> list[Any]:
        """What of it the chat template reads as text."""
        calls = [call.model_dump() for call in self.tool_calls] if self.tool_calls else []
        return [self.text, self.name, self.tool_call_id, self.reasoning, *calls]

    def template_form(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True, exclude={"tool_calls"})
        if self.tool_calls is not None:
            out["tool_calls"] = [call.template_form() for call in self.tool_calls]
        if self.reasoning is not None:  # (Qwen3's and DeepSeek's templates read reasoning_content; vLLM gives both)
            out["reasoning_content"] = self.reasoning
        return out


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="its arguments' JSON schema (none: it takes none)")
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A tool the model may be told of (OpenAI's ``tools``): given to the chat template, which may show it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"] = "function"
    function: FunctionSpec


def lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in ``value``'s strings (keys too), or None: such text has no UTF-8 form, so no
    tokenizer, job or output line could hold it."""
    todo = [value]
    while todo:  # (without recursion: a value may nest deeply)
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return exc.object[exc.start]
        elif isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            todo += item
    return None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (nested past the parser's depth: no arguments a template could take)
        return None


class StructuredOutputs(BaseModel):
    """Constrain the output, as vLLM's ``structured_outputs``: exactly one of a JSON schema, any JSON object, a
    regex, a choice of strings or a Lark grammar. The worker compiles it (llguidance); one it rejects fails the job
    with the library's reason."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (an object or its text)")
    json_object: bool | None = Field(None, description="true: any JSON object")
    regex: str | None = Field(
        None, min_length=1, max_length=MAX_CONSTRAINT_CHARS, description="a regular expression the whole output matches"
    )
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description=f"one of these (at most {MAX_CONSTRAINT_CHARS} characters in all)"
    )
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_CONSTRAINT_CHARS, description="a Lark (or GBNF) grammar"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None and sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"choice has more than {MAX_CONSTRAINT_CHARS} characters in all")
        return self

    def engine_form(self) -> dict[str, Any]:
        """The keyword arguments of ``roseinfer.StructuredOutputsParams``."""
        if self.json_ is not None:
            return {"json": self.json_}
        if self.json_object:
            return {"json_object": True}
        return {k: v for k in ("regex", "choice", "grammar") if (v := getattr(self, k)) is not None}


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object (optional in OpenAI's API)
    description: str | None = None
    strict: bool | None = None  # the schema is enforced here, strict or not (llguidance's limits: README)


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs its json_schema: {'name': ..., 'schema': {...}}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema goes with type 'json_schema', not {self.type!r}")
        return self

    def engine_form(self) -> dict[str, Any] | None:
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_
            return {"json": schema} if schema is not None else {"json_object": True}
        return {"json_object": True} if self.type == "json_object" else None


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options`` for a job's events (the last one always carries the usage)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="usage on the last event: always there; taken for OpenAI's shape")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: every event carries the usage so far (prompt tokens, tokens generated until then)"
    )


def _integral(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


# The fields a model's generation config may recommend (roseinfer.model_loader): the worker takes its
# recommendation for those a payload leaves out, so a producer keeps every one it was given, default values too.
MODEL_RECOMMENDED = frozenset(("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"))


class JobRequest(BaseModel):
    """One generation job. Field names follow the OpenAI API; unknown fields are refused.

    ``max_tokens=None`` generates until EOS, a stop string or the model's context length.
    ``logprobs`` takes the Completions form (an int, top-N per token) or the Chat form (``true`` with
    ``top_logprobs``).
    """

    # The JSON schema says what the checks below say where it can: exactly one of the three inputs, none empty.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": [name], "properties": {name: {"type": kind}}}
                for name, kind in (("prompt", "string"), ("messages", "array"), ("prompt_token_ids", "array"))
            ]
        },
    )

    prompt: str | None = Field(
        None, description="a plain prompt (no chat template)", json_schema_extra={"minLength": 1}
    )
    prompt_token_ids: list[TokenId] | None = Field(
        None,
        description="the prompt as token ids of the worker's model (no chat template)",
        json_schema_extra={"minItems": 1},
    )
    messages: list[ChatMessage] | None = Field(
        None, description="chat messages (the model's chat template applied)", json_schema_extra={"minItems": 1}
    )
    tools: list[ToolSpec] | None = Field(
        None, max_length=MAX_TOOLS, description="tools for the chat template to show the model (with messages)"
    )
    add_generation_prompt: bool = Field(
        True, description="with messages: open the assistant's turn after them (default: unless continuing the last)"
    )
    continue_final_message: bool = Field(
        False, description="with messages: leave the last message open and continue its text (vLLM's)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="with messages: the chat template's own options (e.g. enable_thinking), as vLLM takes them"
    )
    truncation: Literal["disabled", "auto"] = Field(
        "disabled",
        description="with messages: auto drops the earliest turns (leading system messages kept) until the prompt "
        "leaves the output its room (max_tokens with context_overflow error, else a token), as OpenAI's Responses "
        "API; disabled fails a prompt too long",
    )
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate; default: until EOS or the context")
    context_overflow: Literal["cut", "error"] = Field(
        "cut",
        description="a max_tokens past what the context leaves after the prompt: cut generates up to the context "
        "(finish_reason length); error fails the job (what the OpenAI server asks, answered 400 as OpenAI and vLLM do)",
    )
    min_tokens: NonNegInt = Field(0, description="tokens before EOS, a stop token or a stop string may end the output")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of this mass")
    top_k: int = Field(0, ge=-1, le=MAX_TOKEN_ID, description="sample among the k likeliest tokens; 0 or -1: all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below this share of the likeliest one")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="penalise tokens already in the output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="penalise tokens by their count in the output")
    repetition_penalty: float = Field(
        1.0, gt=0.0, allow_inf_nan=False, description="divide logits of tokens seen in prompt or output"
    )
    stop: str | list[str] | None = Field(
        None,
        description=f"strings that end the output (cut from it); at most {MAX_STOP_STRINGS}, of {MAX_STOP_CHARS} "
        "characters each at most",
        json_schema_extra={
            "minLength": 1,
            "maxLength": MAX_STOP_CHARS,
            "items": {"minLength": 1, "maxLength": MAX_STOP_CHARS},
            "maxItems": MAX_STOP_STRINGS,
        },
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="token ids that end the output"
    )
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED, description="sampling seed (sampled jobs get one per job)")
    logprobs: bool | int | None = Field(
        None,
        description="log probabilities of the top N tokens per step",
        json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS},  # (a number's bounds: true and false are none)
    )
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="N, with logprobs=true (chat form)")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="each prompt token's logprob and the top N alternatives (vLLM's)"
    )
    ignore_eos: bool = Field(False, description="keep generating past EOS")
    include_stop_str_in_output: bool = Field(False, description="keep the stop string that ended the output")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(
        True, description="a slow tokenizer's spaces between special tokens (a fast one puts none)"
    )
    priority: int = Field(
        0, ge=-100, le=100, description="lower runs first (as in vLLM); the job waits in its priority's lane"
    )
    notify: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="when the job ends, its id is pushed onto the list roseinfer:done:<notify> (waiters block on it)",
    )  # fmt: skip
    n: int = Field(1, ge=1, le=MAX_N, description="samples of the prompt (computed once), each in the result's choices")
    logit_bias: dict[str, float] | None = Field(
        None,
        description="token id (a decimal string) -> a number in [-100, 100] added to its logit before sampling "
        f"(OpenAI's); at most {MAX_LOGIT_BIAS_TOKENS} tokens",
        json_schema_extra={
            "maxProperties": MAX_LOGIT_BIAS_TOKENS,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        },
    )
    structured_outputs: StructuredOutputs | None = Field(None, description="constrain the output (vLLM's form)")
    response_format: ResponseFormat | None = Field(None, description="constrain the output (OpenAI's form)")
    thinking: Literal["first", "optional"] | None = Field(
        None,
        description="a reasoning model thinks before the constrained output: first (up to </think>, as DeepSeek-R1) "
        "or optional (in a <think> block it may begin with, as Qwen3); for a schema, any object or a choice",
    )
    stream_options: StreamOptions | None = Field(None, description="what the job's events carry (OpenAI's)")
    custom_id: str | None = Field(None, max_length=512, description="your id for the job, echoed in the result")
    metadata: dict[str, Any] | None = Field(None, description="any JSON object, echoed in the result")

    @field_validator(
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", mode="before"
    )
    @classmethod
    def _int_is_a_float(cls, value: Any) -> Any:
        # strict mode refuses 1 for a float field; JSON writers often send it that way.
        if not isinstance(value, int) or isinstance(value, bool):
            return value
        try:
            return float(value)
        except OverflowError:  # (an integer of 400 digits: it raised past pydantic, naming no field)
            return math.inf if value > 0 else -math.inf  # refused by the field's own bounds, in its words

    @field_validator("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "top_logprobs", "prompt_logprobs",
                     "priority", "n", mode="before")  # fmt: skip
    @classmethod
    def _whole_float_is_an_int(cls, value: Any) -> Any:
        # 4.0 is JSON's 4 (the schema's "integer" takes it): writers whose numbers are doubles send it so.
        return _integral(value)

    @field_validator("prompt_token_ids", "stop_token_ids", mode="before")
    @classmethod
    def _whole_floats_are_ints(cls, value: Any) -> Any:
        return [_integral(v) for v in value] if isinstance(value, list) else value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_ids_as_keys(cls, value: Any) -> Any:
        # JSON's keys are strings; a Python caller's are the token ids themselves.
        if isinstance(value, dict):
            keyed = {str(k) if type(k) is int else k: v for k, v in value.items()}
            if len(keyed) < len(value):  # {5: 1, "5": 2}: one would have been dropped without a word
                raise ValueError("logit_bias names a token twice, as an integer and as a string")
            return keyed
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias names {len(value)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are taken")
        seen: dict[int, str] = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys are token ids (0 to {MAX_TOKEN_ID}), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values are numbers in [-100, 100], got {bias!r} for token {key}")
            if (other := seen.setdefault(int(key), key)) != key:  # "5" and "05": which bias was meant?
                raise ValueError(f"logit_bias keys {other!r} and {key!r} name the same token, {int(key)}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(strings)} strings; at most {MAX_STOP_STRINGS} are taken")
        if (longest := max(map(len, strings), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are taken")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value: bool | int | None) -> bool | int | None:
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be true/false or an integer in [0, {MAX_LOGPROBS}]")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'prompt_token_ids'")
        if self.prompt is not None and not self.prompt:  # (" " is a prompt: it has a token, as OpenAI takes it)
            raise ValueError("the prompt is empty")
        # Every string the tokenizer or the chat template reads: one it cannot encode failed the whole tokenize batch
        # (bytes that were not UTF-8, read with surrogateescape, or a \u escape of half a UTF-16 pair).
        read = (("text", self.prompt), ("messages", [m.strings() for m in self.messages or ()]),
                ("tools", self.tools and self.tool_specs()),
                ("chat_template_kwargs", self.chat_template_kwargs))  # fmt: skip
        for where, value in read:
            if value and (surrogate := lone_surrogate(value)) is not None:
                raise ValueError(
                    f"the prompt is not valid Unicode: a lone surrogate {surrogate!r} in its {where} (text that was "
                    "not UTF-8?)"
                )
        # And what the result echoes: written as a \u escape of half a pair, which strict JSON readers refuse.
        for name in ("stop", "metadata"):  # (custom_id: a string pydantic checks itself)
            if (value := getattr(self, name)) and (surrogate := lone_surrogate(value)) is not None:
                raise ValueError(f"{name} is not valid Unicode: a lone surrogate {surrogate!r} (not UTF-8?)")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.messages is None:
            chat_only = (
                "add_generation_prompt",
                "chat_template_kwargs",
                "continue_final_message",
                "tools",
                "truncation",
            )
            # (its default, null or empty asks for nothing: a writer that sends every field sends them so)
            unset = {name: (type(self).model_fields[name].default, [], {}) for name in chat_only}
            if given := [f for f in chat_only if f in self.model_fields_set and getattr(self, f) not in unset[f]]:
                raise ValueError(f"{', '.join(given)}: for the chat template, so with messages (not a plain prompt)")
        both = self.continue_final_message and self.add_generation_prompt
        if both and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message goes on with the last message, add_generation_prompt opens a new "
                             "one: not both")  # fmt: skip
        if reserved := sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_ARGUMENTS):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: those are the job's to say")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.top_logprobs is not None and self.logprobs is not True:  # OpenAI's rule: none would come back
            raise ValueError("top_logprobs goes with logprobs: true (or give logprobs the number alone)")
        # (response_format "text" asks for nothing: beside structured_outputs it was refused, as vLLM takes it)
        text_only = self.response_format is not None and self.response_format.type == "text"
        if self.structured_outputs is not None and self.response_format is not None and not text_only:
            raise ValueError("give structured_outputs or response_format, not both")
        if self.thinking is not None and not {"json", "json_object", "choice"} & set(self.structured_form() or ()):
            raise ValueError("thinking says where a constraint begins: give a JSON schema, any JSON object or a choice "
                             "(structured_outputs or response_format)")  # fmt: skip
        schema = (self.structured_form() or {}).get("json")
        if isinstance(schema, str):  # its text: read, so the checks below see the schema it holds
            try:
                schema = json.loads(schema)
            except RecursionError:  # (the worker's read raised it: a server error for a fault of the job's)
                raise ValueError(f"the structured output schema nests deeper than {MAX_JSON_DEPTH} levels") from None
            except ValueError as exc:
                raise ValueError(f"the structured output schema is not JSON: {exc}") from None
        tools = [tool.function.parameters for tool in self.tools or ()]
        checked = (("structured output schema", schema), ("metadata", self.metadata), ("tools", tools),
                   ("chat_template_kwargs", self.chat_template_kwargs))  # fmt: skip
        for name, value in checked:
            if (problem := json_problem(value)) is not None:
                raise ValueError(f"the {name} {problem}")
        return self

    def structured_form(self) -> dict[str, Any] | None:
        """The output's constraint, from either field, as ``roseinfer.StructuredOutputsParams`` takes it."""
        form = self.structured_outputs.engine_form() if self.structured_outputs is not None else None
        form = form or (self.response_format.engine_form() if self.response_format is not None else None)
        return {**form, "thinking": self.thinking} if form is not None and self.thinking is not None else form

    def template_args(self) -> dict[str, Any]:
        """The chat template call's arguments but the messages, as the engine makes them of ``engine_prompt``."""
        return {
            **(self.chat_template_kwargs or {}),
            "tools": self.tool_specs() if self.tools is not None else None,
            "add_generation_prompt": self.add_generation_prompt and not self.continue_final_message,
            "continue_final_message": self.continue_final_message,
        }

    def tool_specs(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    @property
    def num_logprobs(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:
            return self.top_logprobs or 0
        return self.logprobs

    @property
    def usage_each_event(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt in the form ``LLMEngine.add_request`` takes."""
        if self.messages is not None:
            chat: dict[str, Any] = {"messages": [m.template_form() for m in self.messages]}
            if self.tools is not None:
                chat["tools"] = self.tool_specs()
            if self.continue_final_message:  # (the engine's default then: no generation prompt)
                chat["continue_final_message"] = True
            elif not self.add_generation_prompt:
                chat["add_generation_prompt"] = False
            if self.chat_template_kwargs:
                chat["chat_template_kwargs"] = dict(self.chat_template_kwargs)
            if self.truncation == "auto":  # (the engine's: the tokens the output must have room for)
                needs = self.max_tokens if self.context_overflow == "error" and self.max_tokens is not None else 1
                chat["truncation"] = needs
            return chat
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": list(self.prompt_token_ids)}
        return {"prompt": self.prompt}

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``roseinfer.SamplingParams``."""
        return {
            "max_tokens": self.max_tokens,
            "context_overflow": self.context_overflow,
            "min_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "seed": self.seed,
            "logprobs": self.num_logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "structured_outputs": self.structured_form(),
            "n": self.n,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        }


@dataclass(frozen=True)
class Ending:
    """What a payload asks of its job's end: the id echoed in its result, the completion list its id goes onto."""

    custom_id: str | None = None
    notify: str | None = None
    metadata: dict[str, Any] | None = None


def ending_of(payload: Any) -> Ending:
    """A payload's ``custom_id``, ``notify`` and ``metadata``, each read alone: a job that never ran (refused for what
    else it holds, canceled while queued) still ends as it asks, as one that ran does. A value its field refuses is
    left out."""
    if not isinstance(payload, dict):
        return Ending()
    fields = {}
    for name, (kind, adapter) in _ending_fields().items():
        if isinstance(value := payload.get(name), kind):
            with contextlib.suppress(ValidationError):
                fields[name] = adapter.validate_python(value)
    if "metadata" in fields and not _echoable(fields["metadata"]):  # (the job's own checks, which refused it)
        del fields["metadata"]
    return Ending(**fields)


def json_problem(value: Any) -> str | None:
    """What keeps a value of the payload from being strict JSON another language reads (as words that follow its
    name), or None."""
    if json_depth(value) > MAX_JSON_DEPTH:
        return f"nests objects and lists deeper than {MAX_JSON_DEPTH} levels"
    try:  # Python reads 1e400 as infinity, and wrote it back as Infinity: JSON no other language parses
        json.dumps(value, allow_nan=False)
    except ValueError:
        return "holds NaN or an infinite number (1e400, say): JSON has none"
    except TypeError as exc:  # (a datetime, a set, a numpy number: pydantic passes a TypeError on as it is)
        return f"holds a value JSON cannot hold: {exc}"
    return None


def _echoable(value: Any) -> bool:
    """Whether a JSON value may go into a result as it is, by the payload's own checks (``json_problem``, and no lone
    surrogate): a job refused for its metadata echoed the very NaN or surrogate it was refused for."""
    return json_problem(value) is None and lone_surrogate(value) is None


@functools.cache
def _ending_fields() -> dict[str, tuple[type, TypeAdapter]]:
    """Those fields as the payload checks them, each alone (built once: an adapter costs ~1 ms)."""
    kinds = {"custom_id": str, "notify": str, "metadata": dict}
    return {name: (kind, TypeAdapter(Annotated[kind, JobRequest.model_fields[name]])) for name, kind in kinds.items()}


def job_ending(job: Any) -> Ending:
    """``ending_of`` an RQ job's payload; none where RQ cannot read the job's data."""
    try:
        payload = job.kwargs
    except Exception:
        return Ending()
    return ending_of(payload)


# Where a value may take one of several types, pydantic names the one it tried in the error's location
# (``content.str``, ``content.list[TextPart]``): not part of the field's path.
_UNION_MEMBER = re.compile(r"(str|int|float|bool|bytes|dict|list|tuple)(\[.*\])?|literal\[.*\]|[A-Z]\w*(\[.*\])?")


def field_path(loc: tuple | list) -> str:
    """A validation error's location as the field's path: ``messages.0.content``."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_MEMBER.fullmatch(p)))


def describe_validation_error(exc: Exception, names: dict[str, str] | None = None) -> str:
    """One readable line per field: ``max_tokens: Input should be greater than or equal to 1``; a field that may take
    several types says what each would need (``content: Input should be a valid string or a valid list``).
    ``names``: the caller's own names of top-level fields (an HTTP request's ``prompt`` for ``prompt_token_ids``)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    by_field: dict[str, list[str]] = {}
    for err in errors():
        msg = "unknown field" if err.get("type") == "extra_forbidden" else err.get("msg", "invalid")
        if err.get("type") == "value_error":  # (our own validators' words, without pydantic's "Value error, ")
            msg = msg.removeprefix("Value error, ")
        loc = tuple(err.get("loc", ()))
        if loc and names and str(loc[0]) in names:
            loc = (names[str(loc[0])], *loc[1:])
        where = field_path(loc) or ("" if err.get("type") == "value_error" else "payload")
        if err.get("type") == "extra_forbidden" and loc:  # the field's own name, whatever it looks like (a C#
            where = ".".join(p for p in (field_path(loc[:-1]), str(loc[-1])) if p)  # "MaxTokens": no union member)
        found = by_field.setdefault(_shown(where), [])
        if (msg := _shown(msg)) not in found:
            found.append(msg)
    # A check across fields (min_tokens against max_tokens) names them in its own words: no "payload: " before it.
    lines = (f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs) for where, msgs in by_field.items())
    return "; ".join(lines)


MAX_SHOWN_CHARS = 500


def _shown(text: str) -> str:
    """A payload's words as a reason quotes them: control characters escaped (a field named with a newline forged a
    line of the worker's log), and at most ``MAX_SHOWN_CHARS`` (a 100 KB logit_bias key came back whole, in the
    result kept for a year)."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:MAX_SHOWN_CHARS])
    return (
        line if len(text) <= MAX_SHOWN_CHARS and len(line) <= MAX_SHOWN_CHARS else line[: MAX_SHOWN_CHARS - 3] + "..."
    )
