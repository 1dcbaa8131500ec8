"""A reasoning model's thinking, told from its answer (``--reasoning-parser``, named as vLLM's parsers of the same
formats); the chat's ``reasoning`` field holds it (and ``reasoning_content``, its older name, which clients still
read):

- ``deepseek_r1``: everything before ``</think>`` (a ``<think>`` it begins with left out) is the reasoning, the
  rest the answer; an output without ``</think>`` is reasoning alone (cut short while thinking). DeepSeek-R1 and its
  distillations, and templates that open ``<think>`` in the prompt (Qwen3's thinking-only models, QwQ);
- ``qwen3``: an output that begins with ``<think>`` reasons up to ``</think>``; one that does not is all answer
  (Qwen3 with ``enable_thinking`` false, whose template closes the thinking in the prompt);
- ``mistral``: as ``qwen3``, with ``[THINK]`` and ``[/THINK]`` (Magistral, which thinks where its system prompt
  asks it to).

Streamed, text goes to the reasoning or the answer as it comes, never a piece of a marker. No HTTP, no Redis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from producer.tool_formats import held_back


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    opened: bool  # the output reasons from its start (the template opened <think>), not only after one
    start: str = "<think>"
    end: str = "</think>"
    special: bool = False  # the markers are special tokens, which a job's text leaves out unless told to keep them

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's reasoning and answer (None: none)."""
        if not text:  # (no output at all: an empty answer, not an empty thought)
            return None, text
        body = text.lstrip()
        began = body.startswith(self.start)
        if began:
            text = body[len(self.start) :]
        elif not self.opened:
            return None, text
        reasoning, end, answer = text.partition(self.end)
        return reasoning, (answer or None) if end else None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


THINKING_CONSTRAINTS = ("json", "json_object", "choice")  # the constraints a thought may come before


def plan_for(fmt: ReasoningFormat | None, constraint: str | None) -> ReasoningFormat | None:
    """The format that tells an output's thinking from its answer, under ``constraint`` (its kind: json,
    json_object, regex, choice, grammar; None: none). A constrained output thinks before its constraint (the job's
    ``thinking``) where the constraint is JSON or a choice and the markers are text; under any other it is
    constrained from its first token, and has no thinking."""
    if fmt is None or constraint is None:
        return fmt
    return fmt if constraint in THINKING_CONSTRAINTS and not fmt.special else None


def job_fields_of(fmt: ReasoningFormat | None, constrained: bool) -> dict[str, object]:
    """What a job read by ``fmt`` asks of the worker (the server's chats and batch's rows alike): ``thinking``
    before its constraint ("first" where the output reasons from its start), and its special tokens kept where the
    markers are some (vLLM's mistral parser)."""
    if fmt is None:
        return {}
    fields: dict[str, object] = {"thinking": "first" if fmt.opened else "optional"} if constrained else {}
    return {**fields, "skip_special_tokens": False} if fmt.special else fields


FORMATS = {
    f.name: f
    for f in (
        ReasoningFormat("deepseek_r1", opened=True),
        ReasoningFormat("qwen3", opened=False),
        ReasoningFormat("mistral", opened=False, start="[THINK]", end="[/THINK]", special=True),
    )
}
REASONING_PARSERS = tuple(FORMATS)


@dataclass
class ReasoningStream:
    """One choice's output, piece by piece, as its reasoning and its answer."""

    format: ReasoningFormat
    _held: str = ""
    _state: str = "start"  # start (what it begins with is not known yet), reasoning, answer

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text the next piece of output lets out."""
        self._held += text
        fmt = self.format
        if self._state == "start":
            body = self._held.lstrip()
            if fmt.start.startswith(body):  # (white space, or what may begin <think>: held)
                return "", ""
            if body.startswith(fmt.start):
                self._held, self._state = body[len(fmt.start) :], "reasoning"
            else:
                self._state = "reasoning" if fmt.opened else "answer"
        if self._state == "answer":
            answer, self._held = self._held, ""
            return "", answer
        reasoning, end, answer = self._held.partition(fmt.end)
        if end:
            self._held, self._state = "", "answer"
            return reasoning, answer
        keep = held_back(self._held, (fmt.end,))
        reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What the output's end lets out: text held back."""
        held, self._held = self._held, ""
        if self._state == "start":  # (the output was white space, or a piece of <think>)
            reasoning, answer = self.format.split(held)
            self._state = "reasoning" if answer is None else "answer"
            return reasoning or "", answer or ""
        return (held, "") if self._state == "reasoning" else ("", held)

    @property
    def answering(self) -> bool:
        """The output is past its thinking (or had none): its answer has begun, though it may be empty."""
        return self._state == "answer"


def reasoning_tokens(fmt: ReasoningFormat | None, text: str, token_ids: list[int], tokenizer: Any) -> int:
    """How many of an output's tokens are its thinking (OpenAI's ``reasoning_tokens``, vLLM's count): those after
    its start marker (where the output opens with one) and before its end marker, found by decoding growing
    prefixes of its ids with ``tokenizer`` (the text alone does not say where a token ends); 0 without one."""
    if fmt is None or tokenizer is None or not token_ids or not fmt.split(text)[0]:
        return 0
    decoded = lambda k: tokenizer.decode(token_ids[:k], skip_special_tokens=False)  # noqa: E731
    whole = decoded(len(token_ids))

    def tokens_to(chars: int) -> int:  # the fewest leading tokens whose text reaches ``chars`` characters
        lo, hi = 0, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if len(decoded(mid)) >= chars else (mid + 1, hi)
        return lo

    began = whole.find(fmt.start) if text.lstrip().startswith(fmt.start) else -1
    thought_from = began + len(fmt.start) if began >= 0 else 0
    ends = whole.find(fmt.end, thought_from)
    first = tokens_to(thought_from) if began >= 0 else 0
    last = len(token_ids) if ends < 0 else tokens_to(ends + 1) - 1  # (the token that reaches into the end marker)
    return max(0, last - first)
