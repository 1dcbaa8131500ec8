"""OpenAI's function calling, as vLLM does it: ``tool_choice: "required"`` constrains the output to a JSON array of
calls of the request's tools, a named function to a JSON object of its arguments (structured output: any model);
the text is read back into ``tool_calls``. ``"auto"`` (the model's own choice between text and calls) reads the
calls out of the model's own format, where the operator names it (``roseinfer serve --tool-call-parser``):
``hermes``, the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of Hermes, Qwen 2.5 and the
templates written for them. No HTTP, no Redis."""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# OpenAI's: a function without parameters takes none (its arguments are "{}").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps what its "#/$defs/..." references name
TOOL_CALL_PARSERS = ("hermes",)  # the models' own formats "auto" reads
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)  # (the last may be left open at the end)


class ToolChoiceError(ValueError):
    """A request's tools and tool_choice that cannot go together; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str = "tool_choice") -> None:
        super().__init__(message)
        self.param = param


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # (vLLM's form)


@dataclass(frozen=True)
class ToolChoice:
    """What ``tool_choice`` asks of a request's ``tools``: the arguments of the named function, one or more calls
    of any of them ("required"), or ("auto", with the ``parser`` of the model's format) text or calls as the model
    chooses."""

    parameters: dict[str, dict[str, Any]]  # each tool's name -> its parameters' JSON schema
    name: str | None = None
    parallel: bool = True  # several calls may come (OpenAI's parallel_tool_calls); False: one
    parser: str | None = None  # "auto": the model's own format its calls are read in

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        choice: str | dict[str, Any] | None,
        parallel: bool = True,
        parser: str | None = None,
    ) -> ToolChoice | None:
        """The plan of a request's ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` each) and
        ``tool_choice``; None where no call is asked for ("none", or no tools and no choice). Refuses "auto" with
        tools but no ``parser`` (vLLM's rule), a choice without tools, a name not among them."""
        tools = tools or []
        names = [tool["function"]["name"] for tool in tools]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ToolChoiceError(f"two tools are named {twice!r}", param="tools")
        if choice is None:  # OpenAI's default: "auto" where there are tools
            choice = "auto" if tools else "none"
        if choice == "none":
            return None
        if not tools:
            raise ToolChoiceError(f"tool_choice {_shown(choice)} needs tools")
        parameters = {tool["function"]["name"]: tool["function"].get("parameters") or NO_PARAMETERS for tool in tools}
        if choice == "auto":
            if parser is None:
                raise ToolChoiceError(
                    '"auto" tool choice needs a parser of the model\'s own tool-call format, and none was named '
                    '(--tool-call-parser of roseinfer serve or batch): ask for "required" (one or more calls) or a '
                    'named function, both made by structured output, or "none"'
                )
            return cls(parameters, parallel=parallel, parser=parser)
        if choice == "required":
            return cls(parameters, parallel=parallel)
        name = choice["function"]["name"]  # (a named choice's shape is the request model's to check)
        if name not in parameters:
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the tools")
        return cls(parameters, name)

    @property
    def auto(self) -> bool:
        return self.parser is not None

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output follows: the named function's parameters, or an array of one or more calls
        ``{"name", "parameters"}`` (each tool's ``$defs`` brought to the root, where its references point); none
        for "auto", where the model writes calls in its own format, or text."""
        if self.auto:
            return None
        if self.name is not None:
            return self.parameters[self.name]
        defs: dict[str, Any] = {}
        calls = []
        for name, params in self.parameters.items():
            params = copy.copy(params)
            for key in _DEFS_KEYS:
                for def_name, definition in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                        raise ToolChoiceError(
                            f"tools define {key}/{def_name} twice, differently: give the definitions distinct names",
                            param="tools",
                        )
            calls.append(
                {
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        items = {"type": "object", "anyOf": calls}
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}), "items": items, **defs}

    def read(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output's text (None: none) and tool calls: the named function's with the text as its arguments
        (even cut short: the finish reason says so), each complete call of the array (one cut short is not among
        them), or "auto"'s calls in the model's format and the text around them (an output with a call that does
        not read is all text, as vLLM's)."""
        if self.auto:
            content, calls = _hermes(text)
            return content, calls if self.parallel else calls[:1]  # (parallel_tool_calls false: the first)
        if self.name is not None:
            return None, [_call(self.name, text)]
        _, deltas = self.stream().feed(text)
        return None, [_call(delta["function"]["name"], delta["function"]["arguments"]) for delta in deltas]

    def stream(self) -> CallStream:
        return CallStream(self.name, self.auto, most=None if self.parallel or not self.auto else 1)


def _call(name: str, arguments: str, id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The text outside the call blocks (a stretch of white space alone around them is the format's) and the
    calls; all text where a block does not read."""
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = [_hermes_call(block.group(1)) for block in blocks]
    if any(call is None for call in calls):
        return text, []
    bounds = [0, *(i for block in blocks for i in block.span()), len(text)]
    stretches = [text[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2)]
    return "".join(s for s in stretches if s.strip()) or None, calls  # type: ignore[return-value]


def _hermes_call(body: str) -> dict[str, Any] | None:
    """A call of Hermes' format, ``{"name": ..., "arguments": {...}}``, as OpenAI's; None where it does not read."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # (a model's output nested past the parser's depth reads as text too)
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return _call(call["name"], arguments)


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may begin ``marker`` (held until the next piece says)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class CallStream:
    """One choice's output, piece by piece, as OpenAI's streamed text and ``tool_calls`` deltas. A named function:
    its call first (``opening``), then each piece as its arguments' next part. "required": each call whole, once its
    JSON object closes (a JSON array read as it comes: strings, escapes and nesting followed). "auto": the text as it
    comes (but for what may begin a call's marker), each call whole once its block closes."""

    name: str | None
    auto: bool = False
    most: int | None = None  # "auto" with parallel_tool_calls false: calls past the first are left out
    made: int = 0  # calls sent
    _text: list[str] = field(default_factory=list)  # the object being read, "required"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _held: str = ""  # "auto": text not yet let out
    _in_call: bool = False
    _said: bool = False  # "auto": text of this stretch (before, between or after calls) went out

    def opening(self) -> list[dict[str, Any]]:
        """The deltas before any output: a named function's call, its arguments to come."""
        if self.name is None:
            return []
        self.made = 1
        return [{"index": 0, **_call(self.name, "")}]

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The text and the tool call deltas the next piece of output lets out."""
        if not text:
            return "", []
        if self.auto:
            return self._feed_auto(text)
        if self.name is not None:
            return "", [{"index": 0, "function": {"arguments": text}}]
        deltas = []
        for done in self._objects(text):
            try:
                call = json.loads(done)
            except (ValueError, RecursionError):  # (the output follows the schema: only a broken worker writes this)
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
                deltas.append({"index": self.made, **_call(call["name"], arguments)})
                self.made += 1
        return "", deltas

    def _feed_auto(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                start = self._held.find(_OPEN)
                end = len(self._held) - _held_back(self._held, _OPEN) if start < 0 else start
                out, self._held = self._held[:end], self._held[end:]
                if not self._said and not out.strip() and start < 0:  # (white space alone: held until text says)
                    self._held = out + self._held
                    return content, deltas
                if self._said or out.strip():  # (a stretch of white space alone around calls is the format's)
                    content += out
                    self._said = True
                if start < 0:
                    return content, deltas
                self._held, self._in_call = self._held[len(_OPEN) :], True
            close = self._held.find(_CLOSE)
            if close < 0:
                return content, deltas
            body, self._held, self._in_call = self._held[:close], self._held[close + len(_CLOSE) :], False
            content, deltas = self._add_call(body, content, deltas)
            self._said = False  # (a new stretch of text begins)

    def _add_call(self, body: str, content: str, deltas: list) -> tuple[str, list[dict[str, Any]]]:
        call = _hermes_call(body)
        if call is None:  # (text already out cannot be taken back: the block goes out as text)
            return content + _OPEN + body + _CLOSE, deltas
        if self.most is not None and self.made >= self.most:
            return content, deltas
        self.made += 1
        return content, [*deltas, {"index": self.made - 1, **call}]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What the output's end lets out: "auto"'s text held back, a call its block left open."""
        held, self._held = self._held, ""
        if not self.auto or not self._in_call:
            return ("" if self.made and not self._said and not held.strip() else held), []
        self._in_call = False
        content, deltas = self._add_call(held, "", [])
        return (content.removesuffix(_CLOSE), deltas) if content else ("", deltas)

    def _objects(self, text: str) -> Iterable[str]:
        """The text of each object of the array that closes in ``text``."""
        for ch in text:
            if self._depth >= 2 or (self._depth == 1 and ch == "{"):
                self._text.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}":
                    yield "".join(self._text)
                    self._text.clear()


def _shown(choice: str | dict[str, Any]) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"{{function: {choice['function']['name']!r}}}"
