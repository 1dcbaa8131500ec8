"""The worker's core, with no Redis in it: it holds the jobs in flight, admits them into the engine, steps the
engine, and turns what each step produced into one event per job; cancels and deadlines apply here.

``BatchWorker`` (many RQ jobs in one engine) and ``worker.jobs.generate`` (one job on a stock RQ worker) are
adapters over it: they bring jobs in and carry events out. Whatever one job does fails that job: a prompt the
engine refuses or that breaks its tokenizer, a deadline passed. An exception inside a step cannot be pinned on one
job, so every job of that step fails with a retryable event, and the pump goes on with the rest.
"""

from __future__ import annotations

import copy
import heapq
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("roseinfer.worker")

# A step that fails fails its jobs (retryably) and the engine goes on; this many in a row, each with the jobs the one
# before left, and the engine is taken for broken (a sticky CUDA error fails every step): the worker stops, its
# other jobs handed back, for its supervisor to start it again. Going on, it took the queue's jobs one step at a time
# and spent a retry of each.
MAX_FAILED_STEPS = 3
# A job past its timeout's length that has not had a step yet is looked at again this often (its clock starts then).
START_POLL_S = 0.1


class EngineBroken(RuntimeError):
    """Engine steps keep failing: the engine cannot serve (``MAX_FAILED_STEPS``)."""


@dataclass(slots=True)
class JobEvent:
    """What one step (or a cancel, a failure) produced for one job."""

    job_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, abort (canceled) or error; None while the job runs
    output: Any = None  # the engine's RequestOutput, on a final event that has one
    error: str | None = None
    retryable: bool = False  # an error another attempt may not meet (a failed step), not one about the job itself
    timed_out: bool = False  # the job ran past its deadline
    restarted: bool = False  # the engine could not resume the job's output: it starts over (streams say so)
    index: int = 0  # the sample the text and token ids belong to (jobs with n > 1)
    error_type: str | None = None  # an error's fault: invalid_request (the job itself), timeout or server_error
    error_code: str | None = None  # what the error is, for clients to act on: context_length_exceeded
    logprobs: list[dict[int, float]] | None = None  # one per token id, for a job that asked for them
    sample_end: str | None = None  # n > 1: sample ``index`` ended here (its own reason) while the others go on
    stop_reason: int | str | None = None  # with an end: the stop string or token id that ended it (vLLM's)
    prompt_tokens: int | None = None  # the prompt's length, on a step's events (for usage on every event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def delta_logprobs(out: Any) -> list[dict[int, float]] | None:
    """The logprobs of an output's delta token ids (the last of its sample's), None for a request without them."""
    num = len(out.delta_token_ids)
    for c in out.outputs:
        if c.index == out.delta_index:
            return c.logprobs[len(c.logprobs) - num :] if c.logprobs is not None and num else None
    return None


def _code_of(exc: Exception) -> str | None:
    """The error code an engine's refusal names (``ContextLengthExceeded.code``), if any."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else None


@dataclass
class _Job:
    prompt: Any
    params: Any
    deadline: float | None  # time.monotonic() after which the job fails (or its start is looked for again)
    output_prefix: list[int] | None = None  # what an earlier attempt generated: the output resumes from there
    priority: int = 0
    tokenized: _Tokenized | None = None  # prompt token ids, computed off the step loop
    admitted: bool = False
    prefix_logprobs: list[dict[int, float]] | None = None  # the prefix's, for a job asking for logprobs
    timeout: float | None = None  # its seconds from its first engine step (RQ's job_timeout)


@dataclass
class _Tokenized:
    """One job's place in a batch of prompts tokenized off the step loop."""

    batch: Future
    index: int

    def done(self) -> bool:
        return self.batch.done()

    def result(self) -> tuple[str | None, list[int]]:
        found = self.batch.result()[self.index]
        if isinstance(found, Exception):
            raise found
        return found


class Pump:
    def __init__(self, engine: Any, tokenize_in_thread: bool = True) -> None:
        self.engine = engine
        self._jobs: dict[str, _Job] = {}
        # Tokenizing a long prompt takes milliseconds to seconds: a thread keeps it off the step loop. It has a
        # tokenizer of its own: a Rust tokenizer borrowed by two threads at once can raise "Already borrowed".
        self._pool: ThreadPoolExecutor | None = None
        self._thread_tokenizer = None
        self._untokenized: list[_Job] = []  # submitted since the last step: tokenized together, in one batch
        # Kept apart so that a step looks only at what changed, not at every job in flight.
        self._waiting: dict[str, _Job] = {}  # not admitted into the engine yet
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, job id); ended jobs left to drop
        self.failure: str | None = None  # never set here: an engine in this process cannot die apart from it
        self._step_times: list[float] = []
        self._failed_in_a_row = 0  # engine steps that failed since the last that did not
        # Called after each job a step admits: admissions are progress too (a resumed seeded job replays its draws:
        # on a CPU, milliseconds a token), so a step watchdog counts from the last one, not from the step's start.
        self.on_admitted: Callable[[], None] | None = None
        if tokenize_in_thread and getattr(engine, "tokenizer", None) is not None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="roseinfer-tokenize")
            self._thread_tokenizer = copy.deepcopy(engine.tokenizer)

    @property
    def numerics(self) -> str:
        """The engine's part of a seeded output's fingerprint (``LLMEngine.numerics``)."""
        return getattr(self.engine, "numerics", "")

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def submit(
        self,
        job_id: str,
        prompt: Any,
        params: Any,
        timeout: float | None = None,
        output_prefix: list[int] | None = None,
        priority: int = 0,
        tokenized: _Tokenized | None = None,
        prefix_logprobs: list[dict[int, float]] | None = None,
    ) -> None:
        """Take a job: ``prompt`` as ``LLMEngine.add_request`` takes it, ``params`` its SamplingParams,
        ``output_prefix`` the tokens an earlier attempt already streamed (``prefix_logprobs`` their logprobs, for a
        job asking for them), ``priority`` lower first, ``tokenized`` what ``tokenize_ahead`` gave for its prompt.
        Its admission (or its failure) shows in a later ``step()``; a prefix the engine refuses (a shorter context
        here, say) makes the job start over, with a ``restarted`` event."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id!r} is already in flight")
        deadline = None if timeout is None else time.monotonic() + timeout
        job = _Job(prompt, params, deadline, output_prefix or None, priority, tokenized)
        job.prefix_logprobs, job.timeout = prefix_logprobs, timeout
        if self._pool is not None and tokenized is None:
            self._untokenized.append(job)
        self._jobs[job_id] = job
        self._waiting[job_id] = job
        if deadline is not None:
            self._arm(job_id, job, deadline)

    def _arm(self, job_id: str, job: _Job, deadline: float) -> None:
        job.deadline = deadline
        heapq.heappush(self._deadlines, (deadline, job_id))
        if len(self._deadlines) > 2 * len(self._jobs) + 64:  # mostly jobs that ended: keep the live ones
            self._deadlines = [(d, j) for d, j in self._deadlines if j in self._jobs]
            heapq.heapify(self._deadlines)

    def tokenize_ahead(self, prompts: list[Any]) -> list[_Tokenized] | None:
        """Start tokenizing the prompts of jobs not submitted yet, from any thread (the puller, while it marks them
        started); each result goes to ``submit``. None where this pump tokenizes on its step loop."""
        if self._pool is None or not prompts:
            return None
        batch = self._pool.submit(self.engine.tokenize_many, prompts, self._thread_tokenizer)
        return [_Tokenized(batch, i) for i in range(len(prompts))]

    def _tokenize_submitted(self) -> None:
        """The prompts submitted since the last step, to the tokenizer thread as one batch."""
        jobs, self._untokenized = self._untokenized, []
        for job, tokenized in zip(jobs, self.tokenize_ahead([j.prompt for j in jobs]) or ()):
            job.tokenized = tokenized

    def cancel(self, job_id: str, reason: str | None = None) -> list[JobEvent]:
        """End a job now (canceled: finish ``abort``; with ``reason``: failed, finish ``error``), freeing its
        blocks. Returns its last events, the final one last ([] if it is not here): a job with n > 1 may first
        have a piece of each sample's text not sent yet."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return []
        self._waiting.pop(job_id, None)
        outs = self.engine.abort_request(job_id) if job.admitted else []
        finish = "abort" if reason is None else "error"
        if not outs:
            return [JobEvent(job_id, finish_reason=finish, error=reason)]
        # What it made since its last event (a step with flush=False holds it in the engine) ends with it.
        *pieces, out = outs
        events = [
            JobEvent(job_id, p.delta_text, p.delta_token_ids, index=p.delta_index, logprobs=delta_logprobs(p))
            for p in pieces
        ]
        last = JobEvent(job_id, out.delta_text, out.delta_token_ids, finish, out, reason, index=out.delta_index)
        last.logprobs = delta_logprobs(out)
        return [*events, last]

    def cancel_many(self, job_ids: list[str], reason: str | None = None) -> dict[str, list[JobEvent]]:
        """``cancel`` of each job here; the events by job id."""
        ended = {job_id: self.cancel(job_id, reason) for job_id in job_ids}
        return {job_id: events for job_id, events in ended.items() if events}

    def step(self, flush: bool = True) -> list[JobEvent]:
        """Admit the jobs whose prompts are ready, run one engine step, apply deadlines; the events of it all.
        ``flush=False``: a running job's new text may wait for a later step (its first piece and its end never
        do), as the engine's ``step`` takes it: a caller that sends events every few steps passes True then."""
        self._tokenize_submitted()
        events = self._admit()
        if self.engine.has_unfinished_requests():
            events += self._run_step(flush)
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, job_id = heapq.heappop(self._deadlines)
            job = self._jobs.get(job_id)
            if job is None or job.deadline != deadline:  # ended already (or a new job under the same id)
                continue
            # The timeout counts the job's running time from its first step, as RQ's from a job's start: not its
            # wait for a place in the batch behind max_num_seqs, nor for one again once preempted (looked for again
            # shortly until it has one).
            began = self.engine.running_since(job_id) if job.admitted else None
            if began is None or began + job.timeout > now:
                self._arm(job_id, job, now + START_POLL_S if began is None else began + job.timeout)
                continue
            ended = self.cancel(job_id, "the job exceeded its timeout")
            ended[-1].timed_out, ended[-1].error_type = True, "timeout"
            events += ended
        return events

    def has_work(self) -> bool:
        return bool(self._jobs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ----- inside a step ------------------------------------------------------------------------------
    def _admit(self) -> list[JobEvent]:
        events = []
        for job_id, job in list(self._waiting.items()):
            if self._pool is not None and (job.tokenized is None or not job.tokenized.done()):
                continue
            del self._waiting[job_id]
            try:
                prompt = job.prompt
                if job.tokenized is not None:
                    text, token_ids = job.tokenized.result()
                    prompt = (
                        {"prompt_token_ids": token_ids}
                        if text is None
                        else {"prompt_token_ids": token_ids, "prompt": text}
                    )
                if job.output_prefix:
                    try:
                        resume = {"output_prefix": job.output_prefix, "priority": job.priority}
                        if job.prefix_logprobs is not None:
                            resume["prefix_logprobs"] = job.prefix_logprobs
                        self.engine.add_request(job_id, prompt, job.params, **resume)
                    except ValueError as exc:
                        log.warning("job %s cannot resume its earlier output (%s): it starts over", job_id, exc)
                        self.engine.add_request(job_id, prompt, job.params, priority=job.priority)
                        events.append(JobEvent(job_id, restarted=True))
                else:
                    self.engine.add_request(job_id, prompt, job.params, priority=job.priority)
                job.admitted = True
                if self.on_admitted is not None:
                    self.on_admitted()
            except (ValueError, TypeError) as exc:  # the engine's own words about this prompt
                del self._jobs[job_id]
                events.append(
                    JobEvent(
                        job_id, finish_reason="error", error=str(exc), error_type="invalid_request",
                        error_code=_code_of(exc),
                    )
                )  # fmt: skip
            except Exception as exc:  # an engine or tokenizer bug on this one job: it fails, the rest go on
                log.exception("job %s: the engine could not take it", job_id)
                del self._jobs[job_id]
                error = f"the engine could not take this job: {type(exc).__name__}: {exc}"
                events.append(JobEvent(job_id, finish_reason="error", error=error, error_type="server_error"))
        return events

    def unsent(self) -> list[str]:
        """``EngineProcess.unsent``: none here (a submit reaches the engine at once)."""
        return []

    def pending_events(self) -> list[JobEvent]:
        """``EngineProcess.pending_events``: none here (a step's events are handed out as it ends)."""
        return []

    def take_step_times(self) -> list[float]:
        """Seconds of each engine step run since the last call (the step histogram's)."""
        times, self._step_times = self._step_times, []
        return times

    def _run_step(self, flush: bool) -> list[JobEvent]:
        began = time.perf_counter()
        try:
            outputs = self.engine.step(flush=flush)
            self._step_times.append(time.perf_counter() - began)
        except Exception as exc:
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= MAX_FAILED_STEPS:
                raise EngineBroken(
                    f"{self._failed_in_a_row} engine steps in a row failed, each with other jobs (the last: "
                    f"{type(exc).__name__}: {exc}): the engine is broken (a sticky accelerator error?)"
                ) from exc
            # Jobs the step before ended get their final events; those this one ran fail.
            return self._events_of(self.engine.take_undelivered()) + self._step_failed(exc)
        self._failed_in_a_row = 0
        return self._events_of(outputs)

    def _events_of(self, outputs: list[Any]) -> list[JobEvent]:
        events = []
        for out in outputs:
            if out.request_id not in self._jobs:
                continue
            # A job ends with its last sample; its finish reason is sample 0's (each sample's is in the output).
            reason = out.outputs[0].finish_reason if out.finished else None
            if out.finished:
                del self._jobs[out.request_id]
            aborted = next((o for o in out.outputs if o.finish_reason == "abort"), None) if out.finished else None
            if aborted is not None:  # the engine ended a sample itself (a cancel takes the job out of this pump first)
                events.append(_refused_by_grammar(out, aborted.abort_cause))  # (any sample: one of n said "stop")
                continue
            events.append(
                JobEvent(
                    out.request_id,
                    out.delta_text,
                    out.delta_token_ids,
                    reason,
                    out if out.finished else None,
                    index=out.delta_index,
                    logprobs=delta_logprobs(out),
                    sample_end=None if out.finished else out.outputs[0].finish_reason,
                    prompt_tokens=len(out.prompt_token_ids),
                    # (a sample's piece holds it alone; the job's end, sample 0's, as its finish reason)
                    stop_reason=out.outputs[0].stop_reason if out.finished or out.outputs[0].finish_reason else None,
                )
            )
        return events

    def _step_failed(self, exc: Exception) -> list[JobEvent]:
        """The culprit cannot be named: every job the engine was running fails, retryably; waiting ones go on."""
        running = [job_id for job_id in self.engine.running_request_ids() if job_id in self._jobs]
        log.error("an engine step failed (%s: %s); failing its %d jobs", type(exc).__name__, exc, len(running))
        events = []
        for job_id in running:
            ended = self.cancel(job_id, f"the engine step running this job failed: {type(exc).__name__}: {exc}")
            ended[-1].retryable, ended[-1].error_type = True, "server_error"
            events += ended
        return events


def _refused_by_grammar(out: Any, cause: Any) -> JobEvent:
    """A job the engine aborted on its own: its structured output could go no further (a schema or pattern no
    text completes: the request's fault, as a schema refused up front), or refused a token the model chose (a
    tokenizer whose end token the grammar library does not know, say: the server's). It failed as a job its client
    canceled: a canceled result, RQ's status left "started" for good, a batch waiting on it for a day."""
    retryable = cause is not None and cause.limit
    if retryable:  # (an earlier job of the same constraint used up the grammar library's budget: compiled afresh)
        error = f"the job's structured output passed the grammar library's limits ({cause.why})"
        fault = "server_error"
    elif cause is not None and cause.dead_end:
        error = (
            f"the job's structured output reached a dead end: no text completes its schema or pattern ({cause.why}); "
            "not retried"
        )
        fault = "invalid_request"
    else:
        error = (
            "the job's structured output refused the token the model produced (the grammar library and the "
            "model's tokenizer disagree; the worker's log says more): not retried"
        )
        fault = "server_error"
    return JobEvent(
        out.request_id, out.delta_text, out.delta_token_ids, "error", out, index=out.delta_index,
        error=error, error_type=fault, logprobs=delta_logprobs(out), retryable=retryable,
    )  # fmt: skip
