"""The protocol's outputs as models: a token event and a job's result. Their JSON Schemas (and the job payload's)
are shipped in ``docs/schemas/`` for producers in other languages; ``python -m producer.write_schemas`` writes
them, and a test fails when the shipped files drift from these models."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer.protocol import PROTOCOL_VERSION
from producer.schema import JobRequest

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "docs" / "schemas"
FinishReason = Literal["stop", "length", "abort", "error"]
SampleFinishReason = Literal["stop", "length", "abort"]  # (an error ends the job, never one sample of it)
ErrorType = Literal["invalid_request", "timeout", "server_error"]
ERROR_TYPE_DOC = (
    "with an error: whose fault it was. invalid_request: the job itself (its payload, a prompt too long), it would "
    "fail again; timeout: it ran past its timeout; server_error: the worker or engine failed it. Absent: RQ failed "
    "the job (an abandoned job, say)"
)


ErrorCode = Literal["context_length_exceeded"]
ERROR_CODE_DOC = (
    "with some errors: what it was, for a client to act on. context_length_exceeded: the prompt (or the prompt plus "
    "max_tokens, for a job with context_overflow 'error') is past the model's context; OpenAI's code for it"
)


class PromptTokensDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cached_tokens: int = Field(0, ge=0, description="the prompt's tokens the prefix cache held, not computed again")


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    total_tokens: int = Field(0, ge=0)
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="on a job's last event and its result (OpenAI's field); absent on a job failed before it ran"
    )


def _v_required(schema: dict) -> None:
    """``v`` in the schema's required fields: every event and result carries it (a reader may rely on it; the
    default is for reading what was written before it existed)."""
    schema["required"] = ["v", *(name for name in schema.get("required", []) if name != "v")]


class StreamEvent(BaseModel):
    """One event: a pub/sub message on ``roseinfer:tokens:<id>``, and the ``event`` field of an entry of
    ``roseinfer:stream:<id>`` (the same JSON)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_v_required)

    v: int = Field(PROTOCOL_VERSION, description="protocol version")
    n: int = Field(ge=0, description="0, 1, 2, ... within the job, with no gap")
    text: str = Field(description="the new piece of text: one or more tokens' worth")
    token_ids: list[int] = Field(description="the token ids the piece came from")
    finish_reason: FinishReason | None = Field(None, description="on the last event only")
    usage: Usage | None = Field(
        None,
        description="on the last event; on every event of a job asking stream_options.continuous_usage_stats (the "
        "prompt's tokens and the tokens generated until then, all samples)",
    )
    error: str | None = Field(None, description="on a last event with finish_reason 'error'")
    error_type: ErrorType | None = Field(None, description=ERROR_TYPE_DOC)
    error_code: ErrorCode | None = Field(None, description=ERROR_CODE_DOC)
    reset: bool | None = Field(
        None, description="true: the output starts over here; drop the text and token ids of every earlier event"
    )
    index: int | None = Field(None, ge=0, description="the sample the piece belongs to (a job with n > 1); absent: 0")
    sample_finish_reason: SampleFinishReason | None = Field(
        None, description="a job with n > 1: sample ``index`` ended with this piece (its own reason); the job goes on"
    )
    stop_reason: int | str | None = Field(
        None,
        description="with finish_reason or sample_finish_reason 'stop': the stop string or token id that ended "
        "the output (vLLM's); absent for EOS",
    )
    logprobs: list[list[list[float]]] | None = Field(
        None, description="a job asking for logprobs: per token id of this event, [[token_id, logprob], ...]"
    )


class Timings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enqueued_at: float = Field(description="Unix time, seconds")
    started_at: float = Field(description="Unix time, seconds")
    first_token_at: float | None = Field(description="Unix time, seconds")
    finished_at: float = Field(description="Unix time, seconds")
    queue_s: float = Field(description="seconds from enqueued to started")
    ttft_s: float | None = Field(description="seconds from enqueued to the first token")
    total_s: float = Field(description="seconds from enqueued to finished")


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    logprobs: list[list[list[float]]] | None = None


class JobResult(BaseModel):
    """The ``return_value`` of the latest entry of ``rq:results:<id>`` (JSON in base64; RQ's
    ``job.return_value()`` for a finished job, ``job.latest_result().return_value`` for any). A failed job's result
    has ``error`` and no text; a job canceled before it ran, too (status ``canceled``), but for what the attempts
    before it streamed (a job canceled while it waited for its retry)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_v_required)

    v: int = Field(PROTOCOL_VERSION, description="protocol version")
    id: str
    custom_id: str | None = None
    status: Literal["finished", "canceled", "failed"]
    finish_reason: FinishReason
    model: str | None = None
    system_fingerprint: str | None = Field(
        None,
        description="the worker's backend beside the model: roseinfer's version, device kind, dtype, quantization "
        "and -f32gemm where bfloat16 layers multiply in float32 (OpenAI's field); a seeded job may be written "
        "differently where it differs",
    )
    text: str | None = None
    token_ids: list[int] | None = None
    stop_reason: str | int | None = Field(None, description="the stop string or stop token id that ended it")
    usage: Usage | None = None
    timings: Timings | None = None
    logprobs: list[list[list[float]]] | None = Field(None, description="per token: [[token_id, logprob], ...]")
    prompt: str | None = Field(
        None, description="the prompt's text (a chat's as its template made it), with prompt_logprobs"
    )
    prompt_token_ids: list[int] | None = Field(None, description="the prompt's token ids, with prompt_logprobs")
    prompt_logprobs: list[list[list[float]] | None] | None = Field(
        None, description="per prompt token, null for the first: [[token_id, logprob], ...], the token's own last"
    )
    choices: list[Choice] | None = Field(None, description="a job with n > 1: every sample, sample 0 first")
    metadata: dict[str, Any] | None = None
    error: str | None = None
    error_type: ErrorType | None = Field(None, description=ERROR_TYPE_DOC)
    error_code: ErrorCode | None = Field(None, description=ERROR_CODE_DOC)


def read_check(model: type[BaseModel], value: dict[str, Any]) -> None:
    """Raise ``ValidationError`` where ``value`` breaks ``model``'s schema, fields it does not know aside: a newer
    worker adds fields within a protocol version (``error_code`` came so), and clients and workers deployed before
    it go on reading its events and results, as OpenAI's clients read responses with new fields. The schemas'
    ``additionalProperties: false`` says what this version writes."""
    try:
        model.model_validate(value)
    except ValidationError as exc:
        if not all(error["type"] == "extra_forbidden" for error in exc.errors()):
            raise


def schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema, for the job payload, a token event and a result."""
    return {
        "job-payload.schema.json": JobRequest.model_json_schema(),
        "event.schema.json": StreamEvent.model_json_schema(),
        "result.schema.json": JobResult.model_json_schema(),
    }


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_schemas(folder: Path = SCHEMA_DIR) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        (folder / name).write_text(render(schema))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m producer.write_schemas",
        description="Write the protocol's JSON Schemas (job payload, event, result).",
    )
    parser.add_argument("folder", nargs="?", type=Path, default=SCHEMA_DIR, help=f"where to (default: {SCHEMA_DIR})")
    write_schemas(parser.parse_args(argv).folder)


if __name__ == "__main__":
    main()
