"""OpenAI's function calling, as vLLM does it: ``tool_choice: "required"`` constrains the output to a JSON array of
calls of the request's tools, a named function to a JSON object of its arguments (structured output: any model);
the text is read back into ``tool_calls``. ``"auto"`` (the model's own choice between text and calls) reads the
calls out of the model's own format, where the operator names it (``roseinfer serve --tool-call-parser``; the
formats are in ``producer/tool_formats.py``). No HTTP, no Redis."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from producer.tool_formats import FORMATS, FormatStream, call_id, function_call

# OpenAI's: a function without parameters takes none (its arguments are "{}").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps what its "#/$defs/..." references name
TOOL_CALL_PARSERS = tuple(FORMATS)  # the models' own formats "auto" reads


def object_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters``, which must describe a JSON object (OpenAI refuses any other): a boolean or
    enum schema was taken, its call's arguments made ``false`` or ``1``, and the call, sent back in the
    conversation's next turn, refused there (arguments are a JSON object's text)."""
    kind = schema.get("type")
    if kind is not None and kind not in ("object", ["object"]):  # (["object", "null"] made the arguments "null")
        raise ValueError(f'a function\'s parameters are a JSON schema of type "object", got type {json.dumps(kind)}')
    for key in ("enum", "const"):
        values = schema.get(key) if key == "enum" else [schema.get(key)] if key in schema else None
        if isinstance(values, list) and not all(isinstance(v, dict) for v in values):
            raise ValueError(f"a function's parameters are a JSON schema of an object: its {key} holds other values")
    return schema


class ToolChoiceError(ValueError):
    """A request's tools and tool_choice that cannot go together; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str = "tool_choice") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What ``tool_choice`` asks of a request's ``tools``: the arguments of the named function, one or more calls
    of any of them ("required"), or ("auto", with the ``parser`` of the model's format) text or calls as the model
    chooses."""

    parameters: dict[str, dict[str, Any]]  # each tool's name -> its parameters' JSON schema
    name: str | None = None
    parallel: bool = True  # several calls may come (OpenAI's parallel_tool_calls); False: one
    parser: str | None = None  # "auto": the model's own format its calls are read in
    id_format: str | None = None  # "required" and named: the server's parser, whose call ids its model's template takes

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
            return cls(parameters, parallel=parallel, id_format=parser)
        name = choice["function"]["name"]  # (a named choice's shape is the request model's to check)
        if name not in parameters:
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the tools")
        return cls(parameters, name, id_format=parser)

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
        for i, (name, params) in enumerate(self.parameters.items()):
            # Each tool's parameters in the root's $defs, their references made to point there: nested in the array,
            # "#" (a recursive tree, as zod writes it) pointed at the array of calls, "#/properties/..." nowhere.
            home = f"#/$defs/{_TOOL_DEF}{i}"
            # (its own $id, moved under the root's $defs, made its "#/..." references resolve against itself)
            params = _rebased({k: v for k, v in params.items() if k not in ("$id", "$schema")}, home)
            for key in _DEFS_KEYS:
                found = params.pop(key, None) or {}
                if not isinstance(found, dict):  # (an AttributeError: a 500 where the request is at fault)
                    raise ToolChoiceError(
                        f"tools.{i}: the function {name!r}'s parameters.{key} must be an object of definitions, got "
                        f"{type(found).__name__}",
                        param="tools",
                    )
                for def_name, definition in found.items():
                    if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                        raise ToolChoiceError(
                            f"tools define {key}/{def_name} twice, differently: give the definitions distinct names",
                            param="tools",
                        )
            defs.setdefault("$defs", {})[f"{_TOOL_DEF}{i}"] = params
            calls.append(
                {
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": {"$ref": home}},
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
        if self.parser is not None:
            content, calls = FORMATS[self.parser].read(text, frozenset(self.parameters))
            return content, calls if self.parallel else calls[:1]  # (parallel_tool_calls false: the first)
        if self.name is not None:
            return None, [function_call(self.name, text, self.stream().make_id())]
        _, deltas = self.stream().feed(text)
        return None, [{k: v for k, v in delta.items() if k != "index"} for delta in deltas]

    def stream(self) -> CallStream | FormatStream:
        if self.parser is not None:
            return FORMATS[self.parser].stream(None if self.parallel else 1, frozenset(self.parameters))
        # (Mistral's templates refuse another id than its own 9 characters: the next turn, sent back, was a 400)
        return CallStream(self.name, FORMATS[self.id_format].make_id if self.id_format is not None else call_id)


@dataclass
class CallStream:
    """One choice's output, piece by piece, as OpenAI's ``tool_calls`` deltas. A named function: its call first
    (``opening``), then each piece as its arguments' next part. "required": each call whole, once its JSON object
    closes (a JSON array read as it comes: strings, escapes and nesting followed). ("auto": ``FormatStream``.)"""

    name: str | None
    make_id: Callable[[], str] = call_id
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
        return [{"index": 0, **function_call(self.name, "", self.make_id())}]

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The text (none: the output is the calls) and the tool call deltas the next piece of output lets out."""
        if not text:
            return "", []
        if self.name is not None:
            return "", [{"index": 0, "function": {"arguments": text}}]
        deltas = []
        for done in self._objects(text):
            try:
                call = json.loads(done)
            except (ValueError, RecursionError):  # (the output follows the schema: only a broken worker writes this)
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                # The parameters as the model wrote them: written again from Python, a number past a float's range
                # (1e999, which the grammar's "number" takes) raised and failed the response, and others changed.
                arguments = member_text(done, "parameters") or "{}"
                deltas.append({"index": self.made, **function_call(call["name"], arguments, self.make_id())})
                self.made += 1
        return "", deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What the output's end lets out: nothing (a call cut short is left out)."""
        return "", []

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


_TOOL_DEF = "__roseinfer_tool_"
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, not schemas: their "$ref" keys are data
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rebased(schema: Any, home: str) -> Any:
    """``schema`` with its references to its own root (``#``, ``#/...``) made to ``home``; those into its ``$defs``
    or ``definitions`` stay (they move to the root)."""
    if isinstance(schema, list):
        return [_rebased(item, home) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            if not value.startswith(tuple(f"#/{k}/" for k in _DEFS_KEYS)):
                value = home + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names, each a schema (a property "default" too)
            value = {name: _rebased(sub, home) for name, sub in value.items()}
        elif key not in _NOT_SCHEMAS:
            value = _rebased(value, home)
        out[key] = value
    return out


def member_text(text: str, key: str) -> str | None:
    """The text of member ``key``'s value in the JSON object ``text`` (read whole already), as written; None if
    it has none."""
    decoder, i = json.JSONDecoder(), text.index("{") + 1
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "}":
            return None
        name, i = decoder.raw_decode(text, i)
        i = text.index(":", i) + 1
        while text[i] in " \t\r\n":
            i += 1
        _value, end = decoder.raw_decode(text, i)
        if name == key:
            return text[i:end]
        i = end


def _shown(choice: str | dict[str, Any]) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"{{function: {choice['function']['name']!r}}}"
