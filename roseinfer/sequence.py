"""One request's state inside the engine: its tokens, how far they have been computed, and its outputs.

Its KV blocks are not here: the KV cache manager keeps every request's block table. Only the scheduler
changes ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from roseinfer.detokenizer import IncrementalDetokenizer
    from roseinfer.outputs import AbortCause


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request being served. ``token_ids`` holds the prompt followed by every generated token."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        generator: torch.Generator | None,
        prompt: str | None = None,
        output_prefix: list[int] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        # A resumed request's output starts with the tokens an earlier attempt generated: they are computed with
        # the prompt in its prefill and count as output (max_tokens, min_tokens, penalties); only the rest is sampled.
        self.token_ids: list[int] = list(prompt_token_ids) + list(output_prefix or ())
        self.num_prompt_tokens = len(prompt_token_ids)
        self._prompt_token_ids: list[int] | None = None  # the prompt as a list of its own, made once
        self.num_resumed_tokens = len(output_prefix or ())
        self.priority = priority  # lower runs first (as in vLLM)
        # Sample ``index`` of a request with n > 1 (request_id is then the request's id with "[index]"): the others
        # wait for ``leader`` (sample 0) to hold its prompt's blocks, then share them through the prefix cache.
        self.parent_id = request_id
        self.index = 0
        self.leader: Sequence | None = None
        self.arrival_order = 0  # set by the scheduler: ties between equal priorities go to the earlier request
        self.params = params
        self.detokenizer = detokenizer
        self.generator = generator
        # The structured-output matcher (llguidance's LLMatcher), fed every output token; None when unconstrained.
        self.grammar: Any = None
        self.grammar_fresh = False  # its matcher came of a template compiled for it (``StructuredOutputManager``)
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V sit in the cache (computed here or found in the prefix cache); set by the scheduler.
        self.num_computed_tokens = 0
        # Of those, how many came from the prefix cache at admission.
        self.num_cached_tokens = 0
        # Chained hashes of the full blocks of token_ids: a cache of their content, filled lazily by the KV
        # cache manager (tokens are only appended, so they stay valid across preemptions).
        self.block_hashes: list[bytes] = []
        # Longer than a LongRoPE model's original length (set by the scheduler): every token rotates by the long
        # factors, so its blocks' K differ from a shorter request's with the same tokens (they hash from another root).
        self.long_rope = False
        self.num_preemptions = 0
        # Bumped whenever its blocks are freed for a rebuilt table (a preemption, a failed step's undone admission):
        # the CUDA-graph runner's kept copy of a table belongs to one epoch of it.
        self.table_epoch = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.abort_cause: AbortCause | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Output kind "delta": the sum of the first ``logprobs_summed`` logprobs, the running total its outputs carry.
        self.logprob_sum = 0.0
        self.logprobs_summed = 0
        # Per prompt token, as vLLM's prompt_logprobs: None for the first (nothing comes before it), then each
        # one's logprob and the top alternatives; filled as its prefill runs. None when not asked for.
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # params.logit_bias as (token ids, biases) on the sampler's device: made at the first step that needs it.
        self.logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
        # The prompt as an int64 CPU tensor, for the CPU sampling kernel's repetition penalty: made once, not
        # flattened from a list at every step (a long prompt's were most of the step's sampling time).
        self.prompt_ids: torch.Tensor | None = None
        # Output kind "delta": whether an output went out yet, and the tokens sampled since the last one.
        self.streamed = False
        self.held_ids: list[int] = []
        self.arrival_time = time.perf_counter()
        # When the scheduler first gave it a step (time.monotonic()): a job's timeout counts from there, not its wait.
        self.first_scheduled_time: float | None = None
        self.first_scheduled_at_step = False  # set by the last schedule (a step that never ran takes it back)
        # Time spent waiting again after a preemption (and since when, while it waits): not the job's running time.
        self.preempted_s = 0.0
        self.preempted_at: float | None = None
        self.admission_hit_tokens = 0  # the prefix hit its admission counted in the hit-rate stats
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens' logprobs are still to come: the prefill computes them, so it takes no cache hit."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (one list for the request's life: every output shares it, as vLLM's do)."""
        if self._prompt_token_ids is None:
            self._prompt_token_ids = self.token_ids[: self.num_prompt_tokens]
        return self._prompt_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
