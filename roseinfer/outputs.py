"""What the engine hands back, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AbortCause:
    """What ended a sample the engine aborted on its own. ``dead_end``: its constraint can go no further whatever
    is sampled (a schema or pattern no text completes: the request's fault); else the constraint refused the token
    the model produced (the grammar library and the tokenizer disagree: the server's)."""

    dead_end: bool
    why: str
    limit: bool = False  # the grammar library's own limits, not its constraint's: the server's, worth a retry


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None
    # Why the engine aborted it itself (its structured output's dead end, or a token that output refused); None else.
    abort_cause: AbortCause | None = None
    # A delta output's: the sample's logprobs summed so far, not its delta's alone (vLLM's). None: sum token_ids'.
    running_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The logprobs of the sample's tokens so far, summed (vLLM's); None where no logprobs were asked for."""
        if self.logprobs is None:
            return None
        if self.running_logprob is not None:
            return self.running_logprob
        return sum(step.get(token, float("nan")) for token, step in zip(self.token_ids, self.logprobs))


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n > 1: the advancing sample's while running, every sample once finished
    finished: bool
    # What this step added: the text now safe to show and the token ids sampled, for the sample ``delta_index``
    # (always 0 with n = 1; a step that advances several samples of one request gives one output for each).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_index: int = 0
    metrics: RequestMetrics | None = None
    # As vLLM's: per prompt token, None for the first, then its logprob and the top alternatives; None when the
    # request did not ask for them (prompt_logprobs).
    prompt_logprobs: list[dict[int, float] | None] | None = None
