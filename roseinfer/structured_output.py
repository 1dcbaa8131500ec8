"""Structured outputs: decoding constrained to a JSON schema, any JSON object, a regex, a choice or a Lark grammar.

llguidance does the matching. Each constrained request holds one ``LLMatcher`` (on ``Sequence.grammar``) that has
consumed every output token so far. Before a step samples, the matchers of the rows that sample fill a token bitmask
(in llguidance's threads); the sampler sets every token the mask leaves out to -inf, greedy and sampled rows alike.
On a GPU the masks fill while the model's forward runs; on a CPU, where the forward's threads hold every core, they
fill just before it, on every core (a thread of their own would only slow the forward's threads down).
Preemption and recompute keep the matcher: the tokens it consumed stay the request's.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roseinfer.outputs import AbortCause
from roseinfer.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from roseinfer.sequence import Sequence

log = logging.getLogger(__name__)

# JSON as Python's json.dumps writes it: one space after ',' and ':', no other whitespace. A small model left free
# wanders in blanks and newlines until max_tokens; this keeps every JSON output compact and bounded.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64  # compiled grammars kept (a dataset run uses one schema for every row)

# The string formats llguidance enforces. JSON Schema makes any other ``format`` an annotation, which OpenAI's
# non-strict requests and pydantic's schemas (``path``, ``decimal``, ``password``, ``binary``) use: llguidance
# refused the whole schema for one ("Unknown format: path"), so they are dropped before it compiles.
KNOWN_FORMATS = frozenset(("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"))
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")  # fmt: skip


@dataclass
class GrammarMasks:
    """The token bitmask of one step: ``rows`` are indexes into the step's sampling rows, ``bitmask[i]`` is row
    ``rows[i]``'s (int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed)."""

    rows: list[int]
    bitmask: torch.Tensor

    def allowed(self, vocab: int) -> torch.Tensor:
        """A bool [len(rows), vocab] tensor: True where the mask allows the token."""
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        # (contiguous: a strided one is pinned for the GPU through pageable memory, a copy that waits)
        return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab])).view(torch.bool)


class PendingMasks:
    """Masks being filled in the background; ``get()`` waits for them."""

    def __init__(self, future: Future[GrammarMasks] | GrammarMasks | None) -> None:
        self._future = future

    def get(self) -> GrammarMasks | None:
        return self._future.result() if isinstance(self._future, Future) else self._future


# A reasoning model's thinking before the constrained part (``thinking``), in llguidance's Lark: free text that
# stops at </think> (a lazy lexeme), the constraint right after it (so the answer is the constrained text alone);
# "first" thinks from the start, "optional" in a block it may begin with.
_THINKING = {
    "first": "start: thought answer",
    "optional": 'start: ("<think>" thought)? answer',
}
_THOUGHT = 'thought: body\nbody[stop="</think>"]: /(.|\\n)*/'


def enforceable(schema: Any) -> Any:
    """``schema`` without the ``format`` annotations llguidance does not know (``KNOWN_FORMATS``), walked as a
    schema: a property named "format" is a property, an ``enum`` or ``default`` value is left as it is. An object
    that lists its properties and says nothing of others takes no others, as vLLM's default backend (xgrammar) and
    OpenAI's strict mode: llguidance reads JSON Schema's default, any key, and a small model wrote keys of noise
    until ``max_tokens`` (a pydantic model's schema names none: 8 seeds of 8, the text no JSON). Not an object
    whose properties add up with others' (a part of a composition, one composed beside its properties, one a
    composition refers to, one that requires a key it does not list): closed, those could match nothing."""
    return _enforceable(schema, True, _composed_refs(schema))


def _enforceable(schema: Any, closed: bool, open_refs: set[str]) -> Any:
    if isinstance(schema, list):  # (``items`` as a list: a tuple's schemas)
        return [_enforceable(item, True, open_refs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "format" and isinstance(value, str) and value not in KNOWN_FORMATS:
            continue
        if key in _BOUNDS and isinstance(value, int) and not isinstance(value, bool):
            key, value = _bound_inside(key, value)
        if key in ("maximum", "minimum") and _is_number(value) and _is_number(out.get(key)):
            # (an exclusive bound moved inside is inclusive, beside the schema's own: the tighter holds)
            value = min(value, out[key]) if key == "maximum" else max(value, out[key])
        if key in ("$defs", "definitions") and isinstance(value, dict):
            value = {
                name: _enforceable(sub, f"#/{key}/{name}" not in open_refs, open_refs) for name, sub in value.items()
            }
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _enforceable(sub, True, open_refs) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):  # (the parts of one beside properties add up)
            part_closed = key != "allOf" and "properties" not in schema
            value = [_enforceable(part, part_closed, open_refs) for part in value]
        elif key in _SCHEMA_ONE:
            value = _enforceable(value, True, open_refs)
        out[key] = value
    properties = out.get("properties")
    others = ("additionalProperties", "patternProperties", "unevaluatedProperties", "$ref", "if", *_SCHEMA_LISTS)
    listed = isinstance(properties, dict) and all(name in properties for name in out.get("required") or ())
    if closed and listed and not any(key in out for key in others):
        out["additionalProperties"] = False
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bound_inside(key: str, value: int) -> tuple[str, int]:
    """An integer bound as llguidance holds it, a double, moved to the nearest one inside the bound where it is not
    one exactly: rounded outward, 2**53 + 7 let 9007199254741000 through, past its maximum (14 seeds of 16). That
    double lies inside an exclusive bound, so it becomes an inclusive one (kept exclusive, it refused itself)."""
    try:
        near = float(value)
    except OverflowError:  # (10**400: past every double; a server error where the request is at fault)
        raise ValueError(f"the bound {key} {value} is past what a JSON number holds") from None
    if near == value:
        return key, value
    upper = key in ("maximum", "exclusiveMaximum")
    if (near > value) == upper:  # rounded past it: the next double back in
        near = math.nextafter(near, -math.inf if upper else math.inf)
    return ("maximum" if upper else "minimum"), int(near)


_COMPOSING = ("properties", "patternProperties", "additionalProperties", "allOf", "anyOf", "oneOf", "required")


def _composed_refs(schema: Any) -> set[str]:
    """The references whose targets are composed with others, left open (their properties add up with the
    others'): an ``allOf`` part's, an ``anyOf``/``oneOf`` part's beside properties, a ``$ref`` beside properties
    or a composition; and what those point at in turn. Not a union's alternatives, a tuple's items, nor a ``$ref``
    beside annotations (``description``, ``default``): pydantic's Optional, unions and described fields stay
    closed."""
    found: set[str] = set()
    aliases: dict[str, str] = {}  # a definition that is a reference alone: opening it opens what it names

    def visit(node: Any, path: str) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item, "")
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            if any(key in node for key in _COMPOSING):
                found.add(ref)
            elif path and len(node) == 1:
                aliases[path] = ref
        for key in ("allOf", "anyOf", "oneOf"):
            if key != "allOf" and "properties" not in node:
                continue
            for part in node.get(key) if isinstance(node.get(key), list) else ():
                if isinstance(part, dict) and isinstance(part.get("$ref"), str):
                    found.add(part["$ref"])
        for key, value in node.items():
            if key in ("$defs", "definitions") and isinstance(value, dict):
                for name, sub in value.items():
                    visit(sub, f"#/{key}/{name}")
            else:
                visit(value, "")

    visit(schema, "")
    pending = list(found)
    while pending:  # (through a chain of references: each target opened)
        target = aliases.get(pending.pop())
        if target is not None and target not in found:
            found.add(target)
            pending.append(target)
    return found


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's constraint."""
    import llguidance

    if so.thinking is None:
        return _plain_grammar(so)
    if so.choice is not None:
        # (Lark's strings are JSON's; its lexer refuses a raw DEL, which JSON leaves as it is)
        answer = " | ".join(json.dumps(c, ensure_ascii=False).replace("\x7f", "\\u007f") for c in so.choice)
    else:
        schema = {"type": "object"} if so.json_object else json.loads(so.json) if isinstance(so.json, str) else so.json
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is an object")
        schema = enforceable(schema)
        answer = "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})
    return llguidance.grammar_from("lark", f"{_THINKING[so.thinking]}\n{_THOUGHT}\nanswer: {answer}\n")


def _plain_grammar(so: StructuredOutputsParams) -> str:
    import llguidance
    from llguidance import LLMatcher

    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return LLMatcher.grammar_from_json_schema(enforceable(schema), defaults=JSON_OPTIONS)
    if so.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    assert so.grammar is not None
    return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to it


MAX_REASON_CHARS = 1000


def _said(reason: str) -> str:
    """llguidance's reason in one line of at most ``MAX_REASON_CHARS``: it quotes the input, two or three times (a
    3 MB regex's made a 9 MB log line and a 12 MB result kept a year), and its lines could forge log lines."""
    line = " ".join(reason.split())
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."


class StructuredOutputManager:
    """Compiles constraints into matchers and fills each step's masks. Built once per engine; llguidance's view of
    the tokenizer (~0.5 s to build) is made at the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], overlap: bool = False) -> None:
        """``overlap``: fill masks in a thread while the forward runs (a GPU's forward leaves the CPU free)."""
        self.overlap = overlap
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self.compiled_last = False  # whether ``matcher_for``'s last matcher came of a template compiled for it
        self._pool: ThreadPoolExecutor | None = None

    def _setup(self) -> None:
        if self._ll_tokenizer is not None:
            return
        try:
            import llguidance
            import llguidance.hf
        except ImportError as exc:  # a declared dependency; only a broken install lacks it
            raise ValueError(f"structured outputs need the llguidance package: {exc}") from exc
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, and this model has none")
        # (an EOS past the model's table, a config's, is never sampled: llguidance refused every constraint for it)
        eos = [token for token in self.eos_token_ids if token < self.vocab_size]
        self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor(num_threads=1 if self.overlap else max(1, torch.get_num_threads()))
        if self.overlap:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    # ----- admission -------------------------------------------------------------------------------
    def matcher_for(self, so: StructuredOutputsParams, output_prefix: list[int]) -> Any:
        """A fresh matcher for ``so`` that has consumed ``output_prefix``, or ``ValueError`` with llguidance's reason
        (a schema it cannot compile, a regex that does not parse, a prefix the constraint does not allow)."""
        from llguidance import LLMatcher

        self._setup()
        try:
            text = grammar_text(so)
        except (ValueError, TypeError, RecursionError) as exc:  # (a schema nested past Python's depth: the last)
            raise ValueError(f"invalid structured output: {_said(str(exc))}") from None
        template = self._templates.get(text)
        self.compiled_last = template is None  # (a matcher of its own template: its limits are its constraint's)
        if template is None:
            template = LLMatcher(self._ll_tokenizer, text, log_level=0)
            if template.is_error():
                raise ValueError(f"invalid structured output: {_said(template.get_error())}")
            self._templates[text] = template
            if len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(text)
        matcher = template.deep_copy()
        if output_prefix and not matcher.consume_tokens(list(output_prefix)):
            raise ValueError(f"the output to resume breaks its structured output: {_said(matcher.get_error())}")
        if output_prefix and matcher.is_stopped():  # (a step would add an EOS the uninterrupted run never had)
            raise ValueError("the output to resume completes its structured output: the request had ended")
        return matcher

    # ----- the step --------------------------------------------------------------------------------
    def start_masks(self, sampling: list[Sequence]) -> PendingMasks:
        """Begin filling the masks of the constrained requests among ``sampling`` (the step's rows that sample, in
        order); they fill while the forward runs."""
        rows = [i for i, seq in enumerate(sampling) if seq.grammar is not None]
        matchers = [sampling[i].grammar for i in rows]
        if not rows:
            return PendingMasks(None)
        if self._pool is None:
            return PendingMasks(self._fill(rows, matchers))
        return PendingMasks(self._pool.submit(self._fill, rows, matchers))

    def _fill(self, rows: list[int], matchers: list[Any]) -> GrammarMasks:
        # llguidance.torch's two helpers, inline: importing that module compiles a kernel with torch.compile, which
        # loads inductor (~2.5 s on a slow CPU) inside the step of a worker's first constrained request.
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        pairs = [(m, k) for k, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
        return GrammarMasks(rows, bitmask)

    @staticmethod
    def accept(seq: Sequence, token: int) -> bool:
        """Feed a sampled token to the request's matcher. False when the matcher refuses it (it then stays in error)."""
        return bool(seq.grammar.consume_token(token))

    def refused(self, seq: Sequence, token: int) -> AbortCause:
        """Why the request's matcher refused a token its mask allowed: its constraint's forced expansion never ends
        (a schema that requires itself, as ``{"items": {"$ref": "#"}, "minItems": 1}``: no text completes it, the
        request's fault, where it was called the server's and the official clients sent the job twice more); the
        library's limits (the server's, worth a retry); else the library and the tokenizer disagree."""
        why = self.dead_end(seq)
        if why is not None and "ff_tokens" in why:
            return AbortCause(True, why)
        if why is not None and self.past_limits(why):
            return self.limit_cause(seq, why)
        return AbortCause(False, f"its structured output refused token {token}, its mask allowed")

    @staticmethod
    def limit_cause(seq: Sequence, why: str) -> AbortCause:
        """A matcher past the library's limits: its constraint's fault where it had its template to itself (compiled
        for it, as a retry's is: ``(x{1000}){1000}`` is past them whatever ran before), not retried; else maybe the
        earlier copies' (worth a retry, on a template compiled afresh)."""
        if seq.grammar_fresh:
            return AbortCause(True, f"{why} (past the grammar library's limits on its own)")
        return AbortCause(False, why, limit=True)

    def past_limits(self, why: str) -> bool:
        """Whether a matcher's error (``dead_end``'s) is one of llguidance's limits, not its constraint's: the
        copies of a template share its lexer's states and their budget, so a constraint's earlier requests used it
        up for the later ones (each failed as a dead end for the worker's life, the template reused). The templates
        are compiled afresh from then on."""
        if "TooComplex" not in why and "too many expressions constructed" not in why:
            return False
        self._templates.clear()
        return True

    @staticmethod
    def dead_end(seq: Sequence) -> str | None:
        """Why the request's matcher can go no further (a schema or pattern no text completes: it met that filling
        the mask), or None."""
        return _said(seq.grammar.get_error()) if seq.grammar.is_error() else None

    @staticmethod
    def is_done(seq: Sequence) -> bool:
        """The constraint is complete and nothing may follow: the request ends as if it sampled EOS."""
        return bool(seq.grammar.is_stopped())
