"""Per-request sampling settings, validated once when the request is submitted."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

# Bounds shared with the job payload (producer/schema.py; tests/test_options.py checks that the two agree).
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # as the OpenAI API
# Below this a temperature is greedy (as vLLM reads it): dividing logits by 1e-50 overflows float32 to inf, and
# the softmax of infs is NaN (token 0 every time).
GREEDY_BELOW = 1e-5
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # a signed 64-bit integer, as OpenAI-shaped APIs (vLLM) take it
MAX_TOKEN_ID = 2**31 - 1  # beyond any vocabulary; ids past the model's own are refused or ignored by the engine
MAX_N = 64  # samples per request: each holds its own KV blocks past the shared prompt
MAX_LOGIT_BIAS = 100.0  # a logit_bias value's bound either way, as the OpenAI API's
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias: each is host work at every step
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# Lists checked at every step of a request: bounded so one request cannot slow every other one's steps.
MAX_STOP_STRINGS = 64  # (OpenAI takes 4)
# A stop string's characters: each new token's text is matched against every tail of every stop string (64 of 15 KB
# held a step 4 s where the output broke a long prefix of them).
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# A grammar, regex or choice's characters: llguidance converts a GBNF grammar in time that grows with the square of
# its size, on the step loop (a 218 KB one took 30 s, every other request stalled).
MAX_CONSTRAINT_CHARS = 32 * 1024
# A JSON schema's text, and each regex it holds (``pattern``, ``patternProperties``' keys): a 3.3 MB pattern of 400k
# alternatives spent 1.7 s of the step loop before llguidance refused it.
MAX_SCHEMA_CHARS = 256 * 1024


@dataclass
class StructuredOutputsParams:
    """Constrain the output, as vLLM's ``StructuredOutputsParams``: exactly one of a JSON schema (``json``, a dict or
    its JSON text), any JSON object (``json_object=True``), a regex, a list of strings to choose from (``choice``)
    or a Lark grammar (``grammar``; GBNF is converted). ``thinking``: a reasoning model's output thinks before the
    constrained part, as vLLM's reasoning parsers let it: ``"first"`` up to ``</think>`` (a ``<think>`` it begins
    with included: DeepSeek-R1, a template that opens ``<think>``), ``"optional"`` in a ``<think>...</think>`` block
    it may begin with (Qwen3); the constrained text follows it at once. For a schema, any object or a choice."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    thinking: str | None = None

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"invalid structured output: {msg}")

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if not isinstance(self.json_object, bool):
            fail(f"json_object must be true or false, got {self.json_object!r}")
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            fail(f"give exactly one of json, json_object, regex, choice, grammar (got {given or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            fail(f"json must be a JSON schema (an object, or its text), got {type(self.json).__name__}")
        if self.json is not None:
            _check_schema_size(self.json, fail)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                fail(f"{name} must be a non-empty string")
            if isinstance(value, str) and len(value) > MAX_CONSTRAINT_CHARS:
                fail(f"{name} has {len(value)} characters; at most {MAX_CONSTRAINT_CHARS} are taken")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            fail("choice must be a non-empty list of non-empty strings")
        if self.choice is not None and sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
            fail(f"choice has more than {MAX_CONSTRAINT_CHARS} characters in all; that many are taken at most")
        if self.thinking not in (None, "first", "optional"):
            fail(f"thinking must be 'first' or 'optional', got {self.thinking!r}")
        if self.thinking is not None and (self.regex is not None or self.grammar is not None):
            fail("thinking goes with a JSON schema, any JSON object or a choice (a grammar or regex says its own)")


@dataclass
class SamplingParams:
    """What to generate and when to stop, shaped like vLLM's ``SamplingParams``.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1 disable those filters; a ``top_k``
    above the vocabulary size keeps the whole vocabulary. ``max_tokens`` is 16 by default, as vLLM's (a job's
    payload leaves it unset, as OpenAI's chat API does); ``None`` generates until EOS, a stop condition or the
    model's context length.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # Per prompt token after the first: its logprob and the top-N of the distribution it was drawn from, as vLLM's
    # prompt_logprobs (for scoring a text). Such a request computes its whole prompt: no prefix cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # A slow (Python) tokenizer's decode puts spaces between special tokens unless told not to; a fast one (the
    # usual) never does, as in vLLM.
    spaces_between_special_tokens: bool = True
    n: int = 1
    # Token id -> a number in [-100, 100] added to its logit before the penalties and the sampling (OpenAI's
    # logit_bias, applied as vLLM does); logprobs stay the model's.
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    # What ``LLMEngine.step`` returns for the request, as vLLM's RequestOutputKind: an output at every step with
    # everything so far ("cumulative"); outputs holding only what is new since the request's last one ("delta":
    # no copies of the whole output, and a step called with ``flush=False`` keeps a running request's new text
    # for a later step; its first and final outputs never wait, and the final one holds everything); or only its
    # final one ("final_only": no per-step output objects to build).
    output_kind: str = "cumulative"
    # A max_tokens past what the context leaves after the prompt: "cut" generates up to the context (finish_reason
    # length, as vLLM's offline LLM); "error" refuses the request, as OpenAI's and vLLM's servers answer 400.
    context_overflow: str = "cut"
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy's numbers as Python's (a sweep from np.linspace was refused: not a float)
            value = getattr(self, f.name, None)
            if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
                setattr(self, f.name, value.item())
        self.stop_strings = _normalise_stop(self.stop)
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"invalid sampling parameter: stop_token_ids must be a list, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"invalid structured output: {exc}") from exc
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("invalid sampling parameter: structured_outputs must be a StructuredOutputsParams or dict")
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"invalid sampling parameter: {msg}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.context_overflow not in ("cut", "error"):
            fail(f"context_overflow must be 'cut' or 'error', got {self.context_overflow!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            fail(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOKEN_ID:
            fail(f"top_k must be -1, 0 (disabled) or a positive integer up to {MAX_TOKEN_ID}, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        penalty = self.repetition_penalty
        if not is_num(penalty) or not math.isfinite(penalty) or penalty <= 0:  # NaN passed "<= 0": NaN logits
            fail(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                fail(f"{name} must be in [-2, 2], got {value!r}")
        if self.seed is not None and (not is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            fail(f"seed must be an integer in [-2**63, 2**63 - 1] or None, got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        prompt = self.prompt_logprobs
        if prompt is not None and (not is_int(prompt) or not 0 <= prompt <= MAX_LOGPROBS):
            fail(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {prompt!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are taken")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            fail(f"stop holds {len(self.stop_strings)} strings; at most {MAX_STOP_STRINGS} are taken")
        if (longest := max((len(s) for s in self.stop_strings if isinstance(s, str)), default=0)) > MAX_STOP_CHARS:
            fail(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are taken")
        for tid in self.stop_token_ids:
            if not is_int(tid) or not 0 <= tid <= MAX_TOKEN_ID:
                fail(f"stop_token_ids must hold integers in [0, {MAX_TOKEN_ID}], got {tid!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
                fail(f"logit_bias names {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are taken")
            for tid, bias in self.logit_bias.items():
                if not is_int(tid) or not 0 <= tid <= MAX_TOKEN_ID:
                    fail(f"logit_bias keys must be token ids, integers in [0, {MAX_TOKEN_ID}], got {tid!r}")
                if not is_num(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # (NaN fails both)
                    fail(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tid}")
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        if any(s == "" for s in self.stop_strings):
            fail("stop strings must not be empty")
        if self.output_kind not in OUTPUT_KINDS:
            fail(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index`` of ``n``: sample 0 uses ``seed`` itself, the others seeds derived from it, so a
        rerun reproduces every sample."""
        if self.seed is None or index == 0:
            return self.seed
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def uses_filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


def _normalise_stop(stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ValueError(f"invalid sampling parameter: stop must be a string or a list of strings, got {stop!r}")


def _check_schema_size(schema: dict | str, fail: Callable[[str], None]) -> None:
    """A JSON schema within ``MAX_SCHEMA_CHARS``, each regex in it within ``MAX_CONSTRAINT_CHARS`` (as a regex of
    its own is): both are compiled on the step loop."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        tree = json.loads(schema) if isinstance(schema, str) else schema
    except (TypeError, ValueError, RecursionError):
        return  # (not JSON: the grammar library says so, as for any schema it cannot read)
    if len(text) > MAX_SCHEMA_CHARS:
        fail(f"json (the schema) has {len(text)} characters; at most {MAX_SCHEMA_CHARS} are taken")
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            patterns = [node.get("pattern"), *(node.get("patternProperties") or {})]
            for pattern in patterns:
                if isinstance(pattern, str) and len(pattern) > MAX_CONSTRAINT_CHARS:
                    fail(f"a pattern in json has {len(pattern)} characters; at most {MAX_CONSTRAINT_CHARS} are taken")
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
