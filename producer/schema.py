"""The job payload, shared by producers and the worker (pydantic only: no torch, no transformers)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NonNegInt = Annotated[int, Field(ge=0)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class JobRequest(BaseModel):
    """One generation job. Field names follow the OpenAI API; unknown fields are refused.

    ``max_tokens=None`` generates until EOS, a stop string or the model's context length.
    ``logprobs`` takes the Completions form (an int, top-N per token) or the Chat form (``true`` with
    ``top_logprobs``).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: NonNegInt = 0
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    seed: NonNegInt | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    ignore_eos: bool = False
    custom_id: str | None = Field(default=None, max_length=512)
    metadata: dict[str, Any] | None = None

    @field_validator(
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", mode="before"
    )
    @classmethod
    def _int_is_a_float(cls, value: Any) -> Any:
        # strict mode refuses 1 for a float field; JSON writers often send it that way.
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value: bool | int | None) -> bool | int | None:
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 20:
            raise ValueError("logprobs must be true/false or an integer in [0, 20]")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("the prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def num_logprobs(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:
            return self.top_logprobs or 0
        return self.logprobs

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt in the form ``LLMEngine.add_request`` takes."""
        if self.messages is not None:
            return {"messages": [m.model_dump() for m in self.messages]}
        return {"prompt": self.prompt}

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``roseinfer.SamplingParams``."""
        return {
            "max_tokens": self.max_tokens,
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
            "ignore_eos": self.ignore_eos,
        }


def describe_validation_error(exc: Exception) -> str:
    """One readable line per problem: ``max_tokens: Input should be greater than or equal to 1``."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for err in errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "payload"
        msg = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)
