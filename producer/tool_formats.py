"""The models' own tool-call formats, which ``tool_choice: "auto"`` reads (``--tool-call-parser``, named as vLLM's
parsers of the same formats):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, text around them (Hermes,
  Qwen 2.5 and 3, templates written for them);
- ``llama3_json``: an output that begins with ``{`` or ``<|python_tag|>`` and is JSON objects ``{"name": ...,
  "parameters": {...}}`` (or ``"arguments"``), separated by ``;`` (Llama 3.1 to 3.3);
- ``mistral``: text, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` (Mistral's tokenizers
  before v11), or ``[TOOL_CALLS]name[ARGS]{...}`` (or ``name{...}``) a call (v11 on);
- ``pythonic``: an output that is a Python list of calls with keyword arguments of literal values,
  ``[get_weather(city="Paris"), ...]`` (Llama 3.2, Llama 4, ToolACE); read by ``ast``, never run.

An output whose calls do not all read is text, all of it (vLLM's rule). Streamed, text goes out as it comes, never a
piece of a marker; each call goes out whole once its block closes (hermes) or once the output ends (the others,
whose calls run to the end). No HTTP, no Redis."""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from producer.schema import lone_surrogate

Call = dict[str, Any]  # OpenAI's: {"id", "type": "function", "function": {"name", "arguments"}}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # (vLLM's form)


def _mistral_id() -> str:  # Mistral's templates refuse a tool call id other than 9 letters and digits
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def function_call(name: str, arguments: str, id_: str | None = None) -> Call:
    return {"id": id_ or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_arguments(value: Any) -> str | None:
    """A call's arguments as OpenAI's string: an object's JSON, a string as it is where it is an object's JSON; None
    for anything else (a string that is no object's JSON, an object holding NaN or an infinity, which JSON has no
    word for, or nested past what Python's JSON writes): the client parses what it gets as JSON."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict):
            return None
        return value if lone_surrogate(value) is None else arguments_json(parsed)  # (its UTF-8 form: a 500)
    if not isinstance(value, dict):
        return None
    try:
        return arguments_json(value)
    except (ValueError, RecursionError):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def arguments_json(value: Any) -> str:
    """JSON as the model wrote it (its text unescaped); with escapes where it holds a lone surrogate (``"\\ud83d"``
    read from the model's JSON or Python), which has no UTF-8 form: a response holding it could not be sent."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text if lone_surrogate(text) is None else json.dumps(value, allow_nan=False)


def _json(text: str) -> Any:
    """``text`` as JSON; a ValueError where it is not (nested past the parser's depth too)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _named(obj: Any, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """A JSON call's name and arguments string, the arguments under the first of ``keys`` there ({} if none)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = _json_arguments(next((obj[key] for key in keys if key in obj), {}))
    return None if arguments is None else (obj["name"], arguments)


def _hermes_calls(body: str) -> list[tuple[str, str]] | None:
    try:
        call = _named(_json(body), ("arguments", "parameters"))
    except ValueError:
        return None
    return None if call is None else [call]


_DECODER = json.JSONDecoder()


def _llama3_calls(body: str) -> list[tuple[str, str]] | None:
    """JSON objects separated by ``;`` (white space and commas are let pass too)."""
    calls, i = [], 0
    while (i := _skip(body, i, " \t\r\n;,")) < len(body):
        try:
            obj, i = _DECODER.raw_decode(body, i)
        except (ValueError, RecursionError):
            return None
        if (call := _named(obj, ("parameters", "arguments"))) is None:
            return None
        calls.append(call)
    return calls or None


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _mistral_calls(body: str) -> list[tuple[str, str]] | None:
    """A JSON array of calls (or one call), words the model wrote after it left out (as vLLM's parser leaves them),
    or v11's ``name[ARGS]{...}`` after each marker."""
    try:
        calls = _json(body)
    except ValueError:
        try:  # (the first JSON value alone: "[...] I called it." was all text, no call)
            calls, _end = json.JSONDecoder().raw_decode(body.lstrip())
        except (ValueError, RecursionError):
            return _mistral_v11_calls(body)
        if not isinstance(calls, list):
            return _mistral_v11_calls(body)
    named = [_named(call, ("arguments", "parameters")) for call in (calls if isinstance(calls, list) else [calls])]
    return None if not named or None in named else named  # type: ignore[return-value]


def _mistral_v11_calls(body: str) -> list[tuple[str, str]] | None:
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        name, brace, rest = part.partition("{")
        name = name.removesuffix("[ARGS]").strip()
        if not brace or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            return None
        try:
            obj = _json(brace + rest)
        except ValueError:
            return None
        if not isinstance(obj, dict) or (arguments := _json_arguments(obj)) is None:
            return None
        calls.append((name, arguments))
    return calls


def _pythonic_calls(body: str) -> list[tuple[str, str]] | None:
    """A Python list of calls of plain names with keyword arguments whose values are literals."""
    try:
        tree = ast.parse(body.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if any(kw.arg is None for kw in node.keywords):  # (**kwargs)
                return None
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords}
            calls.append((node.func.id, arguments_json(arguments)))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _literal(node: ast.expr) -> Any:
    """A JSON value written in Python: strings, numbers (signed), True/False/None, lists, tuples, dicts of string
    keys; a ValueError for anything else (a name, a call, an expression)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


# How a leading block's calls begin: one whose start is not so (``[Note] ...``) is text, let out at once.
_PYTHONIC_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*(?:\(|\Z)|\Z)")
_JSON_START = re.compile(r'\{\s*(?:"|\Z)')


@dataclass(frozen=True)
class ToolFormat:
    """Where a model's calls are in its output and how one block of them reads."""

    name: str
    markers: tuple[str, ...]  # what begins a block of calls (not part of it)
    read_block: Callable[[str], list[tuple[str, str]] | None]  # a block's (name, arguments); None: it does not read
    close: str | None = None  # what ends a block; None: the block runs to the output's end
    leading: str = ""  # characters that begin a block (and are part of it) where they begin the output
    start: re.Pattern[str] | None = None  # how a leading block begins, as far as it came
    make_id: Callable[[], str] = call_id

    def read(self, text: str, names: frozenset[str] | None = None) -> tuple[str | None, list[Call]]:
        """A whole output's text outside its blocks (a stretch of white space alone is the format's; none: None)
        and its calls; all text, no calls, where a block does not read (or calls a function not in ``names``, the
        request's tools, where given)."""
        blocks = self._blocks(text)
        calls = []
        for _, _, body in blocks:
            read = _of(self.read_block(body), names)
            if read is None:
                return text, []
            calls += [function_call(name, arguments, self.make_id()) for name, arguments in read]
        if not blocks:
            return text, []
        bounds = [0, *(i for start, end, _ in blocks for i in (start, end)), len(text)]
        stretches = [text[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2)]
        return "".join(s for s in stretches if s.strip()) or None, calls

    def _blocks(self, text: str) -> list[tuple[int, int, str]]:
        """Each block's start, end and body (the last may be left open at the output's end)."""
        body = text.lstrip()
        if body[:1] and body[0] in self.leading and (self.start is None or self.start.match(body)):
            return [(len(text) - len(body), len(text), body)]
        found = [(i, m) for m in self.markers if (i := text.find(m)) >= 0]
        if not found:
            return []
        if self.close is None:
            start, marker = min(found)
            return [(start, len(text), text[start + len(marker) :])]
        blocks, i = [], 0
        while found:
            start, marker = min(found)
            end = text.find(self.close, start + len(marker))
            stop = len(text) if end < 0 else end + len(self.close)
            blocks.append((start, stop, text[start + len(marker) : len(text) if end < 0 else end]))
            i = stop
            found = [(j, m) for m in self.markers if (j := text.find(m, i)) >= 0]
        return blocks

    def stream(self, most: int | None = None, names: frozenset[str] | None = None) -> FormatStream:
        return FormatStream(self, most, names)


def _of(calls: list[tuple[str, str]] | None, names: frozenset[str] | None) -> list[tuple[str, str]] | None:
    """``calls`` where each names one of ``names`` (None: any name); else None, as a block that does not read: an
    OpenAI client is never handed a function its request did not offer."""
    if calls is None or names is None or all(name in names for name, _ in calls):
        return calls
    return None


FORMATS = {
    f.name: f
    for f in (
        ToolFormat("hermes", ("<tool_call>",), _hermes_calls, close="</tool_call>"),
        ToolFormat("llama3_json", ("<|python_tag|>",), _llama3_calls, leading="{", start=_JSON_START),
        ToolFormat("mistral", ("[TOOL_CALLS]",), _mistral_calls, make_id=_mistral_id),
        # (Llama 4 wraps its calls in <|python_start|> ... <|python_end|>, kept as text where tools may be called)
        ToolFormat(
            "pythonic",
            ("<|python_start|>",),
            _pythonic_calls,
            close="<|python_end|>",
            leading="[",
            start=_PYTHONIC_START,
        ),
    )
}


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may begin one of ``markers`` (held until the next piece says)."""
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _last(text: str, count: int) -> str:
    """The last ``count`` characters of ``text`` (none for 0)."""
    return text[len(text) - count :] if len(text) > count else text


@dataclass
class FormatStream:
    """One choice's output in a model's format, piece by piece: its text as it comes (but what may begin a marker,
    and white space alone before a call), each call whole once its block closes."""

    format: ToolFormat
    most: int | None = None  # parallel_tool_calls false: calls past the first are left out
    names: frozenset[str] | None = None  # the functions a call may name (the request's tools); None: any
    made: int = 0  # calls sent
    _held: str = ""  # text not yet let out, or the open block's
    _marker: str | None = None  # the open block's marker ("" for a leading one); None: no block is open
    _said: bool = False  # text of this stretch (before, between or after blocks) went out
    _began: bool = False  # anything but white space came (a leading character begins a block no more)
    _gap: str = ""  # the white space alone before the open block: the format's if it reads, text if not
    _failed: bool = False  # a block did not read: the output is text from there on (as whole, all of it)
    _parts: list[str] = field(default_factory=list)  # an open block's pieces past ``_held``, joined once it may close
    _tail: str = ""  # the open block's last characters, fewer than its close's: a close may begin there

    def opening(self) -> list[Call]:
        """The deltas before any output: none (the model chooses)."""
        return []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The text and the tool call deltas the next piece of output lets out."""
        fmt = self.format
        if self._in_block():  # (each piece added to the whole block and searched again: a long call took seconds)
            close = fmt.close
            keep = len(close) - 1 if close else 0
            if not self._parts:
                self._tail = _last(self._held, keep)
            if close is None or close not in self._tail + text:
                self._parts.append(text)
                self._tail = _last(self._tail + text, keep)
                return "", []
        self._held += "".join(self._parts) + text
        self._parts.clear()
        content, deltas = "", []
        while True:
            if self._failed:
                content, self._held = content + self._held, ""
                return content, deltas
            if self._marker is None:
                if not self._began:
                    body = self._held.lstrip()
                    if not body:  # (white space alone: held until what follows says)
                        return content, deltas
                    self._began = True
                    if body[0] in fmt.leading:
                        self._gap, self._held, self._marker = self._held[: len(self._held) - len(body)], body, ""
                        continue
                found = [(i, m) for m in fmt.markers if (i := self._held.find(m)) >= 0]
                start, marker = min(found) if found else (-1, "")
                end = len(self._held) - held_back(self._held, fmt.markers) if start < 0 else start
                out, self._held = self._held[:end], self._held[end:]
                if not self._said and not out.strip() and start < 0:  # (white space alone: held)
                    self._held = out + self._held
                    return content, deltas
                if self._said or out.strip():  # (a stretch of white space alone around blocks is the format's)
                    content += out
                    self._said = True
                if start < 0:
                    return content, deltas
                self._gap = "" if self._said else out
                self._held, self._marker = self._held[len(marker) :], marker
            if self._marker == "" and fmt.start is not None and not fmt.start.match(self._held):
                # (no call begins so: text, the rest of it as it comes)
                self._marker, self._said, self._held, self._gap = None, True, self._gap + self._held, ""
                continue
            if fmt.close is None or (close := self._held.find(fmt.close)) < 0:
                return content, deltas  # (the block goes on: to its close, or to the output's end)
            body, self._held = self._held[:close], self._held[close + len(fmt.close) :]
            content, deltas = self._add(body, True, content, deltas)
            self._said = False  # (a new stretch of text begins)

    def _in_block(self) -> bool:
        """A block is open, and known to be one (a leading character's block: its start read, not only a piece of
        it that the output's end could still leave as it is)."""
        if self._marker is None or self._failed:
            return False
        start = self.format.start
        if self._parts or self._marker != "" or start is None:
            return True
        read = start.match(self._held)
        return read is not None and read.end() < len(self._held)

    def _add(self, body: str, closed: bool, content: str, deltas: list[Call]) -> tuple[str, list[Call]]:
        marker, self._marker, gap, self._gap = self._marker or "", None, self._gap, ""
        read = _of(self.format.read_block(body), self.names)
        if read is None:  # (calls already out cannot be taken back: the block and all after it go out as text)
            self._failed = True
            return content + gap + marker + body + ((self.format.close or "") if closed else ""), deltas
        for name, arguments in read:
            if self.most is None or self.made < self.most:
                deltas = [*deltas, {"index": self.made, **function_call(name, arguments, self.format.make_id())}]
                self.made += 1
        return content, deltas

    def finish(self) -> tuple[str, list[Call]]:
        """What the output's end lets out: text held back, the calls of a block left open."""
        held, self._held = self._held + "".join(self._parts), ""
        self._parts.clear()
        if self._marker is None:
            return ("" if self.made and not self._said and not held.strip() else held), []
        return self._add(held, False, "", [])
