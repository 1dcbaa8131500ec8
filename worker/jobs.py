"""What a roseinfer job is: its payload checks, its seed, its result; and the job function itself.

``generate`` is a real function so that a stock ``rq worker -S json roseinfer`` can still run jobs one at a
time (slowly, as a fallback); ``roseinfer worker`` runs many at once in one engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import ValidationError
from rq.defaults import DEFAULT_RESULT_TTL
from rq.job import Job
from rq.queue import Queue
from rq.timeouts import JobTimeoutException

from producer.protocol import (
    JOB_FUNCTION,
    OWNER_FIELD,
    PROTOCOL_VERSION,
    encode_logprobs,
    installed_version,
    model_identity,
    usage_of,
)
from producer.schema import JobRequest, describe_validation_error
from roseinfer.config import quantization_name

if TYPE_CHECKING:
    from roseinfer.llm_engine import LLMEngine
    from roseinfer.outputs import RequestOutput
    from worker.publisher import JobStream


class JobRejected(Exception):
    """The job can never run (bad payload, prompt too long, ...): it fails at once and is not retried."""


class StepFailed(Exception):
    """An engine step raised: the jobs it ran fail (and are retried where their policy allows)."""


class JobStopped(Exception):
    """The job was stopped on request while it ran."""


class JobTimedOut(JobTimeoutException):
    """The job ran past its timeout: RQ's class, so that a failure callback or an exception handler matching it
    sees RQ's. Its own ``__init__``: RQ's timer death penalty rewrites the message of the class it raises, for good."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)


def run_limit(job: Job, default: int) -> int | None:
    """The seconds the job may run, as RQ's worker reads them: no timeout (or 0) is the queue's default, one below
    zero runs unlimited (None)."""
    limit = job.timeout or default
    return limit if limit > 0 else None


def check_size(job: Job, max_bytes: int | None) -> None:
    """JobRejected for a job whose stored data is past ``max_bytes`` (the worker's --max-job-bytes)."""
    if max_bytes is not None and len(job.data or b"") > max_bytes:
        raise JobRejected(f"the job's data is {len(job.data)} bytes; this worker takes at most {max_bytes}")


def parse_request(job: Job, max_bytes: int | None = None) -> JobRequest:
    """The job's payload, checked; JobRejected with a readable reason otherwise. ``max_bytes`` bounds the stored
    data before it is parsed, so a 10 MB prompt is refused before anything tokenizes it."""
    check_size(job, max_bytes)
    try:
        func_name = job.func_name
        instance, args, kwargs = job.instance, job.args, job.kwargs
    except Exception as exc:  # DeserializationError, or a payload of the wrong shape
        if _raised_from(exc, RecursionError):  # JSON, but nested past what the parser reads
            raise JobRejected("the job's data is JSON nested too deeply to read") from exc
        if (job.data or b"").startswith(b"\x1f\x8b"):  # (gzip's mark: Node's gzipSync, Python's gzip module)
            raise JobRejected(
                "the job's data is gzip: compress it with zlib's own format (RFC 1950: Python's zlib.compress, "
                "Node's zlib.deflateSync), or write it as plain JSON"
            ) from exc
        if _raised_from(exc, UnicodeDecodeError) and not (job.data or b"").startswith(b"\x80"):  # (pickle's mark)
            raise JobRejected("the job's data is not UTF-8 text (JSON is): write it as UTF-8") from exc
        raise JobRejected(
            "the job's data is not a JSON [function, null, args, kwargs] list (was it enqueued with "
            "the pickle serializer? roseinfer jobs use rq's JSONSerializer)"
        ) from exc
    if func_name != JOB_FUNCTION:
        raise JobRejected(f"this worker runs only {JOB_FUNCTION} jobs, not {func_name!r}")
    if instance is not None:  # (RQ would call a method of it)
        raise JobRejected("the job's data names an instance (its second element): a roseinfer job has null there")
    if not isinstance(args, (list, tuple)) or args:  # ([] as docs/protocol.md has it: {} or 0 read as none)
        raise JobRejected(
            f"pass the payload as keyword arguments: the job's data has [] as its third element, not {_shown(args)}"
        )
    if not isinstance(kwargs, dict):
        raise JobRejected("the job's keyword arguments must be a JSON object")
    try:
        return JobRequest.model_validate(kwargs)
    except ValidationError as exc:
        raise JobRejected(f"invalid job payload: {describe_validation_error(exc)}") from None


def _shown(value: object) -> str:
    """A value of a job's data, as JSON (what its writer wrote), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _raised_from(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is a ``kind``, or was raised from or while handling one (RQ wraps what its serializer raised)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def job_seed(job_id: str) -> int:
    """A seed for a sampled job that has none: fixed per job, so a retried job regenerates the same tokens."""
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "little") >> 1


def sampling_params(job_id: str, req: JobRequest, defaults: dict[str, Any] | None = None):
    """The engine's parameters for the job: its payload's, with ``defaults`` (the model's recommended settings,
    ``LLMEngine.sampling_defaults``) for the fields it does not set, as vLLM's server takes them."""
    from roseinfer.sampling_params import SamplingParams

    # Deltas: a step builds no copy of a job's whole output, and the step loop asks for them only when it sends.
    kwargs = {**req.sampling_kwargs(), "output_kind": "delta"}
    # (a null, max_tokens', is unset, as the producers send it and as vLLM takes it)
    unset = {k for k in defaults or {} if k not in req.model_fields_set or getattr(req, k, None) is None}
    kwargs.update({k: v for k, v in (defaults or {}).items() if k in unset})
    if kwargs["seed"] is None and kwargs["temperature"] > 0:
        kwargs["seed"] = job_seed(job_id)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise JobRejected(str(exc)) from None


def resume_from(stream: JobStream, params: Any) -> tuple[list[int], list[dict[int, float]] | None]:
    """Plan a job's attempt from its stream (``JobStream.start``): the output prefix to resume from and its
    logprobs (for a job asking for them), or nothing. The samples of a job with n > 1 start over together."""
    wants = params.logprobs is not None
    prefix = stream.start(can_resume=params.n == 1, with_logprobs=wants)
    return prefix, stream.resume_logprobs if prefix and wants else None


def usage(out: RequestOutput) -> dict[str, Any]:
    """An ended job's (each sample's tokens together, the prompt's cached tokens once)."""
    cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
    return usage_of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), cached)


def result_bytes(out: RequestOutput | None) -> int:
    """About how many bytes an ended job's result takes in Redis, from its output, without encoding it (100 MB of
    JSON took a second of the step loop): its text, token ids and logprobs (each logprob entry ~30 bytes as JSON),
    in base64 as RQ stores a return value. An upper bound within a factor of ~1.5."""
    size = sum(_json_bytes(c.text, c.token_ids, c.logprobs) for c in out.outputs) if out is not None else 0
    size += _json_bytes("", [], [step for step in getattr(out, "prompt_logprobs", None) or () if step])
    return size * 4 // 3


def piece_bytes(text: str, token_ids: list[int], logprobs: list | None) -> int:
    """``result_bytes`` of a piece of output (an event's): what it adds to its job's result."""
    return _json_bytes(text, token_ids, logprobs) * 4 // 3


def _json_bytes(text: str, token_ids: list[int], logprobs: list | None) -> int:
    """About the JSON bytes of text, token ids and logprobs (each logprob entry ~30 bytes)."""
    return 2 * len(text) + 8 * len(token_ids) + 32 * sum(len(step) for step in logprobs or ())


def system_fingerprint(settings: Any, numerics: str = "") -> str:
    """What a seeded job's text depends on beside the model (OpenAI's ``system_fingerprint``): roseinfer's version,
    the device kind, the dtype, the quantization and the engine's ``numerics`` (bfloat16 layers multiplied in
    float32 on a CPU: ``f32gemm``), e.g. ``roseinfer-0.1.0-cpu-bfloat16-int8``. Workers whose fingerprints differ
    may write different text for the same seeded job."""
    device = settings.device.split(":")[0]
    parts = ("roseinfer", installed_version(), device, settings.dtype, quantization_name(settings), numerics)
    return "-".join(part for part in parts if part)


def build_result(
    job: Job,
    req: JobRequest,
    out: RequestOutput,
    *,
    model: str,
    started_at: float,
    first_token_at: float | None,
    finished_at: float | None = None,
    canceled: bool = False,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The job's result: the return value of its entry in RQ's result stream (``job.return_value()``).
    ``finished_at``: when its last event came out of the engine (default: now). ``canceled``: the job was canceled
    or stopped, whatever its samples' ends (with n > 1 sample 0 may have ended before: its own stays in
    ``choices``)."""
    c = out.outputs[0]
    canceled = canceled or c.finish_reason == "abort"
    finished_at = finished_at or time.time()
    # (the producer's clock, ahead of the worker's: counted from the start, not a negative wait)
    enqueued_at = min(job.enqueued_at.timestamp(), started_at) if job.enqueued_at else started_at
    result: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "id": job.id,
        "custom_id": req.custom_id,
        "status": "canceled" if canceled else "finished",
        "model": model,
        **({"system_fingerprint": fingerprint} if fingerprint else {}),
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": "abort" if canceled else c.finish_reason,
        "stop_reason": None if canceled else c.stop_reason,
        "usage": usage(out),
        "timings": {  # to the microsecond, as RQ's own stamps: the digits past it cost Redis bytes for a day
            "enqueued_at": round(enqueued_at, 6),
            "started_at": round(started_at, 6),
            "first_token_at": None if first_token_at is None else round(first_token_at, 6),
            "finished_at": round(finished_at, 6),
            "queue_s": round(started_at - enqueued_at, 6),
            "ttft_s": None if first_token_at is None else round(first_token_at - enqueued_at, 6),
            "total_s": round(finished_at - enqueued_at, 6),
        },
    }
    if c.logprobs is not None:
        result["logprobs"] = encode_logprobs(c.logprobs)
    if out.prompt_logprobs is not None:  # (the first token's is None: nothing comes before it)
        result["prompt"] = out.prompt
        result["prompt_token_ids"] = list(out.prompt_token_ids)
        result["prompt_logprobs"] = [None, *encode_logprobs(out.prompt_logprobs[1:])]
    if req.metadata is not None:
        result["metadata"] = req.metadata
    if len(out.outputs) == 1:
        return result  # one sample: the result's own fields are it (stored once: Redis keeps every byte a day)
    # Every sample, sample 0 first (its text and token ids are also the result's own; its end too, unless canceled).
    result["choices"] = [
        {
            "index": s.index,
            "text": s.text,
            "token_ids": list(s.token_ids),
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
            **({"logprobs": encode_logprobs(s.logprobs)} if s.logprobs is not None else {}),
        }
        for s in out.outputs
    ]
    return result


_ENGINE: LLMEngine | None = None


def _engine() -> LLMEngine:
    global _ENGINE
    if _ENGINE is None:
        from roseinfer import LLM
        from worker.settings import WorkerSettings

        settings = WorkerSettings()
        _ENGINE = LLM(settings.model, **settings.engine_options()).engine
    return _ENGINE


_IDENTITY: dict[tuple[str, int], str] = {}  # (model, id of the engine) -> its MODEL_FIELD


def _identity(model: str, engine: Any) -> str:
    """The stock path's ``MODEL_FIELD``, as a batch worker's: computed once for its engine."""
    key = (model, id(engine))
    if key not in _IDENTITY:
        _IDENTITY[key] = model_identity(model, getattr(engine, "tokenizer_json", lambda: None)())
    return _IDENTITY[key]


ALARM_MARGIN_S = 2.0  # how long before RQ's alarm a stock worker's job ends at its timeout (a step's length), at most


def _running_worker() -> Any:
    """The RQ worker running this job, found up the call stack (RQ hands a job no handle on it), or None: through
    its ``_stopped_job_id`` RQ ends a job as stopped (not retried, not failed), and its stop-job command says so."""
    from rq.worker import BaseWorker

    frame = sys._getframe(1)
    while frame is not None:
        worker = frame.f_locals.get("self")
        if isinstance(worker, BaseWorker) and hasattr(worker, "_stopped_job_id"):
            return worker
        frame = frame.f_back
    return None


def generate(*args: Any, **payload: Any) -> dict[str, Any]:
    """One job on its own, for a stock RQ worker: streams and stores results like ``roseinfer worker`` (the same
    pump drives the engine; events are sent after each step). A job canceled while it runs stops within a step,
    its stream ended "abort", and ends as RQ's stopped job (RQ's own worker would run it to its end)."""
    from rq import get_current_job

    from worker.job_start import forget_earlier_jobs_stream, ran_on_another_model
    from worker.publisher import Publisher
    from worker.pump import Pump
    from worker.settings import WorkerSettings

    began = time.monotonic()  # (RQ's alarm for the job's timeout was set just before)
    job = get_current_job()
    if job is None:
        raise RuntimeError("worker.jobs.generate runs inside an RQ job")
    settings = WorkerSettings()
    rq_worker = _running_worker()  # (RQ's stop-job command reaches a SimpleWorker's job through it: no horse to kill)
    # RQ's 500 s otherwise (the protocol's default is the worker's --result-ttl), unless `rq worker --results-ttl`
    if job.result_ttl is None and getattr(rq_worker, "default_result_ttl", DEFAULT_RESULT_TTL) == DEFAULT_RESULT_TTL:
        job.result_ttl = settings.result_ttl
    publisher = Publisher.from_settings(settings)
    notify = payload.get("notify") if isinstance(payload.get("notify"), str) else None
    # This attempt owns the job now: a batch worker that stalled on it drops its copy without writing.
    job.connection.hset(job.key, OWNER_FIELD, f"stock:{uuid.uuid4().hex}")
    forget_earlier_jobs_stream(job.connection, job)  # (not resumed: another job's output)
    stream = publisher.resume(job.connection, [job.id])[job.id]

    def refuse(error: str) -> NoReturn:
        publisher.add(stream, "", [], "error", {}, error, error_type="invalid_request")  # as the batch worker's
        with job.connection.pipeline(transaction=False) as pipe:
            publisher.flush(pipe)
            publisher.notify(pipe, job.id, notify)  # (as every end: a waiter on the list learns of it)
            pipe.execute()
        job.retries_left = None  # RQ reads it as it fails the job: one that can never run is not tried again
        raise JobRejected(error) from None

    if args:  # (Python refused the call before this body ran: retried, a bare TypeError, no last event)
        refuse("pass the payload as keyword arguments: enqueue('worker.jobs.generate', prompt=..., max_tokens=...)")
    try:
        check_size(job, settings.max_job_bytes)  # (as the batch worker's: a prompt of 10 MB is not tokenized)
        req = JobRequest.model_validate(payload)
    except JobRejected as exc:
        refuse(str(exc))
    except ValidationError as exc:
        refuse(f"invalid job payload: {describe_validation_error(exc)}")
    stream.usage_each_event = req.usage_each_event
    engine = _engine()
    try:
        params = sampling_params(job.id, req, engine.sampling_defaults)
    except JobRejected as exc:  # (what the engine refuses: a schema past its bounds; it was retried, without a word)
        refuse(str(exc))
    if ran_on_another_model(job.connection, job, _identity(settings.model, engine)):  # (its output is not ours)
        stream.whole = False
    prefix, prefix_logprobs = resume_from(stream, params)
    pump = Pump(engine, tokenize_in_thread=False)
    # The pump ends the job at its timeout itself, between steps, ahead of RQ's alarm: the alarm interrupted a step,
    # which failed as a broken step ("server_error", retried), not a timeout, and one landing between steps wrote
    # no last event.
    limit = run_limit(job, Queue.DEFAULT_TIMEOUT)
    margin = None if limit is None else min(ALARM_MARGIN_S, limit / 4)  # (a 2 s job kept 1.5 s of its own)
    timeout = None if limit is None else max(limit - (time.monotonic() - began) - margin, 0.001)
    pump.submit(job.id, req.engine_prompt(), params, timeout, output_prefix=prefix, prefix_logprobs=prefix_logprobs)
    started_at, first_token_at, final, canceled = time.time(), None, None, False
    try:
        while final is None and not canceled:
            for event in pump.step():
                first_token_at = first_token_at or (time.time() if event.token_ids else None)
                if event.restarted:
                    stream.restart()
                if event.finished:
                    final = event
                else:
                    publisher.add(
                        stream, event.text, event.token_ids, index=event.index, logprobs=event.logprobs,
                        sample_end=event.sample_end, prompt_tokens=event.prompt_tokens, stop_reason=event.stop_reason,
                    )  # fmt: skip
            if final is None:
                with job.connection.pipeline(transaction=False) as pipe:
                    publisher.flush(pipe)
                    pipe.hget(job.key, "status")
                    canceled = pipe.execute()[-1] == b"canceled"  # (RQ's cancel, or a client's: read each step)
                canceled = canceled or (rq_worker is not None and rq_worker._stopped_job_id == job.id)
    finally:  # a Redis error, RQ's timeout: the engine (kept for the next job, where RQ does not fork) lets it go
        ended = pump.cancel(job.id)
    if canceled:
        *pieces, last = ended or [None]
        for piece in pieces:
            publisher.add(stream, piece.text, piece.token_ids, index=piece.index, logprobs=piece.logprobs)
        made = usage(last.output) if last is not None and last.output is not None else usage_of(0, 0)
        text, ids = (last.text, last.token_ids) if last is not None else ("", [])
        publisher.add(stream, text, ids, "abort", made, index=last.index if last is not None else 0,
                      logprobs=last.logprobs if last is not None else None)  # fmt: skip
        with job.connection.pipeline(transaction=False) as pipe:
            publisher.flush(pipe)
            publisher.notify(pipe, job.id, req.notify)
            pipe.execute()
        job.retries_left = None
        if rq_worker is None:
            raise JobRejected("job canceled by request while it ran")
        stopped = rq_worker._stopped_job_id == job.id
        rq_worker._stopped_job_id = job.id  # (RQ ends it as a stopped job)
        # RQ reaches a job stopped this way through its failure path, which runs the failure callback: the stopped
        # one is run here instead, as RQ's own end of a stop runs it (and as the batch worker does).
        from rq.callbacks import execute_stopped_callback

        job._failure_callback = None
        with contextlib.suppress(Exception):  # (RQ logged it, with its traceback)
            execute_stopped_callback(job, rq_worker.death_penalty_class)
        raise JobStopped("job stopped by a stop-job command" if stopped else "job canceled by request while it ran")
    if final.finish_reason != "error" and (size := result_bytes(final.output)) > settings.max_result_bytes:
        final.finish_reason, final.error_type = "error", "invalid_request"  # (no error code: the protocol's v3 has one)
        final.error = f"the job's result would take about {size / 2**20:.0f} MB, past --max-result-bytes"
    # A failure RQ will retry is not the job's end (as the batch worker has it): no final event, no completion entry;
    # the next attempt resumes from what this one streamed.
    retrying = (final.retryable or final.timed_out) and (job.retries_left or 0) > 0
    if final.finish_reason == "error":
        result = None  # RQ records the failure it raises
        if not retrying:
            publisher.add(
                stream, final.text, final.token_ids, "error", usage(final.output) if final.output else {}, final.error,
                error_type=final.error_type, logprobs=final.logprobs, error_code=final.error_code, index=final.index,
            )  # fmt: skip
    else:
        result = build_result(
            job, req, final.output, model=settings.model_name, started_at=started_at, first_token_at=first_token_at,
            fingerprint=system_fingerprint(settings, getattr(engine, "numerics", "")),
        )  # fmt: skip
        publisher.add(
            stream, final.text, final.token_ids, final.finish_reason, usage(final.output), index=final.index,
            logprobs=final.logprobs, stop_reason=final.stop_reason,
        )  # fmt: skip
    with job.connection.pipeline(transaction=False) as pipe:
        publisher.flush(pipe)
        if not (final.finish_reason == "error" and retrying):
            publisher.notify(pipe, job.id, req.notify)
        pipe.execute()
    if final.finish_reason == "error":
        if not (final.retryable or final.timed_out):  # refused by the engine (a prompt too long): it would be again
            job.retries_left = None
        raise (StepFailed if final.retryable else JobTimedOut if final.timed_out else JobRejected)(final.error)
    return result  # RQ stores it once this returns: a stock worker writes the result after the last event
