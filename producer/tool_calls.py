"""OpenAI's function calling by structured output, as vLLM does it without a model's own tool-call parser:
``tool_choice: "required"`` constrains the output to a JSON array of calls of the request's tools, a named
function to a JSON object of its arguments; the text is read back into ``tool_calls``. ``"auto"`` (the model's
own choice between text and calls) needs a parser of the model's format, which is not here. No HTTP, no Redis."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# OpenAI's: a function without parameters takes none (its arguments are "{}").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps what its "#/$defs/..." references name


class ToolChoiceError(ValueError):
    """A request's tools and tool_choice that cannot go together; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str = "tool_choice") -> None:
        super().__init__(message)
        self.param = param


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # (vLLM's form)


@dataclass(frozen=True)
class ToolChoice:
    """What ``tool_choice`` asks of a request's ``tools``: the arguments of the named function, or (``name``
    None: "required") one or more calls of any of them."""

    parameters: dict[str, dict[str, Any]]  # each tool's name -> its parameters' JSON schema
    name: str | None = None
    parallel: bool = True  # "required": several calls may come (OpenAI's parallel_tool_calls); False: one

    @classmethod
    def of(
        cls, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool = True
    ) -> ToolChoice | None:
        """The plan of a request's ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` each) and
        ``tool_choice``; None where no call is asked for ("none", or no tools and no choice). Refuses "auto" with
        tools (vLLM's rule without a tool-call parser), a choice without tools, a name not among them."""
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
        if choice == "auto":
            raise ToolChoiceError(
                '"auto" tool choice needs a parser of the model\'s own tool-call format, which this server has not: '
                'ask for "required" (one or more calls) or a named function, both made by structured output, '
                'or "none"'
            )
        parameters = {tool["function"]["name"]: tool["function"].get("parameters") or NO_PARAMETERS for tool in tools}
        if choice == "required":
            return cls(parameters, parallel=parallel)
        name = choice["function"]["name"]  # (a named choice's shape is the request model's to check)
        if name not in parameters:
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the tools")
        return cls(parameters, name)

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output follows: the named function's parameters, or an array of one or more calls
        ``{"name", "parameters"}`` (each tool's ``$defs`` brought to the root, where its references point)."""
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

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The tool calls in a whole output: the named function's with the text as its arguments (even cut short:
        the finish reason says so), or each complete call of the array (one cut short is not among them)."""
        if self.name is not None:
            return [_call(self.name, text)]
        stream = self.stream()
        return [_call(delta["function"]["name"], delta["function"]["arguments"]) for delta in stream.feed(text)]

    def stream(self) -> CallStream:
        return CallStream(self.name)


def _call(name: str, arguments: str, id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class CallStream:
    """One choice's output, piece by piece, as OpenAI's streamed ``tool_calls`` deltas. A named function: its call
    first (``opening``), then each piece as its arguments' next part. "required": each call whole, once its JSON
    object closes (a JSON array read as it comes: strings, escapes and nesting followed)."""

    name: str | None
    made: int = 0  # calls sent
    _text: list[str] = field(default_factory=list)  # the object being read, "required"
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def opening(self) -> list[dict[str, Any]]:
        """The deltas before any output: a named function's call, its arguments to come."""
        if self.name is None:
            return []
        self.made = 1
        return [{"index": 0, **_call(self.name, "")}]

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.name is not None:
            return [{"index": 0, "function": {"arguments": text}}]
        deltas = []
        for done in self._objects(text):
            try:
                call = json.loads(done)
            except ValueError:  # (the output follows the schema: only a broken worker writes this)
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
                deltas.append({"index": self.made, **_call(call["name"], arguments)})
                self.made += 1
        return deltas

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
